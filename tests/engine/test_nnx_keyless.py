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
    ],
)
def test_bad_given_keys_are_one_error_line(tmp_path, text, message):
    assert_one_error_line(tmp_path, text, message)
