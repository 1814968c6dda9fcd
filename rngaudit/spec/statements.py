"""A module's statements, standard layers and lifted transforms, parsed into spec.tree nodes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..errors import Location, SpecError
from .draws import parse_draw
from .fields import Fields, as_int, as_str, suggest, type_name
from .layers import LAYERS, OPTION_TYPES, make_layer
from .releases import LINEN_SINCE, FlaxRules, version_text
from .tree import (
    PHASES,
    Call,
    Child,
    Cond,
    Define,
    Draw,
    Item,
    Lift,
    MakeRng,
    ModuleDef,
    Param,
    Sequential,
    ToLinenDef,
    Transform,
    Variable,
    WhileLoop,
)
from .yaml_source import YNode

MAX_REPEAT = 10_000_000
MAX_LANES = 1_000_000

# class transforms: statement -> (Flax's class-name prefix, options allowed besides module/name/repeat/when)
LIFTS = {
    "vmap": (
        "Vmap",
        (
            "axis_size",
            "split_rngs",
            "variable_axes",
            "in_axes",
            "out_axes",
            "axis_name",
            "methods",
            "metadata_params",
            "spmd_axis_name",
        ),
    ),
    "scan": (
        "Scan",
        (
            "length",
            "split_rngs",
            "variable_axes",
            "variable_broadcast",
            "variable_carry",
            "check_constancy_invariants",
            "reverse",
            "unroll",
            "in_axes",
            "out_axes",
            "methods",
            "metadata_params",
            "data_transform",
            "_split_transpose",
        ),
    ),
    "jit": (
        "Jit",
        ("rngs", "variables", "static_argnums", "static_argnames", "donate_argnums", "device", "backend", "methods"),
    ),
    "remat": ("Checkpoint", ("rngs", "variables", "prevent_cse", "static_argnums", "policy", "concrete", "methods")),
    "checkpoint": (
        "Checkpoint",
        ("rngs", "variables", "prevent_cse", "static_argnums", "policy", "concrete", "methods"),
    ),
    "fold_rngs": ("Fold_rngs", ("rngs", "variables", "methods")),
    "map_variables": (
        "Map_variables",
        ("rngs", "variables", "init", "mutable", "mapped_collections", "trans_in_fn", "trans_out_fn", "methods"),
    ),
    "remat_scan": (
        "Remat_scan",
        ("lengths", "split_rngs", "variable_axes", "variable_broadcast", "variable_carry", "policy"),
    ),
}
FLOW = ("cond", "switch", "while_loop")
ITEM_KINDS = (
    ("make_rng", "param", "variable", "module", "call", "Sequential") + tuple(LAYERS) + tuple(LIFTS) + FLOW
) + ("ToLinen",)
TO_LINEN_SINCE = (0, 11)  # the NNX rules rngaudit models (Dropout forks its stream) and ToLinen's default stream


def _when(f: Fields) -> str | None:
    n = f.get("when")
    if n is None:
        return None
    w = as_str(n, "`when`")
    if w not in PHASES:
        raise SpecError(f"`when` must be init or apply, not {w!r}{suggest(w, PHASES)}", n.loc)
    return w


def _draw(f: Fields) -> Draw | None:
    n = f.get("draw")
    return None if n is None else parse_draw(n)


# ---------------------------------------------------------------- transform options
_ALL = ("all", "*")


def _required_int(f: Fields, key: str, kind: str, hi: int) -> int:
    n = f.get(key)
    if n is None:
        raise SpecError(f"{kind} needs `{key}` (a positive integer)", f.node.loc)
    return as_int(n, f"`{key}`", 1, hi)


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
        return tuple(as_str(x, f"a name in `{what}`") for x in n.value)
    raise SpecError(f"`{what}` must be true, false, a name or a list of names, not {type_name(v)}", n.loc)


def _split_rngs(n: YNode | None, default) -> tuple:
    if n is None:
        return default
    if isinstance(n.value, str) and n.value in _ALL or n.value is True:
        return ((True, True),)
    if n.value is False or n.value == "none":
        return ()
    if not n.is_map:
        raise SpecError(
            "`split_rngs` maps streams to true/false, e.g. {params: true, dropout: false} (`all` for every stream)",
            n.loc,
        )
    out = []
    for stream, v in n.value.items():
        if not isinstance(v.value, bool):
            raise SpecError(f"`split_rngs` values must be true or false; {stream!r} has {type_name(v.value)}", v.loc)
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


class BodyParser:
    """Module bodies: statements, standard layers and lifted transforms, as spec.tree nodes."""

    def __init__(self, rules: FlaxRules | None = None):
        self.nodes = 0
        self.rules = rules or FlaxRules()  # the release named: a construct it lacks is refused
        self.origin = ""  # who named it, when not the spec (an upgrade check's option)
        self.key_source: Callable | None = None  # reads a key as `rngs:` does (for the NNX module of a ToLinen)

    def items(self, node: YNode | None, what: str, in_setup: bool) -> tuple[Item, ...]:
        if node is None or node.value is None:
            return ()
        if not node.is_seq:
            raise SpecError(f"{what} must be a list of statements, not {type_name(node.value)}", node.loc)
        return tuple(self.item(n, in_setup) for n in node.value)

    def item(self, node: YNode, in_setup: bool) -> Item:
        if isinstance(node.value, str):
            kind, arg, kloc = node.value, YNode(None, node.loc), node.loc
        elif node.is_map and len(node.value) == 1:
            ((kind, arg),) = node.value.items()
            kloc = node.key_locs[kind]
        elif node.is_map:
            raise SpecError(
                "a statement is a mapping with exactly one key (make_rng, param, variable, module, "
                f"call, Sequential or a layer); this one has {len(node.value)}: "
                f"{', '.join(node.value)}; indent options under the statement",
                node.loc,
            )
        else:
            raise SpecError(
                f"a statement must be a mapping like `make_rng: dropout`, not {type_name(node.value)}", node.loc
            )
        if kind not in ITEM_KINDS:
            raise SpecError(
                f"unknown statement {kind!r}{suggest(kind, ITEM_KINDS)}; known: "
                "make_rng, param, variable, module, call, Sequential, " + ", ".join(LAYERS) + ", ToLinen",
                kloc,
            )
        if kind in LIFTS:
            return self._transform(kind, arg, kloc, in_setup)
        if kind in FLOW:
            if in_setup:
                raise SpecError(f"nn.{kind} runs inside a method; put it in `body`", kloc)
            return getattr(self, "_" + kind)(kind, arg, kloc)
        return getattr(
            self,
            "_" + kind
            if kind in ("make_rng", "param", "variable", "module", "call", "Sequential", "ToLinen")
            else "_layer",
        )(kind, arg, kloc, in_setup)

    def _make_rng(self, kind, arg: YNode, loc, in_setup):
        if arg.value is None:
            return MakeRng(loc, None, "params")
        if isinstance(arg.value, str):
            return MakeRng(loc, None, arg.value)
        if not arg.is_map:
            raise SpecError(
                f"make_rng takes a stream name (`make_rng: dropout`) or a mapping "
                f"(`make_rng: {{stream: dropout, repeat: 2}}`), not {type_name(arg.value)}",
                arg.loc,
            )
        f = Fields(arg, "make_rng", ("stream", "repeat", "label", "draw", "when"))
        return MakeRng(
            loc, _when(f), f.text("stream", "params"), f.integer("repeat", 1, 1, MAX_REPEAT), f.text("label"), _draw(f)
        )

    def _param(self, kind, arg: YNode, loc, in_setup):
        if isinstance(arg.value, str):
            return Param(loc, None, arg.value)
        if arg.value is None:
            raise SpecError("param needs a name: `param: w` or `param: {name: w, draw: ...}`", loc)
        if not arg.is_map:
            raise SpecError(
                f"param takes a name (`param: w`) or a mapping (`param: {{name: w, draw: ...}}`), "
                f"not {type_name(arg.value)}",
                arg.loc,
            )
        f = Fields(arg, "param", ("name", "draw", "when"), ("name",))
        draw = _draw(f)
        return Param(loc, _when(f), f.name("name"), draw, True if draw is not None else None)

    def _variable(self, kind, arg: YNode, loc, in_setup):
        f = Fields(arg, "variable", ("collection", "name", "make_rng", "eager", "draw", "when"), ("collection", "name"))
        streams: tuple[str, ...] = ()
        n = f.get("make_rng")
        if n is not None:
            if n.is_seq:
                streams = tuple(as_str(s, "a make_rng stream") for s in n.value)
            else:
                streams = (as_str(n, "`make_rng`"),)
        eager = f.flag("eager", False)
        if eager and not streams:
            raise SpecError("`eager: true` needs `make_rng:` (the stream passed as an argument)", loc)
        return Variable(loc, _when(f), f.name("collection"), f.name("name"), streams, eager, _draw(f))

    def _call(self, kind, arg: YNode, loc, in_setup):
        if isinstance(arg.value, str):
            return Call(loc, None, arg.value)
        if arg.value is None:
            raise SpecError("call needs the child's name: `call: Dense_0` or `call: {name: enc, repeat: 2}`", loc)
        if not arg.is_map:
            raise SpecError(
                f"call takes a child's name (`call: enc`) or a mapping (`call: {{name: enc, repeat: 2}}`), "
                f"not {type_name(arg.value)}",
                arg.loc,
            )
        f = Fields(arg, "call", ("name", "repeat", "when"), ("name",))
        return Call(loc, _when(f), f.name("name"), f.integer("repeat", 1, 1, MAX_REPEAT))

    def module_def(self, node: YNode, what: str, root: bool = False) -> tuple[ModuleDef, Fields]:
        allowed = ("class", "name", "setup", "body", "transforms") + (() if root else ("repeat", "when"))
        f = Fields(node, what, allowed, ("class",))
        lifts: tuple[Lift, ...] = ()
        tn = f.get("transforms")
        if tn is not None:
            if not tn.is_seq:
                raise SpecError(
                    "`transforms` is a list of method decorators, outermost first, e.g. [{jit: {}}]", tn.loc
                )
            for t in tn.value:
                if isinstance(t.value, str):
                    t = YNode({t.value: YNode({}, t.loc)}, t.loc, {t.value: t.loc})
                if not t.is_map or len(t.value) != 1:
                    raise SpecError("each transform is a mapping with one key, e.g. {jit: {rngs: [params]}}", t.loc)
                ((kind, opts),) = t.value.items()
                if kind not in LIFTS:
                    raise SpecError(
                        f"unknown transform {kind!r}{suggest(kind, LIFTS)}; known: {', '.join(LIFTS)}", t.key_locs[kind]
                    )
                lifts += self.lifts(
                    kind, opts if opts.value is not None else YNode({}, opts.loc), t.key_locs[kind], decorator=True
                )
        m = ModuleDef(
            f.name("class"),
            f.text("name"),
            self.items(f.get("setup"), "setup", True),
            self.items(f.get("body"), "body", False),
            node.loc,
            lifts=lifts,
        )
        return m, f

    def root(self, node: YNode) -> ModuleDef:
        if node.is_map and len(node.value) == 1 and next(iter(node.value)) in LIFTS:
            ((kind, arg),) = node.value.items()
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
                raise SpecError(
                    "put `name:` on the transform statement, not inside `module:` (the name "
                    "belongs to the transformed instance)",
                    f.node.key_locs["name"],
                )
            return m
        if node.is_map and len(node.value) == 1:
            ((kind, arg),) = node.value.items()
            kloc = node.key_locs[kind]
            if kind in LIFTS:
                return self._transform(kind, arg, kloc, False, nested=True).target
            if kind in LAYERS:
                child = self._layer(kind, arg, kloc, False)
                if child.module.name is not None or child.repeat != 1 or child.when is not None:
                    raise SpecError(
                        "put `name`, `repeat` and `when` on the transform statement, not on the wrapped layer", kloc
                    )
                return child.module
            raise SpecError(
                f"`module` must be a module ({{class: ..., body: [...]}}), a standard layer "
                f"({{Dense: {{...}}}}) or a transform; {kind!r} is none of these"
                f"{suggest(kind, tuple(LAYERS) + tuple(LIFTS))}",
                kloc,
            )
        raise SpecError(
            "`module` must be a module ({class: ..., body: [...]}), a standard layer "
            "({Dense: {...}}) or a transform ({jit: {module: ...}})",
            node.loc,
        )

    def _transform(self, kind, arg: YNode, loc, in_setup, root=False, nested=False):
        prefix, allowed = LIFTS[kind]
        outer = () if (root or nested) else ("name", "repeat", "when")
        f = Fields(arg, kind, ("module",) + allowed + outer, ("module",))
        target = self.target(f.need("module"), f"module of {kind}")
        opts = YNode(
            {k: v for k, v in arg.value.items() if k not in ("module", "name", "repeat", "when")},
            arg.loc,
            {k: v for k, v in arg.key_locs.items()},
        )
        lifts = self.lifts(kind, opts, loc)
        mod = dataclasses.replace(
            target,
            cls=prefix + target.cls,
            name=None if root or nested else f.text("name"),
            lifts=lifts + target.lifts,
            impl_cls=target.impl_cls or target.cls,
        )
        if root or nested:
            return Transform(loc, None, mod, 1)
        if in_setup:
            if mod.name is None:
                raise SpecError("a transformed module created in setup is named by its attribute: give `name:`", loc)
            return Define(loc, _when(f), mod)
        return Transform(loc, _when(f), mod, f.integer("repeat", 1, 1, MAX_REPEAT))

    def _too_old(self, what: str, loc) -> SpecError:
        """`what` (a construct the named release lacks) refused: the release that has it, and who named this one."""
        have = version_text(self.rules.version)
        said = f"{self.origin} says flax {have}" if self.origin else f"this spec says flax {have} (`flax: version`)"
        return SpecError(f"{what} is flax {version_text(LINEN_SINCE[what])} and later; {said}", loc)

    def lifts(self, kind: str, node: YNode, loc: Location, decorator: bool = False) -> tuple[Lift, ...]:
        """Normalised options of one transform; remat_scan becomes its nested scans."""
        _, allowed = LIFTS[kind]
        f = Fields(node, kind, allowed)
        ccs = "check_constancy_invariants"
        for what, used, where in (
            ("nn.fold_rngs", kind == "fold_rngs", loc),
            (f"nn.scan's {ccs}", ccs in node.value, node.key_locs.get(ccs)),
        ):
            if used and self.rules.lacks(what):
                raise self._too_old(what, where)
        opts: dict = {}
        if kind == "vmap":
            opts["axis_size"] = _required_int(f, "axis_size", kind, MAX_LANES)
        if kind == "scan":
            opts["length"] = _required_int(f, "length", kind, MAX_LANES)
            opts["check_constancy_invariants"] = f.flag("check_constancy_invariants", True)
            f.flag("reverse", False)
        if kind in ("vmap", "scan", "remat_scan"):
            opts["split_rngs"] = _split_rngs(
                f.get("split_rngs"), default=() if kind != "remat_scan" else ((True, True),)
            )
            opts["variable_axes"] = _variable_axes(f.get("variable_axes"), () if kind != "remat_scan" else ((True, 0),))
        if kind in ("scan", "remat_scan"):
            opts["variable_broadcast"] = _filter(f.get("variable_broadcast"), False, "variable_broadcast")
            opts["variable_carry"] = _filter(f.get("variable_carry"), False, "variable_carry")
        if kind in ("jit", "remat", "checkpoint", "fold_rngs", "map_variables"):
            opts["rngs"] = _filter(f.get("rngs"), True, "rngs")
        if kind == "map_variables":
            opts["init"] = f.flag("init", False)
            opts["mutable"] = f.flag("mutable", False)
            opts["mapped_collections"] = _filter(f.get("mapped_collections"), True, "mapped_collections")
        norm = "remat" if kind == "checkpoint" else kind
        if kind != "remat_scan":
            return (Lift(norm, tuple(opts.items()), loc),)
        ln = f.get("lengths")
        if ln is None:
            raise SpecError("remat_scan needs `lengths: [a, b, ...]` (iterations per level)", node.loc)
        if not ln.is_seq or not ln.value:
            raise SpecError("`lengths` must be a non-empty list of positive integers", ln.loc)
        lengths = [as_int(n, "a length", 1, MAX_LANES) for n in ln.value]
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
        f = Fields(arg, "cond", ("true_fun", "false_fun", "rngs", "variables", "when"), ("true_fun", "false_fun"))
        return Cond(
            loc,
            _when(f),
            (self._branches(f.get("true_fun"), "true_fun"), self._branches(f.get("false_fun"), "false_fun")),
            _filter(f.get("rngs"), True, "rngs"),
            "cond",
        )

    def _switch(self, kind, arg: YNode, loc):
        f = Fields(arg, "switch", ("branches", "rngs", "variables", "when"), ("branches",))
        bn = f.need("branches")
        if not bn.is_seq or not bn.value:
            raise SpecError("`branches` must be a non-empty list of statement lists", bn.loc)
        return Cond(
            loc,
            _when(f),
            tuple(self._branches(b, "a branch") for b in bn.value),
            _filter(f.get("rngs"), True, "rngs"),
            "switch",
        )

    def _while_loop(self, kind, arg: YNode, loc):
        f = Fields(
            arg,
            "while_loop",
            ("cond", "body", "iterations", "split_rngs", "carry_variables", "broadcast_variables", "when"),
            ("cond", "body", "iterations"),
        )
        return WhileLoop(
            loc,
            _when(f),
            self._branches(f.get("cond"), "cond"),
            self._branches(f.get("body"), "body"),
            as_int(f.need("iterations"), "`iterations`", 0, MAX_LANES),
            _split_rngs(f.get("split_rngs"), ()),
        )

    def _module(self, kind, arg: YNode, loc, in_setup):
        m, f = self.module_def(arg, "module")
        return self._child(m, f, loc, in_setup)

    def _child(self, m: ModuleDef, f: Fields, loc, in_setup):
        repeat = f.integer("repeat", 1, 1, MAX_REPEAT)
        if in_setup:
            if m.name is None:
                raise SpecError(
                    "a module created in setup is named by its attribute: give `name:` "
                    "(self.enc = ... -> enc; a list self.layers = [...] -> layers_0, layers_1; "
                    "a dict -> dct_<key>)",
                    loc,
                )
            if repeat != 1:
                raise SpecError("`repeat` is not available in setup; list each attribute", f.need("repeat").loc)
            return Define(loc, _when(f), m)
        return Child(loc, _when(f), m, repeat)

    def _ToLinen(self, kind, arg: YNode, loc, in_setup):
        """`bridge.ToLinen(NnxClass)` (or `bridge.to_linen`): `module` is the NNX module, as an NNX spec's
        `model` (class, init, call, keep_rngs)."""
        from .nnx import NnxBridge, NnxCall, NnxChild, NnxParser, nested

        if not arg.is_map:
            raise SpecError(
                "`ToLinen` takes a mapping: module (the NNX module it builds, as an NNX spec's model: {class, init, "
                "call}), and name, skip_rng, repeat, when",
                loc,
            )
        f = Fields(arg, "ToLinen", ("module", "name", "skip_rng", "repeat", "when"), ("module",))
        if self.rules.version is not None and self.rules.version < TO_LINEN_SINCE:
            have = version_text(self.rules.version)
            said = f"{self.origin} says flax {have}" if self.origin else f"this spec says flax {have} (`flax: version`)"
            raise SpecError(
                f"rngaudit models bridge.ToLinen with the NNX rules of flax {version_text(TO_LINEN_SINCE)} and later; "
                f"{said}",
                loc,
            )
        parser = NnxParser()
        parser.version = self.rules.version
        parser.origin = self.origin
        parser.key_source = self.key_source
        mn = f.need("module")
        module = parser.module(mn, "the NNX `module` of ToLinen")

        def refuse_inside(m) -> None:
            for st in m.init:
                if isinstance(st, NnxBridge):
                    raise SpecError(
                        "a bridge.ToNNX inside the NNX module of a ToLinen: rngaudit does not model bridges inside "
                        "bridges yet",
                        st.loc,
                    )
                if isinstance(st, NnxChild):
                    refuse_inside(st.module)
            for st, _ in nested(m.call):
                if isinstance(st, NnxCall) and st.given_rngs == "call":
                    raise SpecError(
                        "`rngs: call` gives a Dropout the Rngs the model's call is given; a ToLinen's NNX module "
                        "is called by ToLinen with the arguments of the Linen call: write the Rngs it is built from "
                        "(`rngs: model`) or a `key:`",
                        st.loc,
                    )

        refuse_inside(module)
        m = ModuleDef(
            "ToLinen",
            f.text("name"),
            (),
            (),
            arg.loc,
            to_linen=ToLinenDef(module, f.flag("skip_rng", False)),
        )
        return self._child(m, f, loc, in_setup)

    def _Sequential(self, kind, arg: YNode, loc, in_setup):
        f = Fields(arg, "Sequential", ("name", "layers", "when"), ("layers",))
        n = f.need("layers")
        if not n.is_seq or not n.value:
            raise SpecError("`layers` must be a non-empty list of modules or layers", n.loc)
        layers = []
        for ln in n.value:
            item = self.item(ln, False)
            if not isinstance(item, (Child, Transform)) or item.repeat != 1:
                raise SpecError(
                    "Sequential layers must be modules, standard layers or transformed modules (no repeat)", ln.loc
                )
            if item.when is not None:
                raise SpecError(
                    "`when` on a layer inside a Sequential is not supported: put `when` on the Sequential", ln.loc
                )
            layers.append(item.module if isinstance(item, Child) else item.target)
        name = f.text("name")
        if in_setup and name is None:
            raise SpecError("a Sequential created in setup needs `name:` (its attribute name)", loc)
        return Sequential(loc, _when(f), name, tuple(layers), in_setup)

    def _layer(self, kind, arg: YNode, loc, in_setup):
        lk = LAYERS[kind]
        if f"nn.{kind}" in LINEN_SINCE and self.rules.lacks(f"nn.{kind}"):
            raise self._too_old(f"nn.{kind}", loc)
        if arg.value is None:
            arg = YNode({}, arg.loc)
        allowed = ("name", "draw", "when", "repeat") + tuple(lk.options) + lk.passive
        f = Fields(arg, kind, allowed)
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
                raise SpecError(
                    f"`{opt}` must be {'true or false' if want is bool else 'a string'}, not {type_name(v)}", n.loc
                )
            opts[opt] = v
        draws = {}
        dn = f.get("draw")
        if dn is not None:
            if not dn.is_map:
                raise SpecError(
                    f"`draw` of a {kind} maps its param names to draws, e.g. {{{lk.params[0]}: {{normal: [2, 2]}}}}",
                    dn.loc,
                )
            for pname, pnode in dn.value.items():
                if pname not in lk.params:
                    raise SpecError(
                        f"{kind} has no {pname!r} to draw{suggest(pname, lk.params)}; it has {', '.join(lk.params)}",
                        dn.key_locs[pname],
                    )
                draws[pname] = parse_draw(pnode, f"draw of {pname}")
        hyper = {opt: n.plain() for opt in lk.passive if (n := f.get(opt)) is not None}
        m = make_layer(kind, opts, loc, f.text("name"), draws, hyper)
        return self._child(m, f, loc, in_setup)
