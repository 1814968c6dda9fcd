"""The values a spec's `draw:` takes from a key: the jax.random or jax.nn.initializers call, written once,
traceable under jax.jit (shard-check's devices) and run eagerly on one key's data (derive)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from ..spec.nnx import NnxSpec
    from ..spec.tree import Draw, Spec
    from .keys import KeyData


RBG_IMPLS = ("rbg", "unsafe_rbg")  # bits from XLA's RngBitGenerator
RBG_LANES = (
    "with rbg keys jax.vmap draws every lane's bits from lane 0's key (jax/_src/lax/control_flow/loops.py "
    "_rng_bit_generator_batching_rule): a lane's values are its row of one draw for all lanes, not a draw from "
    "the key shown"
)

UNSAFE_RBG_LANES = (
    "rngaudit does not model unsafe_rbg keys {what} inside a vmap: JAX batches rng_bit_generator from the first "
    "lane's {whose} (jax/_src/lax/control_flow/loops.py _rng_bit_generator_batching_rule), so the other lanes' keys "
    "are not per-lane {op}s; audit the model with `jax: {{prng_impl: rbg}}` (or threefry2x32), or file an issue "
    "with the model"
)


def draw(key, d: Draw):
    """What jax.random (or jax.nn.initializers) draws from the typed key `key` for `d`."""
    import jax
    import jax.numpy as jnp

    p: dict[str, Any] = dict(d.params)
    dtype = jnp.dtype(d.dtype)
    kind, shape = d.kind, d.shape
    if kind == "normal":
        return jax.random.normal(key, shape, dtype)
    if kind == "uniform":
        return jax.random.uniform(key, shape, dtype, p["minval"], p["maxval"])
    if kind == "bernoulli":
        return jax.random.bernoulli(key, p["p"], shape)
    if kind == "randint":
        return jax.random.randint(key, shape, p["minval"], p["maxval"], dtype)
    if kind == "truncated_normal":
        return jax.random.truncated_normal(key, p["lower"], p["upper"], shape, dtype)
    if kind == "variance_scaling":
        return jax.nn.initializers.variance_scaling(
            p["scale"], p["mode"], p["distribution"], in_axis=p["in_axis"], out_axis=p["out_axis"]
        )(key, shape, dtype)
    return getattr(jax.nn.initializers, kind)(in_axis=p["in_axis"], out_axis=p["out_axis"])(key, shape, dtype)


def draw_values(spec: Spec | NnxSpec, key: KeyData, d: Draw) -> np.ndarray:
    """The values drawn for `d` from the key whose data is `key`, eagerly, under the spec's settings."""
    import numpy as np

    return draw_values_lanes(spec, np.asarray(key, dtype=np.uint32), d)


def draw_values_lanes(spec: Spec | NnxSpec, keys: np.ndarray, d: Draw) -> np.ndarray:
    """The values drawn for `d` in every lane of nested vmaps whose keys are `keys` (shape: the lane sizes,
    outermost first, then the key's words; one key, no vmap), as jax.vmap draws them: with rbg keys
    rng_bit_generator's batching rule draws all lanes' bits from the first lane's key, a row each; with threefry
    each lane from its own key."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    f = lambda k: draw(k, d)
    for _ in range(keys.ndim - 1):
        f = jax.vmap(f)
    with jax.threefry_partitionable(spec.threefry_partitionable), jax.default_device(_cpu(jax)):
        typed = jax.random.wrap_key_data(jnp.asarray(keys, jnp.uint32), impl=spec.prng_impl)
        if 0 in d.shape:
            # no values: the empty array jax returns, without letting it lay out the other dimensions (an rbg draw
            # in vmap lanes of shape [10000000, 0] ran out of memory)
            out = jax.eval_shape(f, typed)
            return np.zeros(out.shape, out.dtype)
        return np.asarray(f(typed))


def _cpu(jax):
    """The device values are drawn on: the CPU, where they equal Flax's bit for bit, whatever the default backend.
    On a GPU, draws that XLA compiles into one kernel with other work (inside nn.scan, or a jitted init) differ
    from eager ones in the last bits (an H100, jax 0.11.2: up to 6e-7 in a lecun_normal kernel drawn in
    nn.scan), so no single eager GPU value is Flax's there; keys never differ. None (the default device) where
    JAX_PLATFORMS leaves out the CPU."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None
