"""Hostile YAML through the real command line: refused in bounded memory, with one `error:` line (how fast is
measured by benchmarks, not here).

Each run is measured in a fresh process that starts the command as its only child, so
`resource.getrusage(RUSAGE_CHILDREN)` is that command's own peak memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import REPO

from rngaudit.shard.request import (
    SpecTarget,
    make_request,
    request_from_json,
    request_json,
)

MAX_RSS_MIB = 400

_MEASURE = """
import json, resource, subprocess, sys
p = subprocess.run(sys.argv[1:], capture_output=True, text=True, encoding="utf-8", errors="replace")
u = resource.getrusage(resource.RUSAGE_CHILDREN)
rss_kib = u.ru_maxrss if sys.platform != "darwin" else u.ru_maxrss // 1024
print(json.dumps({"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "rss_mib": rss_kib / 1024}))
"""


def measured(*args: str, cwd=REPO) -> dict:
    env = dict(os.environ, NO_COLOR="1", PYTHONIOENCODING="utf-8")
    env.pop("RNGAUDIT_DEBUG", None)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, sys.executable, "-m", "rngaudit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return json.loads(out.stdout)


def refused_within_bounds(r: dict, file: str, message: str) -> None:
    assert r["rc"] == 2, r
    assert r["stdout"] == ""
    assert r["stderr"].startswith(f"error: {file}:") and r["stderr"].count("\n") == 1, r["stderr"]
    assert message in r["stderr"], r["stderr"]
    assert "Traceback" not in r["stderr"] and "internal error" not in r["stderr"]
    assert r["rss_mib"] < MAX_RSS_MIB, r


def _billion_laughs() -> bytes:
    lines = [b"rngaudit: 1", b"a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 10):
        lines.append(b"a%d: &a%d [" % (i, i) + b", ".join([b"*a%d" % (i - 1)] * 10) + b"]")
    return b"\n".join(lines + [b"model: {class: M}", b""])


HEAD = b"rngaudit: 1\nmodel: {class: M}\n"
CASES = {  # name -> (bytes, the message's essential part)
    "billion_laughs": (_billion_laughs(), "YAML nodes (an alias bomb?)"),
    "nesting_10000_deep": (
        b"rngaudit: 1\nmodel: " + b"[" * 10_000 + b"]" * 10_000 + b"\n",
        "YAML nested deeper than 200 levels",
    ),
    "nesting_10000_deep_mappings": (
        b"rngaudit: 1\nmodel: " + b"{a: " * 10_000 + b"1" + b"}" * 10_000 + b"\n",
        "YAML nested deeper than 200 levels",
    ),
    "junk_100_mb": (None, "the file is larger than 4 MiB; a spec this large needs --max-spec-mib"),
    "junk_just_under_the_size_limit": (HEAD + b"junk: " + b"x" * (4 * 1024 * 1024 - 64) + b"\n", "unknown key 'junk'"),
    "many_nodes": (HEAD + b"".join(b"k%d: [1, 2]\n" % i for i in range(200_000))[: 4 * 1024 * 1024 - 64], "YAML nodes"),
    "python_object_apply": (
        b"rngaudit: 1\nmodel: !!python/object/apply:os.system ['touch PWNED']\n",
        "YAML tag !!python/object/apply:os.system is not allowed",
    ),
    "python_object": (
        b"rngaudit: 1\nmodel: !!python/object:collections.OrderedDict {}\n",
        "YAML tag !!python/object:collections.OrderedDict is not allowed",
    ),
    "python_name": (b"rngaudit: !!python/name:os.system\nmodel: {class: M}\n", "YAML tag !!python/name:os.system"),
    "binary_tag": (b"rngaudit: 1\nmodel: !!binary aGVsbG8=\n", "YAML tag !!binary is not allowed"),
    "set_tag": (b"rngaudit: 1\nmodel: !!set {a, b}\n", "YAML tag !!set is not allowed"),
    "custom_tag": (b"rngaudit: 1\nmodel: !Model {class: M}\n", "YAML tag !Model is not allowed"),
    "recursive_alias": (b"rngaudit: 1\nmodel: &m {class: M, body: [*m]}\n", "recursive structure"),
}


@pytest.mark.parametrize("command", ["derive", "collisions"])
@pytest.mark.parametrize("name", list(CASES))
def test_hostile_yaml_is_refused_in_bounded_memory(name, command, tmp_path):
    data, message = CASES[name]
    spec = tmp_path / f"{name}.yaml"
    if data is None:
        with open(spec, "wb") as f:  # 100 MB of junk, written without holding it in memory here
            block = os.urandom(1 << 20)
            f.writelines(block for _ in range(100))
    else:
        spec.write_bytes(data)
    args = ["derive", "--no-values"] if command == "derive" else ["collisions", "--no-keys"]
    r = measured(*args, str(spec), cwd=tmp_path)
    refused_within_bounds(r, str(spec), message)
    assert not (tmp_path / "PWNED").exists()  # nothing was constructed, let alone run


# ---------------------------------------------------------------- a legitimately large spec still loads
def _large_spec(modules: int) -> str:
    lines = ["rngaudit: 1", "rngs: {params: 0}", "model:", "  class: M", "  body:"]
    lines += [
        f"    - module: {{class: B, name: b{i}, body: [{{make_rng: params}}, {{param: w}}]}}" for i in range(modules)
    ]
    return "\n".join(lines) + "\n"


def test_the_limit_flags_and_their_configuration_keys(tmp_path, monkeypatch):
    """The limits are options (and pyproject keys): a small limit refuses a spec the default accepts."""
    from typer.testing import CliRunner

    from rngaudit.cli import app

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "m.yaml"
    spec.write_text(_large_spec(20))  # 20 modules: about 250 YAML nodes, 1.3 KB
    run = lambda *a: CliRunner().invoke(app, [*a], catch_exceptions=False)
    assert run("derive", str(spec), "--no-values").exit_code == 0
    r = run("derive", str(spec), "--no-values", "--max-yaml-nodes", "100")
    assert r.exit_code == 2 and "more than 100 YAML nodes" in r.stderr and "--max-yaml-nodes" in r.stderr
    (tmp_path / "pyproject.toml").write_text("[tool.rngaudit]\nmax-yaml-nodes = 100\n")
    r = run("collisions", str(spec), "--no-keys")
    assert r.exit_code == 2 and "more than 100 YAML nodes" in r.stderr
    assert run("collisions", str(spec), "--no-keys", "--max-yaml-nodes", "1000").exit_code == 0
    (tmp_path / "pyproject.toml").unlink()
    big = tmp_path / "big.yaml"
    big.write_text(_large_spec(2) + "#" * (5 * 1024 * 1024) + "\n")
    r = run("derive", str(big), "--no-values")
    assert r.exit_code == 2 and "larger than 4 MiB" in r.stderr
    assert run("derive", str(big), "--no-values", "--max-spec-mib", "6").exit_code == 0


def test_shard_check_passes_the_limits_to_its_device_process():
    r = make_request(specs=[SpecTarget("m.yaml")])
    import dataclasses

    r = dataclasses.replace(r, spec_limits=(123, 456))
    assert request_from_json(json.loads(json.dumps(request_json(r)))).spec_limits == (123, 456)


@pytest.mark.slow
def test_a_spec_larger_than_the_default_node_limit_loads_with_the_flag(tmp_path):
    """About 130,000 YAML nodes: refused by default (quickly), loaded and audited with --max-yaml-nodes."""
    spec = tmp_path / "large.yaml"
    spec.write_text(_large_spec(10_000))
    r = measured("derive", "--no-values", "-f", "json", str(spec), cwd=tmp_path)
    refused_within_bounds(r, str(spec), "more than 100000 YAML nodes")
    r = measured("derive", "--no-values", "-f", "json", "--max-yaml-nodes", "200000", str(spec), cwd=tmp_path)
    assert r["rc"] == 0, r["stderr"]
    assert json.loads(r["stdout"])["summary"]["calls"] == 20_000
