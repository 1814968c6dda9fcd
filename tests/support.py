"""What many tests share: the repository's paths, and running the command line in this process or as a real
`python -m rngaudit` process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from typer.testing import CliRunner

from rngaudit.cli import app

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
BAD_SPECS = REPO / "tests" / "bad_specs"
GUIDE = REPO / "rngaudit" / "examples" / "guide.yaml"
# the bundled example specs of the Linen flavour (the NNX ones say `flavour: nnx`; tests/engine/test_nnx.py)
LINEN_EXAMPLES = sorted(
    p for p in (REPO / "rngaudit" / "examples").glob("*.yaml") if "flavour: nnx" not in p.read_text(encoding="utf-8")
)


def write(directory: Path, name: str, text: str) -> str:
    """Write TEXT (dedented, leading newlines dropped) to DIRECTORY/NAME; return the path as a string."""
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return str(path)


# Lines of a script (run_forking's) that count the children os.fork makes, in `forks`.
COUNT_FORKS = """
forks = []
real_fork = os.fork
def counting_fork():
    pid = real_fork()
    if pid:
        forks.append(pid)
    return pid
os.fork = counting_fork
"""


def run_forking(code: str, timeout: float = 300, cwd: Path | str | None = None, forks: bool = True) -> None:
    """Run the script `code` in a fresh Python (no JAX loaded, the two-process paths allowed) and assert it printed
    `ok`; with `forks`, a machine without two CPUs or os.fork must have stopped it at its `assert ...can_fork(),
    "expected to fork here"` instead."""
    env = {k: v for k, v in os.environ.items() if k != "RNGAUDIT_HASH_PROCESSES"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if forks and ((os.cpu_count() or 1) < 2 or not hasattr(os, "fork")):
        assert "expected to fork here" in r.stderr
        return
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def invoke(*args: object):
    """`rngaudit ARGS` in this process (typer's CliRunner): exit_code, stdout and stderr apart."""
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def run_cli(
    *args: object,
    cwd: Path | str = REPO,
    env_extra: dict | None = None,
    timeout: float = 120,
    input_text: str | None = None,
) -> subprocess.CompletedProcess:
    """`python -m rngaudit ARGS` as a real process, with colour off and no debug tracebacks (`input_text`: its
    standard input)."""
    env = dict(os.environ, NO_COLOR="1", PYTHONIOENCODING="utf-8")
    env.pop("RNGAUDIT_DEBUG", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "rngaudit", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
        input=input_text,
    )
