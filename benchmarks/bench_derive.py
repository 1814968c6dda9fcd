"""Time `derive` (replay + exact NumPy Threefry keys) against baselines run in the same process.

For each model shape (1,000,000 call sites by default):
  rngaudit  the fast path (rngaudit.engine.table: blocks, columns, vectorised Threefry), replay + every key;
  plain     the reference path (one Derivation per call, keys per base), for comparison;
  floor     a bare loop that only computes the SHA-1 hash words of the same inputs (the floor in
            CPython: one hashlib call per call site, on bytes prepared beforehand);
  naive     a replay with one eager `jax.random.fold_in` per key (timed on a sample, scaled up).
Prints the times and the ratios side by side; --check exits 1 when a target is missed
(rngaudit <= 1.5x the floor, >= 100x faster than naive).

    python3 benchmarks/bench_derive.py [--sites 1000000] [--jax-sample 3000] [--no-plain] [--check]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

from rngaudit import parse_spec
from rngaudit.engine.keys import derive_keys, engine_for
from rngaudit.engine.replay import replay
from rngaudit.engine.table import key_table


def shapes(sites: int) -> dict[str, str]:
    """Model specs of about `sites` call sites each."""
    blocks = max(sites // 100, 1)
    experts = 1000
    per_expert = max(sites // experts // 2, 1)
    layers = 96
    per_layer = max(sites // layers, 4)
    return {
        f"{blocks} blocks x 100 make_rng": f"""
rngaudit: 1
rngs: {{params: 0, dropout: 1}}
model:
  class: Model
  body:
    - module:
        class: Block
        repeat: {blocks}
        body:
          - make_rng: {{stream: dropout, repeat: 50}}
          - make_rng: {{stream: params, repeat: 50}}
""",
        f"vmap of {experts} experts": f"""
rngaudit: 1
rngs: {{params: 0, dropout: 1}}
model:
  class: MoE
  body:
    - vmap:
        module:
          class: Expert
          body:
            - make_rng: {{stream: dropout, repeat: {per_expert}}}
            - make_rng: {{stream: params, repeat: {per_expert}}}
        axis_size: {experts}
        split_rngs: all
        variable_axes: {{params: 0}}
""",
        f"scan over {layers} layers": f"""
rngaudit: 1
rngs: {{params: 0, dropout: 1}}
model:
  class: Transformer
  body:
    - scan:
        module:
          class: Layer
          body:
            - module: {{class: Attn, body: [{{make_rng: {{stream: dropout, repeat: {per_layer // 4}}}}}]}}
            - module: {{class: Mlp, body: [{{make_rng: {{stream: dropout, repeat: {per_layer // 4}}}}}]}}
            - make_rng: {{stream: params, repeat: {per_layer - 2 * (per_layer // 4)}}}
        length: {layers}
        split_rngs: all
        variable_axes: {{params: 0}}
""",
    }


def best_of(fn, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench(name: str, text: str, args, jax, jnp) -> list[str]:
    spec = parse_spec(text, "bench.yaml")
    engine = engine_for(spec)
    table = key_table(spec)
    rows = [table.derivation(i) for i in range(table.n)]  # the inputs, prepared outside every timing
    inputs = [d.hash_input for d in rows if not d.discarded]
    n = len(inputs)

    def ours():
        key_table(spec).keys(engine)

    sha1 = hashlib.sha1

    def sha_floor():
        return [int.from_bytes(sha1(b).digest()[:4], "big") for b in inputs]

    t_ours = best_of(ours)
    t_sha = best_of(sha_floor)
    t_plain = None
    if args.plain:

        def plain():
            derive_keys(spec, replay(spec), engine)

        t_plain = best_of(plain, runs=1)

    roots = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    sample = [d for d in rows if not d.discarded][: args.jax_sample]
    jax.random.fold_in(roots["params"], jnp.uint32(0)).block_until_ready()

    def naive_jax():
        k = None
        for d in sample:
            w = int.from_bytes(sha1(d.hash_input).digest()[:4], "big")
            k = jax.random.fold_in(roots[d.stream], jnp.uint32(w))  # (lane bases omitted: a lower bound)
        k.block_until_ready()

    t_jax = best_of(naive_jax, runs=1) * n / len(sample)
    ratio, speedup = t_ours / t_sha, t_jax / t_ours
    ok = ratio <= 1.5 and speedup >= 100
    lines = [
        f"== {name}: {table.n:,} call sites ({n:,} keys that exist)",
        f"  rngaudit fast path (replay + keys): {t_ours:8.3f} s  ({n / t_ours:,.0f} keys/s)",
        f"  bare SHA-1 loop (floor)           : {t_sha:8.3f} s",
        f"  naive eager jax.fold_in replay    : {t_jax:8.3f} s  (from {len(sample):,} keys)",
    ]
    if t_plain is not None:
        lines.append(f"  plain path (reference)            : {t_plain:8.3f} s  ({t_plain / t_ours:.1f}x the fast path)")
    lines += [
        f"  ratio rngaudit / SHA-1 floor : {ratio:6.2f}x  (target <= 1.5x)",
        f"  speed-up vs naive fold_in    : {speedup:6.1f}x  (target >= 100x)  {'ok' if ok else 'MISSED'}",
    ]
    return lines if ok else lines + ["MISSED"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=1_000_000)
    ap.add_argument("--jax-sample", type=int, default=3000)
    ap.add_argument(
        "--plain", action=argparse.BooleanOptionalAction, default=True, help="also time the plain (reference) path"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; jax {jax.__version__}")
    missed = False
    for name, text in shapes(args.sites).items():
        lines = bench(name, text, args, jax, jnp)
        missed |= lines[-1] == "MISSED"
        print("\n".join(line for line in lines if line != "MISSED"), flush=True)
    if args.check and missed:
        sys.exit(1)


if __name__ == "__main__":
    main()
