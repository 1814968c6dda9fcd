"""Time `collisions` on 1,000,000 call sites against a bare SHA-1 loop over the same inputs, in one process.

Three inputs of N call sites each (default 1,000,000), all drawing from one base key, so the birthday
bound gives about N*N/2**33 class-3 pairs (about 116 at a million), each with its separator check and a
verified rename:

  spec       a YAML spec: `modules` auto-named Block modules, each making N/modules make_rng calls;
             timed as replay (rngaudit.replay, not part of this command's own work) + call sites
             and key data (SpecSites) + the audit
  tree       a params tree JSON (what jax.tree.map(lambda x: list(x.shape), params) dumps):
             `modules` modules with N/modules params each; timed from reading the file
  paths      a JSON list of N module paths, each a module of its own; timed from reading the file

The floor is a bare loop `int.from_bytes(sha1(data).digest()[:4], "big")` over the same N hash inputs
(bytes built beforehand). Peak memory: tracemalloc's peak in a second run (tracemalloc slows Python
down, so times come from the first run) of the spec's call sites and audit (the replayed derivations
excluded), or of the JSON's read and audit; and the whole process's max RSS.

    python3 benchmarks/bench_collisions.py [--sites 1000000] [--modules 10000] [--skip spec,tree,paths]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import tempfile
import time
import tracemalloc

from rngaudit import parse_spec
from rngaudit.collisions import SpecSites, audit
from rngaudit.hashing import hash_input
from rngaudit.modpaths import load_module_sites
from rngaudit.replay import replay


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
    sha1 = hashlib.sha1
    t = time.perf_counter()
    for data in inputs:
        int.from_bytes(sha1(data).digest()[:4], "big")
    return time.perf_counter() - t


def peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def report(name: str, n: int, stages: list[tuple[str, float]], floor: float, peak: tuple[str, float], a) -> None:
    total = sum(t for _, t in stages)
    print(f"\n[{name}] {n:,} call sites: {a.failing} failing findings "
          f"({sum(1 for c in a.collisions if c.collision_class == 3)} class 3), {len(a.latent)} latent")
    for stage, t in stages:
        print(f"  {stage:<34} {t:8.3f} s")
    print(f"  {'total':<34} {total:8.3f} s  ({n / total:,.0f} call sites/s)")
    print(f"  {'bare SHA-1 loop, same inputs':<34} {floor:8.3f} s")
    print(f"  ratio total / SHA-1 loop         {total / floor:8.2f}x")
    if any(s.startswith("replay") for s, _ in stages):
        ours = sum(t for s, t in stages if not s.startswith("replay"))
        print(f"  ratio without replay / SHA-1     {ours / floor:8.2f}x")
    print(f"  tracemalloc peak, {peak[0]:<14} {peak[1]:8.1f} MiB")


def bench_spec(n: int, modules: int) -> None:
    spec = parse_spec(spec_text(modules, n // modules), "bench.yaml")
    t = time.perf_counter()
    rows = replay(spec)
    t_replay = time.perf_counter() - t
    t = time.perf_counter()
    sites = SpecSites(spec, rows=rows)
    t_sites = time.perf_counter() - t
    t = time.perf_counter()
    a = audit(sites)
    t_audit = time.perf_counter() - t
    floor = sha1_floor([d.hash_input for d in rows])
    peak = ("sites + audit", peak_mib(lambda: audit(SpecSites(spec, rows=rows))))
    report("spec", len(rows), [("replay (rngaudit.replay)", t_replay), ("call sites + key data", t_sites),
                               ("audit (group, classify, fixes)", t_audit)], floor, peak, a)


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
    report(name, sites.n, [("read JSON + call sites + hashes", t_load), ("audit (group, classify, fixes)", t_audit)],
           floor, peak, a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=1_000_000)
    ap.add_argument("--modules", type=int, default=10_000)
    ap.add_argument("--skip", default="", help="comma-separated: spec, tree, paths")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    n, modules = args.sites, args.modules
    per = n // modules
    print(f"machine: {os.cpu_count()} cores; {n:,} call sites per input")
    if "spec" not in skip:
        bench_spec(n, modules)
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
