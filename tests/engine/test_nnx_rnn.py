"""nnx.RNN and the recurrent cells in NNX specs (`RNN: {cell, rngs, broadcast, ...}` in `init:`, `call: {name,
length}`), against real Flax NNX (flax/nnx/nn/recurrent.py): every key derive prints is the key NNX hands out at
construction and in each call (initialize_carry's draws, nnx.split_rngs(splits=1, squeeze=True) of the broadcast
streams, the cell's draws in every step of the scan), and collisions tells a real shared carry key from keys
NNX hands out and never uses (a zeros carry)."""

from __future__ import annotations

import textwrap

import pytest
from nnx_oracle import agree, assert_one_error_line, nnx_keys, write_nnx_spec
from nnx_oracle import nnx_spec as spec_of
from support import invoke

from rngaudit import FlaxError, derive
from rngaudit.collision.nnx import audit_nnx

CELLS = ("LSTMCell", "OptimizedLSTMCell", "GRUCell", "SimpleCell")


def standard(cell: str, rngs: str, keep: bool, initial: bool = False, given: str = "") -> str:
    call = f"{{name: rnn, length: 3{', initial_carry: true' if initial else ''}{f', rngs: {given}' if given else ''}}}"
    return f"""
        rngs: {{params: 0, dropout: 1, carry: 2}}
        steps: 2
        model:
          class: Model
          init:
            - Linear: {{name: embed}}
            - RNN: {{name: rnn, cell: {{{cell}: {{keep_rngs: {str(keep).lower()}}}}}, rngs: {rngs}}}
            - Dropout: {{name: drop, rate: 0.5}}
          call:
            - call: {call}
            - call: drop
        """


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("rngs", ["own", "fork", "none"])
@pytest.mark.parametrize("keep", [False, True])
def test_standard_cells_hand_out_nnx_keys(cell, rngs, keep):
    got = agree(standard(cell, rngs, keep))
    if rngs == "none" and not keep:
        assert got == {"error": "ValueError"}  # RNGs must be provided to initialize the cell carry.
    else:
        carry = 2 if "LSTM" in cell else 1
        params = {"LSTMCell": 12, "OptimizedLSTMCell": 3, "GRUCell": 3, "SimpleCell": 3}[cell]
        forks = (rngs == "fork") + keep + 1  # the RNN's fork, the cell's keep_rngs fork, the Dropout's
        assert got["keys"] == 2 + params + forks + 2 * (carry + 1)


@pytest.mark.parametrize("given", ["model", "call"])
def test_an_rngs_given_to_the_call_is_forked_for_the_carry(given):
    text = standard("LSTMCell", "own", False, given=given)
    if given == "call":
        text = text.replace("steps: 2", "steps: 2\n        call_rngs: {carry: 7}")
    assert agree(text)["keys"] > 0
    rows = [c.derivation for c in derive(spec_of(text)).calls]
    carry = [d for d in rows if d.kind == "carry"]
    # rngs.carry.fork() at every call: each call's carry keys come from a new stream, counts from 0
    assert [d.count for d in carry] == [0, 1, 0, 1] and carry[0].chain != carry[2].chain


def test_initial_carry_draws_nothing_for_the_carry():
    text = standard("GRUCell", "own", False, initial=True)
    assert agree(text)["keys"] > 0
    assert not [c for c in derive(spec_of(text)).calls if c.derivation.kind == "carry"]


# a user cell with input dropout (carried: a new mask every step) and recurrent dropout (broadcast: one mask a
# sequence), the recurrent-dropout pattern of the NNX "Randomness" guide, run by nnx.RNN
USER = textwrap.dedent("""
    rngs: {params: 0, dropout: 1, recurrent_dropout: 4, carry: 2}
    steps: 3
    model:
      class: Model
      init:
        - RNN:
            name: rnn
            broadcast: recurrent_dropout
            carry_draws: 1
            cell:
              module:
                class: Cell
                init:
                  - Linear: {name: lin}
                  - Dropout: {name: drop, rate: 0.5}
                  - Dropout: {name: rdrop, rate: 0.5, rng_collection: recurrent_dropout}
                call: [{call: drop}, {call: rdrop}]
      call:
        - call: {name: rnn, length: 3}
    """)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {
            "    - call: {name: rnn, length: 3}": "    - call: {name: rnn, length: 3}\n    - call: {name: rnn, length: 2, rngs: model}"
        },
        {"    - call: {name: rnn, length: 3}": "    - call: {name: rnn, length: 2, initial_carry: true}"},
        {"          module:\n": "          module:\n            rngs: fork\n"},
        {"steps: 3": "run: [call, {reseed: {carry: 5, recurrent_dropout: 7}}, call]"},
        {"length: 3}": "length: 3, fork_rngs: true}"},
        {"length: 3}": "length: 3, fork_rngs: [recurrent_dropout]}"},
        {"broadcast: recurrent_dropout": "broadcast: [recurrent_dropout, dropout]"},
        {"        broadcast: recurrent_dropout\n": "        rngs: fork\n"},
    ],
)
def test_a_user_cell_with_recurrent_dropout_hands_out_nnx_keys(change):
    text = USER
    for old, new in change.items():
        assert old in text
        text = text.replace(old, new)
    assert agree(text)["keys"] > 0


def test_recurrent_dropout_is_one_mask_a_sequence_and_a_new_one_each_call():
    rows = derive(spec_of(USER)).calls
    theirs = nnx_keys(spec_of(USER))
    rdrop = [
        (c.derivation.step, tuple(c.key))
        for c in rows
        if c.derivation.site == "rnn.cell.rdrop" and c.derivation.step and c.derivation.kind == "dropout"
    ]
    drop = [tuple(c.key) for c in rows if c.derivation.site == "rnn.cell.drop" and c.derivation.step]
    # (the split of the recurrent dropout's stream at each call is at that Dropout too)
    assert len([c for c in rows if c.derivation.site == "rnn.cell.rdrop" and c.derivation.kind == "split"]) == 3
    assert len(rdrop) == 9 and len(drop) == 9
    # within a call every step draws the same recurrent mask; the next call a new one (split_rngs drew again)
    per_step = {step: {k for s, k in rdrop if s == step} for step in (1, 2, 3)}
    assert all(len(keys) == 1 for keys in per_step.values())
    assert len(set().union(*per_step.values())) == 3
    assert len(set(drop)) == 9
    # ... and so in real NNX, whose keys derive gave (agree() compares them one by one)
    assert {tuple(r["key"]) for r in theirs if r["site"] == "rnn.cell.rdrop" and r["step"]} == set().union(
        *per_step.values()
    )
    found = audit_nnx(spec_of(USER)).collisions
    assert {c.category for c in found} == {"scan_broadcast"} and not any(c.failing for c in found)


TWO = textwrap.dedent("""
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: BiLSTM
      init:
        - RNN: {name: fwd, cell: LSTMCell}
        - RNN: {name: bwd, cell: LSTMCell}
      call:
        - call: {name: fwd, length: 4}
        - call: {name: bwd, length: 4}
    """)


def test_two_rnns_with_their_own_streams_share_carry_keys_only_a_random_carry_uses():
    zeros = TWO
    assert agree(zeros)["keys"] == 24 + 8
    # NNX hands every RNN built without rngs RngStream(0): the same carry keys as each other and as params=0;
    # with the default zeros carry they are never used, so nothing is reported
    assert audit_nnx(spec_of(zeros)).collisions == ()
    text = derive(spec_of(zeros)).calls
    assert [c.derivation.unused for c in text if c.derivation.kind == "carry"] == [True] * 8
    random = zeros.replace("cell: LSTMCell}", "cell: LSTMCell, carry_init: random}")
    found = audit_nnx(spec_of(random)).collisions
    assert found and {c.category for c in found} == {"shared_stream_key"}
    keys = {tuple(r["key"]) for r in nnx_keys(spec_of(random)) if r["site"] in ("fwd", "bwd")}
    assert {tuple(int(w) for w in c.key) for c in found} <= keys
    assert "build bwd and fwd with rngs=rngs" in found[0].fix
    r = invoke("collisions", write_nnx_spec(random))
    assert r.exit_code == 1 and "shared_stream_key" in r.stdout
    # the fix, applied: a carry stream, each RNN forking it
    fixed = random.replace("carry_init: random}", "carry_init: random, rngs: fork}").replace(
        "dropout: 1}", "dropout: 1, carry: 2}"
    )
    assert agree(fixed)["keys"] > 0
    assert audit_nnx(spec_of(fixed)).collisions == ()


def test_derive_shows_unused_carry_keys():
    r = invoke("derive", write_nnx_spec(TWO))
    assert r.exit_code == 0
    assert "fwd.cell.initialize_carry (unused: the carry is zeros)" in r.stdout
    assert "key 0 (nnx.RNN's own RngStream) -> fold_in 0" in r.stdout


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("{name: fwd, length: 4}", "fwd", "fwd is an nnx.RNN: give its call the sequence length"),
        ("{name: fwd, length: 4}", "{name: fwd, length: 4, vmap: 2}", "rngaudit models an RNN called plainly"),
        ("cell: LSTMCell}", "cell: LSTMCel}", "`cell` of an RNN is one of LSTMCell"),
        ("cell: LSTMCell}", "cell: {LSTMCell: {name: c}}}", "drop `name:`"),
        ("cell: LSTMCell}", "cell: LSTMCell, carry_draws: 3}", "draws 2 key(s), always"),
        ("cell: LSTMCell}", "cell: LSTMCell, rngs: shared}", "`rngs` of an RNN is own"),
        ("cell: LSTMCell}", "cell: LSTMCell, carry_init: ones}", "`carry_init` of an RNN is zeros"),
        ("- RNN: {name: fwd, cell: LSTMCell}", "- RNN: {name: fwd}", "RNN"),
        ("steps: 2", 'steps: 2\nflax: {version: "0.11.0"}', "rngaudit models nnx.RNN with the rules of flax 0.12"),
        (
            "- call: {name: bwd, length: 4}",
            "- call: {name: bwd, length: 4}\n    - RNN: {cell: GRUCell}",
            "build it in `init:`",
        ),
    ],
)
def test_bad_rnn_statements_get_one_error_line(tmp_path, old, new, message):
    text = TWO
    assert old in text
    assert_one_error_line(tmp_path, text.replace(old, new, 1), message)


def test_length_on_a_call_of_something_else_is_refused(tmp_path):
    text = """
        rngs: {params: 0, dropout: 1}
        model:
          class: M
          init: [{Dropout: {name: drop, rate: 0.5}}]
          call: [{call: {name: drop, length: 3}}]
        """
    assert_one_error_line(tmp_path, text, "`length` belongs to the call of an nnx.RNN")


def test_an_rnn_without_rngs_and_a_cell_without_them_fails_as_nnx_does():
    with pytest.raises(FlaxError) as e:
        derive(spec_of(standard("LSTMCell", "none", False)))
    assert e.value.flax_error == "ValueError" and "RNGs must be provided to initialize the cell carry" in str(e.value)


BIDI = textwrap.dedent("""
    rngs: {params: 0, dropout: 1, recurrent_dropout: 4, carry: 2}
    steps: 2
    model:
      class: Tagger
      init:
        - Bidirectional:
            name: bi
            rngs: MODE
            forward: {cell: LSTMCell, rngs: SIDE}
            backward:
              cell:
                module:
                  class: Cell
                  init: [{Linear: {name: lin}}, {Dropout: {name: d, rate: 0.5, rng_collection: recurrent_dropout}}]
                  call: [{call: d}]
              broadcast: recurrent_dropout
              carry_draws: 2
              rngs: SIDE
      call:
        - call: {name: bi, length: 3CALL}
    """)


@pytest.mark.parametrize("mode", ["own", "fork", "none"])
@pytest.mark.parametrize("side", ["own", "fork", "none"])
@pytest.mark.parametrize("call", ["", ", rngs: model", ", initial_carry: true"])
def test_bidirectional_hands_out_nnx_keys(mode, side, call):
    text = BIDI.replace("MODE", mode).replace("SIDE", side).replace("CALL", call)
    got = agree(text)
    if mode == side == "none" and not call:
        assert got == {"error": "ValueError"}  # neither Bidirectional nor its RNNs keep a stream
        return
    assert got["keys"] > 0
    rows = [c.derivation for c in derive(spec_of(text)).calls if c.derivation.kind == "carry"]
    if call == ", initial_carry: true":
        assert rows == []
    elif mode != "none" or call:
        # Bidirectional's stream (or the call's rngs.carry, not forked) serves both directions, counts shared
        assert [d.site for d in rows[:4]] == ["bi.forward_rnn.cell.initialize_carry"] * 2 + [
            "bi.backward_rnn.cell.initialize_carry"
        ] * 2
        counts = [d.count for d in rows]
        assert counts == list(range(counts[0], counts[0] + 8)) and len({d.stream for d in rows}) == 1
