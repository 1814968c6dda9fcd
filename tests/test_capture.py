"""`rngaudit capture` and `verify`: real Flax models written to tmp_path, captured through the CLI; the
captured spec, run through derive, must reproduce every key Flax handed out."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from rngaudit.cli import app

HEADER = "import flax.linen as nn\nimport jax\nimport jax.numpy as jnp\n"

GUIDE = HEADER + textwrap.dedent("""
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(2, use_bias=False)(x)
        self.param('model_param', nn.initializers.lecun_normal(), (2, 2))
        self.variable('other_collection', 'model_variable1',
                      lambda: jax.random.normal(self.make_rng('params'), (2,)))
        self.variable('other_collection', 'model_variable2',
                      lambda: jax.random.normal(self.make_rng('other'), (2,)))
        return nn.Dense(2)(x)

    class RNGSubSubModule(nn.Module):
      def __call__(self):
        return self.make_rng('rng_stream'), self.make_rng('rng_stream')

    class RNGSubModule(nn.Module):
      @nn.compact
      def __call__(self):
        self.make_rng('rng_stream'); self.make_rng('rng_stream')
        RNGSubSubModule()()

    class RNGModule(nn.Module):
      @nn.compact
      def __call__(self):
        self.make_rng('rng_stream'); self.make_rng('rng_stream')
        RNGSubModule()()

    def model():
      return Model(), (jnp.ones((1, 2)),)

    def submodules():
      return RNGModule()

    def batch_dense():
      BatchDense = nn.vmap(nn.Dense, in_axes=0, out_axes=0, variable_axes={'params': 0},
                           split_rngs={'params': True})
      return BatchDense(2), (jnp.ones((3, 2)),)
""")

TRANSFORMER = HEADER + textwrap.dedent("""
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, deterministic=False)(y)
        x = x + nn.Dropout(0.1, deterministic=False)(y)
        y = nn.Dense(8)(nn.LayerNorm()(x))
        return x + nn.Dropout(0.1, deterministic=False)(y), None

    class Encoder(nn.Module):
      @nn.compact
      def __call__(self, x):
        Stack = nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                        length=3)
        x, _ = Stack()(x, None)
        return x

    def make():
      return Encoder(), (jnp.ones((2, 4, 8)),)
""")

ENSEMBLE = HEADER + textwrap.dedent("""
    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(4)(x)
        x = nn.Dropout(0.5, deterministic=False)(x)
        return nn.Dense(1)(x)

    class Ensemble(nn.Module):
      @nn.compact
      def __call__(self, x):
        E = nn.vmap(MLP, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                    in_axes=None, out_axes=0, axis_size=3)
        return E()(x)

    def make():
      return Ensemble(), (jnp.ones((2, 4)),)
""")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def capture(tmp_path, target, *opts, stem="cap"):
    spec, keys = tmp_path / f"{stem}.yaml", tmp_path / f"{stem}.json"
    r = invoke("capture", target, "--keys", keys, "-o", spec, *opts)
    assert r.exit_code == 0, r.output
    return spec, json.loads(keys.read_text())


def derived_keys(spec) -> dict:
    r = invoke("derive", spec, "--format", "json", "--no-values")
    assert r.exit_code == 0, r.output
    return {(tuple(c["path"]), c["stream"], c["count"], tuple(c["lane"])): c["key"]
            for c in json.loads(r.output)["calls"] if not c["discarded"]}


def captured_keys(doc) -> dict:
    return {(tuple(c["path"]), c["stream"], c["count"], tuple(c["lane"])): c["key"] for c in doc["calls"]}


def assert_replays(spec, doc):
    ours, theirs = derived_keys(spec), captured_keys(doc)
    assert theirs and ours == theirs


@pytest.mark.parametrize("factory, rngs, n", [
    ("model", "params=0,other=1", 6), ("submodules", "rng_stream=0", 6), ("batch_dense", "params=0", 6)])
def test_guide_models_replay_bit_exactly(tmp_path, factory, rngs, n):
    f = write(tmp_path, "guide_models.py", GUIDE)
    spec, doc = capture(tmp_path, f"{f}:{factory}", "--rngs", rngs)
    assert doc["format"] == "rngaudit.capture" and doc["format_version"] == 1
    assert len(doc["calls"]) == n
    assert_replays(spec, doc)


def test_guide_model_keys_are_the_guides(tmp_path):
    f = write(tmp_path, "guide_models.py", GUIDE)
    _, doc = capture(tmp_path, f"{f}:submodules", "--rngs", "rng_stream=0")
    keys = [c["key"] for c in doc["calls"]]
    # printed in the Flax RNG guide (seeds/000): root c1, RNGSubModule_0 c1, the grand-child c1
    assert keys[0] == [1428664606, 3351135085]
    assert [3858825717, 2323087578] in keys and [234240654, 1028548813] in keys


def test_transformer_block_under_scan(tmp_path):
    f = write(tmp_path, "encoder.py", TRANSFORMER)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    text = spec.read_text()
    assert "scan:" in text and "length: 3" in text and "MultiHeadDotProductAttention" in text
    assert {tuple(c["lane"]) for c in doc["calls"]} == {(0,), (1,), (2,)}
    assert any("Dropout" in c["path_str"] for c in doc["calls"])
    assert_replays(spec, doc)


def test_vmap_ensemble(tmp_path):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    assert "vmap:" in spec.read_text()
    lanes = {tuple(c["lane"]) for c in doc["calls"]}
    assert lanes == {(0,), (1,), (2,)}
    assert_replays(spec, doc)


def test_input_option_and_stdout_spec(tmp_path):
    f = write(tmp_path, "ensemble.py", ENSEMBLE + "\ndef bare():\n  return Ensemble()\n")
    r = invoke("capture", f"{f}:bare", "--input", "f32[2,4]", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("# Captured by rngaudit capture") and "axis_size: 3" in r.output


def test_verify_against_target_and_keys(tmp_path):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    r = invoke("verify", spec, "--against", f"{f}:make")
    assert r.exit_code == 0, r.output
    assert "15 same, 0 differ, 0 missing, 0 extra" in r.output
    r = invoke("verify", spec, "--against", tmp_path / "cap.json", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.output)["summary"]["failing"] is False
    # the model changes: split_rngs for dropout switched off
    g = write(tmp_path, "ensemble2.py", ENSEMBLE.replace("'dropout': True", "'dropout': False"))
    r = invoke("verify", spec, "--against", f"{g}:make", "--format", "json")
    assert r.exit_code == 1
    out = json.loads(r.output)
    bad = {(tuple(s["path"]), s["lane"][0]) for s in out["sites"] if s["status"] != "same"}
    assert bad and all(p[-1] == "Dropout_0" for p, _ in bad)
    assert out["summary"]["differs"] == len(bad)


BAD = {
    "import_error": ("import no_such_module_xyz\n", "make", "cannot import it: ModuleNotFoundError"),
    "syntax_error": ("def make(:\n", "make", "SyntaxError"),
    "not_a_module": ("def make():\n  return 42\n", "make", "not a flax.linen Module"),
    "no_factory": (HEADER, "make", "has no 'make'"),
    "init_raises": (HEADER + textwrap.dedent("""
        class Bad(nn.Module):
          @nn.compact
          def __call__(self, x):
            raise ValueError('boom in init')
        def make():
          return Bad(), (jnp.ones((1,)),)
        """), "make", "Bad.init raises ValueError: boom in init"),
    "factory_raises": ("def make():\n  raise RuntimeError('no model today')\n", "make", "RuntimeError: no model today"),
    "missing_rng": (HEADER + textwrap.dedent("""
        class Noisy(nn.Module):
          @nn.compact
          def __call__(self):
            return self.make_rng('noise')
        def make():
          return Noisy()
        """), "make", "InvalidRngError"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_targets_exit_2_without_traceback(tmp_path, case):
    text, attr, message = BAD[case]
    f = write(tmp_path, f"bad_{case}.py", text)
    out = tmp_path / "out.yaml"
    r = invoke("capture", f"{f}:{attr}", "--rngs", "dropout=0" if case == "missing_rng" else "params=0", "-o", out)
    assert r.exit_code == 2
    assert r.stdout == ""
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["nofile.py:make"], "no such file"),
    (["model.py"], "write FILE.py:FACTORY"),
    (["{f}:make", "--input", "f32(2)"], "write DTYPE[SHAPE]"),
    (["{f}:make", "--rngs", "params"], "write STREAM=SEED"),
    (["{f}:make", "--method", "nope"], "has no method 'nope'"),
])
def test_bad_options_exit_2(tmp_path, args, message):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    r = invoke("capture", *[a.format(f=f) for a in args])
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_flax_is_a_clear_error(tmp_path, monkeypatch):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    monkeypatch.setitem(sys.modules, "flax", None)
    r = invoke("capture", f"{f}:make")
    assert r.exit_code == 2 and "pip install 'rngaudit[flax]'" in r.stderr


def test_unsupported_transform_is_refused(tmp_path):
    f = write(tmp_path, "cond.py", HEADER + textwrap.dedent("""
        class C(nn.Module):
          @nn.compact
          def __call__(self, x):
            return nn.cond(True, lambda m, x: m.make_rng('params'), lambda m, x: m.make_rng('params'), self, x)
        def make():
          return C(), (jnp.ones((1,)),)
        """))
    r = invoke("capture", f"{f}:make")
    assert r.exit_code == 2 and "does not describe nn.cond" in r.stderr and "Traceback" not in r.stderr
