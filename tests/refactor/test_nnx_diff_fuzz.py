"""A refactor fuzzer for `diff` of NNX specs: random NNX models as public code writes them (standard layers,
Dropouts, submodules built from the caller's Rngs or `rngs.fork()`, called over one or two steps), one random
refactor each (rename an attribute, reorder two layers in `__init__`, rename a layer and build it elsewhere,
insert a layer, delete one), diffed. Checked: no crash; every site of both sides is accounted for once (kept,
changed, new, gone, or moved/renamed from its old site); the statuses follow the keys derive gives each side;
every site that is not kept is explained; and every cause a `why` claims is one the refactor can have: a rename
is claimed only for the module renamed, and with the names it had and has, an insertion only for the layer
inserted, a removal only for the one deleted.

The default run draws a fixed set; RNGAUDIT_NNX_DIFF_FUZZ_EXAMPLES=2000 for a long sweep."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rngaudit
from rngaudit import parse_spec

EXAMPLES = int(os.environ.get("RNGAUDIT_NNX_DIFF_FUZZ_EXAMPLES", "40"))
KINDS = ("rename", "reorder", "rename+reorder", "insert", "delete", "rename+insert")
LAYERS = ("Linear", "Linear", "LayerNorm", "Embed", "RMSNorm", "Dropout", "module")


def _layer(draw, kind: str, name: str, depth: int) -> dict:
    if kind == "Dropout":
        return {"Dropout": {"name": name, "rate": 0.5}}
    if kind == "module" and depth == 0:
        inner = [
            _layer(draw, k, f"{name}_{i}", 1)
            for i, k in enumerate(draw(st.lists(st.sampled_from(LAYERS[:-1]), min_size=1, max_size=3)))
        ]
        calls = [{"call": st_["Dropout"]["name"]} for st_ in inner if "Dropout" in st_]
        mod = {"name": name, "class": f"C{name}", "init": inner, **({"call": calls} if calls else {})}
        if draw(st.booleans()):
            mod["rngs"] = "fork"
        return {"module": mod}
    kind = "Linear" if kind == "module" else kind
    return {kind: {"name": name}}


def _name(st_: dict) -> str:
    ((_, opts),) = st_.items()
    return opts["name"]


def _calls(init: list) -> list:
    return [{"call": _name(s)} for s in init if "Dropout" in s or ("module" in s and "call" in s["module"])]


@st.composite
def refactors(draw):
    kinds = draw(st.lists(st.sampled_from(LAYERS), min_size=2, max_size=6))
    names = draw(
        st.lists(
            st.sampled_from(("enc", "dec", "proj", "head", "norm", "drop", "emb", "mlp", "gate", "out")),
            min_size=len(kinds),
            max_size=len(kinds),
            unique=True,
        )
    )
    init = [_layer(draw, k, n, 0) for k, n in zip(kinds, names)]
    doc = {
        "rngaudit": 1,
        "flavour": "nnx",
        "rngs": {"params": 0, "dropout": 1},
        "steps": draw(st.integers(1, 2)),
        "model": {"class": "Model", "init": init},
    }
    if _calls(init):
        doc["model"]["call"] = _calls(init)
    new = copy.deepcopy(doc)
    ni = new["model"]["init"]
    kind = draw(st.sampled_from(KINDS))
    truth: dict = {"kind": kind}
    if kind in ("rename", "rename+reorder"):
        i = draw(st.integers(0, len(ni) - 1))
        old_name = _name(ni[i])
        new_name = old_name + "_v2"
        ((_, opts),) = ni[i].items()
        opts["name"] = new_name
        truth["renamed"] = (old_name, new_name)
        if kind == "rename+reorder":
            j = draw(st.integers(0, len(ni) - 1).filter(lambda j: j != i))
            ni.insert(j, ni.pop(i))
    elif kind == "rename+insert":
        # a submodule renamed with a layer added inside it (blocks -> layers, a gate added to each block)
        mods = [i for i, st_ in enumerate(ni) if "module" in st_]
        if not mods:
            ni.append(_layer(draw, "module", "blk", 0))
            doc["model"]["init"].append(copy.deepcopy(ni[-1]))
            doc["model"].pop("call", None)
            if _calls(doc["model"]["init"]):
                doc["model"]["call"] = _calls(doc["model"]["init"])
            mods = [len(ni) - 1]
        i = draw(st.sampled_from(mods))
        opts = ni[i]["module"]
        old_name = opts["name"]
        opts["name"] = new_name = old_name + "_v2"
        at = draw(st.integers(0, len(opts["init"])))
        opts["init"].insert(at, {draw(st.sampled_from(("Linear", "LayerNorm"))): {"name": "inserted"}})
        truth["renamed"] = (old_name, new_name)
        truth["inserted"] = f"{new_name}.inserted"
    elif kind == "reorder":
        i, j = draw(st.lists(st.integers(0, len(ni) - 1), min_size=2, max_size=2, unique=True))
        ni[i], ni[j] = ni[j], ni[i]
    elif kind == "insert":
        at = draw(st.integers(0, len(ni)))
        ni.insert(at, {draw(st.sampled_from(("Linear", "LayerNorm"))): {"name": "inserted"}})
        truth["inserted"] = "inserted"
    else:
        i = draw(st.integers(0, len(ni) - 1))
        truth["deleted"] = _name(ni.pop(i))
    calls = _calls(ni)
    new["model"].pop("call", None)
    if calls:
        new["model"]["call"] = calls
    return doc, new, truth


def _spec(doc: dict):
    return parse_spec(yaml.safe_dump(doc, sort_keys=False), "<fuzz>")


def _keys(spec) -> dict:
    from rngaudit.refactor.keys_file import spec_capture

    return {s.ident: s.key for s in spec_capture("<fuzz>", spec).sites}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refactors())
def test_diff_of_random_nnx_refactors(case):
    old_doc, new_doc, truth = case
    old, new = _spec(old_doc), _spec(new_doc)
    a, b = _keys(old), _keys(new)
    report = rngaudit.diff(old, new)  # any exception here is a crash: the test fails
    kind = truth["kind"]
    event(f"{kind}: {'changes' if report.failing else 'no change'}")
    # every site of both sides once: an entry's old site is an old one, its new site a new one
    seen_old = [e.old.ident for e in report.entries if e.old is not None]
    seen_new = [e.new.ident for e in report.entries if e.new is not None]
    assert sorted(seen_old) == sorted(a) and sorted(seen_new) == sorted(b)
    for e in report.entries:
        o, n = e.old, e.new
        if e.status == "kept":
            assert o is not None and n is not None and o.ident == n.ident and o.key == n.key
        elif e.status == "moved":
            assert o is not None and n is not None and o.key == n.key and o.ident != n.ident
        elif e.status == "changed":
            assert o is not None and n is not None and o.key != n.key
        elif e.status == "new":
            assert o is None and n.ident not in a
        else:
            assert e.status == "gone" and n is None and o.ident not in b
        if e.status != "kept":
            assert e.why, (kind, e.status, e.site.path)
        for why in e.why:
            _check_claim(why, truth, e)
    assert report.failing == any(e.status in ("changed", "new", "gone") for e in report.entries)
    if "renamed" in truth:
        # the renamed module's draws are followed from the old name to the new: none is left gone or new
        new_name = truth["renamed"][1]
        left = [
            e
            for e in report.entries
            if e.status in ("new", "gone") and e.site.path[0] in truth["renamed"] and "inserted" not in e.site.path
        ]
        assert not left, (truth, [(e.status, e.site.path) for e in left])
        if any(e.status == "changed" and e.new.path[0] == new_name for e in report.entries):
            event("a renamed module's keys changed: explained as renamed")


def _check_claim(why: str, truth: dict, e) -> None:
    kind = truth["kind"]
    # (a fork added or removed is named by the layer that makes it; the refactors here add or remove whole layers)
    assert "there still" not in why and "was there before" not in why, why
    why = re.sub(r"the '[^']+' fork of ", "", why)
    m = re.search(r"and (\S+) is gone: (\S+) renamed (\S+) ", why)
    if m:
        assert kind in ("rename", "rename+reorder", "rename+insert"), (kind, why)
        assert (m.group(2), m.group(3)) == truth["renamed"], (truth, why)
    if "a rename or a move" in why:
        assert kind in ("rename", "rename+reorder", "rename+insert"), (kind, why)
        old_name, new_name = truth["renamed"]
        assert e.old.path[0] == old_name and e.new.path[0] == new_name, (truth, why)
    if "under another name (the rename above)" in why:
        assert kind == "rename+reorder", (kind, why)
    m = re.search(r"added before it: ([^.]+(?:\.[^ .,]+)*(?:, [^ ,.]+(?:\.[^ ,.]+)*)*)", why)
    if "added before it" in why:
        assert kind in ("insert", "rename+insert"), (kind, why)
        assert m and all(p.startswith(truth["inserted"]) for p in m.group(1).split(", ")), (truth, why)
    if "removed before it" in why:
        assert kind == "delete", (kind, why)
        shown = why.split("removed before it: ")[1].split(". An NNX key")[0]
        assert all(
            p.split(".")[0] == truth["deleted"] for p in shown.replace(" and ", ", ").split(", ") if "more" not in p
        ), (truth, why)


RENAME_AND_MOVE = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
model:
  class: M
  init:
    - Linear: {name: enc}
    - Linear: {name: dec}
    - Dropout: {name: drop, rate: 0.1}
  call: [{call: drop}]
"""


def test_a_layer_renamed_and_built_elsewhere_is_followed_and_explained(tmp_path):
    from support import invoke

    old = tmp_path / "old.yaml"
    old.write_text(RENAME_AND_MOVE)
    new = tmp_path / "new.yaml"
    # dec renamed decoder and built first: its counts (so its keys) and enc's moved
    new.write_text(
        RENAME_AND_MOVE.replace(
            "    - Linear: {name: enc}\n    - Linear: {name: dec}\n",
            "    - Linear: {name: decoder}\n    - Linear: {name: enc}\n",
        )
    )
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[1:4] for ln in lines if ln.startswith("CHANGED")] == [
        ["dec/kernel", "->", "decoder/kernel"],
        ["dec/bias", "->", "decoder/bias"],
        ["enc/kernel", "params", "count"],  # (enc's counts shifted: one entry each, count 0 -> 2)
        ["enc/bias", "params", "count"],
    ]
    assert "CHANGED  enc/kernel  params count 0 -> 2 (init)" in r.stdout
    doc = json.loads(invoke("diff", old, new, "-f", "json").stdout)
    changed = [c for c in doc["sites"] if c["status"] == "changed"]
    assert [(c.get("old_path"), c["path"], c["old_count"], c["count"]) for c in changed] == [
        (["dec", "kernel"], ["decoder", "kernel"], 2, 0),
        (["dec", "bias"], ["decoder", "bias"], 3, 1),
        (None, ["enc", "kernel"], 0, 2),
        (None, ["enc", "bias"], 1, 3),
    ]
    assert "why: decoder draws what dec drew (bias, kernel) and dec is gone: dec renamed decoder" in r.stdout
    assert "it drew 'params' count 2 before and 0 now, 2 fewer keys of rngs.params handed out before it" in r.stdout
    # enc's count shift names what moved before it, not "added"
    assert (
        "before it now and after it before, under another name (the rename above): decoder.kernel, decoder.bias"
        in r.stdout
    )
    assert "added before it" not in r.stdout and not any(
        ln.startswith(("GONE     dec/", "NEW      decoder/")) for ln in lines
    )
    assert r.stdout.endswith("2 kept, 4 changed, 0 new, 0 gone\n")
    # the other way round: decoder renamed dec, built after enc
    r = invoke("diff", new, old)
    assert "dec draws what decoder drew (bias, kernel) and decoder is gone: decoder renamed dec" in r.stdout
    assert (
        "after it now and before it before, under another name (the rename above): decoder.kernel, decoder.bias"
        in r.stdout
    )


STEP_DRAW = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1, noise: 2}
run: RUN
model:
  class: M
  keep_rngs: true
  init: [Linear: {name: l}, Dropout: {name: drop, rate: 0.5}]
  call: [call: drop]
"""


@pytest.mark.parametrize(
    "before, after, moved",
    [
        # a training step's draw moved past the model's call: its row belongs to the next call's step now
        ("[draw: noise, call, call]", "[call, draw: noise, call]", [("(root)", "noise", 0, 1, 2)]),
        # an eval call (drawing nothing) inserted: the next training call's keys are the ones the old step 2 drew
        ("[call, call]", "[call, eval, call, train, call]", [("drop", "dropout", 1, 2, 3)]),
    ],
)
def test_a_key_drawn_at_another_step_is_moved_not_new_and_gone(tmp_path, before, after, moved):
    """diff said GONE and NEW, with an untrue why ("the layer is gone, not called, or deterministic"), for a key
    that every stream still hands out at the same site and count: the calls before it changed."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(STEP_DRAW.replace("RUN", before))
    new.write_text(STEP_DRAW.replace("RUN", after))
    doc = json.loads(invoke("diff", old, new, "-f", "json").stdout)
    got = [(e["path_str"], e["stream"], e["count"], e["old_step"]) for e in doc["sites"] if e["status"] == "moved"]
    assert got == [m[:4] for m in moved] and not [e for e in doc["sites"] if e["status"] in ("new", "gone", "changed")]
    # the claim holds: derive draws that key at that site and count, at the old step before and the new one now
    for path, stream, count, was, now in moved:
        drawn = _derived(
            old,
            new,
            lambda c: (c.derivation.step, tuple(c.key)),
            lambda c: (c.derivation.site.split(" ")[0], c.derivation.tag, c.derivation.count) == (path, stream, count),
        )
        assert [s for s, _ in drawn["old"]] == [was] and [s for s, _ in drawn["new"]] == [now]
        assert drawn["old"][0][1] == drawn["new"][0][1]
    r = invoke("diff", old, new)
    assert r.exit_code == 0 and f"(step {moved[0][3]} -> {moved[0][4]})" in r.stdout, r.stdout
    assert "what the steps before it draw changed, not this key" in r.stdout


def _derived(old, new, row, keep) -> dict:
    """Each version's keys as derive gives them, `row(call)` of those `keep(call)` takes: what a diff's claims
    are checked on."""
    return {
        side: [row(c) for c in rngaudit.derive(parse_spec(f.read_text(), str(f))).calls if keep(c)]
        for side, f in (("old", old), ("new", new))
    }


MODE_GATE = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, noise: 2}
run: [call, eval, call, train, call]
model:
  class: M
  init:
    - module:
        name: inject
        class: Noise
        keep_rngs: true
        call: [draw: noise]
  call: [call: {name: inject, when: WHEN}]
"""


def test_a_key_drawn_in_the_other_mode_now_is_changed_and_says_so(tmp_path):
    """A refactor that inverts the test around a draw (`if not deterministic:` -> `if deterministic:`) hands the
    same keys to the eval calls instead of the training ones: diff called them MOVED (exit 0) with a why that
    does not hold ("what the steps before it draw changed")."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(MODE_GATE.replace("WHEN", "train"))
    new.write_text(MODE_GATE.replace("WHEN", "eval"))
    doc = json.loads(invoke("diff", old, new, "-f", "json").stdout)
    got = [(e["status"], e["count"], e.get("old_step"), e.get("old_mode"), e.get("mode")) for e in doc["sites"]]
    assert got == [("changed", 0, 1, "train", "eval"), ("gone", 1, None, None, None)], got
    assert doc["summary"]["failing"]
    # the claim holds: derive draws that key at step 1 (train) before and step 2 (after the eval event) now
    drawn = _derived(
        old, new, lambda c: (c.derivation.step, c.derivation.count, tuple(c.key)), lambda c: c.derivation.tag == "noise"
    )
    assert [d[:2] for d in drawn["old"]] == [(1, 0), (3, 1)] and [d[:2] for d in drawn["new"]] == [(2, 0)]
    assert drawn["old"][0][2] == drawn["new"][0][2]
    r = invoke("diff", old, new)
    assert r.exit_code == 1 and "CHANGED  inject  noise count 0 (step 1 train -> 2 eval)" in r.stdout, r.stdout
    assert "drawn in eval mode now (step 2) and in train mode before (step 1)" in r.stdout
    assert "so the train calls no longer get it" in r.stdout and "MOVED" not in r.stdout
    # the other training call's key is drawn nowhere now
    assert "GONE     inject  noise count 1 (step 3)" in r.stdout, r.stdout
    # the same model, its modes unchanged: nothing to report
    assert invoke("diff", old, old).exit_code == 0


def test_draws_added_at_earlier_calls_are_named_and_a_key_drawn_elsewhere_says_where(tmp_path):
    """A module drawing `noise` in train mode added before another: the later one's count at the third call moved
    by the draws added at the first and the third (it said "2 more keys" without which), and the key the new module
    draws first is the one the other drew there before (it said only "nothing drew this key here before")."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    text = (
        MODE_GATE.replace("WHEN", "train")
        .replace("  init:\n", "  init:\n    - module: {name: pre, class: Pre, keep_rngs: true}\n")
        .replace("call: [call: {name: inject", "call: [call: pre, call: {name: inject")
    )
    old.write_text(text)
    new.write_text(text.replace("keep_rngs: true}", "keep_rngs: true, call: [draw: {stream: noise, when: train}]}"))
    assert old.read_text() != new.read_text()
    drawn = _derived(
        old,
        new,
        lambda c: (c.derivation.step, c.derivation.site, c.derivation.count),
        lambda c: c.derivation.tag == "noise",
    )
    assert drawn == {
        "old": [(1, "inject", 0), (3, "inject", 1)],
        "new": [(1, "pre", 0), (1, "inject", 1), (3, "pre", 2), (3, "inject", 3)],
    }, drawn
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.stdout
    assert (
        "inject drew 'noise' count 1 before and 3 now, 2 more keys of rngs.noise handed out before it: added "
        "before it: pre." in r.stdout
    ), r.stdout
    assert "NEW      pre  noise count 0 (step 1)" in r.stdout
    assert "the old version drew this key at inject (step 1, train mode)" in r.stdout, r.stdout


KEPT_FORK = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, noise: 2}
steps: 2
model:
  class: M
  keep_rngs: true
  init:
    - module: {name: sampler, class: S, keep_rngs: true, call: [draw: noise]}
    - module: {name: mixer, class: X, init: [fork: {stream: noise, name: rng}], call: [draw: {stream: noise, from: rng}]}
  call: [draw: noise, call: sampler, call: mixer]
"""


def test_a_layer_that_draws_from_another_stream_now_is_said_so(tmp_path):
    """A sampler built from rngs.fork() now, drawing from its own fork: its draws were called count shifts of one
    stream ("drew 'noise' count 1 before and 0 now"), two different streams' counts; and a mixer keeping a fork of
    `noise` that draws from the model's stream now was "new ... the layer is new, was not called"."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(KEPT_FORK)
    new.write_text(
        KEPT_FORK.replace("{name: sampler, class: S,", "{name: sampler, class: S, rngs: fork,").replace(
            "init: [fork: {stream: noise, name: rng}], call: [draw: {stream: noise, from: rng}]",
            "keep_rngs: true, call: [draw: noise]",
        )
    )
    drawn = _derived(
        old,
        new,
        lambda c: (c.derivation.step, c.derivation.site, c.derivation.stream, c.derivation.count),
        lambda c: c.derivation.step == 1,
    )
    assert drawn == {
        "old": [(1, "(root)", "rngs.noise", 1), (1, "sampler", "rngs.noise", 2), (1, "mixer.rng", "mixer.rng", 0)],
        "new": [(1, "(root)", "rngs.noise", 1), (1, "sampler", "sampler.rngs.noise", 0), (1, "mixer", "rngs.noise", 2)],
    }, drawn
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.stdout
    assert (
        "sampler draws 'noise' from another stream now: sampler.rngs.noise (count 0) now, rngs.noise (count 2) "
        "before" in r.stdout
    ), r.stdout
    assert "NEW      mixer  noise count 2 (step 1)" in r.stdout, r.stdout
    assert "mixer is there in both versions and did not draw this key before" in r.stdout, r.stdout
    assert "the old version drew this key at sampler (step 1)" in r.stdout, r.stdout
    # (the mixer's fork, whose draws are at its attribute, is gone: its key is the sampler's fork's now)
    assert (
        "GONE     mixer/rng  noise count 0 (init)" in r.stdout
        and "this key is drawn at sampler now (construction)" in r.stdout
    )


ATTENTION_DROPOUT = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
model:
  class: M
  init:
    - MultiHeadAttention: {name: attnRATE}
    - Dropout: {name: drop, rate: 0.1}
  call: [call: drop]
"""


def test_a_fork_no_longer_made_is_named_by_its_layer_which_is_there_still(tmp_path):
    """An attention whose dropout_rate became 0 forks `dropout` no more, which moves a later Dropout's fork: the
    count shift said "removed before it: attn", and attn is there still."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(ATTENTION_DROPOUT.replace("RATE", ", dropout_rate: 0.1"))
    new.write_text(ATTENTION_DROPOUT.replace("RATE", ""))
    # the claim holds: derive has attn's fork of `dropout` in the old version only, and drop's at count 1 -> 0
    forks = _derived(
        old,
        new,
        lambda c: (c.derivation.site, c.derivation.count),
        lambda c: c.derivation.kind == "fork" and c.derivation.tag == "dropout",
    )
    assert forks == {"old": [("attn", 0), ("drop", 1)], "new": [("drop", 0)]}, forks
    r = invoke("diff", old, new)
    assert r.exit_code == 1 and "CHANGED  drop  dropout count 1 -> 0 (init)" in r.stdout, r.stdout
    assert "removed before it: the 'dropout' fork of attn (it is there still, and forks it no more)" in r.stdout
    r = invoke("diff", new, old)
    assert "added before it: the 'dropout' fork of attn (it was there before, and did not fork it)" in r.stdout


NESTED_DROPOUT = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
model:
  class: M
  init:
    - module:
        name: blocks.0
        class: Block
        init: [Linear: {name: lin}, Dropout: {name: NAME, rate: 0.5}]
        call: [call: lin, call: NAME]
  call: [call: blocks.0]
"""


def test_a_dropout_renamed_inside_a_submodule_is_moved_and_exits_0(tmp_path):
    """A Dropout renamed inside a block (self.drop -> self.dropout) was GONE and NEW with "the layer is gone" and
    exit 1; a pure rename: its fork and its mask keep their keys (at the root it was already MOVED)."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(NESTED_DROPOUT.replace("NAME", "drop"))
    new.write_text(NESTED_DROPOUT.replace("NAME", "dropout"))
    r = invoke("diff", old, new)
    assert r.exit_code == 0, r.stdout
    assert r.stdout.count("MOVED    blocks/0/drop -> blocks/0/dropout") == 2 and "GONE" not in r.stdout, r.stdout
    # (the claim holds: derive gives both sides the same keys)
    keys = [sorted(_keys(_spec(yaml.safe_load(f.read_text()))).values()) for f in (old, new)]
    assert keys[0] == keys[1] and len(keys[0]) == 4


TWICE = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
call_rngs: {dropout: 3}
model:
  class: M
  init: [Dropout: {name: emb, rate: 0.1, rngs: false}, Dropout: {name: drop, rate: 0.1, rngs: false}]
  call: [CALLS]
"""


def test_a_count_shift_of_a_layer_called_twice_compares_the_same_call(tmp_path):
    """The second call of a Dropout called twice a step was compared with its first call ("count 1 before and 3
    now, 2 more keys"): one Dropout was added before it."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(TWICE.replace("CALLS", "{call: {name: drop, rngs: call, repeat: 2}}"))
    new.write_text(
        TWICE.replace("CALLS", "{call: {name: emb, rngs: call}}, {call: {name: drop, rngs: call, repeat: 2}}")
    )
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.stdout
    assert (
        "why: count shift: drop drew 'dropout' count 1 before and 2 now, 1 more keys of call_rngs.dropout handed out "
        "before it: added before it: emb" in r.stdout
    ), r.stdout
    assert "2 more keys" not in r.stdout


ALIKE_BLOCKS = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
model:
  class: M
  init:
    - module:
        name: b0
        class: Block
        init:
          - Linear: {name: attn}
          - module: {name: mlp, class: MLP, init: [{Linear: {name: gate}}, {Linear: {name: up}}]}
          - Dropout: {name: drop, rate: 0.1}
        call: [{call: drop}]
  call: [{call: b0}, {call: b1}]
"""
ALIKE_BLOCKS = ALIKE_BLOCKS.replace(
    "  call: [{call: b0}",
    ALIKE_BLOCKS.split("  init:\n", 1)[1].split("  call: [{call: b0}")[0].replace("b0", "b1") + "  call: [{call: b0}",
)


def test_alike_modules_renamed_alike_with_a_layer_inserted_are_followed(tmp_path):
    """Every block's mlp renamed ffw and a layer inserted before it (layers.i.mlp -> layers.i.ffw): the blocks'
    mlps are alike, so no one shape says which is which; each is paired with the one beside it. The count shift
    gives ffw.gate the key mlp.up had: that is not a rename of up to gate (it was MOVED, "a rename or a move")."""
    from support import invoke

    old = tmp_path / "old.yaml"
    old.write_text(ALIKE_BLOCKS)
    new = tmp_path / "new.yaml"
    new.write_text(
        ALIKE_BLOCKS.replace("name: mlp", "name: ffw").replace(
            "- Linear: {name: attn}\n", "- Linear: {name: attn}\n          - Linear: {name: q}\n"
        )
    )
    assert yaml.safe_load(new.read_text()) != yaml.safe_load(old.read_text())
    doc = json.loads(invoke("diff", old, new, "-f", "json").stdout)
    by_status: dict = {}
    for c in doc["sites"]:
        by_status.setdefault(c["status"], []).append(c)
    assert "moved" not in by_status, by_status.get("moved")
    # each mlp's draws followed to the ffw beside it, by name, its counts shifted by the q inserted before it
    pairs = [(c.get("old_path"), c["path"]) for c in by_status["changed"]]
    for b in ("b0", "b1"):
        for layer in ("gate", "up"):
            for p in ("kernel", "bias"):
                assert ([b, "mlp", layer, p], [b, "ffw", layer, p]) in pairs, pairs
    # the q layers are new; b1.attn, after b0's q, draws other counts: changed, count 6 -> 8
    assert {tuple(c["path"][:2]) for c in by_status["new"]} == {("b0", "q"), ("b1", "q")}
    attn = [c for c in by_status["changed"] if c["path"][:2] == ["b1", "attn"]]
    assert [(c["old_count"], c["count"]) for c in attn] == [(6, 8), (7, 9)]
    assert all(c["why"][0].startswith("count shift: b1.attn.") for c in attn)
    whys = " ".join(w for c in doc["sites"] for w in c["why"])
    assert "b0.ffw draws what b0.mlp drew (gate.bias, gate.kernel, up.bias, up.kernel)" in whys
    assert "a rename or a move" not in whys


BRIDGED = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
model:
  class: M
  init:
    - ToNNX:
        name: enc
        module:
          class: Enc
          body:
            - Dense: {features: 4}
            - Dropout: {rate: 0.1, deterministic: false}
            - Dense: {features: 4, name: proj}
    - Linear: {name: head}
  call: [{call: enc}]
"""


@pytest.mark.parametrize(
    "edit, status, why",
    [
        # an unnamed Dense inserted first takes Dense_0's name (so its keys): the old Dense_0 is Dense_1 now
        (
            ("            - Dense: {features: 4}\n", "            - Dense: {features: 8}\n" * 2),
            "new",
            "a Dense was added: appended as Dense_1, or inserted at Dense_0",
        ),
        (("name: proj", "name: out"), "changed", "renamed path (proj -> out)"),
    ],
)
def test_a_linen_module_inside_to_nnx_is_explained_as_linen(tmp_path, edit, status, why):
    """Keys of a bridge.ToNNX's Linen module hash their paths: an unnamed Dense inserted first was "new, nothing
    drew this key here before (the layer is new ...)" beside 'kept' Dense_0, whose layer is another now. The
    bridge's Linen draws are compared as Linen's diff compares them."""
    from support import invoke

    old = tmp_path / "old.yaml"
    old.write_text(BRIDGED)
    new = tmp_path / "new.yaml"
    new.write_text(BRIDGED.replace(*edit))
    assert new.read_text() != BRIDGED
    doc = json.loads(invoke("diff", old, new, "-f", "json").stdout)
    moved = [c for c in doc["sites"] if c["status"] != "kept"]
    assert moved and {c["status"] for c in moved} == {status}, moved
    for c in moved:
        assert len(c["why"]) == 1 and c["why"][0].startswith("a Linen key inside bridge.ToNNX"), c["why"]
        assert why in c["why"][0], c["why"]
        assert c["path"][0] == "enc"


INSERTED_DROPOUT = """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
model:
  class: M
  init:
    - Linear: {name: fc}
    - Dropout: {name: drop, rate: 0.1}
    - Dropout: {name: drop2, rate: 0.1}
  call: [call: drop, call: drop2]
"""


def test_a_new_layer_drawing_the_key_a_changed_site_drew_before_says_where(tmp_path):
    """A Dropout inserted before another takes the fork (and so the masks) the other had: its NEW draws are keys
    the old version drew at a site that is CHANGED now, and diff says where (it looked only at GONE sites)."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(INSERTED_DROPOUT)
    new.write_text(
        INSERTED_DROPOUT.replace(
            "    - Dropout: {name: drop,", "    - Dropout: {name: drop0, rate: 0.1}\n    - Dropout: {name: drop,"
        ).replace("call: [call: drop,", "call: [call: drop0, call: drop,")
    )
    drawn = _derived(
        old,
        new,
        lambda c: (c.derivation.step, c.derivation.site, tuple(c.key)),
        lambda c: c.derivation.stream.endswith("drop.rngs") or c.derivation.stream == "drop0.rngs",
    )
    # (the claim holds: drop0 draws now the key drop drew at step 1 before, and drop draws another)
    ((_, _, was),) = [r for r in drawn["old"] if r[:2] == (1, "drop")]
    assert [r for r in drawn["new"] if r[2] == was] == [(1, "drop0", was)], drawn
    r = invoke("diff", old, new, "--format", "json")
    assert r.exit_code == 1, r.stdout + r.stderr
    sites = {(s["status"], s["path_str"], s["step"]): s for s in json.loads(r.stdout)["sites"]}
    assert sites[("changed", "drop", 1)]["old_key"] == list(was)
    assert "the old version drew this key at drop (step 1)" in sites[("new", "drop0", 1)]["why"], sites
    assert "the old version drew this key at drop (construction)" in sites[("new", "drop0", 0)]["why"], sites


def test_a_count_shift_from_a_draw_added_is_not_put_down_to_the_streams_key(tmp_path):
    """A Dropout inserted before `drop` changes drop's fork (its stream's key), and drop called twice a step
    shifts its counts: the count shift is the added call's, not the stream made differently (the chain is named
    where a reseed reaches the stream in one version only)."""
    from support import invoke

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    base = (
        "rngaudit: 1\nflavour: nnx\nrngs: {params: 0, dropout: 1}\nsteps: 2\nmodel:\n  class: M\n"
        "  init: [Linear: {name: fc}, Dropout: {name: drop, rate: 0.1}]\n  call: [call: drop]\n"
    )
    old.write_text(base)
    new.write_text(
        base.replace(
            "    - Dropout: {name: drop,", "    - Dropout: {name: d0, rate: 0.1}\n    - Dropout: {name: drop,"
        ).replace("call: [call: drop]", "call: [call: {name: drop, repeat: 2}]")
    )
    r = invoke("diff", old, new, "--format", "json")
    assert r.exit_code == 1, r.stdout + r.stderr
    shifted = [x for x in json.loads(r.stdout)["sites"] if x["path_str"] == "drop" and x["step"] == 2]
    assert shifted and all("made differently" not in " ".join(x["why"]) for x in shifted), shifted
    assert any("1 more keys of drop.rngs handed out before it" in " ".join(x["why"]) for x in shifted), shifted
