"""NNX specs with lanes and steps: stacked modules (nnx.split_rngs around nnx.vmap at construction: ensembles,
scan-over-layers stacks), calls under nnx.vmap (split per lane with StateAxes, or broadcast) and under nnx.scan
(carried, or a stream broadcast), against real Flax NNX built the way the NNX "Randomness" guide (../shared/seeds,
003) and FLAX_NNX_RULES.md §8-§10 write them. Every key is compared with the key real NNX hands out; where a test
names a relation between keys, it holds between the keys NNX handed out."""

from __future__ import annotations

import textwrap

import pytest
from nnx_oracle import check_against_nnx, nnx_keys
from support import invoke, write

from rngaudit import FlaxError, SpecError, derive, parse_spec
from rngaudit.api import audit_input

HEAD = "rngaudit: 1\nflavour: nnx\n"


def spec_of(text: str):
    return parse_spec(HEAD + textwrap.dedent(text))


def agree(text: str) -> dict:
    return check_against_nnx(spec_of(text))


def drawn(report, site: str, kind: str | None = None) -> list:
    return [c for c in report.calls if c.derivation.site == site and (kind is None or c.derivation.kind == kind)]


# the guide's Model (Linear, Dropout) as the seed document's data-parallel example calls it
GUIDE_MODEL = """
model:
  class: Model
  init:
    - Linear: {name: linear}
    - Dropout: {name: drop, rate: 0.1}
  call:
    - call: drop
"""

STACK = """
rngs: {params: 0, dropout: 1}
steps: 2
model:
  class: Stack
  init:
    - module:
        name: blocks
        class: Block
        stack: 3
        init:
          - Linear: {name: linear}
          - Dropout: {name: drop, rate: 0.5}
        call:
          - call: drop
  call:
    - call: {name: blocks, scan: true}
"""


def test_data_parallel_dropout_splits_the_dropout_stream_per_lane():
    """The guide's data-parallel dropout: nnx.split_rngs(splits=N, only='dropout') around a map with
    StateAxes({'dropout': 0, ...: None}). (The guide maps with nnx.pmap; nnx.vmap hands out the same keys,
    FLAX_NNX_RULES.md §15.)"""
    text = "rngs: {params: 0, dropout: 1}\nrun: [call, {call: {vmap: 4, split: dropout}}, call]\n" + GUIDE_MODEL
    assert agree(text)["keys"] == 2 + 1 + 1 + (1 + 4) + 1
    r = derive(spec_of(text))
    lanes = [c for c in drawn(r, "drop", "dropout") if c.derivation.step == 2]
    assert [c.derivation.lane for c in lanes] == [0, 1, 2, 3] and len({c.key for c in lanes}) == 4
    assert lanes[2].derivation.chain[-1] == "split 4 [lane 2]"
    # split_rngs drew one key (count 1), put the key back with that count: the next call draws count 2
    (split,) = drawn(r, "drop", "split")  # (at the Dropout whose stream it splits)
    after = [c.derivation.count for c in drawn(r, "drop", "dropout") if c.derivation.step == 3]
    assert split.derivation.count == 1 and after == [2]


def test_vmap_without_split_gives_every_lane_one_mask():
    """The model broadcast into nnx.vmap (in_axes=None): every lane draws fold_in(key, count), the count advances
    as one lane's does; `collisions` reports broadcast_lanes (failing)."""
    text = "rngs: {params: 0, dropout: 1}\nrun: [{call: {vmap: 3}}, call]\n" + GUIDE_MODEL
    agree(text)
    r = derive(spec_of(text))
    lanes = [c for c in drawn(r, "drop", "dropout") if c.derivation.step == 1]
    assert len(lanes) == 3 and len({c.key for c in lanes}) == 1
    assert {c.derivation.broadcast for c in lanes} == {"vmap"}
    assert [c.derivation.count for c in drawn(r, "drop", "dropout") if c.derivation.step == 2] == [1]
    (finding,) = audit_input(spec_of(text)).collisions
    assert finding.category == "broadcast_lanes" and finding.failing and "split_rngs" in finding.fix
    assert [s.lane for s in finding.sites] == [0, 1, 2]


def test_recurrent_dropout_one_mask_per_sequence_and_per_call():
    """The guide's RNNCell with a recurrent_dropout stream, unrolled by nnx.scan with
    StateAxes({'recurrent_dropout': None, ...: nnx.Carry}): every step draws the same key, and, since the scan
    drops the broadcast stream's count update, so does the next call (FLAX_NNX_RULES.md §10)."""
    text = """
    rngs: {params: 0, recurrent_dropout: 1}
    steps: 2
    model:
      class: RNN
      init:
        - module:
            name: cell
            class: RNNCell
            init:
              - Linear: {name: linear}
              - Dropout: {name: drop, rate: 0.1, rng_collection: recurrent_dropout}
            call:
              - call: drop
      call:
        - call: {name: cell, scan: 5, broadcast: recurrent_dropout}
    """
    assert agree(text)["keys"] == 2 + 1 + 2 * 5
    r = derive(spec_of(text))
    drops = drawn(r, "cell.drop", "dropout")
    assert len({c.key for c in drops}) == 1 and [c.derivation.iteration for c in drops[:5]] == [0, 1, 2, 3, 4]
    cats = {c.category: c for c in audit_input(spec_of(text)).collisions}
    assert set(cats) == {"frozen_scan_broadcast"} and cats["frozen_scan_broadcast"].failing
    assert "every step of one scan" in cats["frozen_scan_broadcast"].why
    assert "drops its count update" in cats["frozen_scan_broadcast"].why
    # one call only: the pattern as intended (information)
    once = spec_of(text.replace("steps: 2", "steps: 1"))
    (c,) = audit_input(once).collisions
    assert c.category == "scan_broadcast" and not c.failing


def test_a_carried_scan_threads_the_count_through_the_steps():
    text = """
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: M
      init:
        - Dropout: {name: drop, rate: 0.5}
      call:
        - call: {name: drop, scan: 4}
    """
    agree(text)
    r = derive(spec_of(text))
    assert [c.derivation.count for c in drawn(r, "drop", "dropout")] == list(range(8))
    assert not audit_input(spec_of(text)).collisions


def test_a_scan_over_layers_stack_gives_each_layer_its_own_stream():
    """split_rngs(splits=3) around vmap(in_axes=0) builds three layers, each from lane i of every stream;
    nnx.scan over them gives layer i its own Dropout stream, whose count persists per layer. The layers'
    Dropout fork keys are FLAX_NNX_RULES.md §10's, printed by Flax."""
    assert agree(STACK)["keys"] == 2 + 3 * 3 + 2 * 3
    r = derive(spec_of(STACK))
    forks = [c.key for c in drawn(r, "blocks.drop", "fork")]
    assert forks == [
        (3779159788, 2663927681),
        (1254258977, 2664581614),
        (1683752645, 1464343246),
    ]
    by_layer = {}
    for c in drawn(r, "blocks.drop", "dropout"):
        by_layer.setdefault(c.derivation.lane, []).append(c.derivation.count)
    assert by_layer == {0: [0, 1], 1: [0, 1], 2: [0, 1]}
    assert not audit_input(spec_of(STACK)).collisions


def test_an_ensemble_under_vmap_over_its_members():
    text = """
    rngs: {params: 0, dropout: 1}
    run: [{call: 2}]
    model:
      class: Ensemble
      init:
        - module:
            name: members
            class: MLP
            stack: 4
            init:
              - Linear: {name: l1}
              - Dropout: {name: drop, rate: 0.5}
              - module: {name: head, class: Head, rngs: fork, keep_rngs: true, call: [{draw: dropout}]}
            call:
              - call: drop
              - call: head
      call:
        - call: {name: members, vmap: true}
    """
    agree(text)
    r = derive(spec_of(text))
    kernels = drawn(r, "members.l1.kernel")
    assert [c.derivation.lane for c in kernels] == [0, 1, 2, 3] and len({c.key for c in kernels}) == 4


def test_a_stacked_module_called_outside_its_axis_fails_as_in_nnx():
    text = """
    rngs: {params: 0, dropout: 1}
    model:
      class: M
      init:
        - module: {name: blocks, class: B, stack: 2, init: [{Dropout: {name: drop, rate: 0.5}}], call: [{call: drop}]}
      call:
        - call: blocks
    """
    assert agree(text) == {"error": "ValueError"}
    with pytest.raises(FlaxError, match="scan: true"):
        derive(spec_of(text))


def test_reseed_of_a_stacked_stream_fails_as_in_nnx():
    text = STACK.replace("steps: 2", "run: [call, {reseed: {dropout: 3}}, call]")
    assert agree(text) == {"error": "ValueError"}
    with pytest.raises(FlaxError, match="non-scalar key"):
        derive(spec_of(text))
    # a reseed of streams the stack does not hold is fine
    assert agree(text.replace("dropout: 3", "noise: 3"))["keys"] > 0


def test_the_oracle_sees_every_lane():
    """(The oracle records lanes through JAX's batching of the callback: as many keys as lanes.)"""
    keys = nnx_keys(spec_of(STACK))
    assert sum(1 for k in keys if k["site"].startswith("blocks") and k["step"] == 0) == 2 + 3 * 3


@pytest.mark.parametrize(
    "model, message",
    [
        ("call: [{call: {name: d, vmap: 2, scan: 2}}]", "not both"),
        ("call: [{call: {name: d, scan: true}}]", "d is not stacked"),
        ("call: [{call: {name: d, vmap: 2, broadcast: dropout}}]", "`broadcast:` belongs to `scan:`"),
        ("call: [{call: {name: d, scan: 2, split: dropout}}]", "`split:` belongs to `vmap:`"),
        ("call: [{call: {name: d, split: dropout}}]", "`split:` belongs to `vmap:`"),
        ("call: [{call: {name: d, broadcast: dropout}}]", "`broadcast:` belongs to `scan:`"),
        ("call: [{call: {name: d, vmap: 0}}]", "between 1 and"),
        ("call: [{call: {name: d, vmap: two}}]", "the number of lanes"),
        ("call: [{call: {name: d, vmap: 2, split: {a: 1}}}]", "a stream name or a list"),
    ],
)
def test_bad_transforms(tmp_path, model, message):
    text = f"rngs: {{dropout: 1}}\nmodel: {{class: M, init: [{{Dropout: {{name: d, rate: 0.5}}}}], {model}}}\n"
    path = write(tmp_path, "bad.yaml", HEAD + text)
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        derive(path)
    r = invoke("derive", path)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {path}:") and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "init, message",
    [
        ("{module: {name: s, class: S, stack: 2, rngs: fork}}", "drop `rngs: fork`"),
        ("{module: {name: s, class: S, stack: 2, keep_rngs: true}}", "keeps the Rngs of a stacked module"),
        (
            "{module: {name: s, class: S, stack: 2, init: [{module: {name: t, class: T, keep_rngs: true}}]}}",
            "T keeps the Rngs",
        ),
        (
            "{module: {name: s, class: S, stack: 2, init: [{module: {name: t, class: T, stack: 2}}]}}",
            "nested lanes",
        ),
        ("{module: {name: s, class: S, stack: 0}}", "between 1 and"),
    ],
)
def test_bad_stacks(tmp_path, init, message):
    text = f"rngs: {{params: 0}}\nmodel: {{class: M, init: [{init}]}}\n"
    path = write(tmp_path, "bad.yaml", HEAD + text)
    with pytest.raises(SpecError, match=message):
        derive(path)
    r = invoke("collisions", path)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1


def test_stacked_calls_take_true_and_new_axes_take_a_size(tmp_path):
    text = STACK.replace("{name: blocks, scan: true}", "{name: blocks, scan: 3}")
    with pytest.raises(SpecError, match="call it with `scan: true`"):
        spec_of(text)
    run = "rngs: {dropout: 1}\nrun: [{call: {vmap: true}}]\nmodel: {class: M}\n"
    with pytest.raises(SpecError, match="the number of lanes"):
        spec_of(run)
    nested = STACK.replace("steps: 2", "run: [{call: {vmap: 2}}]")
    with pytest.raises(SpecError, match="nested lanes"):
        derive(spec_of(nested))


def test_lanes_and_steps_in_json_and_text(tmp_path):
    import json

    # jsonl is byte for byte the JSON report's calls, encoded compactly with sorted keys
    text = "rngs: {params: 0, dropout: 1}\nrun: [{call: {vmap: 2}}, {call: {scan: 2, broadcast: dropout}}]\n"
    both = write(tmp_path, "b.yaml", HEAD + text + GUIDE_MODEL)
    calls = json.loads(invoke("derive", both, "-f", "json").stdout)["calls"]
    lines = invoke("derive", both, "-f", "jsonl").stdout.splitlines()[1:-1]
    assert lines == [json.dumps({**c, "record": "call"}, sort_keys=True, separators=(",", ":")) for c in calls]
    assert [c["broadcast"] for c in calls if c["kind"] == "dropout"] == ["vmap", "vmap", "scan", "scan"]
    path = write(tmp_path, "s.yaml", HEAD + STACK)
    doc = json.loads(invoke("derive", path, "-f", "json").stdout)
    lanes = [c["lane"] for c in doc["calls"] if c["site"] == "blocks.drop" and c["kind"] == "dropout"]
    assert lanes == [0, 1, 2, 0, 1, 2]
    lines = [json.loads(x) for x in invoke("derive", path, "-f", "jsonl").stdout.splitlines()[1:-1]]
    assert [x["lane"] for x in lines] == [c["lane"] for c in doc["calls"]]
    assert {x["broadcast"] for x in lines} == {None}
    text = invoke("derive", path).stdout
    assert "blocks.drop [lane 2]" in text and "split 3 [lane 2]" in text
