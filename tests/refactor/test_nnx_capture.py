"""`rngaudit capture`, `verify` and `diff` of Flax NNX models: models written the way NNX projects write them,
built and called in real NNX under capture; the captured spec must replay every key NNX handed out (capture
checks it, and the tests check it again by building the captured spec in NNX with the oracle)."""

from __future__ import annotations

import json
import pathlib
import re
import sys
import textwrap

import pytest
import yaml
from nnx_oracle import check_against_nnx
from support import invoke, write

from rngaudit import load_spec

HEADER = "import jax\nimport jax.numpy as jnp\nfrom flax import nnx\n"

MLP = HEADER + textwrap.dedent("""
    class MLP(nnx.Module):
        def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
            self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
            self.dropout = nnx.Dropout(0.2, rngs=rngs)
            self.bn = nnx.BatchNorm(dhidden, rngs=rngs)
            self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

        def __call__(self, x):
            x = nnx.gelu(self.dropout(self.bn(self.linear1(x))))
            return self.linear2(x)

    def make_model(rngs):
        return MLP(4, 8, 2, rngs=rngs), (jnp.ones((3, 4)),)
""")

ENCODER = HEADER + textwrap.dedent("""
    class FeedForward(nnx.Module):
        def __init__(self, d, hidden, rate, rngs):
            self.up = nnx.Linear(d, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, d, rngs=rngs)
            self.drop = nnx.Dropout(rate, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.down(nnx.relu(self.up(x))))

    class Block(nnx.Module):
        def __init__(self, d, heads, rate, *, rngs):
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=heads, in_features=d, dropout_rate=rate, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.ff = FeedForward(d, 4 * d, rate, rngs.fork())
            self.drop = nnx.Dropout(rate, rngs=rngs)

        def __call__(self, x):
            x = x + self.drop(self.attn(self.ln1(x), deterministic=False))
            return x + self.ff(self.ln2(x))

    class Encoder(nnx.Module):
        def __init__(self, vocab, d, heads, layers, rate, *, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, heads, rate, rngs=rngs) for _ in range(layers)])
            self.norm = nnx.RMSNorm(d, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    def make_model(rngs):
        return Encoder(100, 16, 2, 3, 0.1, rngs=rngs), (jnp.ones((2, 5), jnp.int32),)
""")

RNN = HEADER + textwrap.dedent("""
    class RNNCell(nnx.Module):
        def __init__(self, din, dout, rngs):
            self.linear = nnx.Linear(dout + din, dout, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs, rng_collection='recurrent_dropout')
            self.dout = dout

        def __call__(self, h, x):
            h = self.drop(h)
            y = nnx.relu(self.linear(jnp.concatenate([h, x], axis=-1)))
            return y, y

    class RNN(nnx.Module):
        def __init__(self, din, dout, *, rngs):
            self.cell = RNNCell(din, dout, rngs)
            self.head = nnx.Linear(dout, 1, rngs=rngs)
            self.rngs = rngs

        def __call__(self, xs):
            h = jnp.zeros((xs.shape[0], self.cell.dout))
            for t in range(xs.shape[1]):
                h, _ = self.cell(h, xs[:, t])
            h = h + 0.01 * jax.random.normal(self.rngs.noise(), h.shape)
            return self.head(h)

    def make_model(rngs):
        return RNN(3, 8, rngs=rngs), (jnp.ones((2, 4, 3)),)
""")

ENSEMBLE = HEADER + textwrap.dedent("""
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.linear(x))

    class Ensemble(nnx.Module):
        def __init__(self, n, rngs):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(r):
                return MLP(r)
            self.members = create(rngs)

        def __call__(self, x):
            return nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(self.members, x)

    def make_model(rngs):
        return Ensemble(3, rngs), (jnp.ones((1, 4)),)
""")


SCAN_STACK = HEADER + textwrap.dedent("""
    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=2, in_features=d, dropout_rate=0.1, decode=False, deterministic=False, rngs=rngs)
            self.mlp = nnx.Linear(d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm(x))
            return x + self.drop(self.mlp(x))

    class Transformer(nnx.Module):
        def __init__(self, d, layers, *, rngs):
            self.embed = nnx.Linear(3, d, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r):
                return Block(d, r)

            self.blocks = make(rngs)
            self.head = nnx.Linear(d, 2, rngs=rngs)

        def __call__(self, x):
            x = self.embed(x)

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(h, block):
                return block(h)

            return self.head(body(x, self.blocks))

    def make_model(rngs):
        return Transformer(8, 4, rngs=rngs), (jnp.ones((2, 5, 3)),)
""")

RNN_SCAN = HEADER + textwrap.dedent("""
    class RNNCell(nnx.Module):  # the NNX guide's recurrent dropout
        def __init__(self, din, dout, rngs):
            self.linear = nnx.Linear(dout + din, dout, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs, rng_collection='recurrent_dropout')
            self.dout = dout

        def __call__(self, h, x):
            h = self.drop(h)
            y = nnx.relu(self.linear(jnp.concatenate([h, x], axis=-1)))
            return y, y

    class RNN(nnx.Module):
        def __init__(self, din, dout, *, rngs):
            self.cell = RNNCell(din, dout, rngs)

        def __call__(self, x):
            h = jnp.zeros((x.shape[0], self.cell.dout))
            state_axes = nnx.StateAxes({'recurrent_dropout': None, ...: nnx.Carry})

            @nnx.scan(in_axes=(state_axes, nnx.Carry, 1), out_axes=(nnx.Carry, 1))
            def unroll(cell, h, x):
                h, y = cell(h, x)
                return h, y

            h, y = unroll(self.cell, h, x)
            return y

    def make_model(rngs):
        return RNN(8, 16, rngs=rngs), (jnp.ones((4, 20, 8)),)
""")

DATA_PARALLEL = HEADER + textwrap.dedent("""
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(20, 10, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.linear(x))

    class DataParallel(nnx.Module):  # the NNX guide's data-parallel dropout (vmap for pmap)
        def __init__(self, rngs):
            self.model = Model(rngs)

        def __call__(self, x):
            state_axes = nnx.StateAxes({'dropout': 0, ...: None})

            @nnx.split_rngs(splits=4, only='dropout')
            @nnx.vmap(in_axes=(state_axes, 0), out_axes=0)
            def forward(model, x):
                return model(x)

            return forward(self.model, x)

    def make_model(rngs):
        return DataParallel(rngs), (jnp.ones((4, 16, 20)),)
""")

BRIDGE = HEADER + textwrap.dedent("""
    import flax.linen as nn
    from flax.nnx import bridge

    class LinenBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(4, 4, rngs=rngs)
            self.block = bridge.ToNNX(LinenBlock(), rngs=rngs)
            bridge.lazy_init(self.block, jnp.ones((1, 4)))
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.block(self.embed(x)))

    def make_model(rngs):
        return Model(rngs), (jnp.ones((1, 4)),)
""")

# a Linen scan-over-layers stack (nn.scan(nn.remat(Block)) with dropout, as large Linen Transformers write it)
# reused inside an NNX model through bridge.ToNNX
BRIDGE_STACK = HEADER + textwrap.dedent("""
    import flax.linen as nn
    from flax.nnx import bridge

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y = nn.Dense(8)(nn.LayerNorm()(x))
            return x + nn.Dropout(0.1, deterministic=False)(y), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                           length=4)
            return scan(name="layers")(x, None)[0]

    class Model(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.embed = nnx.Embed(16, 8, rngs=rngs)
            self.stack = bridge.ToNNX(Stack(), rngs=rngs)
            bridge.lazy_init(self.stack, jnp.ones((1, 8)))
            self.head = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, tokens):
            return self.head(self.stack(self.embed(tokens)))

    def make_model(rngs):
        return Model(rngs=rngs), (jnp.ones((1,), jnp.int32),)
""")

# the bridge guide's shape: bridge.lazy_init on the whole model in the factory, a parameter drawn directly
BRIDGE_GUIDE = HEADER + textwrap.dedent("""
    import flax.linen as nn
    from flax.nnx import bridge

    class LinenDot(nn.Module):
        out_dim: int
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], self.out_dim))
            return nn.Dropout(0.5, deterministic=False)(x @ w)

    class NNXOuter(nnx.Module):
        def __init__(self, out_dim, rngs):
            self.dot = bridge.ToNNX(LinenDot(out_dim), rngs=rngs)
            self.b = nnx.Param(jax.random.uniform(rngs.params(), (1, out_dim)))
            self.drop = nnx.Dropout(0.2, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dot(x) + self.b)

    def make_model(rngs):
        x = jnp.ones((4, 3))
        return bridge.lazy_init(NNXOuter(4, rngs), x), (x,)
""")


RESNET = HEADER + textwrap.dedent("""
    class ResBlock(nnx.Module):
        def __init__(self, c, rngs):
            self.conv1 = nnx.Conv(c, c, kernel_size=(3, 3), rngs=rngs)
            self.bn1 = nnx.BatchNorm(c, rngs=rngs)
            self.conv2 = nnx.Conv(c, c, kernel_size=(3, 3), rngs=rngs)
            self.bn2 = nnx.BatchNorm(c, rngs=rngs)

        def __call__(self, x):
            y = nnx.relu(self.bn1(self.conv1(x)))
            return nnx.relu(x + self.bn2(self.conv2(y)))

    class ResNet(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
            self.blocks = nnx.Sequential(*[ResBlock(8, rngs) for _ in range(2)])
            self.head = nnx.Sequential(
                nnx.Linear(8, 16, rngs=rngs), nnx.relu, nnx.Dropout(0.3, rngs=rngs), nnx.Linear(16, 10, rngs=rngs))

        def __call__(self, x):
            x = self.blocks(self.stem(x))
            return self.head(x.mean(axis=(1, 2)))

    def make_model(rngs):
        return ResNet(rngs), (jnp.ones((2, 8, 8, 3)),)
""")

LSTM = HEADER + textwrap.dedent("""
    class Tagger(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(50, 8, rngs=rngs)
            self.cell = nnx.LSTMCell(8, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.out = nnx.Linear(16, 5, rngs=rngs)
            self.rngs = rngs

        def __call__(self, tokens):
            x = self.embed(tokens)
            carry = self.cell.initialize_carry((tokens.shape[0], 8), self.rngs)
            for t in range(tokens.shape[1]):
                carry, y = self.cell(carry, x[:, t])
            return self.out(self.drop(y))

    def make_model(rngs):
        return Tagger(rngs), (jnp.ones((2, 6), jnp.int32),)
""")

# LoRA fine-tuning as NNX code writes it: nnx.LoRALinear projections, nnx.LoRA wrapping a layer built for it
# (base_module), a plain adapter, and dropout
LORA = HEADER + textwrap.dedent("""
    class Attention(nnx.Module):
        def __init__(self, d, rank, *, rngs):
            self.q = nnx.LoRALinear(d, d, lora_rank=rank, use_bias=False, rngs=rngs)
            self.k = nnx.LoRALinear(d, d, lora_rank=rank, use_bias=False, rngs=rngs)
            self.v = nnx.LoRALinear(d, d, lora_rank=rank, rngs=rngs)
            self.out = nnx.LoRA(d, rank, d, base_module=nnx.LinearGeneral(d, d, rngs=rngs), rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            w = jax.nn.softmax(self.q(x) @ self.k(x).T)
            return self.out(self.drop(w) @ self.v(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 8, rngs=rngs)
            self.blocks = nnx.List([Attention(8, 2, rngs=rngs) for _ in range(2)])
            self.adapter = nnx.LoRA(8, 2, 8, rngs=rngs)
            self.norm = nnx.RMSNorm(8, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = x + block(x)
            return self.norm(x + self.adapter(x))

    def make_model(rngs):
        return Model(rngs), (jnp.arange(4),)
""")


def capture(tmp_path, target: str, *args: str):
    spec, keys = tmp_path / "captured.yaml", tmp_path / "keys.json"
    r = invoke("capture", target, "-o", spec, "--keys", keys, *args)
    assert r.exit_code == 0, r.stderr
    return spec, json.loads(keys.read_text())


def assert_real_nnx_agrees(spec_path, doc) -> None:
    """The captured spec built in real NNX by the oracle hands out exactly the keys in the keys file."""
    spec = load_spec(str(spec_path))
    result = check_against_nnx(spec)
    derived = json.loads(invoke("derive", spec_path, "-f", "json").stdout)["calls"]
    assert [c["key"] for c in derived] == [c["key"] for c in doc["calls"]]
    # (a stream nnx.vmap broadcasts hands every lane its key once: NNX's RngStream sees lane 0's)
    once = [c for c in derived if not ("vmap" in (c["broadcast"] or "") and c["lane"])]
    assert result["keys"] + result.get("linen", 0) == len(once)


@pytest.mark.parametrize(
    "source, rngs, steps, draws",
    [
        (MLP, "params=0,dropout=1", 3, 2 + 1 + 2 + 2 + 3),  # linear1, dropout fork, bn, linear2; 3 masks
        (ENCODER, "params=0,dropout=1", 2, None),
        (RNN, "params=0,recurrent_dropout=1,noise=2", 2, 2 + 1 + 2 + 2 * (4 + 1)),
        (ENSEMBLE, "params=0,dropout=1", 2, 2 + 3 * 3 + 2 * 3),  # the split draws, 3 members, 3 masks a call
        (SCAN_STACK, "params=0,dropout=1", 2, None),
        (RNN_SCAN, "params=0,recurrent_dropout=1", 2, 2 + 1 + 2 * 20),
        (DATA_PARALLEL, "params=0,dropout=1", 2, 2 + 1 + 2 * (1 + 4)),
        (RESNET, "params=0,dropout=1", 2, None),  # nnx.Sequential: named and called through it
        (LSTM, "params=0,dropout=1,carry=2", 2, None),  # nnx.LSTMCell; initialize_carry draws from kept rngs
        # bridge.ToNNX: the fork (2), lazy_init's draws (2) and Linen's keys (3), then per call 2 + 1 (+ the NNX
        # Dropout's key)
        (BRIDGE, "params=0,dropout=1", 2, 2 + 2 + 2 + 3 + 1 + 2 * (2 + 1 + 1)),
        (BRIDGE_STACK, "params=0,dropout=1", 2, None),
        (BRIDGE_GUIDE, "default=0", 3, None),
        # embed 1, per block q 3, k 3, v 4, out 4 (its LinearGeneral first) and the dropout fork; adapter 2,
        # norm 1; a mask per block and call
        (LORA, "params=0,dropout=1", 2, 1 + 2 * (3 + 3 + 4 + 4 + 1) + 2 + 1 + 2 * 2),
    ],
)
def test_nnx_models_capture_and_replay(tmp_path, source, rngs, steps, draws):
    f = write(tmp_path, "model.py", source)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", rngs, "--steps", str(steps))
    assert doc["flavour"] == "nnx" and doc["format"] == "rngaudit.capture"
    assert {c["step"] for c in doc["calls"]} == set(range(steps + 1))
    if draws is not None:
        assert len(doc["calls"]) == draws
    assert all(c["stream_path"] and c["chain"] for c in doc["calls"])
    text = spec.read_text()
    assert "flavour: nnx" in text and (f"steps: {steps}" in text or f"- lazy_init\n- call: {steps}" in text)
    assert_real_nnx_agrees(spec, doc)
    # the spec verifies against the live model and against the keys file (and the keys file as SPEC)
    for what, against in (
        (spec, f"{f}:make_model"),
        (spec, tmp_path / "keys.json"),
        (tmp_path / "keys.json", tmp_path / "keys.json"),
    ):
        r = invoke("verify", what, "--against", against)
        assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "source, pieces",
    [
        (ENSEMBLE, ("stack: 3", "vmap: true")),
        (SCAN_STACK, ("stack: 4", "scan: true", "dropout_rate: 0.1")),
        (RNN_SCAN, ("scan: 20", "- recurrent_dropout")),
        (DATA_PARALLEL, ("vmap: 4", "split:\n      - dropout")),
        (RESNET, ("name: blocks.layers.1", "name: head.layers.2", "call: head.layers.2")),
    ],
)
def test_transforms_are_read_as_the_spec_writes_them(tmp_path, source, pieces):
    f = write(tmp_path, "model.py", source)
    spec, _ = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1,recurrent_dropout=2")
    text = spec.read_text()
    assert all(p in text for p in pieces), text


BROADCAST = HEADER + textwrap.dedent("""
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(20, 10, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.linear(x))

    class Wrap(nnx.Module):
        def __init__(self, rngs):
            self.model = Model(rngs)

        def __call__(self, x):
            return nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(self.model, x)

    def make_model(rngs):
        return Wrap(rngs), (jnp.ones((4, 16, 20)),)
""")


def test_a_captured_broadcast_vmap_is_a_collision(tmp_path):
    """A model mapped by nnx.vmap with its state broadcast: captured, then `collisions` on the captured spec
    finds every lane drawing one dropout mask."""
    f = write(tmp_path, "m.py", BROADCAST)
    spec, _ = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1")
    r = invoke("collisions", spec)
    assert r.exit_code == 1 and "broadcast_lanes" in r.stdout and "model.drop [lane 3]" in r.stdout


def test_the_encoders_spec_says_what_the_model_does(tmp_path):
    f = write(tmp_path, "encoder.py", ENCODER)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1")
    text = spec.read_text()
    for piece in ("name: blocks.2", "rngs: fork", "MultiHeadAttention", "dropout_rate: 0.1", "RMSNorm"):
        assert piece in text
    forks = [c for c in doc["calls"] if c["kind"] == "fork" and c["path_str"] == "blocks/1/ff"]
    assert [c["stream"] for c in forks] == ["params", "dropout"]


def test_a_stream_the_model_needs_but_rngs_lacks(tmp_path):
    f = write(tmp_path, "mlp.py", MLP)
    r = invoke("capture", f"{f}:make_model")
    assert r.exit_code == 2 and "KeyError" in r.stderr and "dropout" in r.stderr and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "body, args, message",
    [
        (
            BRIDGE.replace("LinenBlock(), rngs=rngs)", "LinenBlock(), rngs=rngs.params())"),
            ("--rngs", "params=0,dropout=1"),
            "is given a key or another Rngs",
        ),
        (
            BRIDGE.replace("return self.drop(self.block(self.embed(x)))", "return self.block(x, rngs=nnx.Rngs(3))"),
            ("--rngs", "params=0,dropout=1"),
            "draws differently from one call to the next",
        ),
        (HEADER + "def make_model(rngs):\n    return 3\n", (), "not an nnx.Module"),
        (HEADER + "def make_model(rngs):\n    raise RuntimeError('no')\n", (), "RuntimeError: no"),
        (MLP, ("--rngs", "params=0,dropout=1", "--phase", "apply"), "--phase and --method are Linen's"),
        (
            HEADER + "M = nnx.Linear(2, 3, rngs=nnx.Rngs(0))\ndef make_model(rngs):\n    return M\n",
            (),
            "was not built by the factory",
        ),
        (
            HEADER
            + "class M(nnx.Module):\n    def __init__(self, rngs):\n        self.l = nnx.Linear(2, 3, rngs=nnx.Rngs(5))\n"
            + "    def __call__(self, x):\n        return x\n"
            + "def make_model(rngs):\n    return M(rngs), (jnp.ones(2),)\n",
            (),
            "another Rngs",
        ),
    ],
)
def test_what_capture_cannot_read_is_an_error_and_nothing_is_written(tmp_path, body, args, message):
    f = write(tmp_path, "m.py", body)
    spec, keys = tmp_path / "out.yaml", tmp_path / "keys.json"
    r = invoke("capture", f"{f}:make_model", "-o", spec, "--keys", keys, *args)
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not spec.exists() and not keys.exists()


def test_diff_explains_a_layer_inserted_and_a_rename(tmp_path):
    old = write(tmp_path, "old.py", ENCODER)
    new = write(
        tmp_path,
        "new.py",
        ENCODER.replace(
            "self.ln2 = nnx.LayerNorm(d, rngs=rngs)",
            "self.ln2 = nnx.LayerNorm(d, rngs=rngs)\n        self.gate = nnx.Linear(d, d, rngs=rngs)",
        )
        .replace("self.norm = nnx.RMSNorm", "self.final_norm = nnx.RMSNorm")
        .replace("return self.norm(x)", "return self.final_norm(x)"),
    )
    keys = {}
    for name, path in (("old", old), ("new", new)):
        keys[name] = tmp_path / f"{name}.json"
        r = invoke("capture", f"{path}:make_model", "--rngs", "params=0,dropout=1", "-f", "json", "-o", keys[name])
        assert r.exit_code == 0, r.stderr
    r = invoke("diff", keys["old"], keys["new"])
    assert r.exit_code == 1
    assert "count shift: blocks.0.ff drew 'params' count 13 before and 15 now" in r.stdout
    assert "added before it: blocks.0.gate.kernel, blocks.0.gate.bias" in r.stdout
    # the fork of blocks.0.ff moved, so every key below it changed: said with the two chains
    assert "fold_in 13 (rngs.fork() for blocks.0.ff)  became  key 0 -> fold_in 15" in r.stdout
    doc = json.loads(invoke("diff", keys["old"], keys["new"], "-f", "json").stdout)
    assert doc["summary"]["changed"] > 0
    # a rename alone keeps every key: the draw is the same, under another name
    renamed = write(tmp_path, "renamed.py", ENCODER.replace("self.norm", "self.final_norm"))
    rk = tmp_path / "renamed.json"
    assert (
        invoke("capture", f"{renamed}:make_model", "--rngs", "params=0,dropout=1", "-f", "json", "-o", rk).exit_code
        == 0
    )
    r = invoke("diff", keys["old"], rk)
    assert "NNX keys do not depend on names" in r.stdout and "CHANGED" not in r.stdout


def test_verify_finds_a_spec_that_no_longer_matches_the_model(tmp_path):
    f = write(tmp_path, "encoder.py", ENCODER)
    spec, _ = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1")
    # (the spec written before the first block's attention got its dropout: one dropout fork fewer)
    text = spec.read_text()
    assert "dropout_rate: 0.1" in text
    stale = write(tmp_path, "stale.yaml", text.replace("dropout_rate: 0.1", "dropout_rate: 0.0", 1))
    r = invoke("verify", stale, "--against", f"{f}:make_model")
    assert r.exit_code == 1 and "DIFFERS" in r.stdout


def test_the_python_api_captures_nnx_models(tmp_path):
    import rngaudit

    f = write(tmp_path, "mlp.py", MLP)
    report = rngaudit.capture(f"{f}:make_model", rngs="params=0,dropout=1", steps=2)
    assert report.capture.flavour == "nnx" and "flavour: nnx" in report.spec
    assert [s.step for s in report.capture.sites].count(2) == 1
    with pytest.raises(rngaudit.UsageError, match="--steps applies to NNX"):
        rngaudit.capture(f"{write(tmp_path, 'lin.py', 'import flax.linen as nn')}:nn.Dense", steps=2)


KWONLY = HEADER + textwrap.dedent("""
    print("importing the model")

    class Model(nnx.Module):
        def __init__(self, *, rngs):
            self.lin = nnx.Linear(4, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            print("calling the model")
            return self.drop(self.lin(x))

    def exits(rngs):
        raise SystemExit(5)
""")


def test_a_class_target_with_keyword_rngs_and_a_model_that_prints(tmp_path):
    """The usual NNX class (`__init__(self, *, rngs)`) as TARGET; what the model prints goes to stderr, so
    the spec on stdout stays a spec."""
    f = write(tmp_path, "kw.py", KWONLY)
    r = invoke("capture", f"{f}:Model", "--input", "f32[2,4]", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.startswith("# captured from") and "calling the model" not in r.stdout
    spec = write(tmp_path, "kw.yaml", r.stdout)
    assert invoke("derive", spec).exit_code == 0


@pytest.mark.parametrize(
    "target, args, message",
    [
        ("exits", (), "SystemExit"),
        ("Model", ("--input", "f32[100000,100000,100000]"), "--input f32[100000,100000,100000]: cannot make it"),
    ],
)
def test_hostile_factories_and_inputs(tmp_path, target, args, message):
    f = write(tmp_path, "kw.py", KWONLY)
    r = invoke("capture", f"{f}:{target}", "--rngs", "params=0,dropout=1", *args)
    # (before the error line: what the model module printed when imported)
    assert r.exit_code == 2 and r.stderr.splitlines()[-1].startswith("error: ") and message in r.stderr, r.stderr


def test_keys_and_output_are_written_both_or_neither(tmp_path):
    f = write(tmp_path, "mlp.py", MLP)
    keys = tmp_path / "k.json"
    r = invoke(
        "capture", f"{f}:make_model", "--rngs", "params=0,dropout=1", "-o", tmp_path / "no" / "x.yaml", "--keys", keys
    )
    assert r.exit_code == 2 and "--output" in r.stderr and not keys.exists()
    r = invoke("capture", f"{f}:make_model", "--rngs", "params=0,dropout=1", "--keys", tmp_path / "no" / "k.json")
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --keys {tmp_path / 'no' / 'k.json'}")
    same = tmp_path / "same.yaml"
    r = invoke("capture", f"{f}:make_model", "--rngs", "params=0,dropout=1", "-o", same, "--keys", same)
    assert r.exit_code == 2 and "name one file" in r.stderr and not same.exists()


def test_a_hand_edited_keys_file_is_checked(tmp_path):
    f = write(tmp_path, "mlp.py", MLP)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1")
    twice = dict(doc, calls=doc["calls"] + doc["calls"][:1])
    for bad, message in (
        (twice, "repeats the call site of calls[0]"),
        (dict(doc, flavour="weird"), "`flavour` is linen or nnx"),
        (dict(doc, calls=[dict(doc["calls"][0], key=[1])] + doc["calls"][1:]), "2 or 4 unsigned 32-bit words"),
    ):
        path = write(tmp_path, "bad.json", json.dumps(bad))
        r = invoke("verify", spec, "--against", path)
        assert r.exit_code == 2 and message in r.stderr, r.stderr


_INSERTED_GATE = "self.gate = nnx.Linear(dhidden, dhidden, rngs=rngs)\n        self.bn = "


@pytest.mark.parametrize(
    "base, source",
    [
        (
            ENCODER,
            ENCODER.replace(
                "self.ln2 = nnx.LayerNorm(d, rngs=rngs)",
                "self.ln2 = nnx.LayerNorm(d, rngs=rngs)\n        self.gate = nnx.Linear(d, d, rngs=rngs)",
            ),
        ),
        (
            MLP,
            MLP.replace("self.bn = ", _INSERTED_GATE)
            .replace("self.bn(self.linear1(x))", "self.bn(self.gate(self.linear1(x)))")
            .replace("self.bn", "self.norm"),
        ),
    ],
    ids=["inserted", "inserted-and-the-next-renamed"],
)
def test_an_inserted_layer_is_not_called_a_rename(tmp_path, base, source):
    """A layer inserted before `ff` takes over the count `ff`'s fork drew: the same key at a new site, while
    `ff` still exists (at another count). That is a count shift, not a rename. With the next layer renamed too
    (`bn` -> `norm` after an inserted `gate`), `gate.bias` draws what `bn.bias` drew: not a rename either (it was
    reported "MOVED bn/bias -> gate/bias, a rename or a move"): a module renamed whole keeps every draw."""
    assert source != base
    old = write(tmp_path, "old.py", base)
    new = write(tmp_path, "new.py", source)
    keys = []
    for path in (old, new):
        keys.append(tmp_path / f"{pathlib.Path(path).stem}.json")
        assert (
            invoke(
                "capture", f"{path}:make_model", "--rngs", "params=0,dropout=1", "-f", "json", "-o", keys[-1]
            ).exit_code
            == 0
        )
    r = invoke("diff", *keys)
    assert r.exit_code == 1 and "MOVED" not in r.stdout and "count shift" in r.stdout
    if "self.bn" in base and "self.bn" not in source:
        # bn renamed norm, its counts moved by the inserted gate: each of its draws one CHANGED row, from the old
        # name to the new (it was GONE bn, NEW norm, unexplained)
        assert "norm draws what bn drew (bias, scale) and bn is gone: bn renamed norm" in r.stdout
        assert "GONE     bn/" not in r.stdout and "NEW      norm/" not in r.stdout
    else:
        assert "rename" not in r.stdout


DEFAULT_ONLY = HEADER + textwrap.dedent("""
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.noise = nnx.Variable(jax.random.normal(rngs.noise(), (4,)))
            self.rngs = rngs

        def __call__(self, x):
            return x + jax.random.normal(self.rngs.noise(), x.shape)

    def make_model(rngs):
        return M(rngs), (jnp.ones((4,)),)
""")


def test_draws_that_default_serves_keep_the_name_they_asked_for(tmp_path):
    f = write(tmp_path, "d.py", DEFAULT_ONLY)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "default=0", "--steps", "2")
    assert "draw: noise" in spec.read_text()
    assert {c["stream_requested"] for c in doc["calls"]} == {"params", "noise"}
    assert {c["stream"] for c in doc["calls"]} == {"default"}
    r = invoke("derive", spec, "--strict")
    assert r.exit_code == 1 and "5 served by 'default'" in r.stdout


# the ensemble idiom of flax >= 0.12.6: nnx.vmap over rngs.split(N) (or rngs.broadcast(N)); the mapping form
# passes the other streams through, copied with count 0
SPLIT_ENSEMBLE = HEADER + textwrap.dedent("""
    class Member(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    class Ensemble(nnx.Module):
        def __init__(self, rngs, mode, only):
            self.top = nnx.Dropout(0.1, rngs=rngs)
            if only is None:
                self.members = nnx.vmap(lambda r: Member(r), in_axes=0)(getattr(rngs, mode)(3))
            else:
                axes = nnx.StateAxes({only: 0, ...: None})
                made = getattr(rngs, mode)({only: 3, ...: None})
                self.members = nnx.vmap(lambda r: Member(r), in_axes=(axes,))(made)

        def __call__(self, x):
            @nnx.vmap(in_axes=(0, None))
            def run(m, x):
                return m(x)

            return run(self.members, self.top(x))

    def make_model(rngs):
        return Ensemble(rngs, MODE, ONLY), (jnp.ones((1, 4)),)
""")


@pytest.mark.parametrize(
    "mode, only, found",
    [
        ("split", None, []),
        # the members' Dropouts fork the copy at count 0, as the top Dropout did: construction and each step
        ("split", "params", ["count_rewind"] * 3),
        # every member the same keys: its kernel, bias and Dropout fork, then each step's mask
        ("broadcast", None, ["broadcast_lanes"] * 5),
    ],
)
def test_ensembles_over_split_or_broadcast_rngs_capture_and_replay(tmp_path, mode, only, found):
    f = write(tmp_path, "model.py", SPLIT_ENSEMBLE.replace("MODE", repr(mode)).replace("ONLY", repr(only)))
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--steps", "2")
    text = spec.read_text()
    assert f"rngs: {mode}" in text and ("only:" in text) == (only is not None)
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    r = invoke("collisions", spec, "-f", "json")
    assert [c["category"] for c in json.loads(r.stdout)["inputs"][0]["collisions"]] == found


def test_diff_of_a_renamed_bridge_explains_every_key_by_the_key_that_moved(tmp_path):
    old = write(tmp_path, "old.py", BRIDGE)
    new = write(tmp_path, "new.py", BRIDGE.replace("self.block", "self.encoder"))
    for name, f in (("old", old), ("new", new)):
        r = invoke(
            "capture",
            f"{f}:make_model",
            "--rngs",
            "params=0,dropout=1",
            "--steps",
            "2",
            "--keys",
            tmp_path / f"{name}.json",
        )
        assert r.exit_code == 0, r.stderr
    r = invoke("diff", tmp_path / "old.json", tmp_path / "new.json", "-f", "json")
    doc = json.loads(r.stdout)
    entries = [e for e in doc["sites"] if e["status"] != "kept"]
    # the ToNNX's fork, its own Rngs' draws and the Linen keys inside: all moved with the name, none changed, so
    # a gate passes (exit 0)
    assert r.exit_code == 0 and not doc["summary"]["failing"] and doc["summary"]["moved"] == len(entries) > 0
    assert all(e["status"] == "moved" and e["old_key"] == e["new_key"] for e in entries)
    assert all(e["old_path"][0] == "block" and e["path"][0] == "encoder" for e in entries)
    assert all(any("the same key" in w for w in e["why"]) for e in entries), entries


@pytest.mark.parametrize(
    "call, message",
    [
        # a second call with another static argument: its Linen module draws otherwise (no Dropout key)
        ("return self.block(self.block(x), train=False)", "called with different arguments from call to call"),
    ],
)
def test_a_bridge_whose_calls_differ_is_refused_and_nothing_written(tmp_path, call, message):
    source = BRIDGE.replace(
        "def __call__(self, x):\n        return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x))",
        "def __call__(self, x, train=True):\n        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))",
    ).replace("return self.drop(self.block(self.embed(x)))", call)
    assert "train=True" in source and call in source
    f = write(tmp_path, "m.py", source)
    spec, keys = tmp_path / "out.yaml", tmp_path / "keys.json"
    r = invoke("capture", f"{f}:make_model", "-o", spec, "--keys", keys, "--rngs", "params=0,dropout=1", "--steps", "2")
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not spec.exists() and not keys.exists()


def test_a_linen_module_drawing_only_in_init_is_refused_with_the_reason(tmp_path):
    source = BRIDGE.replace(
        "return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x))",
        "if self.is_initializing():\n            self.make_rng('dropout')\n        return nn.Dense(4)(x)",
    )
    f = write(tmp_path, "m.py", source)
    r = invoke("capture", f"{f}:make_model", "-o", tmp_path / "o.yaml", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 2 and "draws differently in apply than in init" in r.stderr, r.stderr
    assert not (tmp_path / "o.yaml").exists()


def test_a_bridge_called_twice_a_step_captures_and_verifies(tmp_path):
    f = write(tmp_path, "m.py", BRIDGE.replace("self.drop(self.block(self.embed(x)))", "self.block(self.block(x))"))
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--steps", "2")
    assert_real_nnx_agrees(spec, doc)
    assert any(c["path"][0] == "block#2" for c in doc["calls"])
    for against in (f"{f}:make_model", tmp_path / "keys.json"):
        r = invoke("verify", spec, "--against", against)
        assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_a_layer_replaced_by_another_kind_is_not_a_move(tmp_path):
    """A Linear replaced by a LayerNorm draws the same params counts: kernel -> scale is not a rename."""
    old = write(tmp_path, "old.py", MLP)
    new = write(
        tmp_path,
        "new.py",
        MLP.replace(
            "self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)", "self.norm = nnx.LayerNorm(dhidden, rngs=rngs)"
        ).replace("return self.linear2(x)", "return self.norm(x)"),
    )
    for name, f in (("old", old), ("new", new)):
        r = invoke("capture", f"{f}:make_model", "--rngs", "params=0,dropout=1", "--keys", tmp_path / f"{name}.json")
        assert r.exit_code == 0, r.stderr
    r = invoke("diff", tmp_path / "old.json", tmp_path / "new.json", "-f", "json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["summary"]["failing"]
    moved = {(tuple(e["old_path"]), tuple(e["path"])) for e in doc["sites"] if e["status"] == "moved"}
    assert (("linear2", "kernel"), ("norm", "scale")) not in moved


# NNX transforms that hand out eager code's keys (FLAX_NNX_RULES.md §11-§12), as public NNX code writes them:
# activation checkpointing per block, a jitted head, control flow over a module that draws
REMAT_AND_CONTROL = HEADER + textwrap.dedent("""
    import functools

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.ff = nnx.Linear(d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return x + self.drop(self.ff(self.norm(x)))

    class Noise(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs

        def __call__(self, x):
            return x + 0.01 * jax.random.normal(self.rngs.noise(), x.shape)

    class Model(nnx.Module):
        def __init__(self, d, n, rngs):
            self.embed = nnx.Linear(d, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs) for _ in range(n)])
            self.noise = Noise(rngs)
            self.head = nnx.Linear(d, 2, rngs=rngs)

        def __call__(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = nnx.remat(lambda b, y: b(y))(block, x)
            x = nnx.cond(True, lambda m, y: m(y), lambda m, y: y, self.noise, x)
            x = nnx.switch(1, [lambda m, y: y, lambda m, y: m(m(y))], self.noise, x)
            x = nnx.fori_loop(0, 2, lambda i, c: (c[0], c[0](c[1])), (self.noise, x))[1]
            x = nnx.while_loop(lambda c: c[2] < 2, lambda c: (c[0], c[0](c[1]), c[2] + 1), (self.noise, x, 0))[1]
            head = functools.partial(nnx.jit, static_argnames=("scale",))(lambda m, y, scale: m(y) * scale)
            return head(self.head, x, scale=2)

    def make_model(rngs):
        return Model(8, 3, rngs), (jnp.ones((2, 8)),)
""")

# a Transformer's layers scanned, each under activation checkpointing (scan over remat)
SCAN_OVER_REMAT = SCAN_STACK.replace(
    "            def body(h, block):", "            @nnx.remat\n            def body(h, block):"
)

# transforms applied when the model's file is imported, as the Flax docs write scan over layers: the stack built by
# a module-level `@nnx.split_rngs @nnx.vmap` function, each block's __call__ decorated with nnx.remat, the scan body
# with nnx.scan, a method jitted by its decorator
IMPORT_TIME = HEADER + textwrap.dedent("""
    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.ff = nnx.Linear(d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        @nnx.remat
        def __call__(self, x):
            return x + self.drop(self.ff(x))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_blocks(rngs):
        return Block(8, rngs)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
        return block(x)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(8, 8, rngs=rngs)
            self.blocks = create_blocks(rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)

        @nnx.jit
        def __call__(self, x):
            return self.head(self.drop(forward(self.embed(x), self.blocks)))

    def make_model(rngs):
        return Model(rngs), (jnp.ones((2, 8)),)
""")

# the Flax 0.11 migration guide's scan over layers: a module that stacks itself (nnx.split_rngs and nnx.vmap on its
# __init__) and scans itself (nnx.scan on its __call__), inside a model of the user's
SELF_STACKED = HEADER + textwrap.dedent("""
    class MLP(nnx.Module):
        @nnx.split_rngs(splits=5)
        @nnx.vmap(in_axes=(0, 0))
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(3, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)
            self.node = nnx.Param(jnp.ones((2,)))

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def __call__(self, x: jax.Array):
            return nnx.gelu(self.dropout(self.bn(self.linear(x))))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(3, 3, rngs=rngs)
            self.mlp = MLP(rngs)

        def __call__(self, x):
            return self.mlp(self.embed(x))

    def make_model(rngs):
        return Model(rngs), (jnp.ones((3, 3)),)

    def bare(rngs):
        return MLP(rngs), (jnp.ones((3, 3)),)
""")


def _real_model_keys(path: str, seeds: dict, steps: int, step: str | None = None, factory: str = "make_model") -> list:
    """(tag, count, key) of every key the model hands out, built and called `steps` times (by the function
    `step` of the file, `step(model, *args)`, when given) in real NNX: its nnx.jit and nnx.remat compiled, its
    control flow traced, observed by the NNX oracle's recorder (a cached trace's keys are recorded as they run,
    but under the step that traced them: the step is left out)."""
    import importlib.util

    import jax
    from flax import nnx
    from nnx_oracle import _Recorder

    loaded = importlib.util.spec_from_file_location(f"real_{pathlib.Path(path).stem}_{id(path)}", path)
    module = importlib.util.module_from_spec(loaded)
    rec = _Recorder()
    reseed = nnx.reseed

    def quiet_reseed(*a, **k):  # (the keys of the fresh Rngs nnx.reseed draws from are not the model's)
        rec.off = True
        try:
            return reseed(*a, **k)
        finally:
            rec.off = False

    with rec.installed(), pytest.MonkeyPatch.context() as patched:
        patched.setattr(nnx, "reseed", quiet_reseed)
        loaded.loader.exec_module(module)
        model, args = getattr(module, factory)(nnx.Rngs(**seeds))
        for n in range(1, steps + 1):
            rec.step = n
            if step is None:
                model(*args)
            else:
                getattr(module, step)(model, *args)
            jax.effects_barrier()
    return sorted((r["tag"], r["count"], r["key"]) for r in rec.records)


def _assert_runs_as_captured(f, spec, doc, seeds: dict, steps: int, step: str, factory: str = "make_model") -> None:
    """The keys file is what the model hands out run as written in real NNX, the spec built in real NNX hands out
    the same, and verify of the spec against the model finds nothing."""
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, steps, step, factory)
    assert_real_nnx_agrees(spec, doc)
    rngs = ",".join(f"{k}={v}" for k, v in seeds.items())
    r = invoke("verify", spec, "--against", f"{f}:{factory}", "--step", f"{f}:{step}", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def mkdir(path: pathlib.Path) -> pathlib.Path:
    path.mkdir()
    return path


def _keys_file_keys(doc: dict) -> list:
    return sorted((c["stream"], c["count"], tuple(c["key"])) for c in doc["calls"])


@pytest.mark.parametrize(
    "source, seeds",
    [
        (REMAT_AND_CONTROL, {"params": 0, "dropout": 1, "noise": 2}),
        (SCAN_OVER_REMAT, {"params": 0, "dropout": 1}),
        (IMPORT_TIME, {"params": 0, "dropout": 1}),
        (SELF_STACKED, {"params": 0, "dropout": 1}),
        # (given its Rngs by keyword, MLP(rngs=rngs): nnx.vmap binds it to its position; it was refused, "MLP.mlp is
        # built inside nnx.vmap/nnx.scan other than as a stack")
        (SELF_STACKED.replace("self.mlp = MLP(rngs)", "self.mlp = MLP(rngs=rngs)"), {"params": 0, "dropout": 1}),
    ],
    ids=[
        "remat-jit-control-flow",
        "scan-over-remat",
        "transforms-applied-at-import",
        "module-that-stacks-itself",
        "module-that-stacks-itself-given-rngs-by-keyword",
    ],
)
def test_models_under_nnx_jit_remat_and_control_flow_capture_the_keys_real_nnx_draws(tmp_path, source, seeds):
    f = write(tmp_path, "model.py", source)
    rngs = ",".join(f"{k}={v}" for k, v in seeds.items())
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", rngs, "--steps", "2")
    # the model run as it is written (compiled, traced, checkpointed) hands out the same keys
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 2)
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_transforms_applied_where_a_neighbour_module_is_imported_are_followed_and_flaxs_after(tmp_path, monkeypatch):
    """The model's layers in a module of their own, imported by the model's file: its decorators run at that
    import, which capture must see (it used to refuse the model). After the capture they are Flax's own again: the
    model built and called outside it is compiled and draws the keys real NNX draws."""
    layers, _, model = IMPORT_TIME.partition("class Model(nnx.Module):")
    layers += textwrap.dedent("""
        SEEN = []

        @nnx.jit
        def head(m, x):
            SEEN.append(isinstance(x, jax.core.Tracer))
            return m(x)
    """)
    jitted = "    @nnx.jit\n    def __call__(self, x):\n        return self.head("
    assert jitted in model
    model = model.replace(jitted, "    def __call__(self, x):\n        return head(self.head, ")
    write(tmp_path, "layers.py", layers)
    f = write(
        tmp_path,
        "model.py",
        HEADER + "from layers import create_blocks, forward, head\n\nclass Model(nnx.Module):" + model,
    )
    seeds = {"params": 0, "dropout": 1}
    monkeypatch.syspath_prepend(tmp_path)
    real = _real_model_keys(f, seeds, 2)  # (layers imported as Python does, before capture: capture imports it again)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--steps", "2")
    assert _keys_file_keys(doc) == real
    assert_real_nnx_agrees(spec, doc)
    seen = sys.modules["layers"].SEEN
    assert seen and not any(seen)  # under capture: run as plain Python
    seen.clear()
    assert _real_model_keys(f, seeds, 2) == real  # the layers module capture imported, after it
    assert seen and all(seen)  # traced by nnx.jit: Flax's own transform


FORKED_DRAW = HEADER + textwrap.dedent("""
    class Scale(nnx.Module):
        def __init__(self, d, *, rngs):
            self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), (d,)))

        def __call__(self, x):
            return x * self.w

    class Model(nnx.Module):
        def __init__(self, *, rngs):
            self.scale = Scale(4, rngs=rngs.fork())

        def __call__(self, x):
            return self.scale(x)

    def make(rngs):
        return Model(rngs=rngs), (jnp.ones((2, 4)),)
""")


@pytest.mark.parametrize(
    "source, factory, message",
    [
        (SELF_STACKED, "bare", "the model, a MLP, stacks itself"),
        (
            HEADER
            + textwrap.dedent("""
                class Head(nnx.Module):
                    def __init__(self, rngs):
                        self.lin = nnx.Linear(3, 3, rngs=rngs)
                        self.drop = nnx.Dropout(0.5, rngs=rngs)

                    def __call__(self, x):
                        y = nnx.vmap(lambda m, z: m.drop(m.lin(z)), in_axes=(None, 0))(self, x)
                        return self.drop(y)

                class Model(nnx.Module):
                    def __init__(self, rngs):
                        self.head = Head(rngs)

                    def __call__(self, x):
                        return self.head(x)

                def make_model(rngs):
                    return Model(rngs), (jnp.ones((2, 3)),)
            """),
            "make_model",
            "the module itself and then calls or draws more",
        ),
        (
            # the Flax transforms guide's ensemble returned as the model itself (it said "the model was not built
            # by the factory's call")
            HEADER
            + textwrap.dedent("""
                class MLP(nnx.Module):
                    def __init__(self, rngs):
                        self.lin = nnx.Linear(3, 3, rngs=rngs)
                        self.drop = nnx.Dropout(0.5, rngs=rngs)

                    def __call__(self, x):
                        return self.drop(self.lin(x))

                @nnx.split_rngs(splits=4)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def create_model(rngs):
                    return MLP(rngs)

                def make_model(rngs):
                    return create_model(rngs), (jnp.ones((2, 3)),)
            """),
            "make_model",
            "is a stack an nnx.vmap built (an ensemble made by nnx.split_rngs(splits=N) and nnx.vmap",
        ),
    ],
    ids=["the-root", "more-after-the-scan", "the-guides-ensemble-as-the-model"],
)
def test_a_module_that_stacks_itself_where_a_spec_cannot_say_it(tmp_path, source, factory, message):
    f = write(tmp_path, "m.py", source)
    r = invoke("capture", f"{f}:{factory}", "-o", tmp_path / "o.yaml", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "o.yaml").exists()


def test_a_fork_and_the_forked_modules_own_draw_at_one_site_are_two_keys_everywhere(tmp_path):
    """A module built from rngs.fork() that draws itself: the fork's key and its first draw share path, stream
    and count. The keys file capture writes is read back by verify and diff (it was refused: "calls[1] repeats the
    call site of calls[0]"), and verify against the model compares both keys (it compared one)."""
    f = write(tmp_path, "m.py", FORKED_DRAW)
    spec, doc = capture(tmp_path, f"{f}:make")
    assert sorted(c["kind"] for c in doc["calls"]) == ["draw", "fork"]
    assert_real_nnx_agrees(spec, doc)
    for against in (tmp_path / "keys.json", f"{f}:make"):
        r = invoke("verify", spec, "--against", against)
        assert r.exit_code == 0 and "2 same, 0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    r = invoke("diff", tmp_path / "keys.json", tmp_path / "keys.json")
    assert r.exit_code == 0 and "2 kept, 0 changed" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "call",
    [
        "nnx.jit(lambda m, y: m(y), graph_updates=False)(self.dropout, {y})",  # the counts are not written back
        "(nnx.eval_shape(lambda m, y: m(y), self.dropout, {y}), self.dropout({y}))[1]",
    ],
    ids=["jit-without-graph-updates", "eval_shape"],
)
def test_a_transform_that_does_not_hand_out_eager_keys_is_refused(tmp_path, call):
    source = MLP.replace("self.dropout(self.bn(self.linear1(x)))", call.format(y="self.bn(self.linear1(x))"))
    assert source != MLP
    f = write(tmp_path, "m.py", source)
    r = invoke("capture", f"{f}:make_model", "-o", tmp_path / "o.yaml", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 2 and "a transform capture does not follow" in r.stderr, r.stderr
    assert not (tmp_path / "o.yaml").exists()


# a training step as the Flax NNX docs write one: jitted when its module is imported, value_and_grad, an optimizer
TRAIN_STEP = HEADER + textwrap.dedent("""
    import optax

    class MLP(nnx.Module):
        def __init__(self, din, dh, dout, *, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(din, dh, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.bn = nnx.BatchNorm(dh, rngs=rngs)
            self.l2 = nnx.Linear(dh, dout, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.bn(self.drop(self.l1(x)))))

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def twice(model, optimizer, x, y):
        model(x)
        model(x)

    def layer(model, optimizer, x, y):
        model(x)
        model.drop(model.l1(x))  # (a drawing layer of the model called outside its call)

    def quiet_layer(model, optimizer, x, y):
        model(x)
        model.l1(x)  # (a layer that draws nothing: no business of the keys)

    def nothing(model, optimizer, x, y):
        pass

    def stray(model, optimizer, x, y):
        model(x)
        model.drop.rngs()

    def split_merge(model, optimizer, x, y):
        graphdef, state = nnx.split(model)
        nnx.merge(graphdef, state)(x)  # (eager: the copy shares the model's variables, its RNG counts included)

    not_a_function = 3

    def make_model(rngs):
        model = MLP(4, 16, 3, rngs=rngs)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        return model, (optimizer, jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
""")


def test_a_jitted_training_step_captures_the_keys_real_nnx_draws(tmp_path):
    f = write(tmp_path, "train.py", TRAIN_STEP)
    seeds = {"params": 0, "dropout": 1}
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--step", f"{f}:train_step", "--rngs", "params=0,dropout=1", "--steps", "3"
    )
    # the step compiled, as written: the keys of construction and of the 3 steps' dropout masks
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 3, "train_step")
    assert [c["step"] for c in doc["calls"] if c["stream"] == "dropout"] == [0, 1, 2, 3]
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", tmp_path / "keys.json")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    # against the model itself, called by the same step (without it, model(optimizer, x, y) fails)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:train_step")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    r = invoke("verify", tmp_path / "keys.json", "--against", tmp_path / "keys.json", "--step", f"{f}:train_step")
    assert r.exit_code == 2 and "--step applies to an NNX spec checked against an NNX model" in r.stderr


# the model in model.py, the step in train.py importing its class, and a step in the model's own file using what
# the factory set up there: one module each (a second import gave classes of their own and globals unset)
MODEL_FILE = (
    TRAIN_STEP.replace("@nnx.jit\n", "")
    .replace(
        "def make_model(rngs):",
        textwrap.dedent("""
        optimizer = None

        def global_step(model, _, x, y):
            assert isinstance(model, MLP), type(model)
            grads = nnx.grad(lambda m: m(x).mean())(model)
            optimizer.update(model, grads)

        def make_model(rngs):
            global optimizer"""),
    )
    .replace("    return model, (optimizer,", "    return model, (None,")
)
STEP_FILE = textwrap.dedent("""
    import jax.numpy as jnp
    from flax import nnx
    from model import MLP

    @nnx.jit
    def train_step(model: MLP, _, x, y):
        assert isinstance(model, MLP), (type(model), MLP)
        return nnx.grad(lambda m: m(x).mean())(model)
""")


@pytest.mark.parametrize("step", ["train.py:train_step", "model.py:global_step"])
def test_a_step_sees_the_factorys_module_its_classes_and_globals(tmp_path, step):
    f = write(tmp_path, "model.py", MODEL_FILE)
    write(tmp_path, "train.py", STEP_FILE)
    assert "global optimizer" in MODEL_FILE and "return model, (None," in MODEL_FILE
    file, name = step.split(":")
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--step", f"{tmp_path / file}:{name}", "--rngs", "params=0,dropout=1"
    )
    seeds = {"params": 0, "dropout": 1}
    if file == "model.py":
        assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 1, name)
    assert [c["step"] for c in doc["calls"] if c["stream"] == "dropout"] == [0, 1]
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{tmp_path / file}:{name}")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    assert "model" not in sys.modules or not sys.modules["model"].__name__.startswith("_rngaudit_user_")


def test_a_step_calling_a_layer_of_the_model_that_draws_nothing_is_captured(tmp_path):
    # (model.l1(x) beside model(x) was refused: "calls Linear outside the model's call"; it draws no key)
    f = write(tmp_path, "train.py", TRAIN_STEP)
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--step", f"{f}:quiet_layer", "--rngs", "params=0,dropout=1", "--steps", "2"
    )
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1}, 2, "quiet_layer")


def test_a_step_calling_an_eager_merge_of_the_model_captures_the_keys_real_nnx_draws(tmp_path):
    """nnx.merge(*nnx.split(model)) outside jax.jit shares the model's variables: its draws are the model's (it
    was refused: "calls MLP outside the model's call")."""
    f = write(tmp_path, "train.py", TRAIN_STEP)
    rngs = "params=0,dropout=1"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--step", f"{f}:split_merge", "--rngs", rngs, "--steps", "2")
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 2, "split_merge")
    assert [c["count"] for c in doc["calls"] if c["stream"] == "dropout" and c["step"]] == [0, 1]
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:split_merge", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "step, message",
    [
        ("nothing", "step 1 does not call the model"),
        ("layer", "step 1 calls Dropout outside the model's call"),
        ("stray", "step 1 draws 1 key(s) outside the model's call"),
        ("not_a_function", "not_a_function is not a function (it is a int)"),
        ("nowhere", "has no 'nowhere'"),
    ],
)
def test_a_step_an_nnx_spec_cannot_say_is_refused_and_nothing_written(tmp_path, step, message):
    _assert_step_refused(tmp_path, TRAIN_STEP, step, message)


def _assert_step_refused(tmp_path, source: str, step: str, message: str) -> None:
    """capture --step of `step` in `source` exits 2 with one `error:` line saying `message`, and writes nothing."""
    f = write(tmp_path, "train.py", source)
    out = tmp_path / "o.yaml"
    r = invoke("capture", f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", "params=0,dropout=1", "-o", out)
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not out.exists()


# the Flax NNX MNIST tutorial's loop: train_step and eval_step jitted, model.train() before the training steps and
# model.eval() before evaluation (or nnx.view of the model in each mode); attention with dropout beside Dropout
TRAIN_EVAL = HEADER + textwrap.dedent("""
    import optax

    class Net(nnx.Module):
        def __init__(self, din, dh, dout, *, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(din, dh, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.bn = nnx.BatchNorm(dh, rngs=rngs)
            self.att = nnx.MultiHeadAttention(
                num_heads=2, in_features=dh, dropout_rate=0.1, decode=False, deterministic=False, rngs=rngs
            )
            self.l2 = nnx.Linear(dh, dout, rngs=rngs)

        def __call__(self, x):
            h = self.bn(self.drop(self.l1(x)))
            return self.l2(nnx.relu(self.att(h[:, None, :])[:, 0, :]))

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def eval_step(model, x, y):
        return loss_fn(model, x, y)

    def epoch(model, optimizer, x, y):
        model.train()
        train_step(model, optimizer, x, y)
        train_step(model, optimizer, x, y)
        model.eval()
        eval_step(model, x, y)

    def views(model, optimizer, x, y):
        train_step(nnx.view(model, deterministic=False), optimizer, x, y)
        eval_step(nnx.view(model, deterministic=True), x, y)

    def attributes(model, optimizer, x, y):
        train_step(nnx.with_attributes(model, deterministic=False), optimizer, x, y)
        eval_step(nnx.with_attributes(model, deterministic=True, use_running_average=True), x, y)

    def two_views(model, optimizer, x, y):
        # two augmented views through one encoder (SimCLR-style): two dropout masks a step
        grads = nnx.grad(lambda m: jnp.mean((m(x) - m(x * 2)) ** 2))(model)
        optimizer.update(model, grads)

    def only_dropout(model, optimizer, x, y):
        model.set_attributes(nnx.Dropout, deterministic=True)
        model(x)

    def opposite(model, optimizer, x, y):
        # the Dropout and the attention in opposite modes, each switched at every step
        now = not model.drop.deterministic
        model.set_attributes(nnx.Dropout, deterministic=now)
        model.set_attributes(nnx.MultiHeadAttention, deterministic=not now)
        model(x)

    def make_model(rngs):
        model = Net(4, 16, 3, rngs=rngs)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        return model, (optimizer, jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
""")


@pytest.mark.parametrize(
    "step, run",
    [
        ("epoch", [{"call": 2}, "eval", "call", "train", {"call": 2}, "eval", "call"]),
        ("views", ["call", "eval", "call", "train", "call", "eval", "call"]),
        ("attributes", ["call", "eval", "call", "train", "call", "eval", "call"]),
        ("two_views", None),
    ],
)
def test_train_and_eval_modes_and_steps_calling_the_model_twice_capture_the_keys_real_nnx_draws(tmp_path, step, run):
    f = write(tmp_path, "train.py", TRAIN_EVAL)
    seeds = {"params": 0, "dropout": 1}
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", "params=0,dropout=1", "--steps", "2"
    )
    # each call of the model is a step of the spec; model.train()/eval() (or the view called) between them
    written = yaml.safe_load(spec.read_text())
    assert written.get("run") == run and written.get("steps") == (None if run else 4), written
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 2, step)
    # (the dropout masks: only calls in train mode draw, the Dropout's and the attention's)
    train = {"epoch": [1, 2, 4, 5], "views": [1, 3], "attributes": [1, 3], "two_views": [1, 2, 3, 4]}[step]
    assert sorted({c["step"] for c in doc["calls"] if c["stream"] == "dropout"} - {0}) == train
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:{step}")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    if run is not None:
        # the spec's modes against a model called plainly: an error that says what to give, not false findings
        r = invoke("verify", spec, "--against", f"{f}:make_model")
        assert r.exit_code == 2 and "give --step STEP" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        # against a step that switches modes elsewhere: the calls whose mode differs, found
        other = "views" if step == "epoch" else "epoch"
        r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:{other}")
        assert r.exit_code == 1 and "MISSING" in r.stdout and "EXTRA" in r.stdout, r.stdout + r.stderr


# Linen-style: a `train` flag at the model's call, passed on as each layer's `deterministic=`
TRAIN_FLAG = HEADER + textwrap.dedent("""
    class ArgNet(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.att = nnx.MultiHeadAttention(num_heads=2, in_features=16, dropout_rate=0.1, decode=False, rngs=rngs)
            self.l2 = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x, *, train: bool):
            h = self.drop(self.l1(x), deterministic=not train)
            h = self.att(h[:, None, :], deterministic=not train)[:, 0, :]
            return self.l2(h)

    def step(model, x):
        model(x, train=True)
        model(x, train=True)
        model(x, train=False)

    def numpy_flag(model, x):
        import numpy as np

        model(x, train=np.bool_(True))
        model(x, train=np.bool_(False))

    def make_model(rngs):
        return ArgNet(rngs), (jnp.ones((8, 4)),)

    class Fixed(nnx.Module):
        # attention always called deterministic, whatever the mode; the Dropout follows model.train()/eval()
        def __init__(self, rngs):
            self.att = nnx.MultiHeadAttention(num_heads=2, in_features=4, dropout_rate=0.1, decode=False, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.att(x, deterministic=True))

    def make_fixed(rngs):
        return Fixed(rngs), (jnp.ones((3, 2, 4)),)

    def fixed_eval(model, x):
        model(x)
        model.eval()
        model(x)
        model.train()

    class Noisy(nnx.Module):
        # a Dropout always called deterministic=False (noise kept at evaluation, MC-dropout style) beside one that
        # follows model.train()/eval(), and attention called deterministic=True, under nnx.jit
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 4, rngs=rngs)
            self.mc = nnx.Dropout(0.5, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.att = nnx.MultiHeadAttention(num_heads=2, in_features=4, dropout_rate=0.1, decode=False, rngs=rngs)

        def __call__(self, x):
            h = self.drop(self.mc(self.l1(x), deterministic=False))
            return self.att(h, deterministic=True)

    def make_noisy(rngs):
        return Noisy(rngs), (jnp.ones((3, 2, 4)),)

    class Twice(nnx.Module):
        # one Dropout called twice a call, once given deterministic=False: both follow the (train) mode
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.drop(x), deterministic=False)

    def make_twice(rngs):
        return Twice(rngs), (jnp.ones((2, 4)),)

    @nnx.jit
    def jitted(model, x):
        return model(x)

    def noisy_epoch(model, x):
        model.train()
        jitted(model, x)
        jitted(model, x)
        model.eval()
        jitted(model, x)
""")


def test_a_train_flag_passed_on_as_deterministic_is_captured_as_train_and_eval(tmp_path):
    f = write(tmp_path, "flag.py", TRAIN_FLAG)
    seeds = {"params": 0, "dropout": 1}
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--step", f"{f}:step", "--rngs", "params=0,dropout=1", "--steps", "2"
    )
    # model(x, train=False) draws what model.eval(); model(x) would: no key (the same keys, the spec says `eval`)
    assert yaml.safe_load(spec.read_text())["run"] == [
        {"call": 2},
        "eval",
        "call",
        "train",
        {"call": 2},
        "eval",
        "call",
    ]
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 2, "step")
    assert sorted({c["step"] for c in doc["calls"] if c["stream"] == "dropout"} - {0}) == [1, 2, 4, 5]
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:step")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "factory, step, run",
    [
        ("make_model", "numpy_flag", ["call", "eval", "call", "train", "call", "eval", "call"]),  # train=np.bool_
        ("make_fixed", None, None),  # (a layer always called deterministic=True: its option, no event)
        ("make_twice", None, None),  # (given deterministic=False at one of its two calls: was refused)
    ],
)
def test_a_deterministic_argument_every_call_gives_is_the_layers_option(tmp_path, factory, step, run):
    f = write(tmp_path, "flag.py", TRAIN_FLAG)
    seeds = {"params": 0, "dropout": 1}
    stepping = ("--step", f"{f}:{step}") if step else ()
    spec, doc = capture(tmp_path, f"{f}:{factory}", *stepping, "--rngs", "params=0,dropout=1", "--steps", "2")
    written = yaml.safe_load(spec.read_text())
    assert written.get("run") == run, written
    if factory == "make_fixed":
        assert {"MultiHeadAttention": {"name": "att", "dropout_rate": 0.1, "deterministic": True}} in written["model"][
            "init"
        ]
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:{factory}", *stepping)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    if step is not None:
        assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 2, step, factory)


@pytest.mark.parametrize(
    "factory, step, run, said",
    [
        # model.eval() agrees with att's deterministic=True, model.train() at call 3 does not
        ("make_fixed", "fixed_eval", ["call", "eval", "call", "train", "call", "eval", "call"], {"att": True}),
        # mc draws in eval mode too; drop only in train mode; att never
        (
            "make_noisy",
            "noisy_epoch",
            [{"call": 2}, "eval", "call", "train", {"call": 2}, "eval", "call"],
            {"mc": False, "att": True},
        ),
    ],
)
def test_a_layers_own_deterministic_argument_beside_train_and_eval_is_said_at_its_calls(
    tmp_path, factory, step, run, said
):
    f = write(tmp_path, "flag.py", TRAIN_FLAG)
    seeds = {"params": 0, "dropout": 1}
    spec, doc = capture(
        tmp_path, f"{f}:{factory}", "--step", f"{f}:{step}", "--rngs", "params=0,dropout=1", "--steps", "2"
    )
    written = yaml.safe_load(spec.read_text())
    assert written["run"] == run, written
    calls = {c["call"]["name"]: c["call"] for c in written["model"]["call"] if isinstance(c["call"], dict)}
    assert {name: calls[name].get("deterministic") for name in said} == said, written["model"]["call"]
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 2, step, factory)
    if factory == "make_noisy":
        # (mc draws at every call, eval ones included; drop only in train mode: calls 1, 2, 4, 5)
        drawn = {(c["path"][0], c["step"]) for c in doc["calls"] if c["stream"] == "dropout" and c["step"]}
        assert {s for p, s in drawn if p.startswith("mc")} == {1, 2, 3, 4, 5, 6}, drawn
        assert {s for p, s in drawn if p.startswith("drop")} == {1, 2, 4, 5}, drawn
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:{factory}", "--step", f"{f}:{step}")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_layers_in_one_mode_at_every_step_and_others_not(tmp_path):
    """A step that makes the Dropouts deterministic and not the attention (set_attributes at every step) was
    refused; each layer in one mode at every call says it itself (the Dropout `deterministic: true`). Layers
    switched at every step, in opposite modes, are still refused."""
    f = write(tmp_path, "train.py", TRAIN_EVAL)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--step", f"{f}:only_dropout", "--rngs", "params=0,dropout=1")
    init = yaml.safe_load(spec.read_text())["model"]["init"]
    assert {"Dropout": {"name": "drop", "rate": 0.2, "deterministic": True}} in init, init
    assert not [c for c in doc["calls"] if c["step"] and c["path"][0] == "drop"]
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1}, 1, "only_dropout")
    out = tmp_path / "o.yaml"
    r = invoke(
        "capture",
        f"{f}:make_model",
        "--step",
        f"{f}:opposite",
        "--rngs",
        "params=0,dropout=1",
        "--steps",
        "2",
        "-o",
        out,
    )
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "are deterministic and others (att) are not" in r.stderr
    assert not out.exists()


def test_step_is_for_nnx_models(tmp_path):
    f = write(
        tmp_path,
        "lin.py",
        "import jax.numpy as jnp\nimport flax.linen as nn\n\n\ndef make():\n    return nn.Dense(3), (jnp.ones((1, 2)),)\n",
    )
    r = invoke("capture", f"{f}:make", "--step", f"{f}:make")
    assert (
        r.exit_code == 2
        and r.stderr == "error: --step applies to NNX models (TARGET builds an nnx.Module from an nnx.Rngs)\n"
    )
    # a factory that fails says why (an NNX model whose Rngs lacks a stream said "--steps applies to NNX models")
    g = write(
        tmp_path,
        "broken.py",
        HEADER + "\n\ndef make():\n    return nnx.Dropout(0.5, rngs=nnx.Rngs(params=0)), (jnp.ones((2,)),)\n",
    )
    for option in ("--steps", "--step"):
        out = tmp_path / "o.yaml"
        r = invoke("capture", f"{g}:make", option, "2" if option == "--steps" else f"{f}:make", "-o", out)
        assert r.exit_code == 2 and "calling make() raises KeyError" in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1 and not out.exists()


SEEDED = (
    MLP
    + """
def seeded():
    return make_model(nnx.Rngs(0, dropout=1))

def seeded_by_key():
    return make_model(nnx.Rngs(jax.random.key(0)))
"""
)


def test_a_factory_that_seeds_its_model_itself_is_captured(tmp_path):
    """`def make(): return Model(rngs=nnx.Rngs(0, dropout=1)), (x,)`, the way most NNX code builds a model (it was
    refused: "an NNX factory takes the nnx.Rngs"): captured with the seeds it gives, the keys real NNX hands out,
    the same as the factory that takes the Rngs given those seeds; verify runs it as it is."""
    f = write(tmp_path, "m.py", SEEDED)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    spec, doc = capture(tmp_path / "a", f"{f}:seeded", "--steps", "3")
    assert load_spec(str(spec)).rngs.keys() == {"default", "dropout"} and doc["rngs"] == {"default": 0, "dropout": 1}
    assert_real_nnx_agrees(spec, doc)
    _, given = capture(tmp_path / "b", f"{f}:make_model", "--rngs", "default=0,dropout=1", "--steps", "3")
    assert [c["key"] for c in doc["calls"]] == [c["key"] for c in given["calls"]] and len(doc["calls"]) == 10
    r = invoke("verify", spec, "--against", f"{f}:seeded")
    assert r.exit_code == 0 and "10 same, 0 differ, 0 missing, 0 extra" in r.stdout, r.output
    # its seeds are the factory's: --rngs (and Linen's --phase) are one error line, nothing written
    for args, message in (
        (("--rngs", "params=0"), "--rngs: TARGET"),
        (("--phase", "apply"), "--phase: TARGET"),
    ):
        out = tmp_path / "no.yaml"
        r = invoke("capture", f"{f}:seeded", "-o", out, *args)
        assert r.exit_code == 2 and r.stderr.startswith(f"error: {message}") and len(r.stderr.splitlines()) == 1
        assert not out.exists()
    r = invoke("verify", spec, "--against", f"{f}:seeded", "--rngs", "default=0")
    assert r.exit_code == 2 and "--rngs: TARGET" in r.stderr
    # an Rngs seeded with a key (nnx.Rngs(jax.random.key(0))): its key data is the spec's rngs (it was refused)
    (tmp_path / "c").mkdir()
    spec, doc = capture(tmp_path / "c", f"{f}:seeded_by_key", "--steps", "3")
    assert "rngs:\n  default: [0, 0]\n" in spec.read_text() and doc["rngs"] == {"default": [0, 0]}
    assert_real_nnx_agrees(spec, doc)
    (tmp_path / "d").mkdir()
    _, by_seed = capture(tmp_path / "d", f"{f}:make_model", "--rngs", "default=0", "--steps", "3")
    assert [c["key"] for c in doc["calls"]] == [c["key"] for c in by_seed["calls"]]  # (key(0) is seed 0's key)
    r = invoke("verify", spec, "--against", f"{f}:seeded_by_key")
    assert r.exit_code == 0 and "10 same, 0 differ, 0 missing, 0 extra" in r.stdout, r.output
    # verify builds a factory that takes the Rngs from the spec's keys (key data, split(...), fold_in(...))
    r = invoke("verify", spec, "--against", f"{f}:make_model")
    assert r.exit_code == 0 and "10 same, 0 differ, 0 missing, 0 extra" in r.stdout, r.output


# the Flax "Randomness" guide's pattern: Dropouts built without rngs, an Rngs made once and given to every call
CALL_RNGS = HEADER + textwrap.dedent("""
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)  # its own fork: the call's Rngs wins

        def __call__(self, x, rngs):
            return self.drop(self.lin(x), rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, deterministic=False)
            self.block = Block(rngs)
            self.rngs = rngs

        def __call__(self, x, rngs):
            return self.block(self.drop(self.linear(x), rngs=rngs), rngs)

    def make_model(rngs):
        return Model(rngs), (jnp.ones((2, 4)), nnx.Rngs(dropout=7))

    class Fresh(Model):
        def __call__(self, x, rngs):
            return self.drop(self.linear(x), rngs=nnx.Rngs(dropout=5))  # a new Rngs at every call

    def fresh(rngs):
        return Fresh(rngs), (jnp.ones((2, 4)), nnx.Rngs(dropout=7))

    def own_rngs(rngs):
        return Model(rngs), (jnp.ones((2, 4)), rngs)

    def a_key(rngs):
        return Model(rngs), (jnp.ones((2, 4)), nnx.Rngs(dropout=jax.random.key(3)))
""")


def test_an_rngs_given_to_the_calls_captures_the_keys_real_nnx_draws(tmp_path):
    f = write(tmp_path, "model.py", CALL_RNGS)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--steps", "2")
    text = spec.read_text()
    assert "call_rngs:\n  dropout: 7\n" in text and "rngs: call" in text and "rngs: false" in text, text
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 2)
    assert sum(c["stream_path"] == "call_rngs.dropout" for c in doc["calls"]) == 4  # two Dropouts, two steps
    assert_real_nnx_agrees(spec, doc)
    for against in (f"{f}:make_model", tmp_path / "keys.json"):
        r = invoke("verify", spec, "--against", against)
        assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_the_guides_model_given_its_own_rngs_at_the_call_captures_the_keys_real_nnx_draws(tmp_path):
    """Model(rngs) and then model(x, rngs) with the same Rngs, as the Flax "Randomness" guide writes it."""
    f = write(tmp_path, "model.py", CALL_RNGS)
    spec, doc = capture(tmp_path, f"{f}:own_rngs", "--rngs", "params=0,dropout=1", "--steps", "2")
    text = spec.read_text()
    assert "rngs: model" in text and "call_rngs" not in text, text
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 2, factory="own_rngs")
    assert_real_nnx_agrees(spec, doc)


def test_an_rngs_of_a_key_given_to_the_calls_captures_the_keys_real_nnx_draws(tmp_path):
    """rngs = nnx.Rngs(dropout=jax.random.key(3)) given to every call (it was refused): its key data is the spec's
    call_rngs."""
    f = write(tmp_path, "model.py", CALL_RNGS)
    spec, doc = capture(tmp_path, f"{f}:a_key", "--rngs", "params=0,dropout=1", "--steps", "2")
    assert "call_rngs:\n  dropout: [0, 3]\n" in spec.read_text(), spec.read_text()
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 2, factory="a_key")
    assert_real_nnx_agrees(spec, doc)


def test_a_new_rngs_of_one_seed_at_every_call_is_captured_and_is_a_count_rewind(tmp_path):
    """A model making nnx.Rngs(dropout=5) in its __call__ gives its Dropout the same mask at every call: captured
    (it was refused) as an Rngs made for each step, and collisions says so."""
    f = write(tmp_path, "model.py", CALL_RNGS)
    spec, doc = capture(tmp_path, f"{f}:fresh", "--rngs", "params=0,dropout=1", "--steps", "2")
    assert "call_rngs:\n- dropout: 5\n- dropout: 5\n" in spec.read_text(), spec.read_text()
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 2, factory="fresh")
    assert_real_nnx_agrees(spec, doc)
    r = invoke("collisions", spec)
    assert r.exit_code == 1 and "FAIL  count_rewind: 2 draws get the key" in r.stdout, r.stdout
    assert "jax.random.fold_in(key, step)" in r.stdout


# Flax's lm1b_nnx example, reduced: the model built from nnx.Rngs(params=a key split from PRNGKey(seed)), Dropouts
# without rngs, and a jitted training step that gives the model nnx.Rngs(dropout=fold_in(dropout_rng, step))
LM1B = HEADER + textwrap.dedent("""
    import optax

    class Block(nnx.Module):
        def __init__(self, d, *, rngs):
            self.attn = nnx.MultiHeadAttention(2, d, d, dropout_rate=0.1, decode=False, keep_rngs=False, rngs=rngs)
            self.lin = nnx.Linear(d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1)

        def __call__(self, x, rngs=None):
            x = x + self.drop(self.attn(x, rngs=rngs, deterministic=False), rngs=rngs)
            return x + self.drop(self.lin(x), rngs=rngs)

    class TransformerLM(nnx.Module):
        def __init__(self, d, *, rngs):
            self.embed = nnx.Embed(16, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs=rngs) for _ in range(2)])

        def __call__(self, tokens, rngs=None):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, rngs=rngs)
            return x

    def make_model():
        rng = jax.random.PRNGKey(0)
        rng, init_rng = jax.random.split(rng)
        model = TransformerLM(4, rngs=nnx.Rngs(params=init_rng))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        return model, (optimizer, jnp.ones((2, 3), jnp.int32), rng)

    @nnx.jit
    def train_step(model, optimizer, tokens, dropout_rng):
        dropout_rng = jax.random.fold_in(dropout_rng, optimizer.step.value)

        def loss_fn(model):
            return jnp.mean(model(tokens, rngs=nnx.Rngs(dropout=dropout_rng)) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def same_key_step(model, optimizer, tokens, dropout_rng):
        # the bug the fold_in prevents: one dropout key for every step
        grads = nnx.grad(lambda m: jnp.mean(m(tokens, rngs=nnx.Rngs(dropout=dropout_rng)) ** 2))(model)
        optimizer.update(model, grads)
""")


def _real_lm1b_keys(path, step: str, steps: int) -> list:
    """(tag, count, key) of every key the model hands out, built by its factory and trained by `step` compiled
    as written (nnx.jit), observed by the NNX oracle's recorder."""
    import importlib.util

    from nnx_oracle import _Recorder

    loaded = importlib.util.spec_from_file_location(f"real_lm1b_{id(path)}", path)
    module = importlib.util.module_from_spec(loaded)
    rec = _Recorder()
    with rec.installed():
        loaded.loader.exec_module(module)
        model, args = module.make_model()
        for _ in range(steps):
            getattr(module, step)(model, *args)
    return sorted((r["tag"], r["count"], r["key"]) for r in rec.records)


def test_the_lm1b_nnx_training_step_captures_the_keys_real_nnx_draws(tmp_path):
    """Both were refused: an Rngs seeded with a key, and a new Rngs given to the calls of every step."""
    f = write(tmp_path, "train.py", LM1B)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--step", f"{f}:train_step", "--steps", "3")
    text = spec.read_text()
    assert "rngs:\n  params: [" in text and text.count("\n- dropout: [") == 3, text
    assert _keys_file_keys(doc) == _real_lm1b_keys(f, "train_step", 3)
    assert_real_nnx_agrees(spec, doc)
    # each step's Rngs counts from 0: 2 attention and 4 Dropout draws a step
    given = [(c["step"], c["count"]) for c in doc["calls"] if c["stream_path"] == "call_rngs.dropout"]
    assert given == [(s, n) for s in (1, 2, 3) for n in range(6)]
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:train_step")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    assert invoke("collisions", spec).exit_code == 0
    # without the fold_in every step draws the masks of the step before: collisions fails it
    (tmp_path / "same").mkdir()
    same, _ = capture(tmp_path / "same", f"{f}:make_model", "--step", f"{f}:same_key_step", "--steps", "2")
    r = invoke("collisions", same)
    assert r.exit_code == 1 and r.stdout.count("FAIL  count_rewind") == 6, r.stdout


# ---------------------------------------------------------------- nnx.RNN, as public NNX projects write it
RNN_MODELS = HEADER + textwrap.dedent("""
    import optax

    class LSTMClassifier(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(100, 8, rngs=rngs)
            self.rnn = nnx.RNN(nnx.LSTMCell(8, 16, rngs=rngs))
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.head = nnx.Linear(16, 2, rngs=rngs)

        def __call__(self, tokens):
            x = self.rnn(self.embed(tokens))
            return self.head(self.drop(x[:, -1]))

    def lstm(rngs):
        return LSTMClassifier(rngs), (jnp.ones((2, 5), jnp.int32),)

    class DropCell(nnx.RNNCellBase):
        # recurrent dropout: one mask a sequence (broadcast_rngs), a new one each call
        def __init__(self, din, dh, rngs):
            self.linear = nnx.Linear(din + dh, dh, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs, rng_collection="recurrent_dropout")
            self.dh = dh

        def __call__(self, h, x):
            h = nnx.relu(self.linear(jnp.concatenate([x, self.drop(h)], -1)))
            return h, h

        def initialize_carry(self, input_shape, rngs=None):
            return jnp.zeros(input_shape[:-1] + (self.dh,))

        @property
        def num_feature_axes(self):
            return 1

    class RecurrentDropout(nnx.Module):
        def __init__(self, rngs):
            self.rnn = nnx.RNN(DropCell(4, 8, rngs=rngs.fork()), broadcast_rngs="recurrent_dropout", rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(self.rnn(x)[:, -1])

    def recurrent(rngs):
        return RecurrentDropout(rngs), (jnp.ones((3, 6, 4)),)

    class BiGRU(nnx.Module):
        def __init__(self, rngs):
            self.fwd = nnx.RNN(nnx.GRUCell(4, 8, rngs=rngs), rngs=rngs)
            self.bwd = nnx.RNN(nnx.GRUCell(4, 8, rngs=rngs), rngs=rngs, reverse=True, keep_order=True)

        def __call__(self, x):
            return jnp.concatenate([self.fwd(x), self.bwd(x)], -1)

    def bigru(rngs):
        return BiGRU(rngs), (jnp.ones((2, 7, 4)),)

    class Seq2Seq(nnx.Module):
        # a random initial carry, time-major inputs, the model's Rngs given to the decoder's call
        def __init__(self, rngs):
            self.rngs = rngs
            self.enc = nnx.RNN(
                nnx.OptimizedLSTMCell(3, 6, carry_init=nnx.initializers.normal(), rngs=rngs),
                time_major=True,
                return_carry=True,
            )
            self.dec = nnx.RNN(nnx.SimpleCell(3, 6, rngs=rngs, keep_rngs=True), rngs=False)

        def __call__(self, x):
            carry, _ = self.enc(x)
            y = self.dec(jnp.swapaxes(x, 0, 1)[:, :2], initial_carry=carry[1])
            return self.dec(jnp.swapaxes(x, 0, 1), rngs=self.rngs) + y.sum()

    def seq2seq(rngs):
        return Seq2Seq(rngs), (jnp.ones((4, 2, 3)),)

    class Tagger(nnx.Module):
        # a bidirectional LSTM tagger: both directions draw their carry keys from Bidirectional's one stream
        def __init__(self, rngs):
            self.embed = nnx.Embed(50, 4, rngs=rngs)
            self.bilstm = nnx.Bidirectional(
                nnx.RNN(nnx.LSTMCell(4, 8, rngs=rngs)),
                nnx.RNN(nnx.LSTMCell(4, 8, rngs=rngs)),
                rngs=rngs,
            )
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.out = nnx.Linear(16, 5, rngs=rngs)

        def __call__(self, tokens):
            return self.out(self.drop(self.bilstm(self.embed(tokens))))

    def tagger(rngs):
        return Tagger(rngs), (jnp.ones((2, 6), jnp.int32),)

    def make_model(rngs):
        model = LSTMClassifier(rngs)
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        return model, (optimizer, jnp.ones((2, 5), jnp.int32), jnp.zeros((2,), jnp.int32))

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss
""")


@pytest.mark.parametrize(
    "factory, pieces",
    [
        ("lstm", ["cell: LSTMCell", "length: 5"]),
        ("recurrent", ["rngs: fork", "broadcast:\n      - recurrent_dropout", "class: DropCell"]),
        ("bigru", ["name: bwd\n      cell: GRUCell\n      rngs: fork"]),
        (
            "seq2seq",
            ["OptimizedLSTMCell", "carry_init: random", "keep_rngs: true", "initial_carry: true", "rngs: model"],
        ),
        ("tagger", ["Bidirectional:", "forward:\n        cell: LSTMCell", "rngs: fork", "length: 6"]),
    ],
)
def test_nnx_rnn_models_capture_the_keys_real_nnx_draws(tmp_path, factory, pieces):
    f = write(tmp_path, "model.py", RNN_MODELS)
    seeds = {"params": 0, "dropout": 1, "recurrent_dropout": 2, "carry": 3}
    rngs = ",".join(f"{k}={v}" for k, v in seeds.items())
    spec, doc = capture(tmp_path, f"{f}:{factory}", "--rngs", rngs, "--steps", "2")
    text = spec.read_text()
    for piece in pieces:
        assert piece in text, text
    # the model run as it is written (nnx.RNN's scan compiled) hands out the same keys, and the spec built in
    # real NNX by the oracle too
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 2, factory=factory)
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:{factory}", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_a_jitted_training_step_of_an_lstm_captures_the_keys_real_nnx_draws(tmp_path):
    f = write(tmp_path, "train.py", RNN_MODELS)
    seeds = {"params": 0, "dropout": 1}
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--step", f"{f}:train_step", "--rngs", "params=0,dropout=1", "--steps", "3"
    )
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 3, "train_step")
    # the LSTM's own stream hands out the same two carry keys' counts on, step after step
    assert [c["count"] for c in doc["calls"] if c["stream_path"] == "rnn.rngs"] == [0, 1, 2, 3, 4, 5]
    assert_real_nnx_agrees(spec, doc)


def _assert_refused(tmp_path, source: str, rngs: str, message: str) -> None:
    """capture of `make` in `source` exits 2 with one `error:` line saying `message`, and writes nothing."""
    f = write(tmp_path, "m.py", source)
    out = tmp_path / "o.yaml"
    r = invoke("capture", f"{f}:make", "--rngs", rngs, "-o", out)
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "fwd = nnx.RNN(nnx.GRUCell(2, 3, rngs=rngs))\n        self.rnn = nnx.Bidirectional(fwd, fwd)",
            "is given one RNN as both directions",
        ),
        (
            "self.rnn = nnx.RNN(nnx.GRUCell(2, 3, rngs=rngs), state_axes=nnx.StateAxes({nnx.Param: nnx.Carry, ...: nnx.Carry}))",
            "is given state_axes",
        ),
    ],
)
def test_rnns_capture_cannot_read_are_refused_and_nothing_written(tmp_path, body, message):
    source = HEADER + textwrap.dedent("""
        class M(nnx.Module):
            def __init__(self, rngs):
                BODY

            def __call__(self, x):
                return self.rnn(x)

        def make(rngs):
            return M(rngs), (jnp.ones((1, 3, 2)),)
    """).replace("BODY", body)
    _assert_refused(tmp_path, source, "params=0", message)


class_B = textwrap.dedent("""
    class B(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(2, 3, rngs=rngs)

        def __call__(self, x):
            return self.l(x)
""")


@pytest.mark.parametrize(
    "body, message",
    [
        (
            (
                "base = nnx.Linear(2, 3, rngs=rngs)\n        self.n = nnx.LayerNorm(3, rngs=rngs)\n        "
                "self.lora = nnx.LoRA(2, 1, 3, base_module=base, rngs=rngs)"
            ),
            "is given a base_module built elsewhere, or not just before it",
        ),
        ("self.lora = nnx.LoRA(2, 1, 3, base_module=B(rngs), rngs=rngs)", "(nnx.LoRA) wraps a B;"),
        ("self.lora = nnx.LoRA(2, 1, 2, base_module=nnx.Dropout(0.5, rngs=rngs), rngs=rngs)", "wraps a Dropout"),
        (
            "self.lora = nnx.LoRA(2, 1, 3, base_module=nnx.Linear(2, 3, rngs=rngs.fork()), rngs=rngs)",
            "or its base_module is given another Rngs",
        ),
    ],
)
def test_loras_capture_cannot_read_are_refused_and_nothing_written(tmp_path, body, message):
    source = (
        HEADER
        + class_B
        + textwrap.dedent("""
        class M(nnx.Module):
            def __init__(self, rngs):
                BODY

            def __call__(self, x):
                return self.lora(x)

        def make(rngs):
            return M(rngs), (jnp.ones((1, 2)),)
    """).replace("BODY", body)
    )
    _assert_refused(tmp_path, source, "params=0,dropout=1", message)


def test_a_layer_the_factory_wraps_after_construction_is_refused_with_the_reason(tmp_path):
    """LoRA fine-tuning often wraps a built model's layer: `model.q = nnx.LoRA(..., base_module=model.q, ...)`. The
    spec cannot say draws made after __init__; the refusal said only that the Linear was kept nowhere."""
    source = HEADER + textwrap.dedent("""
        class M(nnx.Module):
            def __init__(self, rngs):
                self.q = nnx.Linear(2, 2, rngs=rngs)

            def __call__(self, x):
                return self.q(x)

        def make(rngs):
            model = M(rngs)
            model.q = nnx.LoRA(2, 1, 2, base_module=model.q, rngs=rngs)
            return model, (jnp.ones((1, 2)),)
    """)
    message = "M.q holds a LoRA that M.__init__ did not build (made outside it: the factory replaced"
    _assert_refused(tmp_path, source, "params=0", message)


def test_a_layer_inserted_before_a_renamed_rnn_is_followed_by_its_names(tmp_path):
    """rnn -> encoder with a LayerNorm inserted before it: the count shift hands rnn.cell.ig's key to
    encoder.cell.ii (both one-kernel Linears); that is not a move of ig to ii, but rnn renamed encoder whole."""
    before = write(tmp_path, "before.py", RNN_MODELS)
    after = write(
        tmp_path,
        "after.py",
        RNN_MODELS.replace(
            "self.rnn = nnx.RNN(nnx.LSTMCell(8, 16, rngs=rngs))",
            "self.norm = nnx.LayerNorm(8, rngs=rngs)\n        self.encoder = nnx.RNN(nnx.LSTMCell(8, 16, rngs=rngs))",
        ).replace("x = self.rnn(self.embed(tokens))", "x = self.encoder(self.norm(self.embed(tokens)))"),
    )
    for f, keys in ((before, "before.json"), (after, "after.json")):
        r = invoke("capture", f"{f}:lstm", "--rngs", "params=0,dropout=1", "-o", "/dev/null", "--keys", tmp_path / keys)
        assert r.exit_code == 0, r.stderr
    r = invoke("diff", tmp_path / "before.json", tmp_path / "after.json")
    assert r.exit_code == 1, r.stdout
    # rnn renamed encoder whole: each draw followed to the same name below it (the carry keys of its own stream
    # kept, MOVED; the params, their counts shifted by the LayerNorm, CHANGED), never rnn.cell.ig to encoder.cell.ii
    moved = re.findall(r"MOVED +(\S+) -> (\S+)", r.stdout)
    assert moved and all(a.split("/", 1)[1] == b.split("/", 1)[1] for a, b in moved), moved
    assert "rnn renamed encoder (or rnn removed and encoder added)" in r.stdout
    old = {".".join(c["path"]): c["key"] for c in json.loads((tmp_path / "before.json").read_text())["calls"]}
    new = {".".join(c["path"]): c["key"] for c in json.loads((tmp_path / "after.json").read_text())["calls"]}
    assert old["rnn.cell.ig.kernel"] == new["encoder.cell.ii.kernel"]  # (the coincidence the diff must not explain)
    assert "count shift: head.kernel drew 'params' count 13 before and 15 now" in r.stdout


# modules built without an Rngs (they draw nothing: a positional encoding, a LayerScale, nnx.PReLU()), and a
# submodule's method that calls its layers (self.enc.encode(x), as VAE and CLIP-style code does): both refused
WITHOUT_RNGS = HEADER + textwrap.dedent("""
    class SinusoidalPE(nnx.Module):
        def __init__(self, d):
            self.table = nnx.Variable(jnp.sin(jnp.arange(8.0 * d).reshape(8, d)))

        def __call__(self, x):
            return x + self.table[...][: x.shape[0]]

    class LayerScale(nnx.Module):
        def __init__(self, d):
            self.gamma = nnx.Param(jnp.full((d,), 1e-4))

        def __call__(self, x):
            return x * self.gamma[...]

    class Enc(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.scale = LayerScale(4)

        def encode(self, x):
            return self.scale(self.drop(self.lin(x)))

        def __call__(self, x):
            return self.drop(x)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.pe = SinusoidalPE(4)
            self.act = nnx.PReLU()
            self.enc = Enc(rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)

        def __call__(self, x):
            h = self.enc.encode(self.act(self.pe(x)))
            return self.drop(self.enc(h) + self.enc.encode(h))

    def make_model(rngs):
        return Model(rngs), (jnp.ones((2, 4)),)
""")


def test_modules_built_without_an_rngs_and_a_submodules_method_capture_the_keys_real_nnx_draws(tmp_path):
    f = write(tmp_path, "model.py", WITHOUT_RNGS)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--steps", "2")
    text = spec.read_text()
    assert "name: pe\n      rngs: none\n" in text and "class: PReLU" in text and "call: enc.drop" in text, text
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 2)
    assert_real_nnx_agrees(spec, doc)
    # enc.drop: twice through enc.encode, once through enc's __call__, a step
    assert [c["step"] for c in doc["calls"] if c["path_str"] == "enc/drop" and c["step"]] == [1, 1, 1, 2, 2, 2]
    r = invoke("verify", spec, "--against", f"{f}:make_model")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


# a diffusion model's training step drawing its timesteps and noise from the Rngs the model keeps: in the step
# itself, or in a loss method of the model (under nnx.value_and_grad); both were refused ("draws 2 key(s)
# outside the model's calls")
DIFFUSION = HEADER + textwrap.dedent("""
    import optax

    class Denoiser(nnx.Module):
        def __init__(self, d, *, rngs):
            self.inp = nnx.Linear(d, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.out = nnx.Linear(8, d, rngs=rngs)
            self.rngs = rngs
            self.alphas = jnp.linspace(0.99, 0.01, 10)

        def __call__(self, x, t):
            return self.out(self.drop(nnx.silu(self.inp(x)))) * t[:, None]

        def loss(self, x0):
            t = jax.random.randint(self.rngs.time(), (x0.shape[0],), 0, 10)
            noise = jax.random.normal(self.rngs.noise(), x0.shape)
            a = self.alphas[t][:, None]
            return jnp.mean((self(jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise, t) - noise) ** 2)

    @nnx.jit
    def train_step(model, optimizer, x0):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(x0))(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def step_draws(model, optimizer, x0):
        t = jax.random.randint(model.rngs.time(), (x0.shape[0],), 0, 10)
        noise = jax.random.normal(model.rngs.noise(), x0.shape)
        grads = nnx.grad(lambda m: jnp.mean((m(x0 + noise, t) - noise) ** 2))(model)
        optimizer.update(model, grads)
        model.rngs.noise()  # (one more after the call: the step's own, e.g. for logging a sample)

    def make_model(rngs):
        model = Denoiser(4, rngs=rngs)
        return model, (nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), jnp.ones((2, 4)))
""")


@pytest.mark.parametrize(
    "step, run",
    [
        ("train_step", [{"draw": "time"}, {"draw": "noise"}, "call"] * 3),
        ("step_draws", [{"draw": "time"}, {"draw": "noise"}, "call", {"draw": "noise"}] * 3),
    ],
    ids=["in-a-loss-method", "in-the-step"],
)
def test_a_training_step_drawing_from_the_models_rngs_captures_the_keys_real_nnx_draws(tmp_path, step, run):
    f = write(tmp_path, "diffusion.py", DIFFUSION)
    seeds = {"params": 0, "dropout": 1, "noise": 2, "time": 3}
    rngs = "params=0,dropout=1,noise=2,time=3"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", rngs, "--steps", "3")
    # (a draw after a step's call belongs to the next call's step; the last step's, to the last)
    assert yaml.safe_load(spec.read_text())["run"] == run
    # the step compiled as written (nnx.jit, nnx.value_and_grad) hands out the same keys
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 3, step)
    assert_real_nnx_agrees(spec, doc)
    assert [c["step"] for c in doc["calls"] if c["stream"] == "time"] == [1, 2, 3]
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--rngs", rngs)
    assert r.exit_code == 2 and "draws from the model's Rngs outside its calls" in r.stderr


# a VAE whose encoder keeps the model's Rngs and draws the reparameterisation noise in a method (self.enc.sample(x)
# from the model's call), and whose decoder keeps a fork; the training step draws from both submodules' Rngs
# (model.dec.rngs.noise()). Both were refused ("draws from an Rngs it does not keep", "a submodule's kept Rngs").
VAE = HEADER + textwrap.dedent("""
    import optax

    class Encoder(nnx.Module):
        def __init__(self, rngs):
            self.mu = nnx.Linear(4, 2, rngs=rngs)
            self.logvar = nnx.Linear(4, 2, rngs=rngs)
            self.rngs = rngs

        def __call__(self, x):
            return self.mu(x), self.logvar(x)

        def sample(self, x):
            mu, logvar = self(x)
            return mu + jnp.exp(0.5 * logvar) * jax.random.normal(self.rngs.noise(), mu.shape)

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.out = nnx.Linear(2, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.rngs = rngs

        def __call__(self, z):
            return self.drop(self.out(z))

    class VAE(nnx.Module):
        def __init__(self, rngs):
            self.enc = Encoder(rngs)
            self.dec = Decoder(rngs.fork())

        def __call__(self, x):
            return self.dec(self.enc.sample(x))

    @nnx.jit
    def train_step(model, opt, x):
        def loss(m):
            eps = jax.random.normal(m.dec.rngs.noise(), x.shape)
            return jnp.mean((m(x + eps) - x - jax.random.normal(m.enc.rngs.noise(), x.shape)) ** 2)

        grads = nnx.grad(loss)(model)
        opt.update(model, grads)

    def make_model(rngs):
        model = VAE(rngs)
        return model, (nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), jnp.ones((2, 4)))
""")


def test_draws_from_a_submodules_kept_rngs_capture_the_keys_real_nnx_draws(tmp_path):
    f = write(tmp_path, "vae.py", VAE)
    rngs = "params=0,dropout=1,noise=2"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--step", f"{f}:train_step", "--rngs", rngs, "--steps", "3")
    loaded = yaml.safe_load(spec.read_text())
    dec, enc = ({"draw": {"stream": "noise", "from": m}} for m in ("dec", "enc"))
    # (enc's draw after the call belongs to the next call's step; the last one to the last step)
    assert loaded["run"] == [dec, "call", enc, dec, "call", enc, dec, "call", enc], loaded["run"]
    assert {"draw": {"stream": "noise", "from": "enc"}} in loaded["model"]["call"], loaded["model"]
    # the step compiled as written (nnx.jit, nnx.grad) hands out the same keys
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1, "noise": 2}, 3, "train_step")
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:train_step", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


# a step that trains the model given an Rngs and then evaluates it given none (model.eval(); model(x)): refused
# ("draws differently from one call to the next"), with one Rngs for every training call or one made a step
EVAL_GIVEN_NONE = HEADER + textwrap.dedent("""
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5)
            self.att = nnx.MultiHeadAttention(2, 4, dropout_rate=0.1, decode=False, rngs=rngs)
            self.n = 0

        def __call__(self, x, rngs=None):
            return self.att(self.drop(self.lin(x), rngs=rngs), rngs=rngs)

    def make_model(rngs):
        return M(rngs), (jnp.ones((2, 3, 4)), nnx.Rngs(dropout=7))

    def one_rngs(model, x, rngs):
        model.train()
        model(x, rngs=rngs)
        model.eval()
        model(x)

    def per_step(model, x, rngs):
        model.n += 1
        model.train()
        model(x, rngs=nnx.Rngs(dropout=jax.random.fold_in(jax.random.key(0), model.n)))
        model.eval()
        model(x)
""")


def _fold_in_data(seed: int, n: int) -> list[int]:
    import jax

    return [int(w) for w in jax.random.key_data(jax.random.fold_in(jax.random.key(seed), n))]


@pytest.mark.parametrize(
    "step, call_rngs",
    [
        ("one_rngs", {"dropout": 7}),
        ("per_step", [1, None, 2, None]),
    ],
)
def test_eval_calls_given_no_rngs_beside_training_calls_given_one_capture_the_keys_real_nnx_draws(
    tmp_path, step, call_rngs
):
    f = write(tmp_path, "m.py", EVAL_GIVEN_NONE)
    seeds = {"params": 0, "dropout": 1}
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", "params=0,dropout=1", "--steps", "2"
    )
    loaded = yaml.safe_load(spec.read_text())
    if isinstance(call_rngs, list):
        # the Rngs made for each training step, nnx.Rngs(dropout=jax.random.fold_in(key(0), n)), as key data;
        # the eval steps' calls are given none
        call_rngs = [None if n is None else {"dropout": _fold_in_data(0, n)} for n in call_rngs]
    assert loaded["call_rngs"] == call_rngs and loaded["run"] == [
        "call",
        "eval",
        "call",
        "train",
        "call",
        "eval",
        "call",
    ]
    assert _keys_file_keys(doc) == _real_model_keys(f, seeds, 2, step)
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


# an Rngs made from a stream, nnx.Rngs(dropout=rngs.dropout), takes the stream's key and counts from 0 again:
# capture refused it ("not made ... with integer seeds or concrete keys"); now written as the key's data, and
# collisions sees the keys the model's own stream already handed out
FROM_STREAM = HEADER + textwrap.dedent("""
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, rngs):
            return self.drop(self.lin(x), rngs=rngs)

    def make_model(rngs):
        return M(rngs), (jnp.ones((2, 4)), nnx.Rngs(dropout=rngs.dropout))
""")


def test_an_rngs_made_from_a_stream_captures_the_keys_real_nnx_draws_and_is_a_shared_key(tmp_path):
    f = write(tmp_path, "m.py", FROM_STREAM)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--steps", "2")
    import jax

    # (the stream's key, jax.random.key(1), as data)
    key_1 = [int(w) for w in jax.random.key_data(jax.random.key(1))]
    assert yaml.safe_load(spec.read_text())["call_rngs"] == {"dropout": key_1}
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 2)
    assert_real_nnx_agrees(spec, doc)
    r = invoke("collisions", spec)
    assert r.exit_code == 1 and "FAIL  shared_stream_key" in r.stdout, r.stdout


# a pure jax.jit step, as Flax's "performance" guide writes one: nnx.split outside, nnx.merge inside, the state
# returned and written back with nnx.update (or dropped: every step draws the keys of the first). Refused ("calls M
# outside the model's call ... a copy of it: nnx.split/merge").
PURE_JIT = HEADER + textwrap.dedent("""
    import optax

    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, rngs=None):
            return self.drop(self.lin(x), rngs=rngs)

    @jax.jit
    def _train(graphdef, state, x):
        model, opt = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return nnx.state((model, opt))

    def train_step(model, opt, x):
        graphdef, state = nnx.split((model, opt))
        nnx.update((model, opt), _train(graphdef, state, x))

    @jax.jit
    def _forward(graphdef, state, x):
        model = nnx.merge(graphdef, state)
        return model(x), nnx.state(model)

    def dropped(model, opt, x):
        graphdef, state = nnx.split(model)
        y, _ = _forward(graphdef, state, x)  # (the state returned is dropped: the counts roll back)

    @jax.jit
    def _whole(pair, x):
        model, _ = pair
        return model(x)

    def whole_dropped(model, opt, x):
        _whole((model, opt), x)  # (the model passed whole, in a tuple: jax.jit's copy draws, the model does not)

    def forward_then_train(model, opt, x):
        graphdef, state = nnx.split(model)
        _forward(graphdef, state, x)  # (dropped: the training pass draws the same masks)
        train_step(model, opt, x)

    @jax.jit
    def _given(graphdef, state, x, rngs):
        model = nnx.merge(graphdef, state)
        return model(x, rngs=rngs), nnx.state(model)

    def rngs_dropped(model, opt, x):
        graphdef, state = nnx.split(model)
        _, state = _given(graphdef, state, x, RNGS)
        nnx.update(model, state)

    RNGS = nnx.Rngs(dropout=7)  # (made once, passed into the jitted function at every step)

    def lowered(model, opt, x):
        graphdef, state = nnx.split(model)
        assert callable(_forward.lower) and callable(_forward.eval_shape)  # (the jitted function's own methods)
        nnx.update(model, _forward(graphdef, state, x)[1])

    def make_model(rngs):
        model = M(rngs)
        return model, (nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), jnp.ones((2, 4)))
""")


@pytest.mark.parametrize(
    "step, run",
    [("train_step", None), ("dropped", [{"stale_call": 3}]), ("whole_dropped", [{"stale_call": 3}]), ("lowered", None)],
)
def test_a_pure_jax_jit_step_captures_the_keys_real_nnx_draws(tmp_path, step, run):
    f = write(tmp_path, "m.py", PURE_JIT)
    rngs = "params=0,dropout=1"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", rngs, "--steps", "3")
    loaded = yaml.safe_load(spec.read_text())
    assert loaded.get("run") == run and loaded.get("steps") == (3 if run is None else None), loaded
    # the step compiled as written (jax.jit over nnx.merge) hands out the same keys
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1}, 3, step)
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:{step}", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    counts = [c["count"] for c in doc["calls"] if c["stream"] == "dropout" and c["step"]]
    assert counts == ([0, 1, 2] if run is None else [0, 0, 0])
    r = invoke("collisions", spec)
    assert r.exit_code == (0 if run is None else 1), r.stdout
    if run is not None:
        assert "FAIL  count_rewind" in r.stdout and "nnx.update(model, state)" in r.stdout


@pytest.mark.parametrize(
    "step, message",
    [
        ("forward_then_train", "step 1 calls the model 2 times in a jitted function whose state is not written back"),
        ("rngs_dropped", "step 1 passes an nnx.Rngs into a jax.jit function and does not write its state back"),
    ],
)
def test_a_pure_jax_jit_step_a_spec_cannot_say_is_refused_with_the_reason(tmp_path, step, message):
    """(both were refused with an untrue guess: "keys drawn in the factory outside the model's construction?")"""
    _assert_step_refused(tmp_path, PURE_JIT, step, message)


def test_a_stream_the_calls_rngs_lacks_is_a_warning_about_that_rngs(tmp_path):
    """The fallback warning named the Rngs the model is built from for draws from the Rngs given to its calls."""
    f = write(
        tmp_path,
        "m.py",
        CALL_RNGS + "\ndef default_only(rngs):\n    return Model(rngs), (jnp.ones((2, 4)), nnx.Rngs(3))\n",
    )
    r = invoke("capture", f"{f}:default_only", "--rngs", "params=0,dropout=1", "-o", tmp_path / "o.yaml")
    assert r.exit_code == 0, r.stderr
    assert r.stderr.startswith("warning: stream 'dropout' is served by 'default' at 2 draw(s) (first: drop)")
    assert "no 'dropout' in the nnx.Rngs given to the model's calls" in r.stderr, r.stderr


GIVEN_KEYS = HEADER + textwrap.dedent("""
    class PE(nnx.Module):
        def __init__(self):
            self.drop = nnx.Dropout(0.1)

        def __call__(self, x, key=None):
            return self.drop(x, rngs=key)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.kd = nnx.Dropout(0.1)
            self.pe = PE()
            self.calls = 0

        def __call__(self, x):
            x = self.kd(self.lin(x), rngs=jax.random.key(11))  # the same key at every call: the same mask
            return self.pe(x, key=jax.random.key(12))

    class PerStep(Model):
        def __call__(self, x):
            self.calls += 1  # (a key folded with the step: another mask every call)
            return self.kd(self.lin(x), rngs=jax.random.fold_in(jax.random.key(11), self.calls))

    def make_model(rngs):
        return Model(rngs), (jnp.ones((3, 4)),)

    def per_step(rngs):
        return PerStep(rngs), (jnp.ones((3, 4)),)
""")


def test_a_dropout_given_the_same_key_at_every_call_is_captured_and_is_a_keyless_dropout(tmp_path):
    """capture wrote no call for a Dropout given a key (drop(x, rngs=key)), so collisions could not see the
    same mask drawn at every step; the key is written where every call gives the same one."""
    f = write(tmp_path, "m.py", GIVEN_KEYS)
    spec, _ = capture(tmp_path, f"{f}:make_model", "--steps", "2")
    text = spec.read_text()
    assert "name: kd\n      key: [0, 11]\n" in text and "name: drop\n          key: [0, 12]\n" in text, text
    r = invoke("collisions", spec)
    assert r.exit_code == 1 and r.stdout.count("FAIL  keyless_dropout: 2 draws get the key") == 2, r.stdout
    r = invoke("verify", spec, "--against", f"{f}:make_model")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    # a key that differs from call to call: not written (a spec's call has one key), and nothing found
    (tmp_path / "p").mkdir()
    spec, _ = capture(tmp_path / "p", f"{f}:per_step", "--steps", "2")
    assert "key:" not in spec.read_text() and invoke("collisions", spec).exit_code == 0
    r = invoke("verify", spec, "--against", f"{f}:per_step")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


# modules of yours that draw (or call) in train mode only, as real projects write stochastic depth and a noisy MoE
# router: a DropPath with a `deterministic` attribute that model.train()/eval() set, a router given `train=` by
# its caller, a noise layer called `if train:` and a draw made in eval mode only (`when: eval`)
TRAIN_ONLY = HEADER + textwrap.dedent("""
    class DropPath(nnx.Module):
        def __init__(self, rate, rngs):
            self.rate, self.deterministic, self.rngs = rate, False, rngs

        def __call__(self, x):
            if self.deterministic:
                return x
            keep = jax.random.bernoulli(self.rngs.dropout(), 1 - self.rate, (x.shape[0], 1))
            return jnp.where(keep, x / (1 - self.rate), 0)

    class Noise(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs

        def __call__(self, x):
            return x + jax.random.normal(self.rngs.noise(), x.shape)

    class Router(nnx.Module):
        def __init__(self, d, rngs):
            self.gate = nnx.Linear(d, 4, rngs=rngs)
            self.noise = Noise(rngs)
            self.rngs = rngs

        def __call__(self, x, train: bool = True):
            logits = self.gate(x)
            if train:
                logits = self.noise(logits)
            else:
                logits = logits + 0 * jax.random.normal(self.rngs.noise(), logits.shape)
            return logits

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.fc = nnx.Linear(d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.router = Router(d, rngs)
            self.dp = DropPath(0.2, rngs)

        def __call__(self, x, train=True):
            h = self.drop(self.fc(x), deterministic=not train)
            return x + self.dp(h) + self.router(h, train=train).sum()

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(8, rngs) for _ in range(2)])

        def __call__(self, x, train=True):
            for b in self.blocks:
                x = b(x, train)
            return x

    def make_model(rngs):
        return Model(rngs), (jnp.ones((2, 8)),)

    def train_and_eval(model, x):
        model.train()
        model(x, train=True)
        model.eval()
        model(x, train=False)
""")


def test_draws_and_calls_made_in_train_mode_only(tmp_path):
    f = write(tmp_path, "m.py", TRAIN_ONLY)
    rngs = "params=0,dropout=1,noise=2"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", rngs, "--step", f"{f}:train_and_eval", "--steps", "2")
    loaded = yaml.safe_load(spec.read_text())
    assert loaded["run"] == ["call", "eval", "call", "train", "call", "eval", "call"], loaded["run"]
    block = loaded["model"]["init"][0]["module"]
    calls = {m["module"]["name"]: m["module"].get("call") for m in block["init"] if "module" in m}
    assert calls["dp"] == [{"draw": {"stream": "dropout", "when": "train"}}], calls
    assert calls["router"] == [
        {"call": {"name": "noise", "when": "train"}},
        {"draw": {"stream": "noise", "when": "eval"}},
    ]
    assert _keys_file_keys(doc) == _real_model_keys(f, {"params": 0, "dropout": 1, "noise": 2}, 2, "train_and_eval")
    assert_real_nnx_agrees(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:train_and_eval", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_a_module_keeping_a_fork_of_its_rngs_is_built_from_a_fork(tmp_path):
    """A DropPath that keeps `rngs.fork()` (made first thing in its __init__, as ports of timm write it) was
    refused ("forks its Rngs without giving the fork to a submodule"): it is what `rngs: fork` says."""
    source = TRAIN_ONLY.replace(
        "self.rate, self.deterministic, self.rngs = rate, False, rngs",
        "self.rngs = rngs.fork()\n        self.rate, self.deterministic = rate, False",
    )
    assert source != TRAIN_ONLY
    f = write(tmp_path, "m.py", source)
    rngs = "params=0,dropout=1,noise=2"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", rngs, "--step", f"{f}:train_and_eval", "--steps", "2")
    block = yaml.safe_load(spec.read_text())["model"]["init"][0]["module"]
    dp = next(m["module"] for m in block["init"] if m.get("module", {}).get("name") == "dp")
    assert dp["rngs"] == "fork" and dp["keep_rngs"] is True, dp
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1, "noise": 2}, 2, "train_and_eval")


# modules of yours keeping a fork of one stream, as public ports of timm's DropPath, of attention and of Dropout itself
# write them (they were refused: "draws from an Rngs that neither it nor a module of yours it builds keeps")
KEPT_FORKS = HEADER + textwrap.dedent("""
    class DropPath(nnx.Module):
        def __init__(self, rate, *, rngs):
            self.rate, self.deterministic = rate, False
            self.rng = rngs["dropout"].fork()

        def __call__(self, x):
            if self.deterministic or self.rate == 0.0:
                return x
            keep = jax.random.bernoulli(self.rng(), 1 - self.rate, (x.shape[0], 1))
            return jnp.where(keep, x / (1 - self.rate), 0)

    class MyDropout(nnx.Module):
        def __init__(self, rate, rng_collection="dropout", *, rngs):
            self.rate, self.rng_collection = rate, rng_collection
            self.rngs = rngs[self.rng_collection].fork()

        def __call__(self, x):
            keep = jax.random.bernoulli(self.rngs(), 1 - self.rate, x.shape)
            return jnp.where(keep, x / (1 - self.rate), 0)

    class Attention(nnx.Module):
        def __init__(self, d, rate, *, rngs):
            self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
            self.dropout_rng = rngs.dropout.fork() if rate > 0 else None
            self.noise = MyDropout(0.1, "noise", rngs=rngs)

        def __call__(self, x):
            q, k, v = jnp.split(self.qkv(x), 3, -1)
            w = jax.nn.softmax(q @ k.T)
            if self.dropout_rng is not None:
                w = w * jax.random.bernoulli(self.dropout_rng(), 0.9, w.shape)
            return self.noise(w @ v)

    class Block(nnx.Module):
        def __init__(self, d, rate, *, rngs):
            self.attn = Attention(d, 0.1, rngs=rngs)
            self.path = DropPath(rate, rngs=rngs)
            self.drop = MyDropout(0.2, rngs=rngs)

        def __call__(self, x):
            return x + self.drop(self.path(self.attn(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(8, r, rngs=rngs) for r in (0.0, 0.1, 0.2)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    def make_model(rngs):
        return Model(rngs), (jnp.ones((4, 8)),)

    @nnx.jit
    def train_step(model, x):
        model.train()
        model(x)
        model.eval()
        model(x)

    def step_drawing_outside(model, x):
        model(x)
        model.blocks[1].path.rng()

    class Ensemble(nnx.Module):
        def __init__(self, n, *, rngs):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=0, out_axes=0)
            def create(rngs):
                return Block(8, 0.1, rngs=rngs)

            self.members = create(rngs)

        def __call__(self, x):
            @nnx.vmap(in_axes=(0, None), out_axes=0)
            def fwd(m, x):
                return m(x)

            return fwd(self.members, x)

    def make_ensemble(rngs):
        return Ensemble(2, rngs=rngs), (jnp.ones((4, 8)),)

    def plain_step(model, x):
        model(x)
""")


@pytest.mark.parametrize(
    "factory, step",
    [("make_model", "train_step"), ("make_model", "step_drawing_outside"), ("make_ensemble", "plain_step")],
)
def test_modules_keeping_a_fork_of_one_stream(tmp_path, factory, step):
    """(make_ensemble: the members of an nnx.vmap stack, whose attributes are the stacked streams, not the forks
    their __init__ made: it was refused, "does not keep the fork as an attribute of its own")"""
    f = write(tmp_path, "m.py", KEPT_FORKS)
    seeds = {"params": 0, "dropout": 1, "noise": 2}
    spec, doc = capture(
        tmp_path, f"{f}:{factory}", "--rngs", "params=0,dropout=1,noise=2", "--step", f"{f}:{step}", "--steps", "2"
    )
    text = spec.read_text()
    assert "- fork: {stream: dropout, name: rng}" in text and "- fork: dropout" in text, text
    assert "- fork: {stream: dropout, name: dropout_rng}" in text and "- fork: noise" in text, text
    assert "- draw: {stream: dropout, from: dropout_rng}" in text, text
    if step == "step_drawing_outside":
        assert "draw: {stream: dropout, from: blocks.1.path.rng}" in text, text
    _assert_runs_as_captured(f, spec, doc, seeds, 2, step, factory)


# a training step that reseeds the model's dropout stream before its calls (nnx.reseed, as per-epoch reseeding
# writes it): it was refused ("draws 3 key(s) outside the model's calls"), the keys of reseed's own Rngs
RESEED = HEADER + textwrap.dedent("""
    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.rng = rngs.dropout.fork()

        def __call__(self, x):
            return self.drop(self.fc(x)) * jax.random.uniform(self.rng(), x.shape)

    def make_model(rngs):
        return Noisy(rngs), (jnp.ones((2, 4)),)

    def train_step(model, x):
        nnx.reseed(model, dropout=7)
        model(x)
        model(x)

    def reseed_a_part(model, x):
        nnx.reseed(model.drop, dropout=7)
        model(x)

    def reseed_by_a_policy(model, x):
        nnx.reseed(model, dropout=7, policy=lambda path, key, shape: key)
        model(x)

    def reseed_another(model, x):
        nnx.reseed(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3)), dropout=7)  # (a module outside the model)
        model(x)
""")


def test_a_step_reseeding_the_model(tmp_path):
    f = write(tmp_path, "m.py", RESEED)
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--step", f"{f}:train_step", "--steps", "2"
    )
    run = yaml.safe_load(spec.read_text())["run"]
    assert run == [{"reseed": {"dropout": 7}}, {"call": 2}, {"reseed": {"dropout": 7}}, {"call": 2}], run
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1}, 2, "train_step")
    # the same seed at every step: the second step's keys are the first's (collisions says so, as information)
    r = invoke("collisions", spec)
    assert r.exit_code == 0 and "reseed_repeat" in r.stdout, r.stdout
    # without the step, verify says to give it
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 2 and "reseeds the model between calls (`reseed:`); give --step STEP" in r.stderr, r.stderr
    assert re.match(rf"error: {re.escape(str(spec))}:\d+:\d+: its `run:`", r.stderr), r.stderr  # (at the event)
    # nnx.reseed(model.drop, ...): a reseed of that module only (`module:`)
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--step", f"{f}:reseed_a_part", "--steps", "2"
    )
    run = yaml.safe_load(spec.read_text())["run"]
    assert run[0] == {"reseed": {"streams": {"dropout": 7}, "module": "drop"}}, run
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1}, 2, "reseed_a_part")
    for step, message in [
        ("reseed_by_a_policy", "calls nnx.reseed with policy=<function"),
        ("reseed_another", "calls nnx.reseed of a Dropout, not of the model nor of a module of it"),
    ]:
        out = tmp_path / "part.yaml"
        r = invoke("capture", f"{f}:make_model", "--rngs", "params=0,dropout=1", "--step", f"{f}:{step}", "-o", out)
        assert r.exit_code == 2 and message in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1 and not out.exists()


def test_diff_of_a_refactor_that_inverts_a_mode_test(tmp_path):
    """A DropPath whose `if self.deterministic:` became `if not self.deterministic:` draws the same keys at the
    eval calls: diff said MOVED, exit 0, "what the steps before it draw changed". The keys file records the steps
    made in eval mode, so diff of keys files says it too; a router whose noise call moved to the other branch is
    GONE and NEW, each saying where the other version draws the key."""
    rngs = "params=0,dropout=1,noise=2"
    versions = {
        "old": TRAIN_ONLY,
        "droppath": TRAIN_ONLY.replace("if self.deterministic:\n", "if not self.deterministic:\n"),
        "router": TRAIN_ONLY.replace("if train:\n", "if not train:\n"),
    }
    files = {}
    for name, source in versions.items():
        assert name == "old" or source != TRAIN_ONLY
        (tmp_path / name).mkdir()
        f = write(tmp_path / name, "m.py", source)
        spec, doc = capture(tmp_path / name, f"{f}:make_model", "--rngs", rngs, "--step", f"{f}:train_and_eval")
        assert doc["eval_steps"] == [2], doc.get("eval_steps")
        files[name] = (spec, tmp_path / name / "keys.json")
    for i in (0, 1):  # the specs, then the keys files
        r = invoke("diff", files["old"][i], files["droppath"][i])
        assert r.exit_code == 1 and "MOVED" not in r.stdout, r.stdout
        assert r.stdout.count("CHANGED  blocks/") == 2 and "dropout count 2 (step 1 train -> 2 eval)" in r.stdout
        assert "so the train calls no longer get it" in r.stdout, r.stdout
        r = invoke("diff", files["old"][i], files["router"][i])
        assert r.exit_code == 1, r.stdout
        assert "GONE     blocks/0/router/noise  noise count 0 (step 1)" in r.stdout, r.stdout
        assert "this key is drawn at blocks/0/router now (step 1, train mode)" in r.stdout, r.stdout
        assert "NEW      blocks/0/router  noise count 0 (step 1)" in r.stdout, r.stdout
        assert "the old version drew this key at blocks/0/router/noise (step 1, train mode)" in r.stdout, r.stdout
        assert "the old version drew this key at blocks/0/router (step 2, eval mode)" in r.stdout, r.stdout
    # a keys file whose eval_steps is not a list of steps is refused, with what it must be
    doc = json.loads(files["old"][1].read_text())
    doc["eval_steps"] = ["2"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    r = invoke("diff", bad, files["old"][1])
    assert r.exit_code == 2 and "`eval_steps` must be a list of step numbers" in r.stderr, r.stderr


# a GAN as public NNX code writes it: the generator and the discriminator are two models built from one Rngs, each
# with its optimizer, trained by one jitted step that is given both (it was refused: "calls Discriminator outside the
# model's call (a module of the model called directly ...)", which it is not)
GAN = HEADER + textwrap.dedent("""
    import optax

    class Generator(nnx.Module):
        def __init__(self, latent, dout, *, rngs: nnx.Rngs):
            self.latent = latent
            self.fc1 = nnx.Linear(latent, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.fc2 = nnx.Linear(16, dout, rngs=rngs)
            self.rngs = rngs

        def __call__(self, n):
            z = jax.random.normal(self.rngs.noise(), (n, self.latent))
            return jnp.tanh(self.fc2(self.drop(nnx.relu(self.bn(self.fc1(z))))))

    class Discriminator(nnx.Module):
        def __init__(self, din, *, rngs: nnx.Rngs):
            self.fc1 = nnx.Linear(din, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.fc2 = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.fc2(self.drop(nnx.leaky_relu(self.fc1(x), 0.2)))

    def bce(logits, labels):
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    def d_loss(disc, real, fake):
        a, b = disc(real), disc(fake)
        return bce(a, jnp.ones_like(a)) + bce(b, jnp.zeros_like(b))

    def g_loss(gen, disc, n):
        logits = disc(gen(n))
        return bce(logits, jnp.ones_like(logits))

    @nnx.jit
    def train_step(generator, discriminator, g_opt, d_opt, real):
        fake = jax.lax.stop_gradient(generator(real.shape[0]))
        _, grads = nnx.value_and_grad(d_loss)(discriminator, real, fake)
        d_opt.update(discriminator, grads)
        _, grads = nnx.value_and_grad(g_loss)(generator, discriminator, real.shape[0])
        g_opt.update(generator, grads)

    def make_model(rngs):
        generator = Generator(4, 8, rngs=rngs)
        discriminator = Discriminator(8, rngs=rngs)
        g_opt = nnx.Optimizer(generator, optax.adam(2e-4), wrt=nnx.Param)
        d_opt = nnx.Optimizer(discriminator, optax.adam(2e-4), wrt=nnx.Param)
        return generator, (discriminator, g_opt, d_opt, jnp.ones((4, 8)))

    def other_rngs(rngs):
        generator = Generator(4, 8, rngs=rngs)
        discriminator = Discriminator(8, rngs=nnx.Rngs(params=5, dropout=6))
        return generator, (discriminator, None, None, jnp.ones((4, 8)))

    def step_without_optimizers(generator, discriminator, g_opt, d_opt, real):
        discriminator(generator(4))

    def not_given(rngs):
        global OTHER
        generator = Generator(4, 8, rngs=rngs)
        OTHER = Discriminator(8, rngs=nnx.Rngs(params=5, dropout=6))
        return generator, (None, None, None, jnp.ones((4, 8)))

    def calls_another(generator, discriminator, g_opt, d_opt, real):
        OTHER(generator(4))

    def forked(rngs):
        # each model from its own rngs.fork() (what diff advises: an edit of one leaves the other's keys)
        generator = Generator(4, 8, rngs=rngs.fork())
        discriminator = Discriminator(8, rngs=rngs.fork())
        return generator, (discriminator, None, None, jnp.ones((4, 8)))

    def cloned(rngs):
        generator = Generator(4, 8, rngs=rngs)
        return generator, (nnx.clone(generator), None, None, jnp.ones((4, 8)))

    def ema_step(generator, ema, g_opt, d_opt, real):
        ema(4)

    def ema_update_only(generator, ema, g_opt, d_opt, real):
        # an EMA copy the step only updates (never called): no business of the keys
        generator(4)
        nnx.update(ema, nnx.state(generator, nnx.Param))

    def reseed_one(generator, discriminator, g_opt, d_opt, real):
        nnx.reseed(generator, noise=3)
        discriminator(generator(4))

    def reseed_both(generator, discriminator, g_opt, d_opt, real):
        nnx.reseed(generator, dropout=3)
        nnx.reseed(discriminator, dropout=4)
        discriminator(generator(4))

    def reseed_between(generator, discriminator, g_opt, d_opt, real):
        fake = generator(4)
        nnx.reseed(generator, noise=3)
        discriminator(fake)

    def draw_between(generator, discriminator, g_opt, d_opt, real):
        # the step's own draw from the Rngs the generator keeps, between the models' calls
        fake = generator(4)
        noise = jax.random.normal(generator.rngs.noise(), fake.shape)
        discriminator(fake + noise)

    def distill_step(student, teacher, g_opt, d_opt, real):
        # a teacher in eval mode, its student in train mode, set by the step itself
        teacher.eval()
        student.train()
        teacher(student(4))
""")


def test_two_models_trained_by_one_step_are_captured_as_one_root(tmp_path):
    f = write(tmp_path, "gan.py", GAN)
    rngs = "params=0,dropout=1,noise=2"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", rngs, "--step", f"{f}:train_step", "--steps", "2")
    text = spec.read_text()
    assert "# the model: the 2 models the step is given (generator, discriminator)" in text, text
    model = yaml.safe_load(text)["model"]
    assert [m["module"]["name"] for m in model["init"]] == ["generator", "discriminator"], model
    assert model["call"] == [
        {"call": "generator"},
        {"call": {"name": "discriminator", "repeat": 2}},
        {"call": "generator"},
        {"call": "discriminator"},
    ], model["call"]
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1, "noise": 2}, 2, "train_step")
    # what a spec cannot say is refused, saying what it is
    for factory, step, message in [
        ("other_rngs", "step_without_optimizers", "the step calls a Discriminator it is given besides the model, not"),
        ("not_given", "calls_another", "calls a Discriminator that is neither the model nor a module of it"),
        ("cloned", "ema_step", "whose RNG streams are copies of the model's, at the same keys and counts"),
        ("make_model", "reseed_between", "calls nnx.reseed after it has called or drawn from the models it is given"),
    ]:
        out = tmp_path / f"{factory}.yaml"
        r = invoke("capture", f"{f}:{factory}", "--rngs", rngs, "--step", f"{f}:{step}", "-o", out)
        assert r.exit_code == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        assert not out.exists()
    # the step's own draw from the Rngs a model keeps: a draw of the root's call, where it comes
    part, pdoc = capture(
        mkdir(tmp_path / "draw_between"),
        f"{f}:make_model",
        "--rngs",
        rngs,
        "--step",
        f"{f}:draw_between",
        "--steps",
        "2",
    )
    assert yaml.safe_load(part.read_text())["model"]["call"] == [
        {"call": "generator"},
        {"draw": {"stream": "noise", "from": "generator"}},
        {"call": "discriminator"},
    ]
    _assert_runs_as_captured(f, part, pdoc, {"params": 0, "dropout": 1, "noise": 2}, 2, "draw_between")
    # one of the models reseeded by the step: a reseed of that submodule of the root
    part, pdoc = capture(
        mkdir(tmp_path / "reseed_one"), f"{f}:make_model", "--rngs", rngs, "--step", f"{f}:reseed_one", "--steps", "2"
    )
    assert {"reseed": {"streams": {"noise": 3}, "module": "generator"}} in yaml.safe_load(part.read_text())["run"]
    _assert_runs_as_captured(f, part, pdoc, {"params": 0, "dropout": 1, "noise": 2}, 2, "reseed_one")
    # two of them reseeded before the step calls either (the first reseed's own draws are not the models')
    part, pdoc = capture(
        mkdir(tmp_path / "reseed_both"), f"{f}:make_model", "--rngs", rngs, "--step", f"{f}:reseed_both"
    )
    assert yaml.safe_load(part.read_text())["run"][:2] == [
        {"reseed": {"streams": {"dropout": 3}, "module": "generator"}},
        {"reseed": {"streams": {"dropout": 4}, "module": "discriminator"}},
    ]
    _assert_runs_as_captured(f, part, pdoc, {"params": 0, "dropout": 1, "noise": 2}, 1, "reseed_both")
    # without the step, the factory's models cannot be called as one: the error says to give it
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--rngs", rngs)
    assert r.exit_code == 2 and "the factory returns other models beside it, a Discriminator: give the step" in r.stderr


DQN = HEADER + textwrap.dedent("""
    class QNet(nnx.Module):
        def __init__(self, rngs, rate=0.0):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.drop = nnx.Dropout(rate, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.l1(x))))

    def make_model(rngs):
        # a DQN: the target network a copy of the online one, called by every step
        online = QNet(rngs)
        return online, (nnx.clone(online), jnp.ones((3, 4)))

    def eval_target(rngs):
        online = QNet(rngs, 0.2)
        target = nnx.clone(online)
        target.eval()
        return online, (target, jnp.ones((3, 4)))

    def train_target(rngs):
        online = QNet(rngs, 0.2)
        return online, (nnx.clone(online), jnp.ones((3, 4)))

    @nnx.jit
    def train_step(model, target, x):
        def loss(m):
            q = m(x)
            tq = jax.lax.stop_gradient(target(x))
            return jnp.mean((q - tq.max(-1, keepdims=True)) ** 2)

        nnx.value_and_grad(loss)(model)

    def plain_step(model, target, x):
        model(x)
        target(x)

    def actor_critic(rngs):
        # an actor and a critic trained together, the critic's target network a copy of it (DDPG, SAC)
        actor = QNet(rngs, 0.1)
        critic = QNet(rngs)
        return actor, (critic, nnx.clone(critic), jnp.ones((3, 4)))

    def actor_critic_step(actor, critic, target_critic, x):
        actor(x)
        critic(x)
        target_critic(x)
""")


def test_a_copy_the_step_calls_that_draws_no_key_is_left_out(tmp_path):
    # a DQN's target network (nnx.clone of the model) without dropout, or in eval mode: its calls draw nothing,
    # so the keys are the model's alone; one that draws repeats the model's keys and is refused
    f = write(tmp_path, "dqn.py", DQN)
    seeds = {"params": 0, "dropout": 1}
    for factory, step in [
        ("make_model", "train_step"),
        ("eval_target", "train_step"),
        ("actor_critic", "actor_critic_step"),
    ]:
        spec, doc = capture(
            tmp_path, f"{f}:{factory}", "--rngs", "params=0,dropout=1", "--step", f"{f}:{step}", "--steps", "2"
        )
        model = yaml.safe_load(spec.read_text())["model"]
        if factory == "actor_critic":
            assert [m["module"]["name"] for m in model["init"]] == ["actor", "critic"], model
            assert model["call"] == [{"call": "actor"}, {"call": "critic"}], model["call"]
        else:
            assert model["class"] == "QNet", model
        _assert_runs_as_captured(f, spec, doc, seeds, 2, step, factory)
    out = tmp_path / "refused.yaml"
    r = invoke("capture", f"{f}:train_target", "--rngs", "params=0,dropout=1", "--step", f"{f}:plain_step", "-o", out)
    assert r.exit_code == 2 and "whose RNG streams are copies of the model's" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    "factory, step",
    [("forked", "step_without_optimizers"), ("make_model", "distill_step"), ("cloned", "ema_update_only")],
)
def test_models_forked_from_the_rngs_or_in_their_own_modes(tmp_path, factory, step):
    """Models built from rngs.fork() each (Actor(rngs=rngs.fork())), and a step that sets its teacher to eval mode
    and its student to train mode, were refused ("built from another Rngs", "some layers are deterministic and
    others are not")."""
    f = write(tmp_path, "gan.py", GAN)
    seeds = {"params": 0, "dropout": 1, "noise": 2}
    spec, doc = capture(
        tmp_path, f"{f}:{factory}", "--rngs", "params=0,dropout=1,noise=2", "--step", f"{f}:{step}", "--steps", "2"
    )
    model = yaml.safe_load(spec.read_text())["model"]
    if factory == "forked":
        assert [m["module"].get("rngs") for m in model["init"]] == ["fork", "fork"], model["init"]
    elif factory == "cloned":
        # (the copy, never called, is left out: the model alone; it was refused before the step ran)
        assert model["class"] == "Generator", model
    else:
        # (named as the step names them; the teacher's Dropout, in eval mode at every call, says so itself)
        assert model["call"] == [{"call": "student"}, {"call": "teacher"}], model
        teacher = next(m["module"] for m in model["init"] if m["module"]["name"] == "teacher")
        assert {"Dropout": {"name": "drop", "rate": 0.3, "deterministic": True}} in teacher["init"], teacher
    _assert_runs_as_captured(f, spec, doc, seeds, 2, step, factory)


def test_a_module_called_in_both_modes_in_one_call_is_refused(tmp_path):
    source = TRAIN_ONLY.replace(
        "return x + self.dp(h) + self.router(h, train=train).sum()",
        "return x + self.router(h, train=train).sum() + self.router(h, train=not train).sum()",
    )
    f = write(tmp_path, "m.py", source)
    r = invoke("capture", f"{f}:make_model", "--rngs", "params=0,dropout=1,noise=2", "--step", f"{f}:train_and_eval")
    assert r.exit_code == 2 and "Router.__call__ draws differently" in r.stderr and "when: train" in r.stderr
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "captured.yaml").exists()


# a bridge.ToNNX model trained as the Flax bridge guide does: nnx.value_and_grad under nnx.jit. NNX hands the copy
# the gradient sees its Rngs' streams in sorted order (dropout before params), so the ToNNX draws its stream keys in
# another order than at bridge.lazy_init; each stream counts on its own, so the keys are the same (it was refused,
# "ToNNX.__call__ draws differently from one call to the next")
BRIDGE_GRAD = BRIDGE + textwrap.dedent("""
    @nnx.jit
    def train_step(model, x):
        loss, grads = nnx.value_and_grad(lambda m, x: (m(x) ** 2).mean())(model, x)
        return loss
""")


def test_a_bridge_trained_under_value_and_grad(tmp_path):
    f = write(tmp_path, "m.py", BRIDGE_GRAD)
    rngs = "params=0,dropout=1"
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", rngs, "--step", f"{f}:train_step", "--steps", "3")
    assert_real_nnx_agrees(spec, doc)
    plain, _ = capture(tmp_path, f"{f}:make_model", "--rngs", rngs, "--steps", "3")
    assert invoke("derive", spec, "-f", "json").stdout == invoke("derive", plain, "-f", "json").stdout.replace(
        str(plain), str(spec)
    )
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--step", f"{f}:train_step", "--rngs", rngs)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_verify_says_where_flax_hands_out_a_key_the_spec_replays_elsewhere(tmp_path):
    """A renamed layer: the spec's keys are handed out by Flax under the new name (not "never")."""
    f = write(tmp_path, "mlp.py", MLP)
    spec, _ = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1")
    g = write(tmp_path, "renamed.py", MLP.replace("linear1", "first"))
    r = invoke("verify", spec, "--against", f"{g}:make_model", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "Flax hands it out at first/kernel" in r.stdout and "never hands it out" not in r.stdout, r.stdout


SPLIT_TWO_DROPOUTS = HEADER + textwrap.dedent("""
    class Tower(nnx.Module):
        def __init__(self, *, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.drop2 = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.drop2(self.drop(self.fc(x)))

    class Model(nnx.Module):
        def __init__(self, *, rngs):
            self.tower = Tower(rngs=rngs)

        def __call__(self, x):
            # the Randomness guide's data-parallel dropout: split the dropout streams, vmap over the batch
            @nnx.split_rngs(splits=2, only="dropout")
            @nnx.vmap(in_axes=(nnx.StateAxes({"dropout": 0, ...: None}), 0), out_axes=0)
            def f(tower, xs):
                return tower(xs)

            return f(self.tower, x)

    def make_model(rngs):
        return Model(rngs=rngs), (jnp.ones((2, 3, 4)),)
""")


def test_the_split_of_two_streams_of_one_tag_is_two_sites(tmp_path):
    # nnx.split_rngs draws one key from each Dropout's stream: both were at (tower, dropout, count 0, step 1), so
    # capture's own keys file was refused ("repeats the call site") and verify compared one of the two
    f = write(tmp_path, "m.py", SPLIT_TWO_DROPOUTS)
    spec, doc = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--steps", "2")
    split = sorted(c["path_str"] for c in doc["calls"] if c["kind"] == "split" and c["step"] == 1)
    assert split == ["tower/drop", "tower/drop2"], split
    assert_real_nnx_agrees(spec, doc)
    n = len(doc["calls"])
    keys = tmp_path / "keys.json"
    for against in ((str(keys),), (f"{f}:make_model", "--rngs", "params=0,dropout=1")):
        r = invoke("verify", spec, "--against", *against)
        assert r.exit_code == 0 and f"{n} same, 0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_a_target_file_that_does_not_compile_says_where_and_a_unicode_factory_is_found(tmp_path):
    bad = tmp_path / "syn.py"
    bad.write_text("def make(:\n    pass\n")
    r = invoke("capture", f"{bad}:make")
    assert r.exit_code == 2 and f"raised SyntaxError at {bad}:1:10: invalid syntax" in r.stderr, r.stderr
    nul = tmp_path / "nul.py"
    nul.write_bytes(b"def make():\n    return 1\x00\n")
    r = invoke("capture", f"{nul}:make")
    assert r.exit_code == 2 and "None" not in r.stderr and "null bytes" in r.stderr, r.stderr
    # a factory named in another script (a Python identifier all the same)
    f = write(tmp_path, "m.py", MLP.replace("def make_model(", "def 模型("))
    _, doc = capture(tmp_path, f"{f}:模型", "--rngs", "params=0,dropout=1")
    assert doc["calls"]


STREAM_GIVEN = HEADER + textwrap.dedent("""
    class Model(nnx.Module):
        def __init__(self, *, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5)
            self.drop2 = nnx.Dropout(0.5)
            self.attn = nnx.MultiHeadAttention(
                num_heads=2, in_features=4, dropout_rate=0.5, decode=False, deterministic=False, keep_rngs=False,
                rngs=rngs,
            )
            self.rngs = rngs

        def __call__(self, x, rngs: nnx.Rngs):
            # layers given a stream, not an Rngs: the call's, and the one the model keeps
            y = self.drop(self.fc(x), rngs=rngs.dropout)
            return self.attn(y[:, None, :], rngs=rngs.dropout)

    def make_model(rngs):
        return Model(rngs=rngs), (jnp.ones((2, 4)), nnx.Rngs(dropout=7))

    class Own(Model):
        def __call__(self, x, rngs: nnx.Rngs):
            return self.drop2(self.fc(x), rngs=self.rngs.dropout)

    def own(rngs):
        return Own(rngs=rngs), (jnp.ones((2, 4)), nnx.Rngs(dropout=7))

    class Other(Model):
        def __call__(self, x, rngs: nnx.Rngs):
            return self.drop(x, rngs=self.rngs.params)

    def other(rngs):
        return Other(rngs=rngs), (jnp.ones((2, 4)), nnx.Rngs(dropout=7))
""")


def test_a_layer_given_a_stream_at_its_call_draws_from_it(tmp_path):
    # (a Dropout given rngs=rngs.dropout was read as given a key: "NNX handed out 5 keys and the spec replays 2";
    # an attention layer without rngs of its own given one: an internal error)
    f = write(tmp_path, "m.py", STREAM_GIVEN)
    for factory, drawing in (("make_model", ["attn", "drop"]), ("own", ["drop2"])):
        spec, doc = capture(mkdir(tmp_path / factory), f"{f}:{factory}", "--rngs", "params=0,dropout=1", "--steps", "2")
        assert_real_nnx_agrees(spec, doc)
        assert sorted({c["path_str"] for c in doc["calls"] if c["step"]}) == drawing, doc["calls"]
        r = invoke("verify", spec, "--against", f"{f}:{factory}", "--rngs", "params=0,dropout=1")
        assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr
    # a stream of another name than the layer takes from an Rngs: said, not guessed
    out = tmp_path / "other.yaml"
    r = invoke("capture", f"{f}:other", "--rngs", "params=0,dropout=1", "-o", out)
    assert r.exit_code == 2 and "is given the stream 'params' of an Rngs (rngs=params), not its 'dropout'" in r.stderr
    assert len(r.stderr.splitlines()) == 1 and not out.exists()


def test_a_factory_returning_what_capture_cannot_use_says_what_it_returned(tmp_path):
    f = write(
        tmp_path,
        "m.py",
        MLP
        + textwrap.dedent("""
            def four(rngs):
                return MLP(4, 8, 2, rngs=rngs), (jnp.ones((3, 4)),), {}, 1

            import flax.linen as nn

            def linen():
                return nn.Dense(3), (jnp.ones((1, 2)),)
        """),
    )
    # (it said the factory "returned an NNX model" and should take an Rngs, which it does)
    r = invoke("capture", f"{f}:four", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 2 and "four(rngs) returned a tuple of 4 values; return the module, (module, args)" in r.stderr
    spec, _ = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1")
    # an NNX spec verified against a Linen factory (it said "returned a tuple, not an nnx.Module")
    r = invoke("verify", spec, "--against", f"{f}:linen")
    assert r.exit_code == 2 and "returned a Linen module (Dense), and the spec is an NNX spec" in r.stderr, r.stderr


LIST_RESEED = HEADER + textwrap.dedent("""
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.fc(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs), Block(rngs)])
            self.head = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def make_model(rngs):
        return Model(rngs), (jnp.ones((2, 4)),)

    def reseed_list(model, x):
        nnx.reseed(model.blocks, dropout=7)
        model(x)

    def reseed_item(model, x):
        nnx.reseed(model.blocks[1], dropout=7)
        model(x)
""")


@pytest.mark.parametrize("step, module", [("reseed_list", "blocks"), ("reseed_item", "blocks.1")])
def test_a_reseed_of_an_nnx_list_or_one_of_its_items(tmp_path, step, module):
    # (a reseed of the list was an internal error: `module: blocks` named no attribute of the spec, whose
    # attributes are the items, blocks.0 and blocks.1)
    f = write(tmp_path, "m.py", LIST_RESEED)
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--step", f"{f}:{step}", "--steps", "2"
    )
    assert yaml.safe_load(spec.read_text())["run"][0] == {"reseed": {"streams": {"dropout": 7}, "module": module}}
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1}, 2, step)


TWELVE_BLOCKS = HEADER + textwrap.dedent("""
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(x)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(12)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    def make_model(rngs):
        return Model(rngs), (jnp.ones((2, 4)),)

    def reseed(model, x):
        nnx.reseed(model, dropout=5)
        model(x)
""")


@pytest.mark.parametrize("step", ["reseed"])
def test_a_list_of_twelve_blocks_reseeded_in_index_order(tmp_path, step):
    # (nnx.graph walks blocks.2 before blocks.10; the replay walked the names as text and capture refused: "the NNX
    # spec does not reproduce key 14")
    f = write(tmp_path, "m.py", TWELVE_BLOCKS)
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--step", f"{f}:{step}", "--steps", "2"
    )
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1}, 2, step)


SAMPLE_FROM_MODEL = HEADER + textwrap.dedent("""
    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(20, 10, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.drop(self.linear(x)))

    rng_axes = nnx.StateAxes({'dropout': 0, ...: None})

    # the Randomness guide's "Forking implicit random state" (flax 0.11 and later)
    @nnx.fork_rngs(split={'dropout': 5})
    @nnx.vmap(in_axes=(rng_axes, None), out_axes=0)
    def sample_from_model(model, x):
        return model(x)

    # the same with nnx.split_rngs, as the guide wrote it before (data-parallel dropout of the whole model)
    @nnx.split_rngs(splits=5, only='dropout')
    @nnx.vmap(in_axes=(rng_axes, None), out_axes=0)
    def sample_split(model, x):
        return model(x)

    def make_model(rngs):
        return Model(rngs), (jnp.ones((1, 20)),)

    def fork(model, x):
        return sample_from_model(model, x)

    def split(model, x):
        return sample_split(model, x)

    @nnx.vmap(in_axes=(rng_axes, None), out_axes=0)
    def lanes(model, x):
        return model(x)

    def fork_with(model, x):
        with nnx.fork_rngs(model, split={'dropout': 5}):
            return lanes(model, x)

    def split_with(model, x):
        with nnx.split_rngs(model, splits=5, only='dropout'):
            return lanes(model, x)
""")


@pytest.mark.parametrize("step", ["fork", "split", "fork_with", "split_with"])
def test_a_step_calling_the_model_under_split_or_forked_vmap(tmp_path, step):
    # (the step's split draws were put at the step before and the vmap not seen: "the NNX spec does not reproduce
    # key 1"; nnx.fork_rngs(split=...) was "draws 1 key(s) outside the model's calls")
    f = write(tmp_path, "m.py", SAMPLE_FROM_MODEL)
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--step", f"{f}:{step}", "--steps", "3"
    )
    assert yaml.safe_load(spec.read_text())["run"] == [{"call": {"n": 3, "vmap": 5, "split": ["dropout"]}}]
    lanes = [c for c in doc["calls"] if c["step"] == 2 and c["kind"] != "split"]
    assert len(lanes) == 5 and len({tuple(c["key"]) for c in lanes}) == 5
    _assert_runs_as_captured(f, spec, doc, {"params": 0, "dropout": 1}, 3, step)


def test_verify_of_a_step_under_vmap_without_the_step_says_to_give_it(tmp_path):
    f = write(tmp_path, "m.py", SAMPLE_FROM_MODEL)
    spec, _ = capture(tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1", "--step", f"{f}:fork")
    r = invoke("verify", spec, "--against", f"{f}:make_model", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 2 and "give --step STEP" in r.stderr and "Traceback" not in r.stderr, r.stderr


FORK_RNGS = HEADER + textwrap.dedent("""
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.rngs = rngs

        def __call__(self, x):
            return self.drop(self.lin(x)) + jax.random.normal(self.rngs.noise(), x.shape)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = Block(rngs)
            self.b = Block(rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            with nnx.fork_rngs(self.a, split={'dropout': None}):
                x = self.a(x)
            with nnx.fork_rngs(self.b):
                x = self.b(x)
            return self.drop(x)

    def make_model(rngs):
        return Model(rngs), (jnp.ones((2, 4)),)

    def plain(model, x):
        model(x)

    def forked(model, x):
        with nnx.fork_rngs(model, split={('dropout', 'noise'): None}):
            model(x)

    def restored(model, x):
        backups = nnx.fork_rngs(model, split={'dropout': None})
        model(x)
        nnx.restore_rngs(backups)

    def twice(model, x):
        with nnx.fork_rngs(model):
            model(x)
            model(x)

    def unrestored(model, x):
        nnx.fork_rngs(model, split={'dropout': None})
        model(x)

    def raises(model, x):
        with nnx.fork_rngs(model):
            raise KeyError("a bug of the step")

    def in_scan(model, xs):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def f(model, x):
            with nnx.fork_rngs(model):
                y = model(x)
            return model, y

        f(model, jnp.stack([xs, xs]))

    class Keyed(nnx.Module):
        def __init__(self, rngs):
            self.d = nnx.Dict({k: nnx.Dropout(0.5, rngs=rngs) for k in ("2", "10")})

        def __call__(self, x):
            return self.d["10"](self.d["2"](x))

    def make_keyed(rngs):
        return Keyed(rngs), (jnp.ones((2, 4)),)
""")


@pytest.mark.parametrize(
    "step, run",
    [
        ("plain", None),
        ("forked", [{"call": {"n": 2, "fork_rngs": ["dropout", "noise"]}}]),
        ("restored", [{"call": {"n": 2, "fork_rngs": ["dropout"]}}]),
    ],
)
def test_calls_under_nnx_fork_rngs_in_a_module_and_in_the_step(tmp_path, step, run):
    # (with nnx.fork_rngs(self.a): self.a(x) gave "the NNX spec does not reproduce key 7"; in the step, "draws keys
    # outside the model's calls"; the model's fork and then a's fork the same stream at count 0: one site twice)
    f = write(tmp_path, "m.py", FORK_RNGS)
    seeds = {"params": 0, "dropout": 1, "noise": 2}
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--rngs", "params=0,dropout=1,noise=2", "--step", f"{f}:{step}", "--steps", "2"
    )
    written = yaml.safe_load(spec.read_text())
    assert written.get("run") == run
    assert [c["call"].get("fork_rngs") for c in written["model"]["call"][:2]] == [["dropout"], True]
    _assert_runs_as_captured(f, spec, doc, seeds, 2, step)
    r = invoke("verify", spec, "--against", str(tmp_path / "keys.json"))
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "factory, step, message",
    [
        ("make_model", "twice", "step 1: a Model is called twice under one nnx.fork_rngs"),
        ("make_model", "unrestored", "step 1 leaves nnx.fork_rngs of a Model unrestored"),
        # (the step's own error, not capture's: the fork's exit restores the streams)
        ("make_model", "raises", "(step 1) raises KeyError: 'a bug of the step'"),
        ("make_model", "in_scan", "nnx.fork_rngs of a Model inside the function of nnx.vmap/nnx.scan"),
        # (NNX walks a dict's keys as text, '10' before '2'; a spec's `d.10` is a list's item, walked by index)
        ("make_keyed", None, "Keyed.d is a dict keyed by numbers ('2', '10')"),
    ],
)
def test_forks_and_numbered_dicts_a_spec_cannot_say_are_refused(tmp_path, factory, step, message):
    f = write(tmp_path, "m.py", FORK_RNGS)
    out = tmp_path / "s.yaml"
    args = ("--step", f"{f}:{step}") if step else ()
    r = invoke("capture", f"{f}:{factory}", "--rngs", "params=0,dropout=1,noise=2", *args, "--steps", "2", "-o", out)
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


RECURRENT_DROPOUT_AT_THE_TOP = HEADER + textwrap.dedent("""

class Count(nnx.Variable): pass

class RNNCell(nnx.Module):
  def __init__(self, din, dout, rngs):
    self.linear = nnx.Linear(dout + din, dout, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs, rng_collection='recurrent_dropout')
    self.dout = dout
    self.count = Count(jnp.array(0, jnp.uint32))

  def __call__(self, h, x):
    h = self.drop(h)
    y = nnx.relu(self.linear(jnp.concatenate([h, x], axis=-1)))
    self.count.value += 1
    return y, y

  def initial_state(self, batch_size: int):
    return jnp.zeros((batch_size, self.dout))

def make_model(rngs):
    return RNNCell(8, 16, rngs), (jnp.ones((4, 20, 8)),)

@nnx.jit
def rnn_forward(cell, x):
  h = cell.initial_state(batch_size=x.shape[0])
  state_axes = nnx.StateAxes({'recurrent_dropout': None, ...: nnx.Carry})
  @nnx.scan(in_axes=(state_axes, nnx.Carry, 1), out_axes=(nnx.Carry, 1))
  def unroll(cell, h, x):
    h, y = cell(h, x)
    return h, y
  h, y = unroll(cell, h, x)
  return y
""")


def test_a_step_unrolling_the_model_under_nnx_scan_with_a_broadcast_stream(tmp_path):
    # the Randomness guide's recurrent dropout with the cell as the model and the step's own nnx.scan
    f = write(tmp_path, "m.py", RECURRENT_DROPOUT_AT_THE_TOP)
    seeds = {"params": 0, "recurrent_dropout": 1}
    step = "rnn_forward"
    spec, doc = capture(
        tmp_path, f"{f}:make_model", "--rngs", "params=0,recurrent_dropout=1", "--step", f"{f}:{step}", "--steps", "2"
    )
    assert yaml.safe_load(spec.read_text())["run"] == [
        {"call": {"n": 2, "scan": 20, "broadcast": ["recurrent_dropout"]}}
    ]
    _assert_runs_as_captured(f, spec, doc, seeds, 2, step)
