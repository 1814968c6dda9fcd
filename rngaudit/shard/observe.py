"""The randomness a user's step really draws, device by device (the device process of `shard-check --args`).

Every public `jax.random` sampler (normal, uniform, bernoulli — so Flax's nn.Dropout —, randint, permutation,
gamma, ...) is wrapped, in `jax.random` and in `jax._src.random` (where jax.nn.initializers find them), before
the user's code is imported. While `observing()` is active a sampler also records, through
`jax.debug.callback`, the key data it was given where the draw runs: once outside shard_map (where jax.jit
partitions one random array over the devices), and on each device inside shard_map or jax.pmap, named by its
coordinates along the manual mesh axes (`jax.lax.axis_index`). The wrapper runs in the user's trace, above
the samplers' own jax.jit, so every call is its own record; JAX's caches are cleared before the step runs,
so a step traced before (by the factory, by an earlier --fn) is traced again and seen. The values follow from
the sampler, its arguments and the key, so equal key data at the same draw means equal randomness. Nothing
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
# not samplers although their first parameter is a key
_NOT_SAMPLERS = frozenset({"split", "fold_in", "key_data", "key_impl", "clone", "wrap_key_data"})
_OBSERVING: list = []  # the Observation being recorded into (one at a time)


@dataclass(frozen=True)
class DrawSite:
    """Where a draw was traced: the user's source line, the sampler, the Flax module it ran in, its output's shape
    and dtype, and the mesh axes that were manual there (inside shard_map)."""

    file: str | None
    line: int | None
    function: str
    sampler: str
    module: str | None
    shape: tuple[int, ...]
    dtype: str
    manual_axes: tuple[str, ...]
    chain: tuple[tuple[str, int], ...] = ()  # every user frame of the call, innermost first: two calls of one
    # helper from different places are different draws
    split_axes: tuple[str, ...] | None = None  # manual axes that split an input of the mapped function (not a key)

    def as_json(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "sampler": self.sampler,
            "module": self.module,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chain": [list(c) for c in self.chain],
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


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are not the user's: JAX, jaxlib, Flax, NumPy, rngaudit, the standard library."""
    import sysconfig

    dirs = [_RNGAUDIT]
    for name in ("jax", "jaxlib", "flax", "numpy", "optax", "orbax", "chex"):
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)))
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.append(os.path.abspath(path))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def _library(filename: str) -> bool:
    return filename.startswith("<") or os.path.abspath(filename).startswith(_library_dirs())


def _installed(filename: str) -> bool:
    return f"{os.sep}site-packages{os.sep}" in filename or f"{os.sep}dist-packages{os.sep}" in filename


def _where() -> tuple[str | None, int | None, str, tuple[tuple[str, int], ...]]:
    """(file, line, function) of the frame a draw is shown at: the innermost frame of the user's own code (not
    an installed package, when there is one), and the chain of every user frame, innermost first."""
    frame: types.FrameType | None = sys._getframe(2)
    frames: list[types.FrameType] = []
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_RNGAUDIT):
            if frames:
                break  # the worker that called the step: the user's frames end here
        elif not _library(name):
            frames.append(frame)
        frame = frame.f_back
    if not frames:
        return None, None, "?", ()
    shown = next((f for f in frames if not _installed(f.f_code.co_filename)), frames[0])
    chain = tuple((os.path.abspath(f.f_code.co_filename), f.f_lineno) for f in frames)
    return os.path.abspath(shown.f_code.co_filename), shown.f_lineno, shown.f_code.co_name, chain


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


def axis_names(spec) -> list:
    """The mesh axes a PartitionSpec names, in order (`P(('data', 'fsdp'), None, 'model')`)."""
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
            axes.update(axis_names(spec))
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


def _record(obs: Observation, sampler: str, key, out) -> None:
    """Note one call of `sampler` on `key` (its output `out`): the site now, the key data where it runs."""
    import jax
    import numpy as np

    file, line, function, chain = _where()
    manual = _manual_axes()
    leaves = jax.tree_util.tree_leaves(out)
    first = leaves[0] if leaves else None
    site = obs.site(
        DrawSite(
            file,
            line,
            function,
            sampler,
            _flax_module(),
            tuple(int(d) for d in getattr(first, "shape", ())),
            str(getattr(first, "dtype", "")),
            manual,
            chain,
            _mapped_split() if manual else None,
        )
    )
    typed = jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key)
    data = jax.random.key_data(key) if typed else key

    def record(data, *where, site=site, manual=manual):
        words = tuple(int(w) for w in np.asarray(data).ravel())
        coords = tuple((str(a), int(np.asarray(i))) for a, i in zip(manual, where))
        with obs.lock:
            obs.records.append((site, coords, words))

    jax.debug.callback(record, data, *(jax.lax.axis_index(a) for a in manual))


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def sampler(key, *args, **kwargs):
        out = fn(key, *args, **kwargs)
        if _OBSERVING:
            _record(_OBSERVING[-1], name, key, out)
        return out

    sampler._rngaudit = fn  # type: ignore[attr-defined]
    return sampler


def watch_samplers() -> None:
    """Wrap every public jax.random sampler, in jax.random and jax._src.random (for the rest of the process: the
    device process imports the user's code after this, so `from jax.random import normal` gets the wrapper)."""
    import jax.random as public

    private = sys.modules.get("jax._src.random")  # (where jax.nn.initializers look samplers up)
    for name in dir(public):
        fn = getattr(public, name)
        if name.startswith("_") or name in _NOT_SAMPLERS or not callable(fn) or hasattr(fn, "_rngaudit"):
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if not params or params[0] != "key":
            continue
        wrapped = _wrap(name, fn)
        setattr(public, name, wrapped)
        if private is not None and getattr(private, name, None) is fn:
            setattr(private, name, wrapped)


@contextlib.contextmanager
def observing(obs: Observation):
    """Record every sampler call made while active into `obs` (watch_samplers() must have run). JAX's caches are
    cleared first: a step traced before would replay its old trace, which records nothing (or into an old
    Observation)."""
    import jax

    jax.clear_caches()
    _OBSERVING.append(obs)
    try:
        yield obs
    finally:
        _OBSERVING.pop()
