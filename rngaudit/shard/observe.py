"""The randomness a user's step really draws, device by device (the device process of `shard-check --args`).

Every jax.random sampler (normal, uniform, bernoulli — so Flax's nn.Dropout —, randint, permutation, ...) ends in
`jax._src.random.prng.random_bits(keys, bit_width, shape)`. While `observing()` is active that function also
records, through `jax.debug.callback`, the key data each call uses where it runs: once per call outside
shard_map (where jax.jit partitions one random array over the devices), and on each device inside shard_map,
named by its coordinates along the manual mesh axes (`jax.lax.axis_index`). The random bits follow from the
key, the shape and the bit width alone, so equal key data at the same draw means equal randomness. Nothing
else of the computation changes: the callback only reads the key."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import types
from dataclasses import dataclass, field

_RNGAUDIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARIES = tuple(os.sep + p + os.sep for p in ("jax", "jaxlib", "flax", "numpy", "contextlib", "functools"))


@dataclass(frozen=True)
class DrawSite:
    """Where a draw was traced: the user's source line, the sampler, the Flax module it ran in, its shape and
    bit width, and the mesh axes that were manual there (inside shard_map)."""

    file: str | None
    line: int | None
    function: str
    sampler: str
    module: str | None
    shape: tuple[int, ...]
    bit_width: int
    manual_axes: tuple[str, ...]
    split_axes: tuple[str, ...] | None = None  # manual axes that split an input of the mapped function (not a key)

    def as_json(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "sampler": self.sampler,
            "module": self.module,
            "shape": list(self.shape),
            "bit_width": self.bit_width,
            "manual_axes": [str(a) for a in self.manual_axes],
            "split_axes": None if self.split_axes is None else list(self.split_axes),
        }


@dataclass
class Observation:
    """What one process saw: its draw sites and, per run of a draw, (site, coordinates, key words)."""

    process: int
    sites: list[DrawSite] = field(default_factory=list)
    index: dict = field(default_factory=dict)  # DrawSite -> position in `sites`
    records: list = field(default_factory=list)  # (site, ((axis, index), ...), (word, ...))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def site(self, s: DrawSite) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.sites)
            self.sites.append(s)
        return i

    def as_json(self) -> dict:
        return {
            "process": self.process,
            "sites": [s.as_json() for s in self.sites],
            "records": [[site, [list(c) for c in coords], list(words)] for site, coords, words in self.records],
        }


def _library(filename: str) -> bool:
    return filename.startswith((_RNGAUDIT, "<")) or any(p in filename for p in _LIBRARIES)


def _where() -> tuple[str | None, int | None, str, str]:
    """(file, line, function) of the innermost frame of the user's code, and the public jax.random sampler
    that was called (the outermost jax.random function without a leading underscore)."""
    sampler = "random_bits"
    frame: types.FrameType | None = sys._getframe(2)
    user = None
    while frame is not None:
        name = frame.f_code.co_filename
        if os.sep + "random" + os.sep in name and os.sep + "jax" + os.sep in name:
            if not frame.f_code.co_name.startswith("_"):
                sampler = frame.f_code.co_name
        elif user is None and not _library(name):
            user = frame
            break
        frame = frame.f_back
    if user is None:
        return None, None, "?", sampler
    return os.path.abspath(user.f_code.co_filename), user.f_lineno, user.f_code.co_name, sampler


def _flax_module() -> str | None:
    """The path of the Flax Linen module whose method is running ('Encoder/Dropout_0'), if any."""
    mod = sys.modules.get("flax.linen.module")
    ctx = getattr(mod, "_context", None)
    stack = getattr(ctx, "module_stack", None)
    if not stack:
        return None
    top = stack[-1]
    scope = getattr(top, "scope", None)
    path = getattr(scope, "path", None)
    if path is None:
        return None
    return "/".join(str(p) for p in path) or "(root)"


def _manual_axes() -> tuple[str, ...]:
    from jax._src import mesh as mesh_lib

    try:
        am = mesh_lib.get_abstract_mesh()
        return tuple(am.manual_axes) if not am.empty else ()  # (names are strings, or pmap's own name)
    except Exception:  # noqa: BLE001 - a JAX without abstract meshes: nothing is manual
        return ()


_MAPPED: list = []  # while a shard_map (or pmap) body is traced: the axes that split its inputs, None if unknown


def _axis_names(spec) -> list:
    names: list = []
    for entry in spec or ():
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None:
                names.append(name)
    return names


def _split_axes(in_specs, args) -> set | None:
    """The mesh axes that split an argument of a shard_map body that is not a key: its in_specs, or where they
    are inferred, the axes the argument varies along (its `vma`)."""
    import jax
    from jax.sharding import PartitionSpec

    try:
        from jax._src.tree_util import broadcast_prefix

        specs = broadcast_prefix(in_specs, args, is_leaf=lambda x: x is None)
    except Exception:  # noqa: BLE001 - specs JAX inferred (or a JAX whose helpers differ): ask the values
        specs = None
    leaves = jax.tree_util.tree_leaves(args)
    if specs is not None and len(specs) != len(leaves):
        specs = None
    axes: set = set()
    for i, leaf in enumerate(leaves):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            continue
        if dtype == jax.numpy.uint32 and getattr(leaf, "shape", ())[-1:] == (2,):
            continue  # a raw PRNGKey (jax.random.PRNGKey): a key, not data
        spec = specs[i] if specs is not None else None
        if isinstance(spec, PartitionSpec):
            axes.update(_axis_names(spec))
            continue
        vma = getattr(jax.typeof(leaf), "vma", None) if hasattr(jax, "typeof") else None
        if vma is None:
            return None
        axes.update(vma)
    return axes


def watch_mapped_functions() -> None:
    """Make every shard_map (and jax.pmap, built on it) made from now on note, while its body is traced, which
    axes split its inputs: identical randomness is a finding only along those. For the rest of the process (the
    device process imports the user's code after this, so decorators at import time are seen too)."""
    try:
        from jax._src import shard_map as shard_map_lib
    except ImportError:
        return
    original = getattr(shard_map_lib, "_shard_map", None)
    if original is None or getattr(original, "_rngaudit", False):
        return

    def _shard_map(f, *args, **kwargs):
        in_specs = kwargs.get("in_specs")

        def body(*xs):
            try:
                split = _split_axes(in_specs, xs)
            except Exception:  # noqa: BLE001 - cannot tell: the axes' role is left to the fallback
                split = None
            _MAPPED.append(split)
            try:
                return f(*xs)
            finally:
                _MAPPED.pop()

        functools.update_wrapper(body, f)
        return original(body, *args, **kwargs)

    _shard_map._rngaudit = True  # type: ignore[attr-defined]
    shard_map_lib._shard_map = _shard_map


def _mapped_split() -> tuple[str, ...] | None:
    if not _MAPPED or any(m is None for m in _MAPPED):
        return None
    return tuple(sorted({str(a) for m in _MAPPED for a in m}))


@contextlib.contextmanager
def observing(obs: Observation):
    """Record every random_bits call made while active into `obs`."""
    import jax
    import numpy as np
    from jax._src.random import prng

    original = prng.random_bits

    def random_bits(keys, bit_width, shape):
        file, line, function, sampler = _where()
        manual = _manual_axes()
        site = obs.site(
            DrawSite(
                file,
                line,
                function,
                sampler,
                _flax_module(),
                tuple(int(d) for d in shape),
                int(bit_width),
                manual,
                _mapped_split() if manual else None,
            )
        )

        def record(data, *where, site=site, manual=manual):
            words = tuple(int(w) for w in np.asarray(data).ravel())
            coords = tuple((str(a), int(np.asarray(i))) for a, i in zip(manual, where))
            with obs.lock:
                obs.records.append((site, coords, words))

        jax.debug.callback(record, jax.random.key_data(keys), *(jax.lax.axis_index(a) for a in manual))
        return original(keys, bit_width, shape)

    prng.random_bits = random_bits
    try:
        yield obs
    finally:
        prng.random_bits = original


def signature_accepts(fn, name: str) -> bool:
    """Whether `fn` takes a parameter called `name` (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
