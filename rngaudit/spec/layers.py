"""Flax's standard layers as module definitions: the keys each one draws, in order, and its children."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import Location, SpecError
from .tree import Child, MakeRng, ModuleDef, Param, Variable

# Constructor fields of flax.linen 0.12 layers that do not change which keys are drawn.
# They are accepted (and ignored) so a user can paste a layer's arguments unchanged.
_LINEAR = (
    "features",
    "dtype",
    "param_dtype",
    "precision",
    "kernel_init",
    "bias_init",
    "promote_dtype",
    "dot_general",
    "dot_general_cls",
)
_CONV = (
    "features",
    "kernel_size",
    "strides",
    "padding",
    "input_dilation",
    "kernel_dilation",
    "feature_group_count",
    "mask",
    "dtype",
    "param_dtype",
    "precision",
    "kernel_init",
    "bias_init",
    "promote_dtype",
    "conv_general_dilated",
    "conv_general_dilated_cls",
    "transpose_kernel",
    "preferred_element_type",
)
_NORM = (
    "epsilon",
    "dtype",
    "param_dtype",
    "bias_init",
    "scale_init",
    "reduction_axes",
    "feature_axes",
    "axis_name",
    "axis_index_groups",
    "use_fast_variance",
    "force_float32_reductions",
    "use_running_average",
    "axis",
    "momentum",
    "num_groups",
    "group_size",
)
_MHA = (
    "num_heads",
    "dtype",
    "param_dtype",
    "qkv_features",
    "out_features",
    "broadcast_dropout",
    "precision",
    "kernel_init",
    "out_kernel_init",
    "bias_init",
    "out_bias_init",
    "attention_fn",
    "decode",
    "force_fp32_for_softmax",
    "qkv_dot_general",
    "out_dot_general",
    "qkv_dot_general_cls",
    "out_dot_general_cls",
    "qk_attn_weights_einsum_cls",
    "attn_weights_value_einsum_cls",
    "sow_weights",
)


@dataclass(frozen=True)
class LayerKind:
    """A standard Flax layer: its auto-name class, the options that change keys and the key requests it makes."""

    cls: str  # type(m).__name__, which decides the auto-name
    options: dict  # options that change keys -> default (None: required)
    passive: tuple[str, ...]  # accepted, no effect on keys
    build: Callable[[dict, Location, dict], tuple]  # (options, loc, draws) -> body items
    params: tuple[str, ...]  # param names `draw` may name


# the label and kind of the keys a standard layer draws with make_rng (a captured draw has neither)
DROPOUT = ("dropout mask", "dropout")
ATTENTION_DROPOUT = ("attention dropout", "attention_dropout")
DRAW_LABELS = frozenset({DROPOUT[0], ATTENTION_DROPOUT[0]})
DRAW_KINDS = frozenset({DROPOUT[1], ATTENTION_DROPOUT[1]})

_KEYED = ("kernel", "embedding")  # default initializers that draw from their key (lecun_normal, ...)


def _params(names_flags, loc, draws) -> tuple:
    return tuple(
        Param(loc, None, name, draws.get(name), name in _KEYED or name in draws) for name, on in names_flags if on
    )


def _linear(opts, loc, draws):
    return _params((("kernel", True), ("bias", opts["use_bias"])), loc, draws)


def _norm(opts, loc, draws):
    return _params((("scale", opts["use_scale"]), ("bias", opts["use_bias"])), loc, draws)


def _batch_norm(opts, loc, draws):
    # mirrors flax/linen/normalization.py BatchNorm.__call__: batch_stats mean and var are declared
    # before the params, so in apply a missing batch_stats collection is the error Flax reports
    stats = tuple(Variable(loc, None, "batch_stats", name) for name in ("mean", "var"))
    return stats + _norm(opts, loc, draws)


def _rms(opts, loc, draws):
    return _params((("scale", opts["use_scale"]),), loc, draws)


def _embed(opts, loc, draws):
    return _params((("embedding", True),), loc, draws)


def _require_deterministic(opts, loc, layer):
    if opts["deterministic"] is None:
        raise SpecError(
            f"{layer} needs `deterministic: true|false` (Flax raises ValueError when neither the "
            "constructor nor the call sets it)",
            loc,
        )


def _dropout(opts, loc, draws):
    # mirrors flax/linen/stochastic.py Dropout.__call__
    _require_deterministic(opts, loc, "Dropout")
    rate = opts["rate"]
    if rate == 0.0 or opts["deterministic"] or rate == 1.0 or opts["rng"]:
        return ()
    label, kind = DROPOUT
    return (MakeRng(loc, None, opts["rng_collection"], 1, label, draws.get("mask"), kind),)


def _mha(opts, loc, draws):
    # mirrors flax/linen/attention.py MultiHeadDotProductAttention.__call__
    use_bias = opts["use_bias"]

    def dense(name):
        return Child(loc, None, make_layer("DenseGeneral", {"use_bias": use_bias}, loc, name, {}), 1)

    items = [dense("query"), dense("key"), dense("value")]
    if opts["normalize_qk"]:
        for name in ("query_ln", "key_ln"):
            items.append(Child(loc, None, make_layer("LayerNorm", {"use_bias": False}, loc, name, {}), 1))
    if opts["dropout_rate"] > 0.0:
        _require_deterministic(opts, loc, "MultiHeadDotProductAttention with dropout_rate > 0")
        if not opts["deterministic"] and not opts["dropout_rng"]:
            label, kind = ATTENTION_DROPOUT
            items.append(MakeRng(loc, None, "dropout", 1, label, draws.get("mask"), kind))
    items.append(dense("out"))
    return tuple(items)


_MHA_OPTS = {"use_bias": True, "normalize_qk": False, "dropout_rate": 0.0, "deterministic": None, "dropout_rng": False}
_MASK = ("mask",)

LAYERS: dict[str, LayerKind] = {
    "Dense": LayerKind("Dense", {"use_bias": True}, _LINEAR, _linear, ("kernel", "bias")),
    "DenseGeneral": LayerKind(
        "DenseGeneral", {"use_bias": True}, _LINEAR + ("axis", "batch_dims"), _linear, ("kernel", "bias")
    ),
    "Einsum": LayerKind(
        "Einsum",
        {"use_bias": True},
        _LINEAR + ("shape", "einsum_str", "preferred_element_type"),
        _linear,
        ("kernel", "bias"),
    ),
    "Conv": LayerKind("Conv", {"use_bias": True}, _CONV, _linear, ("kernel", "bias")),
    "ConvTranspose": LayerKind("ConvTranspose", {"use_bias": True}, _CONV, _linear, ("kernel", "bias")),
    "ConvLocal": LayerKind("ConvLocal", {"use_bias": True}, _CONV, _linear, ("kernel", "bias")),
    "Embed": LayerKind(
        "Embed",
        {},
        ("num_embeddings", "features", "dtype", "param_dtype", "embedding_init", "promote_dtype"),
        _embed,
        ("embedding",),
    ),
    "LayerNorm": LayerKind("LayerNorm", {"use_scale": True, "use_bias": True}, _NORM, _norm, ("scale", "bias")),
    "RMSNorm": LayerKind("RMSNorm", {"use_scale": True}, _NORM, _rms, ("scale",)),
    "BatchNorm": LayerKind("BatchNorm", {"use_scale": True, "use_bias": True}, _NORM, _batch_norm, ("scale", "bias")),
    "GroupNorm": LayerKind("GroupNorm", {"use_scale": True, "use_bias": True}, _NORM, _norm, ("scale", "bias")),
    "InstanceNorm": LayerKind("InstanceNorm", {"use_scale": True, "use_bias": True}, _NORM, _norm, ("scale", "bias")),
    "Dropout": LayerKind(
        "Dropout",
        {"rate": None, "deterministic": None, "rng_collection": "dropout", "rng": False},
        ("broadcast_dims",),
        _dropout,
        _MASK,
    ),
    "MultiHeadDotProductAttention": LayerKind("MultiHeadDotProductAttention", _MHA_OPTS, _MHA, _mha, _MASK),
    "MultiHeadAttention": LayerKind("MultiHeadAttention", _MHA_OPTS, _MHA, _mha, _MASK),
    "SelfAttention": LayerKind("SelfAttention", _MHA_OPTS, _MHA, _mha, _MASK),
}

# The type each key-changing option must have.
OPTION_TYPES = {
    "use_bias": bool,
    "use_scale": bool,
    "normalize_qk": bool,
    "deterministic": bool,
    "rng": bool,
    "dropout_rng": bool,
    "rng_collection": str,
    "rate": float,
    "dropout_rate": float,
}


def layer_identity(layer: str, options: dict) -> tuple | None:
    """What a standard layer is, told the same way from a spec's layer statement (its options, defaults filled in)
    and from a captured module (its fields set to other than Flax's default): the options a layer statement
    takes, lists as tuples; default values, the call-time `deterministic` and what a capture cannot record as a
    value left out. None for no such layer."""
    kind = LAYERS.get(layer)
    if kind is None:
        return None
    out = []
    for opt in sorted(o for o in {*kind.passive, *kind.options} if _told(o)):
        v = options.get(opt, kind.options.get(opt))
        if v is None or (opt in kind.options and v == kind.options[opt]):
            continue
        out.append((opt, _frozen(v)))
    return (layer, tuple(out))


# left out of a layer's identity: given at the call (deterministic), or a function, dtype or array in Flax, which a
# capture cannot record as a value (a spec's `dtype: bfloat16` would never equal it)
_UNTOLD = frozenset({"deterministic", "name", "precision", "promote_dtype", "mask", "attention_fn"})


def _told(opt: str) -> bool:
    return not (opt in _UNTOLD or opt.endswith("_init") or "dtype" in opt or "dot_general" in opt or "_cls" in opt)


def _frozen(v):
    """A value as a hashable one that compares alike from a spec and from a keys file: lists as tuples, mappings
    as sorted (key, value) tuples, anything else unhashable as its text."""
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted(((str(k), _frozen(x)) for k, x in v.items()), key=repr))
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


def make_layer(
    layer: str, opts: dict, loc: Location, name: str | None, draws: dict, hyper: dict | None = None
) -> ModuleDef:
    """A standard layer as a module definition whose body replays its key use (`hyper`: its options that do not
    change keys, kept to tell two layers apart)."""
    kind = LAYERS[layer]
    full = dict(kind.options)
    full.update(opts)
    items = kind.build(full, loc, draws)
    # mirrors flax/linen/linear.py Embed.setup: the embedding is made in setup(), not in __call__
    setup, body = (items, ()) if layer == "Embed" else ((), items)
    kept = tuple(sorted((k, _frozen(v)) for k, v in (hyper or {}).items()))
    return ModuleDef(
        kind.cls, name, setup, body, loc, layer=layer, layer_options=tuple(sorted(full.items())), layer_hyper=kept
    )


def to_linen_modules(m):
    """Every bridge.ToLinen module (its spec.tree.ToLinenDef) a Linen module (a spec.tree.ModuleDef) holds, each
    definition once."""
    import dataclasses

    seen: set[int] = set()
    todo = [m]
    while todo:
        x = todo.pop()
        if isinstance(x, (tuple, list)):
            todo.extend(reversed(x))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type) and id(x) not in seen:
            seen.add(id(x))
            if isinstance(x, ModuleDef) and x.to_linen is not None:
                yield x.to_linen
                continue
            todo.extend(reversed([getattr(x, f.name) for f in dataclasses.fields(x) if f.name not in ("loc", "draw")]))


def has_to_linen(m) -> bool:
    """Whether a Linen module (a spec.tree.ModuleDef) holds a bridge.ToLinen module anywhere."""
    return next(to_linen_modules(m), None) is not None
