"""Hostile inputs and surroundings found by a sweep: each gets one `error:` line and exit 2, never exit 0 (a CI
gate passed), a traceback or exit 3, and leaves no output file behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import GUIDE, REPO, invoke, run_cli, write

FACTORIES = """
import sys

import flax.linen as nn
import jax.numpy as jnp


class M(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


class Exits(nn.Module):
    @nn.compact
    def __call__(self, x):
        sys.exit(0)


def exits():
    sys.exit(0)


def exits5():
    sys.exit(5)


def raises_base():
    raise BaseException("base")


def os_exits():
    import os

    os._exit(0)


def exits_in_call():
    return Exits(), (jnp.ones((1, 2)),)
"""


def test_the_users_sys_exit_is_an_error_not_a_pass(tmp_path):
    """A factory or a model that calls sys.exit(0) made capture and verify exit 0 with nothing checked; a bare
    BaseException gave a traceback and exit 1."""
    code = write(tmp_path, "evil.py", FACTORIES)
    out = tmp_path / "spec.yaml"
    for name, said in (
        ("exits", "called sys.exit(0)"),
        ("exits5", "called sys.exit(5)"),
        ("exits_in_call", "called sys.exit(0)"),
        ("raises_base", "raised BaseException: base"),
        ("os_exits", "called os._exit(0)"),
    ):
        r = run_cli("capture", f"{code}:{name}", "-o", out, cwd=tmp_path)
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        assert r.stderr.startswith("error: ") and said in r.stderr and "Traceback" not in r.stderr
        assert r.stderr.count("\n") == 1 and not out.exists()
    r = run_cli("verify", GUIDE, "--against", f"{code}:exits", cwd=tmp_path)
    assert r.returncode == 2 and "called sys.exit(0)" in r.stderr and r.stdout == ""


def test_a_full_stdout_is_an_error(tmp_path):
    """Writing to a full disk (/dev/full) is exit 2 with one line, for reports, --help and --version alike (it was
    exit 3, 'internal error', or a traceback)."""
    for args in (
        ["derive", GUIDE, "--no-values"],
        ["derive", GUIDE, "--no-values", "-f", "jsonl"],
        ["collisions", GUIDE, "-f", "sarif"],
        ["--version"],
        ["derive", "--help"],
    ):
        with open("/dev/full", "w") as full:
            r = subprocess.run(
                [sys.executable, "-m", "rngaudit", *map(str, args)],
                cwd=REPO,
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr == "error: cannot write to standard output (No space left on device)\n", (args, r.stderr)


def test_closed_stdin_empty_config_and_non_utf8_arguments(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "rngaudit", "derive", "-"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.close(0),
    )
    assert (
        r.returncode == 2 and r.stderr == "error: -: standard input is closed; give the spec on it, or name the file\n"
    )
    r = run_cli("derive", GUIDE, "--config", "")
    assert r.returncode == 2 and r.stderr.startswith("error: --config '': name a pyproject.toml")
    name = os.fsencode(tmp_path) + b"/s\xff.yaml"
    for args in (
        [b"collisions", b"-f", b"sarif", name],
        [b"derive", GUIDE.as_posix().encode(), b"--stdin-filename", b"x\xff"],
    ):
        r = subprocess.run([sys.executable, "-m", "rngaudit", *args], cwd=REPO, capture_output=True, timeout=120)
        assert r.returncode == 2 and r.stdout == b"", r.stderr
        assert r.stderr.endswith(b"\\xff.yaml' is not UTF-8 (a file name?); rename it or give it as UTF-8 text\n") or (
            r.stderr == b"error: 'x\\xff' is not UTF-8 (a file name?); rename it or give it as UTF-8 text\n"
        ), r.stderr


def test_half_a_utf16_pair_in_a_spec_or_a_json_input(tmp_path):
    """`"\\ud800"` reads as no character at all (YAML and JSON take it; no report can write it): exit 2 at its
    place, where it was exit 3. A real pair (`\\ud83d\\ude00`) and an escaped backslash are fine."""
    spec = write(
        tmp_path,
        "s.yaml",
        'rngaudit: 1\nrngs: {params: 0}\nmodel: {class: M, body: [{module: {class: B, name: "\\ud800", body: [make_rng]}}]}\n',
    )
    r = run_cli("derive", spec)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {spec}:3:52: the string holds \\ud800, half of a UTF-16")
    paths = tmp_path / "p.json"
    paths.write_text('["a/b", "\\ud800/x"]', encoding="utf-8")
    r = run_cli("collisions", paths)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {paths}:1:10: \\ud800 is half of a UTF-16 pair")
    paths.write_text('["a/\\ud83d\\ude00", "\\\\ud800/x"]', encoding="utf-8")
    r = run_cli("collisions", paths)
    assert r.returncode == 0, r.stderr


def test_values_that_are_not_finite_are_valid_json(tmp_path):
    """A draw whose values really are NaN (variance_scaling with a negative scale) wrote bare NaN, which JSON
    parsers refuse: the JSON formats write "NaN", "Infinity" and "-Infinity" as strings (protobuf's JSON mapping)."""
    spec = write(
        tmp_path,
        "nan.yaml",
        """
        rngaudit: 1
        rngs: {params: 0}
        model: {class: M, body: [{make_rng: {draw: {variance_scaling: {shape: [2, 2], scale: -1}}}}]}
    """,
    )

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))

    doc = strict(run_cli("derive", spec, "-f", "json").stdout)
    assert doc["calls"][0]["values"]["data"] == [["NaN", "NaN"], ["NaN", "NaN"]]
    lines = run_cli("derive", spec, "-f", "jsonl").stdout.splitlines()
    assert [strict(line)["record"] for line in lines] == ["header", "call", "summary"]


def test_output_to_a_pipe_keeps_modes_and_never_overwrites_an_input(tmp_path):
    """-o /dev/stdout on a pipe writes into it (it said 'No such file or directory'); a replaced report keeps the
    old file's permissions (600 became 644); -o naming the spec itself is refused, and the spec is untouched."""
    r = subprocess.run(
        [sys.executable, "-m", "rngaudit", "derive", GUIDE, "--no-values", "-o", "/dev/stdout"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "guide.yaml" in r.stdout.splitlines()[0] and "6 keys" in r.stdout, r.stderr
    out = tmp_path / "report.txt"
    out.write_text("old")
    out.chmod(0o600)
    assert invoke("derive", GUIDE, "--no-values", "-o", out).exit_code == 0
    assert out.stat().st_mode & 0o777 == 0o600 and "guide.yaml" in out.read_text()
    spec = tmp_path / "m.yaml"
    spec.write_text(GUIDE.read_text())
    for args in (["derive", spec, "-o", spec], ["collisions", spec, "-o", spec]):
        r = invoke(*args)
        assert r.exit_code == 2 and f"that is the input {spec}; write the report to another file" in r.stderr
        assert spec.read_text() == GUIDE.read_text()


def test_a_draw_shape_with_an_empty_dimension_is_refused():
    """`--draw normal:2,,2` was read as [2, 2] and `normal:,` as a scalar."""
    for text in ("normal:2,,2", "normal:,", "normal:2,x"):
        r = invoke("derive", GUIDE, "--draw", text)
        assert r.exit_code == 2 and f"--draw {text!r}: the shape must be integers" in r.stderr
    assert invoke("derive", GUIDE, "--draw", "normal:2,2").exit_code == 0


def test_stdin_from_the_output_file_a_broken_pipe_and_a_one_tuple_draw(tmp_path):
    """`derive - -o spec.yaml < spec.yaml` overwrote the spec; `-o /dev/stdout | head` said "cannot write (Broken
    pipe)", exit 2 (as `| head` on stdout: the reader's choice, exit 0); `--draw normal:3,` is the one-tuple (3,)."""
    spec = tmp_path / "m.yaml"
    spec.write_text(GUIDE.read_text())
    with open(spec) as stdin:
        r = subprocess.run(
            [sys.executable, "-m", "rngaudit", "derive", "-", "-o", str(spec)],
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    assert r.returncode == 2 and "that is the input on standard input" in r.stderr
    assert spec.read_text() == GUIDE.read_text()
    big = write(
        tmp_path,
        "big.yaml",
        """
        rngaudit: 1
        rngs: {params: 0}
        model: {class: M, body: [{make_rng: {repeat: 20000}}]}
    """,
    )
    r = subprocess.run(
        f"{sys.executable} -m rngaudit derive {big} -f jsonl -o /dev/stdout | head -c 100",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.stderr == "" and len(r.stdout) == 100
    one = write(tmp_path, "one.yaml", "rngaudit: 1\nrngs: {params: 0}\nmodel: {class: M, body: [make_rng]}\n")
    doc = json.loads(invoke("derive", one, "--draw", "normal:3,", "-f", "json").stdout)
    assert doc["calls"][0]["values"]["shape"] == [3]


def test_closed_stdout_a_non_utf8_name_in_a_walk_and_a_workflow_named_as_a_spec(tmp_path):
    """stdout closed (`>&-`) was exit 3 (an AttributeError): a report to it is exit 2, one to -o is written; a
    directory walk that finds a file name that is not UTF-8 reports it as that input's error and audits the others
    (its raw byte went into the JSON); a GitHub workflow named rngaudit.yml is said to be no spec (it was "the key
    'on' reads as a boolean")."""
    out = tmp_path / "r.txt"
    for args, code in (([GUIDE], 2), ([GUIDE, "--no-values", "-o", out], 0)):
        r = subprocess.run(
            [sys.executable, "-m", "rngaudit", "derive", *map(str, args)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            preexec_fn=lambda: os.close(1),
        )
        assert r.returncode == code, r.stderr
    assert r.stderr == "" and "6 keys" in out.read_text()
    walk = tmp_path / "specs"
    walk.mkdir()
    (walk / "ok.yaml").write_text(GUIDE.read_text())
    with open(os.fsencode(walk) + b"/c\xff.yaml", "w") as f:
        f.write(GUIDE.read_text())
    r = run_cli("collisions", walk, "-f", "json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and [i["file"] for i in doc["inputs"]] == [str(walk / "ok.yaml")], r.stdout
    assert doc["errors"][0]["message"] == "the file name is not UTF-8; rename it"
    flow = write(tmp_path, "rngaudit.yml", "name: ci\non: [push]\njobs: {}\n")
    r = run_cli("collisions", flow)
    assert r.returncode == 2 and "not an rngaudit spec: no `rngaudit: 1` at the top" in r.stderr
