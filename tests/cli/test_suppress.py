"""Suppressions and baselines for `collisions`, through the real CLI: `# rngaudit: ignore[RULE]` comments,
--select/--ignore, --per-path-ignore (and their [tool.rngaudit] keys), and --baseline/--write-baseline, so a team
adopts rngaudit on a model with known findings and fails only on new ones."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from support import FIXTURES, invoke, run_cli

SHARP = (FIXTURES / "collisions" / "sharp_edge.yaml").read_text()
HASH_WORD = (FIXTURES / "collisions" / "hash_word.yaml").read_text()
LATENT = (FIXTURES / "collisions" / "latent.yaml").read_text()
ABC = "    - module: {class: Node, name: abc, body: [{module: {class: Leaf, name: def, body: [{make_rng: rng}]}}]}"
NNX_SHARED = (
    "rngaudit: 1\nflavour: nnx\nrngs: {params: 0, dropout: 0}\n"
    "model: {class: M, init: [Linear, {Dropout: {name: d, rate: 0.5}}], call: [{call: d}]}\n"
)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A repository (the working directory) holding the three fixture specs: 1 concatenation, 1 hash-word,
    1 latent finding."""
    (tmp_path / ".git").mkdir()
    for name, text in (("sharp.yaml", SHARP), ("hash.yaml", HASH_WORD), ("latent.yaml", LATENT)):
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _json(*args):
    r = invoke("collisions", *args, "-f", "json")
    return r, json.loads(r.stdout) if r.stdout else None


def _rules(doc) -> list[str]:
    out = []
    for a in doc["inputs"]:
        out += [c["category"] for c in a["collisions"]] + ["latent"] * len(a["latent"])
    return sorted(out)


def _one_error(r, *parts):
    assert r.exit_code == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    for p in parts:
        assert p in r.stderr, r.stderr


# ---------------------------------------------------------------- ignore comments
def test_an_ignore_comment_inside_a_quoted_string_is_no_comment(project):
    """`label: "x # rngaudit: ignore"` is a label that holds the text; it left the finding out."""
    # (and a quote that never closes on its line opened no string: `rock 'n roll  # rngaudit: ignore` is a comment)
    from rngaudit.spec.comments import ignore_comment

    assert ignore_comment("label: rock 'n roll  # rngaudit: ignore") is not None
    assert ignore_comment('label: say "hi  # rngaudit: ignore') is not None
    for quoted in ('"x # rngaudit: ignore"', "'it''s # rngaudit: ignore'"):
        line = ABC.replace("{make_rng: rng}", "{make_rng: {stream: rng, label: " + quoted + "}}")
        (project / "sharp.yaml").write_text(SHARP.replace(ABC, line))
        r = invoke("collisions", "sharp.yaml")
        assert r.exit_code == 1 and "left out" not in r.stdout, r.stdout
        (project / "sharp.yaml").write_text(SHARP.replace(ABC, line + "  # rngaudit: ignore[concatenation]"))
        assert invoke("collisions", "sharp.yaml").exit_code == 0


def test_an_ignore_comment_on_a_call_site_line_leaves_that_finding_out(project):
    (project / "sharp.yaml").write_text(SHARP.replace(ABC, ABC + "  # rngaudit: ignore[concatenation]"))
    r = invoke("collisions", "sharp.yaml")
    assert r.exit_code == 0, r.stdout
    assert "1 finding left out (1 by ignore comments)" in r.stdout
    r, doc = _json("sharp.yaml")
    assert doc["summary"]["failing"] == 0 and doc["summary"]["suppressed"] == {"inline": 1}
    # the rule id and the dashed name work too; a comment naming another rule suppresses nothing
    for name, code in (("collisions/concatenation", 0), ("concatenation, latent", 0), ("hash-word", 1)):
        (project / "sharp.yaml").write_text(SHARP.replace(ABC, ABC + f"  # rngaudit: ignore[{name}]"))
        assert invoke("collisions", "sharp.yaml").exit_code == code, name
    # a bare `ignore` leaves out every rule at that line; --no-inline-ignores reports it anyway
    (project / "sharp.yaml").write_text(SHARP.replace(ABC, ABC + "  #rngaudit: ignore"))
    assert invoke("collisions", "sharp.yaml").exit_code == 0
    r = invoke("collisions", "sharp.yaml", "--no-inline-ignores", "-f", "github")
    assert r.exit_code == 1 and r.stdout.startswith("::error file=sharp.yaml,line=8,col=89,")


def test_a_comment_elsewhere_or_inside_a_name_does_not_suppress(project):
    # on the spec's first line (no call site there) and in a quoted module name: neither is a call site's comment
    text = "# rngaudit: ignore\n" + SHARP.replace("name: abc,", "name: 'abc',")
    (project / "sharp.yaml").write_text(text)
    assert invoke("collisions", "sharp.yaml").exit_code == 1
    (project / "sharp.yaml").write_text(SHARP.replace("name: abc,", "name: 'abc#rngaudit: ignore',"))
    r = invoke("collisions", "sharp.yaml")
    assert r.exit_code == 0 and "left out" not in r.stdout  # the names no longer collide at all


def test_an_unknown_rule_in_a_comment_is_a_warning_at_its_place(project):
    (project / "sharp.yaml").write_text(SHARP.replace(ABC, ABC + "  # rngaudit: ignore[concatentation]"))
    r = invoke("collisions", "sharp.yaml")
    assert r.exit_code == 1  # it suppressed nothing
    col = ABC.index("module") + len(ABC) - ABC.index("module") + len("  # rngaudit: ignore[") + 1
    assert (
        f"warning: sharp.yaml:9:{col}: 'concatentation' in `# rngaudit: ignore[...]` is not a rule and suppresses "
        "nothing; did you mean 'concatenation'?"
    ) in r.stderr


def test_ignore_comments_of_a_spec_on_standard_input(project):
    text = SHARP.replace(ABC, ABC + "  # rngaudit: ignore[concatenation]")
    r = run_cli("collisions", "-", cwd=project, input_text=text)
    assert r.returncode == 0 and "1 finding left out" in r.stdout, r.stdout + r.stderr


def test_an_nnx_finding_is_ignored_at_its_draw(project):
    (project / "nnx.yaml").write_text(NNX_SHARED)
    r, doc = _json("nnx.yaml")
    assert r.exit_code == 1 and _rules(doc) == ["shared_stream_key"]
    lines = NNX_SHARED.splitlines()
    lines[-1] += "  # rngaudit: ignore[shared-stream-key]"
    (project / "nnx.yaml").write_text("\n".join(lines) + "\n")
    r, doc = _json("nnx.yaml")
    assert r.exit_code == 0 and doc["summary"]["suppressed"] == {"inline": 1}, r.stdout


# ---------------------------------------------------------------- select / ignore / per-path-ignore
def test_select_and_ignore_by_any_name(project):
    files = ("sharp.yaml", "hash.yaml", "latent.yaml")
    r, doc = _json(*files)
    assert _rules(doc) == ["concatenation", "hash_word", "latent"] and r.exit_code == 1
    r, doc = _json(*files, "--select", "collisions/latent")
    assert _rules(doc) == ["latent"] and r.exit_code == 0  # latent is information: it does not fail the run
    r, doc = _json(*files, "--ignore", "hash-word", "--ignore", "concatenation")
    assert _rules(doc) == ["latent"] and r.exit_code == 0
    assert "suppressed" not in doc["summary"]  # not reported at all, as ruff's --ignore
    _one_error(invoke("collisions", *files, "--select", "hashword"), "'hashword' is not a category")


def test_per_path_ignore_by_input_path_or_module_path(project):
    files = ("sharp.yaml", "hash.yaml", "latent.yaml")
    r, doc = _json(*files, "--per-path-ignore", "hash.yaml:*", "--per-path-ignore", "abc/*:concatenation")
    assert _rules(doc) == ["latent"] and doc["summary"]["suppressed"] == {"config": 2}
    # the rule must match: a module-path glob for another rule leaves the finding in
    r, doc = _json("sharp.yaml", "--per-path-ignore", "abc/*:hash-word")
    assert _rules(doc) == ["concatenation"]
    for bad, part in (("nocolon", "write GLOB:RULE"), ("x:", "name the rules"), ("x:concat", "'concat' is not a rule")):
        r = invoke("collisions", "sharp.yaml", "--per-path-ignore", bad)
        _one_error(r, part)


def test_a_per_path_ignore_that_matches_nothing_is_a_warning(project):
    """A command line's --per-path-ignore whose glob matches no input and no finding's module path (a typo) says
    so on stderr, the exit code unchanged; one that matches, or one of [tool.rngaudit] (pre-commit passes only the
    changed specs), says nothing."""
    r, doc = _json("sharp.yaml", "--per-path-ignore", "abd/*:concatenation", "--per-path-ignore", "abc/*:latent")
    assert r.exit_code == 1 and _rules(doc) == ["concatenation"]
    assert r.stderr == (
        "warning: --per-path-ignore abd/*:concatenation left out nothing: 'abd/*' matches no input's path and no module "
        "path of a finding (GLOB is an input's path, as given or relative to the working directory, or a call site's "
        "module path such as 'encoder/layers_*')\n"
    )
    r = invoke(
        "collisions", "latent.yaml", "--per-path-ignore", "sharp.yaml:*", "--per-path-ignore", "layer1:hash-word"
    )
    assert r.exit_code == 0 and "warning: --per-path-ignore sharp.yaml:*" in r.stderr and "layer1" not in r.stderr
    (project / "pyproject.toml").write_text('[tool.rngaudit.collisions]\nper-path-ignore = ["legacy/*:latent"]\n')
    r = invoke("collisions", "sharp.yaml")
    assert r.exit_code == 1 and r.stderr == ""
    # an input that could not be read is an input the glob names
    (project / "bad.yaml").write_text("rngaudit: 1\nmodel: [\n")
    r = invoke(
        "collisions",
        "sharp.yaml",
        "bad.yaml",
        "missing.yaml",
        "--per-path-ignore",
        "bad.yaml:*",
        "--per-path-ignore",
        "missing.yaml:*",
    )
    assert r.exit_code == 2 and "warning" not in r.stderr, r.stderr


def test_suppressions_from_the_configuration(project):
    (project / "pyproject.toml").write_text(
        textwrap.dedent("""
        [tool.rngaudit.collisions]
        ignore = ["latent"]
        per-path-ignore = ["hash.yaml:hash-word"]
        """)
    )
    r, doc = _json("sharp.yaml", "hash.yaml", "latent.yaml")
    assert _rules(doc) == ["concatenation"] and r.exit_code == 1
    (project / "pyproject.toml").write_text('[tool.rngaudit.collisions]\nper-path-ignore = ["hash.yaml"]\n')
    _one_error(invoke("collisions", "sharp.yaml"), "pyproject.toml:2:1:", "write GLOB:RULE")


# ---------------------------------------------------------------- baselines
def test_a_baseline_fails_only_on_new_findings(project):
    files = ("sharp.yaml", "hash.yaml", "latent.yaml")
    r = invoke("collisions", *files, "--baseline", "base.json", "--write-baseline")
    assert r.exit_code == 0 and r.stdout == "", r.stdout
    assert r.stderr == "wrote 3 findings to the baseline base.json\n"
    doc = json.loads((project / "base.json").read_text())
    assert doc["format"] == "rngaudit.baseline" and doc["format_version"] == 1
    assert sorted(f["rule"] for f in doc["findings"]) == [
        "collisions/concatenation",
        "collisions/hash-word",
        "collisions/latent",
    ]
    assert {f["input"] for f in doc["findings"]} == set(files)
    r = invoke("collisions", *files, "--baseline", "base.json")
    assert r.exit_code == 0 and "3 findings left out (3 by the baseline base.json)" in r.stdout, r.stdout
    # edits that move lines do not make known findings new ...
    (project / "sharp.yaml").write_text("# a comment\n\n" + SHARP)
    assert invoke("collisions", *files, "--baseline", "base.json").exit_code == 0
    # ... a new finding does: it alone is reported and fails the run
    new = ABC.replace("abc", "xy").replace("def", "z") + "\n" + ABC.replace("abc", "x").replace("def", "yz") + "\n"
    (project / "sharp.yaml").write_text(SHARP + new)
    r, out = _json(*files, "--baseline", "base.json")
    assert r.exit_code == 1 and out["summary"]["failing"] == 1 and out["summary"]["suppressed"] == {"baseline": 3}
    sites = {s["path_str"] for c in out["inputs"][0]["collisions"] for h in c["inputs"] for s in h["sites"]}
    assert sites == {"x/yz", "xy/z"}
    # a collision that grows (a third call site joins it) is a new finding too: its call sites changed
    (project / "sharp.yaml").write_text(SHARP + ABC.replace("abc", "abcd").replace("def", "ef") + "\n")
    r, out = _json(*files, "--baseline", "base.json")
    assert r.exit_code == 1 and out["summary"]["suppressed"] == {"baseline": 2}


def test_a_fixed_finding_is_a_stale_baseline_entry_but_unaudited_inputs_are_not(project):
    invoke("collisions", "sharp.yaml", "hash.yaml", "--baseline", "base.json", "--write-baseline")
    # pre-commit passes only the changed specs: the other inputs' entries are neither stale nor dropped
    r = invoke("collisions", "sharp.yaml", "--baseline", "base.json")
    assert r.exit_code == 0 and "warning" not in r.stderr
    (project / "sharp.yaml").write_text(SHARP.replace("name: abc,", "name: abc_1,"))  # fixed
    r = invoke("collisions", "sharp.yaml", "--baseline", "base.json")
    assert r.exit_code == 0
    assert "warning: base.json: 1 finding is in the baseline and no longer found (fixed?)" in r.stderr
    r, doc = _json("sharp.yaml", "--baseline", "base.json")
    assert doc["summary"]["baseline_unmatched"] == 1
    invoke("collisions", "sharp.yaml", "--baseline", "base.json", "--write-baseline")
    rules = [f["rule"] for f in json.loads((project / "base.json").read_text())["findings"]]
    assert rules == ["collisions/hash-word"]  # hash.yaml's entry kept, sharp.yaml's dropped


def test_the_baseline_from_the_configuration_is_relative_to_it(project):
    (project / "pyproject.toml").write_text('[tool.rngaudit.collisions]\nbaseline = "ci/base.json"\n')
    (project / "ci").mkdir()
    assert invoke("collisions", "hash.yaml", "--write-baseline").exit_code == 0
    assert (project / "ci" / "base.json").is_file()
    sub = project / "models"
    sub.mkdir()
    os.chdir(sub)
    r = invoke("collisions", "../hash.yaml")
    assert r.exit_code == 0 and "1 by the baseline" in r.stdout, r.stdout + r.stderr
    assert json.loads((project / "ci" / "base.json").read_text())["findings"][0]["input"] == "../hash.yaml"


def test_baseline_errors_are_one_line_and_write_nothing(project):
    _one_error(
        invoke("collisions", "sharp.yaml", "--write-baseline"), "--write-baseline writes the file --baseline names"
    )
    _one_error(invoke("collisions", "sharp.yaml", "--baseline", "none.json"), "none.json:1:1: no such baseline file")
    (project / "bad.json").write_text('{"format": "rngaudit.baseline", "format_version": 1, "findings": [{"x": 1}]}')
    _one_error(invoke("collisions", "sharp.yaml", "--baseline", "bad.json"), "bad.json:1:1: findings[0]")
    (project / "bad.json").write_text("{\n  nope")
    _one_error(invoke("collisions", "sharp.yaml", "--baseline", "bad.json"), "bad.json:2:3: the baseline is not valid")
    (project / "other.json").write_text('{"format": "rngaudit.collisions"}')
    _one_error(invoke("collisions", "sharp.yaml", "--baseline", "other.json"), "not an rngaudit baseline")
    # a run with an input that cannot be audited writes no baseline (it would forget that input's findings)
    (project / "broken.yaml").write_text("rngaudit: 1\nmodel: [\n")
    r = invoke("collisions", "sharp.yaml", "broken.yaml", "--baseline", "new.json", "--write-baseline")
    assert r.exit_code == 2 and not (project / "new.json").exists()


def test_sarif_lists_suppressed_findings_as_suppressed(project):
    """Code scanning closes a suppressed result instead of opening an alert: SARIF `suppressions` (inSource for a
    comment, external for the baseline and per-path ignores); github annotations leave them out."""
    invoke("collisions", "hash.yaml", "--baseline", "base.json", "--write-baseline")
    (project / "sharp.yaml").write_text(SHARP.replace(ABC, ABC + "  # rngaudit: ignore"))
    r = invoke("collisions", "sharp.yaml", "hash.yaml", "latent.yaml", "--baseline", "base.json", "-f", "sarif")
    results = json.loads(r.stdout)["runs"][0]["results"]
    kinds = {x["ruleId"]: [s["kind"] for s in x.get("suppressions", [])] for x in results}
    assert kinds == {
        "collisions/concatenation": ["inSource"],
        "collisions/hash-word": ["external"],
        "collisions/latent": [],
    }
    r = invoke("collisions", "sharp.yaml", "hash.yaml", "latent.yaml", "--baseline", "base.json", "-f", "github")
    assert r.stdout.count("::") == 2 and "collisions/latent" in r.stdout  # (`::notice` for latent: 2 colons)


def test_baseline_entries_left_out_otherwise_are_not_stale(project):
    """A finding still there but left out by --ignore, by not looking (--latent-max-count 0), by a comment or a
    per-path ignore keeps its baseline entry: no "no longer found" warning."""
    files = ("sharp.yaml", "hash.yaml", "latent.yaml")
    invoke("collisions", *files, "--baseline", "base.json", "--write-baseline")
    for extra in (
        ["--ignore", "latent"],
        ["--select", "concatenation"],
        ["--latent-max-count", "0"],
        ["--per-path-ignore", "*:latent"],
    ):
        r = invoke("collisions", *files, "--baseline", "base.json", *extra)
        assert r.exit_code == 0 and "no longer found" not in r.stderr, (extra, r.stderr)
    (project / "sharp.yaml").write_text(SHARP.replace(ABC, ABC + "  # rngaudit: ignore"))
    r = invoke("collisions", *files, "--baseline", "base.json")
    assert r.exit_code == 0 and "no longer found" not in r.stderr, r.stderr
    assert "1 by ignore comments" in r.stdout


def test_write_baseline_replaces_an_unreadable_baseline_but_no_other_file(project):
    for text in ("", '{"format": "rngaudit.baseline", "format_version": 2, "findings": []}'):
        (project / "base.json").write_text(text)
        r = invoke("collisions", "hash.yaml", "--baseline", "base.json", "--write-baseline")
        assert r.exit_code == 0, r.stderr
        assert json.loads((project / "base.json").read_text())["format_version"] == 1
    (project / "notes.json").write_text('{"todo": 1}')
    r = invoke("collisions", "hash.yaml", "--baseline", "notes.json", "--write-baseline")
    _one_error(r, "does not overwrite a file that is not an rngaudit baseline")
    assert (project / "notes.json").read_text() == '{"todo": 1}'


def test_per_path_ignores_from_the_configuration_are_relative_to_it(project):
    (project / "specs").mkdir()
    (project / "specs" / "latent.yaml").write_text(LATENT)
    (project / "pyproject.toml").write_text('[tool.rngaudit.collisions]\nper-path-ignore = ["specs/*:latent"]\n')
    assert "1 by per-path ignores" in invoke("collisions", "specs/latent.yaml").stdout
    (project / "sub").mkdir()
    os.chdir(project / "sub")
    assert "1 by per-path ignores" in invoke("collisions", "../specs/latent.yaml").stdout


def test_each_unknown_name_in_a_comment_is_warned_at_its_own_column(project):
    line = ABC + "  # rngaudit: ignore[hash-word, hash]"
    (project / "sharp.yaml").write_text(SHARP.replace(ABC, line))
    r = invoke("collisions", "sharp.yaml")
    assert f"warning: sharp.yaml:9:{line.index('hash]') + 1}: 'hash' in" in r.stderr, r.stderr
