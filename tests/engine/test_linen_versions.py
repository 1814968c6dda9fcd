"""Linen specs that name an older Flax (`flax: {version: ...}`): derive against the keys real Flax 0.8.x,
0.10.0, 0.10.1 and 0.10.2 handed out (recorded in tests/data/linen_old_flax.json by tests/data/record_old_linen.py,
run in a virtualenv of each release), the upgrade check (`diff --from-flax A --to-flax B`) against the keys
that differ between two recorded releases, and the constructs a release lacks refused with the release that
has them."""

from __future__ import annotations

import json
import os

import pytest
from support import REPO, invoke, write

from rngaudit import FlaxError, SpecError, derive, diff, parse_spec
from rngaudit.spec.releases import FlaxRules

# (benchmarks/version_matrix.py points this at the recording it has just made)
RECORDING = os.environ.get("RNGAUDIT_LINEN_RECORDING", str(REPO / "tests" / "data" / "linen_old_flax.json"))
with open(RECORDING, encoding="utf-8") as f:
    RECORDED = json.load(f)
CASES = [(v, i, case) for v, entry in sorted(RECORDED.items()) for i, case in enumerate(entry["cases"])]
PROBES = [(v, p) for v, entry in sorted(RECORDED.items()) for p in entry["probes"]]


def _rows(report) -> list:
    return [
        [
            list(c.derivation.path),
            c.derivation.stream_requested,
            c.derivation.stream,
            c.derivation.count,
            list(c.derivation.lane),
            list(c.key),
        ]
        for c in report.calls
        if not c.derivation.discarded
    ]


def test_the_recording_covers_every_nn_jit_rule_and_the_fallback():
    rules = {FlaxRules(tuple(int(x) for x in v.split("."))).jit for v in RECORDED}
    assert rules == {"transparent", "fold", "fork"}
    assert any(not FlaxRules(tuple(int(x) for x in v.split("."))).stream_fallback for v in RECORDED)
    for entry in RECORDED.values():
        keyed = [c for c in entry["cases"] if "rows" in c]
        assert len(keyed) >= 20 and any(len(c["rows"]) > 10 for c in keyed)
        assert any("jit:" in c["spec"] for c in keyed)


@pytest.mark.parametrize("version, i, case", CASES, ids=[f"{v}-{i}" for v, i, _ in CASES])
def test_derive_hands_out_the_keys_that_release_did(version, i, case):
    spec = parse_spec(case["spec"], f"<flax {version} case {i}>")
    assert spec.flax_version == version
    if "error" in case:
        with pytest.raises(FlaxError) as e:
            derive(spec)
        assert e.value.flax_error == case["error"]
        return
    assert _rows(derive(spec)) == case["rows"]


def _flat(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, path + (k,))
    else:
        yield path, tree


def _lanes(v) -> list:
    return v if isinstance(v[0], list) else [v]


@pytest.mark.parametrize("version, probe", PROBES, ids=[f"{v}-{p['name']}" for v, p in PROBES])
def test_derive_hands_out_the_keys_of_each_probe_model(version, probe):
    """The probe models (read off the variables, each in a fresh process): a param's value is its key, each
    make_rng's key is sown. Among them, jax reusing an nn.jit trace (flax 0.9.0 to 0.10.1): a second instance
    of one jitted class called twice gets the same key twice."""
    spec = parse_spec(probe["spec"], f"<flax {version} probe {probe['name']}>")
    real = probe["variables"]
    if "error" in real:
        with pytest.raises(FlaxError) as e:
            derive(spec)
        assert e.value.flax_error == real["error"]
        return
    ours: dict = {}
    for c in derive(spec).calls:
        # (a jit fork's own key is in no variable, and a key of a trace Flax throws away is in none either)
        if c.derivation.kind in ("param", "make_rng") and not c.derivation.discarded:
            ours.setdefault((tuple(c.derivation.path), c.derivation.kind), []).append(list(c.key))
    expected: dict = {}
    for path, v in _flat(real.get("params", {})):
        expected.setdefault((path[:-1], "param"), []).extend(_lanes(v))
    for path, v in _flat(real.get("keys", {})):
        # a key sown by the module that drew it ('d'), or by its parent as '<child>@d'
        where = path[:-1] + ((path[-1].split("@")[0],) if "@" in path[-1] else ())
        for sown in v:
            expected.setdefault((where, "make_rng"), []).extend(_lanes(sown))
    assert ours == expected


def test_jax_reuses_a_jitted_trace_before_0_10_2_and_the_second_call_repeats_its_key():
    """flax 0.10.1 (recorded): b reuses a's nn.jit trace (the same fields, counters and variables), so b's
    counters do not move and its second call draws the first call's dropout key; derive says why."""
    probe = next(p for p in RECORDED["0.10.1"]["probes"] if p["name"] == "two_instances_called_twice")
    d = probe["variables"]["keys"]["b@d"]
    assert d[0] == d[1]
    report = derive(parse_spec(probe["spec"]))
    b = [c for c in report.calls if c.derivation.path == ("b",) and c.derivation.kind == "make_rng"]
    assert [c.derivation.count for c in b] == [1, 1] and b[0].key == b[1].key
    assert any("jax reused the trace nn.jit made at a" in n for n in b[0].derivation.notes)
    # from 0.10.2 the fork moves every call's counts
    now = derive(parse_spec(probe["spec"].replace("version: '0.10.1'", "version: '0.10.2'")))
    b = [c for c in now.calls if c.derivation.path == ("b",) and c.derivation.kind == "make_rng"]
    assert b[0].key != b[1].key


def _idents(rows) -> dict:
    return {(tuple(r[0]), r[2], r[3], tuple(r[4])): tuple(r[5]) for r in rows}


def _unversioned(text: str, version: str) -> str:
    """A recorded spec with its release replaced by a placeholder (the random ones write it unquoted)."""
    return text.replace(f"version: '{version}'", "version: '0.12.0'").replace(
        f"version: {version}\n", "version: 0.12.0\n"
    )


UPGRADES = [
    ("0.8.1", "0.8.2"),
    ("0.8.5", "0.9.0"),
    ("0.8.1", "0.8.5"),
    ("0.8.5", "0.10.0"),
    ("0.10.0", "0.10.1"),
    ("0.10.1", "0.10.2"),
    ("0.8.5", "0.10.2"),
    ("0.10.2", "0.8.1"),
]


@pytest.mark.parametrize("old, new", UPGRADES)
def test_the_upgrade_check_lists_exactly_the_keys_the_two_releases_hand_out_differently(tmp_path, old, new):
    """diff --from-flax OLD --to-flax NEW of each hand-written spec (the first: nn.jit, a fallback stream and
    nn.vmap): changed, new and gone are the keys that differ between the two real releases."""
    if old not in RECORDED or new not in RECORDED:
        pytest.fail(f"the recording lacks flax {old} or {new}: run tests/data/record_old_linen.py there")
    checked = 0
    later = {_unversioned(b["spec"], new): b for b in RECORDED[new]["cases"] if "rows" in b}
    for a in RECORDED[old]["cases"]:
        text = _unversioned(a["spec"], old)
        b = later.get(text)
        if b is None or "rows" not in a:
            continue
        path = write(tmp_path, f"case{checked}.yaml", text)
        cmp = diff(path, from_flax=old, to_flax=new)
        ra, rb = _idents(a["rows"]), _idents(b["rows"])
        moved = {k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
        listed = {e.ident for e in cmp.entries if e.status != "kept"}
        assert listed == moved
        for e in cmp.entries:
            if e.status != "kept":
                assert e.why and any("flax" in w for w in e.why)
        checked += 1
    assert checked >= 3


def test_the_upgrade_check_on_the_cli_says_which_rule_moved_each_key(tmp_path):
    text = RECORDED["0.10.1"]["cases"][0]["spec"]
    spec = write(tmp_path, "model.yaml", text)
    r = invoke("diff", spec, "--from-flax", "0.10.1", "--to-flax", "0.10.2")
    assert r.exit_code == 1
    assert "from flax 0.10.2, nn.jit forks a fresh key per stream" in r.stdout
    assert "(flax 0.10.1) -> " in r.stdout and "(flax 0.10.2)" in r.stdout
    r = invoke("diff", spec, "--from-flax", "0.10.2", "--to-flax", "newest", "--format", "json")
    assert r.exit_code == 0, r.stdout  # 0.10.2 has the newest Linen rules: nothing moves
    r = invoke("diff", spec, "--from-flax", "0.10.1", "--to-flax", "0.10.1")
    assert r.exit_code == 0
    r = invoke("diff", spec, "--from-jax", "0.4.38", "--to-jax", "0.5.0")
    assert r.exit_code == 0  # the spec pins threefry_partitionable: a JAX upgrade does not move it
    spec = write(tmp_path, "unpinned.yaml", text.replace("jax: {threefry_partitionable: false}\n", ""))
    r = invoke("diff", spec, "--from-jax", "0.4.38", "--to-jax", "0.5.0")
    assert r.exit_code == 1
    assert "jax_threefry_partitionable defaults to true" in r.stdout
    moved = [line for line in r.stdout.splitlines() if line.startswith(("CHANGED", "NEW", "GONE"))]
    assert moved and all("VmapLeaf_0" in line for line in moved)  # only the split lanes move


@pytest.mark.parametrize(
    "args, message",
    [
        (["--from-flax", "ten"], "--from-flax 'ten' is not a release like 0.10.2"),
        (["--to-flax", "0.7.5"], "rngaudit has Flax's rules from 0.8.0 on"),
        ([], "give NEW, or --from-flax/--to-flax"),
    ],
)
def test_bad_upgrade_options_are_usage_errors(tmp_path, args, message):
    spec = write(tmp_path, "m.yaml", "rngaudit: 1\nmodel: {class: M, body: [make_rng]}\n")
    r = invoke("diff", spec, *args)
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_the_upgrade_check_refuses_a_keys_file(tmp_path):
    keys = write(tmp_path, "k.json", json.dumps({"format": "rngaudit.capture"}))
    r = invoke("diff", keys, "--to-flax", "0.10.1")
    assert r.exit_code == 2 and "give spec files (YAML), not a keys file" in r.stderr


@pytest.mark.parametrize(
    "flax, body, message",
    [
        ("0.10.1", "[{fold_rngs: {module: {class: A, body: [make_rng]}}}]", "nn.fold_rngs is flax 0.10.2 and later"),
        (
            "0.10.2",
            "[{scan: {module: {class: A, body: [make_rng]}, length: 2, check_constancy_invariants: false}}]",
            "nn.scan's check_constancy_invariants is flax 0.11.0 and later",
        ),
        ("0.7.5", "[make_rng]", "rngaudit has Flax's rules from 0.8.0 on; flax 0.7.5 is older"),
        ("ten", "[make_rng]", "`version` 'ten' is not a Flax release like '0.10.2'"),
        (0.1, "[make_rng]", "`version` is text: quote it"),
    ],
)
def test_a_release_that_lacks_a_construct_is_refused(flax, body, message):
    version = f"'{flax}'" if isinstance(flax, str) else flax
    with pytest.raises(SpecError) as e:
        parse_spec(f"rngaudit: 1\nflax: {{version: {version}}}\nmodel: {{class: M, body: {body}}}\n", "m.yaml")
    assert message in str(e.value) and str(e.value).startswith("m.yaml:")


def test_the_upgrade_check_refuses_a_construct_the_target_release_lacks(tmp_path):
    spec = write(
        tmp_path,
        "m.yaml",
        "rngaudit: 1\nmodel: {class: M, body: [{fold_rngs: {module: {class: A, body: [make_rng]}}}]}\n",
    )
    r = invoke("diff", spec, "--from-flax", "0.10.1")
    assert (
        r.exit_code == 2
        and "nn.fold_rngs is flax 0.10.2 and later; --from-flax (OLD side) says flax 0.10.1" in r.stderr
    )


def test_before_0_8_2_a_stream_not_passed_raises_and_the_message_says_since_when():
    spec = parse_spec(
        "rngaudit: 1\nflax: {version: '0.8.1'}\nrngs: {params: 0}\nmodel: {class: M, body: [{make_rng: noise}]}\n"
    )
    with pytest.raises(FlaxError) as e:
        derive(spec)
    assert e.value.flax_error == "InvalidRngError"
    assert "has no fallback to 'params': it came in 0.8.2" in str(e.value) and "(or `params:`)" not in str(e.value)


def test_a_jax_release_sets_threefry_partitionable_s_default_and_the_flag_wins():
    def flag(jax: str) -> bool:
        return parse_spec(f"rngaudit: 1\njax: {jax}\nmodel: {{class: M, body: [make_rng]}}\n").threefry_partitionable

    assert flag("{version: '0.4.38'}") is False
    assert flag("{version: '0.5.0'}") is True
    assert flag("{version: '0.4.38', threefry_partitionable: true}") is True


def test_every_report_names_its_rule_set(tmp_path):
    spec = write(
        tmp_path, "m.yaml", "rngaudit: 1\nflax: {version: '0.10.1'}\nrngs: 0\nmodel: {class: M, body: [make_rng]}\n"
    )
    r = invoke("derive", spec)
    assert "rules: flax 0.10.1 (Linen: nn.jit folds the path into the key at its boundary)" in r.stdout
    doc = json.loads(invoke("derive", spec, "--format", "json").stdout)
    assert (
        doc["flax"]["version"] == "0.10.1" and doc["flax"]["jit"] == "fold" and doc["rules"].startswith("flax 0.10.1")
    )
    doc = json.loads(invoke("collisions", spec, "--format", "json").stdout)
    assert doc["inputs"][0]["rules"].startswith("flax 0.10.1")
    assert "rules: flax 0.10.1" in invoke("collisions", spec).stdout
    plain = write(tmp_path, "p.yaml", "rngaudit: 1\nrngs: 0\nmodel: {class: M, body: [make_rng]}\n")
    assert "rules: flax>=0.10.2" in invoke("derive", plain).stdout


def test_verify_says_when_the_spec_s_flax_rules_are_not_the_run_s():
    """A spec under flax 0.10.1's rules against what flax 0.10.2 handed out (recorded): the keys under nn.jit
    differ, and verify names the rules, not the model, as the cause."""
    from rngaudit import verify
    from rngaudit.refactor.keys_file import spec_capture

    old = RECORDED["0.10.1"]["cases"][0]["spec"]
    run = spec_capture("flax 0.10.2 run", parse_spec(old.replace("version: '0.10.1'", "version: '0.10.2'")))
    assert run.settings["flax_version"] == "0.10.2"
    cmp = verify(parse_spec(old), run)
    differs = [e for e in cmp.entries if e.status != "same"]
    assert differs and all("JitBlock_0" in e.site.path_str for e in differs)
    assert all("the spec's Flax rules (flax 0.10.1) are not the run's (flax 0.10.2)" in e.why for e in differs)
    assert any("set `flax: {version: '0.10.2'}` in the spec" in n for n in cmp.notes)


def test_the_upgrade_check_puts_down_to_the_releases_only_what_they_move(tmp_path):
    """OLD and NEW differ by a model edit (a jitted block added) and by their releases: the block's keys are new
    because of the edit, and only the jit fork rows, which exist because of 0.10.2's rule, name the rule."""
    base = write(tmp_path, "base.yaml", "rngaudit: 1\nrngs: {params: 0}\nmodel: {class: M, body: [Dense]}\n")
    edit = write(
        tmp_path,
        "edit.yaml",
        "rngaudit: 1\nrngs: {params: 0}\nmodel: {class: M, body: [Dense, {jit: {module: {class: B, body: [Dense]}}}]}\n",
    )
    cmp = diff(base, edit, from_flax="0.10.1", to_flax="0.10.2")
    rule = "from flax 0.10.2, nn.jit forks"
    for e in cmp.entries:
        named = any(w.startswith(rule) for w in e.why)
        assert named == (e.site.kind == "jit_fork"), (e.site.path_str, e.site.kind, e.why)


def test_a_flag_the_spec_pins_does_not_move_on_a_jax_upgrade(tmp_path):
    spec = write(
        tmp_path,
        "m.yaml",
        "rngaudit: 1\njax: {threefry_partitionable: true}\nrngs: {params: 0}\nmodel:\n"
        "  class: M\n  body: [{vmap: {module: {class: L, body: [param: k]}, axis_size: 2, "
        "variable_axes: {params: 0}, split_rngs: {params: true}}}]\n",
    )
    r = invoke("diff", spec, "--from-jax", "0.4.38", "--to-jax", "0.5.0")
    assert r.exit_code == 0 and "it moves no key of this model" in r.stdout
    # a split root key moves with the flag, and says why
    split = write(
        tmp_path, "s.yaml", "rngaudit: 1\nrngs: {params: 'split(key(0), 2)[1]'}\nmodel: {class: M, body: [Dense]}\n"
    )
    cmp = diff(split, from_jax="0.4.38", to_jax="0.5.0")
    moved = [e for e in cmp.entries if e.status != "kept"]
    assert moved and all(any(w.startswith("from jax 0.5.0") for w in e.why) for e in moved)


def test_a_downgrade_across_two_rules_names_the_rule_it_goes_back_to(tmp_path):
    spec = write(tmp_path, "m.yaml", RECORDED["0.10.1"]["cases"][0]["spec"])
    cmp = diff(spec, from_flax="newest", to_flax="0.8.5")
    jit = {w for e in cmp.entries for w in e.why if "nn.jit" in w and w.startswith("before flax")}
    assert jit == {
        (
            "before flax 0.9.0, nn.jit is transparent (keys inside hash the whole path, as without nn.jit), and the "
            "jitted module's setup() runs only inside the trace (from 0.10.2: nn.jit forks a fresh key per stream "
            "(one make_rng at the jitted module's scope, on every call) and keys inside derive from it)"
        )
    }


def test_a_keys_file_that_does_not_say_its_release_has_unknown_rules(tmp_path):
    """versions missing or not a release number: no crash, no rule put down to any key, `unknown` named."""
    from rngaudit.refactor.keys_file import capture_to_json, spec_capture

    spec = parse_spec(RECORDED["0.10.1"]["cases"][0]["spec"])
    doc = capture_to_json(spec_capture("m", spec))
    for versions in ({}, {"flax": "main", "jax": 0.1}, {"flax": ["0.10.1"]}):
        doc["versions"] = versions
        keys = write(tmp_path, "k.json", json.dumps(doc))
        r = invoke("diff", keys, keys, "--format", "json")
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["rules"] == {"old": "flax unknown, jax unknown", "new": "flax unknown, jax unknown"}
        r = invoke("verify", write(tmp_path, "m.yaml", RECORDED["0.10.1"]["cases"][0]["spec"]), "--against", keys)
        assert r.exit_code == 0 and "Traceback" not in r.stderr


def test_an_error_for_a_construct_names_the_option_that_asked_for_the_release(tmp_path):
    spec = write(
        tmp_path,
        "m.yaml",
        "rngaudit: 1\nrngs: 0\nmodel: {class: M, body: [{fold_rngs: {module: {class: A, body: [make_rng]}}}]}\n",
    )
    r = invoke("diff", spec, "--to-flax", "0.10.1")
    assert r.exit_code == 2 and "--to-flax (NEW side) says flax 0.10.1" in r.stderr


def test_collisions_tell_a_reused_jit_trace_from_a_concatenation():
    """two_instances_called_twice under 0.10.1 (recorded: b's two calls draw one key): class 1 jit_trace_reuse,
    no rename offered; a concatenation inside folded paths is fixed by the separator, as the check says."""
    from rngaudit import collisions

    probe = next(p for p in RECORDED["0.10.1"]["probes"] if p["name"] == "two_instances_called_twice")
    (c,) = collisions(parse_spec(probe["spec"], "p.yaml")).audits[0].collisions
    assert c.category == "jit_trace_reuse" and c.failing and not c.renames
    spec = parse_spec(
        "rngaudit: 1\nflax: {version: '0.10.1'}\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n"
        "    - module: {class: X, name: a, body: [{jit: {name: bc, module: {class: B, body: [make_rng]}}}]}\n"
        "    - module: {class: X, name: ab, body: [{jit: {name: c, module: {class: B, body: [make_rng]}}}]}\n",
        "c.yaml",
    )
    (c,) = collisions(spec).audits[0].collisions
    assert c.category == "concatenation" and c.separator.removes
