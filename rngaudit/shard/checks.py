"""Multi-device checks: re-derive keys and draws, and run a user's (key, x) function, on a mesh of devices.

The command side (`ShardRequest`, `run`) never imports JAX: JAX fixes its device count when it starts,
so every check runs in a fresh child process (`python -m rngaudit.shard.worker`) started with the
environment that gives the devices asked for. The device side (`run_here`) is what that process runs.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from ..errors import DeviceError, Location, RngauditError, SpecError, UserCodeError
from ..spec.keyexpr import FoldIn, KeyExpr, Raw, Seed, Split
from ..spec.keyexpr import parse as parse_key_expr
from ..spec.tree import Draw
from .report import (ALLOWED, FAIL, FINDING, NOT_APPLICABLE, PASS, Check, DeviceSet, Environment,
                           MeshLayout, ShardReport, TargetResult, from_json)

MAX_DEVICES = 1024  # --devices: XLA makes this many host devices in well under a second
DEFAULT_TIMEOUT = 300.0  # seconds the device process may run
MAX_INPUT_ELEMENTS = 1 << 24  # --shape
DEVICE_SPLIT_MAX = 1 << 20  # a split of more keys is not re-derived on the devices (it would materialise them)
MAX_LISTED = 20  # mismatching rows listed per check
PREVIEW = 16  # values shown per device slice or output
PLATFORMS = ("cpu", "gpu", "tpu")
FILLS = ("ones", "normal")
_WORKER = "rngaudit.shard.worker"


# ------------------------------------------------------------------ the request (no JAX)
@dataclass(frozen=True)
class SpecTarget:
    """A spec whose keys (those `paths`/`streams` select; all when empty) and draws are checked."""

    file: str
    phase: str | None = None
    paths: tuple[str, ...] = ()
    streams: tuple[str, ...] = ()
    draw: Draw | None = None  # --draw: values drawn from every key without a `draw:`


@dataclass(frozen=True)
class FnTarget:
    """`--fn FILE.py:NAME` or `--fn package.module:NAME`: a function (key, x) -> y."""

    text: str
    file: str | None
    module: str | None
    attr: str


@dataclass(frozen=True)
class ShardRequest:
    specs: tuple[SpecTarget, ...] = ()
    fns: tuple[FnTarget, ...] = ()
    devices: int | None = None  # forced CPU devices; None: the real devices of `platform`
    platform: str | None = None
    mesh: tuple[tuple[str, int], ...] | None = None  # None: one axis 'data' over every device
    shape: tuple[int, ...] | None = None  # x of --fn; None: (device count, 1)
    fill: str = "ones"  # x of --fn: ones | normal
    seed: int = 0  # seeds x of --input normal (the key is `key`, which --seed also sets)
    key: str = "key(0)"  # the key passed to --fn, a key expression
    allow_replicated: bool = False
    atol: float = 0.0
    timeout: float = DEFAULT_TIMEOUT
    spec_limits: tuple[int, int] | None = None  # (bytes, YAML nodes) the specs were loaded with; None: defaults


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """`data=4,model=2` -> (('data', 4), ('model', 2))."""
    axes = []
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not re.fullmatch(r"\s*\d+\s*", size):
            raise SpecError(f"--mesh {text!r}: write axis sizes as NAME=SIZE, comma-separated, e.g. data=4,model=2")
        if int(size) < 1:
            raise SpecError(f"--mesh {text!r}: axis {name!r} has size {int(size)}; sizes are at least 1")
        if name in dict(axes):
            raise SpecError(f"--mesh {text!r}: axis {name!r} is named twice")
        axes.append((name, int(size)))
    return tuple(axes)


def mesh_text(mesh: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{n}={s}" for n, s in mesh)


def parse_shape(text: str) -> tuple[int, ...]:
    """`8,1` -> (8, 1)."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise SpecError(f"--shape {text!r}: write the shape of x as comma-separated sizes, e.g. 8,1") from None
    if any(d < 1 for d in dims):
        raise SpecError(f"--shape {text!r}: every size must be at least 1 (the first is the batch)")
    if math.prod(dims) > MAX_INPUT_ELEMENTS:
        raise SpecError(f"--shape {text!r}: x would have {math.prod(dims)} values; at most {MAX_INPUT_ELEMENTS}")
    return dims


def parse_fn_target(text: str) -> FnTarget:
    """`path/to/file.py:forward` or `package.module:forward` (the function may be `Class.method`)."""
    where, colon, attr = text.rpartition(":")
    usage = "write FILE.py:FUNCTION or package.module:FUNCTION, e.g. model.py:forward"
    if not colon or not where or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise SpecError(f"--fn {text!r}: {usage}")
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not os.path.isfile(where):
            raise UserCodeError(f"--fn {text}: no such file {where!r}")
        return FnTarget(text, where, None, attr)
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", where):
        raise SpecError(f"--fn {text!r}: {where!r} is neither a .py file nor a module name; {usage}")
    return FnTarget(text, None, where, attr)


def make_request(*, specs=(), fns=(), devices=None, platform=None, mesh=None, shape=None, fill=None, seed=None,
                 key=None, allow_replicated=False, atol=None, timeout=None) -> ShardRequest:
    """Validate the options (as the command line gives them) into a request; every mistake is a SpecError
    or UserCodeError naming the option, raised before any process starts."""
    if not specs and not fns:
        raise SpecError("give a SPEC to check its keys and draws, or --fn FILE.py:FUNCTION to check a function")
    if not fns:
        given = [o for o, v in (("--shape", shape), ("--input", fill), ("--seed", seed), ("--key", key),
                                ("--atol", atol)) if v is not None]
        given += ["--allow-replicated"] if allow_replicated else []
        if given:
            raise SpecError(f"{given[0]} applies to --fn, and no --fn is given")
    if devices is not None and not 1 <= devices <= MAX_DEVICES:
        raise SpecError(f"--devices {devices}: ask for 1 to {MAX_DEVICES} CPU devices")
    if platform is not None:
        if platform not in PLATFORMS:
            raise SpecError(f"--platform {platform!r}: use one of {', '.join(PLATFORMS)}")
        if devices is not None and platform != "cpu":
            raise SpecError(f"--devices makes CPU devices; drop it to use the real {platform} devices "
                            f"(--platform {platform})")
    axes = parse_mesh(mesh) if mesh is not None else None
    count = devices
    if axes is not None:
        positions = math.prod(s for _, s in axes)
        if devices is not None and positions != devices:
            raise SpecError(f"--mesh {mesh}: the sizes multiply to {positions}, but --devices asks for {devices}; "
                            f"they must be equal")
        count = positions
    dims = parse_shape(shape) if shape is not None else None
    if dims is not None and count is not None and dims[0] % count:
        raise SpecError(f"--shape {shape}: the first axis of x is the batch; {dims[0]} rows do not divide over "
                        f"{count} devices")
    if fill is not None and fill not in FILLS:
        raise SpecError(f"--input {fill!r}: use ones or normal")
    if key is not None and _largest_split(parse_key_expr(key, Location("--key", 1, 1))) > DEVICE_SPLIT_MAX:
        raise SpecError(f"--key {key}: splits more than {DEVICE_SPLIT_MAX} keys; rngaudit materialises every split")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise SpecError(f"--seed {seed}: seeds are signed 64-bit integers")
    if atol is not None and not (math.isfinite(atol) and atol >= 0):
        raise SpecError(f"--atol {atol}: give a finite tolerance of 0 or more")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise SpecError(f"--timeout {timeout}: give a positive number of seconds")
    return ShardRequest(
        specs=tuple(specs), fns=tuple(fns), devices=devices, platform=platform, mesh=axes, shape=dims,
        fill=fill or "ones", seed=0 if seed is None else seed,
        key=key if key is not None else f"key({0 if seed is None else seed})",
        allow_replicated=allow_replicated, atol=0.0 if atol is None else float(atol),
        timeout=DEFAULT_TIMEOUT if timeout is None else float(timeout))


def _draw_json(d: Draw | None):
    if d is None:
        return None
    return {"kind": d.kind, "shape": list(d.shape), "dtype": d.dtype, "params": [list(p) for p in d.params],
            "loc": d.loc.as_json()}


def _draw_from_json(j) -> Draw | None:
    if j is None:
        return None
    return Draw(j["kind"], tuple(j["shape"]), j["dtype"], tuple((k, v) for k, v in j["params"]),
                Location(**j["loc"]))


def request_json(r: ShardRequest) -> dict:
    out = dataclasses.asdict(r)
    out["specs"] = [dict(dataclasses.asdict(s), draw=_draw_json(s.draw)) for s in r.specs]
    return out


def request_from_json(j: dict) -> ShardRequest:
    return ShardRequest(
        specs=tuple(SpecTarget(s["file"], s["phase"], tuple(s["paths"]), tuple(s["streams"]),
                               _draw_from_json(s["draw"])) for s in j["specs"]),
        fns=tuple(FnTarget(**f) for f in j["fns"]),
        devices=j["devices"], platform=j["platform"],
        mesh=tuple((n, s) for n, s in j["mesh"]) if j["mesh"] is not None else None,
        shape=tuple(j["shape"]) if j["shape"] is not None else None,
        fill=j["fill"], seed=j["seed"], key=j["key"], allow_replicated=j["allow_replicated"],
        atol=j["atol"], timeout=j["timeout"],
        spec_limits=tuple(j["spec_limits"]) if j.get("spec_limits") is not None else None)


# ------------------------------------------------------------------ the command side: one child process
def child_env(r: ShardRequest, base: dict | None = None) -> dict:
    """The device process's environment: forced CPU devices must be set before JAX starts."""
    env = dict(os.environ if base is None else base)
    if r.devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={r.devices}"])
        env["JAX_NUM_CPU_DEVICES"] = str(r.devices)
        env["JAX_PLATFORMS"] = "cpu"
    # the child must import this rngaudit even when it is run from a checkout that is not installed
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
    return env


def _kill(proc: subprocess.Popen) -> None:
    """Stop the device process and anything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


_ERRORS = {"SpecError": SpecError, "DeviceError": DeviceError, "UserCodeError": UserCodeError}


def run(r: ShardRequest) -> ShardReport:
    """Run the checks in a fresh process started with the devices asked for; raise RngauditError when it
    cannot (bad input it finds, devices that cannot be had, a function that fails, a timeout)."""
    with tempfile.TemporaryDirectory(prefix="rngaudit-shard-") as tmp:
        req_path, res_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req_path, "w", encoding="utf-8") as f:
            json.dump(request_json(r), f)
        try:
            proc = subprocess.Popen([sys.executable, "-m", _WORKER, req_path, res_path], env=child_env(r),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            raise DeviceError(f"cannot start the device process ({e.strerror or e})") from None
        try:
            _, err = proc.communicate(timeout=r.timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise DeviceError(f"the device run did not finish within {r.timeout:g} s (--timeout {r.timeout:g}); "
                              "the devices may be unavailable or busy, or the checks need longer") from None
        except BaseException:
            _kill(proc)
            raise
        err_text = err.decode("utf-8", "replace")
        if os.environ.get("RNGAUDIT_DEBUG"):
            sys.stderr.write(err_text)
        if not os.path.exists(res_path):
            how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
                   else f"exited with code {proc.returncode}")
            last = _last_line(err_text)
            raise DeviceError(f"the device process {how} before reporting" + (f": {last}" if last else ""))
        with open(res_path, encoding="utf-8") as f:
            result = json.load(f)
    if "error" in result:
        raise _ERRORS.get(result["error"]["kind"], RngauditError)(result["error"]["message"])
    return from_json(result["report"])


# ------------------------------------------------------------------ the device side (imports JAX)
def run_here(r: ShardRequest) -> ShardReport:
    """Run every check of `r` in this process, on its devices (what the device process does)."""
    from ..spec.yaml_source import limits

    devices = _pick_devices(r)
    mesh = _make_mesh(devices, r.mesh)
    with limits(*(r.spec_limits or (None, None))):
        targets = [_check_spec(t, mesh) for t in r.specs] + [_check_fn(t, r, mesh) for t in r.fns]
    flat = list(mesh.devices.flat)
    return ShardReport(
        _environment(),
        DeviceSet(flat[0].platform, flat[0].device_kind, tuple(int(d.id) for d in flat), r.devices is not None),
        MeshLayout(tuple(mesh.axis_names), tuple(int(s) for s in mesh.devices.shape),
                   np.vectorize(lambda d: int(d.id), otypes=[np.int64])(mesh.devices).tolist()),
        tuple(targets))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _pick_devices(r: ShardRequest) -> list:
    import jax

    if r.devices is not None:
        devices = jax.devices("cpu")
        if len(devices) != r.devices:
            raise DeviceError(f"--devices {r.devices}: JAX started with {len(devices)} CPU device(s) "
                              f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}); something configured JAX first")
        return devices
    try:
        return jax.devices(r.platform) if r.platform else jax.devices()
    except RuntimeError as e:
        if r.platform:
            raise DeviceError(f"--platform {r.platform}: no {r.platform} devices can be had here "
                              f"({_first_line(e)})") from None
        raise DeviceError(f"JAX cannot start a backend ({_first_line(e)})") from None


def _make_mesh(devices: list, axes):
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    names, sizes = zip(*axes) if axes else (("data",), (len(devices),))
    if math.prod(sizes) != len(devices):
        raise SpecError(f"--mesh {mesh_text(axes)}: the sizes multiply to {math.prod(sizes)}, but "
                        f"{len(devices)} {devices[0].platform} device(s) are here; they must be equal")
    try:
        grid = mesh_utils.create_device_mesh(sizes, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, names)


def _environment() -> Environment:
    import platform

    import jax
    import jaxlib

    return Environment(
        jax=jax.__version__, jaxlib=getattr(jaxlib, "__version__", "unknown"),
        flax=getattr(sys.modules.get("flax"), "__version__", None),
        python=platform.python_version(), prng_impl=str(jax.config.jax_default_prng_impl),
        threefry_partitionable=bool(jax.config.jax_threefry_partitionable),
        enable_x64=bool(jax.config.jax_enable_x64), xla_flags=os.environ.get("XLA_FLAGS"),
        jax_platforms=os.environ.get("JAX_PLATFORMS"))


def _shard_map():
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def _rows_sharding(mesh):
    """Axis 0 split over every mesh axis, so each device holds its own block."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def _blocks(array) -> int:
    """How many distinct pieces of `array` its devices hold (slices are unhashable before Python 3.12)."""
    return len({tuple((i.start, i.stop, i.step) for i in s.index) for s in array.addressable_shards})


def _partition_text(spec) -> str:
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


# ---------------------------------------------------------------- keys from expressions, draws (traceable)
def key_from_expr(expr: KeyExpr, impl: str | None):
    """The typed key a key expression denotes, computed with jax.random (works under jax.jit)."""
    import jax
    import jax.numpy as jnp

    if isinstance(expr, Seed):
        return jax.random.key(expr.seed, impl=impl)
    if isinstance(expr, Raw):
        return jax.random.wrap_key_data(jnp.asarray(expr.words, jnp.uint32), impl=impl)
    if isinstance(expr, Split):
        return jax.random.split(key_from_expr(expr.parent, impl), expr.n)[expr.index]
    if isinstance(expr, FoldIn):
        return jax.random.fold_in(key_from_expr(expr.parent, impl), np.uint32(expr.data))
    raise TypeError(expr)


def _raw_words(expr: KeyExpr) -> tuple[int, ...] | None:
    while isinstance(expr, (Split, FoldIn)):
        expr = expr.parent
    return expr.words if isinstance(expr, Raw) else None


def _largest_split(expr: KeyExpr) -> int:
    if isinstance(expr, Split):
        return max(expr.n, _largest_split(expr.parent))
    if isinstance(expr, FoldIn):
        return _largest_split(expr.parent)
    return 0


def draw_array(key, draw: Draw):
    """What jax.random draws for `draw`: the calls of rngaudit/keys.py draw_values, kept traceable."""
    import jax
    import jax.numpy as jnp

    p = dict(draw.params)
    dtype = jnp.dtype(draw.dtype)
    kind, shape = draw.kind, draw.shape
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
        return jax.nn.initializers.variance_scaling(p["scale"], p["mode"], p["distribution"], in_axis=p["in_axis"],
                                                    out_axis=p["out_axis"])(key, shape, dtype)
    return getattr(jax.nn.initializers, kind)(in_axis=p["in_axis"], out_axis=p["out_axis"])(key, shape, dtype)


def _per_row(one, impl: str):
    """`one` over the rows of its arguments."""
    import jax

    if impl == "unsafe_rbg":
        # lax.map, not vmap: jax/_src/lax/control_flow/loops.py _rng_bit_generator_batching_rule seeds a
        # vmapped rng_bit_generator from keys[0] only (see rngaudit/keys.py _jax_fold_in_many)
        return lambda *cols: jax.lax.map(lambda row: one(*row), cols)
    return jax.vmap(one)


# Jitted functions are built once per process and reused by every spec: jax.jit caches compilations per
# function object (and per threefry_partitionable setting), so building one per spec would compile again.
@functools.lru_cache(maxsize=None)
def _rows_jit(op: str, impl: str, mesh, n_split: int = 0):
    """jax.jit of a per-row key operation with the rows split over every mesh axis: `fold` is
    fold_in(base, word), `split` is split(base, n_split)[index]."""
    import jax

    def fold(base, word):
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(base, impl=impl), word))

    def split(base, index):
        return jax.random.key_data(jax.random.split(jax.random.wrap_key_data(base, impl=impl), n_split)[index])

    sharding = _rows_sharding(mesh)
    return jax.jit(_per_row(fold if op == "fold" else split, impl), in_shardings=(sharding, sharding),
                   out_shardings=sharding)


def _bucket(m: int, n: int) -> int:
    """Rows padded to n devices times a power of two, so specs of similar size share one compilation."""
    per = max(1, -(-m // n))
    return n * (1 << (per - 1).bit_length())


def _sharded_rows(op: str, impl: str, mesh, bases: np.ndarray, args: np.ndarray, n_split: int = 0) -> np.ndarray:
    """The key operation on every row in one jitted call, the rows split over the devices."""
    m = len(bases)
    pad = _bucket(m, mesh.size) - m
    if pad:
        bases = np.concatenate([bases, np.repeat(bases[:1], pad, axis=0)])
        args = np.concatenate([args, np.repeat(args[:1], pad, axis=0)])
    return np.asarray(_rows_jit(op, impl, mesh, n_split)(bases, args))[:m]


@functools.lru_cache(maxsize=None)
def _root_jit(expr: KeyExpr, impl: str, mesh):
    """jax.jit computing a root key from its expression, replicated on every device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(lambda: jax.random.key_data(key_from_expr(expr, impl)),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))


@functools.lru_cache(maxsize=None)
def _draw_jit(kind: str, shape: tuple, dtype: str, params: tuple, impl: str, mesh):
    """jax.jit of one draw from key data, its output partitioned over the mesh as far as the shape allows."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    draw = Draw(kind, shape, dtype, params, Location("-", 1, 1))
    part = partition_for(shape, list(zip(mesh.axis_names, mesh.devices.shape)))
    fn = jax.jit(lambda kd: draw_array(jax.random.wrap_key_data(kd, impl=impl), draw),
                 out_shardings=NamedSharding(mesh, PartitionSpec(*part)))
    return fn, part


# ------------------------------------------------------------------ spec checks
def _selected(d, t: SpecTarget) -> bool:
    if t.paths and not any(fnmatch.fnmatchcase(d.path_str, g) for g in t.paths):
        return False
    return not t.streams or d.stream in t.streams or d.stream_requested in t.streams


def _row_json(d, host=None, device=None) -> dict:
    out = {"index": d.index, "path_str": d.path_str, "stream": d.stream, "count": d.count, "label": d.label,
           "lane": list(d.lane), "location": d.location.as_json()}
    if host is not None:
        out["host"] = [int(w) for w in host]
        out["device"] = [int(w) for w in device]
    return out


def _check_spec(t: SpecTarget, mesh) -> TargetResult:
    import jax

    from ..engine.keys import engine_for
    from ..engine.replay import FoldKey, ForkKey, RootKey, SplitKey
    from ..engine.derive import derive
    from ..spec.parse import load_spec

    spec = load_spec(t.file)
    if t.phase is not None and t.phase != spec.phase:
        spec = dataclasses.replace(spec, phase=t.phase, mutable=t.phase == "init")
    devices = list(mesh.devices.flat)
    n = len(devices)
    with jax.default_device(devices[0]):
        report = derive(spec, values=True, default_draw=t.draw)
    keyed = [c for c in report.calls if c.key is not None]
    chosen = [c for c in keyed if _selected(c.derivation, t)]
    if (t.paths or t.streams) and not chosen:
        sel = " ".join([f"--path {g!r}" for g in t.paths] + [f"--stream {s!r}" for s in t.streams])
        raise SpecError(f"{spec.file}: {sel} select none of its {len(keyed)} keys")
    engine = engine_for(spec)
    impl, width = spec.prng_impl, engine.width
    host: dict = {}

    def host_key(ref):
        # mirrors rngaudit/keys.py derive_keys: the key data a base reference stands for
        if ref not in host:
            if isinstance(ref, RootKey):
                host[ref] = report.roots[ref.stream]
            elif isinstance(ref, SplitKey):
                host[ref] = engine.split(host_key(ref.parent), ref.n, ref.index)
            elif isinstance(ref, FoldKey):
                host[ref] = tuple(int(w) for w in engine.fold_in_many(host_key(ref.parent), np.array([ref.data]))[0])
            else:
                host[ref] = report.calls[ref.index].key
        return host[ref]

    # every base a chosen key hangs from, down to the roots: each is one split or fold of its parent
    bases: dict = {}
    todo = [c.derivation.base for c in chosen]
    while todo:
        ref = todo.pop()
        if isinstance(ref, RootKey) or ref in bases:
            continue
        bases[ref] = None
        todo.append(report.calls[ref.index].derivation.base if isinstance(ref, ForkKey) else ref.parent)

    with jax.threefry_partitionable(spec.threefry_partitionable):
        checks = [_root_check(spec, report.roots, mesh),
                  _base_check(list(bases), host_key, report, impl, width, mesh),
                  _key_check(chosen, host_key, impl, width, mesh),
                  _draw_check(chosen, impl, mesh)]
    info = {"file": spec.file, "phase": spec.phase, "prng_impl": impl,
            "threefry_partitionable": spec.threefry_partitionable, "fix_rng_separator": spec.fix_rng_separator,
            "paths": list(t.paths), "streams": list(t.streams), "draw": t.draw.describe() if t.draw else None,
            "keys": len(report.calls), "checked_keys": len(chosen),
            "not_checked_discarded": len(report.calls) - len(keyed), "devices": n}
    return TargetResult("spec", spec.file, info, tuple(checks))


def _root_check(spec, roots: dict, mesh) -> Check:
    title = "root keys"
    if not spec.rngs:
        return Check("root_keys", title, NOT_APPLICABLE, "the spec passes no rngs")
    streams, wrong, skipped = [], [], []
    for stream in sorted(spec.rngs):
        src = spec.rngs[stream]
        entry = {"stream": stream, "expr": src.text, "host": list(roots[stream])}
        if _largest_split(src.expr) > DEVICE_SPLIT_MAX:
            skipped.append(stream)
            entry["device"] = None
            streams.append(entry)
            continue
        out = _root_jit(src.expr, spec.prng_impl, mesh)()
        copies = {tuple(int(w) for w in np.asarray(s.data)) for s in out.addressable_shards}
        entry["device"] = [list(c) for c in sorted(copies)]
        if copies != {tuple(roots[stream])}:
            wrong.append(stream)
        streams.append(entry)
    details = {"streams": streams, "mismatched": wrong, "not_checked": skipped}
    checked = len(streams) - len(skipped)
    if wrong:
        return Check("root_keys", title, FAIL, f"{len(wrong)} of {checked} root keys derived on the devices differ "
                     f"from the host's: {', '.join(wrong)}", details)
    if not checked:
        return Check("root_keys", title, NOT_APPLICABLE, f"every root splits more than {DEVICE_SPLIT_MAX} keys; "
                     "not derived on the devices", details)
    extra = (f" ({len(skipped)} splitting more than {DEVICE_SPLIT_MAX} keys not derived on the devices)"
             if skipped else "")
    return Check("root_keys", title, PASS, f"{checked} root key(s) derived from their expressions under jax.jit on "
                 f"all {mesh.size} devices equal the host's on every device{extra}", details)


def _base_check(refs: list, host_key, report, impl: str, width: int, mesh) -> Check:
    from ..engine.replay import ForkKey, SplitKey

    title = "base keys"
    if not refs:
        return Check("base_keys", title, NOT_APPLICABLE,
                     "every checked key folds a root key directly (no vmap/scan split, while_loop fold or jit fork)")
    folds = [r for r in refs if not isinstance(r, SplitKey)]
    splits = [r for r in refs if isinstance(r, SplitKey) and r.n <= DEVICE_SPLIT_MAX]
    skipped = len(refs) - len(folds) - len(splits)
    got: dict = {}
    if folds:
        parents, words = [], []
        for r in folds:
            if isinstance(r, ForkKey):
                d = report.calls[r.index].derivation
                parents.append(host_key(d.base))
                words.append(d.hash_word)
            else:
                parents.append(host_key(r.parent))
                words.append(r.data)
        # fold_in takes its data as uint32, wrapping negatives (a while_loop cond folds in -i)
        out = _sharded_rows("fold", impl, mesh, np.asarray(parents, np.uint32).reshape(-1, width),
                            np.asarray(words, np.int64).astype(np.uint32))
        got.update(zip(folds, map(tuple, out.tolist())))
    by_n: dict = {}
    for r in splits:
        by_n.setdefault(r.n, []).append(r)
    for n_split, group in by_n.items():
        out = _sharded_rows("split", impl, mesh,
                            np.asarray([host_key(r.parent) for r in group], np.uint32).reshape(-1, width),
                            np.asarray([r.index for r in group], np.int32), n_split)
        got.update(zip(group, map(tuple, out.tolist())))
    wrong = [r for r, k in got.items() if k != tuple(host_key(r))]
    details = {"checked": len(got), "splits": len(splits), "folds": len(folds), "not_checked": skipped,
               "mismatches": [{"base": str(r), "host": list(host_key(r)), "device": list(got[r])}
                              for r in wrong[:MAX_LISTED]], "mismatched": len(wrong)}
    if wrong:
        return Check("base_keys", title, FAIL, f"{len(wrong)} of {len(got)} base keys (lane splits, loop folds, jit "
                     "forks) re-derived on the devices differ from the host's", details)
    if not got:
        return Check("base_keys", title, NOT_APPLICABLE,
                     f"every base splits more than {DEVICE_SPLIT_MAX} keys; not re-derived on the devices", details)
    return Check("base_keys", title, PASS, f"{len(got)} base key(s) ({len(splits)} splits, {len(folds)} folds and "
                 f"forks) re-derived from their parents under jax.jit, sharded over {mesh.size} devices, equal the "
                 "host's", details)


def _key_check(chosen: list, host_key, impl: str, width: int, mesh) -> Check:
    title = "keys"
    if not chosen:
        return Check("keys", title, NOT_APPLICABLE, "the spec makes no key")
    bases = np.asarray([host_key(c.derivation.base) for c in chosen], np.uint32).reshape(-1, width)
    words = np.asarray([c.derivation.hash_word for c in chosen], np.uint32)
    out = _sharded_rows("fold", impl, mesh, bases, words)
    expected = np.asarray([c.key for c in chosen], np.uint32).reshape(-1, width)
    bad = np.flatnonzero((out != expected).any(axis=1))
    details = {"checked": len(chosen), "mismatched": int(len(bad)),
               "mismatches": [_row_json(chosen[i].derivation, expected[i], out[i]) for i in bad[:MAX_LISTED]]}
    if len(bad):
        return Check("keys", title, FAIL, f"{len(bad)} of {len(chosen)} keys re-derived on the devices differ from "
                     "the host derivation", details)
    return Check("keys", title, PASS, f"{len(chosen)} key(s) re-derived on the devices (fold_in of the base key with "
                 f"the hash word under jax.jit, rows sharded over {mesh.size} devices) equal the host derivation "
                 "bit for bit", details)


def _is_float(dtype) -> bool:
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def _max_ulp(a: np.ndarray, b: np.ndarray) -> int | None:
    """The largest distance in units in the last place between finite floats of a and b."""
    if not _is_float(a.dtype) or a.dtype.itemsize not in (2, 4, 8):
        return None
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    finite = np.isfinite(a.astype(np.float64)) & np.isfinite(b.astype(np.float64))
    if not finite.any():
        return None

    def ordered(x):
        bits = np.ascontiguousarray(x).view(ints).astype(object if ints is np.int64 else np.int64)
        return np.where(bits < 0, np.iinfo(ints).min - bits, bits)

    return int(np.max(np.abs(ordered(a)[finite] - ordered(b)[finite])))


def _compare(a: np.ndarray, b: np.ndarray, atol: float = 0.0) -> dict:
    """How b differs from a: values that differ (bit for bit when atol is 0), the largest |a - b| and ulp distance."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"mismatched": max(a.size, b.size), "max_abs_diff": None, "max_ulp": None}
    if not a.size:
        return {"mismatched": 0, "max_abs_diff": None, "max_ulp": None}
    if atol == 0 or not _is_float(a.dtype):
        bits_a = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, -1)
        bits_b = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(b.size, -1)
        differ = int((bits_a != bits_b).any(axis=1).sum())
    else:
        differ = int((~np.isclose(a.astype(np.float64), b.astype(np.float64), rtol=0.0, atol=atol,
                                  equal_nan=True)).sum())
    if a.dtype == np.bool_:
        return {"mismatched": differ, "max_abs_diff": None, "max_ulp": None}
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"mismatched": differ, "max_abs_diff": None if np.isnan(diff).all() else float(np.nanmax(diff)),
            "max_ulp": _max_ulp(a, b)}


def _draw_check(chosen: list, impl: str, mesh) -> Check:
    title = "draws"
    rows = [c for c in chosen if c.values is not None]
    if not rows:
        return Check("draws", title, NOT_APPLICABLE, "no checked key has a `draw:` (try --draw KIND:SHAPE)")
    wrong, split_over, shapes = [], 0, set()
    for c in rows:
        d = c.draw
        fn, part = _draw_jit(d.kind, d.shape, d.dtype, d.params, impl, mesh)
        out = fn(np.asarray(c.key, np.uint32))
        if _blocks(out) > 1:
            split_over += 1
        shapes.add(_partition_text(part))
        diff = _compare(c.values, np.asarray(out))
        if diff["mismatched"]:
            wrong.append(dict(_row_json(c.derivation), **diff, draw=c.draw.describe(),
                              partition=_partition_text(part), elements=int(c.values.size)))
    details = {"checked": len(rows), "split_over_devices": split_over, "replicated": len(rows) - split_over,
               "partitions": sorted(shapes), "mismatched": len(wrong), "mismatches": wrong[:MAX_LISTED]}
    if wrong:
        return Check("draws", title, FAIL, f"{len(wrong)} of {len(rows)} draws under jax.jit with sharded output "
                     "differ from the eager draw on one device", details)
    rep = (f"; {len(rows) - split_over} too small to split over the mesh ran replicated"
           if split_over < len(rows) else "")
    return Check("draws", title, PASS, f"{len(rows)} draw(s) under jax.jit with the output sharded over "
                 f"{mesh.size} devices equal the eager draw on one device bit for bit{rep}", details)


# ------------------------------------------------------------------ --fn checks
class _NeedsMeshAxes(Exception):
    """The function names mesh axes (jax.lax.axis_index, psum): it runs only inside shard_map."""


def load_function(t: FnTarget):
    """Import the module or file and return the function, checked to accept (key, x)."""
    if t.file is not None:
        path = os.path.abspath(t.file)
        if not os.path.isfile(path):
            raise UserCodeError(f"--fn {t.text}: no such file {t.file!r}")
        name = "_rngaudit_fn_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        # flax modules are dataclasses, which look their module up in sys.modules while the file runs
        sys.modules[name] = module
        sys.path.insert(0, os.path.dirname(path))
        try:
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            raise UserCodeError(f"--fn {t.text}: importing {t.file} raised {type(e).__name__}: "
                                f"{_first_line(e)}") from None
        where = t.file
    else:
        try:
            module = importlib.import_module(t.module)
        except ModuleNotFoundError as e:
            if e.name and (t.module == e.name or t.module.startswith(e.name + ".")):
                raise UserCodeError(f"--fn {t.text}: no module named {e.name!r} (run from the directory that "
                                    "holds it, or install it)") from None
            raise UserCodeError(f"--fn {t.text}: importing {t.module} raised {_first_line(e)}") from None
        except (Exception, SystemExit) as e:
            raise UserCodeError(f"--fn {t.text}: importing {t.module} raised {type(e).__name__}: "
                                f"{_first_line(e)}") from None
        where = t.module
    obj = module
    for part in t.attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items()
                           if inspect.isfunction(v) and not n.startswith("_") and v.__module__ == module.__name__)
            known = f"; functions there: {', '.join(names)}" if names else ""
            raise UserCodeError(f"--fn {t.text}: {where} has no {t.attr!r}{known}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserCodeError(f"--fn {t.text}: {t.attr} is a {type(obj).__name__}, not a function")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj
    try:
        sig.bind(None, None)
    except TypeError:
        raise UserCodeError(f"--fn {t.text}: {t.attr}{sig} cannot be called as {t.attr}(key, x); shard-check "
                            "passes a PRNG key and a batch x") from None
    return obj


def _call(t: FnTarget, where: str, fn, *args, mesh=None):
    """Run the user's code and wait for its result; its failures become one-line UserCodeErrors. Outside
    shard_map (no `mesh`), a function that names mesh axes raises _NeedsMeshAxes instead."""
    import jax

    try:
        out = fn(*args)
        jax.block_until_ready(out)
        return out
    except NameError as e:
        if "unbound axis name" not in str(e):
            raise UserCodeError(f"--fn {t.text}: raised NameError {where}: {_first_line(e)}") from None
        if mesh is None:
            raise _NeedsMeshAxes(_first_line(e)) from None
        raise UserCodeError(f"--fn {t.text}: raised NameError {where} over the mesh axes "
                            f"{', '.join(mesh.axis_names)}: {_first_line(e).rstrip('.')}; give --mesh with the axes "
                            "it names") from None
    except (Exception, SystemExit) as e:
        raise UserCodeError(f"--fn {t.text}: raised {type(e).__name__} {where}: {_first_line(e)}") from None


def _leaves(t: FnTarget, y, rows: int) -> list:
    """The output's arrays; each must have the batch as its first axis, so it can be sharded like x."""
    import jax

    leaves = jax.tree.leaves(y)
    if not leaves:
        raise UserCodeError(f"--fn {t.text}: returned {type(y).__name__} with no arrays; shard-check needs an "
                            "output whose first axis is the batch")
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] != rows:
            what = f"shape {tuple(shape)}" if shape is not None else f"a {type(leaf).__name__}"
            raise UserCodeError(f"--fn {t.text}: returned {what}; shard-check needs outputs whose first axis is "
                                f"the batch, as x's ({rows})")
    return leaves


def _preview(a: np.ndarray) -> list:
    flat = np.asarray(a).reshape(-1)[:PREVIEW]
    if flat.dtype == np.bool_:
        return flat.tolist()
    if np.issubdtype(flat.dtype, np.integer):
        return flat.astype(np.int64).tolist()
    return [float(v) if np.isfinite(v) else str(v) for v in flat.astype(np.float64)]


def _device_slices(y, mesh) -> tuple[list[dict], list[bytes]]:
    """Each device's block of the output, in mesh order: what the report shows of it (the first leaf's rows
    and values), and the bytes of its blocks of every leaf, to compare."""
    import jax

    leaves = jax.tree.leaves(y)
    by_device = [{s.device.id: s for s in leaf.addressable_shards} for leaf in leaves]
    shown, blobs = [], []
    for d in mesh.devices.flat:
        datas = [np.asarray(m[d.id].data) for m in by_device]
        idx = by_device[0][d.id].index[0]
        stop = leaves[0].shape[0] if idx.stop is None else idx.stop
        shown.append({"device": int(d.id), "rows": [int(idx.start or 0), int(stop)], "values": _preview(datas[0]),
                      "size": int(datas[0].size)})
        blobs.append(b"".join(a.tobytes() for a in datas))
    return shown, blobs


def _groups(slices: list[dict], blobs: list[bytes]) -> list[list[int]]:
    """Devices whose blocks are identical, in groups of two or more."""
    seen: dict = {}
    for s, blob in zip(slices, blobs):
        seen.setdefault(blob, []).append(s["device"])
    return [ids for ids in seen.values() if len(ids) > 1]


def _fn_input(r: ShardRequest, n: int) -> np.ndarray:
    """x: ones, or a NumPy normal sample seeded by --seed; its first axis is the batch."""
    shape = r.shape or (n, 1)
    if shape[0] % n:
        raise SpecError(f"--shape {','.join(map(str, shape))}: the first axis of x is the batch; {shape[0]} rows do "
                        f"not divide over {n} devices")
    if r.fill == "ones":
        return np.ones(shape, np.float32)
    return np.random.default_rng(r.seed).standard_normal(shape).astype(np.float32)


def _fn_key(r: ShardRequest, device):
    """The key --seed or --key names, as a typed key of the default PRNG impl, on `device`."""
    import jax

    expr = parse_key_expr(r.key, Location("--key", 1, 1))
    width = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape[-1]
    raw = _raw_words(expr)
    if raw is not None and len(raw) != width:
        raise SpecError(f"--key {r.key}: raw key data of {len(raw)} words; keys of the default PRNG impl "
                        f"({jax.config.jax_default_prng_impl}) have {width}")
    with jax.default_device(device):
        return key_from_expr(expr, None)


def _check_fn(t: FnTarget, r: ShardRequest, mesh) -> TargetResult:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    devices = list(mesh.devices.flat)
    with jax.default_device(devices[0]):  # arrays the module makes on import live on the devices checked
        fn = load_function(t)
    n, names = len(devices), tuple(mesh.axis_names)
    x = _fn_input(r, n)
    rows = len(x) // n
    key = _fn_key(r, devices[0])
    batch, replicated = _rows_sharding(mesh), NamedSharding(mesh, PartitionSpec())
    axes_text = mesh_text(tuple(zip(names, mesh.devices.shape)))
    info = {"fn": t.text, "x": {"shape": list(x.shape), "dtype": "float32", "fill": r.fill,
                                "seed": r.seed if r.fill == "normal" else None},
            "key": {"expr": r.key, "impl": str(jax.random.key_impl(key)),
                    "data": [int(w) for w in np.asarray(jax.random.key_data(key)).reshape(-1)]},
            "batch_partition": _partition_text(batch.spec), "rows_per_device": rows,
            "eager_device": int(devices[0].id), "atol": r.atol, "mesh_axes_only": False, "outputs": None}

    try:
        with jax.default_device(devices[0]):
            eager = _call(t, "when run eagerly on one device", fn, key, jax.device_put(x, devices[0]))
    except _NeedsMeshAxes as e:
        info["mesh_axes_only"] = True
        jit_check = Check("jit_equals_eager", "jit equals eager", NOT_APPLICABLE,
                          f"the function names mesh axes ({e}), so it runs only inside shard_map")
    else:
        eager_leaves = [np.asarray(v) for v in _leaves(t, eager, len(x))]
        info["outputs"] = [{"shape": list(v.shape), "dtype": str(v.dtype)} for v in eager_leaves]
        jitted = jax.jit(fn, in_shardings=(replicated, batch), out_shardings=batch)
        out = _call(t, f"under jax.jit with the batch sharded over {axes_text}", jitted,
                    jax.device_put(key, replicated), jax.device_put(x, batch), mesh=mesh)
        jit_check = _jit_check(eager_leaves, _leaves(t, out, len(x)), r.atol, n, axes_text)

    # under shard_map every device gets the same rows of x, so only the keys can make devices differ
    x_same = jax.device_put(np.concatenate([x[:rows]] * n), batch)
    smap = _shard_map()
    split_fn = smap(lambda kb, xb: fn(kb[0], xb), mesh=mesh, in_specs=(PartitionSpec(names), PartitionSpec(names)),
                    out_specs=PartitionSpec(names))
    with jax.default_device(devices[0]):
        keys = jax.random.split(key, n)
    y = _call(t, "under shard_map with split keys", jax.jit(split_fn), jax.device_put(keys, batch), x_same,
              mesh=mesh)
    _leaves(t, y, len(x))
    split_check = _split_check(*_device_slices(y, mesh), n)

    one_fn = smap(fn, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(names)), out_specs=PartitionSpec(names))
    y = _call(t, "under shard_map with one replicated key", jax.jit(one_fn), jax.device_put(key, replicated),
              x_same, mesh=mesh)
    _leaves(t, y, len(x))
    one_check = _replicated_check(*_device_slices(y, mesh), n, r.allow_replicated, names)
    return TargetResult("fn", t.text, info, (jit_check, split_check, one_check))


ROUNDING_ULP = 8  # differences this small come from how XLA fuses float operations, not from keys


def _jit_check(eager: list, jitted: list, atol: float, n: int, axes_text: str) -> Check:
    title = "jit equals eager"
    differ, elements, max_diff, max_ulp = 0, 0, 0.0, 0
    for a, b in zip(eager, jitted):
        d = _compare(a, np.asarray(b), atol)
        differ += d["mismatched"]
        elements += a.size
        max_diff = max(max_diff, d["max_abs_diff"] or 0.0)
        max_ulp = None if max_ulp is None or d["max_ulp"] is None else max(max_ulp, d["max_ulp"])
    blocks = _blocks(jitted[0])
    details = {"elements": elements, "mismatched": differ, "max_abs_diff": max_diff, "max_ulp": max_ulp,
               "atol": atol, "output_blocks": blocks, "eager": _preview(eager[0]),
               "jit": _preview(np.asarray(jitted[0]))}
    how = "bit for bit" if atol == 0 else f"within atol {atol:g}"
    if differ:
        ulp = f", {max_ulp} ulp" if max_ulp is not None else ""
        why = (" These are rounding differences, not different random values: XLA fuses float operations "
               "differently under jit (e.g. into fused multiply-adds); --atol accepts them."
               if max_ulp is not None and max_ulp <= ROUNDING_ULP else
               " They are larger than rounding: the jitted, sharded run computes different values.")
        return Check("jit_equals_eager", title, FAIL, f"under jax.jit with the batch sharded over {axes_text}, "
                     f"{differ} of {elements} output values differ from the eager run on one device (largest "
                     f"difference {max_diff:.3g}{ulp}{'' if atol == 0 else f', atol {atol:g}'}).{why}", details)
    return Check("jit_equals_eager", title, PASS, f"jax.jit with the batch sharded over {axes_text} gives the eager "
                 f"output {how} ({elements} values, in {blocks} blocks on {n} devices)", details)


def _split_check(slices: list[dict], blobs: list[bytes], n: int) -> Check:
    title = "shard_map, split keys"
    groups = _groups(slices, blobs)
    details = {"slices": slices, "identical_groups": groups}
    if n == 1:
        return Check("shard_map_split_keys", title, PASS, "one device: no other device to differ from", details)
    if groups:
        return Check("shard_map_split_keys", title, FAIL,
                     f"{sum(map(len, groups))} of {n} devices drew the same values as another device although each "
                     f"got its own key from jax.random.split(key, {n}): {_group_text(groups)}; the output does not "
                     "depend on the key there", details)
    return Check("shard_map_split_keys", title, PASS, f"each of the {n} devices drew its own values from its own key "
                 f"(jax.random.split(key, {n}), one per device)", details)


def _group_text(groups: list[list[int]]) -> str:
    return "; ".join("devices " + ", ".join(map(str, g)) + " alike" for g in groups)


def _replicated_check(slices: list[dict], blobs: list[bytes], n: int, allowed: bool,
                      names: tuple[str, ...]) -> Check:
    title = "shard_map, one key"
    groups = _groups(slices, blobs)
    details = {"slices": slices, "identical_groups": groups, "allow_replicated": allowed}
    if n == 1:
        return Check("shard_map_replicated_key", title, PASS, "one device: no other device to repeat it", details)
    if not groups:
        return Check("shard_map_replicated_key", title, PASS, f"given one replicated key, the {n} devices still drew "
                     "different values: the function makes per-device randomness itself", details)
    every = len(groups) == 1 and len(groups[0]) == n
    what = (f"{'both' if n == 2 else f'all {n}'} devices drew identical values from one replicated key" if every
            else f"from one replicated key, {_group_text(groups)}")
    axes = repr(names[0]) if len(names) == 1 else "(" + ", ".join(map(repr, names)) + ")"
    finding = "same randomness on every device" if every else "same randomness on several devices"
    if allowed:
        return Check("shard_map_replicated_key", title, ALLOWED, f"{finding}: {what} (intended: --allow-replicated)",
                     details)
    return Check("shard_map_replicated_key", title, FINDING,
                 f"{finding}: {what}. Pass each device its own key "
                 f"(jax.random.split(key, {n}) with in_specs P({axes})) or fold in the device index "
                 f"(jax.random.fold_in(key, jax.lax.axis_index({axes}))); --allow-replicated if this is intended",
                 details)
