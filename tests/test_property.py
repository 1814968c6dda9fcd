"""Random module trees, written as spec YAML, replayed by rngaudit and built in real Flax: no difference."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import yaml
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

from flax_oracle import OracleUnsupported, check_against_flax
from rngaudit import parse_spec

EXAMPLES = int(os.environ.get("RNGAUDIT_HYPOTHESIS_EXAMPLES", "60"))

STREAMS = ("params", "dropout", "noise", "ß", "")
CLASSES = ("Block", "B2", "Ünï", "_", "9", "Dense")
NAMES = ("a", "b_1", "0", "12", "", "é", "漢字", "x y", "_", "__x", "Block_0", "Dense_0", "w", "layers_0")
PARAMS = ("w", "b", "0", "", "kernel", "ü", "Block_0", "a")
COLLECTIONS = ("state", "cache", "params", "batch_stats")
MUTABLE = (None, False, True, ["params"], ["state"], ["params", "state", "batch_stats", "cache"])
SEQ_LAYERS = ("Dense", "DenseGeneral", "Conv", "LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm",
              "Dropout", "MultiHeadDotProductAttention", "SelfAttention")
LAYERS = SEQ_LAYERS + ("Embed", "Einsum", "ConvTranspose", "ConvLocal", "InstanceNorm", "MultiHeadAttention")
WIDTH = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}
# Names: the edge cases above, or short strings of letters, digits, '_', ' ', '/' and unicode.
child_name = st.one_of(st.sampled_from(NAMES), *[st.text(alphabet="ab_09é漢 /", min_size=1, max_size=5)] * 2)
var_name = st.one_of(st.sampled_from(PARAMS), st.text(alphabet="wb_1ü", min_size=1, max_size=4))


def maybe(draw, p: float) -> bool:
    return draw(st.floats(0, 1)) < p


# ---------------------------------------------------------------- keys
@st.composite
def key_exprs(draw, width: int):
    seed = draw(st.one_of(st.integers(0, 50), st.integers(-(2**63), 2**63 - 1)))
    kind = draw(st.sampled_from(("seed", "seed", "key", "split", "fold_in", "raw")))
    if kind == "seed":
        return seed
    if kind == "raw":
        return draw(st.lists(st.integers(0, 2**32 - 1), min_size=width, max_size=width))
    inner = f"key({seed})"
    if kind == "split":
        n = draw(st.integers(1, 6))
        return f"split({inner}, {n})[{draw(st.integers(0, n - 1))}]"
    if kind == "fold_in":
        return f"fold_in({inner}, {draw(st.integers(0, 2**32 - 1))})"
    return inner


# ---------------------------------------------------------------- layers
def _when(draw) -> dict:
    return {"when": draw(st.sampled_from(("init", "apply")))} if maybe(draw, 0.12) else {}


def _name(draw, in_setup: bool, chainable: bool) -> dict:
    """setup children are named by their attribute; layers of a Sequential built in setup never are."""
    if in_setup:
        return {} if chainable else {"name": draw(child_name)}
    return {"name": draw(child_name)} if maybe(draw, 0.25) else {}


@st.composite
def layer_options(draw, kind: str, chainable: bool) -> dict:
    o: dict = {}
    flag = lambda: draw(st.booleans())  # noqa: E731
    if kind in ("Dense", "DenseGeneral", "Einsum", "Conv", "ConvTranspose", "ConvLocal"):
        o["use_bias"] = flag()
    elif kind in ("LayerNorm", "BatchNorm", "GroupNorm", "InstanceNorm"):
        o.update(use_scale=flag(), use_bias=flag())
    elif kind == "RMSNorm":
        o["use_scale"] = flag()
    elif kind == "Dropout":
        o.update(rate=draw(st.sampled_from((0.0, 0.5, 1.0, 0.25))), deterministic=flag())
        if maybe(draw, 0.3):
            o["rng_collection"] = draw(st.sampled_from(STREAMS))
        if not chainable and maybe(draw, 0.2):
            o["rng"] = True
    elif "Attention" in kind:
        o.update(use_bias=flag(), normalize_qk=flag())
        if maybe(draw, 0.6):
            o.update(dropout_rate=draw(st.sampled_from((0.1, 0.5))), deterministic=flag())
            if not chainable and maybe(draw, 0.2):
                o["dropout_rng"] = True
    return {k: v for k, v in o.items() if maybe(draw, 0.7) or k in ("rate", "deterministic")}


# ---------------------------------------------------------------- module trees
class _Names:
    """The child names a body has made so far, for `call:` (auto-names follow the per-class cursor)."""

    def __init__(self, known=()):
        self.known = list(known)
        self.cursor: dict = {}

    def add(self, cls: str, name: str | None, repeat: int = 1) -> None:
        for _ in range(repeat):
            if name is None:
                n = self.cursor.get(cls, 0)
                self.cursor[cls] = n + 1
                self.known.append(f"{cls}_{n}")
            else:
                self.known.append(name)

    def fork(self) -> "_Names":
        other = _Names(self.known)
        other.cursor = dict(self.cursor)
        return other

    def adopt(self, other: "_Names") -> None:
        self.known, self.cursor = other.known, other.cursor


@st.composite
def layer_item(draw, made: _Names | None, in_setup: bool, chainable: bool = False):
    kind = draw(st.sampled_from(SEQ_LAYERS if chainable else LAYERS))
    item = draw(layer_options(kind, chainable))
    item.update(_name(draw, in_setup, chainable))
    when = {} if chainable else _when(draw)  # a Sequential calls its layers whatever their `when`
    if made is not None and not when:
        made.add(kind, item.get("name"))
    return {kind: {**item, **when}}


@st.composite
def module_item(draw, depth: int, made: _Names | None, in_setup: bool, chainable: bool = False):
    mod = draw(module_def(depth - 1))
    mod.update(_name(draw, in_setup, chainable))
    if not (in_setup or chainable) and maybe(draw, 0.15 if "name" not in mod else 0.02):
        mod["repeat"] = draw(st.integers(2, 3))
    when = {} if chainable else _when(draw)
    if made is not None and not when:
        made.add(mod["class"], mod.get("name"), mod.get("repeat", 1))
    return {"module": {**mod, **when}}


@st.composite
def sequential_item(draw, depth: int, made: _Names, in_setup: bool):
    layers = []
    inner = None if in_setup else made.fork()  # compact: the layers are named in this body
    for _ in range(draw(st.integers(1, 3))):
        if depth > 0 and maybe(draw, 0.3):
            layers.append(draw(module_item(depth, inner, in_setup, chainable=True)))
        else:
            layers.append(draw(layer_item(inner, in_setup, chainable=True)))
    item = {"layers": layers}
    if in_setup or maybe(draw, 0.3):
        item["name"] = draw(child_name)
    when = _when(draw)
    if not when:
        if inner is not None:
            made.adopt(inner)
        made.add("Sequential", item.get("name"))
    return {"Sequential": {**item, **when}}


@st.composite
def rng_item(draw):
    stream = draw(st.sampled_from(STREAMS))
    if maybe(draw, 0.5):
        return "make_rng" if stream == "params" and maybe(draw, 0.5) else {"make_rng": stream}
    item = {"stream": stream}
    if maybe(draw, 0.3):
        item["repeat"] = draw(st.one_of(st.integers(2, 4), st.integers(250, 300)))
    if maybe(draw, 0.1):
        item["draw"] = {"normal": [2]}
    return {"make_rng": {**item, **_when(draw)}}


@st.composite
def param_item(draw):
    name = draw(var_name)
    if maybe(draw, 0.6):
        return {"param": name}
    item = {"name": name}
    if maybe(draw, 0.2):
        item["draw"] = {"uniform": []}  # a float32 scalar, like the oracle's undrawn params
    return {"param": {**item, **_when(draw)}}


@st.composite
def variable_item(draw):
    item = {"collection": draw(st.sampled_from(COLLECTIONS)), "name": draw(var_name)}
    streams = draw(st.lists(st.sampled_from(STREAMS), max_size=2))
    if streams:
        item["make_rng"] = streams if len(streams) > 1 or maybe(draw, 0.5) else streams[0]
        if maybe(draw, 0.4):
            item["eager"] = True
    return {"variable": {**item, **_when(draw)}}


@st.composite
def items(draw, depth: int, in_setup: bool, made: _Names, min_size: int, max_size: int):
    out = []
    for _ in range(draw(st.integers(min_size, max_size))):
        kinds = ["make_rng", "make_rng", "param", "variable", "layer"]
        if depth > 0:
            kinds += ["module", "module", "sequential"]
        if made.known:
            kinds.append("call")
        kind = draw(st.sampled_from(kinds))
        if kind == "make_rng":
            out.append(draw(rng_item()))
        elif kind == "param":
            out.append(draw(param_item()))
        elif kind == "variable":
            out.append(draw(variable_item()))
        elif kind == "layer":
            out.append(draw(layer_item(made, in_setup)))
        elif kind == "module":
            out.append(draw(module_item(depth, made, in_setup)))
        elif kind == "sequential":
            out.append(draw(sequential_item(depth, made, in_setup)))
        else:
            target = draw(st.sampled_from(made.known))
            out.append({"call": target} if maybe(draw, 0.6) else
                       {"call": {"name": target, "repeat": draw(st.integers(1, 2)), **_when(draw)}})
    return out


@st.composite
def module_def(draw, depth: int):
    mod: dict = {"class": draw(st.sampled_from(CLASSES))}
    setup_names = _Names()
    if maybe(draw, 0.3):
        mod["setup"] = draw(items(depth, True, setup_names, 1, 3))
    mod["body"] = draw(items(depth, False, _Names(setup_names.known), 2 if depth == 3 else 0, 5))
    return mod


@st.composite
def specs(draw) -> str:
    impl = draw(st.sampled_from(("threefry2x32",) * 6 + ("rbg",) * 2 + ("unsafe_rbg",)))
    streams = draw(st.lists(st.sampled_from(STREAMS), unique=True, max_size=4))
    if "params" not in streams and maybe(draw, 0.8):
        streams.append("params")
    phase = draw(st.sampled_from(("init", "apply")))
    doc = {
        "rngaudit": 1,
        "flax": {"fix_rng_separator": draw(st.booleans())},
        "jax": {"prng_impl": impl, "threefry_partitionable": draw(st.booleans())},
        "phase": phase,
        "rngs": {s: draw(key_exprs(WIDTH[impl])) for s in streams},
        "model": draw(module_def(3)),
    }
    mutable = draw(st.sampled_from(MUTABLE)) if phase == "apply" else None
    if mutable is not None:
        doc["mutable"] = mutable
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs(), st.booleans())
def test_random_models_match_flax(text, raw_keys):
    """raw_keys: Flax gets jax.random.PRNGKey / raw uint32 data instead of typed keys (R18)."""
    agreement = check_against_flax(parse_spec(text, "<hypothesis>"), raw_keys=raw_keys)
    size = next(label for bound, label in ((0, "0"), (4, "1-4"), (19, "5-19"), (99, "20-99"))
                if agreement.keys <= bound) if agreement.keys < 100 else "100+"
    event(f"flax raises {agreement.error}" if agreement.error else
          f"keys: {size}" + (", with fallback" if agreement.fallbacks else ""))


# ---------------------------------------------------------------- lifted transforms
# Random models with nn.vmap / scan / jit / remat / fold_rngs / map_variables / remat_scan (as class
# transforms, nested up to 3 deep, and as method decorators), nn.while_loop, nn.cond and nn.switch.
# The generator stays clear of the differences tests/test_transforms.py documents at its end
# (known, reported) so that a failure here is a new one:
#   map_variables always has init: true; cond/switch/while bodies create no variables; no
#   variable_carry; a scan that broadcasts params splits no stream and has no eager variable in
#   params; check_constancy_invariants: false only without variable_broadcast; vmap and scan map
#   every collection (variable_axes {all: 0}); rngs are in sorted order (jax sorts the streams a
#   jitted function receives); no unsafe_rbg (jax splits a batch of unsafe_rbg keys differently);
#   no Embed as a transform's target (its param is made in setup, outside a jit's rngs filter); no
#   setup() in a module with method decorators (setup runs outside them: a vmap then finds its
#   variables unbatched). Errors whose only difference is the class or scope path Flax names inside
#   a transform are counted as known (see _known_difference). In apply, `mutable` is never a list
#   (map_variables(init=True) then cannot see the other collections in its first run). No `call:`
#   in setup() of a module that may be transformed (Flax checks setup abstractly, without keys,
#   before the transform, and a child made and called there cannot make its params).
TRANSFORM_EXAMPLES = int(os.environ.get("RNGAUDIT_HYPOTHESIS_TRANSFORM_EXAMPLES", "12"))
LAST_EXAMPLE = os.environ.get("RNGAUDIT_HYPOTHESIS_LAST_EXAMPLE")  # a file: each example is written there first
T_STREAMS = ("params", "dropout", "noise", "ß", "")
PREFIX = {"vmap": "Vmap", "scan": "Scan", "jit": "Jit", "remat": "Checkpoint", "checkpoint": "Checkpoint",
          "fold_rngs": "Fold_rngs", "map_variables": "Map_variables", "remat_scan": "Remat_scan"}
FLOW_CLASSES = ("Br", "Br2")  # classes made only inside cond/while branches (their auto-names stay apart)
T_LAYERS = ("Dense", "LayerNorm", "Dropout", "Conv", "BatchNorm", "MultiHeadDotProductAttention")


@dataclass(frozen=True)
class _Ctx:
    tdepth: int = 0  # lifted transforms around this body
    inside: bool = False  # inside a transform: no `when`
    bcast: bool = False  # inside a scan that broadcasts params
    apply: bool = False  # phase apply: params stays visible (init of the model must succeed)


def _strip(item, ctx: _Ctx):
    """Drop `when` inside transforms, and eager variables of params inside a broadcasting scan."""
    if isinstance(item, list):
        return [_strip(x, ctx) for x in item]
    if not isinstance(item, dict):
        return item
    out = {}
    for k, v in item.items():
        if k == "when" and ctx.inside:
            continue
        out[k] = _strip(v, ctx)
    v = out.get("variable")
    if ctx.bcast and isinstance(v, dict) and v.get("collection") == "params":
        v.pop("eager", None)
    return out


def _filter_value(draw, streams, ctx: _Ctx):
    if maybe(draw, 0.5):
        return "all"
    picked = draw(st.lists(st.sampled_from(streams), unique=True, min_size=0, max_size=3))
    if ctx.apply and "params" not in picked:  # (init gives params a key even when rngs does not)
        picked.append("params")
    return picked


def _split_rngs(draw, streams, ctx: _Ctx, split: bool | None = None):
    if split is None and maybe(draw, 0.25):
        return "all"
    picked = draw(st.lists(st.sampled_from(streams), unique=True, max_size=len(streams)))
    if ctx.apply and "params" not in picked:  # (init gives params a key even when rngs does not)
        picked.append("params")
    return {s: (draw(st.booleans()) if split is None else split) for s in picked}


@st.composite
def lift_options(draw, kind: str, streams, ctx: _Ctx) -> tuple[dict, _Ctx]:
    o: dict = {}
    inner = _Ctx(ctx.tdepth + 1, True, ctx.bcast, ctx.apply)
    if kind == "vmap":
        o.update(axis_size=draw(st.integers(1, 3)), split_rngs=_split_rngs(draw, streams, ctx),
                 variable_axes={"all": 0})
    elif kind == "scan":
        o.update(length=draw(st.integers(1, 3)), variable_axes={"all": 0})
        if maybe(draw, 0.3):
            o.update(variable_broadcast="params", split_rngs=_split_rngs(draw, streams, ctx, split=False))
            inner = _Ctx(ctx.tdepth + 1, True, True, ctx.apply)
        else:
            o["split_rngs"] = _split_rngs(draw, streams, ctx)
            if maybe(draw, 0.3):
                o["check_constancy_invariants"] = False
    elif kind == "remat_scan":
        o["lengths"] = draw(st.lists(st.integers(1, 2), min_size=1, max_size=2))
        if maybe(draw, 0.5):
            o["split_rngs"] = _split_rngs(draw, streams, ctx)
    elif kind in ("jit", "remat", "checkpoint", "fold_rngs"):
        if maybe(draw, 0.4):
            o["rngs"] = _filter_value(draw, streams, ctx)
    elif kind == "map_variables":
        o["init"] = True
        if maybe(draw, 0.4):
            o["mutable"] = True
        if maybe(draw, 0.3):
            o["rngs"] = _filter_value(draw, streams, ctx)
    return o, inner


def _next_req(kind: str, req: str) -> str:
    """What the wrapped call must return: 'any', 'carry' (remat_scan's body) or 'scanbody' (scan's)."""
    return {"scan": "scanbody", "remat_scan": "carry"}.get(kind, req)


def _kinds_for(req: str) -> tuple[str, ...]:
    kinds = ("vmap", "scan", "jit", "remat", "checkpoint", "fold_rngs", "map_variables", "remat_scan")
    if req == "scanbody":
        return tuple(k for k in kinds if k != "remat_scan")
    if req == "carry":
        return tuple(k for k in kinds if k != "scan")
    return kinds


@st.composite
def transform_item(draw, depth: int, made: _Names, streams, ctx: _Ctx, top: bool = True):
    """A transform statement (its target: a layer, a module, or another transform)."""
    chain = []
    req = "any"
    c = ctx
    for _ in range(draw(st.integers(1, max(1, 3 - ctx.tdepth)))):
        kind = draw(st.sampled_from(_kinds_for(req)))
        opts, c = draw(lift_options(kind, streams, c))
        chain.append((kind, opts))
        req = _next_req(kind, req)
    if req == "any" and maybe(draw, 0.35):
        layer = draw(st.sampled_from(T_LAYERS))
        target = {layer: draw(layer_options(layer, True))}  # (no key passed to the call)
        base = layer
    else:
        target = draw(tmodule_def(depth - 1, streams, c, req))
        base = target["class"]
    for kind, opts in reversed(chain):
        target = {kind: {"module": target, **opts}}
    (kind, body), = target.items()
    cls = "".join(PREFIX[k] for k, _ in chain) + base
    if top:
        if maybe(draw, 0.2):
            body["name"] = draw(child_name)
        elif maybe(draw, 0.15):
            body["repeat"] = 2
        made.add(cls, body.get("name"), body.get("repeat", 1))
    return target


@st.composite
def decorators(draw, streams, ctx: _Ctx) -> tuple[list, _Ctx, str]:
    out, req, c = [], "any", ctx
    for _ in range(draw(st.integers(1, max(1, 3 - ctx.tdepth)))):
        kind = draw(st.sampled_from(_kinds_for(req)))
        opts, c = draw(lift_options(kind, streams, c))
        out.append({kind: opts})
        req = _next_req(kind, req)
    return out, c, req


@st.composite
def flow_items(draw, depth: int, streams, ctx: _Ctx):
    """Statements of a cond/switch branch or a while cond/body: keys only, no variables."""
    made = _Names()
    out = []
    for _ in range(draw(st.integers(0, 3))):
        kinds = ["make_rng", "make_rng", "dropout"] + (["module", "jit"] if depth > 0 else [])
        if made.known:
            kinds.append("call")
        kind = draw(st.sampled_from(kinds))
        if kind == "make_rng":
            out.append(_strip(draw(rng_item()), _Ctx(inside=True)))  # (no `when` in a branch)
        elif kind == "dropout":
            out.append({"Dropout": {"rate": 0.5, "deterministic": False,
                                    **({"rng_collection": draw(st.sampled_from(streams))} if maybe(draw, 0.3) else {})}})
        elif kind in ("module", "jit"):
            cls = draw(st.sampled_from(FLOW_CLASSES))
            mod = {"class": cls, "body": draw(flow_items(depth - 1, streams, ctx))}
            if kind == "module":
                out.append({"module": mod})
                made.add(cls, None)
            else:
                tkind = draw(st.sampled_from(("jit", "fold_rngs", "remat")))
                out.append({tkind: {"module": mod}})
                made.add(PREFIX[tkind] + cls, None)
        else:
            out.append({"call": draw(st.sampled_from(made.known))})
    return out


@st.composite
def flow_item(draw, depth: int, streams, ctx: _Ctx):
    kind = draw(st.sampled_from(("while_loop", "cond", "switch")))
    if kind == "while_loop":
        item = {"cond": draw(flow_items(depth, streams, ctx)), "body": draw(flow_items(depth, streams, ctx)),
                "iterations": draw(st.integers(0, 3))}
        if ctx.apply or maybe(draw, 0.8):
            item["split_rngs"] = _split_rngs(draw, streams, ctx)
    elif kind == "cond":
        item = {"true_fun": draw(flow_items(depth, streams, ctx)), "false_fun": draw(flow_items(depth, streams, ctx))}
    else:
        item = {"branches": [draw(flow_items(depth, streams, ctx)) for _ in range(draw(st.integers(1, 3)))]}
    if kind != "while_loop" and maybe(draw, 0.3):
        item["rngs"] = _filter_value(draw, streams, ctx)
    return {kind: item}


@st.composite
def titems(draw, depth: int, in_setup: bool, made: _Names, min_size: int, max_size: int, streams, ctx: _Ctx):
    out = []
    for _ in range(draw(st.integers(min_size, max_size))):
        kinds = ["make_rng", "make_rng", "param", "variable", "layer"]
        if depth > 0:
            kinds += ["module", "sequential"]
            if not in_setup:
                kinds += ["flow"] + (["transform", "transform"] if ctx.tdepth < 3 else [])
        if made.known:
            kinds.append("call")
        kind = draw(st.sampled_from(kinds))
        if kind == "make_rng":
            item = draw(rng_item())
        elif kind == "param":
            item = draw(param_item())
        elif kind == "variable":
            item = draw(variable_item())
        elif kind == "layer":
            item = draw(layer_item(made, in_setup))
        elif kind == "module":
            item = draw(module_item(depth, made, in_setup))
        elif kind == "sequential":
            item = draw(sequential_item(depth, made, in_setup))
        elif kind == "flow":
            item = draw(flow_item(depth - 1, streams, ctx))
        elif kind == "transform":
            item = draw(transform_item(depth, made, streams, ctx))
        else:
            target = draw(st.sampled_from(made.known))
            item = {"call": target} if maybe(draw, 0.6) else {
                "call": {"name": target, "repeat": draw(st.integers(1, 2)), **_when(draw)}}
        out.append(_strip(item, ctx))
    return out


@st.composite
def tmodule_def(draw, depth: int, streams, ctx: _Ctx, req: str = "any"):
    """A module whose body may hold transforms; `req` says what its __call__ must return (the
    oracle builds it accordingly). Sometimes with method decorators (`transforms:`)."""
    mod: dict = {"class": draw(st.sampled_from(CLASSES))}
    c = ctx
    if req == "any" and ctx.tdepth < 3 and maybe(draw, 0.15):
        mod["transforms"], c, _ = draw(decorators(streams, ctx))
    setup_names = _Names()
    if "transforms" not in mod and maybe(draw, 0.25):
        setup = _strip(draw(items(max(depth, 0), True, setup_names, 1, 2)), c)
        mod["setup"] = [s for s in setup if "call" not in s]  # (see the comment above)
    mod["body"] = draw(titems(max(depth, 0), False, _Names(setup_names.known), 1 if depth >= 2 else 0, 4,
                              streams, c))
    return mod


@st.composite
def transform_specs(draw) -> str:
    impl = draw(st.sampled_from(("threefry2x32",) * 3 + ("rbg",)))
    streams = draw(st.lists(st.sampled_from(T_STREAMS), unique=True, max_size=3))
    if "params" not in streams and maybe(draw, 0.85):
        streams.append("params")
    streams = sorted(streams)
    names = tuple(streams) or ("params",)
    phase = draw(st.sampled_from(("init", "apply")))
    ctx = _Ctx(apply=phase == "apply")
    if maybe(draw, 0.2):
        model = draw(transform_item(3, _Names(), names, ctx, top=False))
    else:
        model = draw(tmodule_def(3, names, ctx))
    doc = {
        "rngaudit": 1,
        "flax": {"fix_rng_separator": draw(st.booleans())},
        "jax": {"prng_impl": impl, "threefry_partitionable": draw(st.booleans())},
        "phase": phase,
        "rngs": {s: draw(key_exprs(WIDTH[impl])) for s in streams},
        "model": model,
    }
    # (not a list: map_variables(init=True) fails in apply on a collection not in it, see test_transforms)
    mutable = draw(st.sampled_from([m for m in MUTABLE if not isinstance(m, list)]))
    if phase == "apply" and mutable is not None:
        doc["mutable"] = mutable
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def _known_difference(message: str) -> str | None:
    """Both sides raise the same Flax error and only its message differs in a way
    tests/test_transforms.py documents: inside a lifted transform Flax names the module by its
    original class and the scope by its debug path ("/vmap(VmapB_0)", "/while_loop()")."""
    m = re.match(r"rngaudit: 'Flax raises (\w+): (.*)'; flax: '(.*)'$", message, re.S)
    if m is None:
        return None
    ours, theirs = m.group(2), m.group(3)
    a, b = re.search(r"in Module (\S+?)[:.]", ours), re.search(r"in Module (\S+?)[:.]", theirs)
    if a and b and a.group(1) != b.group(1) and (a.group(1).endswith(b.group(1)) or
                                                  b.group(1).endswith(a.group(1))):
        return "the class named in an error inside a transform"
    if re.search(r'in (scope )?"/[^"]*\(', theirs):
        return "the scope path in an error inside a transform"
    return None


@settings(max_examples=TRANSFORM_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(transform_specs(), st.booleans())
def test_random_transformed_models_match_flax(text, raw_keys):
    if LAST_EXAMPLE:  # for a crash of the process (XLA): the example it was running
        with open(LAST_EXAMPLE, "w", encoding="utf-8") as f:
            f.write(f"# raw_keys: {raw_keys}\n{text}")
    try:
        agreement = check_against_flax(parse_spec(text, "<hypothesis>"), raw_keys=raw_keys)
    except OracleUnsupported as e:
        # a combination the oracle cannot build as a Flax model (e.g. a scan as remat_scan's body):
        # there is nothing to compare, so the example is rejected, not passed
        event(f"oracle cannot build: {e}")
        reject()
    except AssertionError as e:
        known = _known_difference(str(e))
        if known is None:
            raise
        event(f"known difference: {known}")
        return
    event(f"flax raises {agreement.error}" if agreement.error else
          "lanes" if agreement.lanes else "keys" if agreement.keys else "no keys")
    if agreement.discarded:
        event("with discarded traces")
