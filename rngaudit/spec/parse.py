"""YAML model spec (format version 1) -> frozen dataclasses, every problem reported at file:line:col."""
from __future__ import annotations

import dataclasses
import math

from . import keyexpr
from ..errors import Location, SpecError
from .layers import LAYERS, OPTION_TYPES, make_layer
from .tree import (Call, Child, Cond, Define, Draw, Item, Lift, MakeRng, ModuleDef, Param, RngSource,
                    Sequential, Spec, Transform, Variable, WhileLoop)
from .yaml_source import YNode, load_file, load_text

FORMAT_VERSION = 1
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
KEY_WIDTH = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}
PHASES = ("init", "apply")
MAX_REPEAT = 10_000_000
MAX_DRAW_ELEMENTS = 10_000_000
# Upper bounds on a whole replay (every repeat multiplied out, `when` ignored). derive's fast path
# (rngaudit.fast) needs about 1 us and 100 bytes per key, so ten million keys are seconds and ~1 GiB.
MAX_KEYS = 10_000_000
MAX_CALLS = 1_000_000
MAX_DRAWN_VALUES = 20_000_000
MAX_UNSAFE_RBG_SPLIT = 65_536

DRAW_KINDS = {
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
    "variance_scaling": {"scale": 1.0, "mode": "fan_in", "distribution": "truncated_normal",
                         "in_axis": -2, "out_axis": -1},
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INT_DTYPES = ("int32", "uint32", "int16", "int8", "uint8")

# class transforms: statement -> (Flax's class-name prefix, options allowed besides module/name/repeat/when)
LIFTS = {
    "vmap": ("Vmap", ("axis_size", "split_rngs", "variable_axes", "in_axes", "out_axes", "axis_name",
                      "methods", "metadata_params", "spmd_axis_name")),
    "scan": ("Scan", ("length", "split_rngs", "variable_axes", "variable_broadcast", "variable_carry",
                      "check_constancy_invariants", "reverse", "unroll", "in_axes", "out_axes", "methods",
                      "metadata_params", "data_transform", "_split_transpose")),
    "jit": ("Jit", ("rngs", "variables", "static_argnums", "static_argnames", "donate_argnums", "device",
                    "backend", "methods")),
    "remat": ("Checkpoint", ("rngs", "variables", "prevent_cse", "static_argnums", "policy", "concrete",
                             "methods")),
    "checkpoint": ("Checkpoint", ("rngs", "variables", "prevent_cse", "static_argnums", "policy", "concrete",
                                  "methods")),
    "fold_rngs": ("Fold_rngs", ("rngs", "variables", "methods")),
    "map_variables": ("Map_variables", ("rngs", "variables", "init", "mutable", "mapped_collections",
                                        "trans_in_fn", "trans_out_fn", "methods")),
    "remat_scan": ("Remat_scan", ("lengths", "split_rngs", "variable_axes", "variable_broadcast",
                                  "variable_carry", "policy")),
}
FLOW = ("cond", "switch", "while_loop")
ITEM_KINDS = (("make_rng", "param", "variable", "module", "call", "Sequential") + tuple(LAYERS)
              + tuple(LIFTS) + FLOW)
MAX_LANES = 1_000_000


def _suggest(word: str, choices) -> str:
    import difflib  # only for error messages

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "a mapping"


class _Fields:
    """Reads a mapping node: known keys only, each one checked for type."""

    def __init__(self, node: YNode, what: str, allowed, required=()):
        if not node.is_map:
            raise SpecError(f"{what} must be a mapping, not {_type_name(node.value)}", node.loc)
        self.node = node
        self.what = what
        for key in node.value:
            if key not in allowed:
                raise SpecError(
                    f"unknown key {key!r} in {what}{_suggest(key, allowed)}; "
                    f"allowed: {', '.join(sorted(allowed))}",
                    node.key_locs[key],
                )
        for key in required:
            if key not in node.value:
                raise SpecError(f"{what} needs `{key}`", node.loc)

    def has(self, key: str) -> bool:
        return key in self.node.value

    def get(self, key: str) -> YNode | None:
        return self.node.value.get(key)

    def str(self, key: str, default=None) -> str | None:
        n = self.get(key)
        if n is None:
            return default
        return _str(n, f"`{key}` of {self.what}")

    def bool(self, key: str, default: bool) -> bool:
        n = self.get(key)
        if n is None:
            return default
        if not isinstance(n.value, bool):
            raise SpecError(f"`{key}` must be true or false, not {_type_name(n.value)}", n.loc)
        return n.value

    def int(self, key: str, default: int, lo: int, hi: int) -> int:
        n = self.get(key)
        if n is None:
            return default
        return _int(n, f"`{key}`", lo, hi)


def _str(n: YNode, what: str) -> str:
    if not isinstance(n.value, str):
        hint = "; quote it" if not isinstance(n.value, (list, dict)) else ""
        raise SpecError(f"{what} must be a string, not {_type_name(n.value)}{hint}", n.loc)
    return n.value


def _int(n: YNode, what: str, lo: int, hi: int) -> int:
    v = n.value
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f"{what} must be an integer, not {_type_name(v)}", n.loc)
    if not lo <= v <= hi:
        raise SpecError(f"{what} must be between {lo} and {hi}, not {v}", n.loc)
    return v


def _when(f: _Fields) -> str | None:
    n = f.get("when")
    if n is None:
        return None
    w = _str(n, "`when`")
    if w not in PHASES:
        raise SpecError(f"`when` must be init or apply, not {w!r}{_suggest(w, PHASES)}", n.loc)
    return w


# ---------------------------------------------------------------- draws
def parse_draw(node: YNode, what: str = "draw") -> Draw:
    if not node.is_map or len(node.value) != 1:
        raise SpecError(
            f"{what} must be a mapping with one distribution, e.g. {{normal: [2, 2]}}; "
            f"known: {', '.join(DRAW_KINDS)}",
            node.loc,
        )
    (kind, arg), = node.value.items()
    kloc = node.key_locs[kind]
    if kind not in DRAW_KINDS:
        raise SpecError(f"unknown distribution {kind!r}{_suggest(kind, DRAW_KINDS)}; "
                        f"known: {', '.join(DRAW_KINDS)}", kloc)
    defaults = DRAW_KINDS[kind]
    if arg.is_seq:
        shape_node, f = arg, None
    elif not arg.is_map:
        raise SpecError(f"`{kind}` takes a shape ({{{kind}: [2, 2]}}) or a mapping "
                        f"({{{kind}: {{shape: [2, 2], ...}}}}), not {_type_name(arg.value)}", arg.loc)
    else:
        f = _Fields(arg, f"{kind} draw", ("shape", "dtype") + tuple(defaults), ("shape",))
        shape_node = f.get("shape")
    if not shape_node.is_seq:
        raise SpecError("`shape` must be a list of integers, e.g. [2, 2] ([] for a scalar)", shape_node.loc)
    shape = tuple(_int(d, "a shape dimension", 0, 2**31 - 1) for d in shape_node.value)
    if math.prod(shape) > MAX_DRAW_ELEMENTS:
        raise SpecError(f"the draw has more than {MAX_DRAW_ELEMENTS} values; draw a smaller shape", shape_node.loc)
    is_int = kind == "randint"
    dtype = "int32" if is_int else ("bool" if kind == "bernoulli" else "float32")
    params = []
    if f is not None:
        if f.has("dtype"):
            dtype = f.str("dtype")
            allowed = INT_DTYPES if is_int else (("bool",) if kind == "bernoulli" else FLOAT_DTYPES)
            if dtype not in allowed:
                raise SpecError(f"dtype {dtype!r} is not supported for {kind}; use one of "
                                f"{', '.join(allowed)}", f.get("dtype").loc)
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
                raise SpecError(f"`{p}` of the {kind} draw has the wrong type ({_type_name(v)})", n.loc)
            if isinstance(v, float) and not math.isfinite(v):
                raise SpecError(f"`{p}` must be finite", n.loc)
            if p in DRAW_CHOICES and v not in DRAW_CHOICES[p]:
                raise SpecError(f"`{p}` of the {kind} draw must be one of {', '.join(DRAW_CHOICES[p])}, "
                                f"not {v!r}{_suggest(v, DRAW_CHOICES[p])}", n.loc)
            if is_int and not -(2**31) <= v < 2**31:
                raise SpecError(f"`{p}` of the randint draw must fit in int32 (JAX raises OverflowError "
                                f"with x64 off), not {v}", n.loc)
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
DRAW_CHOICES = {"mode": ("fan_in", "fan_out", "fan_avg", "fan_geo_avg"),
                "distribution": ("truncated_normal", "normal", "uniform")}


def _check_fans(kind: str, shape: tuple, params: dict, shape_node: YNode, f) -> None:
    """Variance-scaling initializers need a fan-in and fan-out; JAX fails obscurely without."""
    ndim = len(shape)
    for p in ("in_axis", "out_axis"):
        axis = params[p]
        if not -ndim <= axis < ndim:
            n = f.get(p) if f is not None else None
            if n is not None:
                raise SpecError(f"`{p}` {axis} is out of range for a shape of {ndim} dimensions", n.loc)
            raise SpecError(f"{kind} needs a shape of at least 2 dimensions (in_axis {params['in_axis']}, "
                            f"out_axis {params['out_axis']}), or set in_axis/out_axis", shape_node.loc)
    if 0 in shape:
        raise SpecError(f"{kind} divides by the fan-in and fan-out: every dimension of the shape must be "
                        "at least 1 (JAX raises ZeroDivisionError)", shape_node.loc)


def _draw(f: _Fields) -> Draw | None:
    n = f.get("draw")
    return None if n is None else parse_draw(n)


# ---------------------------------------------------------------- transform options
_ALL = ("all", "*")


def _required_int(f: _Fields, key: str, kind: str, hi: int) -> int:
    n = f.get(key)
    if n is None:
        raise SpecError(f"{kind} needs `{key}` (a positive integer)", f.node.loc)
    return _int(n, f"`{key}`", 1, hi)


def _filter(n: YNode | None, default, what: str):
    """A Flax filter: true/all (every name), false/none, a name, or a list of names."""
    if n is None:
        return default
    v = n.value
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        if v in _ALL:
            return True
        if v == "none":
            return False
        return (v,)
    if n.is_seq:
        return tuple(_str(x, f"a name in `{what}`") for x in n.value)
    raise SpecError(f"`{what}` must be true, false, a name or a list of names, not {_type_name(v)}", n.loc)


def _split_rngs(n: YNode | None, default) -> tuple:
    if n is None:
        return default
    if isinstance(n.value, str) and n.value in _ALL or n.value is True:
        return ((True, True),)
    if n.value is False or n.value == "none":
        return ()
    if not n.is_map:
        raise SpecError("`split_rngs` maps streams to true/false, e.g. {params: true, dropout: false} "
                        "(`all` for every stream)", n.loc)
    out = []
    for stream, v in n.value.items():
        if not isinstance(v.value, bool):
            raise SpecError(f"`split_rngs` values must be true or false; {stream!r} has {_type_name(v.value)}",
                            v.loc)
        out.append((True if stream in _ALL else stream, v.value))
    return tuple(out)


def _variable_axes(n: YNode | None, default) -> tuple:
    if n is None:
        return default
    if not n.is_map:
        raise SpecError("`variable_axes` maps collections to an axis (or null), e.g. {params: 0}", n.loc)
    out = []
    for col, v in n.value.items():
        if v.value is not None and (isinstance(v.value, bool) or not isinstance(v.value, int)):
            raise SpecError(f"the axis of {col!r} must be an integer or null", v.loc)
        out.append((True if col in _ALL else col, v.value))
    return tuple(out)


# ---------------------------------------------------------------- items
class _Parser:
    def __init__(self):
        self.nodes = 0

    def items(self, node: YNode | None, what: str, in_setup: bool) -> tuple[Item, ...]:
        if node is None or node.value is None:
            return ()
        if not node.is_seq:
            raise SpecError(f"{what} must be a list of statements, not {_type_name(node.value)}", node.loc)
        return tuple(self.item(n, in_setup) for n in node.value)

    def item(self, node: YNode, in_setup: bool) -> Item:
        if isinstance(node.value, str):
            kind, arg, kloc = node.value, YNode(None, node.loc), node.loc
        elif node.is_map and len(node.value) == 1:
            (kind, arg), = node.value.items()
            kloc = node.key_locs[kind]
        elif node.is_map:
            raise SpecError(
                "a statement is a mapping with exactly one key (make_rng, param, variable, module, "
                f"call, Sequential or a layer); this one has {len(node.value)}: "
                f"{', '.join(node.value)}; indent options under the statement",
                node.loc,
            )
        else:
            raise SpecError(f"a statement must be a mapping like `make_rng: dropout`, not "
                            f"{_type_name(node.value)}", node.loc)
        if kind not in ITEM_KINDS:
            raise SpecError(f"unknown statement {kind!r}{_suggest(kind, ITEM_KINDS)}; known: "
                            "make_rng, param, variable, module, call, Sequential, "
                            + ", ".join(LAYERS), kloc)
        if kind in LIFTS:
            return self._transform(kind, arg, kloc, in_setup)
        if kind in FLOW:
            if in_setup:
                raise SpecError(f"nn.{kind} runs inside a method; put it in `body`", kloc)
            return getattr(self, "_" + kind)(kind, arg, kloc)
        return getattr(self, "_" + kind if kind in ("make_rng", "param", "variable", "module", "call",
                                                    "Sequential") else "_layer")(kind, arg, kloc, in_setup)

    def _make_rng(self, kind, arg: YNode, loc, in_setup):
        if arg.value is None:
            return MakeRng(loc, None, "params")
        if isinstance(arg.value, str):
            return MakeRng(loc, None, arg.value)
        if not arg.is_map:
            raise SpecError(f"make_rng takes a stream name (`make_rng: dropout`) or a mapping "
                            f"(`make_rng: {{stream: dropout, repeat: 2}}`), not {_type_name(arg.value)}",
                            arg.loc)
        f = _Fields(arg, "make_rng", ("stream", "repeat", "label", "draw", "when"))
        return MakeRng(loc, _when(f), f.str("stream", "params"), f.int("repeat", 1, 1, MAX_REPEAT),
                       f.str("label"), _draw(f))

    def _param(self, kind, arg: YNode, loc, in_setup):
        if isinstance(arg.value, str):
            return Param(loc, None, arg.value)
        if arg.value is None:
            raise SpecError("param needs a name: `param: w` or `param: {name: w, draw: ...}`", loc)
        if not arg.is_map:
            raise SpecError(f"param takes a name (`param: w`) or a mapping (`param: {{name: w, draw: ...}}`), "
                            f"not {_type_name(arg.value)}", arg.loc)
        f = _Fields(arg, "param", ("name", "draw", "when"), ("name",))
        draw = _draw(f)
        return Param(loc, _when(f), f.str("name"), draw, True if draw is not None else None)

    def _variable(self, kind, arg: YNode, loc, in_setup):
        f = _Fields(arg, "variable", ("collection", "name", "make_rng", "eager", "draw", "when"),
                    ("collection", "name"))
        streams: tuple[str, ...] = ()
        n = f.get("make_rng")
        if n is not None:
            if n.is_seq:
                streams = tuple(_str(s, "a make_rng stream") for s in n.value)
            else:
                streams = (_str(n, "`make_rng`"),)
        eager = f.bool("eager", False)
        if eager and not streams:
            raise SpecError("`eager: true` needs `make_rng:` (the stream passed as an argument)", loc)
        return Variable(loc, _when(f), f.str("collection"), f.str("name"), streams, eager, _draw(f))

    def _call(self, kind, arg: YNode, loc, in_setup):
        if isinstance(arg.value, str):
            return Call(loc, None, arg.value)
        if arg.value is None:
            raise SpecError("call needs the child's name: `call: Dense_0` or `call: {name: enc, repeat: 2}`", loc)
        if not arg.is_map:
            raise SpecError(f"call takes a child's name (`call: enc`) or a mapping (`call: {{name: enc, repeat: 2}}`), "
                            f"not {_type_name(arg.value)}", arg.loc)
        f = _Fields(arg, "call", ("name", "repeat", "when"), ("name",))
        return Call(loc, _when(f), f.str("name"), f.int("repeat", 1, 1, MAX_REPEAT))

    def module_def(self, node: YNode, what: str, root: bool = False) -> tuple[ModuleDef, _Fields]:
        allowed = ("class", "name", "setup", "body", "transforms") + (() if root else ("repeat", "when"))
        f = _Fields(node, what, allowed, ("class",))
        lifts: tuple[Lift, ...] = ()
        tn = f.get("transforms")
        if tn is not None:
            if not tn.is_seq:
                raise SpecError("`transforms` is a list of method decorators, outermost first, e.g. "
                                "[{jit: {}}]", tn.loc)
            for t in tn.value:
                if isinstance(t.value, str):
                    t = YNode({t.value: YNode({}, t.loc)}, t.loc, {t.value: t.loc})
                if not t.is_map or len(t.value) != 1:
                    raise SpecError("each transform is a mapping with one key, e.g. {jit: {rngs: [params]}}",
                                    t.loc)
                (kind, opts), = t.value.items()
                if kind not in LIFTS:
                    raise SpecError(f"unknown transform {kind!r}{_suggest(kind, LIFTS)}; known: "
                                    f"{', '.join(LIFTS)}", t.key_locs[kind])
                lifts += self.lifts(kind, opts if opts.value is not None else YNode({}, opts.loc),
                                    t.key_locs[kind], decorator=True)
        m = ModuleDef(f.str("class"), f.str("name"), self.items(f.get("setup"), "setup", True),
                      self.items(f.get("body"), "body", False), node.loc, lifts=lifts)
        return m, f

    def root(self, node: YNode) -> ModuleDef:
        if node.is_map and len(node.value) == 1 and next(iter(node.value)) in LIFTS:
            (kind, arg), = node.value.items()
            item = self._transform(kind, arg, node.key_locs[kind], False, root=True)
            return item.target
        m, _ = self.module_def(node, "model", root=True)
        return m

    # ------------------------------------------------------------ lifted transforms
    def target(self, node: YNode, what: str) -> ModuleDef:
        """The `module:` of a transform: a user module, a standard layer or a nested transform."""
        if node.is_map and "class" in node.value:
            m, f = self.module_def(node, what, root=True)
            if m.name is not None:
                raise SpecError("put `name:` on the transform statement, not inside `module:` (the name "
                                "belongs to the transformed instance)", f.node.key_locs["name"])
            return m
        if node.is_map and len(node.value) == 1:
            (kind, arg), = node.value.items()
            kloc = node.key_locs[kind]
            if kind in LIFTS:
                return self._transform(kind, arg, kloc, False, nested=True).target
            if kind in LAYERS:
                child = self._layer(kind, arg, kloc, False)
                if child.module.name is not None or child.repeat != 1 or child.when is not None:
                    raise SpecError("put `name`, `repeat` and `when` on the transform statement, not on "
                                    "the wrapped layer", kloc)
                return child.module
            raise SpecError(f"`module` must be a module ({{class: ..., body: [...]}}), a standard layer "
                            f"({{Dense: {{...}}}}) or a transform; {kind!r} is none of these"
                            f"{_suggest(kind, tuple(LAYERS) + tuple(LIFTS))}", kloc)
        raise SpecError("`module` must be a module ({class: ..., body: [...]}), a standard layer "
                        "({Dense: {...}}) or a transform ({jit: {module: ...}})", node.loc)

    def _transform(self, kind, arg: YNode, loc, in_setup, root=False, nested=False):
        prefix, allowed = LIFTS[kind]
        outer = () if (root or nested) else ("name", "repeat", "when")
        f = _Fields(arg, kind, ("module",) + allowed + outer, ("module",))
        target = self.target(f.get("module"), f"module of {kind}")
        opts = YNode({k: v for k, v in arg.value.items() if k not in ("module", "name", "repeat", "when")},
                     arg.loc, {k: v for k, v in arg.key_locs.items()})
        lifts = self.lifts(kind, opts, loc)
        mod = dataclasses.replace(target, cls=prefix + target.cls, name=None if root or nested else f.str("name"),
                                  lifts=lifts + target.lifts, impl_cls=target.impl_cls or target.cls)
        if root or nested:
            return Transform(loc, None, mod, 1)
        if in_setup:
            if mod.name is None:
                raise SpecError("a transformed module created in setup is named by its attribute: give "
                                "`name:`", loc)
            return Define(loc, _when(f), mod)
        return Transform(loc, _when(f), mod, f.int("repeat", 1, 1, MAX_REPEAT))

    def lifts(self, kind: str, node: YNode, loc: Location, decorator: bool = False) -> tuple[Lift, ...]:
        """Normalised options of one transform; remat_scan becomes its nested scans."""
        _, allowed = LIFTS[kind]
        f = _Fields(node, kind, allowed)
        opts: dict = {}
        if kind == "vmap":
            opts["axis_size"] = _required_int(f, "axis_size", kind, MAX_LANES)
        if kind == "scan":
            opts["length"] = _required_int(f, "length", kind, MAX_LANES)
            opts["check_constancy_invariants"] = f.bool("check_constancy_invariants", True)
            f.bool("reverse", False)
        if kind in ("vmap", "scan", "remat_scan"):
            opts["split_rngs"] = _split_rngs(f.get("split_rngs"), default=() if kind != "remat_scan" else ((True, True),))
            opts["variable_axes"] = _variable_axes(f.get("variable_axes"),
                                                   () if kind != "remat_scan" else ((True, 0),))
        if kind in ("scan", "remat_scan"):
            opts["variable_broadcast"] = _filter(f.get("variable_broadcast"), False, "variable_broadcast")
            opts["variable_carry"] = _filter(f.get("variable_carry"), False, "variable_carry")
        if kind in ("jit", "remat", "checkpoint", "fold_rngs", "map_variables"):
            opts["rngs"] = _filter(f.get("rngs"), True, "rngs")
        if kind == "map_variables":
            opts["init"] = f.bool("init", False)
            opts["mutable"] = f.bool("mutable", False)
            opts["mapped_collections"] = _filter(f.get("mapped_collections"), True, "mapped_collections")
        norm = "remat" if kind == "checkpoint" else kind
        if kind != "remat_scan":
            return (Lift(norm, tuple(opts.items()), loc),)
        ln = f.get("lengths")
        if ln is None:
            raise SpecError("remat_scan needs `lengths: [a, b, ...]` (iterations per level)", node.loc)
        if not ln.is_seq or not ln.value:
            raise SpecError("`lengths` must be a non-empty list of positive integers", ln.loc)
        lengths = [_int(n, "a length", 1, MAX_LANES) for n in ln.value]
        # mirrors flax/core/lift.py remat_scan: scan(remat(remat_scan(lengths[1:]))) per level
        out: list[Lift] = []
        for i, n in enumerate(lengths):
            if i:
                out.append(Lift("remat", (("rngs", True),), loc))
            out.append(Lift("scan", tuple(dict(opts, length=n, check_constancy_invariants=True).items()), loc))
        return tuple(out)

    def _branches(self, node: YNode | None, what: str) -> tuple[Item, ...]:
        return self.items(node, what, False)

    def _cond(self, kind, arg: YNode, loc):
        f = _Fields(arg, "cond", ("true_fun", "false_fun", "rngs", "variables", "when"), ("true_fun", "false_fun"))
        return Cond(loc, _when(f), (self._branches(f.get("true_fun"), "true_fun"),
                                    self._branches(f.get("false_fun"), "false_fun")),
                    _filter(f.get("rngs"), True, "rngs"), "cond")

    def _switch(self, kind, arg: YNode, loc):
        f = _Fields(arg, "switch", ("branches", "rngs", "variables", "when"), ("branches",))
        bn = f.get("branches")
        if not bn.is_seq or not bn.value:
            raise SpecError("`branches` must be a non-empty list of statement lists", bn.loc)
        return Cond(loc, _when(f), tuple(self._branches(b, "a branch") for b in bn.value),
                    _filter(f.get("rngs"), True, "rngs"), "switch")

    def _while_loop(self, kind, arg: YNode, loc):
        f = _Fields(arg, "while_loop", ("cond", "body", "iterations", "split_rngs", "carry_variables",
                                        "broadcast_variables", "when"), ("cond", "body", "iterations"))
        return WhileLoop(loc, _when(f), self._branches(f.get("cond"), "cond"), self._branches(f.get("body"), "body"),
                         _int(f.get("iterations"), "`iterations`", 0, MAX_LANES),
                         _split_rngs(f.get("split_rngs"), ()))

    def _module(self, kind, arg: YNode, loc, in_setup):
        m, f = self.module_def(arg, "module")
        return self._child(m, f, loc, in_setup)

    def _child(self, m: ModuleDef, f: _Fields, loc, in_setup):
        repeat = f.int("repeat", 1, 1, MAX_REPEAT)
        if in_setup:
            if m.name is None:
                raise SpecError(
                    "a module created in setup is named by its attribute: give `name:` "
                    "(self.enc = ... -> enc; a list self.layers = [...] -> layers_0, layers_1; "
                    "a dict -> dct_<key>)",
                    loc,
                )
            if repeat != 1:
                raise SpecError("`repeat` is not available in setup; list each attribute", f.get("repeat").loc)
            return Define(loc, _when(f), m)
        return Child(loc, _when(f), m, repeat)

    def _Sequential(self, kind, arg: YNode, loc, in_setup):
        f = _Fields(arg, "Sequential", ("name", "layers", "when"), ("layers",))
        n = f.get("layers")
        if not n.is_seq or not n.value:
            raise SpecError("`layers` must be a non-empty list of modules or layers", n.loc)
        layers = []
        for ln in n.value:
            item = self.item(ln, False)
            if not isinstance(item, (Child, Transform)) or item.repeat != 1:
                raise SpecError("Sequential layers must be modules, standard layers or transformed modules "
                                "(no repeat)", ln.loc)
            if item.when is not None:
                raise SpecError("`when` on a layer inside a Sequential is not supported: put `when` on the "
                                "Sequential", ln.loc)
            layers.append(item.module if isinstance(item, Child) else item.target)
        name = f.str("name")
        if in_setup and name is None:
            raise SpecError("a Sequential created in setup needs `name:` (its attribute name)", loc)
        return Sequential(loc, _when(f), name, tuple(layers), in_setup)

    def _layer(self, kind, arg: YNode, loc, in_setup):
        lk = LAYERS[kind]
        if arg.value is None:
            arg = YNode({}, arg.loc)
        allowed = ("name", "draw", "when", "repeat") + tuple(lk.options) + lk.passive
        f = _Fields(arg, kind, allowed)
        opts = {}
        for opt in lk.options:
            n = f.get(opt)
            if n is None:
                if opt == "rate":
                    raise SpecError("Dropout needs `rate` (the drop probability)", loc)
                continue
            want = OPTION_TYPES[opt]
            v = n.value
            if want is float:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                    raise SpecError(f"`{opt}` must be a number between 0 and 1", n.loc)
                v = float(v)
            elif not isinstance(v, want) or (want is not bool and isinstance(v, bool)):
                raise SpecError(f"`{opt}` must be {'true or false' if want is bool else 'a string'}, "
                                f"not {_type_name(v)}", n.loc)
            opts[opt] = v
        draws = {}
        dn = f.get("draw")
        if dn is not None:
            if not dn.is_map:
                raise SpecError(f"`draw` of a {kind} maps its param names to draws, e.g. "
                                f"{{{lk.params[0]}: {{normal: [2, 2]}}}}", dn.loc)
            for pname, pnode in dn.value.items():
                if pname not in lk.params:
                    raise SpecError(f"{kind} has no {pname!r} to draw{_suggest(pname, lk.params)}; "
                                    f"it has {', '.join(lk.params)}", dn.key_locs[pname])
                draws[pname] = parse_draw(pnode, f"draw of {pname}")
        m = make_layer(kind, opts, loc, f.str("name"), draws)
        return self._child(m, f, loc, in_setup)


# ---------------------------------------------------------------- budget
class _Budget:
    """Upper bounds on what replaying a module costs per call: (keys handed out, values drawn,
    module calls). Repeats multiply, so a few innocent-looking numbers can ask for 10**20 keys;
    such specs are refused here, at the statement that crosses a limit, instead of exhausting
    time and memory later."""

    def __init__(self):
        self.memo: dict[int, tuple[int, int, int]] = {}

    def check(self, model: ModuleDef) -> None:
        self.module(model)

    def _limit(self, cost: tuple[int, int, int], loc: Location, what: str) -> tuple[int, int, int]:
        keys, values, calls = cost
        if keys > MAX_KEYS:
            raise SpecError(f"{what} asks for up to {_big(keys)} keys (repeats multiplied out); rngaudit "
                            f"replays at most {MAX_KEYS}: lower `repeat`", loc)
        if calls > MAX_CALLS:
            raise SpecError(f"{what} makes up to {_big(calls)} module calls (repeats multiplied out); "
                            f"rngaudit replays at most {MAX_CALLS}: lower `repeat`", loc)
        if values > MAX_DRAWN_VALUES:
            raise SpecError(f"{what} draws up to {_big(values)} values (shapes times repeats); rngaudit "
                            f"draws at most {MAX_DRAWN_VALUES}: draw smaller shapes or fewer times", loc)
        return cost

    def module(self, m: ModuleDef) -> tuple[int, int, int]:
        if id(m) in self.memo:
            return self.memo[id(m)]
        children: dict[str, tuple[int, int, int]] = {}
        for items in (m.setup, m.body):
            for item in items:
                for name, c in self._defined(item):
                    old = children.get(name, (0, 0, 0))
                    children[name] = tuple(max(x, y) for x, y in zip(old, c))
        total = (0, 0, 1)
        for items in (m.setup, m.body):
            total = tuple(x + y for x, y in zip(total, self.items(items, children)))
        factor = 1
        for lift in m.lifts:
            factor *= _lift_factor(lift)
        # lifted transforms repeat the call per lane and trace (and re-run setup on each clone)
        cost = self._limit(tuple(x * factor * (2 if m.lifts else 1) for x in total), m.loc, f"module {m.cls}")
        self.memo[id(m)] = cost
        return cost

    def items(self, items, children: dict) -> tuple[int, int, int]:
        total = (0, 0, 0)
        for item in items:
            c = self._limit(self.item(item, children), item.loc, "this statement")
            total = tuple(x + y for x, y in zip(total, c))
        return total

    def _defined(self, item: Item):
        """(name, cost per call) for each child the statement creates; auto-names by class."""
        if isinstance(item, (Child, Define)):
            yield (item.module.name or item.module.cls), self.module(item.module)
        elif isinstance(item, Transform):
            yield (item.target.name or item.target.cls), self.module(item.target)
        elif isinstance(item, Sequential):
            for layer in item.layers:
                yield (layer.name or layer.cls), self.module(layer)
            yield (item.name or "Sequential"), self.item(item, {})

    def item(self, item: Item, children: dict) -> tuple[int, int, int]:
        def drawn(n: int, draw: Draw | None) -> tuple[int, int, int]:
            return n, (n * math.prod(draw.shape) if draw is not None else 0), 0

        def times(n: int, c: tuple[int, int, int]) -> tuple[int, int, int]:
            return n * c[0], n * c[1], n * c[2]

        if isinstance(item, MakeRng):
            return drawn(item.repeat, item.draw)
        if isinstance(item, Param):
            return drawn(1, item.draw)
        if isinstance(item, Variable):
            return drawn(len(item.streams), item.draw)
        if isinstance(item, Child):
            return times(item.repeat, self.module(item.module))
        if isinstance(item, Transform):
            return times(item.repeat, self.module(item.target))
        if isinstance(item, Cond):
            total = (0, 0, 0)
            for branch in item.branches:
                total = tuple(x + y for x, y in zip(total, self.items(branch, children)))
            return total
        if isinstance(item, WhileLoop):
            c = self.items(item.cond_items, children)
            b = self.items(item.body_items, children)
            return tuple((item.iterations + 1) * x + item.iterations * y for x, y in zip(c, b))
        if isinstance(item, Call):
            name = item.name
            target = children.get(name)
            if target is None:
                cls, _, num = name.rpartition("_")
                target = children.get(cls) if num.isdigit() else None
            return times(item.repeat, target or (0, 0, 0))
        if isinstance(item, Sequential):
            total = (0, 0, 1)
            for layer in item.layers:
                total = tuple(x + y for x, y in zip(total, self.module(layer)))
            return total
        return 0, 0, 0


def _lift_factor(lift: Lift) -> int:
    if lift.kind == "vmap":
        return lift.opt("axis_size")
    if lift.kind == "scan":
        return lift.opt("length") + (1 if lift.opt("check_constancy_invariants", True) else 0)
    if lift.kind == "map_variables" and lift.opt("init"):
        return 2
    return 1


def budget(model: ModuleDef) -> tuple[int, int, int]:
    """Upper bounds on one replay of `model`: (keys, drawn values, module calls)."""
    return _Budget().module(model)


def _big(n: int) -> str:
    return str(n) if n < 10**12 else f"about 10**{len(str(n)) - 1}"


# ---------------------------------------------------------------- top level
def _rng_source(n: YNode, impl_width: int, impl: str = "threefry2x32") -> RngSource:
    v = n.value
    if isinstance(v, bool) or v is None or isinstance(v, float) or n.is_map:
        raise SpecError(f"a key must be an integer seed, raw key data [w0, w1] or a key expression "
                        f"string, not {_type_name(v)}", n.loc)
    if isinstance(v, int):
        if not keyexpr.INT64_MIN <= v <= keyexpr.INT64_MAX:
            raise SpecError("the seed must fit in a signed 64-bit integer (JAX raises OverflowError)", n.loc)
        expr = keyexpr.Seed(v)
        text = str(v)
    elif n.is_seq:
        words = []
        for w in n.value:
            if isinstance(w.value, bool) or not isinstance(w.value, int) or not 0 <= w.value < 2**32:
                raise SpecError("raw key data must be unsigned 32-bit integers", w.loc)
            words.append(w.value)
        expr = keyexpr.Raw(tuple(words))
        text = str(expr)
    else:
        expr = keyexpr.parse(v, n.loc, quoted=n.quoted)
        text = v
    if impl == "unsafe_rbg":
        e = expr
        while isinstance(e, (keyexpr.Split, keyexpr.FoldIn)):
            if isinstance(e, keyexpr.Split) and e.n > MAX_UNSAFE_RBG_SPLIT:
                raise SpecError(f"split into {e.n} keys: for unsafe_rbg rngaudit asks JAX for all of them; "
                                f"split into at most {MAX_UNSAFE_RBG_SPLIT}", n.loc)
            e = e.parent
    if isinstance(expr, keyexpr.Raw) or _has_raw(expr):
        raw = _find_raw(expr)
        if len(raw.words) != impl_width:
            raise SpecError(
                f"raw key data has {len(raw.words)} words but the PRNG impl needs {impl_width} "
                "(Flax raises ValueError for a key of another impl); check jax.prng_impl",
                n.loc,
            )
    return RngSource(expr, text, n.loc)


def _find_raw(e):
    while not isinstance(e, keyexpr.Raw):
        if isinstance(e, keyexpr.Seed):
            return None
        e = e.parent
    return e


def _has_raw(e) -> bool:
    return _find_raw(e) is not None


def spec_from_node(root: YNode) -> Spec:
    file = root.loc.file
    top = _Fields(root, "the spec", ("rngaudit", "flax", "jax", "phase", "mutable", "rngs", "model"),
                  ())
    vn = top.get("rngaudit")
    if vn is None:
        raise SpecError("the spec needs `rngaudit: 1` (the spec format version) at the top", root.loc)
    if isinstance(vn.value, bool) or not isinstance(vn.value, int) or vn.value != FORMAT_VERSION:
        raise SpecError(f"unsupported spec format version {vn.value!r}; this rngaudit reads version "
                        f"{FORMAT_VERSION}: write `rngaudit: {FORMAT_VERSION}`", vn.loc)
    if not top.has("model"):
        raise SpecError("the spec needs `model:` (the root module: class, body)", root.loc)

    fix = False
    if top.has("flax"):
        ff = _Fields(top.get("flax"), "flax", ("fix_rng_separator",))
        fix = ff.bool("fix_rng_separator", False)
    impl, part = "threefry2x32", True
    if top.has("jax"):
        jf = _Fields(top.get("jax"), "jax", ("prng_impl", "threefry_partitionable"))
        impl = jf.str("prng_impl", impl)
        if impl not in PRNG_IMPLS:
            raise SpecError(f"unknown prng_impl {impl!r}{_suggest(impl, PRNG_IMPLS)}; use one of "
                            f"{', '.join(PRNG_IMPLS)}", jf.get("prng_impl").loc)
        part = jf.bool("threefry_partitionable", True)
    pn = top.get("phase")
    phase = pn.value if pn is not None else "init"
    if not isinstance(phase, str) or phase not in PHASES:
        if not isinstance(phase, str):
            raise SpecError(f"`phase` must be init or apply, not {_type_name(phase)}", pn.loc)
        raise SpecError(f"`phase` must be init or apply, not {phase!r}{_suggest(phase, PHASES)}",
                        top.get("phase").loc)
    mutable: tuple[str, ...] | bool = phase == "init"
    mn = top.get("mutable")
    if mn is not None:
        if phase == "init":
            raise SpecError("`mutable` applies to phase: apply only (init makes every collection mutable)",
                            mn.loc)
        if isinstance(mn.value, bool):
            mutable = mn.value
        elif mn.is_seq:
            mutable = tuple(_str(c, "a collection name") for c in mn.value)
        elif isinstance(mn.value, str):
            mutable = (mn.value,)
        else:
            raise SpecError(f"`mutable` must be true, false, a collection name or a list of them, "
                            f"not {_type_name(mn.value)}", mn.loc)

    rngs: dict[str, RngSource] = {}
    rn = top.get("rngs")
    width = KEY_WIDTH[impl]
    if rn is not None and rn.value is not None:
        if rn.is_map:
            for stream, kn in rn.value.items():
                rngs[stream] = _rng_source(kn, width, impl)
        else:
            rngs["params"] = _rng_source(rn, width, impl)  # a bare key means {'params': key}, as in Flax

    parser = _Parser()
    model = parser.root(top.get("model"))
    _Budget().check(model)
    return Spec(file, fix, impl, part, phase, mutable, rngs, model)


def load_spec(path: str) -> Spec:
    """Load and validate a spec file."""
    return spec_from_node(load_file(path))


def parse_spec(text: str, file: str = "<spec>") -> Spec:
    """Parse spec text (for tests and tools that build specs in memory)."""
    return spec_from_node(load_text(text, file))
