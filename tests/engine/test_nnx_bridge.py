"""Linen inside NNX: `ToNNX` statements (`bridge.ToNNX(linen_module, rngs=...)`) in NNX specs, against real Flax
(FLAX_NNX_RULES.md §13): the NNX keys (the fork at construction, one draw per stream at each call) are compared
with what NNX's RngStreams hand out, and the Linen keys inside with what Linen's Scope.make_rng hands out (the
Linen oracle's hooks, lifted transforms included)."""

from __future__ import annotations

import pytest
from nnx_oracle import agree, assert_one_error_line
from nnx_oracle import nnx_spec as spec_of
from nnx_oracle import write_nnx_spec as write_spec
from support import invoke

from rngaudit import FlaxError, derive

# the bridge guide's shape: a Linen encoder (Dense, Dropout) inside an NNX model, initialised in __init__
ENCODER = """
rngs: {params: 0, dropout: 1}
steps: 2
model:
  class: Model
  init:
    - Linear: {name: lin}
    - ToNNX:
        name: enc
        module: {class: Encoder, body: [{Dense: {features: 3}}, {Dropout: {rate: 0.5, deterministic: false}}]}
    - Dropout: {name: drop, rate: 0.5}
  call:
    - call: lin
    - call: enc
    - call: drop
"""


def test_a_linen_encoder_inside_an_nnx_model_is_bit_exact():
    got = agree(ENCODER)
    # construction: lin (2 params), the fork (2 streams), lazy_init's draws (2) and Linen's 3 keys, the Dropout
    # fork; each call: ToNNX's 2 draws, Linen's dropout key, the NNX Dropout's key
    assert got["keys"] == 2 + 2 + 2 + 1 + 2 * (2 + 1) and got["linen"] == 3 + 2


def test_the_linen_keys_fold_linen_hashes_into_the_key_each_call_drew():
    report = derive(spec_of(ENCODER))
    rows = [c.derivation for c in report.calls]
    kernel = next(d for d in rows if d.site == "enc.Dense_0.kernel")
    assert kernel.kind == "param" and kernel.step == 0 and kernel.linen.startswith("Linen param at /Dense_0 count 1")
    assert kernel.chain[-1] == "fold_in 0 (ToNNX init at enc)" and kernel.stream == "enc.to_nnx__rngs.params"
    masks = [d for d in rows if d.site == "enc.Dropout_0"]
    assert [(d.step, d.chain[-1]) for d in masks] == [
        (0, "fold_in 0 (ToNNX init at enc)"),
        (1, "fold_in 1 (ToNNX call at enc)"),
        (2, "fold_in 2 (ToNNX call at enc)"),
    ]
    out = invoke("derive", write_spec(ENCODER))
    assert out.exit_code == 0 and "Linen dropout at /Dropout_0 count 1" in out.stdout


@pytest.mark.parametrize(
    "rngs, module, extra",
    [
        # Rngs(0): the `default` stream is renamed `params`, and Linen's dropout falls back to params
        ("0", "{class: E, body: [{Dense: {features: 2}}, {Dropout: {rate: 0.5, deterministic: false}}]}", ""),
        # rngs=rngs.params(): ToNNX keeps Rngs(params=key); the Linen module draws only params
        ("{params: 3}", "{Dense: {features: 2}}", "rngs: key"),
        # a stream ToNNX's Rngs has and the Linen module never asks for still draws one key per call
        ("{params: 0, dropout: 1, noise: 2}", "{class: E, body: [{make_rng: noise}, {param: w}]}", ""),
        # standard Linen layers with children (attention), and make_rng draws with labels
        (
            "{params: 0, dropout: 1}",
            "{MultiHeadDotProductAttention: {num_heads: 1, dropout_rate: 0.3, deterministic: false}}",
            "",
        ),
    ],
)
def test_bridge_variants_agree_with_real_flax(rngs, module, extra):
    text = f"""
    rngs: {rngs}
    steps: 2
    model:
      class: M
      init:
        - ToNNX: {{name: enc, module: {module}{", " + extra if extra else ""}}}
      call:
        - call: enc
    """
    got = agree(text)
    assert got["keys"] > 0 and got["linen"] > 0


def test_scan_over_remat_blocks_inside_tonnx_agree_with_real_flax():
    """The Linen scan-over-layers Transformer stack (nn.scan(nn.remat(Block)) with dropout) wrapped for NNX."""
    got = agree(
        """
        rngs: {params: 0, dropout: 1}
        steps: 2
        model:
          class: M
          init:
            - ToNNX:
                name: stack
                module:
                  scan:
                    module:
                      remat:
                        module:
                          class: Block
                          body:
                            - Dense: {features: 2}
                            - Dropout: {rate: 0.1, deterministic: false}
                    length: 3
                    split_rngs: {params: true, dropout: true}
                    variable_axes: {params: 0}
          call:
            - call: stack
        """
    )
    assert got["linen"] > 3 * 3


def test_lazy_init_of_the_whole_model_initialises_at_the_call():
    text = """
    rngs: {params: 0, dropout: 1}
    run: [lazy_init, call, call]
    model:
      class: M
      init:
        - Dropout: {name: drop, rate: 0.5}
        - ToNNX: {name: enc, lazy_init: false, module: {class: E, body: [{Dense: {features: 2}}, {make_rng: dropout}]}}
      call:
        - call: drop
        - call: enc
    """
    got = agree(text)
    rows = [c.derivation for c in derive(spec_of(text)).calls]
    kernel = next(d for d in rows if d.site == "enc.Dense_0.kernel")
    assert kernel.step == 0 and got["linen"] == 3 + 1 + 1


def test_a_stale_step_repeats_the_bridge_keys_and_reseed_reaches_its_rngs():
    text = """
    rngs: {params: 0, dropout: 1}
    run: [stale_call: 2, call, reseed: {dropout: 7}, call]
    model:
      class: M
      init:
        - ToNNX: {name: enc, module: {class: E, body: [{make_rng: dropout}]}}
      call:
        - call: enc
    """
    agree(text)
    rows = [(c.derivation, c.key) for c in derive(spec_of(text)).calls if c.derivation.site == "enc.to_nnx__rngs"]
    by_step = {}
    for d, key in rows:
        by_step.setdefault(d.step, []).append(key)
    assert by_step[1] == by_step[2] == by_step[3] != by_step[4]


def test_called_before_lazy_init_is_flax_s_error():
    spec = spec_of(
        """
        rngs: 0
        model:
          class: M
          init:
            - ToNNX: {name: enc, lazy_init: false, module: {Dense: {features: 2}}}
          call:
            - call: enc
        """
    )
    with pytest.raises(FlaxError, match="before bridge.lazy_init"):
        derive(spec)


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {class: M, init: [{ToNNX: {name: e}}]}", "`ToNNX` needs `module`"),
        ("model: {class: M, init: [ToNNX]}", "`ToNNX` takes a mapping"),
        ("model: {class: M, init: [{ToNNX: {module: {Dense: {}}, rngs: split}}]}", "`rngs` of ToNNX is fork"),
        ("model: {class: M, call: [{ToNNX: {module: {Dense: {}}}}]}", "build it in `init:`"),
        (
            "model: {class: M, init: [{ToNNX: {name: e, module: {Dense: {}}}}], call: [{call: {name: e, vmap: 2}}]}",
            "under nnx.vmap or nnx.scan",
        ),
        ("flax: {version: '0.11.2'}\nmodel: {class: M, init: [{ToNNX: {module: {Dense: {}}}}]}", "flax 0.12"),
        ("model: {class: M, init: [{ToNNX: {module: {class: E, body: [{nosuch: 1}]}}}]}", "nosuch"),
        ("run: [{lazy_init: 2}]\nmodel: {class: M}", "`lazy_init` takes nothing"),
        ("run: [call, lazy_init]\nmodel: {class: M}", "comes first in `run`"),
    ],
)
def test_bad_bridge_statements_are_one_error_line(tmp_path, text, message):
    assert_one_error_line(tmp_path, text, message)


ENSEMBLE_IN_TONNX = """
rngs: {params: 0, dropout: 1}
model:
  class: M
  init:
    - ToNNX:
        name: ens
        module:
          vmap:
            module: {class: Member, body: [{Dense: {features: 2}}, {Dropout: {rate: 0.5, deterministic: false}}]}
            axis_size: 3
            split_rngs: {params: true, dropout: SPLIT}
            variable_axes: {params: 0}
  call:
    - call: ens
"""


@pytest.mark.parametrize("split", [False, True])
def test_a_linen_vmap_inside_tonnx_that_does_not_split_dropout_is_unsplit_lanes(split):
    from rngaudit.collision.nnx import audit_nnx

    text = ENSEMBLE_IN_TONNX.replace("SPLIT", str(split).lower())
    agree(text)  # the keys (the same mask in every lane, or not) are real Flax's
    found = audit_nnx(spec_of(text)).collisions
    if split:
        assert found == ()
    else:
        # the Linen init's and the call's masks: one key for the 3 lanes each, explained as Linen's unsplit lanes
        assert [(c.category, c.failing, len(c.sites)) for c in found] == [("unsplit_lanes", False, 3)] * 2
        assert all("does not split this stream" in c.why and "nnx.reseed" not in c.why for c in found)


def test_a_linen_concatenation_inside_tonnx_is_linen_s_failing_class_not_lanes():
    """ab/cdef and abc/def hash to the same bytes in Linen (class 1): inside a ToNNX as outside."""
    from rngaudit.collision.nnx import audit_nnx

    text = """
    rngs: {params: 0, dropout: 1}
    model:
      class: M
      init:
        - ToNNX:
            name: enc
            module:
              class: E
              body:
                - module: {class: Leaf, name: ab, body: [{module: {class: Leaf, name: cdef, body: [make_rng: dropout]}}]}
                - module: {class: Leaf, name: abc, body: [{module: {class: Leaf, name: def, body: [make_rng: dropout]}}]}
      call: [call: enc]
    """
    agree(text)  # the two keys are equal in real Flax
    found = audit_nnx(spec_of(text)).collisions
    assert [(c.category, c.failing) for c in found] == [("concatenation", True)] * 2
    assert all("same bytes" in c.why and "lifted transform" not in c.why for c in found)


def test_a_tonnx_called_twice_in_a_step_names_its_second_call_s_linen_sites():
    text = """
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: M
      init:
        - ToNNX: {name: enc, module: {class: E, body: [{Dense: {features: 2}}, {Dropout: {rate: 0.5, deterministic: false}}]}}
      call:
        - call: {name: enc, repeat: 2}
    """
    agree(text)
    sites = [c.derivation.site for c in derive(spec_of(text)).calls if c.derivation.linen and c.derivation.step == 1]
    assert sites == ["enc.Dropout_0", "enc#2.Dropout_0"]


def test_a_tonnx_of_a_linen_module_without_variables_needs_no_lazy_init():
    text = """
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: M
      init:
        - ToNNX: {name: drop, lazy_init: false, module: {Dropout: {rate: 0.5, deterministic: false}}}
      call: [call: drop]
    """
    got = agree(text)  # real NNX applies it on no variables
    assert got["linen"] == 2
