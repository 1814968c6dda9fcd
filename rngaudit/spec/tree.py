"""The parsed spec as frozen dataclasses; every node carries its spec file:line:col."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import Location
from .keyexpr import KeyExpr
from .releases import FlaxRules, version_tuple

if TYPE_CHECKING:
    from .nnx import NnxModule

PHASES = ("init", "apply")  # what a spec replays: Flax's init or apply


@dataclass(frozen=True)
class Draw:
    """Values to draw from a key: jax.random.<kind>(key, shape, dtype, **params)."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    params: tuple[tuple[str, object], ...]
    loc: Location

    def describe(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params)
        return f"{self.kind}(shape={list(self.shape)}, dtype={self.dtype}{extra})"


@dataclass(frozen=True)
class Item:
    """One statement of a module body, in execution order."""

    loc: Location
    when: str | None  # None: both phases; 'init' or 'apply': only then


@dataclass(frozen=True)
class MakeRng(Item):
    """`self.make_rng(stream)`, `repeat` times in a row (or a layer's own key request)."""

    stream: str
    repeat: int = 1
    label: str | None = None
    draw: Draw | None = None
    kind: str = "make_rng"  # make_rng | dropout | attention_dropout (what asked for the key)


@dataclass(frozen=True)
class Param(Item):
    """`self.param(name, init, ...)`: one `params` key when the param is created."""

    name: str
    draw: Draw | None = None
    uses_key: bool | None = None  # whether the initializer uses its key; None: unknown (no draw given)


@dataclass(frozen=True)
class Variable(Item):
    """`self.variable(collection, name, init, ...)`: keys of `streams` when created (every call if eager)."""

    collection: str
    name: str
    streams: tuple[str, ...] = ()
    eager: bool = False  # make_rng passed as an argument: evaluated on every call
    draw: Draw | None = None


@dataclass(frozen=True)
class ModuleDef:
    """A Flax module: its class name, optional explicit name, setup() and __call__ bodies."""

    cls: str
    name: str | None
    setup: tuple[Item, ...]
    body: tuple[Item, ...]
    loc: Location
    layer: str | None = None  # the standard layer this stands for, if any
    layer_options: tuple[tuple[str, object], ...] = ()  # its key-changing options, defaults filled in
    layer_hyper: tuple[tuple[str, object], ...] = ()  # the options given that do not change keys (features: 4)
    lifts: tuple[Lift, ...] = ()  # method-decorator transforms on __call__, outermost first
    impl_cls: str | None = None  # the class that runs inside the transforms (cls before renaming)
    to_linen: ToLinenDef | None = None  # a bridge.ToLinen module: the NNX module it builds at every call


@dataclass(frozen=True)
class ToLinenDef:
    """`bridge.ToLinen(NnxClass)`: a Linen module that builds a new NNX module (`module`, a
    rngaudit.spec.nnx.NnxModule) at every call, from `nnx.Rngs(**{s: self.make_rng(s) for s in the scope's
    rngs})` (and at apply a `default` stream of key(0) when there is none), then calls it once. `skip_rng`: no
    Rngs (the module's __init__ takes none)."""

    module: NnxModule
    skip_rng: bool = False


@dataclass(frozen=True)
class Child(Item):
    """Create a child module (auto-named unless `module.name`) and call it once."""

    module: ModuleDef
    repeat: int = 1


@dataclass(frozen=True)
class Define(Item):
    """A child assigned in setup(): created and named, not called."""

    module: ModuleDef


@dataclass(frozen=True)
class Call(Item):
    """Call an existing child again; its counters and variables carry on."""

    name: str
    repeat: int = 1


@dataclass(frozen=True)
class Sequential(Item):
    """nn.Sequential(layers): in @compact the layers are named in the enclosing module."""

    name: str | None
    layers: tuple[ModuleDef, ...]
    in_setup: bool = False


@dataclass(frozen=True)
class RngSource:
    """The key one stream of `rngs` receives, as parsed and as written."""

    expr: KeyExpr
    text: str
    loc: Location


@dataclass(frozen=True)
class Spec:
    """A whole spec: the Flax and JAX settings, the phase, the root keys and the model."""

    file: str
    fix_rng_separator: bool
    prng_impl: str
    threefry_partitionable: bool
    phase: str
    mutable: tuple[str, ...] | bool
    rngs: dict[str, RngSource]
    model: ModuleDef
    version: int = 1
    extra: dict = field(default_factory=dict)
    flax_version: str | None = None  # `flax: {version}`: the release whose rules apply; None: the newest
    jax_version: str | None = None  # `jax: {version}`: sets threefry_partitionable's default only
    method: str | None = None  # `method:` the module method the model runs (verify runs it), None: __call__
    partitionable_pinned: bool = False  # the spec states `jax: {threefry_partitionable}` (a release leaves it)

    @property
    def rules(self) -> FlaxRules:
        return FlaxRules(None if self.flax_version is None else version_tuple(self.flax_version))


# A stream or collection filter, as Flax's Filter: True (all), False (none) or a tuple of names.
Filter = "bool | tuple[str, ...]"


@dataclass(frozen=True)
class Lift:
    """One lifted transform applied to a module's __call__: vmap, scan, jit, remat, fold_rngs,
    map_variables or remat_scan, with its key-relevant options normalised."""

    kind: str
    options: tuple[tuple[str, object], ...]
    loc: Location

    def opt(self, key: str, default=None):
        for k, v in self.options:
            if k == key:
                return v
        return default


@dataclass(frozen=True)
class Transform(Item):
    """A child created from a transformed class (nn.vmap(MLP)(...)) and called once per repeat.
    `target` is the wrapped module with `lifts` holding this transform (outermost first) and
    `cls` already the transformed class name (VmapMLP)."""

    target: ModuleDef
    repeat: int = 1

    @property
    def kind(self) -> str:
        return self.target.lifts[0].kind


@dataclass(frozen=True)
class Cond(Item):
    """nn.cond(pred, true_fun, false_fun, self): both branches traced in order."""

    branches: tuple[tuple[Item, ...], ...]
    rngs: object = True
    kind: str = "cond"


@dataclass(frozen=True)
class WhileLoop(Item):
    """nn.while_loop(cond_fn, body_fn, self, ...): cond traced, then body; runs `iterations` times."""

    cond_items: tuple[Item, ...]
    body_items: tuple[Item, ...]
    iterations: int
    split_rngs: tuple[tuple[object, bool], ...] = ()


def _recalled(xs: tuple, calls: dict[str, str]) -> tuple:
    """`xs` with `call: OLD` as `call: NEW` (also inside the module's own cond/switch/while items)."""

    def item(x):
        if isinstance(x, Call) and x.name in calls:
            return dataclasses.replace(x, name=calls[x.name])
        if isinstance(x, Cond):
            return dataclasses.replace(x, branches=tuple(_recalled(b, calls) for b in x.branches))
        if isinstance(x, WhileLoop):
            return dataclasses.replace(
                x, cond_items=_recalled(x.cond_items, calls), body_items=_recalled(x.body_items, calls)
            )
        return x

    return tuple(item(x) for x in xs)


def renamed_modules(m: ModuleDef, names: dict[int, str]) -> ModuleDef:
    """`m` with the modules whose id is in `names` given those explicit names (a rename fix applied: collisions'
    rename search, diff's fixes)."""

    def items(xs: tuple) -> tuple:
        new = tuple(item(x) for x in xs)
        return xs if all(a is b for a, b in zip(new, xs)) else new

    def item(x):
        if isinstance(x, (Child, Define)):
            new = renamed_modules(x.module, names)
            return x if new is x.module else dataclasses.replace(x, module=new)
        if isinstance(x, Transform):
            new = renamed_modules(x.target, names)
            return x if new is x.target else dataclasses.replace(x, target=new)
        if isinstance(x, Sequential):
            layers = tuple(renamed_modules(c, names) for c in x.layers)
            return x if all(a is b for a, b in zip(layers, x.layers)) else dataclasses.replace(x, layers=layers)
        if isinstance(x, Cond):
            branches = tuple(items(b) for b in x.branches)
            return x if all(a is b for a, b in zip(branches, x.branches)) else dataclasses.replace(x, branches=branches)
        if isinstance(x, WhileLoop):
            c, b = items(x.cond_items), items(x.body_items)
            return x if c is x.cond_items and b is x.body_items else dataclasses.replace(x, cond_items=c, body_items=b)
        return x

    setup, body = items(m.setup), items(m.body)
    # a child named anew is still called by the attribute (setup) or variable (compact) that holds it: its `call:`
    # statements follow the name (Flax: self.classifier = nn.Dense(2, name='head'); self.classifier(x))
    calls = {
        a.module.name: b.module.name
        for a, b in zip((*m.setup, *m.body), (*setup, *body))
        if a is not b and isinstance(a, (Child, Define)) and a.module.name is not None and b.module.name is not None
    }
    if calls:
        setup, body = _recalled(setup, calls), _recalled(body, calls)
    out = m if setup is m.setup and body is m.body else dataclasses.replace(m, setup=setup, body=body)
    if id(m) in names:
        out = dataclasses.replace(out, name=names[id(m)])
    return out
