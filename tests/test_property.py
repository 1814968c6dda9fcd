"""Random module trees, written as spec YAML, replayed by rngaudit and built in real Flax: no difference."""
from __future__ import annotations

import os

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flax_oracle import check_against_flax
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
