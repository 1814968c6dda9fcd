"""Time `rngaudit capture` on large Linen models against the model's own `init` (issue 16).

Models (written to a temporary file): a Transformer encoder of LAYERS pre-LN blocks with attention dropout
and dropout, stacked with `nn.scan(nn.remat(Block))` (the scan-over-layers stack of large models), and a
plain Python loop of BLOCKS small blocks (every key its own call site).

Both sides run in a fresh process, as a user runs them: the baseline imports JAX and Flax, builds the model
and runs its `init` (the first call: tracing and compiling included); the command is `rngaudit capture`
end to end (its start, the same imports and model, the instrumented init, the spec written and its replay
checked against every key, the keys file written). Reported: the median of `--runs` of each and the ratio.

    python3 benchmarks/bench_capture.py [--layers 1000] [--blocks 3000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

MODELS = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp

    class EncoderBlock(nn.Module):
        @nn.compact
        def __call__(self, x, _=None):
            y = nn.LayerNorm()(x)
            y = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, deterministic=False)(y, y)
            x = x + nn.Dropout(0.1, deterministic=False)(y)
            y = nn.Dense(16)(nn.LayerNorm()(x))
            return x + nn.Dropout(0.1, deterministic=False)(nn.Dense(8)(nn.gelu(y))), None

    class ScanRematEncoder(nn.Module):
        layers: int

        @nn.compact
        def __call__(self, x):
            Stack = nn.scan(nn.remat(EncoderBlock), length=self.layers, variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True})
            return Stack(name="layers")(x)[0]

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.LayerNorm()(nn.Dense(8)(x))

    class Loop(nn.Module):
        blocks: int

        @nn.compact
        def __call__(self, x):
            for _ in range(self.blocks):
                x = Block()(x)
            return x

    def encoder():
        return ScanRematEncoder(LAYERS), (jnp.ones((2, 4, 8)),)

    def loop():
        return Loop(BLOCKS), (jnp.ones((1, 8)),)
""")

INIT = """
import sys, jax
sys.path.insert(0, {folder!r})
import models
module, args = models.{factory}()
variables = module.init({{"params": jax.random.key(0), "dropout": jax.random.key(1)}}, *args)
jax.block_until_ready(variables)
"""


def timed(command: list[str], cwd: str) -> float:
    start = time.perf_counter()
    r = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {r.returncode}: {r.stderr.strip()}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "models.py"), "w") as f:
            f.write(MODELS.replace("LAYERS", str(a.layers)).replace("BLOCKS", str(a.blocks)))
        print(f"{'model':<44} {'init':>8} {'capture':>9} {'ratio':>7} {'keys':>7} {'spec':>8}")
        for factory, what in (
            ("encoder", f"scan(remat(EncoderBlock)) x {a.layers}"),
            ("loop", f"Python loop of {a.blocks} blocks"),
        ):
            init = [
                timed([sys.executable, "-c", INIT.format(folder=folder, factory=factory)], folder)
                for _ in range(a.runs)
            ]
            spec, keys = os.path.join(folder, "spec.yaml"), os.path.join(folder, "keys.json")
            command = [sys.executable, "-m", "rngaudit", "capture", f"models.py:{factory}", "--rngs",
                       "params=0,dropout=1", "-o", spec, "--keys", keys]  # fmt: skip
            cap = [timed(command, folder) for _ in range(a.runs)]
            with open(keys) as f:
                n_keys = f.read().count('"stream":')
            ti, tc = statistics.median(init), statistics.median(cap)
            print(f"{what:<44} {ti:>7.2f}s {tc:>8.2f}s {tc / ti:>6.2f}x {n_keys:>7} {os.path.getsize(spec):>7}B")


if __name__ == "__main__":
    main()
