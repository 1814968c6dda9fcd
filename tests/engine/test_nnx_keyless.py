"""A Dropout built without rngs (`nnx.Dropout(rate)`, spec `rngs: false`) and keys given to a Dropout's call
(`drop(x, rngs=key)`, spec `call: {name: drop, key: K}`), FLAX_NNX_RULES.md §4: a call-time key wins and is used
as it is. Real NNX is the oracle: the mask each call drops must be the one derive's key draws, and no stream may
draw. The `keyless_dropout` collision class: the same key given at every call."""

from __future__ import annotations

import pytest
from nnx_oracle import assert_one_error_line, check_against_nnx
from nnx_oracle import nnx_spec as spec_of
from nnx_oracle import write_nnx_spec as write_spec
from support import invoke

from rngaudit import FlaxError, derive
from rngaudit.collision.nnx import audit_nnx


def model(key: str, rngs: str = "rngs: false", steps: int = 3) -> str:
    return f"""
    rngs: {{params: 0, dropout: 1}}
    steps: {steps}
    model:
      class: M
      keep_rngs: true
      init:
        - Linear: {{name: lin}}
        - Dropout: {{name: drop, rate: 0.5, {rngs}}}
      call:
        - call: lin
        - call: {{name: drop, key: {key}}}
        - draw: dropout
    """


def test_the_same_key_at_every_call_is_keyless_dropout():
    text = model("7")
    got = check_against_nnx(spec_of(text))
    assert got["given"] == 3  # three masks NNX dropped, each the one key(7) draws
    (c,) = audit_nnx(spec_of(text)).collisions
    assert c.category == "keyless_dropout" and c.failing and [s.step for s in c.sites] == [1, 2, 3]
    assert "drop(x, rngs=key)" in c.why and "count" not in c.why.split(";")[0]
    r = invoke("collisions", write_spec(text))
    assert r.exit_code == 1 and "FAIL  keyless_dropout" in r.stdout


def test_a_key_given_to_a_dropout_built_with_rngs_wins_and_its_stream_draws_nothing():
    text = model('"fold_in(key(3), 1)"', rngs="rngs: true")
    got = check_against_nnx(spec_of(text))
    # the Dropout's fork at construction is its only draw from its own stream
    report = derive(spec_of(text))
    assert [c.derivation.kind for c in report.calls if c.derivation.site == "drop"] == ["fork"] + ["dropout"] * 3
    assert got["given"] == 3 and audit_nnx(spec_of(text)).collisions[0].category == "keyless_dropout"


def test_one_call_with_a_given_key_is_no_finding():
    text = model("7", steps=1)
    check_against_nnx(spec_of(text))
    assert audit_nnx(spec_of(text)).collisions == ()


def test_a_keyless_dropout_called_without_a_key_is_nnx_s_value_error():
    text = """
    rngs: {params: 0, dropout: 1}
    model:
      class: M
      init: [{Dropout: {name: drop, rate: 0.5, rngs: false}}]
      call: [call: drop]
    """
    assert check_against_nnx(spec_of(text)) == {"error": "ValueError"}
    with pytest.raises(FlaxError, match="no `rngs` argument was provided to Dropout"):
        derive(spec_of(text))


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "model: {class: M, init: [{Linear: {name: l}}], call: [{call: {name: l, key: 1}}]}",
            "l is not a Dropout",
        ),
        (
            "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, key: 1, vmap: 2}}]}",
            "under nnx.vmap/nnx.scan is not modelled",
        ),
        (
            "flax: {version: '0.10.2'}\n"
            + "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, key: 1}}]}",
            "flax 0.11 and later",
        ),
        (
            "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, key: 1.5}}]}",
            "a key must be",
        ),
        ("model: {class: M, init: [{Dropout: {name: d, rate: 0.5, rngs: 0}}]}", "`rngs` must be true or false"),
        (
            "model: {class: M, init: [{Linear: {name: l}}], call: [{call: {name: l, deterministic: true}}]}",
            "and l is neither",
        ),
        (
            "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, deterministic: 1}}]}",
            "`deterministic` must be true or false",
        ),
    ],
)
def test_bad_given_keys_are_one_error_line(tmp_path, text, message):
    assert_one_error_line(tmp_path, text, message)


# ---------------------------------------------------------------- an Rngs given at the call: drop(x, rngs=rngs)
# The Flax "Randomness" guide's pattern: model(x, rngs) with `rngs = nnx.Rngs(dropout=1)` made once, the model
# handing it to its Dropouts (spec `call_rngs:` and `call: {name: drop, rngs: call}`); Dropout draws
# rngs[rng_collection]() from it, its own stream (if any) drawing nothing.
def agreed(text: str):
    """derive's report of an NNX spec, once real NNX is seen to hand out the same keys."""
    got = check_against_nnx(spec_of(text))
    report = derive(spec_of(text))
    assert got["keys"] == len(report.calls)
    return report


def given_rngs(call_rngs: str = "{dropout: 7}", own: str = "rngs: false", run: str = "steps: 3") -> str:
    return f"""
    rngs: {{params: 0, dropout: 1}}
    call_rngs: {call_rngs}
    {run}
    model:
      class: M
      init:
        - Linear: {{name: lin}}
        - Dropout: {{name: drop, rate: 0.5, {own}}}
        - Dropout: {{name: other, rate: 0.5}}
        - module:
            name: block
            class: B
            init: [{{Dropout: {{name: drop, rate: 0.2, rngs: false}}}}]
            call: [{{call: {{name: drop, rngs: call, repeat: 2}}}}]
      call:
        - call: {{name: drop, rngs: call}}
        - call: other
        - call: block
    """


@pytest.mark.parametrize(
    "text",
    [
        given_rngs(),
        given_rngs(own="rngs: true"),  # the call's Rngs wins over the Dropout's own fork
        given_rngs(call_rngs="{default: 3}"),  # rngs['dropout'] falls back to default
        given_rngs(call_rngs="{dropout: 7, noise: 2}", run="run: [call, {reseed: {dropout: 4}}, call]"),
    ],
    ids=["keyless", "own-fork", "default", "reseed-leaves-it"],
)
def test_an_rngs_given_at_the_call_draws_what_nnx_draws(text):
    got = check_against_nnx(spec_of(text))
    report = derive(spec_of(text))
    given = [c for c in report.calls if c.derivation.stream.startswith("call_rngs.")]
    # each step: drop once, block.drop twice, from one counter that carries on from step to step
    assert got["keys"] == len(report.calls) and len(given) == 3 * report.spec.steps
    assert [c.derivation.count for c in given] == list(range(len(given)))


def test_the_rngs_the_model_is_built_from_given_at_the_call_carries_its_counts_on():
    """The guide's own model: Model(rngs) and then model(x, rngs=rngs) with the same Rngs (`rngs: model`): the
    Dropout draws from the dropout stream construction drew from, its counts carrying on."""
    text = """
    rngs: {params: 0, dropout: 1}
    steps: 3
    model:
      class: M
      init:
        - Linear: {name: lin}
        - Dropout: {name: fork, rate: 0.5}
        - Dropout: {name: drop, rate: 0.1, rngs: false}
      call:
        - call: {name: drop, rngs: model}
        - call: fork
    """
    got = check_against_nnx(spec_of(text))
    report = derive(spec_of(text))
    drawn = [(c.derivation.site, c.derivation.stream, c.derivation.count) for c in report.calls]
    assert got["keys"] == len(drawn) == 2 + 1 + 3 * 2
    # the fork drew count 0 of rngs.dropout at construction: the calls' draws from it go on at 1, 2, 3
    assert [d for d in drawn if d[0] == "drop"] == [("drop", "rngs.dropout", n) for n in (1, 2, 3)]


def test_an_rngs_given_at_the_call_without_the_stream_is_nnx_s_key_error():
    text = given_rngs(call_rngs="{noise: 3}")
    assert check_against_nnx(spec_of(text)) == {"error": "KeyError"}
    with pytest.raises(FlaxError, match="No RngStream named 'dropout'"):
        derive(spec_of(text))


def test_a_call_rngs_seeded_like_a_model_stream_re_emits_its_keys():
    text = given_rngs(call_rngs="{dropout: 1}", own="rngs: true")
    check_against_nnx(spec_of(text))
    # the two Dropouts' forks at construction (dropout counts 0 and 1) come again at step 1's two first draws
    found = audit_nnx(spec_of(text)).collisions
    assert [(c.category, c.failing) for c in found] == [("shared_stream_key", True)] * 2
    assert [[(s.stream_path, s.step, s.count) for s in c.sites] for c in found] == [
        [("rngs.dropout", 0, 0), ("call_rngs.dropout", 1, 0)],
        [("rngs.dropout", 0, 1), ("call_rngs.dropout", 1, 1)],
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, rngs: call}}]}",
            "say what it holds with a top-level `call_rngs:",
        ),
        (
            "call_rngs: {dropout: 1}\n"
            + "model: {class: M, init: [{Linear: {name: l}}], call: [{call: {name: l, rngs: call}}]}",
            "l is not a Dropout",
        ),
        (
            "call_rngs: {dropout: 1}\n"
            + "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, rngs: self}}]}",
            "`rngs` of a call is `call`",
        ),
        (
            "call_rngs: {dropout: 1}\n"
            + "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, rngs: call, key: 1}}]}",
            "`rngs: call` or `key:`, not both",
        ),
        (
            "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, rngs: model}}]}\n"
            + "run: [{call: {vmap: 2}}]",
            "not under stale_call, lazy_init, fork_rngs or a transform",
        ),
        (
            "call_rngs: {dropout: 1}\nmodel: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], "
            + "call: [{cond: {pred: true, true_fun: [{call: {name: d, rngs: call}}], false_fun: []}}]}",
            "inside nnx.cond, nnx.switch or a loop",
        ),
        (
            "call_rngs: {dropout: 1}\nrun: [stale_call]\n"
            + "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, rngs: call}}]}",
            "not under stale_call",
        ),
        ("call_rngs: 3\nmodel: {class: M}", "`call_rngs` is the nnx.Rngs given to every call"),
        ("call_rngs: [{dropout: 1}, 2]\nsteps: 2\nmodel: {class: M}", "or a list of them, one a step"),
        ("call_rngs: [{dropout: 1}]\nsteps: 2\nmodel: {class: M}", "lists 1 Rngs, one a step, and the spec makes 2"),
        (
            "call_rngs: [{dropout: 1}]\nrun: [stale_call]\n"
            + "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, rngs: call}}]}",
            "not under stale_call",
        ),
    ],
)
def test_bad_call_rngs_are_one_error_line(tmp_path, text, message):
    assert_one_error_line(tmp_path, text, message)


# ---------------------------------------------------------------- an Rngs made for each step
# Flax's lm1b_nnx example: each training step gives the model nnx.Rngs(dropout=jax.random.fold_in(rng, step)),
# a new Rngs (counts from 0) from a new key. The spec's `call_rngs:` is then a list, one Rngs a step.
def step_rngs(keys: list[str | None], run: str) -> str:
    listed = "".join(
        "\n      - null" if k is None else f"\n      - {{dropout: {k if k.isdigit() or k[0] == '[' else repr(k)}}}"
        for k in keys
    )
    return given_rngs(call_rngs=listed, run=run)


@pytest.mark.parametrize(
    "keys, run",
    [
        (["fold_in(key(7), 0)", "fold_in(key(7), 1)", "fold_in(key(7), 2)"], "steps: 3"),
        (["split(key(3))[0]", "[0, 9]"], "run: [call, {reseed: {dropout: 4}}, eval, call]"),
        (["7", "7"], "steps: 2"),  # the same key every step: the same masks again
        # an eval call given no Rngs (model(x)) between training steps given one: `null`
        (["fold_in(key(7), 0)", None, "fold_in(key(7), 2)"], "run: [call, eval, call, train, call]"),
    ],
    ids=["fold-in-step", "reseed-eval", "same-key", "eval-given-none"],
)
def test_an_rngs_made_for_each_step_draws_what_nnx_draws(keys, run):
    got = check_against_nnx(spec_of(step_rngs(keys, run)))
    report = derive(spec_of(step_rngs(keys, run)))
    given = [c.derivation for c in report.calls if c.derivation.stream.startswith("call_rngs.")]
    assert got["keys"] == len(report.calls) and given
    # each step's Rngs counts from 0: drop, then block.drop twice, in a step that draws
    assert {d.step for d in given} <= set(range(1, len(keys) + 1))
    for step in {d.step for d in given}:
        assert [d.count for d in given if d.step == step] == [0, 1, 2]


@pytest.mark.parametrize("keep", ["false", "true"])
@pytest.mark.parametrize("run", ["steps: 2", "run: [call, eval, call, train, call]"])
def test_attention_given_an_rngs_at_its_call_draws_rngs_dropout_as_nnx_does(keep, run):
    """att(x, rngs=rngs): MultiHeadAttention draws rngs.dropout() from the Rngs given (over its own fork, kept
    or not), when it has dropout_rate > 0 and is not deterministic."""
    text = f"""
    rngs: {{params: 0, dropout: 1}}
    call_rngs: {{dropout: 5}}
    {run}
    model:
      class: M
      init:
        - MultiHeadAttention: {{name: att, dropout_rate: 0.1, keep_rngs: {keep}}}
        - MultiHeadAttention: {{name: quiet, dropout_rate: 0.0}}
      call:
        - call: {{name: att, rngs: call, deterministic: false}}
        - call: {{name: att, rngs: model}}
        - call: {{name: quiet, rngs: call}}
    """
    got = check_against_nnx(spec_of(text))
    report = derive(spec_of(text))
    drawn = [(c.derivation.step, c.derivation.stream, c.derivation.count) for c in report.calls if c.derivation.step]
    assert got["keys"] == len(report.calls)
    # the call's deterministic=False draws in every step; given the model's Rngs it draws only in train mode
    assert [d for d in drawn if d[1] == "call_rngs.dropout"] == [
        (s, "call_rngs.dropout", i) for i, s in enumerate(range(1, report.spec.steps + 1))
    ]


@pytest.mark.parametrize("rate, deterministic", [(0.0, "false"), (0.5, "true")])
def test_attention_given_an_rngs_without_dropout_is_nnx_s_attribute_error_even_drawing_nothing(rate, deterministic):
    """MultiHeadAttention.__call__ reads rngs.dropout before it looks at its rate or mode (found by the random
    generator: derive gave keys where NNX raises)."""
    text = f"""
    rngs: {{params: 0}}
    call_rngs: {{noise: 1}}
    model:
      class: M
      init: [{{MultiHeadAttention: {{name: att, dropout_rate: {rate}, keep_rngs: false}}}}]
      call: [{{call: {{name: att, rngs: call, deterministic: {deterministic}}}}}]
    """
    assert check_against_nnx(spec_of(text)) == {"error": "AttributeError"}
    with pytest.raises(FlaxError, match="No RngStream named 'dropout'"):
        derive(spec_of(text))


def test_an_rngs_made_with_the_same_key_every_step_is_a_count_rewind():
    same = spec_of(step_rngs(["7", "7"], "steps: 2"))
    found = audit_nnx(same).collisions
    assert [(c.category, c.failing) for c in found] == [("count_rewind", True)] * 3
    assert [[(s.stream_path, s.step, s.count) for s in c.sites] for c in found] == [
        [("call_rngs.dropout", 1, n), ("call_rngs.dropout", 2, n)] for n in range(3)
    ]
    assert "an earlier step's held (the same key every step" in found[0].why
    assert "jax.random.fold_in(key, step)" in found[0].fix
    # folded in the step: none
    assert audit_nnx(spec_of(step_rngs(["fold_in(key(7), 0)", "fold_in(key(7), 1)"], "steps: 2"))).collisions == ()


# ---------------------------------------------------------------- modules built without an Rngs, dotted calls
# `Block(d)` with no rngs (a positional encoding, a LayerScale, an activation module, nnx.PReLU()): `rngs: none`.
# A layer of a submodule called from a method of that submodule (self.enc.encode(x) calling self.drop): the
# parent's call says it by its dotted name, `enc.drop`; NNX keys do not depend on who calls.
BUILT_WITHOUT_RNGS = """
rngs: {params: 0, dropout: 1}
call_rngs: {dropout: 3}
run: [call, eval, call, train, call]
model:
  class: M
  init:
    - Linear: {name: lin}
    - module:
        name: pe
        class: PE
        rngs: none
        init:
          - Dropout: {name: d, rate: 0.5, rngs: false}
          - module: {name: act, class: Act, rngs: none}
        call: [{call: {name: d, rngs: call}}, {call: act}]
    - module:
        name: enc
        class: Enc
        init:
          - Linear: {name: lin}
          - Dropout: {name: drop, rate: 0.5}
          - module: {name: inner, class: In, init: [{Dropout: {name: d, rate: 0.3}}], call: [{call: d}]}
    - Dropout: {name: drop, rate: 0.5}
  call:
    - call: pe
    - call: enc.drop
    - call: {name: enc.inner.d, repeat: 2}
    - call: enc.inner
    - call: drop
"""


def test_modules_built_without_an_rngs_and_dotted_calls_draw_what_nnx_draws():
    report = agreed(BUILT_WITHOUT_RNGS)
    drawn = [(c.derivation.step, c.derivation.site, c.derivation.count) for c in report.calls if c.derivation.step]
    # enc.inner.d: twice by its dotted name, once by enc.inner's own call, in steps 1 and 3 (2 is eval)
    assert [(s, n) for s, site, n in drawn if site == "enc.inner.d"] == [(1, 0), (1, 1), (1, 2), (3, 3), (3, 4), (3, 5)]
    assert [(s, n) for s, site, n in drawn if site == "pe.d"] == [(1, 0), (3, 1)]


@pytest.mark.parametrize(
    "init, call, message",
    [
        ("[{Linear: {name: l}}]", "[]", "PE is built without an Rngs (`rngs: none`), and its `init:` builds l"),
        ("[{Dropout: {name: d, rate: 0.5}}]", "[]", "holds only Dropouts built without rngs (`rngs: false`)"),
        ("[{module: {name: m, class: C}}]", "[]", "and modules built without one (`rngs: none`)"),
    ],
)
def test_what_a_module_built_without_an_rngs_cannot_build_is_one_error_line(tmp_path, init, call, message):
    text = f"model: {{class: M, init: [{{module: {{name: pe, class: PE, rngs: none, init: {init}, call: {call}}}}}]}}"
    assert_one_error_line(tmp_path, text, message)


@pytest.mark.parametrize(
    "call, message",
    [
        ("enc.nosuch", "`call: enc.nosuch`: M builds no attribute 'enc.nosuch'"),
        ("enc.drop.x", "builds no attribute 'enc.drop.x'"),
        ("s.d", "builds no attribute 's.d'"),  # (not into a stack's lanes)
    ],
)
def test_a_dotted_call_reaches_only_into_modules_built_as_modules(tmp_path, call, message):
    text = (
        "model: {class: M, init: [{module: {name: enc, class: E, init: [{Dropout: {name: drop, rate: 0.5}}]}}, "
        "{module: {name: s, class: S, stack: 2, init: [{Dropout: {name: d, rate: 0.5}}]}}], "
        f"call: [{{call: {call}}}]}}"
    )
    assert_one_error_line(tmp_path, text, message)


# ---------------------------------------------------------------- draws of a training step from the model's Rngs
# A diffusion training step draws its timesteps and noise from the Rngs the model keeps, outside the model's call
# (t = jax.random.randint(model.rngs.time(), ...), or in a loss method): `draw:` events of `run:`, whose rows are
# the next call's step.
RUN_DRAWS = """
rngs: {params: 0, dropout: 1, noise: 2, time: 3}
run: [{draw: time}, {draw: {stream: noise, repeat: 2}}, call, eval, {draw: noise}, {call: 2}, train, draw: time]
model:
  class: M
  keep_rngs: true
  init:
    - Linear: {name: lin}
    - Dropout: {name: drop, rate: 0.5}
  call:
    - call: drop
    - draw: noise
"""


def test_draws_of_a_training_step_from_the_models_rngs_are_what_nnx_draws():
    report = agreed(RUN_DRAWS)
    rows = [(c.derivation.step, c.derivation.stream, c.derivation.count) for c in report.calls if c.derivation.step]
    # noise counts carry on across the step's draws and the model's own; the last draw is the last step's
    assert [r for r in rows if r[1] == "rngs.noise"] == [(1, "rngs.noise", n) for n in range(3)] + [
        (2, "rngs.noise", 3),
        (2, "rngs.noise", 4),
        (3, "rngs.noise", 5),
    ]
    assert [r for r in rows if r[1] == "rngs.time"] == [(1, "rngs.time", 0), (3, "rngs.time", 1)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("run: [{draw: noise}, call]\nmodel: {class: M}", "the model keeps its Rngs (`keep_rngs: true` on `model:`)"),
        ("run: [{draw: 3}]\nmodel: {class: M, keep_rngs: true}", "`draw` in `run` is model.rngs.<stream>()"),
        ("run: [{draw: {stream: noise, n: 2}}]\nmodel: {class: M, keep_rngs: true}", "unknown key 'n'"),
        ("rngs: {params: 0}\nrun: [{draw: noise}]\nmodel: {class: M, keep_rngs: true}", "No RngStream named 'noise'"),
    ],
)
def test_bad_draw_events_are_one_error_line(tmp_path, text, message):
    if "RngStream" in message:
        with pytest.raises(FlaxError, match=message):
            derive(spec_of(text))
        assert check_against_nnx(spec_of(text)) == {"error": "AttributeError"}
        return
    assert_one_error_line(tmp_path, text, message)


# A VAE whose encoder keeps the Rngs it is given (shared with the model) and whose decoder keeps a fork: the
# model's call draws through a method of the encoder (self.enc.sample(x) drawing self.rngs.noise()), the training
# step from both submodules' Rngs (model.dec.rngs.noise()): `from:` names the module whose kept Rngs is drawn.
KEEPERS = """
rngs: {params: 0, dropout: 1, noise: 2}
run: [{draw: {stream: noise, from: dec}}, call, {draw: {stream: noise, from: enc, repeat: 2}}, {call: 2},
      {draw: {stream: noise, from: enc.inner}}]
model:
  class: VAE
  init:
    - module:
        name: enc
        class: Encoder
        keep_rngs: true
        init:
          - Linear: {name: mu}
          - module: {name: inner, class: Inner, rngs: fork, keep_rngs: true, init: [Linear: {name: l}]}
    - module:
        name: dec
        class: Decoder
        rngs: fork
        keep_rngs: true
        init: [Linear: {name: out}, Dropout: {name: drop, rate: 0.5}]
        call: [call: drop]
  call:
    - call: enc
    - draw: {stream: noise, from: enc}
    - draw: {stream: noise, from: enc.inner}
    - call: dec
"""


def test_draws_from_a_submodules_kept_rngs_are_what_nnx_draws():
    report = agreed(KEEPERS)
    rows = [
        (c.derivation.step, c.derivation.site.split(" ")[0], c.derivation.count)
        for c in report.calls
        if c.derivation.step
    ]
    # the encoder's Rngs is the model's: its noise counts run on across the call's and the step's draws (after the
    # two forks, enc.inner's and dec's, took counts 0 and 1); the decoder's and enc.inner's count on their own
    assert [r for r in rows if r[1] == "enc"] == [(1, "enc", 2), (2, "enc", 3), (2, "enc", 4), (2, "enc", 5)] + [
        (3, "enc", 6)
    ]
    assert [r for r in rows if r[1] == "dec"] == [(1, "dec", 0)]
    assert [r[2] for r in rows if r[1] == "enc.inner"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "run: [{draw: {stream: noise, from: enc}}]\nmodel: {class: M}",
            "names the module whose kept Rngs is drawn from (model.enc.rngs.noise()): there is no module 'enc'",
        ),
        (
            "run: [call]\nmodel: {class: M, init: [module: {name: enc, class: E}], call: [draw: {stream: n, from: enc}]}",
            "`draw: n` from enc is self.enc.rngs.n(): E keeps its Rngs (`keep_rngs: true` on module 'enc')",
        ),
        (
            "model: {class: M, init: [Linear: {name: enc}], call: [draw: {stream: n, from: enc}]}",
            "there is no module 'enc' built in `init:`",
        ),
        (
            "model: {class: M, keep_rngs: true, init: [draw: {stream: params, from: enc}]}",
            "in `init:` a draw is rngs.params() of the Rngs M is given (drop `from`)",
        ),
        (
            "model: {class: M, init: [module: {name: st, class: S, stack: 2}], call: [draw: {stream: n, from: st}]}",
            "`from: st` of a `draw`: st is a stack (`stack: 2`), whose members hold split Rngs",
        ),
        (
            "run: [{draw: {stream: noise, from: ''}}]\nmodel: {class: M, keep_rngs: true}",
            "`from:` names the submodule whose kept Rngs the draw is from",
        ),
    ],
)
def test_bad_draws_from_a_submodule_are_one_error_line(tmp_path, text, message):
    assert_one_error_line(tmp_path, text, message)


# A step whose call is given no Rngs (`null` in call_rngs) while its layers are not deterministic: as NNX's
# drop(x, rngs=None), each layer draws from its own stream, and one built without rngs is NNX's ValueError.
NULL_STEP = """
rngs: {params: 0, dropout: 1}
call_rngs: [{dropout: 7}, null, {dropout: 8}]
steps: 3
model:
  class: M
  init:
    - Linear: {name: lin}
    - Dropout: {name: drop, rate: 0.5}
    - MultiHeadAttention: {name: att, dropout_rate: 0.1}
    - Dropout: {name: keyless, rate: 0.5, rngs: false}
  call:
    - call: {name: drop, rngs: call}
    - call: {name: att, rngs: call}
    - call: {name: keyless, rngs: call, deterministic: DET}
"""


def test_a_step_given_no_rngs_draws_from_each_layers_own_stream_as_nnx_does():
    text = NULL_STEP.replace("DET", "true")
    report = agreed(text)
    rows = [(c.derivation.step, c.derivation.site, c.derivation.stream) for c in report.calls if c.derivation.step]
    assert [r for r in rows if r[0] == 2] == [(2, "drop", "drop.rngs"), (2, "att", "att.rngs")], rows
    assert {r[2] for r in rows if r[0] != 2} == {"call_rngs.dropout"}
    # the keyless Dropout, not deterministic, given no Rngs at step 2: NNX's ValueError
    bad = NULL_STEP.replace("DET", "false")
    with pytest.raises(FlaxError, match="no `rngs` argument was provided to Dropout"):
        derive(spec_of(bad))
    assert check_against_nnx(spec_of(bad)) == {"error": "ValueError"}
