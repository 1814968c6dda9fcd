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
- `rngs.fork()` draws one key from every stream, in the Rngs' order, into a new Rngs of count-0 streams.
- `nnx.split_rngs(splits=N)` draws one key from every matching stream it finds (graph order: sorted
  attributes), sets the stream's key to split(key, N) and its counts to zeros(N), and on exit puts back the key
  and the count it had after that draw. Under `nnx.vmap` lane i of a split stream folds its counts into
  split(key, N)[i]; a stream the vmap broadcasts gives every lane fold_in(key, count) and advances as one lane
  does. A stacked module (split_rngs around vmap at construction) holds per-member streams; nnx.scan or
  nnx.vmap over its axis gives member i its own. nnx.scan carries counts through the steps; a stream it
  broadcasts draws the same keys every step and its count update is dropped."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

from ..errors import FlaxError, Location, SpecError
from ..spec.nnx import (
    CALL_RNGS,
    CELL_PARAMS,
    CELLS,
    NnxBidirectional,
    NnxBridge,
    NnxCall,
    NnxChild,
    NnxCond,
    NnxDraw,
    NnxLayer,
    NnxLoop,
    NnxMode,
    NnxModule,
    NnxReseed,
    NnxRnn,
    NnxRunDraw,
    NnxSpec,
    NnxStep,
    NnxStreamFork,
    NnxTransform,
)
from ..spec.tree import Draw
from .draws import UNSAFE_RBG_LANES
from .keys import KeyData, KeyEngine
from .records import LazyRows

if TYPE_CHECKING:
    import numpy as np

RULES = "flax>=0.11 (NNX: Dropout and attention fork their stream at construction)"
RULES_SHARED = (
    "flax<0.11 (NNX: Dropout and attention draw from the caller's Rngs at each call; nnx.reseed sets a stream "
    "to the key it is given)"
)


def rules_of(spec: NnxSpec) -> str:
    return RULES_SHARED if spec.shared_dropout else RULES


RNN_OWN_KEY = "key 0 (nnx.RNN's own RngStream)"  # the chain of nnx.RNN(cell)'s stream: RngStream(0, tag='carry')
MAX_NNX_DRAWS = 50_000_000
MAX_NNX_CALLS = 10_000_000  # module calls (and members built) the replay makes, draws or not


_STREAM_UIDS = itertools.count()


@dataclass
class Stream:
    """An RngStream: where it lives, its tag, its key (value and how it was made) and its count."""

    path: str  # e.g. rngs.params, block.drop.rngs
    tag: str
    key: KeyData
    chain: tuple[str, ...]  # how the key was made: key(1), fold_in 0 (Dropout fork at drop), ...
    count: int = 0
    key_ix: int = -1  # the key's number among the replay's stream keys (set when the key is)
    lanes: int = 0  # a stacked module's stream: its key is lane `lane` of a (lanes,) key array
    lane: int = -1
    # which stream it is, for the sets of streams a transform broadcasts (an id() can be a freed stream's)
    uid: int = field(default_factory=lambda: next(_STREAM_UIDS))


@dataclass(frozen=True)
class NnxKey:
    """A key an RngStream handed out (or, in the replay, a block of `n` in a row)."""

    step: int  # 0: construction (__init__), n: the n-th call of the model
    site: str  # module path and what drew: linear.kernel, drop (call), block (rngs.fork)
    kind: str  # param, fork, dropout, attention_dropout, draw
    requested: str  # the stream asked for (before the `default` fallback)
    tag: str  # the stream that served it
    stream: str  # that stream's path
    count: int
    chain: tuple[str, ...]  # the stream key's chain; the key is fold_in(stream key, count)
    key_ix: int  # which stream key (NnxReplayer.stream_keys) it folds into
    loc: Location
    label: str | None = None
    draw: Draw | None = None
    n: int = 1  # a block of n calls in a row: counts count .. count + n - 1 (a row of the report has n = 1)
    stale: bool = False  # drawn in a jitted step whose returned state is dropped
    lane: int = -1  # the vmap lane or stacked member it was drawn in (-1: none)
    iteration: int = -1  # the nnx.scan step it was drawn in (-1: none)
    broadcast: str = ""  # the transforms that broadcast its stream: vmap (every lane the same key), scan
    # (every step the same key, update dropped), vmap+scan, or ""
    scan: int = -1  # which nnx.scan call of the replay it was drawn in (-1: none)
    linen: str = ""  # a key of a bridge.ToNNX module's Linen init/apply: where Linen hashed it (the key is not
    # fold_in(stream key, count) but Linen's path and count hashed into the key the call drew)
    linen_lane: tuple[int, ...] = ()  # its Linen vmap lane / scan step / while iteration indices, outermost first
    linen_input: bytes = b""  # what Linen hashed for it (path and count)
    given: str = ""  # a key given to a Dropout's call (as written in the spec): used as it is, no stream drew it
    batched: bool = False  # drawn in an nnx.vmap lane from a per-lane key: inside jax.vmap one traced key array
    unused: bool = False  # handed out and not used: an nnx.RNN cell's initialize_carry with zeros (the default)

    @property
    def fallback(self) -> bool:
        return self.requested != self.tag and self.tag == "default"


def run_draw_steps(run) -> dict[int, int]:
    """The step of each `draw` event of `run:` (by its index): the next call's (bridge.lazy_init's is not a step),
    or, with no call after it, the last call's (0: none)."""
    out: dict[int, int] = {}
    step, pending = 0, []
    for at, e in enumerate(run):
        if isinstance(e, NnxRunDraw):
            pending.append(at)
        elif isinstance(e, NnxStep) and not e.lazy_init:
            out.update(dict.fromkeys(pending, step + 1))
            pending = []
            step += e.n
    out.update(dict.fromkeys(pending, step))
    return out


class Rngs:
    """An nnx.Rngs: its streams in order (vars(self) order)."""

    def __init__(self, name: str, streams: dict[str, Stream], old: bool = False):
        self.name = name
        self.streams = streams
        self.old = old  # flax < 0.11 (its error text)

    def get(self, stream: str, error: str, loc: Location) -> Stream:
        # mirrors flax/nnx/rnglib.py Rngs._get_stream
        s = self.streams.get(stream)
        if s is None:
            s = self.streams.get("default")
        if s is None:
            have = ", ".join(self.streams) or "none"
            said = (
                f"No RNG named '{stream}' or 'default' found in Rngs."
                if self.old
                else f"No RngStream named '{stream}' found in Rngs."
            )
            top = self.name if self.name == CALL_RNGS else "rngs"
            raise FlaxError(
                error,
                f"{said} ({self.name} has {have}: add `{stream}:` (or `default:`) to {top}, or give the module an "
                "Rngs that has it)",
                loc,
            )
        return s


def _graph_sort_key(parts: tuple[str, ...]) -> tuple[tuple[int, int, str], ...]:
    """Where nnx.graph's walk puts a path (its parts, `blocks.10` as `blocks`, `10`) among its siblings: attributes
    by name, and the items of an nnx.List (held as attribute "10") by their index, so `blocks.2` before `blocks.10`
    (mirrors graphlib._type_aware_sort over the int keys of a Pytree with _pytree__has_int_keys)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


class NnxReplayer:
    """Runs an NNX spec's model: construction, then `steps` calls, recording every key handed out."""

    def __init__(self, spec: NnxSpec, engine: KeyEngine):
        self.spec = spec
        self.engine = engine
        self.old = spec.shared_dropout
        self.keys: list[NnxKey] = []
        self.stream_keys: list[KeyData] = []  # every key a stream has had, numbered
        self.total = 0  # keys drawn so far
        self.stale = False  # in a step whose returned state is dropped
        self.step = 0
        self.lane = -1  # the vmap lane or stacked member being run
        self.iteration = -1  # the nnx.scan step being run
        self.scan = -1  # the nnx.scan call being run (numbered)
        self.scans = 0
        self.calls = 0  # module calls made (see MAX_NNX_CALLS)
        self.frozen: set[int] = set()  # streams an nnx.scan broadcasts (uids)
        self.broadcast: set[int] = set()  # streams an nnx.vmap broadcasts (uids)
        # every RngStream the model's graph holds, at each attribute path that reaches it
        self.graph: list[tuple[tuple[str, ...], Stream]] = []
        self.fixed: dict[int, KeyData] = {}  # block -> its key, where it is not fold_in(stream key, count)
        self.stacking = 0  # the size of the stack whose members are being built (0: none)
        self.vmapping = False  # the lanes being run are nnx.vmap's (not nnx.scan's over a stack)
        self.initializing = False  # in a call under bridge.lazy_init
        self.control = 0  # inside nnx.cond / nnx.switch / a loop (how deep)
        self.call_rngs: Rngs | None = None  # `call_rngs:` (run builds it)
        self.model_rngs: Rngs | None = None  # the Rngs the model is built from
        self.mode: bool | None = None  # model.eval() (True) / model.train() (False): every layer's `deterministic`
        self.given_mode: bool | None = None  # the `deterministic=` the layer being called is given at its call

    def rngs(self, name: str, sources: dict) -> Rngs:
        """`nnx.Rngs(**sources)`: the `default` seed (Rngs(0, ...)) is added after the named streams, as
        nnx.Rngs.__init__ adds it."""
        order = sorted(sources, key=lambda stream: stream == "default")
        return Rngs(
            name,
            {
                s: self.stream(f"{name}.{s}", s, self.engine.eval(sources[s].expr), (f"key {sources[s].text}",))
                for s in order
            },
            self.old,
        )

    def run(self) -> list[NnxKey]:
        root = self.model_rngs = self.rngs("rngs", self.spec.rngs)
        model = self.build(self.spec.model, "", root)
        # `call_rngs:` the nnx.Rngs given to every call (model(x, rngs=rngs)): outside the model's graph (reseed
        # and fork_rngs do not reach it), its counts carry on from call to call
        self.call_rngs = self.rngs(CALL_RNGS, self.spec.call_rngs) if self.spec.call_rngs else None
        labels = run_draw_steps(self.spec.run)
        for at, event in enumerate(self.spec.run):
            if isinstance(event, NnxRunDraw):
                # model.rngs.<stream>() outside the model's call (a training step, a loss method): its rows are the
                # next call's step
                site, s = model.kept_stream(event.keeper, event.stream, event.loc)
                now, self.step = self.step, labels[at]
                self.draw(s, site, "draw", event.stream, event.loc, n=event.repeat)
                self.step = now
            elif isinstance(event, NnxStep):
                for _ in range(event.n):
                    self.step += 0 if event.lazy_init else 1  # (bridge.lazy_init's keys belong to init)
                    if event.fork is not None:
                        # `with nnx.fork_rngs(model, split=...): model(x)` (under its transform, if any)
                        forked = self.fork_rngs(model, event.fork, event.loc)
                        if event.transform is not None:
                            self.transformed(model, event.transform, event.loc)
                        else:
                            self.call(model)
                        self.restore(forked)
                    elif event.stale:
                        # a pure jax.jit step (split/merge) whose returned state is dropped: every stream of
                        # the model is back at its count (and key) when the next step starts
                        saved = self.snapshot()
                        self.stale = True
                        self.call(model)
                        self.stale = False
                        self.restore(saved)
                    elif event.transform is not None:
                        self.transformed(model, event.transform, event.loc)
                    elif event.lazy_init:
                        self.initializing = True
                        self.call(model)
                        self.initializing = False
                    else:
                        if self.spec.call_rngs_steps is not None:
                            # an Rngs made for this step and given to its call: counts from 0, its own keys
                            given = self.spec.call_rngs_steps[self.step - 1]
                            self.call_rngs = None if given is None else self.rngs(CALL_RNGS, given)
                        self.call(model)
            elif isinstance(event, NnxReseed):
                self.reseed(event)
            elif isinstance(event, NnxMode):
                # mirrors nnx.Module.eval/train: set_attributes(deterministic=...) on every module that has it
                # (Dropout and attention: the layers whose calls draw), construction's setting overridden
                self.mode = event.deterministic
        return self.keys

    def deterministic(self, st: NnxLayer) -> bool:
        """A Dropout's or attention layer's `deterministic`: as its call gives it (mirrors first_from(deterministic,
        self.deterministic) in their __call__), else as built, or as model.eval()/train() last set it."""
        if self.given_mode is not None:
            return self.given_mode
        return bool(st.opt("deterministic")) if self.mode is None else self.mode

    def streams_in_graph_order(self, under: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Stream]]:
        """The model's RngStreams (those at paths under `under`) as nnx.graph.iter_graph visits them: depth
        first, attributes in sorted order, each object once (at its first path); a stacked stream's lanes
        together."""
        seen: set[int] = set()
        out = []
        # (a layer or fork named `blocks.0`, an item of a list, is under `blocks` and `blocks.0` as a module is)
        flat = [(tuple(p for part in path for p in part.split(".")), path, s) for path, s in self.graph]
        for parts, path, s in sorted(flat, key=lambda e: _graph_sort_key(e[0])):
            if parts[: len(under)] == under and id(s) not in seen:
                seen.add(id(s))
                out.append((path, s))
        return out

    def reseed(self, event: NnxReseed) -> None:
        """nnx.reseed(model, **streams) (of the submodule `event.module`, if given): every stream of its graph
        whose tag is given, in graph order, takes a new key and count 0. The key: flax 0.11 and later, the next key
        of a fresh Rngs(**streams) (mirrors flax/nnx/rnglib.py reseed), split into a stacked stream's lanes under
        policy='match_shape' (_match_shape: one key for all of them); before, the given key itself."""
        given = dict(event.streams)
        fresh = (
            {}
            if self.old
            else {
                name: self.stream(f"reseed {name}", name, self.engine.eval(src.expr), (f"key {src.text}",))
                for name, src in event.streams
            }
        )
        under = tuple(event.module.split(".")) if event.module else ()
        split: tuple | None = None  # the stacked stream being reseeded lane by lane: (path, lane keys, chain)
        for path, s in self.streams_in_graph_order(under):
            src = given.get(s.tag)
            if src is None:
                continue
            if s.lanes and event.policy != "match_shape":
                said = (
                    f"Cannot reseed stream {s.tag!r} with a non-scalar key"
                    if self.old
                    else f"Cannot reseed stream at path {path[len(under) :]!r} becuase it has a non-scalar key"
                )
                raise FlaxError(
                    "ValueError",
                    f"{said}, found key with shape ({s.lanes},) (a stacked module's stream at {'.'.join(path)}"
                    + ("" if self.old else ": pass policy='match_shape' to nnx.reseed")
                    + ")",
                    event.loc,
                )
            if self.old:
                s.chain = (f"key {src.text} (nnx.reseed)",)
                self.set_key(s, self.engine.eval(src.expr))
            elif s.lanes:
                if split is None or split[0] != path:
                    # (the lanes of one stacked stream come together, lane 0 first)
                    new = fresh[s.tag]
                    keys = self.engine.split_all(self.engine.fold_in(new.key, new.count), s.lanes)
                    chain = new.chain + (f"fold_in {new.count} (nnx.reseed: {'.'.join(path)} in graph order)",)
                    split = (path, keys, chain)
                    new.count += 1
                s.chain = split[2] + (f"split {s.lanes} [lane {s.lane}] (policy='match_shape')",)
                self.set_key(s, tuple(int(w) for w in split[1][s.lane]))
            else:
                new = fresh[s.tag]
                s.chain = new.chain + (f"fold_in {new.count} (nnx.reseed: {'.'.join(path)} in graph order)",)
                self.set_key(s, self.engine.fold_in(new.key, new.count))
                new.count += 1
            s.count = 0

    # ---------------------------------------------------------------- drawing
    def stream(self, path: str, tag: str, key: KeyData, chain: tuple[str, ...]) -> Stream:
        s = Stream(path, tag, key, chain)
        self.set_key(s, key)
        return s

    def set_key(self, s: Stream, key: KeyData) -> None:
        s.key = key
        s.key_ix = len(self.stream_keys)
        self.stream_keys.append(key)

    def draw(
        self,
        s: Stream,
        site: str,
        kind: str,
        requested: str,
        loc: Location,
        label=None,
        draw=None,
        n: int = 1,
        unused: bool = False,
    ) -> None:
        # mirrors flax/nnx/rnglib.py RngStream.__call__: fold_in(key, count); count += 1. `n` calls in a row
        # are one block of consecutive counts; the keys are computed with every other one, vectorised, when
        # the replay ends
        self.total += n
        if self.total > MAX_NNX_DRAWS:
            raise SpecError(f"the model draws more than {MAX_NNX_DRAWS} keys; reduce `repeat` or `steps`", loc)
        if s.lanes and self.lane < 0:
            # a stacked module's stream outside nnx.vmap/nnx.scan over its axis: a (lanes,) key array
            raise FlaxError(
                "ValueError",
                f"fold_in accepts a single key, but was given a key array of shape ({s.lanes},) != (). Use "
                f"jax.vmap for batching. ({s.path} belongs to a stacked module: call it under `scan: true` or "
                "`vmap: true`)",
                loc,
            )
        broadcast = "+".join(t for t, uids in (("vmap", self.broadcast), ("scan", self.frozen)) if s.uid in uids)
        # (a stacked module is built under nnx.vmap; a stack called under nnx.scan runs member by member)
        batched = self.lane >= 0 and (self.vmapping or self.stacking > 0) and "vmap" not in broadcast
        if batched and self.spec.prng_impl == "unsafe_rbg":
            # (nnx.split_rngs maps the count too: fold_in's rng_bit_generator is seeded from lane 0's count)
            raise SpecError(UNSAFE_RBG_LANES.format(what="drawn", whose="count", op="fold_in"), loc)
        self.keys.append(
            NnxKey(
                self.step,
                site,
                kind,
                requested,
                s.tag,
                s.path,
                s.count,
                s.chain,
                s.key_ix,
                loc,
                label,
                draw,
                n,
                self.stale,
                self.lane,
                self.iteration,
                broadcast,
                self.scan,
                batched=batched,
                unused=unused,
            )
        )
        s.count += n

    def fork(self, s: Stream, site: str, requested: str, path: str, why: str, loc: Location) -> Stream:
        # mirrors RngStream.fork: one key from the stream becomes a new stream's key, count 0, same tag (a
        # stacked stream forks lane by lane)
        count = s.count
        self.draw(s, site, "fork", requested, loc)
        new = self.stream(
            path + (f"[{s.lane}]" if s.lanes else ""),
            s.tag,
            self.engine.fold_in(s.key, count),
            s.chain + (f"fold_in {count} ({why})",),
        )
        new.lanes, new.lane = s.lanes, s.lane
        if self.stacking and not new.lanes:
            # forked in a stacked member from a stream every member shares: one key for every lane while the
            # members are built (what it draws then, every lane draws alike), stacked by nnx.vmap's out_axes
            new.lanes, new.lane = self.stacking, self.lane
            new.path = f"{path}[{self.lane}]"
            if s.uid in self.broadcast:
                self.broadcast = self.broadcast | {new.uid}
        return new

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
                if layer.shared is not None:
                    # (flax < 0.11: the layer keeps the caller's Rngs as `self.rngs`)
                    self.graph.extend((where + (st.name, "rngs", name), s) for name, s in layer.shared.streams.items())
            elif isinstance(st, NnxChild) and st.stack:
                inst.attrs[st.name] = self.stacked(st, _join(path, st.name), rngs)
            elif isinstance(st, NnxChild):
                inst.attrs[st.name] = self.child(st, _join(path, st.name), rngs)
            elif isinstance(st, NnxRnn):
                inst.attrs[st.name] = self.rnn(st, _join(path, st.name), rngs)
            elif isinstance(st, NnxBidirectional):
                inst.attrs[st.name] = self.bidirectional(st, _join(path, st.name), rngs)
            elif isinstance(st, NnxBridge):
                inst.attrs[st.name] = self.bridge(st, _join(path, st.name), where + (st.name,), rngs)
            elif isinstance(st, NnxDraw):
                s = rngs.get(st.stream, "AttributeError", st.loc)
                self.draw(s, path or "(root)", "draw", st.stream, st.loc, st.label, st.draw, st.repeat)
            elif isinstance(st, NnxStreamFork):
                # self.<name> = rngs.<stream>.fork(): kept at that attribute, in the model's graph
                s = rngs.get(st.stream, "AttributeError", st.loc)
                where_ = _join(path, st.name)
                own = self.fork(s, where_, st.stream, where_, f"rngs.{st.stream}.fork() at {where_}", st.loc)
                inst.forks[st.name] = own
                self.graph.append((where + (st.name,), own))
        return inst

    def child(self, st: NnxChild, child_path: str, rngs: Rngs) -> Instance:
        """A submodule built from the caller's Rngs, from rngs.fork() (`rngs: fork`) or without one (`rngs: none`:
        the parser lets it build only what takes none)."""
        child_rngs = rngs
        if st.rngs == "none":
            child_rngs = Rngs(f"{child_path} (built without an Rngs)", {}, self.old)
        elif st.rngs == "fork":
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
        return self.build(st.module, child_path, child_rngs)

    def own_stream(self, mode: str, path: str, rngs: Rngs, what: str, loc: Location) -> Stream | None:
        """What nnx.RNN / nnx.Bidirectional keeps for the carry: RngStream(0, tag='carry') (`own`), rngs.carry.fork()
        (`fork`) or nothing (`none`), at `path`.rngs in the model's graph."""
        own: Stream | None = None
        if mode == "own":
            own = self.stream(f"{path}.rngs", "carry", self.engine.seed(0), (RNN_OWN_KEY,))
        elif mode == "fork":
            s = rngs.get("carry", "AttributeError", loc)
            own = self.fork(s, path, "carry", f"{path}.rngs", f"{what} fork at {path}", loc)
        if own is not None:
            self.graph.append((tuple(path.split(".")) + ("rngs",), own))
        return own

    def bidirectional(self, st: NnxBidirectional, path: str, rngs: Rngs) -> Bidi:
        """nnx.Bidirectional(forward_rnn, backward_rnn, rngs=...): the RNNs (its arguments) first, then its stream."""
        fwd = self.rnn(st.forward, f"{path}.forward_rnn", rngs)
        bwd = self.rnn(st.backward, f"{path}.backward_rnn", rngs)
        return Bidi(st, path, fwd, bwd, self.own_stream(st.rngs, path, rngs, "nnx.Bidirectional", st.loc))

    def bidi_call(self, b: Bidi, st: NnxCall) -> None:
        """One call of an nnx.Bidirectional (mirrors Bidirectional.__call__): its stream, or the call's rngs.carry
        (not forked), given to the forward RNN's call and then the backward one's (each, given None, its own)."""
        stream = b.own
        given = self.rngs_given(st) if st.given_rngs else None  # (None: a step given no Rngs, its own)
        if given is not None:
            stream = given.get("carry", "AttributeError", st.loc)
        for r in (b.fwd, b.bwd):
            self.rnn_call(r, st, stream, bidi=True)

    def rnn(self, st: NnxRnn, path: str, rngs: Rngs) -> Rnn:
        """`nnx.RNN(cell, rngs=...)` (mirrors flax/nnx/nn/recurrent.py RNN.__init__): the cell is built first (an
        argument), then the RNN keeps its own RngStream(0, tag='carry') (`own`), rngs.carry.fork() (`fork`), or
        nothing (`none`)."""
        where = tuple(path.split("."))
        cell_path = f"{path}.cell"
        cell: Layer | Instance
        if isinstance(st.cell, NnxLayer):
            cell = self.layer(st.cell, cell_path, rngs)
            if cell.own is not None:
                self.graph.append((where + ("cell", "rngs"), cell.own))
        else:
            cell = self.child(st.cell, cell_path, rngs)
        return Rnn(st, path, cell, self.own_stream(st.rngs, path, rngs, "nnx.RNN", st.loc))

    def rnn_call(self, r: Rnn, st: NnxCall, given: Stream | None = None, bidi: bool = False) -> None:
        """One call of an nnx.RNN (mirrors RNN.__call__): the cell's initialize_carry draws from the RNN's stream
        (or the call's rngs.carry.fork(), or the cell's own), then nnx.split_rngs(splits=1, only=broadcast,
        squeeze=True) gives each broadcast stream of the cell a fresh key (one draw, split 1, count 0) around
        nnx.scan over `length` steps that carries every other stream; on exit they get their key back."""
        self.tick(st.loc)
        if self.lane >= 0:
            raise SpecError(
                f"nnx.RNN {r.path} is called inside nnx.vmap lanes or a stacked member; rngaudit does not model that "
                "yet",
                st.loc,
            )
        stream = given if given is not None else r.own
        call_rngs = self.rngs_given(st) if st.given_rngs and not bidi else None  # (None: a step given none)
        if call_rngs is not None:
            g = call_rngs.get("carry", "AttributeError", st.loc)
            stream = self.fork(
                g,
                r.path,
                "carry",
                f"{r.path} (rngs.carry.fork() at the call)",
                f"rngs given to {r.path}'s call: rngs.carry.fork()",
                st.loc,
            )
        if stream is None and isinstance(r.cell, Layer):
            stream = r.cell.own  # the cell's initialize_carry falls back to the stream it keeps (keep_rngs)
        n = 0 if st.initial_carry else r.st.carry_draws
        if n:
            if stream is None:
                raise FlaxError(
                    "ValueError",
                    f"RNGs must be provided to initialize the cell carry. ({r.path} is built with rngs=False and its "
                    + (
                        "cell keeps no stream"
                        if isinstance(r.cell, Layer)
                        else "cell's initialize_carry is given none (a user cell is taken to raise then, as NNX's "
                        "cells do)"
                    )
                    + ": give the call rngs (`rngs: model`) or an initial carry (`initial_carry: true`))",
                    st.loc,
                )
            unused = r.st.carry_init == "zeros"
            self.draw(stream, f"{r.path}.cell.initialize_carry", "carry", "carry", st.loc, n=n, unused=unused)
        split = []
        if r.st.broadcast:
            under = tuple(r.cell.path.split("."))
            for at, s in self.streams_in_graph_order(under):
                if s.tag not in r.st.broadcast:
                    continue
                count = s.count
                self.draw(s, _owner(at), "split", s.tag, st.loc)
                split.append((s, s.key, s.key_ix, s.chain, s.count))
                key = self.engine.split_all(self.engine.fold_in(s.key, count), 1)[0]
                self.set_key(s, tuple(int(w) for w in key))
                s.chain = s.chain + (f"fold_in {count} (nnx.split_rngs for {r.path})", "split 1 [0] (squeezed)")
                s.count = 0
        self.transformed(r.cell, NnxTransform("scan", st.length, r.st.broadcast), st.loc)
        self.restore(split)

    def bridge(self, st: NnxBridge, path: str, where: tuple[str, ...], rngs: Rngs) -> Bridge:
        """`bridge.ToNNX(module, rngs=...)` (mirrors flax/nnx/bridge/wrappers.py ToNNX.__init__): rngs=rngs keeps
        rngs.fork() (one key from every stream, in order); rngs=rngs.params() keeps Rngs(params=that key)."""
        self.no_nesting(st.loc, f"bridge.ToNNX at {path}")
        if st.rngs == "fork":
            streams = {
                name: self.fork(s, path, name, f"{path}.to_nnx__rngs.{name}", f"ToNNX fork at {path}", st.loc)
                for name, s in rngs.streams.items()
            }
        else:
            s = rngs.get("params", "AttributeError", st.loc)
            count = s.count
            self.draw(s, path, "draw", "params", st.loc)
            streams = {
                "params": self.stream(
                    f"{path}.to_nnx__rngs.params",
                    "params",
                    self.engine.fold_in(s.key, count),
                    s.chain + (f"fold_in {count} (rngs.params() for ToNNX at {path})",),
                )
            }
        own = Rngs(f"{path}.to_nnx__rngs", streams, self.old)
        self.graph.extend((where + ("to_nnx__rngs", name), s) for name, s in streams.items())
        b = Bridge(st, path, own)
        if st.lazy_init:
            self.bridge_call(b, st.loc, init=True)
        return b

    def bridge_call(self, b: Bridge, loc: Location, init: bool) -> None:
        """One call of a ToNNX module: one key from every stream of its Rngs, then Linen init (under
        bridge.lazy_init) or apply with them (FLAX_NNX_RULES.md §13)."""
        from .nnx_bridge import linen_keys, linen_rngs

        self.tick(loc)
        if self.control:
            raise SpecError(
                f"bridge.ToNNX at {b.path} is called inside nnx.cond, nnx.switch or a loop; rngaudit does not model "
                "Linen inside NNX control flow yet",
                loc,
            )
        if self.lane >= 0 or self.iteration >= 0:
            raise SpecError(
                f"bridge.ToNNX at {b.path} is called inside nnx.vmap or nnx.scan; rngaudit does not model Linen "
                "inside NNX lanes or steps yet",
                loc,
            )
        if not init and not b.initialized and b.has_params is None:
            # apply on no variables works for a Linen module that makes none (nn.Dropout, make_rng only)
            probe = linen_keys(
                b.st.module,
                {"params": (0,) * self.engine.width},
                True,
                self.spec.prng_impl,
                self.spec.threefry_partitionable,
                self.spec.file,
                loc,
            )
            b.has_params = any(d.kind == "param" for d, _ in probe)
        if not init and not b.initialized and b.has_params:
            raise FlaxError(
                "ScopeCollectionNotFound",
                f"the Linen module of bridge.ToNNX at {b.path} has no variables: it is called before "
                "bridge.lazy_init (give the ToNNX `lazy_init: true`, or start `run:` with a `lazy_init` event)",
                loc,
            )
        drawn: dict[str, KeyData] = {}
        served: dict[str, tuple[Stream, tuple[str, ...]]] = {}
        for name, s in b.rngs.streams.items():
            count = s.count
            # (the site names the Rngs ToNNX keeps: its fork at construction drew at the ToNNX's own path)
            self.draw(s, f"{b.path}.to_nnx__rngs", "bridge", name, loc)
            drawn[name] = self.engine.fold_in(s.key, count)
            served[name] = (s, s.chain + (f"fold_in {count} (ToNNX {'init' if init else 'call'} at {b.path})",))
        served = linen_rngs(served)
        rows = linen_keys(
            b.st.module,
            linen_rngs(drawn),
            init,
            self.spec.prng_impl,
            self.spec.threefry_partitionable,
            self.spec.file,
            loc,
        )
        self.total += len(rows)
        if self.total > MAX_NNX_DRAWS:
            raise SpecError(f"the model draws more than {MAX_NNX_DRAWS} keys; reduce `repeat` or `steps`", loc)
        # (a second call in one step names its Linen sites `enc#2.Dense_0`: a site is one draw per step)
        nth = b.calls_in_step[self.step] = b.calls_in_step.get(self.step, 0) + 1
        at = b.path if nth == 1 else f"{b.path}#{nth}"
        for d, key in rows:
            s, chain = served[d.stream]
            site = ".".join((at,) + d.path + ((d.label,) if d.kind == "param" and d.label else ()))
            self.fixed[len(self.keys)] = key
            self.keys.append(
                NnxKey(
                    self.step,
                    site,
                    d.kind,
                    d.stream_requested,
                    d.stream,
                    s.path,
                    d.count,
                    chain,
                    s.key_ix,
                    d.location,
                    d.label,
                    d.draw,
                    1,
                    self.stale,
                    linen=f"Linen {d.kind} at /{'/'.join(d.path)} count {d.count}"
                    + (f" lane {list(d.lane)}" if d.lane else "")
                    + (f" (sha1 word {d.hash_word})" if d.base is not None else ""),
                    linen_lane=d.lane,
                    linen_input=d.hash_input,
                )
            )
        b.initialized = b.initialized or init

    def stacked(self, st: NnxChild, path: str, rngs: Rngs) -> Stacked:
        """`nnx.split_rngs(splits=N)` around `nnx.vmap(in_axes=0)` building st.module from `rngs`: one key
        from every stream of the Rngs (sorted, as iter_graph visits them), split N ways; member i is built from
        lane i of each (count 0). On exit split_rngs puts the keys back, with the counts after the split draw."""
        import numpy as np

        self.no_nesting(st.loc, f"the stacked module {path}")
        if not rngs.streams:
            raise FlaxError(
                "ValueError",
                "vmap wrapped function must be passed at least one argument containing an array or axis_size must "
                f"be specified (the Rngs that builds {path} has no streams to split)",
                st.loc,
            )
        n = st.stack
        lanes: dict[str, tuple[np.ndarray, tuple[str, ...]]] = {}
        copies: dict[str, Stream] = {}
        if st.rngs == "shared":
            for name in sorted(rngs.streams):
                s = rngs.streams[name]
                count = s.count
                self.draw(s, path, "split", name, st.loc)
                chain = s.chain + (f"fold_in {count} (nnx.split_rngs for {path})",)
                lanes[name] = (self.engine.split_all(self.engine.fold_in(s.key, count), n), chain)
        else:
            # mirrors Rngs.split / Rngs.broadcast: every stream, in the Rngs' order, draws one key, split N ways
            # (or N copies of it); a stream `only` leaves out is passed through: Rngs(**streams) copies its key
            # with count 0 (FLAX_NNX_RULES.md §7), and nnx.vmap's StateAxes give every member that one copy
            for name, s in rngs.streams.items():
                if st.only and s.tag not in st.only:
                    copies[name] = self.stream(
                        f"{path}.rngs.{name} (copy)",
                        s.tag,
                        s.key,
                        s.chain + (f"(copied by rngs.{st.rngs} for {path}: count reset to 0)",),
                    )
                    continue
                count = s.count
                self.draw(s, path, st.rngs, name, st.loc)
                chain = s.chain + (f"fold_in {count} (rngs.{st.rngs}({n}) for {path})",)
                base = self.engine.fold_in(s.key, count)
                if st.rngs == "split":
                    lanes[name] = (self.engine.split_all(base, n), chain)
                else:
                    lanes[name] = (np.asarray([base] * n, dtype=np.uint32), chain)
        if not lanes:
            # nnx.vmap(in_axes=(StateAxes({only: 0, ...: None}),)) with nothing that `only` names: nothing mapped
            raise FlaxError(
                "ValueError",
                "vmap must have at least one non-None value in in_axes or axis_size must be specified (no stream of "
                f"the Rngs that builds {path} has a tag `only` names: {', '.join(st.only)})",
                st.loc,
            )
        how = "split" if st.rngs != "broadcast" else "broadcast"
        members = []
        start = {name: c.count for name, c in copies.items()}
        outer_broadcast = self.broadcast
        self.broadcast = self.broadcast | {c.uid for c in copies.values()}
        self.stacking = n
        for i in range(n):
            self.tick(st.loc)
            self.lane = i
            member: dict[str, Stream] = {}
            for name, s in rngs.streams.items():
                if name in copies:
                    # (every member starts from the copy's count, and they advance as one, as nnx.vmap does)
                    copies[name].count = start[name]
                    member[name] = copies[name]
                    continue
                keys, chain = lanes[name]
                ms = self.stream(
                    f"{s.path}[{i}]", s.tag, tuple(int(w) for w in keys[i]), chain + (f"{how} {n} [lane {i}]",)
                )
                ms.lanes, ms.lane = n, i
                member[name] = ms
            members.append(
                self.build(st.module, path, Rngs(f"lane {i} of {rngs.name} ({how} for {path})", member, self.old))
            )
        self.lane = -1
        self.stacking = 0
        self.broadcast = outer_broadcast
        return Stacked(st, path, members)

    def no_nesting(self, loc: Location, what: str) -> None:
        if self.lane >= 0:
            raise SpecError(
                f"{what} runs inside another nnx.vmap lane or stacked member; rngaudit does not model nested "
                "lanes yet (flatten them into one stack, or file an issue with the model)",
                loc,
            )

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
        elif kind in CELLS:
            params = list(CELL_PARAMS[kind])
        elif kind == "LoRALinear":
            # mirrors LoRALinear.__init__: Linear's params, then its nnx.LoRA `lora` (lora_a, lora_b)
            params = ["kernel"] + (["bias"] if st.opt("use_bias") else []) + ["lora.lora_a", "lora.lora_b"]
        elif kind == "LoRA":
            # mirrors nnx.LoRA.__init__ (its base_module, an argument, is built first)
            if st.base is not None:
                self.layer(st.base, f"{path}.base_module", rngs)
            params = ["lora_a", "lora_b"]
        elif kind == "MultiHeadAttention":
            lin = ["kernel", "bias"] if st.opt("use_bias") else ["kernel"]
            params = [f"{p}.{q}" for p in ("query", "key", "value") for q in lin]
            if st.opt("normalize_qk"):
                params += ["query_ln.scale", "key_ln.scale"]
            params += [f"out.{q}" for q in lin]
        own: Stream | None = None
        if kind in CELLS and st.opt("keep_rngs"):
            # mirrors LSTMCell.__init__ (and the other cells'): keep_rngs stores rngs.carry.fork(), before the
            # Linear layers are built
            s = rngs.get("carry", "AttributeError", st.loc)
            own = self.fork(s, path, "carry", f"{path}.rngs", f"{kind} keep_rngs fork at {path}", st.loc)
        for p in params:
            s = rngs.get("params", "AttributeError", st.loc)
            self.draw(s, f"{path}.{p}", "param", "params", st.loc)
        if kind in CELLS:
            return Layer(st, path, own, len(params))
        if kind == "Dropout" and not st.opt("rngs"):
            return Layer(st, path, None, len(params))  # nnx.Dropout(rate): no Rngs, a key comes with each call
        if self.old:
            # flax < 0.11: Dropout keeps the Rngs it is given; attention keeps it when dropout_rate > 0
            keeps = kind == "Dropout" or (kind == "MultiHeadAttention" and st.opt("dropout_rate") > 0)
            return Layer(st, path, None, len(params), rngs if keeps else None)
        if kind == "Dropout":
            # mirrors nnx.Dropout.__init__: rngs[rng_collection].fork(), whatever the rate
            col = str(st.opt("rng_collection"))
            s = rngs.get(col, "KeyError", st.loc)
            own = self.fork(s, path, col, f"{path}.rngs", f"Dropout fork at {path}", st.loc)
        elif kind == "MultiHeadAttention" and st.opt("dropout_rate") > 0 and st.opt("keep_rngs"):
            s = rngs.get("dropout", "AttributeError", st.loc)
            own = self.fork(s, path, "dropout", f"{path}.rngs", f"attention fork at {path}", st.loc)
        return Layer(st, path, own, len(params))

    # ---------------------------------------------------------------- calls
    def tick(self, loc: Location) -> None:
        """Counts a module call (or a member built): a spec's repeats, steps and lanes multiply, drawing or not."""
        self.calls += 1
        if self.calls > MAX_NNX_CALLS:
            raise SpecError(
                f"the model makes more than {MAX_NNX_CALLS} module calls; reduce `repeat`, `steps`, `scan:`, "
                "`vmap:` or `stack:`",
                loc,
            )

    def call(self, inst: Instance) -> None:
        self.tick(inst.mod.loc)
        self.statements(inst, inst.mod.call)

    def statements(self, inst: Instance, statements: Sequence) -> None:
        """`inst`'s __call__ statements (or those of a branch or loop body), in order."""
        for st in statements:
            if (
                isinstance(st, (NnxDraw, NnxCall))
                and st.when is not None
                and (self.mode is True) != (st.when == "eval")
            ):
                # (run in the other mode only: mirrors `if not self.deterministic:` in a module whose
                # `deterministic` model.train()/eval() set, built False, or a `train` argument following the mode)
                continue
            if isinstance(st, NnxCond):
                self.branch(inst, st)
            elif isinstance(st, NnxLoop):
                self.loop(inst, st)
            elif isinstance(st, NnxCall) and st.fork is not None:
                # `with nnx.fork_rngs(self.<name>, split=...): self.<name>(x)`, each of the `repeat` calls
                one = replace(st, repeat=1, fork=None)
                for _ in range(st.repeat):
                    forked = self.fork_rngs(inst.attr(st.name), st.fork, st.loc)
                    self.statements(inst, (one,))
                    self.restore(forked)
            elif isinstance(st, NnxCall) and st.deterministic is not None:
                # drop(x, deterministic=...): a layer's call (the parser allows it on Dropout/attention only)
                self.given_mode = st.deterministic
                try:
                    self.statements(inst, (replace(st, deterministic=None),))
                finally:
                    self.given_mode = None
            elif isinstance(st, NnxCall):
                target = inst.attr(st.name)
                if isinstance(target, Rnn):
                    for _ in range(st.repeat):
                        self.rnn_call(target, st)
                elif isinstance(target, Bidi):
                    for _ in range(st.repeat):
                        self.tick(st.loc)
                        self.bidi_call(target, st)
                elif st.transform is not None:
                    for _ in range(st.repeat):
                        self.transformed(target, st.transform, st.loc)
                elif isinstance(target, Layer) and st.key is not None:
                    self.given_key(target, st, inst.path)
                elif isinstance(target, Layer) and st.given_rngs:
                    self.given_rngs(target, st)
                elif isinstance(target, Layer):
                    self.call_layer(target, st.loc, st.repeat)
                else:
                    for _ in range(st.repeat):
                        self.call_target(target, st.loc)
            elif isinstance(st, NnxDraw):
                site, s = inst.kept_stream(st.keeper, st.stream, st.loc)
                self.draw(s, site, "draw", st.stream, st.loc, st.label, st.draw, st.repeat)

    def fork_rngs(
        self, target: Layer | Instance | Stacked | Bridge | Rnn | Bidi, tags: tuple[str, ...], loc: Location
    ) -> list:
        """`nnx.fork_rngs(target, split={tags: None})` (graph mode; mirrors flax/nnx/rnglib.py fork_rngs): every
        stream in target's graph whose tag is in `tags` (every one for ()), in graph order, forks: it draws one
        key (count + 1) and takes that key, with count 0, until `restore` puts back its key and the count after
        the draw. Returns what restore puts back."""
        where = target.path or "the model"
        under = tuple(target.path.split(".")) if target.path else ()
        saved = []
        for at, s in self.streams_in_graph_order(under):
            if tags and s.tag not in tags:
                continue
            if s.lanes and self.lane >= 0 and s.lane != self.lane:
                continue  # (another member of a stack, run in its own lane)
            if s.lanes and self.lane < 0:
                raise FlaxError(
                    "ValueError",
                    f"fold_in accepts a single key, but was given a key array of shape ({s.lanes},) != (). Use "
                    f"jax.vmap for batching. (nnx.fork_rngs forks {s.path}, a stream of a stacked module, outside "
                    "its axis: fork it inside the nnx.scan or nnx.vmap over the stack, or use nnx.split_rngs)",
                    loc,
                )
            count = s.count
            self.draw(s, _owner(at), "fork", s.tag, loc)
            saved.append((s, s.key, s.key_ix, s.chain, s.count))
            s.chain = s.chain + (f"fold_in {count} (nnx.fork_rngs for {where})",)
            self.set_key(s, self.engine.fold_in(s.key, count))
            s.count = 0
        return saved

    def snapshot(self) -> list:
        """Every stream of the model's graph as it is now (what `restore` puts back)."""
        return [(s, s.key, s.key_ix, s.chain, s.count) for _, s in self.graph]

    def restore(self, saved: list) -> None:
        """Streams back as a snapshot (or nnx.fork_rngs: restore_rngs) found them: key and count."""
        for s, key, ix, chain, count in saved:
            s.key, s.key_ix, s.chain, s.count = key, ix, chain, count

    def branch(self, inst: Instance, st: NnxCond) -> None:
        """nnx.cond / nnx.switch: JAX traces every branch, in order, so one not taken raises its errors, and only
        the taken branch's draws and count updates come back (FLAX_NNX_RULES.md §12)."""
        self.control += 1
        for i, statements in enumerate(st.branches):
            if i == st.taken:
                self.statements(inst, statements)
            else:
                self.traced(inst, statements)
        self.control -= 1

    def loop(self, inst: Instance, st: NnxLoop) -> None:
        """nnx.fori_loop / nnx.while_loop: the RngState is carried, so the body runs `iterations` times in a row
        as it would unrolled (iteration i draws fold_in(key, c0 + i) from a stream it draws once). With no
        iteration JAX still traces the body: its errors, no draws."""
        self.control += 1
        if not st.iterations:
            self.traced(inst, st.body)
        for _ in range(st.iterations):
            self.tick(st.loc)
            self.statements(inst, st.body)
        self.control -= 1

    def traced(self, inst: Instance, statements: Sequence) -> None:
        """Statements JAX traces but does not run (a branch not taken, a loop body run no time): they raise what
        they would raise, and the state after is the state before (no draw, no count)."""
        saved = self.snapshot()
        keys, stream_keys = len(self.keys), len(self.stream_keys)
        total, calls, scans = self.total, self.calls, self.scans
        self.statements(inst, statements)
        self.restore(saved)
        del self.keys[keys:]
        del self.stream_keys[stream_keys:]
        for ix in [ix for ix in self.fixed if ix >= keys]:
            del self.fixed[ix]
        self.total, self.calls, self.scans = total, calls, scans

    def call_target(self, target: Layer | Instance | Stacked | Bridge, loc: Location) -> None:
        if isinstance(target, Bridge):
            self.bridge_call(target, loc, self.initializing)
        elif isinstance(target, Layer):
            self.tick(loc)
            self.call_layer(target, loc)
        elif isinstance(target, Instance):
            self.call(target)
        else:
            # a stacked module called as it is: its streams hold key arrays, so a draw fails (in draw())
            self.call(target.members[0])

    def transformed(self, target: Layer | Instance | Stacked | Bridge, t: NnxTransform, loc: Location) -> None:
        """One call of `target` under nnx.vmap or nnx.scan."""
        if isinstance(target, Stacked):
            # over the stacked axis: member i with its own streams (counts persist per member)
            self.no_nesting(loc, f"nnx.{t.kind} over {target.path}")
            if not target.members[0].stateful:
                # a stack of modules with no arrays gives the transform nothing to map over
                raise FlaxError(
                    "ValueError",
                    (
                        "scan got no values to scan over and `length` not provided."
                        if t.kind == "scan"
                        else "vmap must have at least one non-None value in in_axes or axis_size must be specified"
                    )
                    + f" ({target.path}'s members hold no parameters, statistics or RNG streams)",
                    loc,
                )
            outer_vmap = self.vmapping
            self.vmapping = t.kind == "vmap"
            for i, member in enumerate(target.members):
                self.lane = i
                self.call(member)
            self.lane = -1
            self.vmapping = outer_vmap
            return
        under = tuple(target.path.split(".")) if target.path else ()
        graph = self.streams_in_graph_order(under)
        streams = [s for _, s in graph]
        if t.kind == "scan":
            # mirrors nnx.scan with StateAxes({broadcast: None, ...: nnx.Carry}): carried counts thread through
            # the steps; a broadcast stream starts every step at its count and its update is dropped
            frozen = [s for s in streams if s.tag in t.streams]
            start = [s.count for s in frozen]
            outer = self.iteration, self.frozen, self.scan
            self.frozen = self.frozen | {s.uid for s in frozen}
            self.scan, self.scans = self.scans, self.scans + 1
            for it in range(t.lanes):
                self.iteration = it
                for s, c in zip(frozen, start):
                    s.count = c
                self.call_target(target, loc)
            for s, c in zip(frozen, start):
                s.count = c
            self.iteration, self.frozen, self.scan = outer
            return
        # mirrors nnx.split_rngs(splits=N, only=split) around nnx.vmap(in_axes=(StateAxes({split: 0, ...:
        # None}), ...)): the split streams draw one key each (graph order) and lane i folds into its split; the
        # others are broadcast: every lane starts at the same count, and they advance as one lane does
        self.no_nesting(loc, f"nnx.vmap over {target.path or 'the model'}")
        for s in streams:
            if s.lanes:
                raise SpecError(
                    f"nnx.vmap over {target.path or 'the model'} maps a stacked module's streams too; rngaudit "
                    "does not model nested lanes yet",
                    loc,
                )
        n = t.lanes
        where = target.path or "(root)"
        split = []
        for at, s in graph:
            if s.tag in t.streams:
                count = s.count
                self.draw(s, _owner(at), "split", s.tag, loc)
                chain = s.chain + (f"fold_in {count} (nnx.split_rngs for {where})",)
                keys = self.engine.split_all(self.engine.fold_in(s.key, count), n)
                split.append((s, s.key, s.key_ix, s.chain, s.count, keys, chain))
        shared = [s for s in streams if s.tag not in t.streams]
        start = [s.count for s in shared]
        outer_broadcast, outer_vmap = self.broadcast, self.vmapping
        self.broadcast = self.broadcast | {s.uid for s in shared}
        self.vmapping = True
        for i in range(n):
            self.lane = i
            for s, _, _, _, _, keys, chain in split:
                self.set_key(s, tuple(int(w) for w in keys[i]))
                s.chain = chain + (f"split {n} [lane {i}]",)
                s.count = 0
            for s, c in zip(shared, start):
                s.count = c
            self.call_target(target, loc)
        self.lane = -1
        self.broadcast, self.vmapping = outer_broadcast, outer_vmap
        for s, key, ix, chain, count, _, _ in split:
            s.key, s.key_ix, s.chain, s.count = key, ix, chain, count

    def given_key(self, layer: Layer, st: NnxCall, where: str) -> None:
        """`self.drop(x, rngs=key)`, `st.repeat` times: the Dropout uses the key as it is (mirrors
        nnx.Dropout.__call__: a call-time key wins over its own stream, which draws nothing)."""
        assert st.key is not None
        rate = layer.st.opt("rate")
        if rate == 0.0 or self.deterministic(layer.st) or rate == 1.0:
            return
        key = self.engine.eval(st.key.expr)
        self.total += st.repeat
        for _ in range(st.repeat):
            self.tick(st.loc)
            self.fixed[len(self.keys)] = key
            self.stream_keys.append(key)  # (the row's key is `fixed`; its key_ix only has to exist)
            self.keys.append(
                NnxKey(
                    self.step,
                    layer.path,
                    "dropout",
                    str(layer.st.opt("rng_collection")),
                    str(layer.st.opt("rng_collection")),
                    f"{layer.path} (key given by {where or 'the model'})",
                    0,
                    (f"key {st.key.text} (given at the call)",),
                    len(self.stream_keys) - 1,
                    st.loc,
                    stale=self.stale,
                    lane=self.lane,
                    iteration=self.iteration,
                    # (a key given inside nnx.vmap is the same in every lane: broadcast)
                    broadcast="vmap" if self.vmapping and self.lane >= 0 else "",
                    scan=self.scan,
                    given=st.key.text,
                )
            )

    def rngs_given(self, st: NnxCall) -> Rngs | None:
        """The Rngs a call is given (`rngs: call`: the spec's call_rngs, None in a step given none; `rngs: model`:
        the one the model is built from)."""
        return self.call_rngs if st.given_rngs == "call" else self.model_rngs

    def given_rngs(self, layer: Layer, st: NnxCall) -> None:
        """`self.drop(x, rngs=rngs)`, `st.repeat` times, given the Rngs the model's call was given (mirrors
        nnx.Dropout.__call__: `rngs[rng_collection]()`, the call's Rngs winning over the Dropout's own stream,
        which draws nothing; nnx.MultiHeadAttention.__call__: `rngs.dropout()` when it has dropout_rate > 0 and
        is not deterministic)."""
        attention = layer.st.kind == "MultiHeadAttention"
        given = self.rngs_given(st)
        if given is None:
            # (a step whose call is given no Rngs, `null` in call_rngs: as called without one, rngs=None)
            self.call_layer(layer, st.loc, st.repeat)
            return
        if attention:
            # (MultiHeadAttention.__call__ reads rngs.dropout first, whatever its rate or mode: a missing stream is
            # AttributeError even where it would draw nothing)
            stream = given.get("dropout", "AttributeError", st.loc)
            if not layer.st.opt("dropout_rate") > 0 or self.deterministic(layer.st):
                return
        else:
            rate = layer.st.opt("rate")
            if rate == 0.0 or self.deterministic(layer.st) or rate == 1.0:
                return
        if self.lane >= 0 or self.control or self.stale:
            where = "nnx.vmap/nnx.scan lanes" if self.lane >= 0 else "control flow" if self.control else "stale_call"
            raise SpecError(
                f"{layer.path} is given the call's Rngs inside {where}: rngaudit does not model that yet; call it "
                "plainly",
                st.loc,
            )
        if attention:
            self.draw(stream, layer.path, "attention_dropout", "dropout", st.loc, n=st.repeat)
            return
        col = str(layer.st.opt("rng_collection"))
        s = given.get(col, "KeyError", st.loc)
        self.draw(s, layer.path, "dropout", col, st.loc, n=st.repeat)

    def call_layer(self, layer: Layer, loc: Location, n: int = 1) -> None:
        """`n` calls of a standard layer in a row (each draws the next key of the same stream, or none)."""
        st = layer.st
        if st.kind == "Dropout":
            rate = st.opt("rate")
            # mirrors nnx.Dropout.__call__: rate 0 or deterministic, and rate 1, draw nothing
            if rate == 0.0 or self.deterministic(st) or rate == 1.0:
                return
            col = str(st.opt("rng_collection"))
            if layer.shared is None and layer.own is None:
                raise FlaxError(
                    "ValueError",
                    "`deterministic` is False, but no `rngs` argument was provided to Dropout (it is built without "
                    "rngs, `rngs: false`: give the call a key, `call: {name: ..., key: K}`)",
                    loc,
                )
            if layer.shared is not None:
                # flax < 0.11: rngs[rng_collection]() on the Rngs it was given, at each call
                self.draw(layer.shared.get(col, "KeyError", loc), layer.path, "dropout", col, loc, n=n)
                return
            assert layer.own is not None
            self.draw(layer.own, layer.path, "dropout", col, loc, n=n)
        elif st.kind == "MultiHeadAttention":
            if not st.opt("dropout_rate") > 0 or self.deterministic(st):
                return
            if layer.shared is not None:
                # flax < 0.11: rngs.dropout() on the Rngs it was given, at each call
                self.draw(
                    layer.shared.get("dropout", "AttributeError", loc),
                    layer.path,
                    "attention_dropout",
                    "dropout",
                    loc,
                    n=n,
                )
                return
            if layer.own is None:
                raise FlaxError(
                    "ValueError",
                    "'rngs' must be provided to __call__ method if MultiHeadAttention instance is defined "
                    "with keep_rngs=False. (set keep_rngs: true, or deterministic: true)",
                    loc,
                )
            self.draw(layer.own, layer.path, "attention_dropout", "dropout", loc, n=n)


@dataclass
class Layer:
    st: NnxLayer
    path: str
    own: Stream | None  # the stream it forked (Dropout, attention)
    params: int = 0
    shared: Rngs | None = None  # flax < 0.11: the caller's Rngs it keeps and draws from at each call

    @property
    def stateful(self) -> bool:
        """Whether it holds arrays: parameters, BatchNorm's statistics or an RNG stream."""
        return bool(self.params) or self.own is not None or self.shared is not None or self.st.kind == "BatchNorm"


@dataclass
class Bridge:
    """A bridge.ToNNX module: the Linen module and the Rngs it keeps."""

    st: NnxBridge
    path: str
    rngs: Rngs
    initialized: bool = False
    has_params: bool | None = None  # whether its Linen init makes params (known once asked)
    calls_in_step: dict[int, int] = field(default_factory=dict)

    @property
    def stateful(self) -> bool:
        return True


@dataclass
class Rnn:
    """An nnx.RNN: its cell and the stream it keeps for initialize_carry (None: rngs=False)."""

    st: NnxRnn
    path: str
    cell: Layer | Instance
    own: Stream | None

    @property
    def stateful(self) -> bool:
        return True


@dataclass
class Bidi:
    """An nnx.Bidirectional: its two RNNs and the stream it keeps (None: rngs=False)."""

    st: NnxBidirectional
    path: str
    fwd: Rnn
    bwd: Rnn
    own: Stream | None

    @property
    def stateful(self) -> bool:
        return True


@dataclass
class Stacked:
    """A stacked module: its members, built from lane i of every stream."""

    st: NnxChild
    path: str
    members: list[Instance]


class Instance:
    """A built user module: its attributes (layers and submodules) and the Rngs it keeps, if any."""

    def __init__(self, mod: NnxModule, path: str, rngs: Rngs | None):
        self.mod = mod
        self.path = path
        self.rngs = rngs
        self.attrs: dict[str, Layer | Instance | Stacked | Bridge | Rnn | Bidi] = {}
        self.forks: dict[str, Stream] = {}  # the streams it keeps by `fork:` (self.rng = rngs.dropout.fork())

    def kept_stream(self, keeper: str, stream: str, loc: Location) -> tuple[str, Stream]:
        """Stream `stream` of the Rngs this module keeps (self.rngs), or (`keeper`, `from: enc`) the one the
        submodule `keeper` keeps (self.enc.rngs), or the stream a module keeps by `fork:` (`from: rng`, `from:
        enc.rng`): the site its draws are at (the module, or the fork's attribute, as a Dropout's draws are at the
        Dropout) and the stream (a missing one: NNX's AttributeError)."""
        if keeper in self.forks:  # (a fork kept under a dotted name, an item of a list: blocks.0)
            return _join(self.path, keeper), self.forks[keeper]
        head, _, last = keeper.rpartition(".")
        try:
            holder = self.attr(head) if head else self
        except KeyError:
            holder = None  # (`blocks` of a module kept as `blocks.0`, an item of a list: no attribute of its own)
        if isinstance(holder, Instance) and last in holder.forks:
            return _join(holder.path, last), holder.forks[last]
        owner = self.attr(keeper) if keeper else self
        assert isinstance(owner, Instance) and owner.rngs is not None  # (the parser asks for keep_rngs)
        return owner.path or "(root)", owner.rngs.get(stream, "AttributeError", loc)

    def attr(self, name: str) -> Layer | Instance | Stacked | Bridge | Rnn | Bidi:
        """Attribute `name`, or (dotted, `enc.drop`) one of a submodule's (the parser checked it exists)."""
        if name in self.attrs:
            return self.attrs[name]
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            head = self.attrs.get(".".join(parts[:i]))
            if isinstance(head, Instance):
                try:
                    return head.attr(".".join(parts[i:]))
                except KeyError:
                    continue
        raise KeyError(name)

    @property
    def stateful(self) -> bool:
        return (
            self.rngs is not None
            or bool(self.forks)
            or any(
                isinstance(a, Stacked) or a.stateful
                for a in self.attrs.values()  # (a stack holds its members')
            )
        )


def _owner(at: tuple[str, ...]) -> str:
    """The site a transform's draw from a stream of the graph is at: the layer or module that keeps the stream (a
    Dropout's own, `drop.rngs`; a module's kept Rngs, `enc.rngs.dropout`; a fork kept at `rng`). Two streams of one
    tag split or forked together are two sites."""
    if at[-1:] == ("rngs",):
        at = at[:-1]
    elif at[-2:-1] == ("rngs",):
        at = at[:-2]
    return ".".join(at) or "(root)"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclass(frozen=True)
class NnxTable:
    """The replay as columns: its blocks, and per key the block it is in, its count and its key data."""

    blocks: list[NnxKey]
    block: np.ndarray  # row -> block
    count: np.ndarray  # row -> count (uint32, as NNX folds it)
    keys: np.ndarray  # row -> key data (rows, width)


def _least(mod: NnxModule, statements: Sequence, memo: dict) -> tuple[int, int]:
    """(module calls, keys drawn) that running `statements` of module `mod` surely makes, whatever the modes, as
    the replay counts them (NnxReplayer.tick, .total): a call of a submodule, a bridge or an RNN, a layer's call in
    each lane or scan step of a transform, each loop iteration; a draw with no `when:` its keys. What depends on a
    mode, a branch not taken or a layer's options counts nothing: a lower bound, so that past the limits the
    replay would be too."""
    from ..spec.nnx import ATTRIBUTES, _attribute_of

    names = {st.name: st for st in mod.init if isinstance(st, ATTRIBUTES)}

    def inner(target) -> tuple[int, int]:
        if not isinstance(target, NnxChild):
            return 0, 0
        key = id(target.module)
        if key not in memo:
            memo[key] = (0, 0)  # (a module reached again while it is counted: nothing more)
            memo[key] = _least(target.module, target.module.call, memo)
        return memo[key]

    calls = draws = 0
    for st in statements:
        if isinstance(st, NnxDraw) and st.when is None:
            draws += st.repeat
        elif isinstance(st, NnxLoop):
            c, d = _least(mod, st.body, memo)
            calls, draws = calls + st.iterations * (1 + c), draws + st.iterations * d
        elif isinstance(st, NnxCond) and 0 <= st.taken < len(st.branches):
            c, d = _least(mod, st.branches[st.taken], memo)
            calls, draws = calls + c, draws + d
        elif isinstance(st, NnxCall) and st.when is None and st.key is None and not st.given_rngs:
            target = _attribute_of(names, st.name)
            if isinstance(target, (NnxRnn, NnxBidirectional, NnxBridge)):
                calls += st.repeat  # (one call each, at least)
            elif st.transform is not None:
                stacked = isinstance(target, NnxChild) and target.stack
                lanes = st.transform.lanes or (target.stack if stacked else 0)
                c, d = inner(target)
                calls, draws = calls + st.repeat * lanes * (1 + c), draws + st.repeat * lanes * d
            elif isinstance(target, NnxChild) and not target.stack:
                c, d = inner(target)
                calls, draws = calls + st.repeat * (1 + c), draws + st.repeat * d
    return calls, draws


def _refuse_past_limits(spec: NnxSpec) -> None:
    """A spec whose run surely makes more module calls or draws more keys than the replay allows is refused before
    it runs (it would be, after minutes and GBs: a loop of a million iterations at each of 100 steps)."""
    steps = sum(e.n for e in spec.run if isinstance(e, NnxStep))
    if not steps:
        return
    calls, draws = _least(spec.model, spec.model.call, {})
    if steps * (1 + calls) > MAX_NNX_CALLS:
        raise SpecError(
            f"the model makes more than {MAX_NNX_CALLS} module calls ({steps} step{'s' * (steps > 1)} of at least "
            f"{1 + calls}); reduce `repeat`, `steps`, `iterations`, `scan:`, `vmap:` or `stack:`",
            spec.model.loc,
        )
    if steps * draws > MAX_NNX_DRAWS:
        raise SpecError(
            f"the model draws more than {MAX_NNX_DRAWS} keys ({steps} step{'s' * (steps > 1)} of at least {draws}); "
            "reduce `repeat`, `steps` or `iterations`",
            spec.model.loc,
        )


def replay_nnx(spec: NnxSpec, engine: KeyEngine) -> NnxTable:
    """Every key the NNX model hands out, construction first, then each step's calls: fold_in(stream key,
    count) for all rows at once."""
    import numpy as np

    _refuse_past_limits(spec)
    r = NnxReplayer(spec, engine)
    blocks = r.run()
    sizes = np.fromiter((k.n for k in blocks), dtype=np.int64, count=len(blocks))
    block = np.repeat(np.arange(len(blocks), dtype=np.int64), sizes)
    first = np.fromiter((k.count for k in blocks), dtype=np.int64, count=len(blocks))
    starts = np.cumsum(sizes) - sizes
    count = (first[block] + (np.arange(len(block), dtype=np.int64) - starts[block])).astype(np.uint64)
    count = count.astype(np.uint32)  # (NNX's RngCount is uint32)
    if not len(block):
        return NnxTable(blocks, block, count, np.zeros((0, engine.width), dtype=np.uint32))
    bases = np.asarray(r.stream_keys, dtype=np.uint32)
    ix = np.fromiter((k.key_ix for k in blocks), dtype=np.int64, count=len(blocks))
    keys = engine.fold_in_rows(bases[ix[block]], count)
    if r.fixed:
        # (a bridge.ToNNX's Linen keys: blocks of one row each)
        at = np.asarray(list(r.fixed), dtype=np.int64)
        keys[starts[at]] = np.asarray(list(r.fixed.values()), dtype=np.uint32)
    return NnxTable(blocks, block, count, keys)


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
    calls: NnxCalls
    total: int | None = None  # keys before --stream/--path/--limit; None: no filter
    rules: str = RULES
    unmatched: tuple[str, ...] = ()  # a warning per --stream/--path that matches no key

    @property
    def fallbacks(self) -> int:
        """Keys served by the `default` stream for another stream's name (the findings of --strict)."""
        table = self.calls.table
        fb = [k.fallback for k in table.blocks]
        if not fb:
            return 0
        import numpy as np

        return int(np.asarray(fb, dtype=bool)[table.block[self.calls.rows()]].sum())

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
    keyed: int | None = None,
) -> NnxDeriveReport:
    """Replay the NNX spec, with every key (and the requested draws). `streams` (requested or serving),
    `paths` (globs over the site) and `limit` select keys before any value is drawn; `keyed`: draw the values
    of the first `keyed` selected keys now, the others' when first read (NnxCalls)."""
    from fnmatch import fnmatchcase

    from ..errors import SpecError
    from .draws import RBG_IMPLS, draw_values, draw_values_lanes

    engine = KeyEngine(spec.prng_impl, spec.threefry_partitionable)
    import numpy as np

    table = replay_nnx(spec, engine)
    blocks = table.blocks
    filtered = bool(streams or paths or limit is not None)
    selected = None
    unmatched: tuple[str, ...] = ()
    if filtered:
        keep = np.ones(len(blocks), dtype=bool)
        for b, k in enumerate(blocks):
            if (
                streams
                and not (k.requested in streams or k.tag in streams)
                or paths
                and not any(fnmatchcase(k.site, g) for g in paths)
            ):
                keep[b] = False
        selected = np.flatnonzero(keep[table.block]) if len(table.block) else np.zeros(0, dtype=np.int64)
        from .table import unmatched_filters

        unmatched = unmatched_filters(
            streams, (), {k.requested for k in blocks} | {k.tag for k in blocks}, set()
        ) + tuple(
            f"--path {g} matches no site"
            for g in dict.fromkeys(paths)
            if not any(fnmatchcase(k.site, g) for k in blocks)
        )
        if limit is not None:
            selected = selected[:limit]
    if not values:
        calls = NnxCalls(table, selected, default_draw, {})
    else:
        draws = [k.draw or (default_draw if k.kind != "fork" else None) for k in blocks]
        has = np.array([d is not None for d in draws], dtype=bool)
        rows = np.arange(len(table.block)) if selected is None else selected
        lanes = _lane_groups(table) if spec.prng_impl in RBG_IMPLS else {}
        done: dict = {}

        def drawn(j0: int, j1: int | None = None) -> dict:
            # the values of the keys at positions j0..j1-1 (by position)
            out: dict = {}
            part = rows[j0:j1]
            for j in np.flatnonzero(has[table.block[part]] if len(part) else np.zeros(0, dtype=bool)).tolist():
                i = int(part[j])
                draw = draws[int(table.block[i])]
                assert draw is not None
                try:
                    group = lanes.get(i)
                    if group is None:
                        out[j0 + j] = draw_values(spec, tuple(int(w) for w in table.keys[i]), draw)
                        continue
                    # inside jax.vmap with rbg keys every lane's bits are a row of one draw from lane 0's key
                    members, lane = group
                    if members not in done:
                        done[members] = draw_values_lanes(spec, table.keys[np.asarray(members)], draw)
                    out[j0 + j] = done[members][lane]
                except (ValueError, TypeError, ArithmeticError, IndexError) as e:
                    raise SpecError(f"cannot draw {draw.describe()}: {e}", draw.loc) from None
            return out

        rest = None if keyed is None or keyed >= len(rows) else partial(drawn, keyed)
        calls = NnxCalls(table, selected, default_draw, drawn(0, keyed), rest, keyed or 0)
    roots = {name: engine.eval(src.expr) for name, src in spec.rngs.items()}
    return NnxDeriveReport(spec, roots, calls, len(table.block) if filtered else None, rules_of(spec), unmatched)


def _lane_groups(table: NnxTable) -> dict:
    """Per row drawn in an nnx.vmap lane from a per-lane key: (the rows of the same draw in lanes 0..n-1, its
    lane). A draw whose lanes are not all there is left out (drawn from its own key)."""
    import numpy as np

    groups: dict = {}
    blocks = table.blocks
    if not any(k.batched for k in blocks):
        return {}
    starts = np.searchsorted(table.block, np.arange(len(blocks)))
    for b, k in enumerate(blocks):
        if not k.batched:
            continue
        for r in range(k.n):
            where = (k.step, k.site, k.kind, k.requested, k.tag, k.count + r, k.loc, k.iteration, k.scan, k.label)
            groups.setdefault(where, {})[k.lane] = int(starts[b]) + r
    out: dict = {}
    for by_lane in groups.values():
        if sorted(by_lane) != list(range(len(by_lane))):
            continue
        members = tuple(by_lane[lane] for lane in range(len(by_lane)))
        for lane, row in enumerate(members):
            out[row] = (members, lane)
    return out


class NnxCalls(LazyRows, Sequence[NnxKeyedCall]):
    """A report's keys: an NnxKeyedCall made when one is read (a million stay columns)."""

    def __init__(
        self,
        table: NnxTable,
        selected,
        default_draw: Draw | None,
        values: dict,
        rest: Callable[[], dict] | None = None,
        drawn_upto: int = 0,
    ):
        self.table = table
        self.selected = selected  # row numbers kept by the filters; None: every row
        self.default_draw = default_draw
        self._values = values  # position -> drawn values (of positions < drawn_upto only while `rest` is left)
        self._rest = rest  # the other positions' values, drawn when first read
        self._upto = drawn_upto

    @property
    def values(self) -> dict:
        """Position -> the values drawn there, for every key that draws."""
        if self._rest is not None:
            self._values.update(self._rest())  # (may raise: a draw that fails; nothing changes then)
            self._rest = None
        return self._values

    def values_upto(self, n: int) -> dict:
        """`values` of the first n positions (drawing no other position's)."""
        values = self._values if self._rest is None or n <= self._upto else self.values
        return {j: v for j, v in values.items() if j < n}

    def row(self, j: int) -> int:
        return j if self.selected is None else int(self.selected[j])

    def rows(self) -> np.ndarray:
        import numpy as np

        return np.arange(len(self.table.block)) if self.selected is None else self.selected

    def __len__(self) -> int:
        return len(self.table.block) if self.selected is None else len(self.selected)

    def _at(self, j: int) -> NnxKeyedCall:
        import copy

        i = self.row(j)
        k = self.table.blocks[int(self.table.block[i])]
        if k.n != 1:
            # (one row of the block: dataclasses.replace re-runs __init__, ten times slower for a million rows)
            k = copy.copy(k)
            object.__setattr__(k, "count", int(self.table.count[i]))
            object.__setattr__(k, "n", 1)
        draw = k.draw or (self.default_draw if k.kind != "fork" else None)
        values = self._values if self._rest is None or j < self._upto else self.values
        return NnxKeyedCall(k, tuple(int(w) for w in self.table.keys[i]), draw, values.get(j), i)
