"""Time `derive` of an NNX spec end to end, against baselines run in the same process.

For each model shape (1,000,000 draws by default):
  rngaudit  `rngaudit derive SPEC --format jsonl` as a user runs it (in this process: parse, replay, keys and
            the report written to a file);
  floor     the SHA-1-free floor: fold_in(stream key, count) for the same (key, count) rows with the project's
            own vectorised Threefry (KeyEngine.fold_in_rows), nothing else;
  naive     one eager `jax.random.fold_in(key, count)` per draw in a Python loop (timed on a sample, scaled up).
Prints the times and the ratios side by side. The shapes: steps of many draws, many forked blocks, and a
scan-over-layers stack (lanes: every member's draws listed member by member).

    python3 benchmarks/bench_nnx_derive.py [--draws 1000000] [--jax-sample 3000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def shapes(draws: int) -> dict[str, str]:
    steps = 1000
    per_step = max(draws // steps // 2, 1)
    layers = 200
    per_layer = max(draws // layers // 4, 1)
    stack, per_lane = 100, 100
    return {
        f"{steps} steps x {2 * per_step} dropout draws": f"""
rngaudit: 1
flavour: nnx
rngs: {{params: 0, dropout: 1}}
steps: {steps}
model:
  class: M
  keep_rngs: true
  init: [{{Linear: {{name: l}}}}, {{Dropout: {{name: d, rate: 0.5}}}}]
  call:
    - {{call: {{name: d, repeat: {per_step}}}}}
    - {{draw: {{stream: dropout, repeat: {per_step}}}}}
""",
        f"{layers} forked blocks, 4 steps": """
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
steps: 4
model:
  class: M
  init:
"""
        + "".join(
            f"""    - module:
        name: b{i}
        class: Block
        rngs: fork
        init: [{{Linear: {{name: l}}}}, {{Dropout: {{name: d, rate: 0.1}}}}]
        call: [{{call: {{name: d, repeat: {per_layer}}}}}]
"""
            for i in range(layers)
        )
        + "  call:\n"
        + "".join(f"    - call: b{i}\n" for i in range(layers)),
        # lanes: a scan-over-layers stack (split_rngs around vmap), each layer's Dropout called per step
        f"stack of {stack} layers under nnx.scan, {max(draws // stack // per_lane, 1)} steps": f"""
rngaudit: 1
flavour: nnx
rngs: {{params: 0, dropout: 1}}
steps: {max(draws // stack // per_lane, 1)}
model:
  class: M
  init:
    - module:
        name: layers
        class: Layer
        stack: {stack}
        init: [{{Linear: {{name: l}}}}, {{Dropout: {{name: d, rate: 0.1}}}}]
        call: [{{call: {{name: d, repeat: {per_lane}}}}}]
  call:
    - {{call: {{name: layers, scan: true}}}}
""",
    }


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=1_000_000)
    ap.add_argument("--jax-sample", type=int, default=3000)
    a = ap.parse_args()

    import numpy as np

    from rngaudit import parse_spec
    from rngaudit.cli.root import app
    from rngaudit.engine.keys import KeyEngine
    from rngaudit.engine.nnx import replay_nnx

    print(f"{'model':40} {'draws':>9} {'rngaudit':>9} {'floor':>8} {'naive':>9} {'/floor':>7} {'naive/':>7}")
    for name, text in shapes(a.draws).items():
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "spec.yaml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            out = os.path.join(d, "keys.jsonl")

            def run(path=path, out=out):
                try:
                    app(["derive", path, "--format", "jsonl", "--output", out], standalone_mode=False)
                except SystemExit:
                    pass

            t_ours, _ = timed(run)
            spec = parse_spec(text)
            engine = KeyEngine(spec.prng_impl, spec.threefry_partitionable)
            table = replay_nnx(spec, engine)  # (the rows the floor computes; not timed)
            n = len(table.block)
            base_rows = np.asarray([table.keys[0]] * n, dtype=np.uint32)
            t_floor, _ = timed(lambda e=engine, b=base_rows, c=table.count: e.fold_in_rows(b, c))

            import jax

            k = jax.random.key(1)
            sample = min(a.jax_sample, n)
            counts = table.count[:sample].tolist()

            def naive(counts=counts, k=k):
                for c in counts:
                    jax.random.key_data(jax.random.fold_in(k, c)).block_until_ready()

            naive()  # (compile once)
            t_sample, _ = timed(naive)
            t_naive = t_sample * n / max(sample, 1)
        print(
            f"{name:40} {n:>9} {t_ours:>8.2f}s {t_floor:>7.2f}s {t_naive:>8.1f}s "
            f"{t_ours / t_floor:>6.1f}x {t_naive / t_ours:>6.0f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
