"""Issue 16's corpus: models written the way public code writes them, captured in init and apply; derive on each
captured spec equals the keys file, verify against the live model exits 0, and a deliberate change to the model
makes verify exit 1 naming the sites it moved.

Hugging Face's Flax BERT and GPT-2 come from `transformers<5` (the test extra), built from small configs (no
download): their modules use setup(), nn.Embed, nn.Dropout with `deterministic`, and attention dropout."""

from __future__ import annotations

import json
import textwrap

import pytest
from support import invoke, write

from refactor.test_capture import assert_replays, capture

RESNET = textwrap.dedent("""
    from functools import partial
    import flax.linen as nn
    import jax.numpy as jnp

    class ResNetBlock(nn.Module):
        filters: int
        strides: tuple = (1, 1)

        @nn.compact
        def __call__(self, x, train: bool = True):
            norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
            residual = x
            y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
            y = nn.relu(norm()(y))
            y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
            y = norm(scale_init=nn.initializers.zeros_init())(y)
            if residual.shape != y.shape:
                residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False, name='conv_proj')(residual)
                residual = norm(name='norm_proj')(residual)
            return nn.relu(residual + y)

    class ResNet(nn.Module):
        stage_sizes: tuple = (1, 1)
        num_classes: int = 10
        width: int = 2
        hidden_head: bool = False

        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.Conv(self.width, (3, 3), use_bias=False, name='conv_init')(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train, name='bn_init')(x))
            for i, size in enumerate(self.stage_sizes):
                for j in range(size):
                    strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                    x = ResNetBlock(self.width * 2 ** i, strides)(x, train)
            x = jnp.mean(x, axis=(1, 2))
            if self.hidden_head:
                x = nn.Dropout(0.1, deterministic=not train)(x)
                x = nn.Dense(8)(x)
            x = nn.Dropout(0.2, deterministic=not train)(x)
            return nn.Dense(self.num_classes)(x)

    def make():
        return ResNet(), (jnp.ones((2, 8, 8, 3)),)

    def wider_head():
        # the deliberate change: a hidden Dropout and Dense before the classifier take the auto-names (and keys)
        # of the old ones: the classifier and its dropout become Dense_1 and Dropout_1, with new keys
        return ResNet(hidden_head=True), (jnp.ones((2, 8, 8, 3)),)
""")

SEQ2SEQ = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp

    class DecoderCell(nn.Module):
        vocab: int = 12
        dropout: float = 0.1

        @nn.compact
        def __call__(self, carry, x):
            carry, y = nn.GRUCell(8)(carry, x)
            y = nn.Dropout(self.dropout, deterministic=False)(y)
            logits = nn.Dense(self.vocab)(y)
            return carry, logits

    class Seq2Seq(nn.Module):
        vocab: int = 12
        dropout: float = 0.1
        split_dropout: bool = True

        @nn.compact
        def __call__(self, src, tgt):
            emb = nn.Embed(self.vocab, 8, name='shared_embedding')
            enc = nn.RNN(nn.GRUCell(8), return_carry=True, name='encoder')
            carry, _ = enc(emb(src))
            carry = nn.Dropout(self.dropout, deterministic=False)(carry)
            Decode = nn.scan(DecoderCell, variable_broadcast='params',
                             split_rngs={'params': False, 'dropout': self.split_dropout}, in_axes=1, out_axes=1)
            _, logits = Decode(self.vocab, self.dropout, name='decoder')(carry, emb(tgt))
            return logits

    def make():
        return Seq2Seq(), (jnp.ones((2, 5), jnp.int32), jnp.ones((2, 4), jnp.int32))

    def dropout_not_split():
        # the deliberate change: the decode loop shares one dropout key across its steps
        return Seq2Seq(split_dropout=False), (jnp.ones((2, 5), jnp.int32), jnp.ones((2, 4), jnp.int32))
""")

HF = textwrap.dedent("""
    import jax.numpy as jnp
    from transformers import BertConfig, GPT2Config
    from transformers.models.bert.modeling_flax_bert import FlaxBertModule
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Module

    # (`deterministic=False` is passed: dropout and attention dropout draw)
    def _bert(layers):
        cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16)
        ids = jnp.ones((1, 8), jnp.int32)
        return FlaxBertModule(cfg, dtype=jnp.float32), (ids, jnp.ones_like(ids), jnp.zeros_like(ids), jnp.arange(8)[None], None, None, None, False, False)

    def _gpt2(layers):
        cfg = GPT2Config(vocab_size=50, n_embd=16, n_layer=layers, n_head=2, n_positions=16)
        ids = jnp.ones((1, 8), jnp.int32)
        return FlaxGPT2Module(cfg, dtype=jnp.float32), (ids, jnp.ones_like(ids), jnp.arange(8)[None], None, None, False)

    def bert():
        return _bert(2)

    def bert_deeper():
        return _bert(3)

    def gpt2():
        return _gpt2(2)

    def gpt2_deeper():
        return _gpt2(3)
""")


@pytest.mark.parametrize(
    "source, factory, changed, rngs, moved",
    [
        (RESNET, "make", "wider_head", "params=0,dropout=1", {"Dropout_1"}),
        (SEQ2SEQ, "make", "dropout_not_split", "params=0,dropout=1", {"decoder/Dropout_0"}),
        (HF, "bert", "bert_deeper", "params=0,dropout=1", "encoder/layer/2/"),
        (HF, "gpt2", "gpt2_deeper", "params=0,dropout=1", "h/2/"),
    ],
    ids=["resnet", "seq2seq", "hf-bert", "hf-gpt2"],
)
@pytest.mark.parametrize("phase", ["init", "apply"])
def test_corpus_model_captures_verifies_and_catches_a_change(tmp_path, source, factory, changed, rngs, moved, phase):
    f = write(tmp_path, "model.py", source)
    spec, doc = capture(tmp_path, f"{f}:{factory}", "--rngs", rngs, "--phase", phase)
    assert_replays(spec, doc)
    n = len(doc["calls"])
    r = invoke("verify", spec, "--against", f"{f}:{factory}", "--rngs", rngs)
    assert r.exit_code == 0 and f"{n} same, 0 differ, 0 missing, 0 extra" in r.output, r.output
    r = invoke("verify", spec, "--against", f"{f}:{changed}", "--rngs", rngs, "--format", "json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.output)
    bad = {"/".join(s["path"]) for s in out["sites"] if s["status"] != "same"}
    assert bad
    if isinstance(moved, set):
        assert moved <= bad, bad
    else:  # a deeper stack: only the new layer's keys are missing from the spec, every old layer's are kept
        assert all(p.startswith(moved) for p in bad), bad
        assert out["summary"]["missing"] > 0 and out["summary"]["differs"] == 0 and out["summary"]["extra"] == 0
