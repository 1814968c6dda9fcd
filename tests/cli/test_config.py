"""`[tool.rngaudit]` in pyproject.toml: defaults per command, flags win, and every mistake is an input error
at the file's line and column (exit 2, nothing on stdout)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from support import REPO, invoke

from rngaudit.cli.config import find_pyproject, key_positions, load

SHARP = REPO / "fixtures" / "collisions" / "sharp_edge.yaml"
FALLBACK = REPO / "fixtures" / "ci" / "fallback.yaml"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project directory (the working directory) with a spec; `write(toml)` sets its pyproject.toml."""
    (tmp_path / ".git").mkdir()  # the repository root: discovery stops here
    (tmp_path / "sharp.yaml").write_text(SHARP.read_text())
    (tmp_path / "fallback.yaml").write_text(FALLBACK.read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RNGAUDIT_DEBUG", raising=False)

    def write(text: str, name: str = "pyproject.toml") -> Path:
        p = tmp_path / name
        p.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return p

    write.root = tmp_path
    return write


def refused(r, where: str, *parts: str) -> None:
    assert r.exit_code == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith(f"error: {where}: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    for p in parts:
        assert p in r.stderr, r.stderr


def test_common_and_command_defaults_apply(project):
    project("""
        [project]
        name = "demo"

        [tool.rngaudit]
        format = "github"

        [tool.rngaudit.collisions]
        fix-rng-separator = true
        """)
    r = invoke("collisions", "sharp.yaml")
    assert r.exit_code == 0, r.stderr  # the separator removes the class 1 collision
    assert r.stdout == ""  # github format: no findings, no annotations
    r = invoke("collisions", "sharp.yaml", "--no-fix-rng-separator")  # the flag wins
    assert r.exit_code == 1
    assert r.stdout.startswith("::error file=sharp.yaml,line=8,col=89,")
    r = invoke("collisions", "sharp.yaml", "--no-fix-rng-separator", "-f", "json")
    assert json.loads(r.stdout)["summary"]["failing"] == 1


def test_section_wins_over_common_and_flags_win_over_both(project):
    project(
        """
        [tool.rngaudit]
        exit-zero = true
        [tool.rngaudit.derive]
        strict = true
        exit-zero = false
        format = "json"
        no-values = true
        """.replace("no-values = true\n", "values = false\n")
    )
    r = invoke("derive", "fallback.yaml")
    assert r.exit_code == 1  # strict from [tool.rngaudit.derive]; its exit-zero = false wins over the common one
    assert json.loads(r.stdout)["summary"]["fallbacks"] == 2
    assert invoke("derive", "fallback.yaml", "--no-strict").exit_code == 0
    assert invoke("derive", "fallback.yaml", "--exit-zero").exit_code == 0
    assert invoke("derive", "fallback.yaml", "-f", "text").stdout.startswith("fallback.yaml")
    # the common exit-zero still applies to collisions
    assert invoke("collisions", "sharp.yaml").exit_code == 0


def test_fail_on_and_lists(project):
    project("""
        [tool.rngaudit.collisions]
        fail-on = ["hash_word", "shared_seed"]
        """)
    assert invoke("collisions", "sharp.yaml").exit_code == 0
    assert invoke("collisions", "sharp.yaml", "--fail-on", "concatenation").exit_code == 1


def test_choices_from_the_configuration_are_the_options_choices(project):
    """An optional choice (phase: Phase | None) and a list of choices (fail-on) given in the configuration
    reach the command as the command line would give them."""
    project("""
        [tool.rngaudit]
        phase = "apply"
        format = "json"
        [tool.rngaudit.collisions]
        fail-on = ["concatenation"]
        """)
    r = invoke("collisions", "sharp.yaml")
    assert r.exit_code == 1, r.stderr  # (the sharp edge collides in either phase)
    assert json.loads(r.stdout)["summary"]["failing"] == 1
    r = invoke("derive", "sharp.yaml")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["phase"] == "apply"


def test_shard_check_defaults_reach_the_request(project):
    """`devices` from the configuration is checked like --devices (refused before any device process)."""
    project("""
        [tool.rngaudit.shard-check]
        devices = 0
        """)
    (project.root / "x.py").write_text("def f(key, x):\n    return x\n")
    r = invoke("shard-check", "--fn", "x.py:f")
    assert r.exit_code == 2 and "--devices 0: ask for 1 to 1024 CPU devices" in r.stderr
    r = invoke("shard-check", "--fn", "x.py:f", "--devices", "2", "--shape", "3,1")  # the flag wins
    assert r.exit_code == 2 and "3 rows do not divide over 2 devices" in r.stderr


@pytest.mark.parametrize(
    "toml,where,parts",
    [
        (
            '[tool.rngaudit]\nformat = "github"\nstirct = true\n',
            "pyproject.toml:3:1",
            ["[tool.rngaudit]: unknown key 'stirct'; did you mean 'strict'?"],
        ),
        (
            "[tool.rngaudit.collisions]\n  latent-max-cont = 3\n",
            "pyproject.toml:2:3",
            ["[tool.rngaudit.collisions]: unknown key 'latent-max-cont'; did you mean 'latent-max-count'?"],
        ),
        (
            "[tool.rngaudit.collisions]\ndevices = 4\n",
            "pyproject.toml:2:1",
            ["[tool.rngaudit.collisions]: unknown key 'devices'"],
        ),
        (
            "[tool.rngaudit.colisions]\nstrict = true\n",
            "pyproject.toml:1:1",
            ["no command is called 'colisions'; did you mean 'collisions'?"],
        ),
        (
            '[tool.rngaudit]\noutput = "report.txt"\n',
            "pyproject.toml:2:1",
            ["output: cannot be set here: it names the file one run writes its report to; give --output"],
        ),
        (
            '[tool.rngaudit.collisions]\nstdin-filename = "x.yaml"\n',
            "pyproject.toml:2:1",
            ["stdin-filename: cannot be set here: it names the spec one run reads from standard input"],
        ),
        ('[tool.rngaudit]\nformat = "jsnol"\n', "pyproject.toml:2:1", ["'jsnol' is not one of"]),
        (
            '[tool.rngaudit]\nstrict = "yes"\n',
            "pyproject.toml:2:1",
            ["[tool.rngaudit] strict: must be a boolean (true or false), not str 'yes'"],
        ),
        ("[tool.rngaudit.collisions]\nlatent-max-count = -1\n", "pyproject.toml:2:1", ["-1 is not in the range"]),
        ("[tool.rngaudit.collisions]\nlatent-max-count = 1.5\n", "pyproject.toml:2:1", ["must be an integer"]),
        ('[tool.rngaudit]\nformat = "xml"\n', "pyproject.toml:2:1", ["'xml' is not one of"]),
        ('[tool.rngaudit.collisions]\nfail-on = "hash_word"\n', "pyproject.toml:2:1", ["must be a list of strings"]),
        (
            '[tool.rngaudit.collisions]\nfail-on = ["hash"]\n',
            "pyproject.toml:2:1",
            ["'hash' is not a category: use one of"],
        ),
        ('[tool.rngaudit]\nformat = "github\n', "pyproject.toml:2:17", ["invalid TOML"]),
        ("[tool]\nrngaudit = 3\n", "pyproject.toml:2:1", ["[tool.rngaudit] must be a table"]),
        (
            "[tool.rngaudit]\ncollisions.stirct = true\n",
            "pyproject.toml:2:1",
            ["[tool.rngaudit.collisions]: unknown key 'stirct'"],
        ),
    ],
)
def test_bad_configuration_is_an_input_error_at_its_line(project, toml, where, parts, tmp_path):
    project(toml)
    out = tmp_path / "report.txt"
    r = invoke("collisions", "sharp.yaml", "--output", str(out))
    refused(r, where, *parts)
    assert not out.exists()


def test_an_unknown_key_fails_every_command(project):
    """A typo anywhere in the table is an error whichever command runs, so it is found at once."""
    project("[tool.rngaudit.shard-check]\ndevics = 2\n")
    for args in (["derive", "fallback.yaml"], ["collisions", "sharp.yaml"]):
        refused(invoke(*args), "pyproject.toml:2:1", "unknown key 'devics'; did you mean 'devices'?")


def test_non_utf8_configuration(project):
    (project.root / "pyproject.toml").write_bytes(b'[tool.rngaudit]\nformat = "\xff"\n')
    refused(invoke("derive", "fallback.yaml"), "pyproject.toml:2:11", "not UTF-8")


def test_explicit_config_file_and_discovery(project):
    project('[tool.rngaudit]\nformat = "json"\n')
    sub = project.root / "models" / "deep"
    sub.mkdir(parents=True)
    assert find_pyproject(str(sub)) == str(project.root / "pyproject.toml")
    # discovery stops at the repository root: a pyproject.toml above it is not this project's
    (project.root / "inner").mkdir()
    (project.root / "inner" / ".git").mkdir()
    assert find_pyproject(str(project.root / "inner")) is None
    other = project('[tool.rngaudit]\nformat = "github"\n', name="ci.toml")
    r = invoke("collisions", "sharp.yaml", "--config", str(other))
    assert r.stdout.startswith("::error ")
    refused(invoke("collisions", "sharp.yaml", "--config", "missing.toml"), "missing.toml:1:1", "no such file")
    # no [tool.rngaudit] at all: built-in defaults
    project("[project]\nname = 'x'\n")
    assert invoke("collisions", "sharp.yaml").stdout.startswith("sharp.yaml  (spec")


def test_key_positions_follow_tables_dotted_keys_and_skip_strings(tmp_path):
    text = textwrap.dedent('''
        [tool.rngaudit]
        doc = """
        fake = 1
        """
          "exit-zero" = true
        collisions.strict = true
        [tool."rngaudit".derive]  # a comment
        phase = "apply"
        ''').lstrip("\n")
    pos = key_positions(text, "p.toml")
    assert str(pos[("tool", "rngaudit", "exit-zero")]) == "p.toml:5:3"
    assert str(pos[("tool", "rngaudit", "collisions", "strict")]) == "p.toml:6:1"
    assert str(pos[("tool", "rngaudit", "derive", "phase")]) == "p.toml:8:1"
    assert ("tool", "rngaudit", "fake") not in pos
    f = tmp_path / "pyproject.toml"
    f.write_text(text)
    cfg = load(str(f))
    assert cfg.for_command("derive")["phase"].value == "apply"
    assert cfg.sections["collisions"]["strict"].location.line == 6


def test_every_option_is_settable_or_says_why():
    """Each command's visible options are either fields of its configurable options (the NamedTuple the command
    fills from [tool.rngaudit]) or named as per-run with a reason: none is silently refused."""
    import typer.main

    from rngaudit.cli import collisions, derive, refactor, shard_check
    from rngaudit.cli.defaults import _config_keys, _options, per_run
    from rngaudit.cli.root import app

    records = {
        "derive": derive.DeriveOptions,
        "collisions": collisions.CollisionsOptions,
        "shard-check": shard_check.ShardCheckOptions,
        "capture": refactor.CaptureOptions,
        "verify": refactor.VerifyOptions,
        "diff": refactor.DiffOptions,
    }
    commands = typer.main.get_command(app).commands
    assert set(commands) == set(records)
    for name, command in commands.items():
        settable = _config_keys(name, command)
        assert {p.name for p in settable.values()} <= set(records[name]._fields), name
        for key in set(_options(command)) - set(settable):
            assert per_run(name, key), (name, key)


def test_derive_filters_and_columns_from_the_configuration(project):
    """README lists `stream`, `path` (lists) and `limit` as settable: derive takes them, as --stream/--path/--limit
    would, and a bad `columns` is refused at its line."""
    project("""
        [tool.rngaudit.derive]
        format = "jsonl"
        stream = ["params"]
        path = ["(root)"]
        limit = 2
        """)
    r = invoke("derive", "fallback.yaml")
    assert r.exit_code == 0, r.stderr
    calls = [json.loads(line) for line in r.stdout.splitlines()][1:-1]
    # 'dropout' falls back to 'params': its rows are used from 'params', so the stream filter keeps them
    assert [c["stream_requested"] for c in calls] == ["params", "dropout"], calls
    assert len(invoke("derive", "fallback.yaml", "--limit", "3").stdout.splitlines()) == 5  # the flag wins
    project('[tool.rngaudit.derive]\nformat = "jsonl"\nstream = ["nosuch"]\n')
    r = invoke("derive", "fallback.yaml")
    assert r.exit_code == 0 and "warning: " in r.stderr and "nosuch" in r.stderr
    project('[tool.rngaudit.derive]\ncolumns = "path,kye"\n')
    refused(invoke("derive", "fallback.yaml"), "pyproject.toml:2:1", "columns: kye: name columns among")
    project('[tool.rngaudit.derive]\ncolumns = "path,key"\n')
    text = invoke("derive", "fallback.yaml", "-f", "text").stdout
    assert text.splitlines()[3].split() == ["#", "path", "key"], text


def test_a_common_value_only_some_commands_take_applies_to_those(project):
    """`format = "jsonl"` under [tool.rngaudit] is derive's: collisions keeps its own default (text) and runs,
    instead of refusing a value that was never meant for it."""
    project('[tool.rngaudit]\nformat = "jsonl"\n')
    r = invoke("collisions", "sharp.yaml")
    assert r.exit_code == 1 and r.stdout.startswith("sharp.yaml  (spec"), r.stdout + r.stderr
    r = invoke("derive", "fallback.yaml")
    assert r.exit_code == 0 and json.loads(r.stdout.splitlines()[0])["record"] == "header"
    # in a command's own section the value is that command's: refused there
    project('[tool.rngaudit.collisions]\nformat = "jsonl"\n')
    refused(invoke("collisions", "sharp.yaml"), "pyproject.toml:2:1", "'jsonl' is not one of")


def test_a_common_value_of_the_wrong_type_is_refused_not_given_to_another_command(project):
    """`input = "f32[3,5]"` under [tool.rngaudit] is a string: capture's --input is a list, so capture refuses it
    at its line (shard-check's --input, a string, does not make it capture's business to ignore it)."""
    project('[tool.rngaudit]\ninput = "f32[3,5]"\n')
    refused(invoke("capture", "nosuch.py:make"), "pyproject.toml:2:1", "input: must be a list of strings")


def test_columns_of_the_other_flavour_are_refused(project):
    r = invoke("derive", "fallback.yaml", "--columns", "chain")
    assert r.exit_code == 2 and "a Linen spec's report has no such column" in r.stderr
    # the other formats carry every column: --columns (set in [tool.rngaudit], say) does not concern them
    assert invoke("derive", "fallback.yaml", "--columns", "chain", "-f", "jsonl").exit_code == 0


def test_a_command_written_as_a_value_says_its_settings_are_a_table(project):
    # (it said "unknown key 'derive'; did you mean 'derive'?")
    project('[tool.rngaudit]\nderive = "x"\n')
    r = invoke("derive", "sharp.yaml")
    refused(r, "pyproject.toml:2:1", "derive: the settings of `rngaudit derive` are a table, [tool.rngaudit.derive]")
    assert "did you mean" not in r.stderr
