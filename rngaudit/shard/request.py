"""What `shard-check` is asked to do: its options validated into a ShardRequest, and the request's JSON
form (how the command hands it to the device process). No JAX here."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from ..errors import Location, UsageError
from ..spec.keyexpr import largest_split
from ..spec.keyexpr import parse as parse_key_expr
from ..spec.tree import Draw
from ..usercode import CodeRef, parse_code_ref

MAX_DEVICES = 1024  # --devices: XLA makes this many host devices in well under a second
MAX_PROCESSES = 16  # --processes: each is a JAX process on this machine
DEFAULT_TIMEOUT = 300.0  # seconds the device process may run
MAX_INPUT_ELEMENTS = 1 << 24  # --shape
DEVICE_SPLIT_MAX = 1 << 20  # a split of more keys is not re-derived on the devices (it would materialise them)
PLATFORMS = ("cpu", "gpu", "tpu")
FILLS = ("ones", "normal")


@dataclass(frozen=True)
class SpecTarget:
    """A spec whose keys (those `paths`/`streams` select; all when empty) and draws are checked."""

    file: str
    phase: str | None = None
    paths: tuple[str, ...] = ()
    streams: tuple[str, ...] = ()
    draw: Draw | None = None  # --draw: values drawn from every key without a `draw:`


@dataclass(frozen=True)
class ShardRequest:
    specs: tuple[SpecTarget, ...] = ()
    fns: tuple[CodeRef, ...] = ()
    devices: int | None = None  # forced CPU devices; None: the real devices of `platform`
    platform: str | None = None
    mesh: tuple[tuple[str, int], ...] | None = None  # None: one axis 'data' over every device
    shape: tuple[int, ...] | None = None  # x of --fn; None: (device count, 1)
    fill: str = "ones"  # x of --fn: ones | normal
    seed: int = 0  # seeds x of --input normal (the key is `key`, which --seed also sets)
    key: str = "key(0)"  # the key passed to --fn, a key expression
    replicated_key: bool = False  # --replicated-key: the function is called with one replicated key
    allow_replicated: bool = False
    atol: float | None = None  # None: XLA's rounding is accepted; a number: that tolerance (0: bit for bit)
    timeout: float = DEFAULT_TIMEOUT
    spec_limits: tuple[int, int] | None = None  # (bytes, YAML nodes) the specs were loaded with; None: defaults
    args: CodeRef | None = None  # --args: the factory of the step's arguments; the --fn functions are steps
    processes: int = 1  # --processes: local processes joined with jax.distributed
    data_axes: tuple[str, ...] = ()  # --data-axis: mesh axes that split the data; () = from the arguments


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """`data=4,model=2` -> (('data', 4), ('model', 2))."""
    axes: list[tuple[str, int]] = []
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not re.fullmatch(r"\s*\d+\s*", size):
            raise UsageError(f"--mesh {text!r}: write axis sizes as NAME=SIZE, comma-separated, e.g. data=4,model=2")
        if int(size) < 1:
            raise UsageError(f"--mesh {text!r}: axis {name!r} has size {int(size)}; sizes are at least 1")
        if name in dict(axes):
            raise UsageError(f"--mesh {text!r}: axis {name!r} is named twice")
        axes.append((name, int(size)))
    return tuple(axes)


def mesh_text(mesh: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{n}={s}" for n, s in mesh)


def parse_shape(text: str) -> tuple[int, ...]:
    """`8,1` -> (8, 1)."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise UsageError(f"--shape {text!r}: write the shape of x as comma-separated sizes, e.g. 8,1") from None
    if any(d < 1 for d in dims):
        raise UsageError(f"--shape {text!r}: every size must be at least 1 (the first is the batch)")
    if math.prod(dims) > MAX_INPUT_ELEMENTS:
        raise UsageError(f"--shape {text!r}: x would have {math.prod(dims)} values; at most {MAX_INPUT_ELEMENTS}")
    return dims


def parse_fn_target(text: str) -> CodeRef:
    """`path/to/file.py:forward` or `package.module:forward` (the function may be `Class.method`)."""
    return parse_code_ref(text, "--fn", "FUNCTION", "forward")


def parse_args_factory(text: str) -> CodeRef:
    """--args `path/to/train.py:make_args`: the factory of a step's arguments."""
    return parse_code_ref(text, "--args", "FACTORY", "make_args")


def make_request(
    *,
    specs=(),
    fns=(),
    devices=None,
    platform=None,
    mesh=None,
    shape=None,
    fill=None,
    seed=None,
    key=None,
    replicated_key=False,
    allow_replicated=False,
    atol=None,
    timeout=None,
    args=None,
    processes=None,
    data_axes=(),
) -> ShardRequest:
    """Validate the options (as the command line gives them) into a request; every mistake is a UsageError
    or UserCodeError naming the option, raised before any process starts."""
    if not specs and not fns:
        raise UsageError("give a SPEC to check its keys and draws, or --fn FILE.py:FUNCTION to check a function")
    # the options of a (key, x) function, in the order they are named when one is out of place
    given = [
        o
        for o, v in (("--shape", shape), ("--input", fill), ("--seed", seed), ("--key", key), ("--atol", atol))
        if v is not None
    ]
    given += ["--replicated-key"] if replicated_key else []
    given += ["--allow-replicated"] if allow_replicated else []
    if args is not None:
        if not fns:
            raise UsageError("--args builds the arguments of a --fn training step, and no --fn is given")
        if given:
            raise UsageError(
                f"{given[0]} applies to a (key, x) --fn; with --args the step is called with the factory's "
                "arguments as written"
            )
    elif data_axes:
        raise UsageError("--data-axis applies to a --fn step run with --args, and no --args is given")
    for a in data_axes:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", a):
            raise UsageError(f"--data-axis {a!r}: give the name of a mesh axis, e.g. --data-axis data")
    if processes is not None:
        if not 1 <= processes <= MAX_PROCESSES:
            raise UsageError(f"--processes {processes}: run 1 to {MAX_PROCESSES} processes")
        if processes > 1 and args is None:
            raise UsageError("--processes runs a --fn training step in each process; give its arguments with --args")
        if processes > 1 and specs:
            raise UsageError("--processes runs a --fn step; check SPECs in a run of one process")
        if processes > 1 and platform not in (None, "cpu"):
            raise UsageError(f"--processes starts local CPU processes; drop --platform {platform}")
    if not fns and given:
        raise UsageError(f"{given[0]} applies to --fn, and no --fn is given")
    if replicated_key and allow_replicated:
        raise UsageError(
            "--replicated-key says identical randomness from one key is a finding, --allow-replicated that it "
            "is intended; give one of them"
        )
    if devices is not None and not 1 <= devices <= MAX_DEVICES:
        raise UsageError(f"--devices {devices}: ask for 1 to {MAX_DEVICES} CPU devices")
    if platform is not None:
        if platform not in PLATFORMS:
            raise UsageError(f"--platform {platform!r}: use one of {', '.join(PLATFORMS)}")
        if devices is not None and platform != "cpu":
            raise UsageError(
                f"--devices makes CPU devices; drop it to use the real {platform} devices (--platform {platform})"
            )
    axes = parse_mesh(mesh) if mesh is not None else None
    nproc = processes or 1
    count = devices * nproc if devices is not None else None
    if axes is not None:
        positions = math.prod(s for _, s in axes)
        if count is not None and positions != count:
            per = f" in each of {nproc} processes ({count} in all)" if nproc > 1 else ""
            raise UsageError(
                f"--mesh {mesh}: the sizes multiply to {positions}, but --devices asks for {devices}{per}; "
                f"they must be equal"
            )
        count = positions
    dims = parse_shape(shape) if shape is not None else None
    if dims is not None and count is not None and dims[0] % count:
        raise UsageError(
            f"--shape {shape}: the first axis of x is the batch; {dims[0]} rows do not divide over {count} devices"
        )
    if fill is not None and fill not in FILLS:
        raise UsageError(f"--input {fill!r}: use ones or normal")
    if key is not None and largest_split(parse_key_expr(key, Location("--key", 1, 1))) > DEVICE_SPLIT_MAX:
        raise UsageError(f"--key {key}: splits more than {DEVICE_SPLIT_MAX} keys; rngaudit materialises every split")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise UsageError(f"--seed {seed}: seeds are signed 64-bit integers")
    if atol is not None and not (math.isfinite(atol) and atol >= 0):
        raise UsageError(f"--atol {atol}: give a finite tolerance of 0 or more")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout}: give a positive number of seconds")
    return ShardRequest(
        specs=tuple(specs),
        fns=tuple(fns),
        devices=devices,
        platform=platform,
        mesh=axes,
        shape=dims,
        fill=fill or "ones",
        seed=0 if seed is None else seed,
        key=key if key is not None else f"key({0 if seed is None else seed})",
        replicated_key=replicated_key,
        allow_replicated=allow_replicated,
        atol=None if atol is None else float(atol),
        timeout=DEFAULT_TIMEOUT if timeout is None else float(timeout),
        args=args,
        processes=nproc,
        data_axes=tuple(dict.fromkeys(data_axes)),
    )


def _draw_json(d: Draw | None):
    if d is None:
        return None
    return {
        "kind": d.kind,
        "shape": list(d.shape),
        "dtype": d.dtype,
        "params": [list(p) for p in d.params],
        "loc": d.loc.as_json(),
    }


def _draw_from_json(j) -> Draw | None:
    if j is None:
        return None
    return Draw(j["kind"], tuple(j["shape"]), j["dtype"], tuple((k, v) for k, v in j["params"]), Location(**j["loc"]))


def request_json(r: ShardRequest) -> dict:
    out = dataclasses.asdict(r)
    out["specs"] = [dict(dataclasses.asdict(s), draw=_draw_json(s.draw)) for s in r.specs]
    return out


def request_from_json(j: dict) -> ShardRequest:
    return ShardRequest(
        specs=tuple(
            SpecTarget(s["file"], s["phase"], tuple(s["paths"]), tuple(s["streams"]), _draw_from_json(s["draw"]))
            for s in j["specs"]
        ),
        fns=tuple(CodeRef(**f) for f in j["fns"]),
        devices=j["devices"],
        platform=j["platform"],
        mesh=tuple((n, s) for n, s in j["mesh"]) if j["mesh"] is not None else None,
        shape=tuple(j["shape"]) if j["shape"] is not None else None,
        fill=j["fill"],
        seed=j["seed"],
        key=j["key"],
        replicated_key=j["replicated_key"],
        allow_replicated=j["allow_replicated"],
        atol=j["atol"],
        timeout=j["timeout"],
        spec_limits=tuple(j["spec_limits"]) if j.get("spec_limits") is not None else None,
        args=CodeRef(**j["args"]) if j.get("args") else None,
        processes=j.get("processes", 1),
        data_axes=tuple(j.get("data_axes", ())),
    )
