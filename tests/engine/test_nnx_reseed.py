"""nnx.reseed of part of a model (nnx.reseed(model.enc, ...): `module:`) and of stacked streams
(policy='match_shape': the new key split into the lanes), against real Flax NNX: every key derive prints is the
key NNX hands out after such a reseed."""

from __future__ import annotations

import json
import textwrap

import pytest
from nnx_oracle import NNX_HEAD, agree, assert_one_error_line
from nnx_oracle import nnx_spec as spec_of

from rngaudit import derive

MODEL = """
rngs: {params: 0, dropout: 1, noise: 2}
run:
  - call
  - reseed: {streams: {dropout: 7}, module: enc}
  - call
  - reseed: {streams: {dropout: 9, noise: 3}, policy: match_shape}
  - call
  - reseed: {streams: {dropout: 4}, module: blocks, policy: match_shape}
  - call
  - reseed: {streams: {dropout: 5}, module: enc.drop}
  - call
model:
  class: Model
  init:
    - module:
        name: enc
        class: Encoder
        init: [Linear: {name: fc}, Dropout: {name: drop, rate: 0.5}, Dropout: {name: after, rate: 0.5}]
        call: [call: fc, call: drop, call: after]
    - module:
        name: blocks
        class: Block
        stack: 3
        init: [Linear: {name: fc}, Dropout: {name: drop, rate: 0.5}, fork: {stream: noise, name: rng}]
        call: [call: drop, draw: {stream: noise, from: rng}]
    - Dropout: {name: head_drop, rate: 0.5}
  call:
    - call: enc
    - call: {name: blocks, scan: true}
    - call: head_drop
"""


def test_a_reseed_of_part_of_the_model_and_of_stacked_streams_hands_out_nnx_keys():
    assert agree(MODEL)["keys"] > 0  # (every key real NNX hands out is derive's, in order)
    calls = derive(spec_of(MODEL)).calls
    by = {}
    for c in calls:
        d = c.derivation
        by.setdefault((d.step, d.stream), []).append(c)
    # nnx.reseed(model.enc, dropout=7): enc's two Dropouts take the fresh Rngs' first two keys, in graph order
    # (after < drop), count 0; the head's Dropout, outside enc, goes on counting
    assert by[(2, "enc.drop.rngs")][0].derivation.count == 0
    assert "fold_in 1 (nnx.reseed: enc.drop.rngs" in " ".join(by[(2, "enc.drop.rngs")][0].derivation.chain)
    assert "fold_in 0 (nnx.reseed: enc.after.rngs" in " ".join(by[(2, "enc.after.rngs")][0].derivation.chain)
    assert by[(2, "head_drop.rngs")][0].derivation.count == 1
    # policy='match_shape': a stacked stream's new key is one key of the fresh Rngs, split into its lanes
    lanes = [c for c in calls if c.derivation.step == 3 and c.derivation.stream.startswith("blocks.drop")]
    assert len(lanes) == 3 and len({tuple(c.key) for c in lanes}) == 3
    assert all("(policy='match_shape')" in " ".join(c.derivation.chain) for c in lanes)
    # a reseed of one layer (model.enc.drop) leaves its sibling counting on from the whole model's reseed
    assert by[(5, "enc.drop.rngs")][0].derivation.count == 0 and by[(5, "enc.after.rngs")][0].derivation.count == 2


def test_a_stacked_stream_reseeded_without_match_shape_is_nnx_value_error():
    text = MODEL.replace("module: blocks, policy: match_shape", "module: blocks")
    assert agree(text) == {"error": "ValueError"}  # (NNX raises it too: a non-scalar key)


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("module: enc}", "module: encoder}", "the model has no attribute 'encoder' built in `init:`"),
        ("module: enc}", "module: ''}", "`module:` of a `reseed` names the submodule reseeded"),
        ("policy: match_shape}", "policy: match}", "nnx.reseed's policy is scalars_only or match_shape"),
        ("{streams: {dropout: 7}, module: enc}", "{streams: {}, module: enc}", "`reseed` takes the streams"),
        ("module: enc}", "module: enc, graph: true}", "unknown key 'graph'"),
        ("rngs: {params: 0,", "flax: {version: 0.10.7}\nrngs: {params: 0,", "nnx.reseed's policy is flax 0.11"),
    ],
)
def test_a_bad_reseed_is_one_error_line(tmp_path, old, new, message):
    assert old in MODEL
    text = MODEL.replace(old, new, 1)
    if "flax:" in new:  # (the old rules: no forks kept, no policy)
        text = text.replace(", fork: {stream: noise, name: rng}]", "]").replace(
            ", draw: {stream: noise, from: rng}", ""
        )
    assert_one_error_line(tmp_path, text, message)


def test_diff_of_a_reseed_narrowed_says_the_stream_was_set_anew_in_one_version_only(tmp_path):
    """The old run reseeds all of enc, the new one enc.after only: enc.drop goes on counting from its fork (count 1,
    not 0). diff says the stream was made differently, reseeded in the old version only, not that draws were
    added before it."""
    from support import invoke

    old = tmp_path / "old.yaml"
    new = tmp_path / "new.yaml"
    old.write_text(NNX_HEAD + textwrap.dedent(MODEL))
    new.write_text(NNX_HEAD + textwrap.dedent(MODEL).replace("module: enc}", "module: enc.after}"))
    r = invoke("diff", old, new, "--format", "json")
    assert r.exit_code == 1, r.stdout + r.stderr
    changed = [c for c in json.loads(r.stdout)["sites"] if c["status"] != "kept"]
    assert [(c["status"], c["path_str"], c["old_count"], c["count"], c["step"]) for c in changed] == [
        ("changed", "enc/drop", 0, 1, 2)
    ], changed
    why = changed[0]["why"][0]
    assert "the stream enc.drop.rngs it draws from was made differently: key 7 -> fold_in 1 (nnx.reseed" in why
    assert why.endswith("(nnx.reseed reaches the stream before this draw in the old version only)"), why
    # (true: derive gives enc.drop count 0 at step 2 from the reseeded stream before, count 1 from its fork now)
    for path, count in ((old, 0), (new, 1)):
        drawn = [c.derivation for c in derive(str(path)).calls if c.derivation.stream == "enc.drop.rngs"]
        assert [d.count for d in drawn if d.step == 2] == [count]


DOTTED = """
rngs: {params: 0, dropout: 1}
run:
  - call
  - reseed: {streams: {dropout: 3}, module: blocks.0}
  - call
  - reseed: {streams: {dropout: 4}, module: blocks.1}
  - call
model:
  class: M
  init:
    - fork: {stream: dropout, name: blocks.0}
    - Dropout: {name: blocks.1, rate: 0.5}
    - Dropout: {name: blocks_2, rate: 0.5}
  call: [draw: {stream: dropout, from: blocks.0}, call: blocks.1, call: blocks_2]
"""


def test_a_fork_and_a_layer_named_as_list_items_are_drawn_from_and_reseeded_as_in_nnx():
    # (a fork kept as `blocks.0` drawn from was an internal error; a reseed of it reached nothing)
    assert agree(DOTTED)["keys"] == 12
    drawn = [(c.derivation.step, c.derivation.stream, c.derivation.count) for c in derive(spec_of(DOTTED)).calls]
    assert (2, "blocks.0", 0) in drawn and (3, "blocks.1.rngs", 0) in drawn, drawn


@pytest.mark.parametrize("value", ["5", "null", "true", "[dropout]"])
def test_a_draw_in_init_that_names_no_stream_is_one_error_line(tmp_path, value):
    # (a scalar was an internal error: TypeError)
    text = f"rngs: {{params: 0}}\nmodel:\n  class: M\n  init:\n    - draw: {value}\n"
    assert_one_error_line(tmp_path, text, "`draw` names a stream: `draw: params`")


def test_a_reseed_of_a_list_reaches_its_items_in_order():
    # `module: blocks` of items blocks.0, blocks.1 (an nnx.List, as capture writes it): one fresh Rngs for both
    text = DOTTED.replace("module: blocks.1}", "module: blocks}")
    assert agree(text)["keys"] == 12
    drawn = {(c.derivation.step, c.derivation.stream): c.derivation for c in derive(spec_of(text)).calls}
    assert "fold_in 0 (nnx.reseed: blocks.0 in graph order)" in drawn[(3, "blocks.0")].chain
    assert "fold_in 1 (nnx.reseed: blocks.1.rngs in graph order)" in drawn[(3, "blocks.1.rngs")].chain
    assert drawn[(3, "blocks_2.rngs")].count == 2  # (not in the list: not reseeded)


def _twelve(run: str) -> str:
    items = "\n".join(f"    - Dropout: {{name: blocks.{i}, rate: 0.5}}" for i in range(12))
    calls = ", ".join(f"call: blocks.{i}" for i in range(12))
    return f"rngs: {{params: 0, dropout: 1}}\nrun:\n{run}\nmodel:\n  class: M\n  init:\n{items}\n  call: [{calls}]\n"


@pytest.mark.parametrize(
    "run",
    [
        "  - call\n  - reseed: {streams: {dropout: 3}}\n  - call",
        "  - call\n  - reseed: {streams: {dropout: 3}, module: blocks}\n  - call",
        "  - call: {fork_rngs: dropout}\n  - call",
    ],
    ids=["reseed", "reseed-list", "fork_rngs"],
)
def test_graph_order_walks_the_items_of_a_list_by_index(run):
    # nnx.graph walks an nnx.List's items by their index (blocks.2 before blocks.10), not by their names as text:
    # with 12 items, a reseed or fork_rngs handed blocks.10 the third key (capture refused such models)
    text = _twelve(run)
    assert agree(text)["keys"] > 0
    chains = {
        c.derivation.stream: " ".join(c.derivation.chain) for c in derive(spec_of(text)).calls if c.derivation.step == 2
    }
    if "reseed" in run:
        assert "fold_in 2 (nnx.reseed: blocks.2.rngs in graph order)" in chains["blocks.2.rngs"], chains
        assert "fold_in 10 (nnx.reseed: blocks.10.rngs in graph order)" in chains["blocks.10.rngs"], chains


def test_a_module_kept_as_a_list_item_is_drawn_from_as_in_nnx():
    # (`draw: {stream: params, from: l.0}` of a module that is an item of a list and keeps its Rngs was an internal
    # error, KeyError 'l'; found by the random-model generator naming items as list items)
    text = (
        "rngs: {params: 0, dropout: 0}\nmodel:\n  class: M1\n  init:\n  - module: {class: M2, keep_rngs: true, "
        "name: l.0, rngs: fork}\n  call:\n  - draw: {stream: params, from: l.0}\nsteps: 2\n"
    )
    assert agree(text)["keys"] == 4
