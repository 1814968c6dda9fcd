"""The Python API (rngaudit.derive, collisions, shard_check, capture, verify, diff, findings): each takes a path
(str or pathlib.Path) or an already-loaded spec, returns the report the command renders, and raises the
command's errors as exceptions."""

from __future__ import annotations

import json

import pytest
from support import REPO
from typer.testing import CliRunner

import rngaudit
from rngaudit.cli import app
from rngaudit.output.collisions_json import to_json as collisions_json
from rngaudit.output.compare_json import to_json as compare_json
from rngaudit.output.derive_json import to_json as derive_json

GUIDE = REPO / "rngaudit" / "examples" / "guide.yaml"
LATENT = REPO / "fixtures" / "collisions" / "latent.yaml"
HASH_WORD = REPO / "fixtures" / "collisions" / "hash_word.yaml"
PATHS = REPO / "fixtures" / "collisions" / "paths.json"
MODELS = REPO / "tests" / "golden" / "models"


def cli_json(*args) -> tuple[int, dict]:
    r = CliRunner().invoke(app, [str(a) for a in args] + ["-f", "json"])
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.parametrize("given", [str(GUIDE), GUIDE, rngaudit.load_spec(str(GUIDE))], ids=["str", "path", "spec"])
def test_derive_takes_a_path_or_a_spec_and_returns_what_the_command_prints(given):
    report = rngaudit.derive(given)
    assert isinstance(report, rngaudit.DeriveReport)
    _, doc = cli_json("derive", GUIDE)
    assert derive_json(report) == doc
    assert next(c.key for c in report.calls) == tuple(doc["calls"][0]["key"])


def test_derive_options_are_the_commands():
    report = rngaudit.derive(GUIDE, phase="init", values=False, streams=["params"], limit=2)
    _, doc = cli_json("derive", GUIDE, "--phase", "init", "--no-values", "--stream", "params", "--limit", "2")
    assert derive_json(report) == doc and len(report.calls) == 2 and report.total == 6


def test_collisions_report_fails_as_the_command_exits():
    report = rngaudit.collisions(HASH_WORD, str(PATHS), LATENT)
    code, doc = cli_json("collisions", HASH_WORD, PATHS, LATENT)
    assert collisions_json(report.audits) == doc
    assert report.failing is (code == 1) is True
    assert [f.rule for f in rngaudit.findings(report)][:1] == ["collisions/hash-word"]
    latent_only = rngaudit.collisions(LATENT)
    assert not latent_only.failing and rngaudit.collisions(LATENT, strict=True).failing
    assert rngaudit.collisions(LATENT, fail_on=["latent"]).failing
    with pytest.raises(rngaudit.UsageError, match="fail_on 'hash-word'"):
        rngaudit.collisions(LATENT, fail_on=["hash-word"])


def test_diff_and_verify_take_specs_keys_files_and_captures(tmp_path):
    old, new = REPO / "fixtures" / "guide" / "make_rng_key0.yaml", REPO / "fixtures" / "guide" / "make_rng_key1.yaml"
    cmp = rngaudit.diff(old, rngaudit.load_spec(str(new)))
    code, doc = cli_json("diff", old, new)
    assert compare_json(cmp) == doc and cmp.failing and code == 1
    same = rngaudit.verify(old, rngaudit.diff(old, old).new)
    assert not same.failing and same.count("same") == len(same.entries) > 0


def test_capture_then_verify_against_the_model_and_its_keys(tmp_path):
    report = rngaudit.capture(f"{MODELS / 'base.py'}:make", rngs="params=0,dropout=1")
    assert isinstance(report, rngaudit.CaptureReport) and "rngaudit: 1" in report.spec
    spec = tmp_path / "base.yaml"
    spec.write_text(report.spec, encoding="utf-8")
    assert not rngaudit.verify(spec, against=report.capture).failing
    assert not rngaudit.verify(spec, against=f"{MODELS / 'base.py'}:make", rngs={"params": 0, "dropout": 1}).failing
    moved = rngaudit.verify(spec, against=f"{MODELS / 'insert.py'}:make", rngs="params=0,dropout=1")
    assert moved.failing and rngaudit.findings(moved)[0].rule.startswith("verify/")


def test_shard_check_runs_on_forced_devices():
    report = rngaudit.shard_check([REPO / "fixtures" / "shard" / "forks.yaml"], devices=2)
    assert isinstance(report, rngaudit.ShardReport) and report.devices.count == 2 and not report.failing
    assert rngaudit.findings(report) == []


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: rngaudit.derive(REPO / "tests" / "bad_specs" / "unknown_top_key.yaml"), "SpecError"),
        (lambda: rngaudit.derive(GUIDE, draw="normal:2,x"), "UsageError"),
        (lambda: rngaudit.derive(GUIDE, phase="train"), "UsageError"),
        (lambda: rngaudit.collisions(REPO / "fixtures" / "collisions" / "bad.json"), "InputError"),
        (lambda: rngaudit.shard_check([], paths=["x"]), "UsageError"),
        (lambda: rngaudit.shard_check([rngaudit.parse_spec("rngaudit: 1\nmodel: {class: M}\n")]), "UsageError"),
        (lambda: rngaudit.capture("nowhere.py:make"), "UserCodeError"),
        (lambda: rngaudit.findings(object()), "TypeError"),
    ],
)
def test_errors_are_raised_with_the_class_of_their_cause(call, error):
    with pytest.raises(Exception) as e:
        call()
    assert type(e.value).__name__ == error
    assert isinstance(e.value, rngaudit.RngauditError) or error == "TypeError"


def test_the_public_names_resolve():
    for name in rngaudit.__all__:
        assert getattr(rngaudit, name) is not None, name


def test_the_readme_example_runs(monkeypatch, capsys):
    """README's Python API example, run as written from the repository root."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    example = text.split("<!-- api-example -->\n```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(REPO)
    exec(compile(example, "README.md", "exec"), {})  # noqa: S102 - our own README
    out = capsys.readouterr().out.splitlines()
    # the key Flax gives the guide's Dense_0 kernel on every release (shared/FLAX_VERSIONS.md)
    assert out[0] == "Dense_0 params 1 (3043437727, 3662875008)"
    assert out[-1] == "missing.yaml:1:1: no such file 2"
