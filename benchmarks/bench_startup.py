"""Time rngaudit's start-up against `python -c "import typer, rich, yaml"`, each in fresh processes, in one run.

Each command runs `--runs` times in a fresh subprocess (stdout and stderr to /dev/null), the commands
interleaved round-robin so that load from elsewhere on the machine hits them alike; the baseline is
part of the same rounds. Reports best-of and median wall times, each command's ratio to the baseline's
(best to best, median to median), and the ratio of best CPU times (user + system of the process, which
load from elsewhere disturbs less than wall time). Targets (issue 7): `--help` and `collisions` on the
guide's spec each take at most 2x the baseline; `derive --no-values` is reported, with no target.

The command is the console script next to this Python (not a pyenv or similar shim, which adds its
own start-up), else `python -m rngaudit`. Bytecode is cached, as for an installed package (pip compiles
on install): every process gets PYTHONPYCACHEPREFIX, a fresh temporary folder that an untimed first run
fills, so the checkout is not written to. --uncached runs with PYTHONDONTWRITEBYTECODE=1 instead: the
checkout's modules are compiled on every start (site-packages keep their installed bytecode).

    python3 benchmarks/bench_startup.py [--runs 15] [--uncached] [--check]

With --check the exit status is 1 when a target is missed, else 0. Targets are judged on best-of ratios:
on a shared machine the best run is the one least disturbed by other work (medians are shown too).
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


def run_once(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    # collisions exits 1 when it has findings; 2 means the command itself failed
    if proc.returncode not in (0, 1):
        raise SystemExit(f"error: {' '.join(argv)} exited with {proc.returncode}")
    return elapsed, usage.ru_utime + usage.ru_stime


def measure(cmds, runs: int, env: dict) -> list[list[tuple[float, float]]]:
    for _, argv, _ in cmds:  # fill the bytecode and file caches; not timed
        run_once(argv, env)
    times: list[list[tuple[float, float]]] = [[] for _ in cmds]
    for _ in range(runs):
        for k, (_, argv, _) in enumerate(cmds):
            times[k].append(run_once(argv, env))
    return times


def report(cmds, times: list[list[tuple[float, float]]], args) -> list[str]:
    """Print the table; return the labels of the commands that miss their target."""
    bytecode = "compiled on every start (--uncached)" if args.uncached else "cached"
    print(
        f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, {args.runs} runs each, "
        f"interleaved; bytecode {bytecode}; command: {' '.join(rngaudit_command())}"
    )
    base = [w for w, _ in times[0]]
    base_best, base_median, base_cpu = min(base), statistics.median(base), min(c for _, c in times[0])
    print(f"{'command':<56} {'best s':>7} {'median s':>8} {'best x':>7} {'median x':>8} {'cpu x':>6}  target")
    missed = []
    for k, ((label, _, target), runs) in enumerate(zip(cmds, times)):
        wall = [w for w, _ in runs]
        best, median, cpu = min(wall), statistics.median(wall), min(c for _, c in runs)
        rb = best / base_best
        if target is None:
            verdict = "baseline" if k == 0 else "-"
        else:
            verdict = f"<= {target:g}x " + ("ok" if rb <= target else "MISSED")
            if rb > target:
                missed.append(label)
        print(
            f"{label:<56} {best:7.3f} {median:8.3f} {rb:7.2f} {median / base_median:8.2f} {cpu / base_cpu:6.2f}"
            f"  {verdict}"
        )
    return missed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="runs of each command (default 15)")
    ap.add_argument(
        "--uncached",
        action="store_true",
        help="compile the checkout's modules on every start (PYTHONDONTWRITEBYTECODE=1)",
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args()
    cmds = commands()
    with tempfile.TemporaryDirectory(prefix="rngaudit-pyc-") as cache:
        env = dict(os.environ)
        if args.uncached:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            env.pop("PYTHONPYCACHEPREFIX", None)
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = cache
        times = measure(cmds, args.runs, env)
    missed = report(cmds, times, args)
    if missed and args.check:
        print(f"missed: {', '.join(missed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
