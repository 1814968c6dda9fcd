"""Every command in every `--format`, `--output`, `--exit-zero` and the exit-code table (0 clean, 1 findings,
2 usage or input error), through the real command line. SARIF is validated against the SARIF 2.1.0 schema
(tests/data, vendored: no network at test time)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
from support import REPO, invoke

from rngaudit.errors import Location
from rngaudit.output.findings import ERROR, NOTE, WARNING, Finding, shard_findings
from rngaudit.output.formats import Format
from rngaudit.output.github import annotation, render_github
from rngaudit.output.sarif import to_sarif
from rngaudit.output.shard_json import from_json

SCHEMA = json.loads((REPO / "tests" / "data" / "sarif-schema-2.1.0-rtm.4.json").read_text(encoding="utf-8"))
ANNOTATION = re.compile(r"^::(error|warning|notice) file=([^,]+),line=(\d+),col=(\d+),title=([^:]+)::(.+)$")

FALLBACK = "fixtures/ci/fallback.yaml"  # derive --strict finding at 8:7
GUIDE = "rngaudit/examples/guide.yaml"
SHARP = "fixtures/collisions/sharp_edge.yaml"  # class 1 at 8:89 and 9:89
CLEAN = "fixtures/collisions/clean.yaml"
BAD = "tests/bad_specs/unknown_key_make_rng.yaml"
GUIDE_FN = "fixtures/shard/guide_forward.py:forward"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # paths in annotations are relative to the checkout
    monkeypatch.delenv("RNGAUDIT_DEBUG", raising=False)


def valid_sarif(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.Draft4Validator(SCHEMA).validate(doc)
    assert doc["version"] == "2.1.0"
    (run,) = doc["runs"]
    assert run["tool"]["driver"]["name"] == "rngaudit"
    rules = [r["id"] for r in run["tool"]["driver"]["rules"]]
    for res in run["results"]:
        assert rules[res["ruleIndex"]] == res["ruleId"]
    return doc


def sarif_places(doc: dict) -> list[tuple[str, str, int, int]]:
    out = []
    for res in doc["runs"][0]["results"]:
        loc = res["locations"][0]["physicalLocation"]
        out.append(
            (res["ruleId"], loc["artifactLocation"]["uri"], loc["region"]["startLine"], loc["region"]["startColumn"])
        )
    return out


def annotations(text: str) -> list[tuple[str, str, int, int, str, str]]:
    out = []
    for line in text.splitlines():
        m = ANNOTATION.match(line)
        assert m, f"not a workflow command: {line!r}"
        out.append((m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), m.group(5), m.group(6)))
    return out


def test_the_format_enum_is_what_the_readme_promises():
    assert [f.value for f in Format] == ["text", "json", "github", "sarif"]


# ---------------------------------------------------------------- every format of derive and collisions
RUNS = {  # (command, case) -> (arguments, exit code)
    ("derive", "findings"): (["derive", FALLBACK, "--strict", "--no-values"], 1),
    ("derive", "clean"): (["derive", GUIDE, "--strict", "--no-values"], 0),
    ("collisions", "findings"): (["collisions", SHARP], 1),
    ("collisions", "clean"): (["collisions", CLEAN], 0),
}
EXPECTED = {  # where each finding points: (rule, file, line, col)
    ("derive", "findings"): [("derive/stream-fallback", FALLBACK, 8, 7)],
    ("derive", "clean"): [],
    ("collisions", "findings"): [("collisions/concatenation", SHARP, 8, 89)],
    ("collisions", "clean"): [],
}


@pytest.mark.parametrize("fmt", list(Format), ids=[f.value for f in Format])
@pytest.mark.parametrize("run", list(RUNS), ids=["-".join(r) for r in RUNS])
def test_every_format(run, fmt, tmp_path):
    args, code = RUNS[run]
    r = invoke(*args, "--format", fmt.value)
    assert r.exit_code == code, r.stdout + r.stderr
    assert r.stderr == ""
    expected = EXPECTED[run]
    if fmt is Format.text:
        assert r.stdout and "\x1b[" not in r.stdout  # no colour off a terminal
    elif fmt is Format.json:
        assert json.loads(r.stdout)["format"] == f"rngaudit.{run[0]}"
    elif fmt is Format.github:
        got = annotations(r.stdout)
        assert [(f, ln, c) for _, f, ln, c, _, _ in got] == [(f, ln, c) for _, f, ln, c in expected]
        assert all(
            kind == "error" and title == f"rngaudit {rule}"
            for (kind, _, _, _, title, _), (rule, *_) in zip(got, expected)
        )
        assert r.stdout == "" or r.stdout.endswith("\n")
    else:
        doc = valid_sarif(r.stdout)
        assert sarif_places(doc) == expected
        assert all(res["level"] == "error" for res in doc["runs"][0]["results"])
    # --output writes exactly the report, and nothing goes to stdout
    out = tmp_path / f"report.{fmt.value}"
    r2 = invoke(*args, "--format", fmt.value, "--output", str(out))
    assert r2.exit_code == code and r2.stdout == "" and r2.stderr == ""
    assert out.read_text(encoding="utf-8") == r.stdout


def test_collision_annotation_names_the_other_call_site_and_the_fix():
    r = invoke("collisions", SHARP, "-f", "github")
    (ann,) = annotations(r.stdout)
    message = ann[5]
    assert "ab/cdef (rng, count 1) at fixtures/collisions/sharp_edge.yaml:8:89" in message
    assert "abc/def (rng, count 1) at fixtures/collisions/sharp_edge.yaml:9:89" in message
    assert "rename abc/def at fixtures/collisions/sharp_edge.yaml:9:56 to 'def_1' (verified)" in message
    doc = valid_sarif(invoke("collisions", SHARP, "-f", "sarif").stdout)
    (res,) = doc["runs"][0]["results"]
    (rel,) = res["relatedLocations"]
    assert rel["physicalLocation"]["region"] == {"startLine": 9, "startColumn": 89}


def test_collision_levels_follow_fail_on_and_strict():
    # unsplit lanes are information: a warning-free note unless --strict or --fail-on makes them fail
    spec = "fixtures/collisions/shared_seed.yaml"
    doc = valid_sarif(invoke("collisions", spec, "-f", "sarif").stdout)
    levels = {res["ruleId"]: res["level"] for res in doc["runs"][0]["results"]}
    assert levels["collisions/shared-seed"] == ERROR
    r = invoke("collisions", SHARP, "-f", "github", "--fail-on", "hash_word")
    assert r.exit_code == 0  # class 1 found, but only hash-word collisions fail this run
    assert annotations(r.stdout)[0][0] == "warning"
    r = invoke("collisions", "fixtures/collisions/latent.yaml", "-f", "sarif")
    latent = [res for res in json.loads(r.stdout)["runs"][0]["results"] if res["ruleId"] == "collisions/latent"]
    assert latent and all(res["level"] == NOTE for res in latent) and r.exit_code == 0
    r = invoke("collisions", "fixtures/collisions/latent.yaml", "-f", "sarif", "--strict")
    assert r.exit_code == 1
    assert {res["level"] for res in json.loads(r.stdout)["runs"][0]["results"]} == {ERROR}
    r = invoke("collisions", "fixtures/collisions/latent.yaml", "--fail-on", "latent")
    assert r.exit_code == 1


def test_json_inputs_annotate_the_json_file():
    r = invoke("collisions", "fixtures/collisions/paths.json", "-f", "github")
    assert r.exit_code == 1
    got = annotations(r.stdout)
    assert got and {f for _, f, *_ in got} == {"fixtures/collisions/paths.json"}
    valid_sarif(invoke("collisions", "fixtures/collisions/paths.json", "-f", "sarif").stdout)


# ---------------------------------------------------------------- the exit-code table, per command
EXIT_TABLE = [
    ("derive", [GUIDE, "--no-values"], 0),
    ("derive", [FALLBACK, "--no-values", "--strict"], 1),
    ("derive", [FALLBACK, "--no-values", "--strict", "--exit-zero"], 0),
    ("derive", [BAD], 2),
    ("derive", [BAD, "--exit-zero"], 2),
    ("derive", [GUIDE, "--format", "xml"], 2),
    ("collisions", [CLEAN], 0),
    ("collisions", [SHARP], 1),
    ("collisions", [SHARP, "--exit-zero"], 0),
    ("collisions", [BAD], 2),
    ("collisions", [BAD, "--exit-zero"], 2),
    ("collisions", [CLEAN, "--fail-on", "everything"], 2),
    ("shard-check", [BAD], 2),
    ("shard-check", [BAD, "--exit-zero"], 2),
    ("shard-check", ["--fn", GUIDE_FN, "--devices", "0"], 2),
    ("shard-check", [], 2),
]


@pytest.mark.parametrize("command,args,code", EXIT_TABLE, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(EXIT_TABLE)])
def test_exit_code_table(command, args, code):
    for fmt in ("text", "sarif"):
        r = invoke(command, *args, *(["--format", fmt] if "--format" not in args else []))
        assert r.exit_code == code, r.stdout + r.stderr
        if code == 2:
            assert r.stdout == "" and "internal error" not in r.stderr and "Traceback" not in r.stderr
            if "--format" not in args and "--fail-on" not in args:  # not a usage error click reports itself
                assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


def _run(*args: str, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    env.pop("RNGAUDIT_DEBUG", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "rngaudit", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=240,
    )


def test_shard_check_exit_codes_and_ci_formats(tmp_path):
    """The real command and its device process: with --replicated-key, 1 for the same randomness on every
    device (SARIF at the function's `def`), 0 with --exit-zero (annotations still printed), 0 when
    --allow-replicated says it is intended (a notice); without either, 0 and no annotation (information)."""
    out = tmp_path / "shard.sarif"
    r = _run("shard-check", "--devices", "2", "--fn", GUIDE_FN, "-f", "sarif", "-o", str(out), "--replicated-key")
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    doc = valid_sarif(out.read_text(encoding="utf-8"))
    places = sarif_places(doc)
    def_line = next(
        n
        for n, line in enumerate((REPO / "fixtures/shard/guide_forward.py").read_text().splitlines(), 1)
        if line.startswith("def forward(")
    )
    assert places == [("shard-check/shard_map_replicated_key", "fixtures/shard/guide_forward.py", def_line, 1)]
    r = _run("shard-check", "--devices", "2", "--fn", GUIDE_FN, "-f", "github", "--exit-zero", "--replicated-key")
    assert r.returncode == 0, r.stderr
    ((kind, file, line, _, title, message),) = annotations(r.stdout)
    assert (kind, file, line, title) == (
        "error",
        "fixtures/shard/guide_forward.py",
        def_line,
        "rngaudit shard-check/shard_map_replicated_key",
    )
    assert "same randomness on every device" in message
    r = _run("shard-check", "--devices", "2", "--fn", GUIDE_FN, "-f", "github", "--allow-replicated")
    assert r.returncode == 0, r.stderr
    assert [a[0] for a in annotations(r.stdout)] == ["notice"]
    r = _run("shard-check", "--devices", "2", "--fn", GUIDE_FN, "-f", "github")
    assert r.returncode == 0 and annotations(r.stdout) == [], r.stdout + r.stderr


def test_shard_findings_point_at_the_first_mismatched_key():
    """A spec check that fails points at the spec line of its first differing key (or the file's top)."""
    check = {
        "id": "keys",
        "title": "keys",
        "status": "fail",
        "message": "1 of 2 keys differ",
        "details": {
            "mismatches": [{"index": 0, "path_str": "Dense_0", "location": {"file": "m.yaml", "line": 7, "col": 9}}]
        },
    }
    passing = dict(check, id="root_keys", status="pass", details={})
    draws = dict(check, id="draws", details={"mismatches": []})
    doc = {
        "environment": {
            k: None
            for k in (
                "jax",
                "jaxlib",
                "flax",
                "python",
                "jax_default_prng_impl",
                "jax_threefry_partitionable",
                "jax_enable_x64",
                "XLA_FLAGS",
                "JAX_PLATFORMS",
            )
        },
        "devices": {"platform": "cpu", "kind": "cpu", "ids": [0, 1], "forced": True},
        "mesh": {"axis_names": ["data"], "axis_sizes": [2], "device_ids": [0, 1]},
        "targets": [{"kind": "spec", "name": "m.yaml", "info": {}, "checks": [passing, check, draws]}],
    }
    found = shard_findings(from_json(doc))
    assert [(f.rule, f.level, f.location) for f in found] == [
        ("shard-check/keys", ERROR, Location("m.yaml", 7, 9)),
        ("shard-check/draws", ERROR, Location("m.yaml", 1, 1)),
    ]
    valid_sarif(json.dumps(to_sarif("shard-check", found, ())))


# ---------------------------------------------------------------- the renderers on their own
def test_github_escapes_what_the_runner_would_misread():
    f = Finding("r/x", WARNING, "50% of keys\nshared: a, b", Location("dir,1/a:b.yaml", 3, 4))
    line = annotation(f)
    assert line == "::warning file=dir%2C1/a%3Ab.yaml,line=3,col=4,title=rngaudit r/x::50%25 of keys%0Ashared: a, b"
    assert render_github([]) == ""
    assert annotation(Finding("r/x", NOTE, "m", None)) == "::notice title=rngaudit r/x::m"


def test_sarif_paths_are_relative_to_the_checkout_and_escaped(tmp_path):
    inside = Finding("r/x", ERROR, "m", Location(str(REPO / "fixtures" / "a b.yaml"), 2, 3))
    outside = Finding("r/x", ERROR, "m", Location(str(tmp_path / "o.yaml"), 1, 1))
    doc = to_sarif("collisions", [inside, outside], ())
    jsonschema.Draft4Validator(SCHEMA).validate(doc)
    a, b = (res["locations"][0]["physicalLocation"]["artifactLocation"] for res in doc["runs"][0]["results"])
    assert a == {"uri": "fixtures/a%20b.yaml", "uriBaseId": "%SRCROOT%"}
    assert b == {"uri": (tmp_path / "o.yaml").as_uri()}
    # an unknown rule still gets a descriptor, so ruleIndex stays valid
    assert doc["runs"][0]["tool"]["driver"]["rules"][0]["id"] == "r/x"


def test_sarif_schema_rejects_a_broken_log():
    """The vendored schema really checks: a result without a message is not SARIF."""
    doc = to_sarif("derive", [Finding("r/x", ERROR, "m", Location("a.yaml", 1, 1))], ())
    del doc["runs"][0]["results"][0]["message"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(SCHEMA).validate(doc)


# ---------------------------------------------------------------- pre-commit, colours, progress
def test_pre_commit_hook_runs_collisions_on_matching_specs(tmp_path):
    import shlex

    import yaml

    (hook,) = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
    assert hook["id"] == "rngaudit-collisions" and hook["language"] == "python"
    files = re.compile(hook["files"])
    for name in ("rngaudit.yaml", "specs/rngaudit_model.yml", "m.rngaudit.yaml", "rngaudit/examples/guide.yaml"):
        assert files.search(name), name
    for name in ("model.yaml", "ci/workflow.yml", "rngaudit.json"):
        assert not files.search(name), name
    # the README's own workflow file is named rngaudit.yml: the hook leaves .github/ alone
    exclude = re.compile(hook["exclude"])
    assert files.search(".github/workflows/rngaudit.yml") and exclude.search(".github/workflows/rngaudit.yml")
    assert not any(exclude.search(n) for n in ("rngaudit.yaml", "specs/rngaudit_model.yml", "a/.github.yaml"))
    # pre-commit runs `entry` with the changed files appended
    argv = shlex.split(hook["entry"])
    assert argv[0] == "rngaudit"
    assert invoke(*argv[1:], SHARP, CLEAN).exit_code == 1
    assert invoke(*argv[1:], CLEAN).exit_code == 0


def _on_a_terminal(env_extra: dict) -> str:
    """`derive` with stdout on a pseudo-terminal; what the terminal shows."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="200", TERM="xterm-256color", **env_extra)
    env.pop("NO_COLOR", None) if "NO_COLOR" not in env_extra else None
    p = subprocess.Popen(
        [sys.executable, "-m", "rngaudit", "derive", FALLBACK, "--no-values"],
        cwd=REPO,
        env=env,
        stdout=slave,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    p.wait(timeout=60)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


COLOUR = re.compile(r"\x1b\[[0-9;]*?(?<![0-9])(3[0-8]|9[0-7]|4[0-8]|10[0-7])(;[0-9;]*)?m")  # SGR colours, not bold


def test_colour_only_on_a_terminal_and_never_with_no_color():
    assert COLOUR.search(_on_a_terminal({}))  # the fallback note is yellow
    shown = _on_a_terminal({"NO_COLOR": "1"})
    assert "fallback.yaml" in shown and not COLOUR.search(shown)  # bold is not colour (no-color.org)
    assert "\x1b[" not in invoke("derive", FALLBACK, "--no-values").stdout  # not a terminal


def test_progress_is_a_no_op_off_a_terminal_and_transient_on_one(capsys):
    import io
    import time

    from rngaudit.output.progress import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    quiet = io.StringIO()
    with progress(10, "work", stream=quiet) as advance:
        for _ in range(10):
            advance(1)
    assert quiet.getvalue() == ""
    term = Terminal()
    with progress(3, "work", stream=term, delay=0.0) as advance:
        advance(2)
        time.sleep(0.4)
    assert "work" in term.getvalue()  # drawn on the terminal stream, then cleared
    fast = Terminal()
    with progress(None, "quick", stream=fast) as advance:  # done before the bar's first second
        advance(1)
    assert fast.getvalue() == ""
    assert capsys.readouterr().out == ""  # never on stdout


def test_a_drawn_bar_leaves_stdout_to_the_report(capsys):
    """With the bar on a terminal (stderr), what is written to stdout meanwhile (a report redirected to a file,
    `derive -f jsonl > out.jsonl`) still goes to stdout: rich would swap sys.stdout for a proxy that draws it on
    the terminal above the bar (the report then missed its file, and took minutes to draw)."""
    import io
    import time

    from rngaudit.output.progress import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    stdout = sys.stdout
    with progress(3, "writing", stream=term, delay=0.0) as advance:
        time.sleep(0.3)  # the bar is up
        assert sys.stdout is stdout
        print('{"record": "call"}')
        advance(3)
    assert "writing" in term.getvalue() and "record" not in term.getvalue()
    assert capsys.readouterr().out == '{"record": "call"}\n'
