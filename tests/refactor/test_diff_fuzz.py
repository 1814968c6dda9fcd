"""A refactor fuzzer for `diff` (issue 18): random models (the replay property tests' generators), random
refactors of them (seed, separator, PRNG flag, insert, delete, reorder, rename, wrap in nn.jit/nn.vmap,
split_rngs), each diffed. Checked: no crash, the sets (kept/changed/new/gone) equal the truth computed
from both sides' derived keys, the exit status follows the sets, every non-kept site has an explanation,
and the causes that are known from the refactor are named (and a split change is not claimed instead).

The default run draws a fixed set; RNGAUDIT_DIFF_FUZZ_EXAMPLES=2000 for a long sweep, and
RNGAUDIT_DIFF_FUZZ_KINDS=wrap,split to draw only some refactor kinds (the rarely valid ones get many examples)."""

from __future__ import annotations

import copy
import os

import yaml
from engine.test_replay_property import specs, transform_specs
from hypothesis import HealthCheck, event, example, given, reject, settings
from hypothesis import strategies as st

import rngaudit
from rngaudit import RngauditError, parse_spec
from rngaudit.refactor.keys_file import _eager_variables

EXAMPLES = int(os.environ.get("RNGAUDIT_DIFF_FUZZ_EXAMPLES", "60"))

KINDS = ("seed", "separator", "partitionable", "insert", "delete", "reorder", "rename", "wrap", "split")
# the structural refactors are drawn more often: they are rejected more (a body without a module to rename)
WEIGHTED = 3 * KINDS[3:] + KINDS[:3]
_ONLY = [k for k in os.environ.get("RNGAUDIT_DIFF_FUZZ_KINDS", "").split(",") if k]
if _ONLY:
    if not set(_ONLY) <= set(KINDS):
        raise ValueError(f"RNGAUDIT_DIFF_FUZZ_KINDS: the kinds are {', '.join(KINDS)}, not {', '.join(_ONLY)}")
    WEIGHTED = tuple(_ONLY)
INSERTS = ({"Dense": {"features": 2}}, {"LayerNorm": {}}, {"param": "inserted"}, {"make_rng": "params"})


def _bodies(node, out: list) -> list:
    """Every statement list (`body`, `setup`) in the model, outermost first."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("body", "setup") and isinstance(v, list):
                out.append(v)
            _bodies(v, out)
    elif isinstance(node, list):
        for v in node:
            _bodies(v, out)
    return out


def _modules(body: list) -> list[int]:
    return [i for i, s in enumerate(body) if isinstance(s, dict) and "module" in s and isinstance(s["module"], dict)]


@st.composite
def refactors(draw):
    doc = yaml.safe_load(draw(st.one_of(specs(), transform_specs())))
    new = copy.deepcopy(doc)
    kind = draw(st.sampled_from(WEIGHTED))
    bodies = _bodies(new["model"], [])
    if kind == "seed":
        if not new.get("rngs"):
            reject()
        stream = draw(st.sampled_from(sorted(new["rngs"])))
        new["rngs"][stream] = f"fold_in({new['rngs'][stream]}, 7)" if isinstance(new["rngs"][stream], str) else 7
        return doc, new, kind, stream
    if kind == "separator":
        new["flax"]["fix_rng_separator"] = not new["flax"]["fix_rng_separator"]
        return doc, new, kind, None
    if kind == "partitionable":
        new["jax"]["threefry_partitionable"] = not new["jax"]["threefry_partitionable"]
        return doc, new, kind, None
    if kind in ("rename", "wrap"):
        bodies = [b for b in bodies if _modules(b)]
    if not bodies:
        reject()
    body = draw(st.sampled_from(bodies))
    if kind == "insert":
        body.insert(draw(st.integers(0, len(body))), copy.deepcopy(draw(st.sampled_from(INSERTS))))
    elif kind == "delete":
        if not body:
            reject()
        del body[draw(st.integers(0, len(body) - 1))]
    elif kind == "reorder":
        if len(body) < 2:
            reject()
        i = draw(st.integers(0, len(body) - 2))
        body[i], body[i + 1] = body[i + 1], body[i]
    how = None
    if kind in ("rename", "wrap"):
        i = draw(st.sampled_from(_modules(body)))
        if kind == "rename":
            body[i]["module"]["name"] = draw(st.sampled_from(("renamed", "encoder", "Block_7")))
        else:
            inner = body[i]["module"]
            outer = {k: inner.pop(k) for k in ("name", "repeat", "when") if k in inner}
            how = draw(st.sampled_from(("jit", "vmap", "remat")))
            opts = (
                {"axis_size": 2, "split_rngs": {"params": True}, "variable_axes": {"params": 0}}
                if how == "vmap"
                else {}
            )
            body[i] = {how: {"module": inner, **opts, **outer}}
    if kind == "split":
        found = []
        for node in _walk(new["model"]):
            if isinstance(node, dict) and isinstance(node.get("split_rngs"), (dict, str, bool)):
                found.append(node)
        if not found:
            reject()
        node = draw(st.sampled_from(found))
        # (`{all: false}` passes every stream unsplit; `{}` and `none` hide them, which Flax mostly refuses)
        node["split_rngs"] = draw(st.sampled_from(({}, {"params": True}, "all", "none", {"all": False})))
        return doc, new, kind, None
    if kind == "wrap":
        return doc, new, f"wrap {how}", None
    return doc, new, kind, None


def _walk(node):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _load(doc):
    try:
        return parse_spec(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False), "<fuzz>")
    except RngauditError:
        reject()


def _truth(spec) -> dict:
    """ident -> key of every key the spec's model hands out at run time, from derive."""
    out: dict = {}
    for c in rngaudit.derive(spec, values=False).calls:
        d = c.derivation
        if not d.discarded:
            out[(tuple(d.path), d.stream, d.count, tuple(d.lane))] = tuple(c.key) if c.key is not None else None
    return out


def _thing_truth(spec) -> dict:
    """(module path, label or kind, requested stream, lane, n-th) -> key of every thing that draws, from derive."""
    out: dict = {}
    rows = [c for c in rngaudit.derive(spec, values=False).calls if not c.derivation.discarded]
    # an eager variable's key is a make_rng passed to self.variable: Flax (and a keys file) names it a make_rng
    eager = _eager_variables(spec.model)
    rows.sort(key=lambda c: (tuple(c.derivation.path), c.derivation.stream_requested, c.derivation.lane))
    for c in sorted(rows, key=lambda c: c.derivation.count):
        d = c.derivation
        if d.kind == "jit_fork" or c.key is None:
            continue
        what = "make_rng" if d.kind == "variable" and d.location in eager else d.label or d.kind
        base = (tuple(d.path), what, d.stream_requested, tuple(d.lane))
        n = sum(1 for k in out if k[:4] == base)
        out[base + (n,)] = tuple(c.key)
    return out


_SCANNED_DENSES = {
    "rngaudit": 1,
    "flax": {"fix_rng_separator": False},
    "jax": {"prng_impl": "threefry2x32", "threefry_partitionable": False},
    "phase": "init",
    "rngs": {"params": 0, "dropout": 0},
    "model": {
        "scan": {
            "module": {
                "class": "Block",
                "setup": ["make_rng"],
                "body": [
                    {"module": {"class": "Dense", "body": []}},
                    {"module": {"class": "Dense", "setup": ["make_rng"], "body": []}},
                ],
            },
            "length": 1,
            "split_rngs": "all",
            "variable_axes": {"all": 0},
            "variable_broadcast": "params",
        }
    },
}


# the settings every hand-written example here starts from
_HEAD = {
    "rngaudit": 1,
    "flax": {"fix_rng_separator": False},
    "jax": {"prng_impl": "threefry2x32", "threefry_partitionable": False},
    "phase": "init",
    "rngs": {"params": 0},
}


_EAGER = {
    **_HEAD,
    "model": {
        "class": "Block",
        "body": [
            {"variable": {"collection": "state", "name": "w", "make_rng": ["params"], "eager": True, "when": "init"}},
            "make_rng",
        ],
    },
}


_SHIFTED_LANES = {
    **_HEAD,
    "rngs": {"params": 0, "dropout": 0},
    "model": {
        "scan": {
            "module": {
                "map_variables": {
                    "module": {
                        "class": "Block",
                        "setup": ["make_rng"],
                        "body": [
                            {
                                "while_loop": {
                                    "cond": [],
                                    "body": [],
                                    "iterations": 1,
                                    "split_rngs": "all",
                                    "when": "init",
                                }
                            },
                            {"make_rng": "dropout"},
                            "make_rng",
                        ],
                    },
                    "init": True,
                    "mutable": True,
                    "mapped_collections": "params",
                }
            },
            "length": 1,
            "split_rngs": "all",
            "variable_axes": {"all": 0},
            "check_constancy_invariants": False,
        }
    },
}


def _inserted(doc: dict) -> dict:
    """`doc` with a param inserted first in the setup of its scanned, mapped Block."""
    new = copy.deepcopy(doc)
    block = new["model"]["scan"]["module"]["map_variables"]["module"]
    block["setup"] = [{"param": "inserted"}, *block["setup"]]
    return new


_FOLDED = {
    **_HEAD,
    "model": {
        "class": "Block",
        "body": [
            {"fold_rngs": {"module": {"map_variables": {"module": {"Dense": {"use_bias": False}}, "init": True}}}},
            "make_rng",
        ],
    },
}
_FOLDED["model"]["body"][0]["fold_rngs"]["name"] = "a"


def _jitted_in_one_lane(jit: bool) -> dict:
    inner = {"class": "Block", "body": ["make_rng"] * 5}
    a = (
        {"jit": {"module": inner, "name": "a", "when": "init"}}
        if jit
        else {"module": dict(inner, name="a", when="init")}
    )
    lanes = {"vmap": {"module": {"class": "Block", "body": [a]}, "axis_size": 1, "split_rngs": "all"}}
    lanes["vmap"]["variable_axes"] = {"all": 0}
    mapped = {"module": lanes, "init": True, "mutable": True, "rngs": "all", "mapped_collections": "params"}
    return {
        "rngaudit": 1,
        "flax": {"fix_rng_separator": False},
        "jax": {"prng_impl": "threefry2x32", "threefry_partitionable": False},
        "phase": "init",
        "rngs": {"params": 0},
        "model": {"jit": {"module": {"map_variables": mapped}, "rngs": "all"}},
    }


def _renamed_first(model: dict) -> dict:
    model = copy.deepcopy(model)
    model["scan"]["module"]["body"][0]["module"]["name"] = "renamed"
    return model


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(refactors())
# found by 1,500 random refactors: a keyless module renamed frees its auto-name, so the sibling that draws moves onto
# a path that exists on both sides (Dense_1 -> Dense_0); it was "a call site that did not exist before"
@example(
    (
        _SCANNED_DENSES,
        {**_SCANNED_DENSES, "model": _renamed_first(_SCANNED_DENSES["model"])},
        "rename",
        None,
    )
)
# found by 1,500 kind-targeted refactors: nn.jit around a module in a one-lane vmap hides the split from the key's
# base, which read as "a different split" besides the jit fork that holds
@example((_jitted_in_one_lane(False), _jitted_in_one_lane(True), "wrap jit", None))
# (a deleted nn.fold_rngs module takes its fork with it: a jit-fork cause without nn.jit in either spec)
@example((_FOLDED, {**_FOLDED, "model": {"class": "Block", "body": ["make_rng"]}}, "delete", None))
# (a draw inserted before a while_loop's lanes shifts the counts: a count's lanes are another draw's now, and no
# "axis size changed" claim holds)
@example((_SHIFTED_LANES, _inserted(_SHIFTED_LANES), "insert", None))
# (an eager variable's key is a make_rng to Flax: a layer inserted before it shifts it, named so on both sides)
@example(
    (
        _EAGER,
        {**_EAGER, "model": {"class": "Block", "body": [{"param": "inserted"}, *_EAGER["model"]["body"]]}},
        "insert",
        None,
    )
)
def test_diff_of_random_refactors(case):
    old_doc, new_doc, kind, stream = case
    old, new = _load(old_doc), _load(new_doc)
    try:
        a, b = _truth(old), _truth(new)
    except RngauditError:
        reject()  # a model Flax refuses (InvalidRngError ...): diff reports it as an input error
    report = rngaudit.diff(old, new)  # any exception here is a crash: the test fails
    event(f"{kind}: {'changes' if report.failing else 'no change'}")
    truth = {}
    for ident in set(a) | set(b):
        if ident not in a:
            truth[ident] = "new"
        elif ident not in b:
            truth[ident] = "gone"
        else:
            truth[ident] = "kept" if a[ident] == b[ident] else "changed"
    got = {e.ident: e.status for e in report.entries}
    assert got == truth
    # every fix printed was applied to NEW and derived again (both sides are specs), and none that failed is printed
    for fix in report.fixes:
        assert "[checked: refused:" not in fix, (kind, fix)
        # (a module of a `repeat:` statement cannot be named alone in a spec: its fix stays unchecked)
        assert "[checked: " in fix or "repeat" in repr(new_doc), (kind, fix)
    # things: each old module followed to where diff's pairing puts it (renames and shifts it found from the keys
    # drawn), the keys of its draws from derive on both sides
    from rngaudit.refactor.compare import _moved, module_pairs
    from rngaudit.refactor.keys_file import spec_capture

    pairs = module_pairs(spec_capture("old", old), spec_capture("new", new))
    ta, tb = _thing_truth(old), _thing_truth(new)
    things = set()
    for (path, *rest), key in ta.items():
        to = _moved(path, pairs)
        if to is not None and (to, *rest) in tb and tb[(to, *rest)] != key:
            things.add((path, *rest))
    assert {(t.old_module, t.what, t.stream, t.lane, t.nth) for t in report.things} == things
    assert report.failing == (any(s != "kept" for s in truth.values()) or bool(things))
    for e in report.entries:
        if e.status != "kept":
            assert e.why, (kind, e.ident, e.status)
        if e.status != "changed":
            continue
        text = " | ".join(e.why)
        if kind == "seed" and e.site.stream == stream:
            assert f"the root key of stream {stream!r} differs" in text and "a different split" not in text, text
        if kind == "separator":
            assert "fix_rng_separator differs" in text, text
        if kind in ("seed", "separator", "partitionable"):
            assert "a new jit fork" not in text and "renamed" not in text, text
    _check_causes(report, kind, repr(old_doc) + repr(new_doc))


# Each cause an explanation can claim, the phrases that claim it, and the refactors under which it can hold. A
# claim outside its refactors is false: the fuzzer applied one refactor, so nothing else changed.
CAUSES = {
    "seed": (("the root key of stream",), {"seed"}),
    "separator": (("fix_rng_separator differs",), {"separator"}),
    "partitionable": (("threefry_partitionable differs",), {"partitionable"}),
    "release": (("flax ", "jax "), set()),
    # a fork comes or goes with nn.jit: wrapped now, or a jit module renamed, moved, deleted or shifted
    "jit": (("jit fork",), {"wrap jit", "rename", "delete", "insert", "reorder"}),
    "split": (("a different split", "lanes changed", "axis size changed"), {"split", "wrap vmap"}),
    "path": (
        ("renamed path", "shifted auto-name index", "was added", "its keys moved to", "; was "),
        {"rename", "insert", "delete", "reorder", "wrap jit", "wrap vmap", "wrap remat"},
    ),
    # an nn.scan/nn.vmap module and as many modules of its class beside it: unrolled (or rolled); a module wrapped
    # in a one-lane nn.vmap is such a roll
    "unroll": (("was unrolled into", "were rolled into"), {"wrap vmap"}),
    # nn.jit's fork draws from the parent's streams: the parent's later draws shift
    "count": (("shifted count", "count shift"), {"insert", "delete", "reorder", "wrap jit"}),
}
# what the refactor must be explained by whenever it changed, added or removed a key
EXPECTED = {
    "seed": "seed",
    "separator": "separator",
    "partitionable": "partitionable",
    "rename": "path",
}


def _claims(text: str) -> set:
    return {cause for cause, (phrases, _) in CAUSES.items() if any(p in text for p in phrases)}


def _check_causes(report, kind: str, docs: str) -> None:
    """Every cause claimed can hold under the refactor applied (a jit cause needs an nn.jit on a side), and the
    refactor's own cause is claimed where it moved a key."""
    claimed = set()
    for e in report.entries:
        if e.status == "kept":
            continue
        for why in e.why:
            if why in ("a call site that did not exist before", "this call site no longer exists"):
                continue
            if why.startswith("unexplained:"):  # (it lists the causes it ruled out)
                continue
            causes = _claims(why)
            claimed |= causes
            for cause in causes:
                allowed = CAUSES[cause][1]
                assert kind in allowed, (kind, cause, e.site.path_str, why)
                if cause == "jit":  # (nn.fold_rngs forks the streams as nn.jit does)
                    assert "jit" in docs or "fold_rngs" in docs, (kind, why)
    for note in report.notes:
        for cause in _claims(note) - {"release"}:
            assert kind in CAUSES[cause][1], (kind, cause, note)
    want = EXPECTED.get(kind)
    if want is not None and any(e.status != "kept" for e in report.entries):
        assert want in claimed or any(want in _claims(n) for n in report.notes), (kind, claimed, report.notes)


# ---------------------------------------------------------------- layer stacks: each layer followed by its options
# A stack of standard layers as public models write them (Dense, LayerNorm, Dropout, auto-named unless renamed),
# each with options no other layer of it has, so the truth of where each layer went needs no pairing by diff: a
# layer is found on both sides by its options, and its keys come from derive.
STACK_KINDS = ("Dense", "Dense", "LayerNorm", "Dropout")


def _layer(kind: str, k: int) -> dict:
    if kind == "Dense":
        return {"Dense": {"features": k}}
    if kind == "LayerNorm":
        return {"LayerNorm": {"epsilon": k / 1000}}
    return {"Dropout": {"rate": round(k / 200, 3), "deterministic": False}}


@st.composite
def stack_refactors(draw):
    kinds = draw(st.lists(st.sampled_from(STACK_KINDS), min_size=2, max_size=7))
    body = [_layer(kind, k) for k, kind in enumerate(kinds, start=2)]
    doc = {"rngaudit": 1, "rngs": {"params": 0, "dropout": 1}, "model": {"class": "Stack", "body": body}}
    new = copy.deepcopy(doc)
    nb = new["model"]["body"]
    kind = draw(st.sampled_from(("insert", "delete", "reorder", "rename")))
    if kind == "insert":
        nb.insert(draw(st.integers(0, len(nb))), _layer(draw(st.sampled_from(STACK_KINDS)), 99))
    elif kind == "delete":
        del nb[draw(st.integers(0, len(nb) - 1))]
    elif kind == "reorder":
        i = draw(st.integers(0, len(nb) - 2))
        nb[i], nb[i + 1] = nb[i + 1], nb[i]
    else:
        (opts,) = nb[draw(st.integers(0, len(nb) - 1))].values()
        opts["name"] = "renamed"
    return doc, new, kind


def _where(body: list) -> dict:
    """Each layer's options (its identity here) -> its module path, named as Flax names it."""
    seen: dict = {}
    out = {}
    for item in body:
        ((cls, opts),) = item.items()
        name = opts.get("name")
        if name is None:
            name = f"{cls}_{seen.get(cls, 0)}"
            seen[cls] = seen.get(cls, 0) + 1
        out[repr({k: v for k, v in opts.items() if k != "name"})] = (name,)
    return out


def _drawn(spec) -> dict:
    """(module path, label) -> key of every draw of the stack."""
    return {
        (tuple(c.derivation.path), c.derivation.label or c.derivation.kind): tuple(c.key)
        for c in rngaudit.derive(spec, values=False).calls
        if not c.derivation.discarded and c.key is not None
    }


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stack_refactors())
def test_diff_follows_each_layer_of_a_refactored_stack(case):
    old_doc, new_doc, kind = case
    old, new = _load(old_doc), _load(new_doc)
    report = rngaudit.diff(old, new)
    event(kind)
    wo, wn = _where(old_doc["model"]["body"]), _where(new_doc["model"]["body"])
    ko, kn = _drawn(old), _drawn(new)
    # the truth: a layer on both sides whose draw of a label got another key
    truth = set()
    for layer, po in wo.items():
        if layer not in wn:
            continue
        for (path, label), key in ko.items():
            if path == po and kn.get((wn[layer], label), key) != key:
                truth.add((po, wn[layer], label))
    got = {(t.old_module, t.new_module, t.what) for t in report.things}
    assert got == truth, (kind, old_doc, new_doc)
    assert report.failing == bool(truth or any(e.status != "kept" for e in report.entries))
    text = " | ".join([*(w for e in report.entries for w in e.why), *report.notes])
    _check_causes(report, kind, "")
    # an auto-name shift is claimed exactly when a layer of the inserted or deleted class came after it
    if kind in ("insert", "delete"):
        longer, shorter = (new_doc, old_doc) if kind == "insert" else (old_doc, new_doc)
        body = longer["model"]["body"]
        at = next(i for i, (a, b) in enumerate(zip(body, shorter["model"]["body"] + [None])) if a != b)
        cls = next(iter(body[at]))
        shifted = any(next(iter(item)) == cls for item in body[at + 1 :])
        assert ("shifted auto-name index" in text) == shifted, (kind, at, cls, text)
    for fix in report.fixes:
        assert "[checked: " in fix and "refused" not in fix, fix
