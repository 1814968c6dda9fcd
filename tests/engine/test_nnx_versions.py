"""NNX specs that name an older Flax (`flax: {version: ...}`): derive against the keys real Flax 0.10.2 and
0.11.0 handed out, recorded in tests/data/nnx_old_flax.json by tests/data/record_old_nnx.py (run with that
release installed), and the constructs a release lacks refused with the release that has them."""

from __future__ import annotations

import json

import pytest
from support import REPO, invoke, write

from rngaudit import FlaxError, SpecError, derive, parse_spec

RECORDED = json.loads((REPO / "tests" / "data" / "nnx_old_flax.json").read_text())
CASES = [(v, i, case) for v, entry in sorted(RECORDED.items()) for i, case in enumerate(entry["cases"])]


def test_the_recording_covers_both_rule_sets():
    assert set(RECORDED) == {"0.10.2", "0.11.0"}
    for entry in RECORDED.values():
        keys = [c for c in entry["cases"] if "keys" in c]
        assert len(keys) >= 30 and any(len(c["keys"]) > 10 for c in keys)


@pytest.mark.parametrize("version, i, case", CASES, ids=[f"{v}-{i}" for v, i, _ in CASES])
def test_derive_hands_out_the_keys_that_release_did(version, i, case):
    spec = parse_spec(case["spec"], f"<flax {version} case {i}>")
    assert spec.flax_version == version
    if "error" in case:
        with pytest.raises(FlaxError) as e:
            derive(spec)
        assert e.value.flax_error == case["error"]
        return
    ours = [[c.derivation.step, c.derivation.tag, c.derivation.count, list(c.key)] for c in derive(spec).calls]
    if "vmap:" in case["spec"] or "stack:" in case["spec"] or "scan:" in case["spec"]:
        # (under transforms NNX hands out a draw's keys lane by lane; a broadcast stream's once for all lanes)
        report = derive(spec)
        ours = [
            [c.derivation.step, c.derivation.tag, c.derivation.count, list(c.key)]
            for c in report.calls
            if not ("vmap" in c.derivation.broadcast and c.derivation.lane > 0)
        ]
        assert sorted(ours) == sorted(case["keys"])
    else:
        assert ours == case["keys"]


def test_before_0_11_dropout_draws_from_the_callers_stream():
    """flax 0.10.2 (recorded): no fork at construction; the first mask is fold_in(key(1), 0), the dropout
    stream's own first key, and both Dropouts and the attention share its counter."""
    case = RECORDED["0.10.2"]["cases"][0]
    report = derive(parse_spec(case["spec"]))
    assert not [c for c in report.calls if c.derivation.kind == "fork"]
    step1 = [c for c in report.calls if c.derivation.step == 1]
    assert [c.derivation.count for c in step1] == [0, 1, 2]
    assert [c.derivation.stream for c in step1] == ["rngs.dropout"] * 3
    assert report.rules.startswith("flax<0.11")
    # the same model under the current rules forks at construction (a different first mask)
    now = derive(parse_spec(case["spec"].replace("flax: {version: '0.10.2'}\n", "")))
    assert now.rules.startswith("flax>=0.11") and [c for c in now.calls if c.derivation.kind == "fork"]


def test_reseed_before_0_11_gives_every_stream_the_key_itself():
    """0.10.2 (recorded): nnx.reseed(model, dropout=3) sets the dropout stream to key(3), count 0."""
    case = RECORDED["0.10.2"]["cases"][0]
    report = derive(parse_spec(case["spec"]))
    after = [c for c in report.calls if c.derivation.step == 3]
    assert after[0].derivation.chain == ("key 3 (nnx.reseed)",) and after[0].derivation.count == 0


@pytest.mark.parametrize(
    "version, body, message",
    [
        ("0.10.2", "init: [{module: {name: b, class: B, rngs: fork}}]", "rngs: fork is flax 0.11 and later"),
        ("0.11.0", "init: [{MultiHeadAttention: {keep_rngs: false}}]", "keep_rngs is flax 0.11.1 and later"),
        ("0.11.2", "init: [InstanceNorm]", "InstanceNorm is flax 0.12 and later"),
        (
            "0.10.2",
            "init: [{module: {name: s, class: S, stack: 2, init: [{Dropout: {rate: 0.5}}]}}]",
            "before flax 0.11 keeps the Rngs it is given",
        ),
    ],
)
def test_what_a_release_lacks(tmp_path, version, body, message):
    path = write(
        tmp_path,
        "old.yaml",
        f"rngaudit: 1\nflavour: nnx\nflax: {{version: '{version}'}}\nrngs: {{params: 0}}\nmodel: {{class: M, {body}}}\n",
    )
    with pytest.raises(SpecError, match=message):
        derive(path)
    r = invoke("derive", path)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "flax, message",
    [
        ("{version: 0.10}", "quote it"),
        ("{version: 'ten'}", "not a Flax release"),
        ("{version: '0.7.5'}", "has no NNX"),
        ("{fix_rng_separator: true}", "Linen setting"),
        ("{versoin: '0.10.2'}", "did you mean 'version'"),
    ],
)
def test_bad_versions(tmp_path, flax, message):
    path = write(
        tmp_path, "v.yaml", f"rngaudit: 1\nflavour: nnx\nflax: {flax}\nrngs: {{params: 0}}\nmodel: {{class: M}}\n"
    )
    r = invoke("derive", path)
    assert r.exit_code == 2 and message in r.stderr and r.stderr.startswith(f"error: {path}:")


def test_the_rules_are_named_in_every_report(tmp_path):
    case = RECORDED["0.10.2"]["cases"][0]
    path = write(tmp_path, "old.yaml", case["spec"])
    assert "rules: flax<0.11" in invoke("derive", path).stdout
    assert json.loads(invoke("derive", path, "-f", "json").stdout)["rules"].startswith("flax<0.11")
    doc = json.loads(invoke("collisions", path, "-f", "json").stdout)
    assert doc["inputs"][0]["rules"].startswith("flax<0.11")


def test_the_upgrade_check_of_an_nnx_model_names_the_dropout_fork(tmp_path):
    """diff --from-flax 0.10.2 --to-flax 0.11.0 of the recorded guide model (each side's keys checked against
    that release above): every key that moves is a Dropout's or attention's, and says why."""
    text = RECORDED["0.10.2"]["cases"][0]["spec"].replace("flax: {version: '0.10.2'}\n", "")
    spec = write(tmp_path, "m.yaml", text)
    r = invoke("diff", spec, "--from-flax", "0.10.2", "--to-flax", "0.11.0", "--format", "json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    moved = [s for s in doc["sites"] if s["status"] != "kept"]
    assert moved and all(s["path"][0] in ("drop", "attn", "d2") for s in moved)
    assert all(any("from flax 0.11.0, nnx.Dropout and attention fork" in w for w in s["why"]) for s in moved)
    assert invoke("diff", spec, "--from-flax", "0.11.0", "--to-flax", "newest").exit_code == 0
