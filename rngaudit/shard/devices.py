"""The device side's setting: the devices picked, the mesh over them, how rows are sharded, and the
environment that decides what JAX computes."""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from ..engine.keys import jax_setting
from ..errors import DeviceError, UsageError
from ..usercode import first_line
from .report import Environment
from .request import ShardRequest, mesh_text


def pick_devices(r: ShardRequest) -> list:
    import jax

    if r.devices is not None:
        devices = jax.devices("cpu")  # with --processes: every process's, in process order
        local = jax.local_devices(backend="cpu")
        if len(local) != r.devices:
            raise DeviceError(
                f"--devices {r.devices}: JAX started with {len(local)} CPU device(s) "
                f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}); something configured JAX first"
            )
        return devices
    try:
        return jax.devices(r.platform) if r.platform else jax.devices()
    except RuntimeError as e:
        if r.platform:
            raise DeviceError(
                f"--platform {r.platform}: no {r.platform} devices can be had here ({first_line(e)})"
            ) from None
        raise DeviceError(f"JAX cannot start a backend ({first_line(e)})") from None


def make_mesh(devices: list, axes):
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    names, sizes = zip(*axes) if axes else (("data",), (len(devices),))
    if math.prod(sizes) != len(devices):
        raise UsageError(
            f"--mesh {mesh_text(axes)}: the sizes multiply to {math.prod(sizes)}, but "
            f"{len(devices)} {devices[0].platform} device(s) are here; they must be equal"
        )
    try:
        grid = mesh_utils.create_device_mesh(sizes, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, names)


def environment() -> Environment:
    import platform

    import jax
    import jaxlib

    return Environment(
        jax=jax.__version__,
        jaxlib=getattr(jaxlib, "__version__", "unknown"),
        flax=getattr(sys.modules.get("flax"), "__version__", None),
        python=platform.python_version(),
        prng_impl=str(jax_setting("jax_default_prng_impl")),
        threefry_partitionable=bool(jax_setting("jax_threefry_partitionable")),
        enable_x64=bool(jax_setting("jax_enable_x64")),
        xla_flags=os.environ.get("XLA_FLAGS"),
        jax_platforms=os.environ.get("JAX_PLATFORMS"),
    )


def shard_map():
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def rows_sharding(mesh):
    """Axis 0 split over every mesh axis, so each device holds its own block."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def distinct_blocks(array) -> int:
    """How many distinct pieces of `array` its devices hold (slices are unhashable before Python 3.12)."""
    return len({tuple((i.start, i.stop, i.step) for i in s.index) for s in array.addressable_shards})


def partition_text(spec) -> str:
    def one(p):
        if p is None:
            return "None"
        if isinstance(p, tuple):
            return "(" + ", ".join(repr(a) for a in p) + ("," if len(p) == 1 else "") + ")"
        return repr(p)

    return "P(" + ", ".join(one(p) for p in spec) + ")"


def partition_for(shape: tuple[int, ...], axes) -> tuple:
    """Which mesh axes split which dimension of an output of `shape`: each axis goes to the first dimension
    it divides; an axis that divides none is left replicated. Returns PartitionSpec entries."""
    dims: list[list[str]] = [[] for _ in shape]
    rest = list(shape)
    for name, size in axes:
        if size == 1:
            continue
        for d, r in enumerate(rest):
            if r % size == 0:
                dims[d].append(name)
                rest[d] //= size
                break
    return tuple(None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in dims)
