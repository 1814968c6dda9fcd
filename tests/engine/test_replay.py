"""Every number the Flax RNG guide prints that comes from a key, reproduced by `derive` on fixtures/guide."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from support import FIXTURES, REPO

from rngaudit import load_spec, produce_hash
from rngaudit.engine.derive import derive

GUIDE = FIXTURES / "guide"

# Printed in ../shared/seeds/000_8dddc161bbb0d8fb.txt ("Randomness and PRNGs in Flax").
KEY0 = [[1428664606, 3351135085], [3456700291, 3873160899], [2411773124, 4124888837]]
KEY1 = [[3077990774, 2166202870], [3825832496, 2886313970], [791337683, 1373966058]]
SUB = {
    ("RNGModule", 1): [1428664606, 3351135085],
    ("RNGModule", 2): [3456700291, 3873160899],
    ("RNGSubModule_0", 1): [3858825717, 2323087578],
    ("RNGSubModule_0", 2): [601859108, 3782857444],
    ("RNGSubSubModule_0", 1): [234240654, 1028548813],
    ("RNGSubSubModule_0", 2): [3650462303, 2124609379],
    ("RNGSubModule_1", 1): [426957352, 2006350344],
    ("RNGSubModule_1", 2): [4006253729, 4205356731],
}
PARAM_VARIABLE = [
    ("kernel", [[-1.6185919, 0.700908], [-1.3146383, -0.79342234]]),
    ("model_param", [[0.0761425, -1.6157459], [-1.6857724, 0.7126891]]),
    ("model_variable1", [[0.60175574, 0.2553228], [0.27367848, -2.1975214]]),
    ("model_variable2", [[1.6249592, 0.30813068], [1.6613585, 1.0404155]]),
    ("kernel", [[0.0030665, 0.29551846], [0.16670242, -0.78252524]]),
    ("bias", [1.582462, 0.15216611]),
]


def run(name: str, values: bool = True):
    return derive(load_spec(str(GUIDE / name)), values=values)


def keys(report):
    return [list(c.key) for c in report.calls]


def test_make_rng_three_calls_key0_and_key1():
    assert keys(run("make_rng_key0.yaml")) == KEY0
    assert keys(run("make_rng_key1.yaml")) == KEY1


def test_two_streams_do_not_affect_each_other():
    assert keys(run("two_streams.yaml")) == [KEY0[0], KEY1[0], KEY0[1], KEY1[1], KEY0[2], KEY1[2]]


def test_two_streams_with_the_same_seed_hand_out_equal_keys():
    assert keys(run("two_streams_same_seed.yaml")) == [KEY0[0], KEY0[0], KEY0[1], KEY0[1], KEY0[2], KEY0[2]]


def _by_module(report):
    out = {}
    for c in report.calls:
        d = c.derivation
        out[(d.path[-1] if d.path else "RNGModule", d.count)] = list(c.key)
    return out


def test_submodule_keys_hash_path_and_count():
    got = _by_module(run("submodules.yaml"))
    assert got == {k: v for k, v in SUB.items() if k[0] != "RNGSubModule_1"}
    paths = [c.derivation.hash_items for c in run("submodules.yaml").calls]
    assert paths[4] == ("RNGSubModule_0", "RNGSubSubModule_0", 1)


def test_second_instance_of_a_class_is_auto_named_1():
    got = _by_module(run("two_submodules.yaml"))
    assert got == {k: v for k, v in SUB.items() if k[0] != "RNGSubSubModule_0"}


def test_param_and_variable_values():
    report = run("param_variable.yaml")
    assert [c.derivation.label for c in report.calls] == [label for label, _ in PARAM_VARIABLE]
    for c, (_, printed) in zip(report.calls, PARAM_VARIABLE):
        np.testing.assert_allclose(c.values, np.array(printed, dtype=np.float32), rtol=2e-6, atol=2e-7)


def test_bundled_example_is_the_guide_model():
    bundled = REPO / "rngaudit" / "examples" / "guide.yaml"
    assert bundled.read_text() == (GUIDE / "param_variable.yaml").read_text()


def test_produce_hash_concatenation_siblings():
    for items in (("A", "B", "C", 1), ("AB", "C", 1), ("A", "BC", 1), ("ABC", 1)):
        assert produce_hash(items) == 947574064


def test_sharp_edge_same_key_and_value_then_fixed_by_separator():
    same = run("sharp_edge.yaml")
    a, b = same.calls
    assert a.derivation.path != b.derivation.path
    assert a.key == b.key and a.values == b.values
    fixed = run("sharp_edge_separator.yaml")
    a, b = fixed.calls
    assert a.key != b.key


def test_derive_cli_reproduces_guide_keys_in_json():
    out = subprocess.run(
        [sys.executable, "-m", "rngaudit", "derive", str(GUIDE / "make_rng_key0.yaml"), "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(out.stdout)
    assert [c["key"] for c in doc["calls"]] == KEY0
    assert [c["hash_items"] for c in doc["calls"]] == [[1], [2], [3]]


# ---------------------------------------------------------------------------------------------
# The guide's multi-device section prints values from Dense's lecun_normal kernel and from
# normal() draws on split keys. Real Flax 0.12.8 on jax 0.10.2 prints other numbers than the
# guide for those cells (the guide was run on an older JAX), so these fixtures are checked
# against what real Flax gives today, running the guide's own code.
def _guide_jit_and_shard_map():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, add_noise):
            x = nn.Dense(1)(x)
            return jnp.where(add_noise, x + jax.random.normal(self.make_rng("params"), x.shape), x)

    module = Model()
    init_rng, apply_rng = jax.random.split(jax.random.key(0))
    x = jnp.ones((8, 1))
    variables = module.init(init_rng, x, False)
    clean = np.asarray(module.apply(variables, x, False, rngs={"params": apply_rng}))
    noisy = np.asarray(module.apply(variables, x, True, rngs={"params": apply_rng}))
    dev_keys = jax.random.split(apply_rng, 8)
    per_device = [np.asarray(module.apply(variables, x[:1], True, rngs={"params": dev_keys[i]})) for i in range(8)]
    kernel = np.asarray(variables["params"]["Dense_0"]["kernel"])
    return kernel, clean, noisy, per_device


def test_jit_and_shard_map_fixtures_match_real_flax():
    kernel, clean, noisy, per_device = _guide_jit_and_shard_map()
    init = run("jit_init.yaml")
    np.testing.assert_array_equal(init.calls[0].values, kernel)
    np.testing.assert_allclose(clean, np.full((8, 1), kernel[0, 0]), rtol=1e-6)
    noise = run("jit_apply.yaml").calls[0].values
    np.testing.assert_allclose(noisy, clean + noise, rtol=1e-6, atol=1e-6)
    rows = []
    for i in range(8):
        dev = run(f"shard_map_device{i}.yaml").calls[0].values
        np.testing.assert_allclose(per_device[i], clean[:1] + dev, rtol=1e-6, atol=1e-6)
        rows.append(float(dev[0, 0]))
    assert len(set(rows)) == 8  # split keys: every device draws its own noise
