"""The oracle: builds a spec's model in real Flax, runs it, and records every key Flax hands out."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import Scope

from rngaudit import keyexpr
from rngaudit.nodes import (Call, Child, Define, Draw, MakeRng, ModuleDef, Param, Sequential, Spec,
                            Variable)

# Every module is called with X (or its own input); layers keep the shape, so Sequential can chain them.
FEATURES = 4
X = jnp.ones((1, 2, FEATURES), jnp.float32)
TOKENS = jnp.zeros((1, 2), jnp.int32)
SCALAR = jnp.zeros((), jnp.float32)  # the value of params and variables that draw nothing
PASSED_KEY_SEED = 12345  # the key handed to Dropout(rng=...) / attention(dropout_rng=...)

# Flax's default initializer of a layer param, written as the draw that reproduces it.
_DEFAULT_INIT = {
    "kernel": ("lecun_normal", {"in_axis": -2, "out_axis": -1}),
    "embedding": ("variance_scaling", {"scale": 1.0, "mode": "fan_in", "distribution": "normal",
                                       "in_axis": -2, "out_axis": 0}),
}
_INIT_KWARG = {"kernel": "kernel_init", "bias": "bias_init", "embedding": "embedding_init",
               "scale": "scale_init"}
_MHA = ("MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention")


class OracleUnsupported(Exception):
    """The spec uses something this oracle cannot build in Flax."""


# ---------------------------------------------------------------- global settings and capture
@contextlib.contextmanager
def flax_settings(spec: Spec):
    """Sets the separator flag, the threefry mode and the PRNG impl from the spec; restores them."""
    saved = (flax.config.flax_fix_rng_separator, jax.config.jax_threefry_partitionable,
             jax.config.jax_default_prng_impl)
    flax.config.update("flax_fix_rng_separator", spec.fix_rng_separator)
    jax.config.update("jax_threefry_partitionable", spec.threefry_partitionable)
    jax.config.update("jax_default_prng_impl", spec.prng_impl)
    try:
        yield
    finally:
        flax.config.update("flax_fix_rng_separator", saved[0])
        jax.config.update("jax_threefry_partitionable", saved[1])
        jax.config.update("jax_default_prng_impl", saved[2])


def key_words(key) -> tuple[int, ...]:
    return tuple(int(w) for w in np.asarray(jax.random.key_data(key)).ravel())


def _concrete(x) -> bool:
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


@contextlib.contextmanager
def capture():
    """Records every key Scope.make_rng returns (and the value each param init drew from it)."""
    records: list[dict] = []
    make_rng, param = Scope.make_rng, Scope.param

    def recording_make_rng(scope, name="params"):
        used = name if scope.has_rng(name) else "params"
        key = make_rng(scope, name)
        records.append({"path": tuple(scope.path), "requested": name, "stream": used,
                        "key": key_words(key)})
        return key

    def recording_param(scope, name, init_fn, *args, **kwargs):
        def init(key, *a, **kw):
            value = init_fn(key, *a, **kw)
            last = records[-1] if records else None
            if (_concrete(key) and _concrete(value) and last is not None
                    and last["path"] == tuple(scope.path) and last["key"] == key_words(key)):
                last["label"] = name
                last.setdefault("value", np.asarray(value))
            return value

        return param(scope, name, init, *args, **kwargs)

    Scope.make_rng, Scope.param = recording_make_rng, recording_param
    try:
        yield records
    finally:
        Scope.make_rng, Scope.param = make_rng, param


def _attach(records: list[dict] | None, key, value) -> None:
    if records is None:  # init before apply: nothing is recorded
        return
    last = records[-1]
    assert last["key"] == key_words(key), "the value was not drawn from the last key"
    last["value"] = np.asarray(value)


# ---------------------------------------------------------------- keys and draws
def eval_key(expr: keyexpr.KeyExpr, raw: bool):
    """A key expression evaluated with jax.random: typed keys, or raw uint32 data when `raw`."""
    if isinstance(expr, keyexpr.Seed):
        return jax.random.PRNGKey(expr.seed) if raw else jax.random.key(expr.seed)
    if isinstance(expr, keyexpr.Raw):
        data = jnp.asarray(expr.words, jnp.uint32)
        return data if raw else jax.random.wrap_key_data(data)
    if isinstance(expr, keyexpr.Split):
        return jax.random.split(eval_key(expr.parent, raw), expr.n)[expr.index]
    if isinstance(expr, keyexpr.FoldIn):
        return jax.random.fold_in(eval_key(expr.parent, raw), expr.data)
    raise TypeError(expr)


def draw_fn(draw: Draw):
    """key -> the values jax.random / jax.nn.initializers draw for `draw`."""
    p = dict(draw.params)
    shape, dtype, kind = draw.shape, jnp.dtype(draw.dtype), draw.kind
    if kind == "normal":
        return lambda k: jax.random.normal(k, shape, dtype)
    if kind == "uniform":
        return lambda k: jax.random.uniform(k, shape, dtype, p["minval"], p["maxval"])
    if kind == "bernoulli":
        return lambda k: jax.random.bernoulli(k, p["p"], shape)
    if kind == "randint":
        return lambda k: jax.random.randint(k, shape, p["minval"], p["maxval"], dtype)
    if kind == "truncated_normal":
        return lambda k: jax.random.truncated_normal(k, p["lower"], p["upper"], shape, dtype)
    if kind == "variance_scaling":
        init = jax.nn.initializers.variance_scaling(p["scale"], p["mode"], p["distribution"],
                                                     in_axis=p["in_axis"], out_axis=p["out_axis"])
    else:
        init = getattr(jax.nn.initializers, kind)(in_axis=p["in_axis"], out_axis=p["out_axis"])
    return lambda k: init(k, shape, dtype)


def _is_flax_default(param: str, draw: Draw) -> bool:
    want = _DEFAULT_INIT.get(param)
    return (want is not None and draw.kind == want[0] and dict(draw.params) == want[1]
            and draw.dtype == "float32")


# ---------------------------------------------------------------- the model
class _Builder:
    """Turns ModuleDefs into nn.Module subclasses whose methods execute the spec's statements."""

    def __init__(self):
        self.phase = "init"
        self.records: list[dict] | None = None
        self._classes: dict[int, type] = {}

    # -------------------------------------------------------------- construction
    def construct(self, mod: ModuleDef, name: str | None):
        kw = {} if name is None else {"name": name}
        if mod.layer is not None:
            return _layer(mod, kw)
        return self._class(mod)(**kw)

    def _class(self, mod: ModuleDef) -> type:
        cls = self._classes.get(id(mod))
        if cls is None:
            cls = self._classes[id(mod)] = self._make_class(mod)
        return cls

    def _make_class(self, mod: ModuleDef) -> type:
        builder = self

        def setup(m):
            object.__setattr__(m, "_oracle_setup_children", {})
            builder.run(m, mod.setup, m.__dict__["_oracle_setup_children"])

        def __call__(m, x=None):
            builder.run(m, mod.body, {})
            return X if x is None else x

        attrs = {"__call__": nn.compact(__call__), "__module__": __name__}
        if mod.setup:
            attrs["setup"] = setup
        return type(mod.cls, (nn.Module,), attrs)

    # -------------------------------------------------------------- statements
    def run(self, m, items, local: dict) -> None:
        for item in items:
            if item.when is not None and item.when != self.phase:
                continue
            if isinstance(item, MakeRng):
                for _ in range(item.repeat):
                    self.rng(m, item.stream, item.draw)
            elif isinstance(item, Param):
                self._param(m, item)
            elif isinstance(item, Variable):
                self._variable(m, item)
            elif isinstance(item, Child):
                for _ in range(item.repeat):
                    child = self.construct(item.module, item.module.name)
                    local[child.name] = (child, item.module)
                    self.invoke(child, item.module)
            elif isinstance(item, Define):
                child = self._attribute(m, item.module.name, lambda: self.construct(item.module, None),
                                        lambda: self.construct(item.module, item.module.name))
                local[child.name] = (child, item.module)
            elif isinstance(item, Call):
                child, mod = local.get(item.name) or m.__dict__.get("_oracle_setup_children", {})[item.name]
                for _ in range(item.repeat):
                    self.invoke(child, mod)
            elif isinstance(item, Sequential):
                self._sequential(m, item, local)
            else:
                raise OracleUnsupported(type(item).__name__)

    def rng(self, m, stream: str, draw: Draw | None):
        key = m.make_rng(stream)
        if draw is not None:
            _attach(self.records, key, draw_fn(draw)(key))
        return key

    @staticmethod
    def _param(m, item: Param) -> None:
        if m.has_variable("params", item.name):
            # apply: no key is drawn, but Flax checks the initializer's shape against what it finds
            # (which may be the subtree of a child of that name): give it an initializer that agrees
            found = m.get_variable("params", item.name)
            m.param(item.name, lambda k: found)
        elif item.draw is not None:
            m.param(item.name, draw_fn(item.draw))
        else:
            # an initializer that ignores its key, as zeros() does: Flax still draws one (R7)
            m.param(item.name, lambda k: SCALAR)

    def _variable(self, m, item: Variable) -> None:
        # the value is a scalar whatever the keys, so a param of the same name sees a consistent shape
        if item.eager:
            # self.variable(col, name, f, self.make_rng(s)): the argument is evaluated on every call
            keys = [self.rng(m, s, item.draw) for s in item.streams]
            m.variable(item.collection, item.name, lambda *ks: SCALAR, *keys)
        else:
            def init():
                for s in item.streams:
                    self.rng(m, s, item.draw)
                return SCALAR

            m.variable(item.collection, item.name, init)

    @staticmethod
    def _attribute(m, name: str, unnamed, named):
        """self.<name> = Module() in setup; an explicit name= where `name` cannot be an attribute."""
        plain = (name.isidentifier() and not name.startswith("_") and not hasattr(type(m), name)
                 and name not in m.__dict__)
        if not plain:
            return named()
        setattr(m, name, unnamed())
        return m.__dict__[name]

    def _sequential(self, m, item: Sequential, local: dict) -> None:
        for layer in item.layers:
            _check_chainable(layer)
        if item.in_setup:
            seq = self._attribute(
                m, item.name,
                lambda: nn.Sequential([self.construct(l, None) for l in item.layers]),
                lambda: nn.Sequential([self.construct(l, None) for l in item.layers], name=item.name))
            local[seq.name] = (seq, None)
            return
        layers = []
        for layer in item.layers:
            child = self.construct(layer, layer.name)
            local[child.name] = (child, layer)
            layers.append(child)
        seq = nn.Sequential(layers, **({} if item.name is None else {"name": item.name}))
        local[seq.name] = (seq, None)
        seq(X)

    # -------------------------------------------------------------- calls
    def invoke(self, child, mod: ModuleDef | None):
        if mod is None or mod.layer is None:
            return child(X)
        opts = dict(mod.layer_options)
        x = _input(mod)
        if mod.layer == "Dropout":
            mask = _mask_draw(mod)
            x = x if mask is None else jnp.ones(mask.shape, jnp.float32)
            before = len(self.records or ())
            out = child(x, rng=jax.random.key(PASSED_KEY_SEED)) if opts["rng"] else child(x)
            if mask is not None and self.records is not None and len(self.records) > before:
                self.records[-1]["value"] = np.asarray(out != 0)
            return out
        if mod.layer in _MHA and opts["dropout_rng"]:
            return child(x, dropout_rng=jax.random.key(PASSED_KEY_SEED))
        return child(x)


def _mask_draw(mod: ModuleDef) -> Draw | None:
    return next((it.draw for it in mod.body if isinstance(it, MakeRng)), None)


def _check_chainable(mod: ModuleDef) -> None:
    opts = dict(mod.layer_options)
    if mod.layer == "Embed" or opts.get("rng") or opts.get("dropout_rng"):
        raise OracleUnsupported(f"{mod.layer} inside Sequential (it needs its own call arguments)")
    if mod.layer is not None and _dims(mod) != {"in": FEATURES, "out": FEATURES, "k": 3}:
        raise OracleUnsupported("a layer inside Sequential must keep the canonical shapes")


_NORMS = ("LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm")


def _dims(mod: ModuleDef) -> dict:
    """Input features, output features and kernel size of a layer: canonical unless a draw fixes them."""
    d = {"in": FEATURES, "out": FEATURES, "k": 3}
    for item in mod.body:
        if not isinstance(item, Param) or item.draw is None or not item.draw.shape:
            continue
        s = item.draw.shape
        if item.name in ("kernel", "embedding") and len(s) >= 2:
            d.update({"in": s[-2], "out": s[-1]}, **({"k": s[0]} if len(s) == 3 else {}))
        elif len(s) == 1:
            d["out"] = s[0]
            if mod.layer in _NORMS:
                d["in"] = s[0]
    return d


def _input(mod: ModuleDef):
    if mod.layer == "Embed":
        return TOKENS
    return jnp.ones((1, 2, _dims(mod)["in"]), jnp.float32)


def _layer(mod: ModuleDef, kw: dict):
    """The real Flax layer for a standard-layer ModuleDef (shapes: canonical, or those its draws give)."""
    o = dict(mod.layer_options)
    kind = mod.layer
    d = _dims(mod)
    for item in mod.body:
        if isinstance(item, Param) and item.draw is not None and not _is_flax_default(item.name, item.draw):
            kw[_INIT_KWARG[item.name]] = _draw_init(item.draw)
    if kind in ("Dense", "DenseGeneral"):
        return getattr(nn, kind)(features=d["out"], use_bias=o["use_bias"], **kw)
    if kind == "Einsum":
        return nn.Einsum(shape=(d["in"], d["out"]), einsum_str="abc,cd->abd", use_bias=o["use_bias"], **kw)
    if kind in ("Conv", "ConvTranspose", "ConvLocal"):
        return getattr(nn, kind)(features=d["out"], kernel_size=(d["k"],), use_bias=o["use_bias"], **kw)
    if kind == "Embed":
        return nn.Embed(num_embeddings=d["in"], features=d["out"], **kw)
    if kind == "LayerNorm":
        return nn.LayerNorm(use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "RMSNorm":
        return nn.RMSNorm(use_scale=o["use_scale"], **kw)
    if kind == "BatchNorm":
        return nn.BatchNorm(use_running_average=True, use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "GroupNorm":
        return nn.GroupNorm(num_groups=1, use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "InstanceNorm":
        return nn.InstanceNorm(use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "Dropout":
        return nn.Dropout(rate=o["rate"], deterministic=o["deterministic"],
                          rng_collection=o["rng_collection"], **kw)
    if kind in _MHA:
        return getattr(nn, kind)(num_heads=2, use_bias=o["use_bias"], normalize_qk=o["normalize_qk"],
                                 dropout_rate=o["dropout_rate"], deterministic=o["deterministic"], **kw)
    raise OracleUnsupported(f"layer {kind}")


def _draw_init(draw: Draw):
    f = draw_fn(draw)
    return lambda key, *shape_dtype: f(key)


# ---------------------------------------------------------------- entry point
def flax_keys(spec: Spec, raw_keys: bool = False) -> list[dict]:
    """Builds spec.model in Flax, runs init (or init, then apply on its variables) and returns every
    key Flax hands out, in order: dicts with path, requested, stream, key (key data words) and, where
    an initializer or a draw used the key, value (and label, for params). Flax's own exception
    propagates unchanged when the model fails in Flax."""
    builder = _Builder()
    with flax_settings(spec):
        rngs = {s: eval_key(src.expr, raw_keys) for s, src in spec.rngs.items()}
        model = builder.construct(spec.model, spec.model.name)
        if spec.phase == "init":
            with capture() as builder.records:
                model.init(rngs, X)
            return builder.records
        # apply() gets the variables that init() of the same model makes; init only needs a params key
        variables = model.init({"params": jax.random.key(0), **rngs}, X)
        builder.phase = "apply"
        mutable = list(spec.mutable) if isinstance(spec.mutable, tuple) else spec.mutable
        with capture() as builder.records:
            model.apply(variables, X, rngs=rngs, mutable=mutable)
        return builder.records


# ---------------------------------------------------------------- the differential check
FLAX_DOCS = " (https://flax.readthedocs.io"


@dataclass
class Agreement:
    """What a differential check compared: keys, drawn values, or the error both sides report."""

    keys: int = 0
    values: int = 0
    fallbacks: int = 0
    error: str | None = None


def _row(c) -> tuple:
    d = c.derivation
    return d.path, d.stream_requested, d.stream, c.key


def _first_difference(ours: list, theirs: list) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"call {i}: rngaudit {a} != flax {b}"
    return f"rngaudit has {len(ours)} calls, flax {len(theirs)}; first extra: " + repr(
        (ours if len(ours) > len(theirs) else theirs)[min(len(ours), len(theirs))])


def check_against_flax(spec: Spec, raw_keys: bool = False) -> Agreement:
    """Asserts that rngaudit and real Flax agree on the spec: the same (path, stream requested,
    stream used, key data) sequence and the same drawn values, or the same Flax error class and
    message. Returns what was compared."""
    from rngaudit import FlaxError, derive

    ours_error = theirs_error = None
    try:
        report = derive(spec)
    except FlaxError as e:
        ours_error = e
    try:
        records = flax_keys(spec, raw_keys)
    except OracleUnsupported:
        raise
    except Exception as e:  # noqa: BLE001 - whatever Flax raises is the expected answer
        theirs_error = e
    if ours_error is not None or theirs_error is not None:
        assert theirs_error is not None, f"rngaudit predicts an error Flax does not raise: {ours_error}"
        assert ours_error is not None, (f"Flax raises {type(theirs_error).__name__}: {theirs_error}; "
                                        "rngaudit derived keys")
        name = type(theirs_error).__name__
        assert ours_error.flax_error == name, f"rngaudit: {ours_error}; flax: {name}: {theirs_error}"
        core = str(theirs_error).split(FLAX_DOCS)[0].rstrip(".")
        assert ours_error.message.startswith(f"Flax raises {name}: {core}"), (
            f"rngaudit: {ours_error.message!r}; flax: {core!r}")
        return Agreement(error=name)
    ours = [_row(c) for c in report.calls]
    theirs = [(r["path"], r["requested"], r["stream"], r["key"]) for r in records]
    assert ours == theirs, _first_difference(ours, theirs)
    values = 0
    for i, (c, r) in enumerate(zip(report.calls, records)):
        if c.values is None or c.derivation.kind == "attention_dropout":
            continue
        assert "value" in r, f"call {i}: rngaudit drew {c.draw.describe()}, the oracle has no value"
        v = r["value"]
        assert c.values.dtype == v.dtype and c.values.shape == v.shape, (
            f"call {i}: rngaudit {c.values.dtype}{c.values.shape} != flax {v.dtype}{v.shape}")
        assert np.array_equal(c.values, v), f"call {i}: values differ:\n{c.values}\n{v}"
        values += 1
    return Agreement(len(ours), values, sum(1 for c in report.calls if c.derivation.fallback))
