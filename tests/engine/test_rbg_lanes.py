"""Values drawn inside a vmap with rbg keys, against real Flax (Linen and NNX): jax.vmap draws every lane's bits
from lane 0's key (jax's rng_bit_generator batching rule), so a lane's values are not a draw from its own key.
Every expectation is "the values real Flax drew" (tests/flax_oracle.py, tests/nnx_oracle.py) or a relation between
them; the keys themselves are the same as eagerly."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from flax_oracle import check_against_flax
from nnx_oracle import agree as agree_nnx

from rngaudit import SpecError, derive, parse_spec
from rngaudit.engine.draws import RBG_LANES, draw_values

IMPLS = ("rbg", "unsafe_rbg")


def linen(impl: str, model: str, rngs: str = "{params: 45}") -> str:
    body = textwrap.indent(textwrap.dedent(model).strip("\n"), "  ")
    return f"rngaudit: 1\njax: {{prng_impl: {impl}}}\nphase: init\nrngs: {rngs}\nmodel:\n{body}\n"


PARAM = """
    - param:
        name: w
        draw: {uniform: [2]}
"""

# a draw in one vmap, a Dense (its kernel's fan from the lane's shape, not the batch's) in nested vmaps, and
# a vmap inside a scan (each step its own vmap)
LINEN_MODELS = {
    "vmap": f"""
        class: M
        body:
          - vmap:
              module:
                class: B
                body:{textwrap.indent(PARAM, "                ")}
              axis_size: 3
              split_rngs: all
              variable_axes: {{all: 0}}
    """,
    "nested": """
        class: M
        body:
          - vmap:
              module:
                vmap:
                  module:
                    class: B
                    body:
                      - Dense: {features: 2}
                      - param:
                          name: w
                          draw: {normal: [2]}
                  axis_size: 2
                  split_rngs: all
                  variable_axes: {all: 0}
              axis_size: 3
              split_rngs: all
              variable_axes: {all: 0}
    """,
    "scan_of_vmap": f"""
        class: M
        body:
          - scan:
              module:
                vmap:
                  module:
                    class: B
                    body:{textwrap.indent(PARAM, "                    ")}
                  axis_size: 2
                  split_rngs: all
                  variable_axes: {{all: 0}}
              length: 2
              split_rngs: all
              variable_axes: {{all: 0}}
    """,
}


LINEN_CASES = [(impl, name) for impl in IMPLS for name in sorted(LINEN_MODELS)]
LINEN_CASES.remove(("unsafe_rbg", "nested"))  # refused: test_unsafe_rbg_splits_inside_a_vmap_are_refused


@pytest.mark.parametrize(("impl", "name"), LINEN_CASES)
def test_linen_vmap_draws_match_flax(impl, name):
    spec = parse_spec(linen(impl, LINEN_MODELS[name]))
    agreed = check_against_flax(spec)
    assert agreed.values == {"vmap": 3, "nested": 6, "scan_of_vmap": 4}[name], agreed
    # lanes do not draw from their own keys: lane 1's values are not what its key draws eagerly
    report = derive(spec)
    lane1 = next(c for c in report.calls if c.values is not None and c.derivation.lane[-1] == 1)
    assert not np.array_equal(lane1.values, draw_values(spec, lane1.key, lane1.draw))
    assert RBG_LANES in lane1.derivation.notes


def test_linen_fast_and_plain_paths_draw_alike():
    spec = parse_spec(linen("rbg", LINEN_MODELS["nested"]))
    fast, plain = derive(spec, engine="fast"), derive(spec, engine="plain")
    drawn = [(a.values, b.values) for a, b in zip(fast.calls, plain.calls, strict=True) if a.values is not None]
    assert len(drawn) == 6 and all(np.array_equal(a, b) for a, b in drawn)


def test_linen_filtered_rows_draw_as_in_the_whole_report():
    """--path/--limit select rows before keys are computed: a lane's values still come from its first lane."""
    spec = parse_spec(linen("rbg", LINEN_MODELS["vmap"]))
    whole = [c.values for c in derive(spec).calls]
    last = derive(spec, paths=["*"], limit=None).calls
    assert all(np.array_equal(a, c.values) for a, c in zip(whole, last, strict=True))
    one = derive(spec, limit=3).calls[2]
    assert np.array_equal(one.values, whole[2])


def test_linen_unsplit_stream_draws_the_same_in_every_lane():
    """A stream nn.vmap does not split gives every lane one key, unbatched: every lane draws alike."""
    model = LINEN_MODELS["vmap"].replace("split_rngs: all", "split_rngs: {params: false}")
    spec = parse_spec(linen("rbg", model))
    report = derive(spec)
    drawn = [c for c in report.calls if c.values is not None]
    assert len(drawn) == 3 and all(np.array_equal(c.values, drawn[0].values) for c in drawn)
    assert all(RBG_LANES not in c.derivation.notes for c in drawn)
    check_against_flax(spec)


def test_threefry_lanes_draw_from_their_own_keys():
    spec = parse_spec(linen("threefry2x32", LINEN_MODELS["nested"]))
    assert check_against_flax(spec).values == 6
    for c in derive(spec).calls:
        if c.values is not None:
            assert np.array_equal(c.values, draw_values(spec, c.key, c.draw))
            assert RBG_LANES not in c.derivation.notes


def test_derive_text_notes_the_rows(tmp_path):
    from typer.testing import CliRunner

    from rngaudit.cli import app

    f = tmp_path / "m.yaml"
    f.write_text(linen("rbg", LINEN_MODELS["vmap"]))
    out = CliRunner().invoke(app, ["derive", str(f)])
    assert out.exit_code == 0, out.output
    assert "lane 0's key" in " ".join(out.output.split())


# ---------------------------------------------------------------- NNX
NNX_STACK = """
    jax: {{prng_impl: {impl}}}
    rngs: {{params: 45, dropout: 3}}
    model:
      class: Model
      init:
        - module:
            name: blocks
            class: Block
            stack: 3
            init:
              - draw: {{stream: params, draw: {{uniform: [2]}}}}
              - Linear: {{name: lin}}
              - module:
                  name: noise
                  class: Noise
                  rngs: fork
                  keep_rngs: true
                  call:
                    - draw: {{stream: dropout, draw: {{normal: []}}}}
            call:
              - call: noise
      call:
        - call: {{name: blocks, vmap: true}}
        - call: {{name: blocks, scan: true}}
"""

NNX_VMAP_CALL = """
    jax: {{prng_impl: {impl}}}
    rngs: {{params: 0, dropout: 1}}
    model:
      class: Model
      keep_rngs: true
      init:
        - Linear: {{name: lin}}
      call:
        - draw: {{stream: dropout, draw: {{uniform: []}}}}
        - draw: {{stream: params, draw: {{uniform: []}}}}
    run:
      - call: {{n: 2, vmap: 3, split: [dropout]}}
"""


@pytest.mark.parametrize("impl", ("rbg", "threefry2x32"))
@pytest.mark.parametrize("text", [NNX_STACK, NNX_VMAP_CALL], ids=["stack", "vmap_call"])
def test_nnx_vmap_draws_match_nnx(impl, text):
    agreed = agree_nnx(textwrap.dedent(text.format(impl=impl)))
    assert agreed["values"] >= 6, agreed


# ---------------------------------------------------------------- unsafe_rbg: what rngaudit does not model
def test_jax_batches_unsafe_rbg_splits_and_folds_from_the_first_lane():
    """What the refusals below rest on: under jax.vmap an unsafe_rbg split of a batched key, and a fold_in of a
    batched count, are not the per-lane ones for lanes past the first (rbg's are)."""
    import jax

    for impl, per_lane in (("unsafe_rbg", False), ("rbg", True)):
        keys = jax.random.split(jax.random.key(3, impl=impl), 3)
        split = jax.random.key_data(jax.vmap(lambda k: jax.random.split(k, 2))(keys))
        eager = np.stack([jax.random.key_data(jax.random.split(keys[i], 2)) for i in range(3)])
        assert np.array_equal(split[0], eager[0])
        assert np.array_equal(split, eager) == per_lane
        counts = np.zeros(3, dtype=np.uint32)
        folded = jax.random.key_data(jax.vmap(jax.random.fold_in)(keys, counts))
        eager = np.stack([jax.random.key_data(jax.random.fold_in(keys[i], 0)) for i in range(3)])
        assert np.array_equal(folded, eager) == per_lane


def test_unsafe_rbg_splits_inside_a_vmap_are_refused():
    with pytest.raises(SpecError, match=r"unsafe_rbg keys split inside a vmap.*prng_impl: rbg") as e:
        derive(parse_spec(linen("unsafe_rbg", LINEN_MODELS["nested"])))
    assert e.value.location is not None and e.value.location.line == 14


@pytest.mark.parametrize("text", [NNX_STACK, NNX_VMAP_CALL], ids=["stack", "vmap_call"])
def test_unsafe_rbg_draws_in_nnx_vmap_lanes_are_refused(text):
    with pytest.raises(SpecError, match=r"unsafe_rbg keys drawn inside a vmap.*count"):
        derive(parse_spec("rngaudit: 1\nflavour: nnx\n" + textwrap.dedent(text.format(impl="unsafe_rbg"))))


def test_unsafe_rbg_outside_lanes_is_still_derived():
    """A single nn.vmap's split is of an unbatched key: exact, and compared with Flax above; NNX outside lanes too."""
    text = "rngaudit: 1\nflavour: nnx\njax: {prng_impl: unsafe_rbg}\nrngs: {params: 0}\nmodel:\n  class: M\n"
    text += "  init:\n    - Linear: {name: lin}\n"
    assert agree_nnx(text.split("\n", 2)[2])["keys"] == 2


@pytest.mark.parametrize("impl", ("rbg", "threefry2x32"))
def test_a_draw_with_a_zero_dimension_is_empty_without_laying_out_the_others(impl):
    """`uniform: [10000000, 0]` in 1,000 vmap lanes has no values: it is drawn as the empty array jax returns (its
    dtype and shape), without jax laying out 10,000,000 x 1,000 bits (it ran out of memory with rbg keys)."""
    from rngaudit.engine.draws import draw_values_lanes

    model = (
        "  vmap:\n    module: {class: B, body: [{param: {name: w, draw: {uniform: [%s, 0]}}}, "
        "{param: {name: b, draw: {bernoulli: {shape: [0, 3], p: 0.5}}}}]}\n"
        "    axis_size: %d\n    split_rngs: {params: true}\n    variable_axes: {params: 0}\n"
    )
    spec = parse_spec(f"rngaudit: 1\njax: {{prng_impl: {impl}}}\nrngs: {{params: 0}}\nmodel:\n" + model % (10**7, 1000))
    calls = derive(spec).calls
    assert len(calls) == 2000
    w = next(c.values for c in calls if c.derivation.label == "w")
    b = next(c.values for c in calls if c.derivation.label == "b")
    assert w.shape == (10**7, 0) and w.dtype == np.float32 and b.shape == (0, 3) and b.dtype == np.bool_
    # what jax itself draws for a small one, lanes included
    small = parse_spec(f"rngaudit: 1\njax: {{prng_impl: {impl}}}\nrngs: {{params: 0}}\nmodel:\n" + model % (4, 3))
    keys = np.asarray([c.key for c in derive(small).calls if c.derivation.label == "w"], dtype=np.uint32)
    import jax

    want = jax.vmap(lambda k: jax.random.uniform(k, (4, 0)))(jax.random.wrap_key_data(keys, impl=impl))
    draw = next(c.draw for c in derive(small).calls if c.derivation.label == "w")
    got = draw_values_lanes(small, keys, draw)
    assert got.shape == want.shape == (3, 4, 0) and got.dtype == want.dtype
