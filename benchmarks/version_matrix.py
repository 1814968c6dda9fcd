"""The version matrix: every Flax release rngaudit has rules for, each with a JAX of its era, checked against
derive under that release's rules (`flax: {version}`).

For each release it makes a virtualenv (kept under --workdir and reused), installs that Flax and JAX there,
and in it:
  1. builds random Linen models in real Flax (the Hypothesis generators of tests/engine/test_replay_property.py,
     which keep to what the release has, every spec naming the release) and compares every key with derive;
  2. records the hand-written models of tests/data/record_old_linen.py (nn.jit, a fallback stream, nn.vmap,
     scan over remat, setup) and its probe models (jax reusing an nn.jit trace, each in a fresh process),
     and then, in this Python, tests/engine/test_linen_versions.py compares derive with that recording and
     checks the upgrade check (`diff --from-flax A --to-flax B`) against the keys two releases hand out.
It prints one row per release. Too slow for CI (installs and a few minutes per release); run it before a
release, or when a new Flax comes out (add it to MATRIX):

    python3 benchmarks/version_matrix.py                      # every release, 100 random models each
    python3 benchmarks/version_matrix.py --only 0.10.1 --examples 300
    python3 benchmarks/version_matrix.py --record             # also rewrite tests/data/linen_old_flax.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = ["pyyaml", "rich", "typer<0.29", "pytest", "hypothesis"]
# (flax, the jax of its era, extra pins that release needs to import)
MATRIX = [
    ("0.8.1", "0.4.25", ["numpy<2", "orbax-checkpoint<0.6", "ml_dtypes<0.5"]),
    ("0.8.2", "0.4.26", ["numpy<2", "orbax-checkpoint<0.6", "ml_dtypes<0.5"]),
    ("0.8.5", "0.4.30", ["numpy<2", "orbax-checkpoint<0.6"]),
    ("0.9.0", "0.4.31", []),
    ("0.10.0", "0.4.34", []),
    ("0.10.1", "0.4.35", []),
    ("0.10.2", "0.4.38", []),
    ("0.11.0", "0.7.0", []),
    ("0.12.8", "0.10.2", []),
]


def venv(workdir: Path, flax: str, jax: str, extra: list[str]) -> Path:
    """A virtualenv with this Flax and JAX (made once, reused)."""
    where = workdir / f"flax-{flax}-jax-{jax}"
    python = where / "bin" / "python"
    ok = python.exists() and subprocess.run([python, "-c", "import flax.linen"], capture_output=True).returncode == 0
    if not ok:
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        pins = [f"flax=={flax}", f"jax=={jax}", f"jaxlib=={jax}", *extra, *TOOLS]
        subprocess.run([python, "-m", "pip", "install", "-q", *pins], check=True)
    return python


def _pytest(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest in that release's virtualenv, on this checkout (rngaudit and the tests' oracle from here)."""
    return subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}", **env),
        capture_output=True,
        text=True,
    )


def sweep(python: Path, examples: int) -> tuple[bool, str]:
    """The random-model sweep in that release: (passed, pytest's last line)."""
    r = _pytest(
        python,
        "tests/engine/test_replay_property.py",
        "-k",
        "random_models or random_transformed",
        RNGAUDIT_HYPOTHESIS_EXAMPLES=str(examples),
        RNGAUDIT_HYPOTHESIS_TRANSFORM_EXAMPLES=str(examples),
    )
    return r.returncode == 0, (r.stdout.strip().splitlines() or ["(no output)"])[-1]


def differential(python: Path) -> tuple[bool, str]:
    """The differential suite (tests/engine/test_replay_differential.py, the hand-written models) in that release,
    each spec under that release's rules (a model using what the release lacks is skipped). Its tests also assert
    what the newest Flax does (a stream fallback, a key count); only a failure inside the oracle's comparison is
    a disagreement between derive and that Flax: (no disagreement, summary)."""
    r = _pytest(python, "--tb=line", "tests/engine/test_replay_differential.py")
    lines = r.stdout.strip().splitlines() or ["(no output)"]
    disagree = sum(1 for line in lines if "flax_oracle.py:" in line and "Error" in line)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped)", lines[-1])}
    ran = counts.get("passed", 0) + counts.get("failed", 0)
    newest = counts.get("failed", 0) - disagree
    text = f"{ran - disagree} of {ran} agree"
    if newest:
        text += f" ({newest} tests also expect the newest release's behaviour)"
    if counts.get("skipped"):
        text += f", {counts['skipped']} use what it lacks"
    return disagree == 0 and r.returncode in (0, 1), text


def record(python: Path, out: Path, random: int) -> str:
    env = dict(
        os.environ,
        PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}",
        RNGAUDIT_RECORD_OUT=str(out),
        RNGAUDIT_RECORD_RANDOM=str(random),
    )
    r = subprocess.run([python, "tests/data/record_old_linen.py"], cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"recording failed in {python}:\n{r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


def compare(recording: Path) -> tuple[bool, str]:
    """tests/engine/test_linen_versions.py on that recording, in this Python (the newest Flax)."""
    env = dict(os.environ, RNGAUDIT_LINEN_RECORDING=str(recording))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_linen_versions.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    return r.returncode == 0, (r.stdout.strip().splitlines() or ["(no output)"])[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/rngaudit-version-matrix", help="where the virtualenvs live")
    ap.add_argument("--only", help="comma-separated Flax releases of the matrix")
    ap.add_argument("--examples", type=int, default=100, help="random models of each generator per release")
    ap.add_argument("--record", action="store_true", help="write the recording to tests/data/linen_old_flax.json")
    a = ap.parse_args()
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(",")) if a.only else None
    recording = REPO / "tests" / "data" / "linen_old_flax.json" if a.record else workdir / "recording.json"
    if not a.record:
        recording.unlink(missing_ok=True)
    rows = []
    for flax, jax, extra in MATRIX:
        if only and flax not in only:
            continue
        t = time.perf_counter()
        python = venv(workdir, flax, jax, extra)
        ok, last = sweep(python, a.examples)
        dok, dlast = differential(python)
        recorded = record(python, recording, 40)
        verdict = f"{'pass' if ok else 'FAIL'}: {a.examples} plain + {a.examples} transformed models"
        dverdict = f"{'pass' if dok else 'FAIL'}: {dlast}"
        rows.append((flax, jax, verdict, dverdict, re.sub(r" -> .*", "", recorded), time.perf_counter() - t))
        print(
            f"flax {flax} / jax {jax}: sweep {'pass' if ok else 'FAIL'} ({last}); differential {dlast}; {recorded}",
            flush=True,
        )
    ok, last = compare(recording)
    print()
    print(
        "| flax | jax | random models in real Flax vs derive | differential suite | recorded for the default run | time |"
    )
    print("|---|---|---|---|---|---|")
    for flax, jax, verdict, dverdict, recorded, secs in rows:
        print(f"| {flax} | {jax} | {verdict} | {dverdict} | {recorded.split(': ', 1)[1]} | {secs:.0f} s |")
    print(f"\nderive and the upgrade check against the recording: {'pass' if ok else 'FAIL'} ({last})")
    doc = json.loads(recording.read_text())
    order = sorted(doc, key=lambda v: tuple(int(x) for x in re.findall(r"\d+", v)))
    print(f"recorded releases: {', '.join(order)}")
    return 0 if ok and all(r[2].startswith("pass") and r[3].startswith("pass") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
