"""Time `rngaudit capture --step` of NNX training steps against the same steps run as written (issue 15).

Models (written to a temporary file), each with a training step as the Flax NNX docs write one (`@nnx.jit` when
its module is imported, `nnx.value_and_grad`, an `nnx.Optimizer` of optax.adamw):
- a GPT-style Transformer of LAYERS blocks (attention dropout and dropout), its layers built by
  `nnx.split_rngs` around `nnx.vmap` and run by `nnx.scan` over `nnx.remat`;
- a Python loop of BLOCKS small blocks under `nnx.remat` each (every block its own call sites).

Both sides run in a fresh process, as a user runs them: the baseline imports JAX and Flax, builds the model and
the optimizer and runs STEPS training steps compiled (tracing and compiling included); the command is
`rngaudit capture --step` end to end (its start, the same imports and model, the steps run as plain Python while
capture watches, the spec written and its replay checked against every key, the keys file written). Reported:
the median of `--runs` of each and the ratio.

    python3 benchmarks/bench_nnx_capture.py [--layers 24] [--blocks 200] [--steps 3] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap

from bench_capture import timed  # (benchmarks/ is on sys.path when a benchmark runs as a script)

MODELS = textwrap.dedent("""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.norm1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, dropout_rate=0.1, decode=False,
                                               deterministic=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.drop(self.down(nnx.gelu(self.up(self.norm2(x)))))

    class GPT(nnx.Module):
        def __init__(self, vocab, d, layers, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r):
                return Block(d, r)

            self.blocks = make(rngs)
            self.head = nnx.Linear(d, vocab, rngs=rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def body(h, block):
                return block(h)

            return self.head(body(self.embed(tokens), self.blocks))

    class Small(nnx.Module):
        def __init__(self, d, rngs):
            self.lin = nnx.Linear(d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return x + self.drop(self.lin(x))

    class Loop(nnx.Module):
        def __init__(self, blocks, rngs):
            self.embed = nnx.Embed(16, 8, rngs=rngs)
            self.blocks = nnx.List([Small(8, rngs) for _ in range(blocks)])
            self.head = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = nnx.remat(lambda b, y: b(y))(block, x)
            return self.head(x)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def _with_optimizer(model):
        return model, (nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param), jnp.ones((2, 8), jnp.int32))

    def gpt(rngs):
        return _with_optimizer(GPT(16, 16, LAYERS, rngs))

    def loop(rngs):
        return _with_optimizer(Loop(BLOCKS, rngs))
""")

STEPS = """
import sys, jax
from flax import nnx
sys.path.insert(0, {folder!r})
import models
model, args = models.{factory}(nnx.Rngs(params=0, dropout=1))
for _ in range({steps}):
    loss = models.train_step(model, *args)
jax.block_until_ready(loss)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "models.py"), "w") as f:
            f.write(MODELS.replace("LAYERS", str(a.layers)).replace("BLOCKS", str(a.blocks)))
        print(f"{'model':<52} {'steps':>8} {'capture':>9} {'ratio':>7} {'keys':>7}")
        for factory, what in (
            ("gpt", f"GPT, scan(remat(Block)) x {a.layers}, value_and_grad"),
            ("loop", f"loop of {a.blocks} remat blocks, value_and_grad"),
        ):
            script = STEPS.format(folder=folder, factory=factory, steps=a.steps)
            base = [timed([sys.executable, "-c", script], folder) for _ in range(a.runs)]
            spec, keys = os.path.join(folder, "spec.yaml"), os.path.join(folder, "keys.json")
            command = [sys.executable, "-m", "rngaudit", "capture", f"models.py:{factory}", "--step",
                       "models.py:train_step", "--steps", str(a.steps), "--rngs", "params=0,dropout=1", "-o", spec,
                       "--keys", keys]  # fmt: skip
            cap = [timed(command, folder) for _ in range(a.runs)]
            with open(keys) as f:
                n_keys = f.read().count('"stream":')
            tb, tc = statistics.median(base), statistics.median(cap)
            print(f"{what:<52} {tb:>7.2f}s {tc:>8.2f}s {tc / tb:>6.2f}x {n_keys:>7}")


if __name__ == "__main__":
    main()
