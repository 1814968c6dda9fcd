"""Flax NNX's derivation, replayed from an NNX spec: `nnx.Rngs` streams as objects (key, count, tag), shared by
reference between the layers built from one Rngs, forked where NNX forks (Dropout and attention at
construction, `rngs.fork()`), and every `RngStream.__call__` recorded as `fold_in(stream_key, count)`.

The rules (FLAX_NNX_RULES.md, flax/nnx/rnglib.py, flax/nnx/nn/*.py, Flax 0.11 and later):
- `stream()` returns fold_in(key, count) and counts up; the key never changes; the stream's name is not hashed.
- a stream missing from an Rngs falls back to `default` (sharing its counter); without `default` NNX raises
  AttributeError (`rngs.name()`) or KeyError (`rngs['name']`).
- layers draw `params` in __init__ in a fixed order (kernel, bias; scale, bias; attention's q, k, v, [q_ln,
  k_ln], out), from the caller's Rngs: counts continue across layers.
- Dropout forks one key from its rng_collection at construction (its own stream, count 0, the tag of the
  stream it forked from); each call that is not deterministic, with 0 < rate < 1, draws one key from it.
- MultiHeadAttention forks `rngs.dropout` after its params when dropout_rate > 0 and keep_rngs.
- `rngs.fork()` draws one key from every stream, in the Rngs' order, into a new Rngs of count-0 streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import FlaxError, Location
from ..spec.nnx import NnxCall, NnxChild, NnxDraw, NnxLayer, NnxModule, NnxReseed, NnxSpec, NnxStep
from ..spec.tree import Draw
from .keys import KeyData, KeyEngine

if TYPE_CHECKING:
    import numpy as np

RULES = "flax>=0.11 (NNX: Dropout and attention fork their stream at construction)"
MAX_NNX_DRAWS = 50_000_000


@dataclass
class Stream:
    """An RngStream: where it lives, its tag, its key (value and how it was made) and its count."""

    path: str  # e.g. rngs.params, block.drop.rngs
    tag: str
    key: KeyData
    chain: tuple[str, ...]  # how the key was made: key(1), fold_in 0 (Dropout fork at drop), ...
    count: int = 0


@dataclass(frozen=True)
class NnxKey:
    """One key an RngStream handed out."""

    step: int  # 0: construction (__init__), n: the n-th call of the model
    site: str  # module path and what drew: linear.kernel, drop (call), block (rngs.fork)
    kind: str  # param, fork, dropout, attention_dropout, draw
    requested: str  # the stream asked for (before the `default` fallback)
    tag: str  # the stream that served it
    stream: str  # that stream's path
    count: int
    chain: tuple[str, ...]  # the stream key's chain; the key is fold_in(stream key, count)
    key: KeyData
    loc: Location
    label: str | None = None
    draw: Draw | None = None

    @property
    def fallback(self) -> bool:
        return self.requested != self.tag and self.tag == "default"


class Rngs:
    """An nnx.Rngs: its streams in order (vars(self) order)."""

    def __init__(self, name: str, streams: dict[str, Stream]):
        self.name = name
        self.streams = streams

    def get(self, stream: str, error: str, loc: Location) -> Stream:
        # mirrors flax/nnx/rnglib.py Rngs._get_stream
        s = self.streams.get(stream)
        if s is None:
            s = self.streams.get("default")
        if s is None:
            have = ", ".join(self.streams) or "none"
            raise FlaxError(
                error,
                f"No RngStream named '{stream}' found in Rngs. ({self.name} has {have}: add `{stream}:` "
                "(or `default:`) to rngs, or give the module an Rngs that has it)",
                loc,
            )
        return s


class NnxReplayer:
    """Runs an NNX spec's model: construction, then `steps` calls, recording every key handed out."""

    def __init__(self, spec: NnxSpec, engine: KeyEngine):
        self.spec = spec
        self.engine = engine
        self.keys: list[NnxKey] = []
        self.step = 0
        # every RngStream the model's graph holds, at each attribute path that reaches it
        self.graph: list[tuple[tuple[str, ...], Stream]] = []

    def run(self) -> list[NnxKey]:
        # mirrors nnx.Rngs.__init__: the `default` seed (Rngs(0, ...)) is added after the named streams
        order = sorted(self.spec.rngs, key=lambda name: name == "default")
        root = Rngs(
            "rngs",
            {
                name: Stream(f"rngs.{name}", name, self.engine.eval(src.expr), (f"key {src.text}",))
                for name, src in ((n, self.spec.rngs[n]) for n in order)
            },
        )
        model = self.build(self.spec.model, "", root)
        for event in self.spec.run:
            if isinstance(event, NnxStep):
                for _ in range(event.n):
                    self.step += 1
                    if event.stale:
                        # a pure jax.jit step (split/merge) whose returned state is dropped: every stream of
                        # the model is back at its count (and key) when the next step starts
                        saved = [(s, s.key, s.chain, s.count) for _, s in self.graph]
                        self.call(model)
                        for s, key, chain, count in saved:
                            s.key, s.chain, s.count = key, chain, count
                    else:
                        self.call(model)
            elif isinstance(event, NnxReseed):
                self.reseed(event)
        return self.keys

    def streams_in_graph_order(self) -> list[tuple[tuple[str, ...], Stream]]:
        """The model's RngStreams as nnx.graph.iter_graph visits them: depth first, attributes in sorted
        order, each object once (at its first path)."""
        seen: set[int] = set()
        out = []
        for path, s in sorted(self.graph, key=lambda ps: ps[0]):
            if id(s) not in seen:
                seen.add(id(s))
                out.append((path, s))
        return out

    def reseed(self, event: NnxReseed) -> None:
        # mirrors flax/nnx/rnglib.py reseed: a fresh Rngs(**stream_keys); every stream of the graph whose
        # tag is given takes that Rngs' next key, in graph order, and count 0
        fresh = {
            name: Stream(f"reseed {name}", name, self.engine.eval(src.expr), (f"key {src.text}",))
            for name, src in event.streams
        }
        for path, s in self.streams_in_graph_order():
            new = fresh.get(s.tag)
            if new is None:
                continue
            s.chain = new.chain + (f"fold_in {new.count} (nnx.reseed: {'.'.join(path)} in graph order)",)
            s.key = self.engine.fold_in(new.key, new.count)
            new.count += 1
            s.count = 0

    # ---------------------------------------------------------------- drawing
    def draw(self, s: Stream, site: str, kind: str, requested: str, loc: Location, label=None, draw=None) -> KeyData:
        # mirrors flax/nnx/rnglib.py RngStream.__call__: fold_in(key, count); count += 1
        if len(self.keys) >= MAX_NNX_DRAWS:
            from ..errors import SpecError

            raise SpecError(f"the model draws more than {MAX_NNX_DRAWS} keys; reduce `repeat` or `steps`", loc)
        key = self.engine.fold_in(s.key, s.count)
        self.keys.append(
            NnxKey(self.step, site, kind, requested, s.tag, s.path, s.count, s.chain, key, loc, label, draw)
        )
        s.count += 1
        return key

    def fork(self, s: Stream, site: str, requested: str, path: str, why: str, loc: Location) -> Stream:
        # mirrors RngStream.fork: one key from the stream becomes a new stream's key, count 0, same tag
        count = s.count
        key = self.draw(s, site, "fork", requested, loc)
        return Stream(path, s.tag, key, s.chain + (f"fold_in {count} ({why})",))

    # ---------------------------------------------------------------- construction
    def build(self, mod: NnxModule, path: str, rngs: Rngs) -> Instance:
        inst = Instance(mod, path, rngs if mod.keep_rngs else None)
        where = tuple(path.split(".")) if path else ()
        if mod.keep_rngs:
            self.graph.extend((where + ("rngs", name), s) for name, s in rngs.streams.items())
        for st in mod.init:
            if isinstance(st, NnxLayer):
                layer = inst.attrs[st.name] = self.layer(st, _join(path, st.name), rngs)
                if layer.own is not None:
                    self.graph.append((where + (st.name, "rngs"), layer.own))
            elif isinstance(st, NnxChild):
                child_path = _join(path, st.name)
                child_rngs = rngs
                if st.rngs == "fork":
                    # mirrors Rngs.fork: every stream, in order
                    child_rngs = Rngs(
                        f"{child_path}.rngs" if st.module.keep_rngs else f"rngs.fork() for {child_path}",
                        {
                            name: self.fork(
                                s,
                                child_path,
                                name,
                                f"{child_path}.rngs.{name}",
                                f"rngs.fork() for {child_path}",
                                st.loc,
                            )
                            for name, s in rngs.streams.items()
                        },
                    )
                inst.attrs[st.name] = self.build(st.module, child_path, child_rngs)
            elif isinstance(st, NnxDraw):
                for _ in range(st.repeat):
                    s = rngs.get(st.stream, "AttributeError", st.loc)
                    self.draw(s, path or "(root)", "draw", st.stream, st.loc, st.label, st.draw)
        return inst

    def layer(self, st: NnxLayer, path: str, rngs: Rngs) -> Layer:
        kind = st.kind
        params = []
        if kind in ("Linear", "LinearGeneral", "Conv", "ConvTranspose"):
            params = ["kernel"] + (["bias"] if st.opt("use_bias") else [])
        elif kind == "Embed":
            params = ["embedding"]
        elif kind in ("LayerNorm", "BatchNorm", "GroupNorm", "InstanceNorm"):
            params = (["scale"] if st.opt("use_scale") else []) + (["bias"] if st.opt("use_bias") else [])
        elif kind == "RMSNorm":
            params = ["scale"] if st.opt("use_scale") else []
        elif kind == "MultiHeadAttention":
            lin = ["kernel", "bias"] if st.opt("use_bias") else ["kernel"]
            params = [f"{p}.{q}" for p in ("query", "key", "value") for q in lin]
            if st.opt("normalize_qk"):
                params += ["query_ln.scale", "key_ln.scale"]
            params += [f"out.{q}" for q in lin]
        for p in params:
            s = rngs.get("params", "AttributeError", st.loc)
            self.draw(s, f"{path}.{p}", "param", "params", st.loc)
        own: Stream | None = None
        if kind == "Dropout":
            # mirrors nnx.Dropout.__init__: rngs[rng_collection].fork(), whatever the rate
            col = str(st.opt("rng_collection"))
            s = rngs.get(col, "KeyError", st.loc)
            own = self.fork(s, path, col, f"{path}.rngs", f"Dropout fork at {path}", st.loc)
        elif kind == "MultiHeadAttention" and st.opt("dropout_rate") > 0 and st.opt("keep_rngs"):
            s = rngs.get("dropout", "AttributeError", st.loc)
            own = self.fork(s, path, "dropout", f"{path}.rngs", f"attention fork at {path}", st.loc)
        return Layer(st, path, own)

    # ---------------------------------------------------------------- calls
    def call(self, inst: Instance) -> None:
        for st in inst.mod.call:
            if isinstance(st, NnxCall):
                target = inst.attrs[st.name]
                for _ in range(st.repeat):
                    if isinstance(target, Layer):
                        self.call_layer(target, st.loc)
                    else:
                        self.call(target)
            elif isinstance(st, NnxDraw):
                assert inst.rngs is not None  # the parser asks for keep_rngs
                for _ in range(st.repeat):
                    s = inst.rngs.get(st.stream, "AttributeError", st.loc)
                    self.draw(s, inst.path or "(root)", "draw", st.stream, st.loc, st.label, st.draw)

    def call_layer(self, layer: Layer, loc: Location) -> None:
        st = layer.st
        if st.kind == "Dropout":
            rate = st.opt("rate")
            # mirrors nnx.Dropout.__call__: rate 0 or deterministic, and rate 1, draw nothing
            if rate == 0.0 or st.opt("deterministic") or rate == 1.0:
                return
            assert layer.own is not None
            self.draw(layer.own, layer.path, "dropout", str(st.opt("rng_collection")), loc)
        elif st.kind == "MultiHeadAttention":
            if not st.opt("dropout_rate") > 0 or st.opt("deterministic"):
                return
            if layer.own is None:
                raise FlaxError(
                    "ValueError",
                    "'rngs' must be provided to __call__ method if MultiHeadAttention instance is defined "
                    "with keep_rngs=False. (set keep_rngs: true, or deterministic: true)",
                    loc,
                )
            self.draw(layer.own, layer.path, "attention_dropout", "dropout", loc)


@dataclass
class Layer:
    st: NnxLayer
    path: str
    own: Stream | None  # the stream it forked (Dropout, attention)


class Instance:
    """A built user module: its attributes (layers and submodules) and the Rngs it keeps, if any."""

    def __init__(self, mod: NnxModule, path: str, rngs: Rngs | None):
        self.mod = mod
        self.path = path
        self.rngs = rngs
        self.attrs: dict[str, Layer | Instance] = {}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def replay_nnx(spec: NnxSpec, engine: KeyEngine) -> list[NnxKey]:
    """Every key the NNX model hands out, construction first, then each step's calls."""
    return NnxReplayer(spec, engine).run()


# ---------------------------------------------------------------- the derive stage for NNX
@dataclass(frozen=True)
class NnxKeyedCall:
    """A key an NNX stream handed out and, when asked, the values drawn from it."""

    derivation: NnxKey
    key: KeyData
    draw: Draw | None
    values: np.ndarray | None
    index: int  # its number among all the model's keys (before filters)


@dataclass(frozen=True)
class NnxDeriveReport:
    spec: NnxSpec
    roots: dict[str, KeyData]
    calls: list[NnxKeyedCall]
    total: int | None = None  # keys before --stream/--path/--limit; None: no filter
    rules: str = RULES

    @property
    def fallbacks(self) -> int:
        """Keys served by the `default` stream for another stream's name (the findings of --strict)."""
        return sum(1 for c in self.calls if c.derivation.fallback)

    @property
    def discarded(self) -> int:
        return 0


def derive_nnx(
    spec: NnxSpec,
    values: bool = True,
    default_draw: Draw | None = None,
    streams: tuple[str, ...] = (),
    paths: tuple[str, ...] = (),
    limit: int | None = None,
) -> NnxDeriveReport:
    """Replay the NNX spec, with every key (and the requested draws). `streams` (requested or serving),
    `paths` (globs over the site) and `limit` select keys before any value is drawn."""
    from fnmatch import fnmatchcase

    from ..errors import SpecError
    from .draws import draw_values

    engine = KeyEngine(spec.prng_impl, spec.threefry_partitionable)
    keys = replay_nnx(spec, engine)
    chosen = list(enumerate(keys))
    if streams:
        chosen = [(i, k) for i, k in chosen if k.requested in streams or k.tag in streams]
    if paths:
        chosen = [(i, k) for i, k in chosen if any(fnmatchcase(k.site, g) for g in paths)]
    if limit is not None:
        chosen = chosen[:limit]
    calls = []
    for i, k in chosen:
        draw = k.draw or (default_draw if k.kind != "fork" else None)
        vals = None
        if values and draw is not None:
            try:
                vals = draw_values(spec, k.key, draw)
            except (ValueError, TypeError, ArithmeticError, IndexError) as e:
                raise SpecError(f"cannot draw {draw.describe()}: {e}", draw.loc) from None
        calls.append(NnxKeyedCall(k, k.key, draw, vals, i))
    filtered = bool(streams or paths or limit is not None)
    roots = {name: engine.eval(src.expr) for name, src in spec.rngs.items()}
    return NnxDeriveReport(spec, roots, calls, len(keys) if filtered else None)
