"""The NNX flavour of a spec (`flavour: nnx`): the streams an `nnx.Rngs` is built with, a module tree in
construction order (`init:`, what `__init__` does) and call order (`call:`, what `__call__` does), and how many
times the model is called. Parsed into frozen dataclasses, every node with its file:line:col.

NNX keys are not path-hashed: every `RngStream` call returns `fold_in(stream_key, count)` and counts up, so a
spec states the order in which streams are drawn and which objects share a stream (a layer built from the
caller's `Rngs` shares its counters; a Dropout forks its own stream)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import Location, SpecError
from .budget import check_budget
from .draws import parse_draw
from .fields import Fields, as_int, as_str, suggest, type_name
from .releases import NEWEST, release, version_tuple
from .statements import MAX_REPEAT, BodyParser
from .tree import Draw, ModuleDef, RngSource
from .yaml_source import YNode

MAX_STEPS = 1_000_000
MAX_LANES = 65_536
LINEN_STATEMENTS = ("body", "setup", "transforms", "make_rng", "param", "variable", "phase", "mutable")

# The standard layers' construction-time draws (FLAX_NNX_RULES.md §3, flax/nnx/nn/*.py): the params keys
# each takes in order, given its options. A layer's options with their defaults.
LAYER_OPTIONS: dict[str, dict[str, object]] = {
    "Linear": {"use_bias": True},
    "LinearGeneral": {"use_bias": True},
    "Conv": {"use_bias": True},
    "ConvTranspose": {"use_bias": True},
    "Embed": {},
    "LayerNorm": {"use_scale": True, "use_bias": True},
    "BatchNorm": {"use_scale": True, "use_bias": True},
    "GroupNorm": {"use_scale": True, "use_bias": True},
    "InstanceNorm": {"use_scale": True, "use_bias": True},
    "RMSNorm": {"use_scale": True},
    "Dropout": {"rate": None, "rng_collection": "dropout", "deterministic": False, "rngs": True},
    "MultiHeadAttention": {
        "use_bias": True,
        "normalize_qk": False,
        "dropout_rate": 0.0,
        "keep_rngs": True,
        "deterministic": False,
    },
    # the recurrent cells (flax/nnx/nn/recurrent.py): their Linear layers' params; keep_rngs (deprecated) forks
    # `carry` first, for initialize_carry
    "LSTMCell": {"keep_rngs": False},
    "OptimizedLSTMCell": {"keep_rngs": False},
    "GRUCell": {"keep_rngs": False},
    "SimpleCell": {"keep_rngs": False},
    # flax/nnx/nn/lora.py: LoRALinear is a Linear (kernel, bias) holding `lora`, an nnx.LoRA (lora_a, lora_b)
    "LoRALinear": {"use_bias": True},
    "LoRA": {},
}
# what nnx.LoRA's base_module may be in a spec: a standard layer that draws nothing when called (its call adds the
# base's output; a user module there is not modelled)
LORA_BASES = ("Linear", "LinearGeneral", "Conv", "ConvTranspose", "Embed")
# each cell's params draws in __init__ order, and how many keys its initialize_carry draws
CELL_PARAMS: dict[str, tuple[str, ...]] = {
    "LSTMCell": (
        "ii.kernel",
        "if_.kernel",
        "ig.kernel",
        "io.kernel",
        "hi.kernel",
        "hi.bias",
        "hf.kernel",
        "hf.bias",
        "hg.kernel",
        "hg.bias",
        "ho.kernel",
        "ho.bias",
    ),
    "OptimizedLSTMCell": ("dense_i.kernel", "dense_h.kernel", "dense_h.bias"),
    "GRUCell": ("dense_i.kernel", "dense_i.bias", "dense_h.kernel"),
    "SimpleCell": ("dense_h.kernel", "dense_i.kernel", "dense_i.bias"),
}
CELLS = tuple(CELL_PARAMS)
CARRY_DRAWS = {"LSTMCell": 2, "OptimizedLSTMCell": 2, "GRUCell": 1, "SimpleCell": 1}
RNN_RNGS = ("own", "fork", "none")
LAYERS = tuple(LAYER_OPTIONS)
RNGS_MODES = ("shared", "fork", "none")
MODES = ("train", "eval")  # a `call:` draw's `when`: the model's mode it is drawn in
# how a stacked module's members get their streams besides nnx.split_rngs (`shared`): nnx.vmap(in_axes=0) over
# rngs.split(N), or over rngs.broadcast(N) (every member the same keys); with `only:`, rngs.split({only: N, ...:
# None}) and StateAxes({only: 0, ...: None}): the other streams are copies, count reset to 0, every member's
STACK_RNGS = ("split", "broadcast")


@dataclass(frozen=True)
class NnxStatement:
    loc: Location


@dataclass(frozen=True)
class NnxLayer(NnxStatement):
    """A standard layer built in `__init__` from the module's Rngs, stored as attribute `name`."""

    kind: str
    name: str
    options: tuple[tuple[str, object], ...]
    base: NnxLayer | None = None  # nnx.LoRA(..., base_module=Linear(...)): the layer it wraps, built first

    def opt(self, key: str):
        return dict(self.options)[key]


@dataclass(frozen=True)
class NnxChild(NnxStatement):
    """A submodule built in `__init__`: from the module's own Rngs (`shared`) or from `rngs.fork()`; `stack`
    N > 0: N of them at once, `nnx.split_rngs(splits=N)` around `nnx.vmap(in_axes=0)` (an ensemble, or the
    layers of a scan-over-layers stack), member i built from lane i of every stream of the Rngs; or nnx.vmap over
    `rngs.split(N)` / `rngs.broadcast(N)` (`rngs: split` / `broadcast`, `only:` the streams split)."""

    name: str
    module: NnxModule
    rngs: str = "shared"
    stack: int = 0
    only: tuple[str, ...] = ()  # rngs: split / broadcast: the streams split (broadcast); () every one


@dataclass(frozen=True)
class NnxBridge(NnxStatement):
    """`self.<name> = bridge.ToNNX(linen_module, rngs=...)` in `__init__`: a Linen module inside the NNX model.
    `rngs`: `fork` (rngs=rngs: ToNNX keeps rngs.fork()) or `key` (rngs=rngs.params(): Rngs(params=key)).
    `lazy_init`: `bridge.lazy_init(self.<name>, x)` right after (Linen init); otherwise a `lazy_init` run event
    initialises it. Each call draws one key from every stream of its Rngs and runs Linen init or apply with
    them (`default` renamed `params` when there is no `params`)."""

    name: str
    module: ModuleDef
    rngs: str = "fork"
    lazy_init: bool = True


BRIDGE_RNGS = ("fork", "key")


@dataclass(frozen=True)
class NnxRnn(NnxStatement):
    """`self.<name> = nnx.RNN(cell, rngs=..., broadcast_rngs=...)` in `__init__` (mirrors flax/nnx/nn/recurrent.py
    RNN): `cell` is built first (a standard cell or a user module, attribute `cell`); `rngs` is what the RNN keeps
    for initialize_carry: `own` (rngs=True, the default: its own RngStream(0, tag='carry')), `fork`
    (rngs=rngs: rngs.carry.fork()) or `none` (rngs=False). Each call (`call: {name, length: T}`) draws the cell's
    carry keys, then nnx.split_rngs(splits=1, only=broadcast, squeeze=True) around nnx.scan over T steps, the
    `broadcast` streams broadcast, the rest carried."""

    name: str
    cell: NnxLayer | NnxChild
    rngs: str = "own"
    broadcast: tuple[str, ...] = ()
    carry_draws: int = 0  # keys the cell's initialize_carry draws (a standard cell's are known)
    # what the carry is initialised with: zeros (NNX's default: the keys drawn for it are not used, and
    # collisions leaves them out) or random (carry_init=... on the cell: they are used)
    carry_init: str = "zeros"


@dataclass(frozen=True)
class NnxBidirectional(NnxStatement):
    """`self.<name> = nnx.Bidirectional(forward_rnn, backward_rnn, rngs=...)` (mirrors recurrent.py Bidirectional):
    the two RNNs built first (attributes forward_rnn, backward_rnn), then the stream it keeps: `own` (its own
    RngStream(0, tag='carry')), `fork` (rngs.carry.fork()) or `none`. Each call runs the forward RNN, then the
    backward one, both given that stream (or the call's rngs.carry, not forked): their carry keys share its count."""

    name: str
    forward: NnxRnn
    backward: NnxRnn
    rngs: str = "own"


@dataclass(frozen=True)
class NnxTransform:
    """How a call is transformed. `vmap`: `lanes` lanes (0: over a stacked module's members), the streams
    whose tag is in `streams` split per lane by nnx.split_rngs and mapped with StateAxes, the rest broadcast.
    `scan`: `lanes` steps (0: over a stacked module's layers), state carried, the streams whose tag is in
    `streams` broadcast (frozen)."""

    kind: str  # vmap or scan
    lanes: int  # 0: over the stacked axis of the module
    streams: tuple[str, ...] = ()

    def describe(self) -> str:
        over = "its stacked axis" if not self.lanes else f"{self.lanes} {'lanes' if self.kind == 'vmap' else 'steps'}"
        what = "split" if self.kind == "vmap" else "broadcast"
        streams = f", {what} {', '.join(self.streams)}" if self.streams else ""
        return f"nnx.{self.kind} over {over}{streams}"


@dataclass(frozen=True)
class NnxDraw(NnxStatement):
    """`rngs.<stream>()` (in `__init__`) or `self.rngs.<stream>()` (in `__call__`), `repeat` times; in `__call__`,
    `keeper` (`from: enc`) draws from the Rngs a submodule keeps instead (self.enc.rngs.noise(), or a method of enc
    drawing from its own: self.enc.sample(x))."""

    stream: str
    repeat: int = 1
    label: str | None = None
    draw: Draw | None = None
    keeper: str = ""
    # in `__call__`: drawn in that mode of the model only (`train`: `if not self.deterministic:` in a module that
    # model.train()/eval() switch, or a `train=` argument following the model's mode; `eval` the other way)
    when: str | None = None


@dataclass(frozen=True)
class NnxStreamFork(NnxStatement):
    """`self.<name> = rngs.<stream>.fork()` in `__init__` (as nnx.Dropout keeps its stream, and DropPath or
    attention ports of yours write it): the stream hands out one key, which becomes the key of a stream of that
    tag the module keeps as attribute `name`, count 0; a call draws from it with `draw: {stream, from: name}`."""

    stream: str
    name: str


@dataclass(frozen=True)
class NnxCall(NnxStatement):
    """`self.<name>(x)` in `__call__`, `repeat` times: a Dropout or attention draws, a submodule runs its call."""

    name: str
    repeat: int = 1
    transform: NnxTransform | None = None
    key: RngSource | None = None  # `self.<name>(x, rngs=key)`: a Dropout given this key, used as it is
    fork: tuple[str, ...] | None = None  # `with nnx.fork_rngs(self.<name>, split={tags: None})`: () every stream
    # a Dropout given an Rngs at its call, `self.<name>(x, rngs=rngs)`: `call` the spec's call_rngs (an Rngs made
    # once and given to every call of the model), `model` the Rngs the model is built from; "" none
    given_rngs: str = ""
    length: int = 0  # an nnx.RNN's call: the sequence length (the steps of its scan)
    initial_carry: bool = False  # an nnx.RNN's call given `initial_carry=`: initialize_carry draws nothing
    # a Dropout's or attention layer's call given `deterministic=` (it wins over the layer's attribute, whatever
    # model.train()/eval() set); None: not given
    deterministic: bool | None = None
    when: str | None = None  # called in that mode of the model only (as NnxDraw's)


@dataclass(frozen=True)
class NnxCond(NnxStatement):
    """`nnx.cond(pred, true_fun, false_fun, self, x)` (kind `cond`: branches (true_fun, false_fun), `taken` 0 when
    pred) or `nnx.switch(index, branches, self, x)` (kind `switch`: `taken` is the index clamped into range, as
    jax.lax.switch clamps it). JAX traces every branch, in order: one not taken raises its errors and draws
    nothing; the taken one's draws and counts carry on."""

    kind: str
    given: int  # pred (a bool) or index, as written
    taken: int
    branches: tuple[tuple[NnxStatement, ...], ...]


@dataclass(frozen=True)
class NnxLoop(NnxStatement):
    """`nnx.fori_loop(0, N, body, (self, x))` or `nnx.while_loop` over (self, i, x) until i == N: the body's
    statements N times, the RngState carried (each iteration draws where the one before stopped). With N = 0
    JAX still traces the body: its errors are raised, nothing is drawn."""

    kind: str
    iterations: int
    body: tuple[NnxStatement, ...]


CONTROL = ("cond", "switch", "fori_loop", "while_loop")


def nested(statements, under: NnxStatement | None = None):
    """`(statement, the control statement it is in or None)` for `statements` and every statement in their
    branches and loop bodies, depth first."""
    for st in statements:
        yield st, under
        if isinstance(st, NnxCond):
            for branch in st.branches:
                yield from nested(branch, under or st)
        elif isinstance(st, NnxLoop):
            yield from nested(st.body, under or st)


@dataclass(frozen=True)
class NnxStep(NnxStatement):
    """`n` calls of the model; `stale`: each in a pure jax.jit step whose returned state is dropped (the
    next step starts from the same RNG counts); `transform`: each call under nnx.vmap or nnx.scan."""

    n: int = 1
    stale: bool = False
    transform: NnxTransform | None = None
    lazy_init: bool = False  # `bridge.lazy_init(model, x)` after construction: every ToNNX runs Linen init (step 0)
    fork: tuple[str, ...] | None = None  # each call in `with nnx.fork_rngs(model, split={tags: None})`: () every one


@dataclass(frozen=True)
class NnxReseed(NnxStatement):
    """`nnx.reseed(model, stream=key, ...)` between calls; `module`: of that submodule only (nnx.reseed(model.enc,
    ...), dotted); `policy`: 'match_shape' splits the new key for a stacked module's streams."""

    streams: tuple[tuple[str, RngSource], ...]
    module: str = ""
    policy: str = "scalars_only"


@dataclass(frozen=True)
class NnxMode(NnxStatement):
    """`model.eval()` (deterministic) or `model.train()` between calls: sets `deterministic` on every Dropout and
    attention layer of the model (mirrors nnx.Module.eval/train, set_attributes), or calls of an
    `nnx.view(model, deterministic=...)`, which share the model's RNG counts."""

    deterministic: bool


@dataclass(frozen=True)
class NnxRunDraw(NnxStatement):
    """`model.rngs.<stream>()` outside the model's call, `repeat` times: a training step (or a method of the model
    other than __call__, a diffusion loss's timesteps and noise) drawing from the Rngs the model keeps, or (`keeper`,
    `from: enc`) one a module of it keeps (model.enc.rngs.noise()). Its rows belong to the step of the next call of
    the model (the last one's, when no call follows)."""

    stream: str
    repeat: int = 1
    keeper: str = ""


@dataclass(frozen=True)
class NnxModule:
    cls: str
    init: tuple[NnxStatement, ...]
    call: tuple[NnxStatement, ...]
    keep_rngs: bool
    loc: Location


@dataclass(frozen=True)
class NnxSpec:
    """An NNX spec: the JAX settings, the root `nnx.Rngs` streams, the model and how often it is called."""

    file: str
    prng_impl: str
    threefry_partitionable: bool
    rngs: dict[str, RngSource]
    model: NnxModule
    run: tuple[NnxStep | NnxReseed | NnxMode | NnxRunDraw, ...]
    flavour: str = "nnx"
    flax_version: str | None = None  # `flax: {version: ...}`; None: the current rules (flax >= 0.11)
    jax_version: str | None = None  # `jax: {version}`: sets threefry_partitionable's default only
    # `call_rngs:`: the nnx.Rngs made once before the first call and given to every call, model(x, rngs=rngs)
    call_rngs: dict[str, RngSource] | None = None
    # `call_rngs:` as a list: step i's call is given an nnx.Rngs made for it (nnx.Rngs(dropout=fold_in(key, i)))
    call_rngs_steps: tuple[dict[str, RngSource] | None, ...] | None = None  # (None: that step's call is given none)
    partitionable_pinned: bool = False  # the spec states `jax: {threefry_partitionable}` (a release leaves it)

    @property
    def shared_dropout(self) -> bool:
        """Flax before 0.11: Dropout and attention keep the caller's Rngs and draw from it at each call (no
        fork at construction), and nnx.reseed sets each stream to the key it is given."""
        return self.flax_version is not None and version_tuple(self.flax_version) < (0, 11)

    @property
    def steps(self) -> int:
        """How many times the model is called."""
        return sum(e.n for e in self.run if isinstance(e, NnxStep) and not e.lazy_init)

    @property
    def eval_steps(self) -> tuple[int, ...] | None:
        """The steps (calls of the model) made in eval mode, after a `eval` event and before the next `train`;
        None when the spec has neither event (its layers draw as built). The others are made in train mode, those
        before the first event too (as `when:` draws are)."""
        if not any(isinstance(e, NnxMode) for e in self.run):
            return None
        out: list[int] = []
        step, evaluating = 0, False
        for e in self.run:
            if isinstance(e, NnxMode):
                evaluating = e.deterministic
            elif isinstance(e, NnxStep) and not e.lazy_init:
                if evaluating:
                    out += range(step + 1, step + e.n + 1)
                step += e.n
        return tuple(out)


def _mixed(key: str, loc) -> SpecError:
    return SpecError(
        f"`{key}:` is a Linen statement, and this spec is `flavour: nnx`; an NNX module has `init:` "
        "(what __init__ builds and draws, in order) and `call:` (what __call__ does); write one flavour per spec",
        loc,
    )


# what a Flax release must be to have a spec's construct (the first release with it)
SINCE = {
    "rngs: fork": (0, 11),
    "keep_rngs": (0, 11, 1),
    "InstanceNorm": (0, 12),
    "ToNNX": (0, 12),
    "a key given to a Dropout call": (0, 11),
    "rngs: split": (0, 12, 6),
    "rngs: broadcast": (0, 12, 7),
    "fork_rngs": (0, 11),
    "fork": (0, 11),
    "nnx.reseed's policy": (0, 11),
}
# what rngaudit models with the rules of one release on (checked against that release; older ones not)
# what a module builds and keeps as an attribute (`name:`)
ATTRIBUTES = (NnxLayer, NnxChild, NnxBridge, NnxRnn, NnxBidirectional, NnxStreamFork)
MODELLED_SINCE = {
    "nnx.RNN": (0, 12),
    "nnx.Bidirectional": (0, 12),
    "nnx.LoRA": (0, 12),
    "nnx.LoRALinear": (0, 12),
    **{f"nnx.{c}": (0, 12) for c in CELLS},
}


class NnxParser:
    version: tuple[int, ...] | None = None  # the spec's `flax: version`, None: the current rules
    origin = ""  # who named the release, when not the spec (an upgrade check's option)
    key_source: Callable | None = None  # reads a key as `rngs:` does (a seed, raw key data or a key expression)

    def lacks(self, what: str) -> bool:
        return self.version is not None and self.version < SINCE[what]

    def said(self) -> str:
        """Who names the release the spec is read under, and which."""
        have = ".".join(map(str, self.version or ()))
        return f"{self.origin} says flax {have}" if self.origin else f"this spec says flax {have} (`flax: version`)"

    def too_old(self, what: str, loc) -> SpecError:
        since = ".".join(map(str, SINCE[what]))
        return SpecError(f"{what} is flax {since} and later; {self.said()}", loc)

    def modelled(self, what: str, loc) -> None:
        since = MODELLED_SINCE[what]
        if self.version is not None and self.version < since:
            raise SpecError(
                f"rngaudit models {what} with the rules of flax {'.'.join(map(str, since))} and later (checked "
                f"against real NNX); {self.said()}",
                loc,
            )

    def module(self, node: YNode, what: str = "`model`") -> NnxModule:
        if node.is_map:
            for key in node.value:
                if key in LINEN_STATEMENTS:
                    raise _mixed(key, node.key_locs[key])
        f = Fields(node, what, ("class", "init", "call", "keep_rngs"), ("class",))
        cls = f.name("class")
        keep = f.flag("keep_rngs", False)
        init = tuple(self.statements(f.get("init"), cls, "init"))
        names: dict[str, NnxStatement] = {}
        for st in init:
            if isinstance(st, ATTRIBUTES) and keep and st.name == "rngs":
                raise SpecError(
                    f"{cls} keeps its Rngs as `self.rngs` (keep_rngs: true); name this attribute otherwise", st.loc
                )
            if isinstance(st, NnxDraw) and st.keeper:
                raise SpecError(
                    f"`from:` of a `draw` names the submodule whose kept Rngs a call draws from; in `init:` a draw "
                    f"is rngs.{st.stream}() of the Rngs {cls} is given (drop `from`)",
                    st.loc,
                )
            if isinstance(st, ATTRIBUTES):
                if st.name in names:
                    raise SpecError(
                        f"attribute {st.name!r} of {cls} is assigned twice in __init__; give it another `name:`",
                        st.loc,
                    )
                names[st.name] = st
        call = tuple(self.statements(f.get("call"), cls, "call"))
        for st, under in nested(call):
            if isinstance(st, NnxCall) and _attribute_of(names, st.name) is None:
                known = ", ".join(names) or "none"
                raise SpecError(
                    f"`call: {st.name}`: {cls} builds no attribute {st.name!r} in `init:` (attributes: {known})",
                    st.loc,
                )
            if isinstance(st, NnxCall) and isinstance(_attribute_of(names, st.name), NnxStreamFork):
                fork = _attribute_of(names, st.name)
                raise SpecError(
                    f"`call: {st.name}`: {st.name} is the stream {cls} keeps by `fork:` (rngs.{fork.stream}.fork()); "
                    f"draw from it with `draw: {{stream: {fork.stream}, from: {st.name}}}`",
                    st.loc,
                )
            bridged = isinstance(st, NnxCall) and isinstance(_attribute_of(names, st.name), NnxBridge)
            if bridged and (under is not None or isinstance(st, NnxCall) and st.transform is not None):
                where = "inside nnx.cond, nnx.switch or a loop" if under is not None else "under nnx.vmap or nnx.scan"
                raise SpecError(
                    f"{st.name} is a bridge.ToNNX module: rngaudit does not model it called {where} yet; call it "
                    "plainly, outside control flow and transforms",
                    st.loc,
                )
            if isinstance(st, NnxCall) and st.given_rngs and under is not None:
                raise SpecError(
                    f"{st.name} is given the call's Rngs inside nnx.cond, nnx.switch or a loop: rngaudit does not "
                    "model that yet; give it in a plain call",
                    st.loc,
                )
            if isinstance(st, NnxCall):
                self.rnn_call(st, _attribute_of(names, st.name))
            if (
                isinstance(st, NnxCall)
                and (st.key is not None or st.given_rngs)
                and not isinstance(_attribute_of(names, st.name), (NnxRnn, NnxBidirectional))
            ):
                target = _attribute_of(names, st.name)
                takes = ("Dropout",) if st.key is not None else ("Dropout", "MultiHeadAttention")
                if not (isinstance(target, NnxLayer) and target.kind in takes):
                    given = "`key:` is a key" if st.key is not None else f"`rngs: {st.given_rngs}` is an Rngs"
                    raise SpecError(
                        f"{given} given to a Dropout's call (drop(x, rngs=...)), and {st.name} is not a Dropout"
                        + (
                            ""
                            if st.key is not None
                            else " (nor a MultiHeadAttention or an nnx.RNN, whose calls take an Rngs too)"
                        ),
                        st.loc,
                    )
            if isinstance(st, NnxCall) and st.deterministic is not None:
                target = _attribute_of(names, st.name)
                if not (isinstance(target, NnxLayer) and target.kind in ("Dropout", "MultiHeadAttention")):
                    raise SpecError(
                        f"`deterministic:` at a call is the argument of a Dropout's or attention layer's call "
                        f"(drop(x, deterministic=True)), and {st.name} is neither; a module's own flag is said by "
                        "its layers' calls, or by the run events `train`/`eval`",
                        st.loc,
                    )
            if isinstance(st, NnxCall) and st.transform is not None:
                target = _attribute_of(names, st.name)
                size = target.stack if isinstance(target, NnxChild) else 0
                stacked = size > 0
                t = st.transform
                if stacked and t.lanes:
                    raise SpecError(
                        f"{st.name} is a stack of {size} (`stack:`): call it with `{t.kind}: true` "
                        f"(nnx.{t.kind} over its stacked axis); rngaudit does not model a new {t.kind} axis around "
                        "a stacked module",
                        st.loc,
                    )
                if not stacked and not t.lanes:
                    raise SpecError(
                        f"`{t.kind}: true` maps over a stacked module's axis, and {st.name} is not stacked; build it "
                        f"with `stack: N`, or give the number of {'lanes' if t.kind == 'vmap' else 'steps'} "
                        f"(`{t.kind}: 4`)",
                        st.loc,
                    )
            if isinstance(st, NnxDraw) and st.keeper:
                _check_keeper(names, st.keeper, st.stream, f"self.{st.keeper}", st.loc)
            elif isinstance(st, NnxDraw) and not keep:
                raise SpecError(
                    f"`draw:` in `call:` draws from self.rngs, which {cls} does not keep; add `keep_rngs: true` "
                    "(its __init__ stores `self.rngs = rngs`)",
                    st.loc,
                )
        return NnxModule(cls, init, call, keep, node.loc)

    def rnn_call(self, st: NnxCall, target: NnxStatement) -> None:
        """What a call of an nnx.RNN needs (its sequence length), and what only such a call takes."""
        if isinstance(target, (NnxRnn, NnxBidirectional)):
            if not st.length:
                raise SpecError(
                    f"{st.name} is an nnx.RNN: give its call the sequence length, the steps of its scan (`call: "
                    f"{{name: {st.name}, length: 10}}` for inputs of 10 time steps)",
                    st.loc,
                )
            if st.transform is not None or st.key is not None:
                what = "a key (`key:`)" if st.key is not None else f"`{st.transform.kind}:`" if st.transform else ""
                raise SpecError(
                    f"{st.name} is an nnx.RNN, called with {what}: rngaudit models an RNN called plainly (its own "
                    "scan over the sequence), with `length`, `initial_carry`, `rngs` and `fork_rngs`",
                    st.loc,
                )
            return
        if st.length or st.initial_carry:
            what = "`length`" if st.length else "`initial_carry`"
            raise SpecError(
                f"{what} belongs to the call of an nnx.RNN (`RNN:` in `init:`), and {st.name} is not one", st.loc
            )

    def bidirectional(self, arg: YNode | None, loc, n: int, cls: str) -> NnxBidirectional:
        """`Bidirectional: {forward, backward, name, rngs}`: nnx.Bidirectional(forward_rnn, backward_rnn, rngs=...)."""
        if arg is None or not arg.is_map:
            raise SpecError(
                "`Bidirectional` takes a mapping: forward and backward (each an RNN, as `RNN:` writes it: {cell: "
                "LSTMCell}), name, rngs (own | fork | none)",
                loc,
            )
        self.modelled("nnx.Bidirectional", loc)
        f = Fields(arg, "`Bidirectional`", ("forward", "backward", "name", "rngs"), ("forward", "backward"))
        rnns = []
        for side in ("forward", "backward"):
            node = f.need(side)
            if node.is_map and "name" in node.value:
                raise SpecError(
                    f"nnx.Bidirectional keeps its RNNs as `{side}_rnn`: drop `name:`", node.key_locs["name"]
                )
            rnns.append(dataclasses.replace(self.rnn(node, node.loc, 0, cls), name=f"{side}_rnn"))
        return NnxBidirectional(
            loc, _attribute(f, f"bidirectional_{n}"), rnns[0], rnns[1], _rnn_rngs(f, "a Bidirectional")
        )

    def rnn(self, arg: YNode | None, loc, n: int, cls: str) -> NnxRnn:
        """`RNN: {cell, name, rngs, broadcast, carry_draws}`: nnx.RNN(cell, rngs=..., broadcast_rngs=...)."""
        shape = (
            "`RNN` takes a mapping: cell (a standard cell such as {LSTMCell: {}} or a user cell {module: {class, "
            "init, call}}), name, rngs (own | fork | none), broadcast (the streams of broadcast_rngs), carry_draws "
            "(a user cell's initialize_carry draws)"
        )
        if arg is None or not arg.is_map:
            raise SpecError(shape, loc)
        self.modelled("nnx.RNN", loc)
        f = Fields(arg, "`RNN`", ("cell", "name", "rngs", "broadcast", "carry_draws", "carry_init"), ("cell",))
        cn = f.need("cell")
        kinds = CELLS + ("module",)
        if isinstance(cn.value, str):
            cn = YNode({cn.value: YNode(None, cn.loc, {})}, cn.loc, {cn.value: cn.loc})
        if not cn.is_map or len(cn.value) != 1:
            raise SpecError(
                f"`cell` of an RNN is one cell: {', '.join(f'{{{c}: {{}}}}' for c in CELLS)} or a user cell "
                "{module: {class, init, call}}",
                cn.loc,
            )
        ((ck, cv),) = cn.value.items()
        if ck not in kinds:
            raise SpecError(
                f"`cell` of an RNN is one of {', '.join(kinds)}, not {ck!r}{suggest(ck, kinds)}", cn.key_locs[ck]
            )
        if cv is not None and cv.is_map and "name" in cv.value:
            raise SpecError(
                "nnx.RNN keeps its cell as the attribute `cell`: drop `name:` (the cell's keys are named "
                "<rnn>.cell....)",
                cv.key_locs["name"],
            )
        cell = self.statement(cn, cls, "init", {})
        if isinstance(cell, NnxChild) and cell.stack:
            raise SpecError("a stacked cell inside nnx.RNN is not modelled yet; drop `stack:`", cell.loc)
        assert isinstance(cell, (NnxLayer, NnxChild))
        cell = dataclasses.replace(cell, name="cell")
        mode = _rnn_rngs(f, "an RNN")
        bn = f.get("broadcast")
        broadcast = () if bn is None else _streams(bn, "`broadcast:` (the streams of broadcast_rngs)")
        if isinstance(cell, NnxLayer):
            if f.has("carry_draws"):
                raise SpecError(
                    f"a {cell.kind}'s initialize_carry draws {CARRY_DRAWS[cell.kind]} key(s), always: drop "
                    "`carry_draws` (it is for a user cell)",
                    f.need("carry_draws").loc,
                )
            carry = CARRY_DRAWS[cell.kind]
        else:
            carry = f.integer("carry_draws", 0, 0, MAX_REPEAT)
        init = f.text("carry_init", "zeros")
        if init not in ("zeros", "random"):
            raise SpecError(
                "`carry_init` of an RNN is zeros (NNX's default: initialize_carry draws keys it does not use) or "
                f"random (the cell's carry_init uses them), not {init!r}",
                f.need("carry_init").loc,
            )
        return NnxRnn(loc, _attribute(f, f"rnn_{n}"), cell, mode, broadcast, carry, init)

    def statements(self, node: YNode | None, cls: str, where: str):
        if node is None or node.value is None:
            return
        if not node.is_seq:
            raise SpecError(f"`{where}` of {cls} must be a list of statements, not {type_name(node.value)}", node.loc)
        counts: dict[str, int] = {}
        for item in node.value:
            yield self.statement(item, cls, where, counts)

    def statement(self, item: YNode, cls: str, where: str, counts: dict) -> NnxStatement:
        allowed = (
            ("draw", "call") + CONTROL
            if where == "call"
            else ("draw", "fork", "module", "ToNNX", "RNN", "Bidirectional") + LAYERS
        )
        if isinstance(item.value, str):
            key, arg = item.value, None
        elif item.is_map and len(item.value) == 1:
            ((key, arg),) = item.value.items()
        else:
            raise SpecError(
                f"a statement of `{where}` is one of {', '.join(allowed)}, as `name` or `name: options`", item.loc
            )
        loc = item.key_locs.get(key, item.loc) if item.is_map else item.loc
        if key in LINEN_STATEMENTS:
            raise _mixed(key, loc)
        if key not in allowed:
            hint = ""
            if where == "call" and key in LAYERS + ("module", "ToNNX", "RNN", "Bidirectional"):
                hint = "; build it in `init:` and call it here with `call: NAME`"
            elif where == "init" and key == "call":
                hint = "; __init__ builds, __call__ calls: move it to `call:`"
            elif where == "init" and key in CONTROL:
                hint = (
                    f"; rngaudit models nnx.{key} in __call__ (`call:`), not in __init__: write the statements it "
                    "runs in `init:` as they are"
                )
            raise SpecError(
                f"unknown statement {key!r} in `{where}` of {cls}{suggest(key, allowed)}; allowed: "
                f"{', '.join(allowed)}{hint}",
                loc,
            )
        if key == "draw":
            return self.draw(arg, loc, where)
        if key == "fork":
            return self.stream_fork(arg, loc)
        if key == "call":
            return self.call(arg, loc)
        if key in ("cond", "switch"):
            return self.branches(key, arg, loc, cls)
        if key in ("fori_loop", "while_loop"):
            return self.loop(key, arg, loc, cls)
        n = counts.get(key, 0)
        counts[key] = n + 1
        if key == "ToNNX":
            return self.bridge(arg, loc, n)
        if key == "RNN":
            return self.rnn(arg, loc, n, cls)
        if key == "Bidirectional":
            return self.bidirectional(arg, loc, n, cls)
        if key == "module":
            if arg is None or not arg.is_map:
                raise SpecError("`module` takes a mapping: class, name, rngs, init, call", loc)
            for k in arg.value:
                if k in LINEN_STATEMENTS:
                    raise _mixed(k, arg.key_locs[k])
            f = Fields(
                arg, "`module`", ("class", "name", "rngs", "init", "call", "keep_rngs", "stack", "only"), ("class",)
            )
            mode = f.text("rngs", "shared")
            stack = f.integer("stack", 0, 1, MAX_LANES)
            modes = ("shared",) + STACK_RNGS if stack else RNGS_MODES
            if mode not in modes:
                if stack:
                    what = (
                        "`rngs` of a stacked module is shared (the caller's Rngs, split by nnx.split_rngs), split "
                        "(nnx.vmap over rngs.split(N)) or broadcast (over rngs.broadcast(N))"
                    )
                else:
                    what = (
                        "`rngs` of a module is shared (the caller's Rngs), fork (rngs.fork()) or none (built without "
                        "an Rngs)"
                    )
                hint = f"; `rngs: {mode}` builds a stack: add `stack: N`" if mode in STACK_RNGS else ""
                if stack and mode == "fork":
                    hint = "; drop `rngs: fork` (a stack's members are built from lanes of the caller's streams)"
                raise SpecError(f"{what}, not {mode!r}{suggest(mode, modes)}{hint}", f.need("rngs").loc)
            if mode in ("fork", "split", "broadcast") and self.lacks(f"rngs: {mode}"):
                raise self.too_old(f"rngs: {mode}", f.need("rngs").loc)
            only: tuple[str, ...] = ()
            on = f.get("only")
            if on is not None:
                if mode not in STACK_RNGS:
                    raise SpecError(
                        "`only:` names the streams rngs.split / rngs.broadcast split (`rngs: split` or `rngs: "
                        "broadcast` on a stacked module); the others are copied, count reset to 0",
                        on.loc,
                    )
                only = _streams(on, "`only:`")
                if not only:
                    raise SpecError(
                        "`only:` names at least one stream (rngs.split({...: None}) splits none, and nnx.vmap then "
                        "has nothing to map); drop `only:` to split every stream",
                        on.loc,
                    )
            inner = YNode(
                {k: v for k, v in arg.value.items() if k not in ("name", "rngs", "stack", "only")},
                arg.loc,
                arg.key_locs,
            )
            mod = self.module(inner, "`module`")
            if mode == "none":
                _needs_no_rngs(mod, arg.loc)
            if stack:
                kept = _keeps_shared(mod, self.version is not None and self.version < (0, 11))
                if kept is not None:
                    raise SpecError(
                        f"{kept} keeps the Rngs of a stacked module: inside nnx.vmap that is the caller's Rngs "
                        "object, which nnx.split_rngs puts back unsplit; rngaudit does not model it"
                        + (
                            ". Draw in the stacked module from a Dropout, or from a child built with `rngs: fork`"
                            if "flax 0.11" not in kept
                            else ""
                        ),
                        arg.loc,
                    )
            return NnxChild(loc, _attribute(f, f"{mod.cls.lower()}_{n}"), mod, mode, stack, only)
        return self.layer(key, arg, loc, n)

    def layer(self, kind: str, arg: YNode | None, loc, n: int) -> NnxLayer:
        defaults = LAYER_OPTIONS[kind]
        base: NnxLayer | None = None
        if arg is None or arg.value is None:
            values: dict = {}
            f = None
        else:
            f = Fields(arg, f"`{kind}`", ("name",) + tuple(defaults) + (("base_module",) if kind == "LoRA" else ()))
            values = {k: v for k, v in arg.value.items() if k != "base_module"}
            bn = f.get("base_module")
            if bn is not None:
                base = self.lora_base(bn)
        opts: list[tuple[str, object]] = []
        for k, default in defaults.items():
            node = values.get(k)
            if node is None:
                if default is None:
                    raise SpecError(f"`{kind}` needs `{k}`", arg.loc if arg is not None else loc)
                opts.append((k, default))
                continue
            v = node.value
            if isinstance(default, bool):
                if not isinstance(v, bool):
                    raise SpecError(f"`{k}` must be true or false, not {type_name(v)}", node.loc)
            elif k in ("rate", "dropout_rate"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                    raise SpecError(f"`{k}` must be a number from 0 to 1, not {v!r}", node.loc)
                v = float(v)
            else:
                v = as_str(node, f"`{k}`")
            opts.append((k, v))
        name = _attribute(f, f"{kind.lower()}_{n}")
        if "keep_rngs" in values and self.lacks("keep_rngs"):
            raise self.too_old("keep_rngs", values["keep_rngs"].loc)
        if kind in SINCE and self.lacks(kind):
            raise self.too_old(kind, loc)
        if f"nnx.{kind}" in MODELLED_SINCE:
            self.modelled(f"nnx.{kind}", loc)
        return NnxLayer(loc, kind, name, tuple(opts), base)

    def lora_base(self, node: YNode) -> NnxLayer:
        """`base_module:` of nnx.LoRA: one standard layer, built before the LoRA from the same Rngs (its keys are
        named <lora>.base_module....)."""
        shape = (
            f"`base_module` of a LoRA is one standard layer that draws nothing when called ({', '.join(LORA_BASES)}),"
            " as `{Linear: {}}`"
        )
        why = "; rngaudit does not model a user module or a layer drawing at its call there yet"
        if isinstance(node.value, str):
            node = YNode({node.value: YNode(None, node.loc, {})}, node.loc, {node.value: node.loc})
        if not node.is_map or len(node.value) != 1:
            raise SpecError(shape + why, node.loc)
        ((bk, bv),) = node.value.items()
        if bk not in LORA_BASES:
            hint = suggest(bk, LORA_BASES) or why
            raise SpecError(f"{shape}, not {bk!r}{hint}", node.key_locs[bk])
        if bv is not None and bv.is_map and "name" in bv.value:
            raise SpecError("nnx.LoRA keeps its base as the attribute `base_module`: drop `name:`", bv.key_locs["name"])
        return dataclasses.replace(self.layer(bk, bv, node.key_locs[bk], 0), name="base_module")

    def bridge(self, arg: YNode | None, loc, n: int) -> NnxBridge:
        if arg is None or not arg.is_map:
            raise SpecError(
                "`ToNNX` takes a mapping: module (the Linen module, as a Linen spec writes it: {class, body} or a "
                "standard layer such as {Dense: {features: 4}}), name, rngs (fork | key), lazy_init",
                loc,
            )
        if self.lacks("ToNNX"):
            raise SpecError(
                "bridge.ToNNX forks the Rngs it is given from flax 0.12 (before, it kept them and drew differently, "
                f"which rngaudit does not model); {self.origin or 'this spec'} says flax "
                f"{'.'.join(map(str, self.version or ()))}",
                loc,
            )
        f = Fields(arg, "`ToNNX`", ("module", "name", "rngs", "lazy_init"), ("module",))
        mode = f.text("rngs", "fork")
        if mode not in BRIDGE_RNGS:
            raise SpecError(
                f"`rngs` of ToNNX is fork (bridge.ToNNX(m, rngs=rngs): it keeps rngs.fork()) or key (rngs="
                f"rngs.params(): it keeps Rngs(params=key)), not {mode!r}{suggest(mode, BRIDGE_RNGS)}",
                f.need("rngs").loc,
            )
        module = BodyParser().target(f.need("module"), "the Linen `module` of ToNNX")
        check_budget(module)
        return NnxBridge(loc, _attribute(f, f"tonnx_{n}"), module, mode, f.flag("lazy_init", True))

    def draw(self, arg: YNode | None, loc, where: str = "call") -> NnxDraw:
        if arg is None:
            raise SpecError("`draw` names a stream: `draw: params` or `draw: {stream: noise, repeat: 2}`", loc)
        if isinstance(arg.value, str):
            return NnxDraw(loc, arg.value)
        if not arg.is_map:
            raise SpecError("`draw` names a stream: `draw: params` or `draw: {stream: noise, repeat: 2}`", arg.loc)
        if where == "init" and "when" in arg.value:
            raise SpecError(
                "`when` is for a draw in `call:` (drawn in train or eval mode only); __init__ draws once, as built",
                arg.key_locs["when"],
            )
        f = Fields(arg, "`draw`", ("stream", "repeat", "label", "draw", "from", "when"), ("stream",))
        dn = f.get("draw")
        return NnxDraw(
            loc,
            f.name("stream"),
            f.integer("repeat", 1, 1, MAX_REPEAT),
            f.text("label"),
            None if dn is None else parse_draw(dn),
            _keeper(f),
            _when(f),
        )

    def stream_fork(self, arg: YNode | None, loc) -> NnxStreamFork:
        if self.lacks("fork"):
            raise self.too_old("fork", loc)
        if arg is None or not (isinstance(arg.value, str) or arg.is_map):
            raise SpecError(
                "`fork` names the stream a module forks and keeps: `fork: dropout` (self.rngs = "
                "rngs.dropout.fork()) or `fork: {stream: dropout, name: rng}` (self.rng = rngs.dropout.fork())",
                loc,
            )
        if isinstance(arg.value, str):
            return NnxStreamFork(loc, arg.value, "rngs")
        f = Fields(arg, "`fork`", ("stream", "name"), ("stream",))
        return NnxStreamFork(loc, f.name("stream"), _attribute(f, "rngs"))

    def call(self, arg: YNode | None, loc) -> NnxCall:
        if arg is None:
            raise SpecError("`call` names an attribute built in `init:`: `call: drop` or `call: {name: drop}`", loc)
        if isinstance(arg.value, str):
            return NnxCall(loc, arg.value)
        f = Fields(
            arg,
            "`call`",
            ("name", "repeat", "key", "rngs", "fork_rngs", "length", "initial_carry", "deterministic", "when")
            + TRANSFORM_KEYS,
            ("name",),
        )
        length = f.integer("length", 0, 1, MAX_STEPS)
        initial = f.flag("initial_carry", False)
        det = f.flag("deterministic", False) if f.has("deterministic") else None
        rn = f.get("rngs")
        if rn is not None:
            if rn.value not in ("call", "model"):
                raise SpecError(
                    "`rngs` of a call is `call` (the Dropout is given the Rngs every call of the model is given, the "
                    "spec's `call_rngs:`) or `model` (the Rngs the model is built from: Model(rngs) and then "
                    "model(x, rngs))",
                    rn.loc,
                )
            for other in ("key", "fork_rngs", *TRANSFORM_KEYS):
                if f.has(other):
                    raise SpecError(f"give a call `rngs: {rn.value}` or `{other}:`, not both", rn.loc)
            if self.lacks("a key given to a Dropout call"):
                raise self.too_old("a key given to a Dropout call", rn.loc)
            return NnxCall(
                loc,
                f.name("name"),
                f.integer("repeat", 1, 1, MAX_REPEAT),
                given_rngs=rn.value,
                length=length,
                initial_carry=initial,
                deterministic=det,
                when=_when(f),
            )
        fork = _fork(f.get("fork_rngs"))
        if fork is not None and self.lacks("fork_rngs"):
            raise self.too_old("fork_rngs", f.need("fork_rngs").loc)
        kn = f.get("key")
        key = None
        if kn is not None:
            if self.lacks("a key given to a Dropout call"):
                raise self.too_old("a key given to a Dropout call", kn.loc)
            assert self.key_source is not None
            key = self.key_source(kn)
        t = transform(f, stacked_ok=True)
        if key is not None and t is not None:
            raise SpecError(
                "a key given at the call (`key:`) under nnx.vmap/nnx.scan is not modelled; give it to a plain call",
                kn.loc if kn is not None else loc,
            )
        return NnxCall(
            loc,
            f.name("name"),
            f.integer("repeat", 1, 1, MAX_REPEAT),
            t,
            key,
            fork,
            length=length,
            initial_carry=initial,
            deterministic=det,
            when=_when(f),
        )

    def body(self, node: YNode | None, cls: str, what: str) -> tuple[NnxStatement, ...]:
        """A branch or loop body: the statements `call:` takes (nested control flow included)."""
        if node is None or node.value is None:
            return ()
        if not node.is_seq:
            raise SpecError(
                f"{what} is a list of statements (those `call:` takes: {', '.join(('draw', 'call') + CONTROL)}), "
                f"not {type_name(node.value)}",
                node.loc,
            )
        counts: dict[str, int] = {}
        return tuple(self.statement(item, cls, "call", counts) for item in node.value)

    def branches(self, kind: str, arg: YNode | None, loc, cls: str) -> NnxCond:
        """`cond: {pred, true_fun, false_fun}` or `switch: {index, branches}`."""
        if kind == "cond":
            if arg is None or not arg.is_map:
                raise SpecError(
                    "`cond` takes a mapping: pred (true or false: the branch nnx.cond takes), true_fun and false_fun "
                    "(the statements each branch runs, as `call:` lists them; [] for none)",
                    loc,
                )
            f = Fields(arg, "`cond`", ("pred", "true_fun", "false_fun"), ("pred", "true_fun", "false_fun"))
            pn = f.need("pred")
            if not isinstance(pn.value, bool):
                raise SpecError(
                    "`pred` of cond is true or false (the branch nnx.cond takes: rngaudit replays a known "
                    f"predicate), not {type_name(pn.value)}",
                    pn.loc,
                )
            both = (
                self.body(f.need("true_fun"), cls, "`true_fun` of cond"),
                self.body(f.need("false_fun"), cls, "`false_fun` of cond"),
            )
            return NnxCond(loc, kind, pn.value, 0 if pn.value else 1, both)
        if arg is None or not arg.is_map:
            raise SpecError(
                "`switch` takes a mapping: index (the branch nnx.switch takes) and branches (a list of branches, "
                "each a list of statements as `call:` lists them)",
                loc,
            )
        f = Fields(arg, "`switch`", ("index", "branches"), ("index", "branches"))
        index = as_int(f.need("index"), "`index` of switch", -(2**31), 2**31 - 1)
        bn = f.need("branches")
        if not bn.is_seq or not bn.value:
            raise SpecError(
                "`branches` of switch is a list of one or more branches, each a list of statements (nnx.switch "
                f"with no branches is jax.lax.switch's ValueError), not {'[]' if bn.is_seq else type_name(bn.value)}",
                bn.loc,
            )
        out = []
        for i, b in enumerate(bn.value):
            if b.value is not None and not b.is_seq:
                raise SpecError(
                    f"branch {i} of switch is a list of statements, not {type_name(b.value)}: `branches:` is a list "
                    "of lists (`branches: [[call: a], [call: b]]`)",
                    b.loc,
                )
            out.append(self.body(b, cls, f"branch {i} of switch"))
        # (jax.lax.switch clamps the index into range: below 0 runs branch 0, past the end the last one)
        return NnxCond(loc, kind, index, min(max(index, 0), len(out) - 1), tuple(out))

    def loop(self, kind: str, arg: YNode | None, loc, cls: str) -> NnxLoop:
        """`fori_loop: {iterations, body}` or `while_loop: {iterations, body}`."""
        if arg is None or not arg.is_map:
            raise SpecError(
                f"`{kind}` takes a mapping: iterations (how many times the body runs) and body (its statements, "
                "as `call:` lists them)",
                loc,
            )
        f = Fields(arg, f"`{kind}`", ("iterations", "body"), ("iterations", "body"))
        n = as_int(f.need("iterations"), f"`iterations` of {kind}", 0, MAX_STEPS)
        return NnxLoop(loc, kind, n, self.body(f.need("body"), cls, f"`body` of {kind}"))


def _when(f: Fields) -> str | None:
    """A `call:` statement's `when`: the model's mode it runs in (`if not self.deterministic:` / `if train:`)."""
    when = f.text("when")
    if when is not None and when not in MODES:
        raise SpecError(
            f"`when` is {' or '.join(MODES)} (run only while the model is in that mode: model.train() / "
            f"model.eval(), or a `train` argument that follows it), not {when!r}{suggest(when, MODES)}",
            f.need("when").loc,
        )
    return when


def _rnn_rngs(f: Fields, what: str) -> str:
    """The `rngs:` of an RNN or a Bidirectional: what it keeps for initialize_carry."""
    mode = f.text("rngs", "own")
    if mode not in RNN_RNGS:
        raise SpecError(
            f"`rngs` of {what} is own (its own RngStream(0, tag='carry'), the default), fork (rngs=rngs: it keeps "
            f"rngs.carry.fork()) or none (rngs=False), not {mode!r}{suggest(mode, RNN_RNGS)}",
            f.need("rngs").loc,
        )
    return mode


def _fork(node: YNode | None) -> tuple[str, ...] | None:
    """`fork_rngs:` of a call: None (no fork), () (`true`: every stream) or the tags of the streams forked."""
    if node is None or node.value is False:
        return None
    if node.value is True:
        return ()
    tags = _streams(node, "`fork_rngs:` (true: every stream, or the tags of the streams nnx.fork_rngs forks)")
    if not tags:
        raise SpecError(
            "`fork_rngs: []` forks no stream; name the tags of the streams to fork, or `fork_rngs: true` for every one",
            node.loc,
        )
    return tags


TRANSFORM_KEYS = ("vmap", "scan", "split", "broadcast")


def _attribute(f: Fields | None, default: str) -> str:
    """An attribute's `name:` (`default` without one): a Python identifier, or a path through containers
    (`blocks.0`, as capture names what an nnx.List holds)."""
    if f is None or f.get("name") is None:
        return default
    name = f.text("name", default)
    if not all(p.isidentifier() or p.isdigit() for p in name.split(".")):
        raise SpecError(
            f"`name` {name!r} is not an attribute name (self.{name} = ...): use a Python identifier (or a path "
            "through containers such as blocks.0)",
            f.need("name").loc,
        )
    return name


def _keeps_shared(mod: NnxModule, old: bool = False) -> str | None:
    """The first module in `mod` (itself, or a child given the same Rngs) that keeps its Rngs; `old`: flax
    before 0.11, whose Dropout and attention keep the Rngs they are given."""
    if mod.keep_rngs:
        return mod.cls
    for st in mod.init:
        if isinstance(st, NnxChild) and st.rngs == "shared":
            found = _keeps_shared(st.module, old)
            if found is not None:
                return found
        if (
            old
            and isinstance(st, NnxLayer)
            and (st.kind == "Dropout" or (st.kind == "MultiHeadAttention" and st.opt("dropout_rate") > 0))
        ):
            return f"{mod.cls}.{st.name} (a {st.kind}, which before flax 0.11 keeps the Rngs it is given)"
    return None


def _streams(node: YNode, what: str) -> tuple[str, ...]:
    items = [node] if isinstance(node.value, str) else node.value if node.is_seq else None
    if items is None:
        raise SpecError(f"{what} is a stream name or a list of them, not {type_name(node.value)}", node.loc)
    return tuple(as_str(i, f"a stream of {what}") for i in items)


def transform(f: Fields, stacked_ok: bool) -> NnxTransform | None:
    """`vmap:`/`scan:` with `split:`/`broadcast:` of a call, or None."""
    vn, sn = f.get("vmap"), f.get("scan")
    if vn is not None and sn is not None:
        raise SpecError("a call is under `vmap:` or `scan:`, not both (nest them in two modules)", sn.loc)
    tn = vn if vn is not None else sn
    kind = "vmap" if vn is not None else "scan" if sn is not None else None
    lists = {"vmap": "split", "scan": "broadcast"}  # the streams list each transform takes
    for belongs, lst in lists.items():
        ln = f.get(lst)
        if ln is not None and belongs != kind:
            under = f"; under `{kind}:` give `{lists[kind]}:`" if kind is not None else ""
            raise SpecError(f"`{lst}:` belongs to `{belongs}:`{under}", ln.loc)
    if tn is None or kind is None:
        return None
    if tn.value is True and stacked_ok:
        lanes = 0
    else:
        what = "lanes" if kind == "vmap" else "steps"
        over = " or true (over a stacked module's axis)" if stacked_ok else ""
        if isinstance(tn.value, bool) or not isinstance(tn.value, int):
            raise SpecError(f"`{kind}:` is the number of {what}{over}, not {type_name(tn.value)}", tn.loc)
        lanes = as_int(tn, f"`{kind}:` (the number of {what})", 1, MAX_LANES if kind == "vmap" else MAX_STEPS)
    key = lists[kind]
    sl = f.get(key)
    streams = () if sl is None else _streams(sl, f"`{key}:`")
    if streams and not lanes:
        raise SpecError(
            f"`{key}:` applies to {kind} over a new axis; a stacked module's streams are already split per member",
            f.need(key).loc,
        )
    return NnxTransform(kind, lanes, streams)


# the spec's `call_rngs:`, and the name of that Rngs in a replay: its streams are `call_rngs.<stream>`
CALL_RNGS = "call_rngs"
RUN_EVENTS = ("call", "stale_call", "reseed", "lazy_init", "train", "eval", "draw")


def _run(node: YNode, key_source) -> tuple[NnxStep | NnxReseed | NnxMode | NnxRunDraw, ...]:
    if not node.is_seq:
        raise SpecError(
            f"`run` must be a list of events ({', '.join(RUN_EVENTS)}), not {type_name(node.value)}", node.loc
        )
    out: list[NnxStep | NnxReseed | NnxMode | NnxRunDraw] = []
    for item in node.value:
        if isinstance(item.value, str):
            key, arg, loc = item.value, None, item.loc
        elif item.is_map and len(item.value) == 1:
            ((key, arg),) = item.value.items()
            loc = item.key_locs[key]
        else:
            raise SpecError(f"an event of `run` is one of {', '.join(RUN_EVENTS)}", item.loc)
        if key not in RUN_EVENTS:
            raise SpecError(
                f"unknown event {key!r} in `run`{suggest(key, RUN_EVENTS)}; use {', '.join(RUN_EVENTS)}", loc
            )
        if key == "call" and arg is not None and arg.is_map:
            f = Fields(arg, "`call`", ("n", "fork_rngs") + TRANSFORM_KEYS)
            n, t = f.integer("n", 1, 1, MAX_STEPS), transform(f, stacked_ok=False)
            out.append(NnxStep(loc, n, False, t, fork=_fork(f.get("fork_rngs"))))
        elif key == "lazy_init":
            if arg is not None:
                raise SpecError("`lazy_init` takes nothing: it is one call of the model under bridge.lazy_init", loc)
            if out:
                raise SpecError(
                    "`lazy_init` (bridge.lazy_init(model, x): the model's init, its keys are construction's) comes "
                    "first in `run`",
                    loc,
                )
            out.append(NnxStep(loc, 1, lazy_init=True))
        elif key in ("train", "eval"):
            if arg is not None and arg.value is not None:
                raise SpecError(
                    f"`{key}` takes nothing: it is model.{key}(), which sets `deterministic` on every Dropout and "
                    "attention layer of the model",
                    loc,
                )
            out.append(NnxMode(loc, key == "eval"))
        elif key in ("call", "stale_call"):
            n = 1 if arg is None else as_int(arg, f"`{key}` (how many calls)", 1, MAX_STEPS)
            out.append(NnxStep(loc, n, key == "stale_call"))
        elif key == "draw":
            # model.rngs.<stream>() outside the model's call: `draw: noise` or `draw: {stream: noise, repeat: 2}`
            if arg is not None and isinstance(arg.value, str):
                out.append(NnxRunDraw(loc, arg.value))
                continue
            if arg is None or not arg.is_map:
                raise SpecError(
                    "`draw` in `run` is model.rngs.<stream>() outside the model's call: `draw: noise` or `draw: "
                    "{stream: noise, repeat: 2}`",
                    loc,
                )
            f = Fields(arg, "`draw`", ("stream", "repeat", "from"), ("stream",))
            keeper = _keeper(f)
            out.append(NnxRunDraw(loc, f.name("stream"), f.integer("repeat", 1, 1, MAX_REPEAT), keeper))
        else:
            out.append(_reseed(arg, loc, key_source))
    return tuple(out)


RESEED_POLICIES = ("scalars_only", "match_shape")


def _reseed(arg, loc: Location, key_source) -> NnxReseed:
    """`reseed: {dropout: 5}` (nnx.reseed(model, dropout=5)), or `reseed: {streams: {dropout: 5}, module: enc,
    policy: match_shape}` (nnx.reseed(model.enc, dropout=5, policy='match_shape'))."""
    said = (
        "`reseed` takes the streams to reseed and their new keys, `reseed: {dropout: 5}`, or `reseed: {streams: "
        "{dropout: 5}, module: enc, policy: match_shape}` for nnx.reseed(model.enc, dropout=5, policy='match_shape')"
    )
    if arg is None or not arg.is_map or not arg.value:
        raise SpecError(said, loc)
    sn = arg.value.get("streams")
    if sn is None or not sn.is_map:
        return NnxReseed(loc, tuple((s, key_source(kn)) for s, kn in arg.value.items()))
    f = Fields(arg, "`reseed`", ("streams", "module", "policy"), ("streams",))
    if not sn.value:
        raise SpecError(said, sn.loc)
    module = _named(
        f,
        "module",
        "`module:` of a `reseed` names the submodule reseeded (nnx.reseed(model.enc, ...): `module: enc`, dotted for "
        "one inside another); leave it out for the whole model",
    )
    policy = f.text("policy", "scalars_only")
    if policy not in RESEED_POLICIES:
        raise SpecError(
            f"`policy: {policy}` of a `reseed`: nnx.reseed's policy is {' or '.join(RESEED_POLICIES)} (a callable "
            "policy cannot be written in a spec)",
            f.need("policy").loc,
        )
    return NnxReseed(loc, tuple((s, key_source(kn)) for s, kn in sn.value.items()), module, policy)


def nnx_spec(
    top: Fields,
    file: str,
    impl: str,
    partitionable: bool,
    rngs: dict[str, RngSource],
    key_source,
    flax_override: str | None = None,
    origin: str | None = None,
) -> NnxSpec:
    """The NNX spec of a top-level mapping that says `flavour: nnx` (its jax settings and rngs already read);
    `key_source` reads a key (a seed, raw key data or a key expression) as `rngs:` does."""
    for key in top.node.value:
        if key in LINEN_STATEMENTS:
            raise _mixed(key, top.node.key_locs[key])
        if key == "method":
            raise SpecError(
                "`method:` names the method a Linen model runs (capture --method); an NNX spec's `run:` and the "
                "model's `call:` say what runs",
                top.node.key_locs[key],
            )
    sn, rn = top.get("steps"), top.get("run")
    if sn is not None and rn is not None:
        raise SpecError("give `steps: N` (N calls of the model) or `run:` (calls and events), not both", rn.loc)
    if rn is not None:
        run = _run(rn, key_source)
    else:
        steps = 1 if sn is None else as_int(sn, "`steps`", 0, MAX_STEPS)
        run = (NnxStep(sn.loc if sn is not None else top.node.loc, steps),) if steps else ()
    fn = top.get("flax")
    ff = None if fn is None else Fields(fn, "flax", ("version",))
    version = None if ff is None else release(ff)
    if flax_override is not None:
        version = None if flax_override == NEWEST else flax_override
    if ff is not None and version is not None and version_tuple(version) < (0, 8):
        raise SpecError(f"flax {version} has no NNX (flax.nnx is 0.8 and later)", ff.need("version").loc)
    parser = NnxParser()
    parser.version = None if version is None else version_tuple(version)
    parser.origin = origin or ""
    parser.key_source = key_source
    for e in run:
        if isinstance(e, NnxStep) and e.fork is not None and parser.lacks("fork_rngs"):
            raise parser.too_old("fork_rngs", e.loc)
        if isinstance(e, NnxReseed) and e.policy != "scalars_only" and parser.lacks("nnx.reseed's policy"):
            raise parser.too_old("nnx.reseed's policy", e.loc)
    model = parser.module(top.need("model"))
    names = {st.name: st for st in model.init if isinstance(st, ATTRIBUTES)}
    for e in run:
        if (
            isinstance(e, NnxReseed)
            and e.module
            and _attribute_of(names, e.module) is None
            and not _holds(names, e.module)
        ):
            raise SpecError(
                f"`module: {e.module}` of a `reseed` names the submodule reseeded (nnx.reseed(model.{e.module}, "
                f"...)): the model has no attribute {e.module!r} built in `init:` (dotted for one inside a submodule "
                "built as a `module`: enc.block; not inside a stack: reseed the stack)",
                e.loc,
            )
    for drawn in run:
        if isinstance(drawn, NnxRunDraw) and drawn.keeper:
            _check_keeper(names, drawn.keeper, drawn.stream, f"model.{drawn.keeper}", drawn.loc)
        elif isinstance(drawn, NnxRunDraw) and not model.keep_rngs:
            raise SpecError(
                f"`draw: {drawn.stream}` in `run` is model.rngs.{drawn.stream}() outside the model's call: the model "
                "keeps its Rngs (`keep_rngs: true` on `model:`)",
                drawn.loc,
            )
    cn = top.get(CALL_RNGS)
    call_rngs = call_rngs_steps = None
    if cn is not None:
        what = (
            "`call_rngs` is the nnx.Rngs given to every call of the model (model(x, rngs=rngs)): its streams and "
            "seeds, e.g. `call_rngs: {dropout: 1}`; or a list of them, one a step, where each step's call is given "
            "an Rngs made for it (model(x, rngs=nnx.Rngs(dropout=jax.random.fold_in(key, step)))), `null` for a "
            "step whose call is given none (an eval call, model(x))"
        )
        if cn.is_seq and cn.value:
            if len(cn.value) != sum(e.n for e in run if isinstance(e, NnxStep) and not e.lazy_init):
                raise SpecError(
                    f"`call_rngs` lists {len(cn.value)} Rngs, one a step, and the spec makes "
                    f"{sum(e.n for e in run if isinstance(e, NnxStep) and not e.lazy_init)} steps: give one for each "
                    "step",
                    cn.loc,
                )
            for item in cn.value:
                if item.value is not None and (not item.is_map or not item.value):
                    raise SpecError(what, item.loc)
            call_rngs_steps = tuple(
                None if item.value is None else {stream: key_source(kn) for stream, kn in item.value.items()}
                for item in cn.value
            )
        elif not cn.is_map or not cn.value:
            raise SpecError(what, cn.loc)
        else:
            call_rngs = {stream: key_source(kn) for stream, kn in cn.value.items()}
    given = [st for st in _calls(model) if st.given_rngs]
    uses = next((st for st in given if st.given_rngs == "call"), None)
    if uses is not None and call_rngs is None and call_rngs_steps is None:
        raise SpecError(
            f"`rngs: call` gives {uses.name} the Rngs the model's call is given: say what it holds with a top-level "
            "`call_rngs: {dropout: SEED}`",
            uses.loc,
        )
    if call_rngs is not None or call_rngs_steps is not None or given:
        for e in run:
            if isinstance(e, NnxStep) and (e.stale or e.transform is not None or e.fork is not None or e.lazy_init):
                raise SpecError(
                    "rngaudit models an Rngs given at a call (`call_rngs`, `rngs: call` or `rngs: model`) for plain "
                    "calls of the model (`call`, `steps`); not under stale_call, lazy_init, fork_rngs or a "
                    "transform yet",
                    e.loc,
                )
    return NnxSpec(
        file,
        impl,
        partitionable,
        rngs,
        model,
        run,
        flax_version=version,
        call_rngs=call_rngs,
        call_rngs_steps=call_rngs_steps,
    )


def _keeper(f: Fields) -> str:
    """`from:` of a `draw`: the submodule whose kept Rngs it draws from ("": none said)."""
    return _named(
        f,
        "from",
        "`from:` names the submodule whose kept Rngs the draw is from (`from: enc`); leave it out for the module's "
        "own (self.rngs)",
    )


def _named(f: Fields, key: str, said: str) -> str:
    """Field `key`, a name ("" when left out); one given empty is `said`, at it."""
    value = f.text(key, "")
    if f.has(key) and not value.strip():
        raise SpecError(said, f.need(key).loc)
    return value


def _check_keeper(names: dict, keeper: str, stream: str, what: str, loc: Location) -> None:
    """`from: KEEPER` of a `draw`: a submodule built as a module (`names`: the attributes of the module drawing, or
    of the model) that keeps its Rngs (`what`: how the code names it, `model.enc` or `self.enc`)."""
    found = _attribute_of(names, keeper)
    if isinstance(found, NnxStreamFork):
        if found.stream != stream:
            raise SpecError(
                f"`from: {keeper}` draws from the fork of {found.stream!r} kept as {keeper} ({what} = "
                f"rngs.{found.stream}.fork()), a stream of tag {found.stream!r}: write `stream: {found.stream}`",
                loc,
            )
        return
    if isinstance(found, NnxChild) and found.stack:
        raise SpecError(
            f"`from: {keeper}` of a `draw`: {keeper} is a stack (`stack: {found.stack}`), whose members hold split "
            "Rngs; `from:` names a submodule built as a `module` that keeps its Rngs (draw inside the stack's own "
            "`call:` instead)",
            loc,
        )
    if not (isinstance(found, NnxChild) and not found.stack):
        raise SpecError(
            f"`from: {keeper}` of a `draw` names the module whose kept Rngs is drawn from ({what}.rngs.{stream}()): "
            f"there is no module {keeper!r} built in `init:` (a submodule built as a `module`, not a stack; dotted "
            f"for one inside another: enc.block), nor a stream kept by `fork:` of that name ({what}())",
            loc,
        )
    if not found.module.keep_rngs:
        raise SpecError(
            f"`draw: {stream}` from {keeper} is {what}.rngs.{stream}(): {found.module.cls} keeps its Rngs "
            f"(`keep_rngs: true` on module {keeper!r})",
            loc,
        )


def _holds(names: dict, name: str) -> bool:
    """Whether `name` holds attributes named under it (`blocks` of `blocks.0`, `blocks.1`: an nnx.List of a module,
    or of a submodule built as a module: `enc.blocks`)."""
    if any(n.startswith(name + ".") for n in names):
        return True
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = names.get(".".join(parts[:i]))
        if isinstance(head, NnxChild) and not head.stack:
            inner = {st.name: st for st in head.module.init if isinstance(st, ATTRIBUTES)}
            if _holds(inner, ".".join(parts[i:])):
                return True
    return False


def _attribute_of(names: dict, name: str):
    """The statement that built attribute `name` of a module (`names`: its attributes), or None. A dotted name
    reaches into a submodule built as a module (`enc.drop`: self.enc.drop, called from a method of enc such as
    self.enc.encode(x)); a name that is itself an attribute (`blocks.0`, an nnx.List item) is taken first."""
    if name in names:
        return names[name]
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = names.get(".".join(parts[:i]))
        if isinstance(head, NnxChild) and not head.stack:
            inner = {st.name: st for st in head.module.init if isinstance(st, ATTRIBUTES)}
            found = _attribute_of(inner, ".".join(parts[i:]))
            if found is not None:
                return found
    return None


def _needs_no_rngs(mod: NnxModule, loc: Location) -> None:
    """A module built without an Rngs (`rngs: none`, `Block(d)`) builds only what takes none: Dropouts without
    rngs and modules built without one (any other layer, and a draw, would fail in NNX on rngs=None)."""
    for st in mod.init:
        if isinstance(st, NnxLayer) and st.kind == "Dropout" and not st.opt("rngs"):
            continue
        if isinstance(st, NnxChild) and st.rngs == "none" and not st.stack:
            continue
        raise SpecError(
            f"{mod.cls} is built without an Rngs (`rngs: none`), and its `init:` builds {st.name if hasattr(st, 'name') else 'a draw'} from one; "
            "a module built without an Rngs holds only Dropouts built without rngs (`rngs: false`) and modules "
            "built without one (`rngs: none`)",
            st.loc,
        )
    if mod.keep_rngs:
        raise SpecError(f"{mod.cls} is built without an Rngs (`rngs: none`): it keeps none (drop `keep_rngs`)", loc)


def _calls(mod: NnxModule):
    """Every call statement of a module and of the modules it builds, nested in control flow too."""
    for st, _ in nested(mod.call):
        if isinstance(st, NnxCall):
            yield st
    for st in mod.init:
        if isinstance(st, NnxChild):
            yield from _calls(st.module)
        else:
            rnns = (st.forward, st.backward) if isinstance(st, NnxBidirectional) else (st,)
            for r in rnns:
                if isinstance(r, NnxRnn) and isinstance(r.cell, NnxChild):
                    yield from _calls(r.cell.module)


def drawn_streams(mod: NnxModule) -> set[str]:
    """The streams a module (its submodules included) asks for: its Dropout and attention layers' rng_collection
    and its `draw:` statements' streams."""
    out: set[str] = set()

    def walk(x) -> None:
        if isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            if isinstance(x, NnxLayer) and x.kind in ("Dropout", "MultiHeadAttention"):
                out.add(str(dict(x.options).get("rng_collection", "dropout")))
            elif isinstance(x, (NnxDraw, NnxStreamFork)):
                out.add(x.stream)
            walk([getattr(x, f.name) for f in dataclasses.fields(x) if f.name != "loc"])

    walk(mod)
    return out
