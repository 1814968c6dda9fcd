"""Many inputs, as ruff and yamllint take them: every input is reported, a bad one is a diagnostic (an `error:`
line, a github annotation, a SARIF result, a JSON `errors` entry) while the others still run, and the run exits 2
at the end; directories are walked for specs (include/exclude, non-spec YAML skipped); `-` reads standard input."""

from __future__ import annotations

import json
import shutil

from support import GUIDE, invoke, run_cli, write

from rngaudit.cli.inputs import DEFAULT_INCLUDE, expand

BAD = "rngaudit: 1\nmodel: [\n"  # invalid YAML at 3:1
# a spec whose two call sites get one key (a class-1 concatenation): exit 1 on its own
COLLIDING = """
    rngaudit: 1
    rngs: {params: 0}
    model:
      class: M
      body:
        - module: {name: ab, class: A, body: [make_rng: params]}
        - module: {name: a, class: A2, body: [{module: {name: b, class: B, body: [make_rng: params]}}]}
"""


def _tree(tmp_path):
    good = tmp_path / "good.yaml"
    shutil.copy(GUIDE, good)
    bad = write(tmp_path, "bad.yaml", BAD)
    return str(good), bad


def test_one_bad_input_does_not_hide_the_others(tmp_path):
    good, bad = _tree(tmp_path)
    r = invoke("collisions", good, bad)
    assert r.exit_code == 2
    assert "6 call sites" in r.stdout  # the good input's report
    assert "1 input not audited" in r.stdout
    (line,) = r.stderr.splitlines()
    assert line == f"error: {bad}:3:1: invalid YAML: expected the node content, but found '<stream end>' (while " + (
        "parsing a flow node at line 3, column 1)"
    )


def test_findings_and_a_bad_input_exit_2_and_keep_the_findings(tmp_path):
    colliding = write(tmp_path, "c.yaml", COLLIDING)
    r = invoke("collisions", colliding, tmp_path / "missing.yaml", "-f", "json")
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["summary"]["failing"] == 1 and doc["summary"]["errors"] == 1
    assert doc["errors"] == [{"file": str(tmp_path / "missing.yaml"), "line": 1, "col": 1, "message": "no such file"}]
    # --exit-zero covers findings, not errors
    assert invoke("collisions", colliding, tmp_path / "missing.yaml", "--exit-zero").exit_code == 2
    assert invoke("collisions", colliding, "--exit-zero").exit_code == 0


def test_clean_json_has_no_errors_key(tmp_path):
    good, _ = _tree(tmp_path)
    doc = json.loads(invoke("collisions", good, "-f", "json").stdout)
    assert "errors" not in doc and "errors" not in doc["summary"]


def test_bad_inputs_are_annotated_in_github_and_sarif(tmp_path):
    good, bad = _tree(tmp_path)
    r = invoke("collisions", good, bad, "-f", "github")
    assert r.exit_code == 2
    assert r.stdout.startswith(f"::error file={bad.replace(':', '%3A')},line=3,col=1,")
    assert "title=rngaudit collisions/input-error::invalid YAML" in r.stdout
    # one bad input alone: nothing audited, so no report (as every command does for a bad input), exit 2
    alone = invoke("collisions", bad, "-f", "github")
    assert alone.exit_code == 2 and alone.stdout == "" and alone.stderr.startswith(f"error: {bad}:3:1: ")
    sarif = json.loads(invoke("collisions", good, bad, "-f", "sarif").stdout)
    run = sarif["runs"][0]
    (result,) = run["results"]
    assert result["ruleId"] == "collisions/input-error" and result["level"] == "error"
    assert result["locations"][0]["physicalLocation"]["region"] == {"startLine": 3, "startColumn": 1}
    assert "collisions/input-error" in {r["id"] for r in run["tool"]["driver"]["rules"]}


def test_a_bad_input_writes_no_output_file(tmp_path):
    """--output is written only by a run that succeeds: with a bad input (alone or beside good ones), no file."""
    good, bad = _tree(tmp_path)
    out = tmp_path / "report.json"
    for inputs in ([bad], [good, bad]):
        r = invoke("collisions", *inputs, "-f", "json", "-o", out)
        assert r.exit_code == 2 and not out.exists() and r.stdout == "", inputs
        assert r.stderr.startswith(f"error: {bad}:3:1: ")


def test_directories_are_walked_for_specs(tmp_path):
    root = tmp_path / "repo"
    (root / "models" / "deep").mkdir(parents=True)
    (root / ".venv").mkdir()
    shutil.copy(GUIDE, root / "models" / "a.yaml")
    shutil.copy(GUIDE, root / "models" / "deep" / "b.yml")
    shutil.copy(GUIDE, root / ".venv" / "c.yaml")  # never walked into
    write(root, "ci.yaml", "on: push\njobs: {}\n")  # not a spec: skipped
    write(root / "models", "paths.json", '["a", "b"]')  # JSON only when included
    sources, errors = expand([str(root)])
    assert errors == [] and [s.replace(str(root), "") for s in sources] == ["/models/a.yaml", "/models/deep/b.yml"]
    r = invoke("collisions", root, "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert [i["file"] for i in json.loads(r.stdout)["inputs"]] == sources
    assert len(expand([str(root)], include=["*.json"])[0]) == 1
    assert expand([str(root)], exclude=["deep"])[0] == [str(root / "models" / "a.yaml")]
    assert expand([str(root)], exclude=["models/deep/*.yml"])[0] == [str(root / "models" / "a.yaml")]
    # a file given twice (itself and under its directory) is audited once
    assert len(expand([str(root / "models" / "a.yaml"), str(root)])[0]) == 2


def test_include_and_exclude_come_from_pyproject(tmp_path):
    root = tmp_path / "repo"
    (root / "specs" / "fixtures").mkdir(parents=True)
    shutil.copy(GUIDE, root / "specs" / "a.yaml")
    shutil.copy(GUIDE, root / "specs" / "fixtures" / "b.yaml")
    write(root, "pyproject.toml", '[tool.rngaudit.collisions]\nexclude = ["fixtures"]\n')
    r = run_cli("collisions", "specs", "-f", "json", cwd=root)
    assert r.returncode == 0, r.stderr
    assert [i["file"] for i in json.loads(r.stdout)["inputs"]] == ["specs/a.yaml"]


def test_a_directory_without_specs_is_an_error_not_a_clean_run(tmp_path):
    (tmp_path / "empty").mkdir()
    r = invoke("collisions", GUIDE, tmp_path / "empty")
    assert r.exit_code == 2 and "6 call sites" in r.stdout
    assert f"error: {tmp_path / 'empty'}:1:1: no spec under this directory" in r.stderr
    assert ", ".join(DEFAULT_INCLUDE) in r.stderr


def test_stdin_is_a_spec_named_as_asked():
    text = GUIDE.read_text(encoding="utf-8")
    r = run_cli("collisions", "-", "--stdin-filename", "models/guide.yaml", "-f", "json", input_text=text)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["inputs"][0]["file"] == "models/guide.yaml"
    d = run_cli("derive", "-", "--format", "jsonl", input_text=text)
    assert d.returncode == 0 and d.stdout == run_cli("derive", GUIDE, "--format", "jsonl").stdout.replace(
        str(GUIDE), "<stdin>"
    )
    bad = run_cli("derive", "-", input_text=BAD)
    assert bad.returncode == 2 and bad.stderr.startswith("error: <stdin>:3:1: invalid YAML")
    twice = run_cli("collisions", "-", "-", input_text=text)
    assert twice.returncode == 2 and "given twice" in twice.stderr


def test_ci_paths_are_relative_to_the_repository_root_from_any_directory(tmp_path):
    """GitHub resolves annotation files and SARIF %SRCROOT% URIs at the checkout's root, not where the command ran."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "models").mkdir()
    (repo / "tools" / "ci").mkdir(parents=True)
    write(repo / "models", "m.yaml", COLLIDING)
    env = {"GITHUB_WORKSPACE": ""}
    gh = run_cli("collisions", "../../models/m.yaml", "-f", "github", cwd=repo / "tools" / "ci", env_extra=env)
    assert gh.returncode == 1 and gh.stdout.startswith("::error file=models/m.yaml,line=6,"), gh.stdout
    sarif = run_cli("collisions", "../../models/m.yaml", "-f", "sarif", cwd=repo / "tools" / "ci", env_extra=env)
    where = json.loads(sarif.stdout)["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert where == {"uri": "models/m.yaml", "uriBaseId": "%SRCROOT%"}
    # GITHUB_WORKSPACE names the root when set (the runner's checkout)
    ws = run_cli("collisions", "m.yaml", "-f", "github", cwd=repo / "models", env_extra={"GITHUB_WORKSPACE": str(repo)})
    assert ws.stdout.startswith("::error file=models/m.yaml,")
    # outside any repository: relative to the working directory, as before
    (tmp_path / "plain").mkdir()
    write(tmp_path / "plain", "m.yaml", COLLIDING)
    plain = run_cli("collisions", "m.yaml", "-f", "github", cwd=tmp_path / "plain", env_extra=env)
    assert plain.stdout.startswith("::error file=m.yaml,")


def test_statistics_count_the_findings_by_rule(tmp_path):
    colliding = write(tmp_path, "c.yaml", COLLIDING)
    r = invoke("collisions", colliding, GUIDE, "--statistics")
    assert r.exit_code == 1
    assert r.stdout.splitlines() == ["1  collisions/concatenation  error", "1 finding in 2 inputs"]
    latent = invoke("collisions", "fixtures/collisions/latent.yaml", colliding, "--statistics", "--fail-on", "latent")
    lines = latent.stdout.splitlines()
    assert lines[-1] == "2 findings in 2 inputs"
    assert sorted(lines[:-1]) == ["1  collisions/concatenation  warning", "1  collisions/latent         error"]
