"""Time `rngaudit derive` of a Linen model whose layers are NNX blocks under `bridge.ToLinen` (issue 15) against
the model's own `init` in real Flax.

The model: `nn.scan` over LAYERS steps of a Linen module calling `bridge.ToLinen(Block)`, Block an NNX
Transformer block (LayerNorm, MultiHeadAttention with attention dropout, an MLP with Dropout), params and dropout
split per step; phase init with {params, dropout}. Both sides run in a fresh process, as a user runs them: the
baseline imports JAX and Flax, builds the model and runs `init` (tracing the scan, the NNX module built per step);
the command is `rngaudit derive SPEC -f jsonl -o FILE` end to end (its start, the replay of the Linen keys, each
step's NNX module built from its make_rng keys, every key computed and written). Reported: the median of `--runs`
of each and the ratio.

    python3 benchmarks/bench_to_linen.py [--layers 48] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap

from bench_capture import timed  # (benchmarks/ is on sys.path when a benchmark runs as a script)
from bench_nnx_capture import MODELS

# the NNX Transformer block of bench_nnx_capture's GPT (Block(d, rngs)), as its source
NNX_BLOCK = MODELS[MODELS.index("class Block") : MODELS.index("class GPT")]

BLOCK = """
  class: Block
  init:
    - LayerNorm: {name: norm1}
    - MultiHeadAttention: {name: attn, dropout_rate: 0.1}
    - LayerNorm: {name: norm2}
    - Linear: {name: up}
    - Linear: {name: down}
    - Dropout: {name: drop, rate: 0.1}
  call: [{call: norm1}, {call: attn}, {call: norm2}, {call: up}, {call: down}, {call: drop}]
"""

SPEC = """
rngaudit: 1
rngs: {params: 0, dropout: 1}
model:
  class: Model
  body:
    - scan:
        length: LAYERS
        variable_axes: {params: 0}
        split_rngs: {params: true, dropout: true}
        module:
          class: Layer
          body:
            - ToLinen:
                module:
BLOCK
"""

INIT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    from flax.nnx import bridge

    {block}
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return bridge.ToLinen(Block, args=(16,))(x), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Layer, variable_axes={{'params': 0}}, split_rngs={{'params': True, 'dropout': True}},
                           length={layers})
            return scan()(x, None)[0]

    v = Model().init({{'params': jax.random.key(0), 'dropout': jax.random.key(1)}}, jnp.ones((2, 8, 16)))
    jax.block_until_ready(v)
""")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        spec = os.path.join(folder, "spec.yaml")
        block = textwrap.indent(textwrap.dedent(BLOCK).strip(), " " * 18)
        with open(spec, "w") as f:
            f.write(SPEC.replace("LAYERS", str(a.layers)).replace("BLOCK", block))
        out = os.path.join(folder, "keys.jsonl")
        init = [
            timed([sys.executable, "-c", INIT.format(layers=a.layers, block=NNX_BLOCK)], folder) for _ in range(a.runs)
        ]
        derive = [
            timed([sys.executable, "-m", "rngaudit", "derive", spec, "-f", "jsonl", "-o", out], folder)
            for _ in range(a.runs)
        ]
        with open(out) as f:
            records = [line for line in f if '"record":"to_linen"' in line]
        i, d = statistics.median(init), statistics.median(derive)
        print(f"{'model':<52} {'init':>8} {'derive':>8} {'ratio':>7} {'ToLinen calls':>14}")
        print(
            f"{f'nn.scan over {a.layers} ToLinen(NNX Transformer block)':<52} {i:7.2f}s {d:7.2f}s {d / i:6.2f}x "
            f"{len(records):>14}"
        )


if __name__ == "__main__":
    main()
