"""Time `collisions` on 1,000,000 call sites against a bare SHA-1 loop over the same inputs, in one process.

Three inputs of N call sites each (default 1,000,000), all drawing from one base key, so the birthday
bound gives about N*N/2**33 class-3 pairs (about 116 at a million), each with its separator check and a
verified rename:

  spec       a YAML spec: `modules` auto-named Block modules, each making N/modules make_rng calls;
             timed as the command runs it: replay on derive's fast path + call sites and key data
             (spec_sites) + the audit; best of 3
  tree       a params tree JSON (what jax.tree.map(lambda x: list(x.shape), params) dumps):
             `modules` modules with N/modules params each; timed from reading the file
  paths      a JSON list of N module paths, each a module of its own; timed from reading the file
  command    the spec through `python -m rngaudit collisions` in a fresh process, report written to a
             file (text and JSON): start-up, YAML and the report included; best of 3
  shapes     the three models of bench_derive.py (blocks with two streams, a vmap of experts, a scan
             over layers), timed as `spec`

The floor is a bare loop `[int.from_bytes(sha1(data).digest()[:4], "big") for data in inputs]` over the
same N hash inputs (bytes built beforehand), best of 3; it runs on one core. rngaudit hashes a large
spec in two processes when two CPUs are free (RNGAUDIT_HASH_PROCESSES=1: one), and compares
threefry2x32 keys as (base key, hash word), computing keys for the reported sites only. Peak
memory: tracemalloc's peak in a second run (tracemalloc slows Python down, so times come from the
first run) of the spec's call sites and audit, or of the JSON's read and audit; and the whole
process's max RSS.

    python3 benchmarks/bench_collisions.py [--sites 1000000] [--modules 10000] [--skip spec,command,shapes,tree,paths]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc

from rngaudit import parse_spec
from rngaudit.collision.audit import audit
from rngaudit.collision.module_paths import load_module_sites
from rngaudit.collision.spec_sites import spec_sites
from rngaudit.engine.hashing import hash_input


def spec_text(modules: int, per_module: int) -> str:
    return f"""
rngaudit: 1
rngs: {{params: 0}}
model:
  class: Model
  body:
    - module:
        class: Block
        repeat: {modules}
        body:
          - make_rng: {{stream: params, repeat: {per_module}}}
"""


def sha1_floor(inputs: list[bytes]) -> float:
    """Best of 3: one hashlib call per input, the word taken from the digest (a list comprehension,
    the fastest plain loop in CPython)."""
    sha1 = hashlib.sha1
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        [int.from_bytes(sha1(data).digest()[:4], "big") for data in inputs]
        best = min(best, time.perf_counter() - t)
    return best


def peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def report(name: str, n: int, stages: list[tuple[str, float]], floor: float, peak: tuple[str, float], a) -> None:
    total = sum(t for _, t in stages)
    print(
        f"\n[{name}] {n:,} call sites: {a.failing} failing findings "
        f"({sum(1 for c in a.collisions if c.collision_class == 3)} class 3), {len(a.latent)} latent"
    )
    for stage, t in stages:
        print(f"  {stage:<34} {t:8.3f} s")
    print(f"  {'total':<34} {total:8.3f} s  ({n / total:,.0f} call sites/s)")
    print(f"  {'bare SHA-1 loop, same inputs':<34} {floor:8.3f} s")
    print(f"  ratio total / SHA-1 loop         {total / floor:8.2f}x")
    if any(s.startswith("replay") for s, _ in stages):
        ours = sum(t for s, t in stages if not s.startswith("replay"))
        print(f"  ratio without replay / SHA-1     {ours / floor:8.2f}x")
    if peak[1] == peak[1]:  # (not measured: nan)
        print(f"  tracemalloc peak, {peak[0]:<14} {peak[1]:8.1f} MiB")


def bench_spec(text: str, name: str = "spec", peak: bool = True) -> float:
    """The command's own path: replay on derive's fast path, call sites and keys (spec_sites), audit.
    Returns the floor."""
    spec = parse_spec(text, "bench.yaml")
    best = None
    for _ in range(3):
        t = time.perf_counter()
        sites = spec_sites(spec)
        t_sites = time.perf_counter() - t
        t = time.perf_counter()
        a = audit(sites)
        t_audit = time.perf_counter() - t
        if best is None or t_sites + t_audit < sum(best):
            best = (t_sites, t_audit)
    inputs = [hash_input(sites.items(i), spec.fix_rng_separator) for i in range(sites.n)]
    floor = sha1_floor(inputs)
    del inputs
    traced = ("replay + audit", peak_mib(lambda: audit(spec_sites(spec))) if peak else float("nan"))
    report(
        name,
        sites.n,
        [("call sites: replay, hashes, keys", best[0]), ("audit (group, classify, fixes)", best[1])],
        floor,
        traced,
        a,
    )
    return floor


def bench_command(modules: int, per_module: int, floor: float) -> None:
    """The whole command in a fresh process, as a user runs it: start-up, YAML, replay, audit, and the
    report written to a file (text, and JSON); best of 3."""
    print("\n[command] rngaudit collisions on the spec, end to end (fresh process, report to a file)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.yaml")
        with open(path, "w") as f:
            f.write(spec_text(modules, per_module))
        for fmt in ("text", "json"):
            out = os.path.join(tmp, f"report.{fmt}")
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                r = subprocess.run(
                    [sys.executable, "-m", "rngaudit", "collisions", path, "--format", fmt, "-o", out],
                    capture_output=True,
                    text=True,
                )
                best = min(best, time.perf_counter() - t)
                if r.returncode not in (0, 1):
                    raise SystemExit(f"rngaudit collisions failed ({r.returncode}): {r.stderr}")
            size = os.path.getsize(out) / 2**20
            print(f"  --format {fmt:<5} ({size:5.1f} MiB)        {best:8.3f} s   {best / floor:5.2f}x the SHA-1 loop")


def bench_json(name: str, value, inputs: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.json")
        with open(path, "w") as f:
            json.dump(value, f)
        del value
        t = time.perf_counter()
        sites = load_module_sites(path)
        t_load = time.perf_counter() - t
        t = time.perf_counter()
        a = audit(sites)
        t_audit = time.perf_counter() - t
        floor = sha1_floor(inputs)
        peak = ("read + audit", peak_mib(lambda: audit(load_module_sites(path))))
    report(
        name,
        sites.n,
        [("read JSON + call sites + hashes", t_load), ("audit (group, classify, fixes)", t_audit)],
        floor,
        peak,
        a,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=1_000_000)
    ap.add_argument("--modules", type=int, default=10_000)
    ap.add_argument("--skip", default="", help="comma-separated: spec, command, shapes, tree, paths")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    n, modules = args.sites, args.modules
    per = n // modules
    print(f"machine: {os.cpu_count()} cores; {n:,} call sites per input")
    if "spec" not in skip:
        floor = bench_spec(spec_text(modules, n // modules))
        if "command" not in skip:
            bench_command(modules, n // modules, floor)
    if "shapes" not in skip:
        from bench_derive import shapes

        for name, text in shapes(n).items():
            bench_spec(text, f"spec: {name}", peak=False)
    if "tree" not in skip:
        tree = {"params": {f"Block_{i}": {f"p{j}": [4, 4] for j in range(per)} for i in range(modules)}}
        inputs = [hash_input((f"Block_{i}", c), False) for i in range(modules) for c in range(1, per + 1)]
        bench_json("tree", tree, inputs)
    if "paths" not in skip:
        paths = [f"Block_{i}/Dense_{j}" for i in range(n // 10) for j in range(10)]
        inputs = [hash_input((f"Block_{i}", f"Dense_{j}", 1), False) for i in range(n // 10) for j in range(10)]
        bench_json("paths", paths, inputs)
    print(f"\nprocess max RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB")


if __name__ == "__main__":
    main()
