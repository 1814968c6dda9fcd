"""Time `derive` (replay + exact NumPy Threefry keys) against baselines run in the same process.

Baselines: (1) a bare loop that only computes the SHA-1 hash words of the same inputs (the floor
in CPython), (2) a naive replay with one eager `jax.random.fold_in` per key (timed on a sample
and scaled up). Prints the ratios.

    python3 benchmarks/bench_derive.py [--modules 2000] [--per-module 100] [--jax-sample 2000]
"""
from __future__ import annotations

import argparse
import os
import time

from rngaudit import parse_spec
from rngaudit.hashing import hash_input, hash_word
from rngaudit.keys import derive_keys, engine_for
from rngaudit.replay import replay


def build_spec(modules: int, per_module: int) -> str:
    return f"""
rngaudit: 1
rngs: {{params: 0, dropout: 1}}
model:
  class: Model
  body:
    - module:
        class: Block
        repeat: {modules}
        body:
          - make_rng: {{stream: dropout, repeat: {per_module // 2}}}
          - make_rng: {{stream: params, repeat: {per_module - per_module // 2}}}
"""


def best_of(fn, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, default=2000)
    ap.add_argument("--per-module", type=int, default=100)
    ap.add_argument("--jax-sample", type=int, default=2000)
    args = ap.parse_args()

    spec = parse_spec(build_spec(args.modules, args.per_module), "bench.yaml")
    engine = engine_for(spec)
    rows = replay(spec)
    n = len(rows)
    items = [d.hash_items for d in rows]

    def ours():
        r = replay(spec)
        derive_keys(spec, r, engine)

    def sha_floor():
        for it in items:
            hash_word(hash_input(it, False))

    t_ours = best_of(ours)
    t_sha = best_of(sha_floor)

    import jax
    import jax.numpy as jnp

    roots = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    sample = rows[: args.jax_sample]
    jax.random.fold_in(roots["params"], jnp.uint32(0)).block_until_ready()

    def naive_jax():
        for d in sample:
            k = jax.random.fold_in(roots[d.stream], jnp.uint32(d.hash_word))
        k.block_until_ready()

    t_jax = best_of(naive_jax, runs=1) * n / len(sample)

    print(f"machine: {os.cpu_count()} cores; jax {jax.__version__}")
    print(f"call sites: {n:,}")
    print(f"rngaudit replay + keys : {t_ours:8.3f} s  ({n / t_ours:,.0f} keys/s)")
    print(f"bare SHA-1 loop (floor): {t_sha:8.3f} s")
    print(f"naive jax.fold_in loop : {t_jax:8.3f} s  (extrapolated from {len(sample):,} keys)")
    print(f"ratio rngaudit / SHA-1 floor : {t_ours / t_sha:6.2f}x")
    print(f"speed-up vs naive fold_in    : {t_jax / t_ours:6.1f}x")


if __name__ == "__main__":
    main()
