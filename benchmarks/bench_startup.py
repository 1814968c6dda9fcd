"""Time rngaudit's start-up against `python -c "import typer, rich, yaml"`, each in fresh processes, in one run.

Each command runs `--runs` times in a fresh subprocess (stdout and stderr to /dev/null), the commands
interleaved round-robin so that load from elsewhere on the machine hits them alike; the baseline is
part of the same rounds. Reports best-of and median wall times and each command's ratio to the
baseline's (best to best, median to median). Targets (issue 7): `--help` and `collisions` on the
guide's spec each take at most 2x the baseline; `derive --no-values` is reported, with no target.

The command is the console script next to this Python (not a pyenv or similar shim, which adds its
own start-up), else `python -m rngaudit`. Bytecode is cached, as for an installed package (pip compiles
on install): every process gets PYTHONPYCACHEPREFIX, a fresh temporary folder that an untimed first run
fills, so the checkout is not written to. --uncached runs with PYTHONDONTWRITEBYTECODE=1 instead: the
checkout's modules are compiled on every start (site-packages keep their installed bytecode).

    python3 benchmarks/bench_startup.py [--runs 15] [--uncached] [--check]

With --check the exit status is 1 when a target is missed (judged on the medians), else 0.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join("rngaudit", "examples", "guide.yaml")
TARGET = 2.0


def rngaudit_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "rngaudit")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    found = shutil.which("rngaudit")
    if found and "shims" not in found:
        return [found]
    return [sys.executable, "-m", "rngaudit"]


def commands() -> list[tuple[str, list[str], float | None]]:
    """(label, argv, target ratio or None)."""
    cli = rngaudit_command()
    return [
        ('python -c "import typer, rich, yaml"', [sys.executable, "-c", "import typer, rich, yaml"], None),
        ("rngaudit --help", cli + ["--help"], TARGET),
        (f"rngaudit collisions {GUIDE}", cli + ["collisions", GUIDE], TARGET),
        (f"rngaudit derive {GUIDE} --no-values", cli + ["derive", GUIDE, "--no-values"], None),
    ]


def run_once(argv: list[str], env: dict) -> float:
    t = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    elapsed = time.perf_counter() - t
    # collisions exits 1 when it has findings; 2 means the command itself failed
    if done.returncode not in (0, 1):
        raise SystemExit(f"error: {' '.join(argv)} exited with {done.returncode}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="runs of each command (default 15)")
    ap.add_argument("--uncached", action="store_true",
                    help="compile the checkout's modules on every start (PYTHONDONTWRITEBYTECODE=1)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rngaudit-pyc-") as cache:
        env = dict(os.environ)
        if args.uncached:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            env.pop("PYTHONPYCACHEPREFIX", None)
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = cache
        times = measure(commands(), args.runs, env)
    report(times, args)


def measure(cmds, runs: int, env: dict) -> list[list[float]]:
    for _, argv, _ in cmds:  # fill the bytecode and file caches; not timed
        run_once(argv, env)
    times: list[list[float]] = [[] for _ in cmds]
    for _ in range(runs):
        for k, (_, argv, _) in enumerate(cmds):
            times[k].append(run_once(argv, env))
    return times


def report(times: list[list[float]], args) -> None:
    cmds = commands()
    bytecode = "compiled on every start (--uncached)" if args.uncached else "cached"
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, {args.runs} runs each, "
          f"interleaved; bytecode {bytecode}; command: {' '.join(rngaudit_command())}")
    base_best, base_median = min(times[0]), statistics.median(times[0])
    print(f"{'command':<56} {'best s':>8} {'median s':>9} {'best x':>7} {'median x':>9}  target")
    missed = []
    for (label, _, target), ts in zip(cmds, times):
        best, median = min(ts), statistics.median(ts)
        rb, rm = best / base_best, median / base_median
        if target is None:
            verdict = "baseline" if ts is times[0] else "-"
        else:
            ok = rm <= target
            verdict = f"<= {target:g}x {'ok' if ok else 'MISSED'}"
            if not ok:
                missed.append(label)
        print(f"{label:<56} {best:8.3f} {median:9.3f} {rb:7.2f} {rm:9.2f}  {verdict}")
    if missed and args.check:
        print(f"missed: {', '.join(missed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
