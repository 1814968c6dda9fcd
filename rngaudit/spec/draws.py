"""A spec's `draw:` (the values drawn from a key) parsed and checked against what JAX accepts."""

from __future__ import annotations

import math

from ..errors import SpecError
from .fields import Fields, as_int, suggest, type_name
from .tree import Draw
from .yaml_source import YNode

MAX_DRAW_ELEMENTS = 10_000_000

DRAW_KINDS: dict[str, dict[str, object]] = {
    # kind -> {param: default}; None means required
    "normal": {},
    "uniform": {"minval": 0.0, "maxval": 1.0},
    "bernoulli": {"p": 0.5},
    "randint": {"minval": None, "maxval": None},
    "truncated_normal": {"lower": -2.0, "upper": 2.0},
    "lecun_normal": {"in_axis": -2, "out_axis": -1},
    "lecun_uniform": {"in_axis": -2, "out_axis": -1},
    "glorot_normal": {"in_axis": -2, "out_axis": -1},
    "glorot_uniform": {"in_axis": -2, "out_axis": -1},
    "xavier_normal": {"in_axis": -2, "out_axis": -1},
    "xavier_uniform": {"in_axis": -2, "out_axis": -1},
    "he_normal": {"in_axis": -2, "out_axis": -1},
    "he_uniform": {"in_axis": -2, "out_axis": -1},
    "kaiming_normal": {"in_axis": -2, "out_axis": -1},
    "kaiming_uniform": {"in_axis": -2, "out_axis": -1},
    "variance_scaling": {
        "scale": 1.0,
        "mode": "fan_in",
        "distribution": "truncated_normal",
        "in_axis": -2,
        "out_axis": -1,
    },
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INT_DTYPES = ("int32", "uint32", "int16", "int8", "uint8")


def parse_draw(node: YNode, what: str = "draw") -> Draw:
    if not node.is_map or len(node.value) != 1:
        raise SpecError(
            f"{what} must be a mapping with one distribution, e.g. {{normal: [2, 2]}}; known: {', '.join(DRAW_KINDS)}",
            node.loc,
        )
    ((kind, arg),) = node.value.items()
    kloc = node.key_locs[kind]
    if kind not in DRAW_KINDS:
        raise SpecError(
            f"unknown distribution {kind!r}{suggest(kind, DRAW_KINDS)}; known: {', '.join(DRAW_KINDS)}", kloc
        )
    defaults = DRAW_KINDS[kind]
    if arg.is_seq:
        shape_node, f = arg, None
    elif not arg.is_map:
        raise SpecError(
            f"`{kind}` takes a shape ({{{kind}: [2, 2]}}) or a mapping "
            f"({{{kind}: {{shape: [2, 2], ...}}}}), not {type_name(arg.value)}",
            arg.loc,
        )
    else:
        f = Fields(arg, f"{kind} draw", ("shape", "dtype") + tuple(defaults), ("shape",))
        shape_node = f.need("shape")
    if not shape_node.is_seq:
        raise SpecError("`shape` must be a list of integers, e.g. [2, 2] ([] for a scalar)", shape_node.loc)
    shape = tuple(as_int(d, "a shape dimension", 0, 2**31 - 1) for d in shape_node.value)
    # (a draw with a 0 dimension has no values, but jax may lay out its other dimensions anyway)
    if math.prod(d for d in shape if d) > MAX_DRAW_ELEMENTS:
        what = "the draw's dimensions other than 0 make" if 0 in shape else "the draw has"
        raise SpecError(f"{what} more than {MAX_DRAW_ELEMENTS} values; draw a smaller shape", shape_node.loc)
    is_int = kind == "randint"
    dtype = "int32" if is_int else ("bool" if kind == "bernoulli" else "float32")
    params = []
    if f is not None:
        if f.has("dtype"):
            dtype = f.name("dtype")
            allowed = INT_DTYPES if is_int else (("bool",) if kind == "bernoulli" else FLOAT_DTYPES)
            if dtype not in allowed:
                raise SpecError(
                    f"dtype {dtype!r} is not supported for {kind}; use one of {', '.join(allowed)}", f.need("dtype").loc
                )
        for p, default in defaults.items():
            n = f.get(p)
            if n is None:
                if default is None:
                    raise SpecError(f"{kind} draw needs `{p}`", arg.loc)
                params.append((p, default))
                continue
            v = n.value
            if isinstance(default, str) or p in ("mode", "distribution"):
                ok = isinstance(v, str)
            elif p in ("in_axis", "out_axis") or is_int:
                ok = isinstance(v, int) and not isinstance(v, bool)
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok:
                raise SpecError(f"`{p}` of the {kind} draw has the wrong type ({type_name(v)})", n.loc)
            if isinstance(v, float) and not math.isfinite(v):
                raise SpecError(f"`{p}` must be finite", n.loc)
            if p in DRAW_CHOICES and v not in DRAW_CHOICES[p]:
                raise SpecError(
                    f"`{p}` of the {kind} draw must be one of {', '.join(DRAW_CHOICES[p])}, "
                    f"not {v!r}{suggest(v, DRAW_CHOICES[p])}",
                    n.loc,
                )
            if is_int and not -(2**31) <= v < 2**31:
                raise SpecError(
                    f"`{p}` of the randint draw must fit in int32 (JAX raises OverflowError with x64 off), not {v}",
                    n.loc,
                )
            if isinstance(v, int) and not is_int and p not in ("in_axis", "out_axis"):
                v = float(v)  # what the spec means; JAX would read a big int as an int32
            params.append((p, v))
    else:
        for p, default in defaults.items():
            if default is None:
                raise SpecError(f"{kind} draw needs `{p}`: write {{{kind}: {{shape: [...], {p}: ...}}}}", arg.loc)
            params.append((p, default))
    if "in_axis" in defaults:
        _check_fans(kind, shape, dict(params), shape_node, f)
    return Draw(kind, shape, dtype, tuple(params), node.loc)


# jax.nn.initializers.variance_scaling's choices
DRAW_CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("fan_in", "fan_out", "fan_avg", "fan_geo_avg"),
    "distribution": ("truncated_normal", "normal", "uniform"),
}


def _check_fans(kind: str, shape: tuple, params: dict, shape_node: YNode, f) -> None:
    """Variance-scaling initializers need a fan-in and fan-out; JAX fails obscurely without."""
    ndim = len(shape)
    for p in ("in_axis", "out_axis"):
        axis = params[p]
        if not -ndim <= axis < ndim:
            n = f.get(p) if f is not None else None
            if n is not None:
                raise SpecError(f"`{p}` {axis} is out of range for a shape of {ndim} dimensions", n.loc)
            raise SpecError(
                f"{kind} needs a shape of at least 2 dimensions (in_axis {params['in_axis']}, "
                f"out_axis {params['out_axis']}), or set in_axis/out_axis",
                shape_node.loc,
            )
    if 0 in shape:
        raise SpecError(
            f"{kind} divides by the fan-in and fan-out: every dimension of the shape must be "
            "at least 1 (JAX raises ZeroDivisionError)",
            shape_node.loc,
        )
