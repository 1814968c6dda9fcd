"""`rngaudit capture` and `verify`: real Flax models written to tmp_path, captured through the CLI; the
captured spec, run through derive, must reproduce every key Flax handed out."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import yaml
from support import invoke, write

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


def capture(tmp_path, target, *opts, stem="cap"):
    spec, keys = tmp_path / f"{stem}.yaml", tmp_path / f"{stem}.json"
    r = invoke("capture", target, "--keys", keys, "-o", spec, *opts)
    assert r.exit_code == 0, r.output
    return spec, json.loads(keys.read_text())


def derived_keys(spec) -> dict:
    r = invoke("derive", spec, "--format", "json", "--no-values")
    assert r.exit_code == 0, r.output
    return {
        (tuple(c["path"]), c["stream"], c["count"], tuple(c["lane"])): c["key"]
        for c in json.loads(r.output)["calls"]
        if not c["discarded"]
    }


def captured_keys(doc) -> dict:
    return {(tuple(c["path"]), c["stream"], c["count"], tuple(c["lane"])): c["key"] for c in doc["calls"]}


def assert_replays(spec, doc):
    ours, theirs = derived_keys(spec), captured_keys(doc)
    assert theirs and ours == theirs


@pytest.mark.parametrize(
    "factory, rngs, n",
    [("model", "params=0,other=1", 6), ("submodules", "rng_stream=0", 6), ("batch_dense", "params=0", 6)],
)
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


def test_the_keys_of_one_scan_step_reach_the_host_in_one_callback(tmp_path, monkeypatch):
    # a host callback per key per step made capture of a 1,000-layer scan 3x slower than the model's init:
    # the keys drawn in one traced body travel together, one callback per step, and still replay bit-exactly
    import jax

    runs = []
    traced = jax.debug.callback

    def counting(fn, *args, **kw):
        def counted(*xs, **kws):
            runs.append(len(xs))
            return fn(*xs, **kws)

        return traced(counted, *args, **kw)

    monkeypatch.setattr(jax.debug, "callback", counting)
    f = write(tmp_path, "encoder.py", TRANSFORMER)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    per_step = sum(1 for c in doc["calls"] if c["lane"] == [0])
    assert per_step == 17 and len(doc["calls"]) == 3 * per_step
    assert len(runs) == 3  # one per scan step
    assert_replays(spec, doc)


def test_vmap_ensemble(tmp_path):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    assert "vmap:" in spec.read_text()
    lanes = {tuple(c["lane"]) for c in doc["calls"]}
    assert lanes == {(0,), (1,), (2,)}
    assert_replays(spec, doc)


JIT_ROOT = textwrap.dedent("""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Block(nn.Module):
      @nn.jit
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(2)(x)
        return x + jax.random.normal(self.make_rng('dropout'), x.shape)

    def make():
      return Block(), (jnp.ones((1, 2)),)
""")


@pytest.mark.parametrize("phase", ["init", "apply"])
def test_a_jit_method_decorator_on_the_root_is_captured_in_apply_too(tmp_path, phase):
    """Flax keeps the lifted function nn.jit makes at a method's first call: capture's init before apply made it
    without the hooks, so apply's fork went unseen and the spec did not replay (found by the keys-file fuzzer)."""
    f = write(tmp_path, "jit_root.py", JIT_ROOT)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1", "--phase", phase)
    assert "transforms:" in spec.read_text() and "jit:" in spec.read_text()
    assert any(c["kind"] == "jit_fork" for c in doc["calls"])
    assert_replays(spec, doc)


# one jitted class made once and instantiated in a loop: jax.jit's cache reuses the first instance's trace
JIT_CLASS_REUSED = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp

    class FFN(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.Dropout(0.1, deterministic=False)(nn.gelu(nn.Dense(8)(x)))
        return nn.Dense(x.shape[-1])(h)

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.checkpoint(FFN)(name='ffn')(nn.LayerNorm()(x))

    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(4, name='inp')(x)
        JBlock = nn.jit(Block)
        for _ in range(3):
          x = JBlock()(x)
        return nn.Dense(2, name='out')(x)

    def make():
      return Net(), (jnp.ones((2, 5)),)
""")


def _real_linen_keys(path, rngs: dict) -> list:
    """Every key Scope.make_rng returns while the model of `path` (its `make`) runs init in real Flax, jitted
    bodies included (read back by a callback), sorted."""
    import importlib.util

    import jax
    import numpy as np
    from flax.core import scope as flax_scope

    seen: list = []
    original = flax_scope.Scope.make_rng

    def record(data):
        seen.extend(tuple(int(v) for v in row) for row in np.asarray(data).reshape(-1, 2))

    def make_rng(self, name="params"):
        key = original(self, name)
        jax.debug.callback(record, jax.random.key_data(key))
        return key

    loaded = importlib.util.spec_from_file_location(f"real_{id(path)}", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    model, args = module.make()
    flax_scope.Scope.make_rng = make_rng
    try:
        model.init({k: jax.random.key(v) for k, v in rngs.items()}, *args)
        jax.effects_barrier()
    finally:
        flax_scope.Scope.make_rng = original
    return sorted(seen)


def test_a_jitted_class_instantiated_in_a_loop_is_captured(tmp_path):
    """`JBlock = nn.jit(Block)` once, `JBlock()(x)` in a loop: JAX reuses the first instance's trace, so the
    others' draws never ran in Python (capture refused: "ran without tracing its body"). Recording, each call is
    traced afresh; the keys are those real Flax hands out with its cache."""
    f = write(tmp_path, "jit_loop.py", JIT_CLASS_REUSED)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    assert spec.read_text().count("jit:") >= 1
    assert {tuple(c["path"][:1]) for c in doc["calls"]} >= {("JitBlock_0",), ("JitBlock_1",), ("JitBlock_2",)}
    assert_replays(spec, doc)
    assert sorted(tuple(c["key"]) for c in doc["calls"]) == _real_linen_keys(f, {"params": 0, "dropout": 1})


# the jit-decorated Block of JIT_ROOT, now the members of an ensemble
DECORATED_IN_VMAP = JIT_ROOT.split("def make():")[0] + textwrap.dedent("""
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(2)(x)
        Ensemble = nn.vmap(Block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                           in_axes=None, out_axes=0, axis_size=2)
        return Ensemble(name='members')(x)

    def make():
      return Model(), (jnp.ones((1, 2)),)
""")


@pytest.mark.parametrize("phase", ["init", "apply"])
def test_a_method_decorator_inside_a_class_transform_is_captured(tmp_path, phase):
    """nn.vmap of a class whose __call__ is decorated (nn.jit): the decorator is the wrapped class's `transforms:`,
    inside the vmap statement. capture wrote it beside `vmap:` and crashed (found by the keys-file fuzzer)."""
    f = write(tmp_path, "decorated.py", DECORATED_IN_VMAP)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1", "--phase", phase)
    model = yaml.safe_load(spec.read_text())["model"]
    vmap = next(s["vmap"] for s in model["body"] if isinstance(s, dict) and "vmap" in s)
    assert [next(iter(t)) for t in vmap["module"]["transforms"]] == ["jit"], vmap
    assert {tuple(c["lane"]) for c in doc["calls"] if c["path"][:1] == ["members"]} == {(0,), (1,)}
    assert_replays(spec, doc)


MAPPED_WITH_STATE = textwrap.dedent("""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Noise(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + jax.random.normal(self.make_rng('params'), x.shape)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        steps = self.variable('state', 'steps', jnp.zeros, ())
        steps.value += 1
        return nn.map_variables(Noise, 'params', init=True)()(x)

    def make():
      return Model(), (jnp.ones((1, 2)),)
""")


def test_apply_with_a_state_collection_says_it_is_mutable(tmp_path):
    """capture applies with every collection but params mutable (here `state`); with a mutable collection Flax runs
    nn.map_variables(init=True)'s body twice and throws the first run's keys away. The spec says `mutable: [state]`
    so derive runs it the same way; without it the spec did not replay and capture exited 3."""
    f = write(tmp_path, "mapped.py", MAPPED_WITH_STATE)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0", "--phase", "apply")
    assert yaml.safe_load(spec.read_text())["mutable"] == ["state"]
    assert [c["count"] for c in doc["calls"] if c["kind"] == "make_rng"] == [2]  # (count 1: the first run's)
    assert_replays(spec, doc)


SETUP_VARIABLE = textwrap.dedent("""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Block(nn.Module):
      def setup(self):
        # one variable whose initialiser draws two keys
        self.w = self.variable('state', 'w', lambda: jax.random.normal(self.make_rng('params'), (2,))
                               + jax.random.normal(self.make_rng('params'), (2,)))

      def __call__(self, x):
        return x + self.w.value

    def make():
      return Block(), (jnp.ones((1, 2)),)
""")


@pytest.mark.parametrize("collection", ["state", "params"])
def test_a_setup_variable_drawing_two_keys_is_one_variable(tmp_path, collection):
    """Found by the keys-file diff fuzzer: in setup() each key of one variable's initialiser became a `variable`
    statement of its own (of the params collection: a `param` per key), which Flax refuses (NameInUseError), so
    capture wrote no spec (exit 3)."""
    f = write(tmp_path, "setup_variable.py", SETUP_VARIABLE.replace("'state'", f"'{collection}'"))
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0")
    assert spec.read_text().count("name: w") == 1 and "[params, params]" in spec.read_text()
    assert len(doc["calls"]) == 2
    assert_replays(spec, doc)


def test_input_option_and_stdout_spec(tmp_path):
    f = write(tmp_path, "ensemble.py", ENSEMBLE + "\ndef bare():\n  return Ensemble()\n")
    r = invoke("capture", f"{f}:bare", "--input", "f32[2,4]", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("# Captured by rngaudit capture") and "axis_size: 3" in r.output


def test_verify_against_target_and_keys(tmp_path):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    spec, _doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
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
    "import_error": (
        "import no_such_module_xyz\n",
        "make",
        "raised ModuleNotFoundError: No module named 'no_such_module_xyz'",
    ),
    "syntax_error": ("def make(:\n", "make", "SyntaxError"),
    "not_a_module": ("def make():\n  return 42\n", "make", "not a flax.linen Module"),
    "no_factory": (HEADER, "make", "has no 'make'"),
    "init_raises": (
        HEADER
        + textwrap.dedent("""
        class Bad(nn.Module):
          @nn.compact
          def __call__(self, x):
            raise ValueError('boom in init')
        def make():
          return Bad(), (jnp.ones((1,)),)
        """),
        "make",
        "Bad.init raises ValueError: boom in init",
    ),
    "factory_raises": ("def make():\n  raise RuntimeError('no model today')\n", "make", "RuntimeError: no model today"),
    "missing_rng": (
        HEADER
        + textwrap.dedent("""
        class Noisy(nn.Module):
          @nn.compact
          def __call__(self):
            return self.make_rng('noise')
        def make():
          return Noisy()
        """),
        "make",
        "InvalidRngError",
    ),
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["nofile.py:make"], "no such file"),
        (["model.py"], "write FILE.py:FACTORY"),
        (["{f}:make", "--input", "f32(2)"], "write DTYPE[SHAPE]"),
        (["{f}:make", "--rngs", "params"], "write STREAM=SEED"),
        (["{f}:make", "--method", "nope"], "has no method 'nope'"),
    ],
)
def test_bad_options_exit_2(tmp_path, args, message):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    r = invoke("capture", *[a.format(f=f) for a in args])
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_flax_is_a_clear_error(tmp_path, monkeypatch):
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    monkeypatch.setitem(sys.modules, "flax", None)
    r = invoke("capture", f"{f}:make")
    assert r.exit_code == 2 and "pip install 'rngaudit[flax]'" in r.stderr


def test_a_flax_that_fails_to_import_is_not_called_missing(tmp_path, monkeypatch):
    # issue 16: an installed Flax failing to import (an old Flax on a new JAX) was reported as "not installed"
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    fake = tmp_path / "site" / "flax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("from jax.random import no_such_function\n")
    for name in [m for m in sys.modules if m == "flax" or m.startswith("flax.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    r = invoke("capture", f"{f}:make")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "is installed but fails to import (ImportError: cannot import name 'no_such_function'" in r.stderr
    assert "not installed" not in r.stderr


def test_a_flax_release_without_the_hooked_functions_is_named(tmp_path, monkeypatch):
    # issue 16: below Flax 0.10.2 (no flax.core.lift.fold_rngs) capture crashed with an internal error
    import flax
    from flax.core import lift

    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    monkeypatch.delattr(lift, "fold_rngs")
    r = invoke("capture", f"{f}:make")
    assert r.exit_code == 2, r.stderr
    assert r.stderr == (
        f"error: capture supports Flax 0.10.2 and later; Flax {flax.__version__} is installed (it has no "
        "flax.core.lift.fold_rngs): pip install 'flax>=0.10.2'\n"
    )


def _flax_functions() -> dict:
    import flax.linen as nn
    import flax.linen.transforms as linen_transforms
    from flax.core import axes_scan, lift
    from flax.core.scope import Scope

    places = [
        (Scope, "make_rng"),
        (Scope, "param"),
        (Scope, "variable"),
        (nn.Module, "__post_init__"),
        (axes_scan, "scan"),
        (linen_transforms, "fork_rngs"),
    ]
    places += [
        (lift, name)
        for name in (
            "vmap",
            "scan",
            "jit",
            "fold_rngs",
            "checkpoint",
            "remat",
            "map_variables",
            "cond",
            "switch",
            "while_loop",
            "vjp",
            "jvp",
            "custom_vjp",
        )
    ]
    return {f"{getattr(owner, '__name__', owner)}.{attr}": getattr(owner, attr) for owner, attr in places}


@pytest.mark.parametrize("factory, code", [("make", 0), ("nosuch", 2), ("broken", 2)])
def test_flax_is_its_own_again_after_a_capture(tmp_path, factory, code):
    """The hooks are installed for the capture only: afterwards (also after a failed capture) every
    function capture hooks is Flax's own again."""
    before = _flax_functions()
    f = write(tmp_path, "ensemble.py", ENSEMBLE + "\ndef broken():\n  raise RuntimeError('no')\n")
    r = invoke("capture", f"{f}:{factory}", "--rngs", "params=0,dropout=1")
    assert r.exit_code == code, r.stderr
    after = _flax_functions()
    assert {k: v for k, v in after.items() if v is not before[k]} == {}


def test_a_class_transform_made_during_a_capture_still_works_after_it(tmp_path):
    """A class transform made while the hooks were installed keeps the hook: outside a capture it passes
    straight through to Flax."""
    import jax
    import jax.numpy as jnp

    from rngaudit.refactor.capture import observe

    f = write(
        tmp_path, "ensemble.py", ENSEMBLE + "\nSTACK = {}\ndef kept():\n  STACK['m'] = make()\n  return STACK['m']\n"
    )
    observe(f"{f}:kept", rngs="params=0,dropout=1")
    import os
    import re

    model, args = sys.modules["_rngaudit_user_" + re.sub(r"\W", "_", os.path.abspath(f))].STACK["m"]
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, *args)
    assert jax.tree_util.tree_leaves(variables) and isinstance(variables["params"], dict)
    assert model.apply(variables, jnp.ones((2, 4)), rngs={"dropout": jax.random.key(2)}).shape == (3, 2, 1)


SCAN_LAYERS = HEADER + textwrap.dedent("""
    class Block(nn.Module):
      features: int = 4

      @nn.compact
      def __call__(self, x, _):
        x = nn.Dense(self.features)(x)
        return nn.Dropout(0.1, deterministic=False)(x), None

    # a class transform made when this module is imported, by the model's file
    ScanBlocks = nn.scan(
        nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=3
    )
""")

MODEL_OF_LAYERS = HEADER + textwrap.dedent("""
    from layers import ScanBlocks

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = ScanBlocks()(x, None)
        return nn.Dense(2)(x)

    def make():
      return Model(), (jnp.ones((2, 4)),)
""")


@pytest.mark.parametrize("phase", ["init", "apply"])
def test_a_model_whose_class_transforms_are_made_in_another_file_captures(tmp_path, phase):
    """Projects keep their layers in a module of their own: its class transforms are made when the model's file
    imports it, which capture's hooks must see (capture used to import it before installing them, and exited
    3). Two projects with a `layers.py` each, captured in one process: each gets its own."""
    for n, length in ((1, 3), (2, 5)):
        d = tmp_path / f"project{n}"
        d.mkdir()
        write(d, "layers.py", SCAN_LAYERS.replace("length=3", f"length={length}"))
        model = write(d, "model.py", MODEL_OF_LAYERS)
        spec = d / "spec.yaml"
        r = invoke("capture", f"{model}:make", "--rngs", "params=0,dropout=1", "--phase", phase, "-o", spec)
        assert r.exit_code == 0, r.stderr
        assert f"length: {length}" in spec.read_text()
        r = invoke("verify", spec, "--against", f"{model}:make")
        assert r.exit_code == 0 and " 0 differ, 0 missing, 0 extra" in r.stdout, r.stdout + r.stderr


def test_errors_have_the_class_of_their_cause(tmp_path, monkeypatch):
    from rngaudit import errors
    from rngaudit.refactor import capture as capture_module
    from rngaudit.refactor.capture import observe, run_capture

    with pytest.raises(errors.UsageError):
        observe("no-colon-here")
    with pytest.raises(errors.UserCodeError):
        observe(f"{tmp_path / 'nosuch.py'}:make")
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    with pytest.raises(errors.UsageError):
        observe(f"{f}:make", phase="train")
    # a captured spec whose replay disagrees with Flax is a bug of rngaudit's: InternalError (exit code 3)
    monkeypatch.setattr(capture_module, "build_spec", lambda *a, **kw: "rngaudit: 1\nmodel: {class: M}\n")
    with pytest.raises(errors.InternalError) as e:
        run_capture(f"{f}:make", rngs="params=0,dropout=1")
    assert e.value.exit_code == errors.EXIT_INTERNAL and "does not reproduce Flax" in e.value.message


def test_unsupported_transform_is_refused(tmp_path):
    f = write(
        tmp_path,
        "vjp.py",
        HEADER
        + textwrap.dedent("""
        class C(nn.Module):
          @nn.compact
          def __call__(self, x):
            y, _ = nn.vjp(lambda m, x: x * jax.random.normal(m.make_rng('params'), x.shape), self, x)
            return y
        def make():
          return C(), (jnp.ones((1,)),)
        """),
    )
    out = tmp_path / "out.yaml"
    r = invoke("capture", f"{f}:make", "-o", out)
    assert r.exit_code == 2 and "does not describe nn.vjp" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    from rngaudit.errors import UnsupportedError
    from rngaudit.refactor.capture import run_capture

    with pytest.raises(UnsupportedError):
        run_capture(f"{f}:make")


# ---------------------------------------------------------------- nn.cond, nn.switch, nn.while_loop, nn.map_variables
FLOW = HEADER + textwrap.dedent("""
    class Draw(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + jax.random.normal(self.make_rng('noise'), x.shape)

    class CondModel(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(3)(x)
        def t(m, x):
          return Draw()(x) + jax.random.normal(m.make_rng('noise'), x.shape)
        def f(m, x):
          return Draw()(x) - jax.random.normal(m.make_rng('params'), x.shape)   # no 'params' in apply: fallback
        x = nn.cond(x.sum() > 0, t, f, self, x)
        return nn.Dense(3)(x) + jax.random.normal(self.make_rng('noise'), x.shape)

    class SetupCond(nn.Module):
      def setup(self):
        self.a = nn.Dense(3)
        self.b = Draw()

      def t(self, x):
        return self.a(x) + jax.random.normal(self.make_rng('noise'), x.shape)

      def f(self, x):
        return self.b(self.a(x))

      def __call__(self, x, flag):
        return nn.cond(flag, SetupCond.t, SetupCond.f, self, x)

    class SwitchModel(nn.Module):
      @nn.compact
      def __call__(self, x):
        branches = [lambda m, x: x + jax.random.uniform(m.make_rng('noise'), x.shape),
                    lambda m, x: Draw()(x),
                    lambda m, x: Draw(name='named')(x) - jax.random.uniform(m.make_rng('noise'), x.shape)]
        return Draw()(nn.switch(1, branches, self, x))

    class WhileModel(nn.Module):
      split: bool = True
      @nn.compact
      def __call__(self, x):
        def cond_fn(m, c):
          return c[0] + 0 * jax.random.uniform(m.make_rng('noise')) < 3
        def body_fn(m, c):
          i, y = c
          return i + 1, Draw()(y) + jax.random.normal(m.make_rng('noise'), y.shape)
        return nn.while_loop(cond_fn, body_fn, self, (0, x), split_rngs={'noise': self.split})[1]

    class DenseLoop(nn.Module):
      @nn.compact
      def __call__(self, x):
        def body_fn(m, c):
          i, y = c
          return i + 1, nn.Dense(3)(y) + jax.random.normal(m.make_rng('noise'), y.shape)
        if self.is_mutable_collection('params'):   # the pattern of Flax's docs: params made outside the loop
          return body_fn(self, (0, x))[1]
        return nn.while_loop(lambda m, c: c[0] < 2, body_fn, self, (0, x), split_rngs={'noise': True})[1]

    class Inner(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(3)(x)
        return x + jax.random.normal(self.make_rng('noise'), x.shape)

    class MapModel(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.map_variables(Inner, 'params', lambda v: v, lambda v: v, init=True)()(x)
        return nn.map_variables(Inner, 'params', rngs=('params', 'noise'), mutable=True)(name='plain')(x)

    class VmapCond(nn.Module):
      @nn.compact
      def __call__(self, x):
        def body(m, x):   # the predicate is batched: both branches run, lane by lane
          return nn.cond(x.sum() > 0, lambda m, x: Draw()(x), lambda m, x: -Draw()(x), m, x)
        return nn.vmap(body, variable_axes={}, split_rngs={'noise': True})(self, x)

    class Looper(nn.Module):
      @nn.compact
      def __call__(self, n, x):
        return nn.while_loop(lambda m, c: c[0] < n, lambda m, c: (c[0] + 1, c[1] + jax.random.normal(
            m.make_rng('noise'), c[1].shape)), self, (0, x), split_rngs={'noise': True})[1]

    class TwoLoops(nn.Module):
      @nn.compact
      def __call__(self, x):
        loop = Looper()
        return loop(3, loop(2, x))

    X = jnp.ones((1, 3))
    def cond():
      return CondModel(), (X,)
    def setup_cond():
      return SetupCond(), (X, True)
    def switch():
      return SwitchModel(), (X,)
    def while_split():
      return WhileModel(), (X,)
    def while_unsplit():
      return WhileModel(split=False), (X,)
    def dense_loop():
      return DenseLoop(), (X,)
    def map_variables():
      return MapModel(), (X,)
    def vmap_cond():
      return VmapCond(), (jnp.array([[1., 1.], [-1., -1.], [2., 2.]]),)
    def two_loops():
      return TwoLoops(), (X,)

    class Noisy(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(x.shape[-1])(x)
        return x + jax.random.normal(self.make_rng("noise"), x.shape)

    class Refine(nn.Module):
      # a compact child made and called before the loop, then called in its body (a closure)
      @nn.compact
      def __call__(self, x):
        step = Noisy()
        x = step(x)
        def body(mdl, c):
          return step(c[0]), c[1] + 1
        return nn.while_loop(lambda m, c: c[1] < 3, body, self, (x, 0), split_rngs={"noise": True})[0]

    def refine():
      return Refine(), (X,)
""")

FLOW_CASES = {  # factory -> (phases, what the spec must say)
    "cond": (("init", "apply"), "cond:"),
    "setup_cond": (("init", "apply"), "cond:"),
    "switch": (("init", "apply"), "switch:"),
    "while_split": (("init", "apply"), "while_loop:"),
    "while_unsplit": (("init",), "while_loop:"),
    "dense_loop": (("apply",), "while_loop:"),
    "map_variables": (("init", "apply"), "map_variables:"),
    "vmap_cond": (("init",), "cond:"),
}


@pytest.mark.parametrize("factory, phase", [(f, p) for f, (phases, _) in FLOW_CASES.items() for p in phases])
def test_flow_transforms_replay_bit_exactly(tmp_path, factory, phase):
    """Every key real Flax hands out in and around nn.cond/switch/while_loop/map_variables, derived again
    from the captured spec; cond/switch keys of every branch (capture runs the model with each branch)."""
    f = write(tmp_path, "flow.py", FLOW)
    spec, doc = capture(tmp_path, f"{f}:{factory}", "--rngs", "params=0,noise=1", "--phase", phase)
    assert FLOW_CASES[factory][1] in spec.read_text()
    assert_replays(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:{factory}", "--rngs", "params=0,noise=1")
    assert r.exit_code == 0, r.output


def test_cond_captures_the_branch_that_did_not_run(tmp_path):
    f = write(tmp_path, "flow.py", FLOW)
    _, doc = capture(tmp_path, f"{f}:setup_cond", "--rngs", "params=0,noise=1")
    sites = {(c["path_str"], c["stream"], c["count"]): c["context"] for c in doc["calls"]}
    # flag=True runs `t` only; `f`'s keys (b's noise, a's second params) exist only when f runs
    assert sites[("b", "noise", 1)] == ["cond"] and ("a", "params", 3) in sites and ("(root)", "noise", 1) in sites


def test_switch_branches_share_counters(tmp_path):
    f = write(tmp_path, "flow.py", FLOW)
    spec, doc = capture(tmp_path, f"{f}:switch", "--rngs", "params=0,noise=1")
    got = {(c["path_str"], c["count"]) for c in doc["calls"] if c["stream"] == "noise"}
    # branch 0 takes c1 and branch 2 c2 at the root. `Draw()(nn.switch(...))` constructs (and auto-names)
    # its Draw_0 before the switch runs, so branch 1's Draw is Draw_1: the spec names it explicitly
    assert got == {("(root)", 1), ("(root)", 2), ("Draw_1", 1), ("named", 1), ("Draw_0", 1)}
    assert "name: Draw_1" in spec.read_text()


def test_while_loop_lanes_and_iterations(tmp_path):
    f = write(tmp_path, "flow.py", FLOW)
    spec, doc = capture(tmp_path, f"{f}:while_split", "--rngs", "params=0,noise=1")
    assert "iterations: 3" in spec.read_text() and "split_rngs: {noise: true}" in spec.read_text()
    cond_lanes = {c["lane"][0] for c in doc["calls"] if c["path_str"] == "(root)" and c["count"] == 1}
    body_lanes = {c["lane"][0] for c in doc["calls"] if c["path_str"] == "Draw_0"}
    assert cond_lanes == {0, 1, 2, 3} and body_lanes == {0, 1, 2}  # cond runs once more than the body
    assert all(c["context"] == ["while_loop"] for c in doc["calls"])


def test_a_child_made_before_a_while_loop_and_called_in_it(tmp_path):
    """It keeps the scope outside: every iteration draws the same key (split_rngs notwithstanding), which
    collisions reports with why and the fix. capture stopped with an internal error (exit 3): the spec's replay
    had no child Body_0 inside the loop."""
    f = write(tmp_path, "flow.py", FLOW)
    spec, doc = capture(tmp_path, f"{f}:refine", "--rngs", "params=0,noise=1")
    assert_replays(spec, doc)
    loop = {tuple(c["lane"]): c["key"] for c in doc["calls"] if c["stream"] == "noise" and c["lane"]}
    assert set(loop) == {(0,), (1,), (2,)} and len(set(map(tuple, loop.values()))) == 1
    r = invoke("collisions", spec)
    assert r.exit_code == 0 and "Noisy_0 was made before the nn.while_loop" in r.stdout, r.stdout


def test_map_variables_init_run_twice(tmp_path):
    f = write(tmp_path, "flow.py", FLOW)
    _, doc = capture(tmp_path, f"{f}:map_variables", "--rngs", "params=0,noise=1")
    noise = {c["path_str"]: c["count"] for c in doc["calls"] if c["stream"] == "noise"}
    # init=True with a mutable collection: the body runs twice, its make_rng keys come from run 2
    assert noise == {"Map_variablesInner_0": 2, "plain": 1}


def test_a_loop_running_different_counts_is_refused(tmp_path):
    f = write(tmp_path, "flow.py", FLOW)
    out = tmp_path / "out.yaml"
    r = invoke("capture", f"{f}:two_loops", "--rngs", "params=0,noise=1", "-o", out)
    assert r.exit_code == 2 and "ran 2 or 3 times" in r.stderr and "one iteration count" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and not out.exists()


RECURRENT = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp

    class ScanNoLength(nn.Module):
        # issue 16: nn.scan without length= (taken from the inputs), as every nn.RNN has
        @nn.compact
        def __call__(self, xs):
            f = lambda m, c, x: (c, nn.Dense(3)(x))
            return nn.scan(f, variable_broadcast="params", split_rngs={"params": False})(self, 0.0, xs)[1]

    class Cell(nn.Module):
        def initialize(self):
            return 0  # no key, no parameter, no child

        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class KeylessFirst(nn.Module):
        # issue 16: a child whose first call is a key-less method lost the keys of its later __call__
        @nn.compact
        def __call__(self, x):
            c = Cell()
            c.initialize()
            y = c(x)
            c.initialize()
            return c(y[:, :2] if y.shape[1] > 2 else y)

    class LSTMClassifier(nn.Module):
        @nn.compact
        def __call__(self, tokens, train: bool = False):
            x = nn.Embed(20, 4)(tokens)
            x = nn.RNN(nn.LSTMCell(8))(x)
            x = nn.Dropout(0.1, deterministic=not train)(x)
            return nn.Dense(2)(x[:, -1])

    class BiGRU(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(20, 4)(tokens)
            return nn.Bidirectional(nn.RNN(nn.GRUCell(6)), nn.RNN(nn.GRUCell(6)))(x)

    def scan_no_length():
        return ScanNoLength(), (jnp.ones((4, 2)),)

    def keyless_first():
        return KeylessFirst(), (jnp.ones((1, 2)),)

    def lstm():
        return LSTMClassifier(), (jnp.ones((2, 5), jnp.int32),)

    def bigru():
        return BiGRU(), (jnp.ones((2, 5), jnp.int32),)
""")


@pytest.mark.parametrize(
    "factory, n",
    [("scan_no_length", 2), ("keyless_first", 2), ("lstm", 15), ("bigru", 21)],
)
def test_recurrent_models_and_keyless_first_calls_replay_bit_exactly(tmp_path, factory, n):
    f = write(tmp_path, "recurrent.py", RECURRENT)
    spec, doc = capture(tmp_path, f"{f}:{factory}")
    assert len(doc["calls"]) == n
    assert_replays(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:{factory}")
    assert r.exit_code == 0 and f"{n} same, 0 differ, 0 missing, 0 extra" in r.output, r.output


def test_a_failure_inside_rngaudit_is_not_blamed_on_the_model(tmp_path, monkeypatch):
    # issue 16: a hook's own exception was reported as "TARGET ...: T.init raises TypeError", blaming the model
    from rngaudit import errors
    from rngaudit.refactor.capture import observe
    from rngaudit.refactor.recorder import Recorder

    f = write(tmp_path, "recurrent.py", RECURRENT)
    monkeypatch.setattr(Recorder, "make_rng", staticmethod(int))  # raises TypeError inside the hook
    with pytest.raises(errors.InternalError) as e:
        observe(f"{f}:lstm")
    assert e.value.exit_code == errors.EXIT_INTERNAL
    assert "rngaudit failed while recording LSTMClassifier.init (TypeError" in e.value.message
    assert "the model is not at fault" in e.value.message


@pytest.mark.parametrize(
    "signature, call, message",
    [
        ("x, mask", "nn.Dense(2)(x) * mask", "M.__call__() missing 1 required positional argument: 'mask'"),
        (
            "x",
            "nn.scan(Body, variable_axes={'params': 0}, split_rngs={'params': True}, length=2)()(x, x)",
            "Body.__call__() takes 2 positional arguments but 3 were given",
        ),
    ],
    ids=["missing-argument", "scan-body-signature"],
)
def test_a_type_error_of_the_models_own_is_the_models(tmp_path, signature, call, message):
    """A TypeError the model raises where capture's hook calls its method (a forgotten argument, a scan body of the
    wrong signature) is the model's error, exit 2, as Flax raises it: it was called rngaudit's own (exit 3)."""
    source = HEADER + textwrap.dedent(f"""
        class Body(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(3)(x)

        class M(nn.Module):
            @nn.compact
            def __call__(self, {signature}):
                return {call}

        def make():
            return M(), (jnp.ones((1, 3)),)
    """)
    r = invoke("capture", f"{write(tmp_path, 'm.py', source)}:make")
    assert r.exit_code == 2 and "M.init raises TypeError" in r.stderr and message in r.stderr, r.stderr
    assert "not at fault" not in r.stderr


NESTED = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp

    SPLIT = {"params": True, "dropout": True}

    class EncoderBlock(nn.Module):
        # a ViT/BERT-style pre-LN block, called as the body of nn.scan: (carry, _) -> (carry, None)
        heads: int = 2
        dropout: float = 0.1

        @nn.compact
        def __call__(self, x, _=None):
            y = nn.LayerNorm()(x)
            y = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout,
                                                deterministic=False)(y, y)
            x = x + nn.Dropout(self.dropout, deterministic=False)(y)
            y = nn.Dense(8)(nn.LayerNorm()(x))
            x = x + nn.Dropout(self.dropout, deterministic=False)(nn.Dense(x.shape[-1])(nn.gelu(y)))
            return x, None

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.1, deterministic=False)(nn.Dense(4)(x))

    class ScanRematEncoder(nn.Module):
        # issue 16: nn.scan(nn.remat(Block)), the scan-over-layers stack of large Transformers
        layers: int = 3

        @nn.compact
        def __call__(self, x):
            Stack = nn.scan(nn.remat(EncoderBlock), length=self.layers, variable_axes={"params": 0},
                            split_rngs=SPLIT)
            return Stack(name="layers")(x, None)[0]

    class ScanJit(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(nn.jit(EncoderBlock), length=2, variable_axes={"params": 0}, split_rngs=SPLIT)()(x)[0]

    class VmapRematEnsemble(nn.Module):
        @nn.compact
        def __call__(self, x):
            E = nn.vmap(nn.remat(Mlp), in_axes=None, out_axes=0, axis_size=3, variable_axes={"params": 0},
                        split_rngs=SPLIT)
            return E()(x)

    class RematScan(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(nn.scan(EncoderBlock, length=2, variable_axes={"params": 0}, split_rngs=SPLIT))()(x)[0]

    class ScanScan(nn.Module):
        @nn.compact
        def __call__(self, x):
            inner = nn.scan(EncoderBlock, length=2, variable_axes={"params": 0}, split_rngs=SPLIT)
            return nn.scan(inner, length=2, variable_axes={"params": 0}, split_rngs=SPLIT)()(x)[0]

    def make(cls):
        return lambda: (cls(), (jnp.ones((2, 3, 4)),))

    scan_remat = make(ScanRematEncoder)
    scan_jit = make(ScanJit)
    vmap_remat = make(VmapRematEnsemble)
    remat_scan = make(RematScan)
    scan_scan = make(ScanScan)
""")


@pytest.mark.parametrize("phase", ["init", "apply"])
@pytest.mark.parametrize("factory", ["scan_remat", "scan_jit", "vmap_remat", "remat_scan", "scan_scan"])
def test_nested_class_transforms_replay_bit_exactly(tmp_path, factory, phase):
    # issue 16: scan(remat(Block)), vmap(remat), scan(jit), remat(scan) and scan(scan) were refused with
    # "cannot tell how ScanCheckpointBlock wraps Block"
    f = write(tmp_path, "nested.py", NESTED)
    spec, doc = capture(tmp_path, f"{f}:{factory}", "--phase", phase, "--rngs", "params=0,dropout=1")
    assert_replays(spec, doc)
    text = spec.read_text()
    outer, inner = {
        "scan_remat": ("scan", "remat"),
        "scan_jit": ("scan", "jit"),
        "vmap_remat": ("vmap", "remat"),
        "remat_scan": ("remat", "scan"),
        "scan_scan": ("scan", "scan"),
    }[factory]
    assert f"- {outer}:\n      module:\n        {inner}:\n" in text, text
    r = invoke("verify", spec, "--against", f"{f}:{factory}", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 0 and ", 0 differ, 0 missing, 0 extra" in r.output, r.output


STACK = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(nn.Dense(4)(x))
            return x + self.param("b", nn.initializers.zeros, (4,))

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class Stack(nn.Module):
        n: int = 200

        @nn.compact
        def __call__(self, x):
            for _ in range(self.n):
                x = Block()(x)
            return Head()(Head()(x))

    def make():
        return Stack(), (jnp.ones((1, 4)),)

    def make_3000():
        return Stack(3000), (jnp.ones((1, 4)),)
""")


def test_identical_blocks_in_a_row_are_one_statement_with_repeat(tmp_path):
    # issue 16: a captured spec of a 96-layer model was 96 copies of one layer
    f = write(tmp_path, "stack.py", STACK)
    spec, doc = capture(tmp_path, f"{f}:make")
    text = spec.read_text()
    assert text.count("class: Block") == 1 and "repeat: 200" in text and "repeat: 2" in text, text
    assert len(text) < 2000
    assert len(doc["calls"]) == 200 * 5 + 2 * 2
    assert_replays(spec, doc)


@pytest.mark.slow
def test_a_model_of_3000_blocks_captures_and_its_spec_derives_without_raised_limits(tmp_path):
    # issue 16: 3,000 blocks (15k keys) exited 2: "generated spec does not replay (... more than 100000 YAML nodes)"
    f = write(tmp_path, "stack.py", STACK)
    spec, doc = capture(tmp_path, f"{f}:make_3000")
    assert len(doc["calls"]) == 3000 * 5 + 4 and "repeat: 3000" in spec.read_text()
    assert_replays(spec, doc)  # derive with the default limits


def test_verify_names_a_setting_that_differs_from_the_run(tmp_path):
    # issue 16: a live JAX with another threefry_partitionable listed every lane key as different, unexplained
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    spec, _ = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    other = tmp_path / "other.yaml"
    # (a captured spec leaves the flag to its JAX release's default: the spec pins the other value)
    text = spec.read_text()
    assert "threefry_partitionable" not in text
    other.write_text(text.replace("prng_impl: threefry2x32", "prng_impl: threefry2x32, threefry_partitionable: false"))
    r = invoke("verify", other, "--against", f"{f}:make", "--rngs", "params=0,dropout=1", "-f", "json")
    assert r.exit_code == 1
    doc = json.loads(r.output)
    differ = [e for e in doc["sites"] if e["status"] == "differs"]
    assert differ and all(
        "a setting differs between the spec and the run (threefry_partitionable: False -> True)" in e["why"]
        for e in differ
    )
    assert any("jax_threefry_partitionable" in n for n in doc["notes"])


def test_a_stream_that_falls_back_to_params_is_a_warning(tmp_path):
    # issue 16: `capture --phase apply` without a dropout seed recorded a fallback to params without a word
    f = write(tmp_path, "ensemble.py", ENSEMBLE)
    r = invoke("capture", f"{f}:make", "--phase", "apply", "-o", tmp_path / "a.yaml")
    assert r.exit_code == 0
    assert r.stderr.startswith("warning: make_rng('dropout') fell back to stream 'params' at ") and (
        "give it (e.g. --rngs params=0,dropout=1)" in r.stderr
    ), r.stderr
    r = invoke("capture", f"{f}:make", "--phase", "apply", "--rngs", "params=0,dropout=1", "-o", tmp_path / "b.yaml")
    assert r.exit_code == 0 and r.stderr == ""
    # given, but hidden by the ensemble's split_rngs: the warning names that cause, not a missing seed
    hidden = ENSEMBLE.replace("split_rngs={'params': True, 'dropout': True}", "split_rngs={'params': True}")
    assert hidden != ENSEMBLE
    f = write(tmp_path, "hidden.py", hidden)
    r = invoke("capture", f"{f}:make", "--phase", "apply", "--rngs", "params=0,dropout=1", "-o", tmp_path / "c.yaml")
    assert r.exit_code == 0 and "'dropout' is given, but a transform around it hides it" in r.stderr, r.stderr
    assert "no 'dropout' in --rngs" not in r.stderr


ADOPTED = HEADER + textwrap.dedent("""
    class Noise(nn.Module):
        # a layer whose setup() draws: Flax runs it once per instance, at its first call
        def setup(self):
            self.scale = self.param('scale', nn.initializers.normal(), (4,))
            self.offset = jax.random.normal(self.make_rng('noise'), (4,))

        def __call__(self, x):
            return x * self.scale + self.offset

    class Residual(nn.Module):
        # a module holding another in a dataclass field, as public models write residual wrappers
        layer: nn.Module

        def __call__(self, x):
            return x + self.layer(x)

    class Siamese(nn.Module):
        # one tower (an nn.Sequential built in setup, whose layers Flax adopts from its field) applied twice
        def setup(self):
            self.tower = nn.Sequential([nn.Dense(4), Residual(Noise()), Noise()])

        def __call__(self, a, b):
            return self.tower(a) - self.tower(b)

    class Inline(nn.Module):
        # the same tower made inline in a compact method called twice: new instances on each call
        @nn.compact
        def __call__(self, x):
            return nn.Sequential([nn.Dense(4), Residual(Noise())])(x)

    class Twice(nn.Module):
        def setup(self):
            self.inner = Inline()

        def __call__(self, x):
            return self.inner(self.inner(x))

    def siamese():
        return Siamese(), (jnp.ones((1, 4)), jnp.ones((1, 4)))

    def twice():
        return Twice(), (jnp.ones((1, 4)),)
""")


@pytest.mark.parametrize("factory, n", [("siamese", 6), ("twice", 5)])
def test_layers_adopted_from_a_field_replay_bit_exactly(tmp_path, factory, n):
    # issue 18's keys-file fuzzer: nn.Sequential's layers were written as compact children of its body, so a second
    # call of the Sequential ran a layer's setup() again in the replay (a key Flax never handed out)
    f = write(tmp_path, "adopted.py", ADOPTED)
    spec, doc = capture(tmp_path, f"{f}:{factory}", "--rngs", "params=0,noise=1")
    assert len(doc["calls"]) == n
    assert_replays(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:{factory}", "--rngs", "params=0,noise=1")
    assert r.exit_code == 0 and f"{n} same, 0 differ, 0 missing, 0 extra" in r.output, r.output


LAYERS = HEADER + textwrap.dedent("""
    class Dense(nn.Module):
        # a user's own class that happens to be called Dense: written as a module, not as nn.Dense
        features: int

        @nn.compact
        def __call__(self, x):
            w = self.param('w', nn.initializers.lecun_normal(), (x.shape[-1], self.features))
            return x @ w

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8, use_bias=False)(x)
            x = nn.LayerNorm(epsilon=1e-5)(x)
            x = nn.Dropout(0.1)(x, deterministic=False)
            return Dense(4)(x)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3,), padding='CIRCULAR')(x)
            x = nn.Embed(10, 4)(jnp.ones(x.shape[:2], jnp.int32)) + x
            for _ in range(3):
                x = Block()(x)
            return x

    def make():
        return Net(), (jnp.ones((2, 5, 3)),)
""")


def test_standard_layers_are_layer_statements_with_their_hyper_parameters(tmp_path):
    # issue 16: a captured spec keeps the layers' hyper-parameters (those set to other than Flax's default)
    f = write(tmp_path, "layers.py", LAYERS)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    text = spec.read_text()
    for line in (
        "Dense: {features: 8, use_bias: false}",
        "LayerNorm: {epsilon: 1.0e-05}",
        "Dropout: {rate: 0.1, deterministic: false}",
        "Embed: {num_embeddings: 10, features: 4}",
        "padding: CIRCULAR",
        "repeat: 3",
    ):
        assert line in text, text
    assert "class: Dense" in text and "{param: w}" in text  # the user's Dense stays a module
    assert_replays(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:make", "--rngs", "params=0,dropout=1")
    assert r.exit_code == 0 and f"{len(doc['calls'])} same, 0 differ" in r.output, r.output


EAGER_VARIABLE = HEADER + textwrap.dedent("""
    class Block(nn.Module):
      def setup(self):
        self.w = self.variable('state', 'w', lambda k: jax.random.normal(k, (2,)), self.make_rng('params'))

      def __call__(self, x):
        self.make_rng('params')
        self.make_rng('params')
        return x

    def make():
      return Block(), (jnp.ones((2,)),)
""")


def test_a_spec_with_an_eager_variable_diffs_clean_against_its_models_keys_file(tmp_path):
    """`self.variable(col, name, f, self.make_rng(s))` draws its key before the variable exists: Flax (and the keys
    file) sees a plain make_rng there, the spec a `variable` statement. Diff names it alike from both, so the spec
    and its model's keys file differ in nothing (found by the keys-file fuzzer: "2 things with another key")."""
    f = write(tmp_path, "model.py", EAGER_VARIABLE)
    _, _ = capture(tmp_path, f"{f}:make", "--phase", "apply", "--rngs", "params=0")
    spec = write(
        tmp_path,
        "hand.yaml",
        textwrap.dedent("""
        rngaudit: 1
        rngs: {params: 0}
        phase: apply
        mutable: [state]
        model:
          class: Block
          setup:
            - variable: {collection: state, name: w, make_rng: params, eager: true, draw: {normal: [2]}}
          body: [make_rng, make_rng]
        """),
    )
    for pair in ((spec, tmp_path / "cap.json"), (tmp_path / "cap.json", spec)):
        r = invoke("diff", *pair)
        assert r.exit_code == 0, r.output
        assert "3 kept, 0 changed, 0 new, 0 gone" in r.output and "things" not in r.output, r.output


VAE = (
    HEADER
    + """
class VAE(nn.Module):
  def setup(self):
    self.enc = nn.Dense(4)
    self.dec = nn.Dense(4)
    self.drop = nn.Dropout(0.1, deterministic=False)
  def __call__(self, x):
    return self.dec(self.encode(x))
  def encode(self, x):
    h = self.enc(x)
    return self.drop(h + jax.random.normal(self.make_rng('noise'), h.shape))

def make():
  return VAE(), (jnp.ones((2, 4)),)
"""
)


@pytest.mark.parametrize("phase", ["init", "apply"])
def test_the_method_capture_ran_is_recorded_and_verify_runs_it(tmp_path, phase):
    """capture --method encode writes `method: encode` into the spec and the keys file; verify runs that method
    (a spec of encode's keys checked against the model's __call__ found dec's keys missing: a false alarm)."""
    f = write(tmp_path, "vae.py", VAE)
    opts = ("--method", "encode", "--rngs", "params=0,noise=1,dropout=2", "--phase", phase)
    spec, doc = capture(tmp_path, f"{f}:make", *opts)
    assert yaml.safe_load(spec.read_text())["method"] == "encode" and doc["method"] == "encode"
    assert_replays(spec, doc)
    assert not any(c["path"][:1] == ["dec"] for c in doc["calls"])  # (encode never calls dec)
    r = invoke("verify", spec, "--against", f"{f}:make")
    assert r.exit_code == 0 and ", 0 missing, 0 extra" in r.output, r.output
    r = invoke("verify", spec, "--against", tmp_path / "cap.json")
    assert r.exit_code == 0, r.output
    # --method names another method: it wins (__call__ also draws dec's params)
    r = invoke("verify", spec, "--against", f"{f}:make", "--method", "__call__")
    assert r.exit_code == (1 if phase == "init" else 0) and "0 differ" in r.output, r.output
    # __call__, the default, is not written
    plain, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,noise=1,dropout=2", stem="plain")
    assert "method" not in yaml.safe_load(plain.read_text()) and "method" not in doc


@pytest.mark.parametrize(
    "text, message",
    [
        ("method: 3\n", "`method` must be the name of the module method the model runs (e.g. encode), not 3"),
        ("method: 'a b'\n", "not 'a b'"),
        ("flavour: nnx\nmethod: encode\n", "`method:` names the method a Linen model runs"),
    ],
)
def test_a_bad_method_in_a_spec_is_one_error_line(tmp_path, text, message):
    model = "{class: M, init: [{Linear: {name: l}}]}" if "nnx" in text else "{class: M, body: [make_rng]}"
    spec = write(tmp_path, "s.yaml", f"rngaudit: 1\n{text}rngs: {{params: 0}}\nmodel: {model}\n")
    r = invoke("derive", spec)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output
    assert r.output.count("error:") == 1 and f"{spec}:" in r.output


REMAT_SCAN = (
    HEADER
    + """
class Block(nn.Module):
    heads: int = 2
    train: bool = True
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=0.1, deterministic=not self.train)(h)
        x = x + nn.Dropout(0.1, deterministic=not self.train)(h)
        h = nn.Dense(16)(nn.LayerNorm()(x))
        h = nn.Dense(x.shape[-1])(nn.gelu(h))
        return x + nn.Dropout(0.1, deterministic=not self.train)(h)

class GPT(nn.Module):
    lengths: tuple = (2, 2)
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(50, 8)(ids)
        x = nn.Dropout(0.1, deterministic=False)(x)
        x = nn.remat_scan(Block, lengths=self.lengths)(heads=2, name="h")(x)
        return nn.Dense(50)(nn.LayerNorm()(x))

class DenseStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(nn.Dense, lengths=(10, 10))(8, name="dense_stack")(x)

class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(Block, lengths=(3,), variable_broadcast="params",
                             split_rngs={"params": False, "dropout": True})()(x)

def gpt():
    return GPT(), (jnp.ones((2, 5), jnp.int32),)
def gpt3():
    return GPT(lengths=(2, 1, 2)), (jnp.ones((2, 5), jnp.int32),)
def dense_stack():
    return DenseStack(), (jnp.ones((2, 8)),)
def shared():
    return Shared(), (jnp.ones((2, 3, 8)),)

class NBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x))
        return x + jax.random.normal(self.make_rng("noise"), x.shape)

class InVmap(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.vmap(nn.remat_scan(NBlock, lengths=(2, 2)), variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True, "noise": True})()(x)

def invmap():
    return InVmap(), (jnp.ones((3, 2, 4)),)
"""
)


@pytest.mark.parametrize(
    "factory, draws",
    [("gpt", (82, 13)), ("gpt3", (82, 13)), ("dense_stack", (200, 0)), ("shared", (25, 9)), ("invmap", (48, 24))],
)
@pytest.mark.parametrize("phase", ["init", "apply"])
def test_remat_scan_is_captured_as_one_statement(tmp_path, factory, draws, phase):
    """nn.remat_scan (a GPT's blocks with attention and dropout, the Flax docs' 100 Dense, shared params under
    variable_broadcast): Flax runs it as scan of remat of scan...; capture writes one `remat_scan` statement with
    its lengths, whose replay is every key real Flax handed out, and verify finds nothing."""
    f = write(tmp_path, "models.py", REMAT_SCAN)
    spec, doc = capture(tmp_path, f"{f}:{factory}", "--rngs", "params=0,dropout=1", "--phase", phase)
    assert len(doc["calls"]) == draws[phase == "apply"]
    text = spec.read_text()
    assert "remat_scan:" in text and "- scan:" not in text and "transforms:" not in text
    assert (
        "lengths: [2, 1, 2]" if factory == "gpt3" else "lengths: [3]" if factory == "shared" else "lengths: ["
    ) in text
    if doc["calls"]:
        assert_replays(spec, doc)
    r = invoke("verify", spec, "--against", f"{f}:{factory}")
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.output, r.output


SCANNED = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.Dropout(0.1, deterministic=False)(nn.Dense(4)(x)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=3)
            return scan()(x, None)[0]

    def make():
        return Model(), (jnp.ones((1, 4)),)
""")


def test_a_captured_spec_leaves_threefry_partitionable_to_its_jax_release(tmp_path):
    """capture wrote `threefry_partitionable: true` into every spec, and a spec that states the flag pins it: the
    upgrade check `diff --from-jax 0.4.38 --to-jax 0.5.0` then said the release moves no key (a false negative).
    The flag is written only where the model set it against its release's default."""
    f = write(tmp_path, "m.py", SCANNED)
    spec, doc = capture(tmp_path, f"{f}:make", "--rngs", "params=0,dropout=1")
    assert "threefry_partitionable" not in spec.read_text() and "version: " in spec.read_text()
    assert_replays(spec, doc)
    r = invoke("diff", spec, "--from-jax", "0.4.38", "--to-jax", "0.5.0")
    assert r.exit_code == 1 and "0 kept, 9 changed" in r.stdout, r.stdout
    # a spec that pins the flag: nothing moves, and a note says why
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(
        spec.read_text().replace("prng_impl: threefry2x32", "prng_impl: threefry2x32, threefry_partitionable: true")
    )
    r = invoke("diff", pinned, "--from-jax", "0.4.38", "--to-jax", "0.5.0")
    assert r.exit_code == 0 and "9 kept, 0 changed" in r.stdout, r.stdout
    assert "note: OLD sets jax.threefry_partitionable: true (the model sets the flag)" in r.stdout
