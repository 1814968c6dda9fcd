"""The refactor fuzzer on keys files (issue 18): random models and random refactors of them (test_diff_fuzz's),
each side built in real Flax and captured with `rngaudit capture` (a process per side), then diffed as keys
files and as a mix of spec and keys file. Checked: no crash, the sets (kept/changed/new/gone) equal the truth
from both specs' derived keys, the same sets and the same things whichever inputs are given.

The default run draws a few (each side is a capture process); RNGAUDIT_DIFF_CAPTURE_EXAMPLES=200 for a sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from hypothesis import HealthCheck, event, example, given, reject, settings

import rngaudit
from refactor.test_diff_fuzz import _load, _truth, refactors
from rngaudit import RngauditError

EXAMPLES = int(os.environ.get("RNGAUDIT_DIFF_CAPTURE_EXAMPLES", "4"))
FACTORY = Path(__file__).with_name("oracle_factory.py")


def _capture(spec_path: Path, doc: dict, keys: Path) -> bool:
    """Capture the spec's model built in real Flax; False when capture cannot run it (not a crash)."""
    rngs = doc.get("rngs") or {}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in rngs.values()):
        return False  # (capture's --rngs takes integer seeds)
    env = dict(os.environ, RNGAUDIT_ORACLE_SPEC=str(spec_path), NO_COLOR="1")
    env.pop("RNGAUDIT_DEBUG", None)
    args = [sys.executable, "-m", "rngaudit", "capture", f"{FACTORY}:make", "--keys", str(keys)]
    args += ["-o", str(keys.with_suffix(".yaml")), "--phase", doc.get("phase", "init")]
    if rngs:
        args += ["--rngs", ",".join(f"{k}={v}" for k, v in rngs.items())]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode in (0, 2), r.stderr  # 3 is an internal error: a bug
    if r.returncode == 2:
        event(f"capture refused: {r.stderr.split(':')[-1].strip()[:60]}")
    return r.returncode == 0


# the settings every hand-written example here starts from
_HEAD = {
    "rngaudit": 1,
    "flax": {"fix_rng_separator": False},
    "jax": {"prng_impl": "threefry2x32", "threefry_partitionable": False},
    "phase": "apply",
    "rngs": {"params": 0},
}


def _jit_nine(jit: bool) -> dict:
    module = {"class": "9", "body": [{"make_rng": {"stream": "params", "draw": {"normal": [2]}}}]}
    statement = {"jit": {"module": module, "name": "_"}} if jit else {"module": dict(module, name="_")}
    return {**_HEAD, "model": {"class": "Block", "body": [statement]}}


def _eager_variable(kept: bool) -> dict:
    setup = [{"variable": {"collection": "state", "name": "w", "make_rng": ["params"], "eager": True}}]
    return {
        **_HEAD,
        "mutable": True,  # (capture narrows it to [state], and the spec diffed is this one, rewritten so)
        "model": {"class": "Block", **({"setup": setup} if kept else {}), "body": ["make_rng", "make_rng"]},
    }


def _unconditional(doc):
    if isinstance(doc, dict):
        return {k: _unconditional(v) for k, v in doc.items() if k != "when"}
    if isinstance(doc, list):
        return [_unconditional(v) for v in doc]
    return doc


def _mutable(doc: dict):
    m = doc.get("mutable", False) if doc.get("phase") == "apply" else False
    return sorted(m) if isinstance(m, list) and m else bool(m)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(refactors())
# found by 80 random captures: Flax names nn.jit of class `9` Jit9, which diff did not read as the same class, so two
# keys files said nothing of the thing whose key moved (its make_rng now at count 2, after the fork)
@example((_jit_nine(False), _jit_nine(True), "wrap jit", None))
# found by the same sweep: an eager variable's key (a make_rng passed as an argument) is a plain make_rng in a keys
# file but was a `variable` in the spec, so a spec and a keys file listed two make_rngs whose key moved
@example((_eager_variable(True), _eager_variable(False), "delete", None))
def test_diff_of_captured_keys_files(tmp_path_factory, case):
    old_doc, new_doc, kind, _ = case
    # (the oracle's builder runs `when:` by its own phase flag, which a capture process cannot flip: each statement
    # runs unconditionally on both sides, the refactor unchanged)
    old_doc, new_doc = _unconditional(old_doc), _unconditional(new_doc)
    old, new = _load(old_doc), _load(new_doc)
    try:
        _truth(old), _truth(new)
    except RngauditError:
        reject()
    tmp = tmp_path_factory.mktemp("capture")
    paths = {}
    for side, doc in (("old", old_doc), ("new", new_doc)):
        spec = tmp / f"{side}.yaml"
        spec.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
        if not _capture(spec, doc, tmp / f"{side}.json"):
            reject()
        # capture applies with every collection init made but params mutable, and its spec says so: the truth is
        # derived from the refactored spec applied the same way
        applied = yaml.safe_load((tmp / f"{side}.yaml").read_text()).get("mutable", False)
        if doc.get("phase") == "apply" and _mutable(doc) != _mutable({"phase": "apply", "mutable": applied}):
            doc["mutable"] = applied
            spec.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
        paths[side] = spec
    old, new = _load(old_doc), _load(new_doc)
    try:
        a, b = _truth(old), _truth(new)
    except RngauditError:
        reject()
    truth = {}
    for ident in set(a) | set(b):
        truth[ident] = (
            "new" if ident not in a else "gone" if ident not in b else "kept" if a[ident] == b[ident] else "changed"
        )
    event(kind)
    things: list[set] = []
    for pair in (
        (tmp / "old.json", tmp / "new.json"),
        (paths["old"], tmp / "new.json"),
        (tmp / "old.json", paths["new"]),
    ):
        report = rngaudit.diff(*map(str, pair))  # any exception is a crash: the test fails
        got = {e.ident: e.status for e in report.entries}
        assert got == truth, pair
        assert report.failing == (any(s != "kept" for s in truth.values()) or bool(report.things))
        things.append({(t.old_module, t.new_module, t.what, t.nth, t.stream, t.lane) for t in report.things})
        for e in report.entries:
            if e.status != "kept":
                assert e.why, (kind, e.ident, e.status)
    # the same things from keys files and from a mix (where both sides record modules, pairing by hyper-parameters
    # may follow a module the keys alone cannot: a keys file pair may name more, never other, things)
    assert things[1] == things[2] and things[1] <= things[0], things
