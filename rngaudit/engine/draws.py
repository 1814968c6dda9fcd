"""The values a spec's `draw:` takes from a key: the jax.random or jax.nn.initializers call, written once,
traceable under jax.jit (shard-check's devices) and run eagerly on one key's data (derive)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from ..spec.nnx import NnxSpec
    from ..spec.tree import Draw, Spec
    from .keys import KeyData


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
    import jax
    import jax.numpy as jnp
    import numpy as np

    with jax.threefry_partitionable(spec.threefry_partitionable):
        return np.asarray(draw(jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=spec.prng_impl), d))
