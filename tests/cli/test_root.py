"""What starting rngaudit imports: `--help` and `--version` load neither JAX nor NumPy nor the spec machinery,
and the package's public API loads on first use yet behaves as an eager one. (Start-up time itself is
measured by benchmarks/bench_startup.py, not here.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support import REPO, invoke

_IMPORTS = textwrap.dedent("""
    import sys
    from rngaudit.cli import main
    sys.argv = ["rngaudit", *sys.argv[1:]]
    try:
        main()
    except SystemExit as e:
        print("exit:", e.code)
    print("loaded:", sorted(m for m in sys.modules
                            if m.split(".")[0] in ("jax", "jaxlib", "flax", "numpy", "yaml")
                            or m in ("rngaudit.spec.parse", "rngaudit.spec.yaml_source", "rngaudit.api")
                            or m.split(".")[:2] in (["rngaudit", "engine"], ["rngaudit", "collision"])))
""")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["collisions", "--help"], ["derive", "--help"]])
def test_help_and_version_load_no_jax_numpy_or_spec_machinery(args):
    r = subprocess.run([sys.executable, "-c", _IMPORTS, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "exit: 0" in r.stdout and "loaded: []" in r.stdout, r.stdout + r.stderr


def test_lazy_package_api_is_the_eager_one():
    code = textwrap.dedent("""
        import rngaudit
        import rngaudit.engine.replay          # the submodule must not replace the function
        from rngaudit.engine.records import Derivation as D
        from rngaudit import *
        assert callable(replay) and replay is rngaudit.replay and replay.__module__ == "rngaudit.engine.replay"
        assert Derivation is D and load_spec.__module__ == "rngaudit.spec.parse"
        assert produce_hash(("ab", "cdef", 1)) == produce_hash(("abc", "def", 1))
        assert set(rngaudit.__all__) <= set(dir(rngaudit))
        try:
            rngaudit.no_such_name
        except AttributeError:
            print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.mark.parametrize("command", ["derive", "collisions", "shard-check", "capture", "verify", "diff"])
def test_usage_names_arguments_plainly(command):
    """`Usage: rngaudit derive [OPTIONS] SPEC`, as click and argparse write it: no typer braces around a required
    argument."""
    usage = invoke(command, "--help").stdout.splitlines()[0]
    assert usage.startswith(f"Usage: rngaudit {command} [OPTIONS] ") and "{" not in usage and "}" not in usage


@pytest.mark.parametrize("command", ["derive", "collisions", "shard-check", "capture", "verify", "diff"])
def test_help_shows_choices_as_the_readme_writes_them(command):
    """`--format text|json|github|sarif`, `--phase init|apply`: no `<...>` around choices, no `<str>`."""
    text = invoke(command, "--help").stdout
    options = [line.strip().split("  ")[0] for line in text.splitlines() if line.lstrip().startswith("-")]
    assert not [o for o in options if "<" in o], options
    assert any("--format text|json|github|sarif" in o for o in options)


@pytest.mark.parametrize("command", [(), ("derive",), ("collisions",), ("diff",), ("verify",), ("shard-check",)])
def test_dash_h_is_help(command):
    """-h is --help, as ruff, mypy and pytest take it, for the tool and every command."""
    short, long = invoke(*command, "-h"), invoke(*command, "--help")
    assert short.exit_code == long.exit_code == 0 and short.stdout == long.stdout and "Usage:" in short.stdout
