"""End to end, as a user runs it: `rngaudit derive big.yaml -f text|json|jsonl` and `rngaudit collisions big.yaml
-f text|json` in a fresh process each (interpreter start, YAML, replay, keys and the report written to a file),
against the bare SHA-1 loop over the same call sites' hash inputs, run in this process. Prints wall time, the ratio
to the floor and each run's peak memory (its own maximum resident set).

    python3 benchmarks/bench_output.py [--sites 1000000] [--runs 3]

Targets (issue 17): jsonl <= 1.5x, text <= 2x, json <= 2x the floor; peak memory under 500 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time

SPEC = """\
rngaudit: 1
rngs: {{params: 0, dropout: 1}}
model:
  class: Model
  body:
    - module:
        class: Block
        repeat: {blocks}
        body:
          - make_rng: {{stream: dropout, repeat: 100}}
"""


def floor(blocks: int, runs: int) -> float:
    """SHA-1 of every call site's hash input (prepared beforehand), the best of `runs`."""
    from rngaudit.engine.hashing import hash_input

    inputs = [hash_input((f"Block_{b}", c), False) for b in range(blocks) for c in range(1, 101)]
    sha1 = hashlib.sha1
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for data in inputs:
            sha1(data).digest()
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: list[str], runs: int) -> tuple[float, float]:
    """Best wall time (s) and the largest peak RSS (MB) of `python -m rngaudit ARGS` over `runs` runs."""
    best, peak = float("inf"), 0.0
    env = dict(os.environ, NO_COLOR="1")
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "rngaudit", *args], stdout=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        elapsed = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode not in (0, 1):
            raise SystemExit(f"rngaudit {' '.join(args)} exited {p.returncode}")
        best = min(best, elapsed)
        peak = max(peak, usage.ru_maxrss / 1024)  # (KiB on Linux)
    return best, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    blocks = max(args.sites // 100, 1)
    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "big.yaml")
        with open(spec, "w", encoding="utf-8") as f:
            f.write(SPEC.format(blocks=blocks))
        out = os.path.join(tmp, "out")
        base = floor(blocks, args.runs)
        print(f"{blocks * 100:,} call sites; SHA-1 floor {base:.2f} s (this process)")
        print(f"{'command':<40} {'time':>8} {'x floor':>8} {'peak MB':>8}")
        for label, cmd in (
            ("derive -f jsonl", ["derive", spec, "-f", "jsonl", "-o", out]),
            ("derive -f text --max-rows 0", ["derive", spec, "--max-rows", "0", "-o", out]),
            ("derive -f text (first 1,000 rows)", ["derive", spec, "-o", out]),
            ("derive -f json", ["derive", spec, "-f", "json", "-o", out]),
            ("derive -f jsonl --no-values", ["derive", spec, "-f", "jsonl", "--no-values", "-o", out]),
            ("collisions -f text", ["collisions", spec, "-o", out]),
            ("collisions -f json", ["collisions", spec, "-f", "json", "-o", out]),
        ):
            t, mb = run(cmd, args.runs)
            print(f"{label:<40} {t:>7.2f}s {t / base:>7.2f}x {mb:>8.0f}")


if __name__ == "__main__":
    main()
