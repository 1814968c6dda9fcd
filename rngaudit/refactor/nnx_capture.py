"""`capture` of a Flax NNX model: build it from an `nnx.Rngs` and call it, record every key its streams hand out
(construction and each step), read off what each module's `__init__` built and drew and what its `__call__`
did, write that as an NNX spec, and hand the spec out only if `derive` replays every key bit-exactly.

What is observed (all restored when the capture ends):
- `RngStream.__call__`: every key, its tag and count, and the module being built or called;
- the construction of every `nnx.Module` (the Pytree metaclass's construct step): its class, the Rngs it was
  given, what it drew and built, in order;
- `Rngs.fork`: a forked Rngs handed to a submodule (`rngs: fork`);
- the `__call__` of every module class built: which attributes each call calls and what it draws.

What an NNX spec cannot say yet (lanes inside the model call, a layer given another Rngs, a module that
behaves differently from call to call) is refused with an error that names it."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import InternalError, RngauditError, UnsupportedError, UsageError, UserCodeError
from ..spec.nnx import CARRY_DRAWS, CELLS, LAYER_OPTIONS, RESEED_POLICIES
from ..usercode import CodeRef, first_line, load
from .keys_file import Capture, Site
from .specgen import jax_doc
from .target import InputSpec

MAX_STEPS = 10_000
_MISSING = object()


@dataclass
class Built:
    """A module's construction: its object, the Rngs it was given, and what its __init__ did, in order."""

    cls: type
    rngs: object | None
    events: list = field(default_factory=list)  # ("draw", tag) | ("fork", rngs) | ("child", Built)
    obj: object | None = None
    stack: int = 0  # built by nnx.split_rngs(splits=stack) around nnx.vmap; -1: by a vmap without split_rngs
    split_of: object | None = None  # the Rngs that nnx.split_rngs split for it
    made: tuple = ()  # (mode, only): built from rngs.split / rngs.broadcast (mode "split" / "broadcast")
    this: object | None = None  # the module being built (obj once its construction is over)


@dataclass
class Split:
    """An nnx.split_rngs decorator at work: its splits and filter; `body` once the function it wraps runs."""

    n: int
    only: object
    node: tuple  # the arguments it split
    body: bool = False


@dataclass
class Transform:
    """An nnx.vmap or nnx.scan call: its axes, its arguments (outside), the split_rngs around it."""

    kind: str
    in_axes: object
    length: int | None
    outer: tuple
    split: Split | None
    depth: int  # how many modules were being built when it started
    inner_out: object = None
    inner_args: tuple = ()  # the arguments its function was given (inside)


@dataclass
class Called:
    obj: object
    events: list = field(default_factory=list)  # ("call", Called, how) | ("draw", tag, id(the stream))
    drew: bool = False
    transforms: int = 0  # how many transforms were running when the call started
    given: object = None  # a layer's call given an nnx.Rngs (drop(x, rngs=rngs)): that Rngs
    sealed: int | None = None  # a call under a transform over the module itself: its events when that ended
    rnn: tuple | None = None  # an nnx.RNN's call: (sequence length, given initial_carry, the Rngs given or None)
    quiet: bool = False  # a Dropout's or attention's call that draws nothing because it is deterministic
    key: bool = False  # a Dropout's call given a key (drop(x, rngs=key)): it draws from no stream
    # a module of yours: whether it was deterministic at this call (its `deterministic` argument or attribute, or not
    # its `train`/`training` argument; model.train()/eval() set the attribute), None where it has none
    mode: bool | None = None
    synthetic: bool = False  # the call of the root standing for several models: the step itself
    touched: bool = False  # whether a key was drawn during the call (by it, a module it called, a fork or a split)
    fork: tuple[str, ...] | None = None  # called in `with nnx.fork_rngs(it, split=...)`: the tags forked (() all)


@dataclass
class BridgeCall:
    """A call of a bridge.ToNNX: Linen init (under bridge.lazy_init) or apply, with the arguments and the keys it
    gives Linen (None: traced, or no Rngs); `whole`: inside a call of the root model (bridge.lazy_init(model))."""

    init: bool
    args: tuple
    kwargs: dict
    keys: dict | None
    step: int
    whole: bool
    extra: bool  # given rngs=, method= or mutable= at the call


class NnxRecorder:
    def __init__(self):
        self.active = True  # False once its observation ends: a hook made meanwhile (at import) is Flax's again
        self.building: list[Built] = []
        self.calling: list[Called] = []
        self.roots: list[Built] = []
        # rngs.fork() outside every module's construction and call (the factory's Actor(rngs=rngs.fork())): (how many
        # roots were built before it, the fork, the Rngs forked)
        self.loose_forks: list[tuple[int, object, object]] = []
        self.forks = 0  # inside Rngs.fork
        self.step = 0  # the model's calls so far (a spec's step is one call of the model)
        self.invocation = 0  # the step being run (capture's call of the model or of --step), from 1
        self.model: object | None = None  # the model, once the factory has built it
        # each call of the model: id(Dropout/attention) -> whether it was deterministic at its calls (its attribute
        # on the object called: the model or a view, or the call's `deterministic=` argument)
        self.modes: list[dict] = []
        self.built_modes: dict[int, object] = {}  # id(Dropout/attention) -> its `deterministic` as built
        # id(Dropout/attention) -> the `deterministic=` every call of it gives, where the model also switches modes
        # (model.train()/eval()): the spec says it at the layer's calls
        self.pinned: dict[int, bool] = {}
        self.records: list[dict] = []
        self.traced = False
        self.calls: dict[int, list] = {}  # id(module) -> what its first call did
        # id(a module of yours whose mode is known at its calls) -> its mode -> what its calls in that mode did
        self.mode_calls: dict[int, dict[bool, list]] = {}
        self.user_modes: dict[int, dict[int, set]] = {}  # step -> id(such a module) -> its modes at that step
        self.mode_names: dict[int, str] = {}  # id(such a module) -> its class's name
        self.differs: str | None = None
        self.transforms: list[Transform] = []
        self.splits: list[Split] = []
        self.alias: dict[int, object] = {}  # id(an object inside a transform) -> the object outside
        self.inner: list = []  # (keeps those objects alive, so their ids stay theirs)
        self.lanes = False  # a transform ran: keys come lane by lane, in JAX's order
        self.asked: dict[int, str] = {}  # id(stream) -> the name it was last asked for (`default` serves others)
        self.bridges: dict[int, list[BridgeCall]] = {}  # id(bridge.ToNNX) -> its calls
        # id(an Rngs that rngs.split / rngs.broadcast made) -> (the Rngs, mode, N, only: the streams split or ())
        self.made: dict[int, tuple] = {}
        self.top: list = []  # the modules called from outside any module's call, this step (--step checks them)
        self.stray = 0  # keys drawn in a step outside every module's call (by a training step itself)
        self.reseeds: list[str] = []  # nnx.reseed calls a spec cannot say (of what, why)
        self.excluded: dict[int, str] = {}  # id(a module the step is given that a spec cannot say) -> why, if called
        # the streams of the Rngs the model and its modules keep (id -> (keeper: "" the model, else its attribute
        # path; the stream's name)): a step may draw from them (model.rngs.noise(), model.enc.rngs.noise())
        self.kept_streams: dict[int, tuple[str, str]] = {}
        # such draws since the model's last call: (record index, keeper, stream)
        # a training step's draws from the kept Rngs since the last call of the model, and its nnx.reseed calls:
        # (record index, keeper, stream), or (None, None, {stream: seed}) for a reseed
        self.pending: list[tuple[int | None, str | None, Any]] = []
        # call of the model -> what the step did before it: (keeper, stream) drawn, (None, {stream: seed}) reseeded
        self.draws_before: dict[int, list[tuple[str | None, Any]]] = {}
        # id(an nnx.Rngs made while capture watched) -> its seeds (integers, or a concrete key's data)
        self.seeds: dict[int, dict] = {}
        self.rngs_made: list = []  # every nnx.Rngs made while capture observes (whose streams a call may be given)
        self.call_rngs: dict[int, object] = {}  # id -> every Rngs a layer's call was given (drop(x, rngs=rngs))
        self.call_rngs_at: dict[int, dict[int, object]] = {}  # step -> the Rngs given at its calls (id -> it)
        # id(Dropout) -> the key data its calls were given (drop(x, rngs=key)); None in it: one capture cannot write
        self.given_keys: dict[int, set] = {}
        self.rnn_draws: dict[int, int] = {}  # id(an nnx.RNN) -> the keys its cell's initialize_carry draws a call
        # the copies of the model and of nnx.Rngs a jax.jit boundary (or nnx.merge) made since the last check:
        # (copy, original); what they drew stays in them unless their state is written back
        self.merged: list[tuple[object, object]] = []
        self.dropped: set[str] = set()  # "model" / "rngs": a copy's counts were not written back this step
        self.split_of: dict[int, tuple] = {}  # id(an nnx.split graphdef) -> (it, what it was split from)
        self.stale: set[int] = set()  # the model's calls whose RNG counts were not written back (stale_call)
        # call of the model -> (the transform, the model's place among its arguments, depth): the step calls the
        # model under nnx.vmap/nnx.scan (the Randomness guide's data-parallel dropout and sample_from_model)
        self.root_how: dict[int, tuple] = {}
        self.ahead: list[int] = []  # records of the keys nnx.split_rngs draws in a step before the call it splits for
        # nnx.fork_rngs(node, split=...) at work: [node (outside), the tags forked (() every stream), its backups,
        # whether node has been called under it]
        self.forked: list[list] = []
        self.split_backups: list[tuple[object, Split]] = []  # `with nnx.split_rngs(node, ...)` at work: backups
        self.fork_problems: list[str] = []  # nnx.fork_rngs used as a spec cannot say (said when the step ends)
        self.root_fork: dict[int, tuple[str, ...]] = {}  # call of the model -> the tags the step forked for it

    def reset(self) -> None:
        """Empty, as made (and active)."""
        self.__init__()  # type: ignore[misc]

    def resolve(self, obj):
        return self.alias.get(id(obj), obj)

    def between_calls(self) -> bool:
        """Whether a step is running and no module is being built or called (the step's own code)."""
        return bool(self.invocation) and not self.calling and not self.building

    def inside(self) -> bool:
        """Whether a module's call is running (not the step of several models, which stands for their root's)."""
        return bool(self.calling) and not self.calling[-1].synthetic

    def next_step(self) -> None:
        """A call of the model starts (a step of the spec): the draws the training step made before it are its."""
        self.step += 1
        for j in self.ahead:
            self.records[j]["step"] = self.step
        self.ahead = []
        if self.pending:
            for i, _, _ in self.pending:
                if i is not None:
                    self.records[i]["step"] = self.step
            self.draws_before[self.step] = [(keeper, tag) for _, keeper, tag in self.pending]
            self.pending = []
        self.modes.append({})

    def given(self, rngs) -> object:
        """An nnx.Rngs a layer's call is given (drop(x, rngs=rngs)), noted with the step it is given at."""
        rngs = self.resolve(rngs)
        self.call_rngs[id(rngs)] = rngs
        self.call_rngs_at.setdefault(self.step, {})[id(rngs)] = rngs
        return rngs

    def draw(self, stream, count, key, traced: bool = False) -> None:
        import jax
        import numpy as np

        for f in self.calling:
            f.touched = True
        tag = stream.tag
        if traced:
            # inside a transform: the key exists when the computation runs (per lane under vmap)
            step = self.step

            def record(c, k):
                self.records.append(
                    {"step": step, "tag": tag, "count": int(c), "key": tuple(int(w) for w in np.asarray(k).ravel())}
                )

            jax.debug.callback(record, count, jax.random.key_data(key))
        else:
            self.records.append(
                {
                    "step": self.step,
                    "tag": tag,
                    "count": int(count),
                    "key": _key_words(key),
                }
            )
        if self.forks:
            return
        if self.splits and not self.splits[-1].body:
            if self.between_calls() and not traced:
                self.ahead.append(len(self.records) - 1)  # (in a step, before the call of the model it splits for)
            return  # nnx.split_rngs drawing the keys it splits
        tag = self.asked.get(id(stream), tag)
        if self.inside():
            frame = self.calling[-1]
            frame.drew = True
            frame.events.append(("draw", tag, id(self.resolve(stream))))
            for f in self.calling:
                f.drew = True
        elif self.building:
            self.building[-1].events.append(("draw", tag))
        elif (
            self.calling and self.calling[-1].synthetic and not traced and id(self.resolve(stream)) in self.kept_streams
        ):
            # a step of several models drawing from the Rngs one of them keeps (generator.rngs.noise()): a draw of
            # their root's call, where it comes among the models' calls
            frame = self.calling[-1]
            frame.drew = True
            frame.events.append(("draw", tag, id(self.resolve(stream))))
        elif self.invocation > 0 and not traced and id(self.resolve(stream)) in self.kept_streams:
            # model.rngs.<stream>() by the training step (or a method of the model other than __call__): its row
            # is the next call's step (relabelled there), a `draw` event of the spec's `run:`
            self.pending.append((len(self.records) - 1, self.kept_streams[id(self.resolve(stream))][0], tag))
        elif self.invocation > 0:
            self.stray += 1


_OPEN: list[NnxRecorder] = []


@contextlib.contextmanager
def observing() -> Iterator[NnxRecorder]:
    """Every NNX hook installed for the duration (and removed, whatever happens). Inside another observation
    (capture's session, open while the model's modules are imported) its recorder, as it is: the caller resets it
    once the model's file is imported (what the imports built and drew is not the model's)."""
    if _OPEN:
        yield _OPEN[-1]
        return
    rec = NnxRecorder()
    _OPEN.append(rec)
    try:
        with _observed(rec):
            yield rec
    finally:
        rec.active = False
        _OPEN.pop()


def _seed(value) -> int | list[int] | None:
    """What a spec's `rngs:` writes for a stream of nnx.Rngs(...): an integer seed as given, a concrete key
    (jax.random.key(n), PRNGKey(n), a split of one, or an RngStream's key: nnx.Rngs(dropout=rngs.dropout)) as its
    raw key data `[w0, w1]`; None for anything else (a key traced under a transform)."""
    if type(value) is int:
        return value
    import jax
    import numpy as np

    if type(value).__name__ == "RngStream":
        # nnx.Rngs(dropout=self.rngs.dropout): the stream's key, its count not taken (a new stream counts from 0)
        key = value.key
        value = key.get_value() if hasattr(key, "get_value") else key.value

    run_key = jax.random.key(0)  # (the run's PRNG impl and its key width)
    width = np.asarray(jax.random.key_data(run_key)).size
    try:
        if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            if str(jax.random.key_impl(value)) != str(jax.random.key_impl(run_key)):
                return None  # (a key of another PRNG impl than the run's: a spec has one impl)
            value = jax.random.key_data(value)
        data = np.asarray(value)
    except Exception:  # noqa: BLE001  (a tracer, or not an array)
        return None
    if data.dtype != np.uint32 or data.shape != (width,):
        return None
    return [int(w) for w in data]


@contextlib.contextmanager
def _observed(rec: NnxRecorder) -> Iterator[None]:
    import jax
    from flax import nnx
    from flax.nnx import pytreelib, rnglib

    meta = pytreelib.PytreeMeta
    construct = meta._pytree_meta_construct
    stream_call = nnx.RngStream.__call__
    fork = nnx.Rngs.fork
    stream_fork = nnx.RngStream.fork
    reseed = getattr(nnx, "reseed", None)
    patched: dict[type, object] = {}

    def construct_hook(cls, self, *args, **kwargs):
        if isinstance(cls, type) and issubclass(cls, nnx.Rngs):
            # nnx.Rngs(default, **streams): its seeds, where they are integers (an Rngs a call is given is
            # written as the spec's call_rngs)
            out = construct(cls, self, *args, **kwargs)
            rec.rngs_made.append(self)
            given = {**({"default": args[0]} if args else {}), **kwargs}
            seeds = {k: _seed(v) for k, v in given.items()}
            if given and all(v is not None for v in seeds.values()):
                rec.seeds[id(self)] = seeds
                rec.inner.append(self)
            return out
        if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
            return construct(cls, self, *args, **kwargs)
        given = next((a for a in (*args, *kwargs.values()) if isinstance(a, nnx.Rngs)), None)
        built = Built(cls, given, this=self)
        t = rec.transforms[-1] if rec.transforms else None
        if t is not None and len(rec.building) == t.depth:
            # built by the function a transform runs: a stack when nnx.split_rngs splits for a vmap
            made = next((rec.made[id(a)] for a in t.outer if id(a) in rec.made), None)
            if t.kind == "vmap" and t.split is not None:
                built.stack = t.split.n
                split_of = next((a for a in t.split.node if isinstance(a, nnx.Rngs)), None)
                built.split_of = rec.resolve(split_of)
            elif t.kind == "vmap" and made is not None:
                # nnx.vmap over rngs.split(N) / rngs.broadcast(N)
                parent, mode, n, only = made
                built.stack, built.split_of, built.made = n, parent, (mode, only)
            else:
                built.stack = -1
        parent = rec.building[-1] if rec.building else None
        rec.building.append(built)
        try:
            construct(cls, self, *args, **kwargs)
        finally:
            rec.building.pop()
        built.obj = self
        if parent is not None:
            parent.events.append(("child", built))
        else:
            rec.roots.append(built)
        for klass in cls.__mro__:
            if "__call__" in vars(klass) and klass not in patched and klass is not nnx.Module:
                patched[klass] = vars(klass)["__call__"]
                _patch(klass, "__call__", _call_hook(rec, vars(klass)["__call__"]))
        return None

    def stream_hook(stream):
        count = stream.count[...]
        key = stream_call(stream)
        traced = isinstance(count, jax.core.Tracer) or isinstance(jax.random.key_data(key), jax.core.Tracer)
        if traced and not rec.transforms:
            rec.traced = True  # (nnx.jit, or a transform capture does not follow)
        rec.draw(stream, count, key, traced)
        return key

    def split_hook(node=_MISSING, /, **kw):
        if not rec.active or "splits" not in kw or (node is not _MISSING and not set(kw) <= {"splits", "only"}):
            # (as a function with other arguments, graph_updates=False, ...: not followed; what it splits shows as
            # draws no spec explains)
            return split_rngs(**kw) if node is _MISSING else split_rngs(node, **kw)
        if node is _MISSING:
            return splitting(split_rngs, kw, kw["splits"], kw.get("only", ...))
        return split_within(split_rngs, node, kw, kw["splits"], kw.get("only", ...))

    def split_within(original, node, kw: dict, n, only):
        """`with nnx.split_rngs(node, splits=N, only=...)` / `with nnx.fork_rngs(node, split={tag: N})` around a
        transform: the split the decorator makes (Split), until nnx.restore_rngs gives the streams back."""
        split = Split(n if isinstance(n, int) else -1, only, (node,))
        rec.splits.append(split)
        try:
            backups = original(node, **kw)
        except BaseException:
            rec.splits.remove(split)
            raise
        split.body = True  # (its keys drawn: what runs now runs under it)
        rec.split_backups.append((backups, split))
        return backups

    def fork_rngs_hook(node=_MISSING, /, **kw):
        # @nnx.fork_rngs(split={'dropout': 5}) (the Randomness guide's sample_from_model): what
        # @nnx.split_rngs(splits=5, only='dropout') does (the same keys and counts, checked against real NNX)
        plain = set(kw) <= {"split"}
        if rec.active and plain and node is not _MISSING:
            tags = _fork_tags(kw.get("split"))
            if tags is not None:
                return forking(node, kw, tags)
        n, only = _fork_split(kw.get("split")) if plain else (None, None)
        if not rec.active or n is None:
            return fork_rngs(**kw) if node is _MISSING else fork_rngs(node, **kw)
        if node is _MISSING:
            return splitting(fork_rngs, kw, n, only)
        return split_within(fork_rngs, node, kw, n, only)

    def forking(node, kw: dict, tags: tuple[str, ...]):
        """`with nnx.fork_rngs(node, split={tags: None})` (or its backups restored by nnx.restore_rngs): the keys
        it draws (one per stream forked, the spec's `fork_rngs` says them), and node's call under it."""
        first = len(rec.records)
        ahead = rec.between_calls() and not rec.transforms
        if rec.transforms and (not rec.calling or len(rec.transforms) > rec.calling[-1].transforms):
            rec.fork_problems.append(
                f"nnx.fork_rngs of a {type(rec.resolve(node)).__name__} inside the function of nnx.vmap/nnx.scan (an "
                "NNX spec forks outside the transform: `call: {name: X, vmap: N, fork_rngs: true}`)"
            )
            return fork_rngs(node, **kw)  # type: ignore[misc]
        rec.forks += 1
        try:
            backups = fork_rngs(node, **kw)  # type: ignore[misc]  # (hooked only where Flax has it)
        finally:
            rec.forks -= 1
        if ahead:
            rec.ahead.extend(range(first, len(rec.records)))  # (a step's, before the call of the model it forks)
        rec.forked.append([rec.resolve(node), tags, backups, False])
        return backups

    def restore_hook(backups, /):
        for i in range(len(rec.split_backups) - 1, -1, -1):
            if rec.split_backups[i][0] is backups:
                _, split = rec.split_backups.pop(i)
                if split in rec.splits:
                    rec.splits.remove(split)
                break
        for i in range(len(rec.forked) - 1, -1, -1):
            if rec.forked[i][2] is backups:
                node, _, _, called = rec.forked.pop(i)
                if not called:
                    rec.fork_problems.append(
                        f"nnx.fork_rngs of a {type(node).__name__} that is not called under it (or only under "
                        "another nnx.fork_rngs inside it, or not as a module of the model, whose call an NNX spec "
                        "marks `fork_rngs:`); capture reads `with nnx.fork_rngs(module): module(x)`"
                    )
                break
        return restore_rngs(backups)

    def splitting(original, kw: dict, n, only):
        """The decorator `original(**kw)` makes, noting the split it makes (Split) while the function it wraps runs."""

        def decorator(f):
            def body(*a, **k):
                rec.splits[-1].body = True
                return f(*a, **k)

            functools.update_wrapper(body, f)
            wrapped = original(**kw)(body)
            plain = original(**kw)(f)

            @functools.wraps(f)
            def outer(*a, **k):
                if not rec.active:  # (applied at import, called after capture: Flax's own)
                    return plain(*a, **k)
                rec.splits.append(Split(n if isinstance(n, int) else -1, only, (*a, *k.values())))
                try:
                    return wrapped(*a, **k)
                finally:
                    rec.splits.pop()

            return outer

        return decorator

    def transform_hook(kind: str, original):
        def hook(*args, **kw):
            if not rec.active:
                return original(*args, **kw)
            if not args:
                return lambda f: hook(f, **kw)
            f = args[0]

            def made():
                def inner(*a, **k):
                    t = rec.transforms[-1]
                    t.inner_args = a
                    for i, o in zip(a, t.outer):
                        _pair(rec, i, o)
                    out = f(*a, **k)
                    t.inner_out = out
                    return out

                functools.update_wrapper(inner, f)
                return original(inner, *args[1:], **kw)

            plain = original(f, *args[1:], **kw)  # (Flax's checks of the arguments, where it is applied)

            @functools.wraps(f)
            def outer(*a, **k):
                if not rec.active:
                    return plain(*a, **k)
                split = rec.splits[-1] if rec.splits and rec.splits[-1].body else None
                default = 0 if kind == "vmap" else (nnx.Carry, 0)
                # (its arguments as the function sees them: nnx.vmap and nnx.scan bind keyword arguments to their
                # positions, MLP(rngs=rngs) reaching __init__(self, rngs) as two positional ones)
                t = Transform(
                    kind, kw.get("in_axes", default), kw.get("length"), _bound(f, a, k), split, len(rec.building)
                )
                # a module that stacks itself (the 0.11 migration guide's scan over layers: @nnx.split_rngs
                # @nnx.vmap on __init__, @nnx.scan on __call__): read as the stack a function under split_rngs and
                # vmap builds (the same keys, checked against real NNX), scanned by its parent's call
                this = a[0] if a else None
                building = bool(rec.building) and this is rec.building[-1].this
                frame = rec.calling[-1] if rec.calling and this is not None else None
                calling = frame is not None and rec.resolve(this) is frame.obj and not frame.events
                if building:
                    _stacks_itself(rec, rec.building[-1], t, kind, nnx)
                elif calling:
                    _scans_itself(rec, frame, t)
                rec.transforms.append(t)
                rec.lanes = True
                try:
                    # a function made afresh at every call: JAX caches the trace of one it has seen (a transform
                    # applied once, at import), and a cached call runs no Python, so its draws would go unseen
                    out = made()(*a, **k)
                finally:
                    rec.transforms.pop()
                    if calling:
                        frame.transforms -= 1
                        frame.sealed = len(frame.events)
                if building and t.inner_args:
                    _pair(rec, t.inner_args[0], this)  # (its attributes, made inside, and the module's own)
                    b = rec.building[-1]
                    # its layers were given the Rngs inside (a lane's): that is the Rngs its __init__ builds from
                    b.rngs = next((i for i, o in zip(t.inner_args, t.outer) if o is b.rngs), b.rngs)
                if t.inner_out is not None:
                    _pair(rec, t.inner_out, out)
                return out

            return outer

        return hook

    def tonnx_hook(self, *args, **kwargs):
        # mirrors the start of ToNNX.__call__: the keys it draws from its Rngs, in order, for Linen
        given = kwargs.get("rngs")
        r = given if given is not None else self.to_nnx__rngs
        keys = None
        if isinstance(r, nnx.Rngs):
            ks = {n: jax.random.fold_in(s.key[...], s.count[...]) for n, s in r.items()}
            if not any(isinstance(jax.random.key_data(k), jax.core.Tracer) for k in ks.values()):
                keys = ks
        state = getattr(self, "_pytree__state", None)
        rec.bridges.setdefault(id(rec.resolve(self)), []).append(
            BridgeCall(
                bool(getattr(state, "initializing", False)),
                args,
                {k: v for k, v in kwargs.items() if k not in ("rngs", "method", "mutable")},
                keys,
                rec.step,
                bool(rec.calling) and not isinstance(rec.calling[0].obj, tonnx),
                any(kwargs.get(k) is not None for k in ("rngs", "method", "mutable")),
            )
        )
        return tonnx_call(self, *args, **kwargs)

    split_rngs, vmap, scan = nnx.split_rngs, nnx.vmap, nnx.scan
    fork_rngs = getattr(nnx, "fork_rngs", None)  # (flax 0.11 and later)
    restore_rngs = getattr(rnglib, "restore_rngs", None)
    get_stream = getattr(nnx.Rngs, "_get_stream", None)

    def get_stream_hook(self, name, *args, **kwargs):
        s = get_stream(self, name, *args, **kwargs)
        rec.asked[id(s)] = name
        return s

    def made_hook(mode: str, original):
        def hook(self, k, *args, **kwargs):
            # mirrors Rngs.split / Rngs.broadcast: read N and the streams the mapping names (its draws are the
            # stack's, not the module's)
            rec.forks += 1
            try:
                out = original(self, k, *args, **kwargs)
            finally:
                rec.forks -= 1
            n, only = k, ()
            if isinstance(k, dict):
                sizes = {v for v in k.values() if v is not None}
                named = [f for f, v in k.items() if v is not None]
                n = next(iter(sizes)) if len(sizes) == 1 else None
                only = tuple(named) if all(isinstance(f, str) for f in named) else None
                if ... in k and k[...] is not None:
                    only = ()  # every stream split
            if isinstance(n, int) and only is not None:
                rec.made[id(out)] = (self, mode, n, only)
                rec.inner.append(out)
            return out

        return hook

    def reseed_hook(node, /, **kwargs):
        # nnx.reseed(model, dropout=SEED) by a training step: a `reseed:` event of `run:` before the next call (the
        # keys of the fresh Rngs it draws its new keys from are not the model's)
        if not rec.active or rec.invocation <= 0 or rec.inside() or rec.building:
            return reseed(node, **kwargs)
        synthetic = rec.calling[-1] if rec.calling and rec.calling[-1].synthetic else None
        busy = synthetic is not None and (synthetic.events or synthetic.touched)
        held = len(rec.records)
        rec.forks += 1
        try:
            out = reseed(node, **kwargs)
        finally:
            rec.forks -= 1
            if synthetic is not None:
                synthetic.touched = bool(busy)  # (reseed's own Rngs' draws are not the models')
        del rec.records[held:]
        seeds = {k: _seed(v) for k, v in kwargs.items() if k not in ("graph", "policy")}
        policy = kwargs.get("policy", "scalars_only")
        where = _reseeded(rec, node)
        if isinstance(where, str):
            rec.reseeds.append(where)
        elif policy not in RESEED_POLICIES:
            rec.reseeds.append(f"nnx.reseed with policy={policy!r}")
        elif not seeds or any(v is None for v in seeds.values()):
            rec.reseeds.append("nnx.reseed with keys that are not integer seeds or concrete keys")
        elif busy:
            rec.reseeds.append(
                "nnx.reseed after it has called or drawn from the models it is given (a spec's `reseed:` comes "
                "between the steps of several models: reseed at the start of the step)"
            )
        else:
            # nnx.reseed(model.enc, ...) or policy='match_shape': `reseed: {streams: ..., module: enc, policy: ...}`
            said = {"module": ".".join(where)} if where else {}
            said |= {"policy": policy} if policy != "scalars_only" else {}
            entry = {"streams": _Inline(seeds), **said} if said else seeds
            if synthetic is not None:  # (at the start of a step of several models, whose call has begun)
                rec.draws_before.setdefault(rec.step, []).append((None, entry))
            else:
                rec.pending.append((None, None, entry))
        return out

    def stream_fork_hook(self, *args, **kwargs):
        # self.rng = rngs.dropout.fork() in the __init__ of a module of yours (Flax's layers' own forks are their
        # layer statements' business): one event, not the draw it makes
        building = rec.building[-1] if rec.building and not rec.calling and not rec.forks else None
        if building is None or args or kwargs or type(building.this).__module__.startswith("flax."):
            return stream_fork(self, *args, **kwargs)
        rec.forks += 1
        try:
            out = stream_fork(self)
        finally:
            rec.forks -= 1
        building.events.append(("stream_fork", out, self))
        return out

    def fork_hook(self, *args, **kwargs):
        rec.forks += 1
        try:
            out = fork(self, *args, **kwargs)
        finally:
            rec.forks -= 1
        if rec.building and not rec.calling:
            rec.building[-1].events.append(("fork", out, self))
        elif not rec.building and not rec.calling and not rec.invocation:
            rec.loose_forks.append((len(rec.roots), out, self))
        return out

    def paired_hook(original):
        # nnx.grad / nnx.value_and_grad: the function may see copies of the modules it is given (merged from their
        # state), drawing keys as the originals would (the RngState written back after): each copy stands for its
        # original, so its calls and draws are the original's
        def hook(*args, **kw):
            if not rec.active:
                return original(*args, **kw)
            f = args[0] if args else kw.get("f")
            if not callable(f):
                return lambda g: hook(g, **{k: v for k, v in kw.items() if k != "f"})
            given: list = []

            @functools.wraps(f)
            def inner(*a, **k):
                for i, o in zip(a, given[-1] if given else ()):
                    _pair(rec, i, o)
                return f(*a, **k)

            made = original(inner, *args[1:], **{k: v for k, v in kw.items() if k != "f"})

            plain = original(*args, **kw)

            @functools.wraps(f)
            def outer(*a, **k):
                if not rec.active:
                    return plain(*a, **k)
                given.append(a)
                try:
                    return made(*a, **k)
                finally:
                    given.pop()

            return outer

        return hook

    def graph_split_hook(original):
        # nnx.split(node): what its graphdef was split from, so that nnx.merge(graphdef, state) is known a copy
        def hook(*args, **kw):
            out = original(*args, **kw)
            if rec.active and args and isinstance(out, tuple) and out:
                rec.split_of[id(out[0])] = (out[0], args[0])
            return out

        return hook

    def merge_hook(original):
        # nnx.merge(graphdef, state) of an nnx.split of the model (a pure jax.jit step: model = nnx.merge(graphdef,
        # state) inside, the state returned and written back with nnx.update): a copy holding the model's RNG
        # counts as they were split, so its calls and draws are the model's
        def hook(*args, **kw):
            out = original(*args, **kw)
            made = rec.split_of.get(id(args[0])) if rec.active and args else None
            if made is not None and rec.invocation > 0:
                _pair(rec, out, made[1])
                _note_copies(rec, out)
            return out

        return hook

    def view_hook(original):
        # nnx.view(model, deterministic=...) / nnx.with_attributes: new module objects sharing the model's variables
        # (its RNG counts included), so a view's calls and draws are the model's; its `deterministic` is read at
        # each call
        def hook(node, /, *args, **kw):
            out = original(node, *args, **kw)
            if rec.active:
                _pair(rec, out, node)
            return out

        return hook

    hooks: list[tuple[object, str, object, object]] = [  # (owner, name, original, hook)
        *_eager_transforms(nnx, rec),
        *(
            (nnx, n, getattr(nnx, n), paired_hook(getattr(nnx, n)))
            for n in ("grad", "value_and_grad")
            if hasattr(nnx, n)
        ),
        *(
            (nnx, n, getattr(nnx, n), view_hook(getattr(nnx, n)))
            for n in ("view", "with_attributes")
            if hasattr(nnx, n)
        ),
        (meta, "_pytree_meta_construct", construct, construct_hook),
        *(
            ((nnx, "merge", nnx.merge, merge_hook(nnx.merge)), (nnx, "split", nnx.split, graph_split_hook(nnx.split)))
            if hasattr(nnx, "merge") and hasattr(nnx, "split")
            else ()
        ),
        (nnx.RngStream, "__call__", stream_call, stream_hook),
        (nnx.Rngs, "fork", fork, fork_hook),
        (nnx.RngStream, "fork", stream_fork, stream_fork_hook),
        *(((nnx, "reseed", reseed, reseed_hook),) if reseed is not None else ()),
        (nnx, "split_rngs", split_rngs, split_hook),
        *(((nnx, "fork_rngs", fork_rngs, fork_rngs_hook),) if fork_rngs is not None else ()),
        *(
            ((rnglib, "restore_rngs", restore_rngs, restore_hook), (nnx, "restore_rngs", restore_rngs, restore_hook))
            if restore_rngs is not None and getattr(nnx, "restore_rngs", None) is restore_rngs
            else ()
        ),
        (nnx, "vmap", vmap, transform_hook("vmap", vmap)),
        (nnx, "scan", scan, transform_hook("scan", scan)),
    ]
    compat = getattr(nnx, "compat", None)
    if compat is not None and getattr(compat, "scan", None) is not None:
        # (nnx.RNN's scan over the sequence: the cell inside stands for the cell outside)
        hooks.append((compat, "scan", compat.scan, transform_hook("scan", compat.scan)))
    if get_stream is not None:
        hooks.append((nnx.Rngs, "_get_stream", get_stream, get_stream_hook))
    for mode in ("split", "broadcast"):
        if mode in vars(nnx.Rngs):  # (flax 0.12.6 / 0.12.7 and later)
            original = vars(nnx.Rngs)[mode]
            hooks.append((nnx.Rngs, mode, original, made_hook(mode, original)))
    tonnx = _tonnx()
    if tonnx is not None:
        tonnx_call = vars(tonnx)["__call__"]
        hooks.append((tonnx, "__call__", tonnx_call, tonnx_hook))
    for owner, name, _, hook in hooks:
        _patch(owner, name, hook)
    try:
        yield
    finally:
        # (the classes' __call__ first: a hooked class's is the hook itself, put back by the second loop)
        for klass, original in patched.items():
            _patch(klass, "__call__", original)
        for owner, name, original, _ in hooks:
            _patch(owner, name, original)


def _bound(f, args: tuple, kwargs: dict) -> tuple:
    """A call's arguments in the order of f's parameters (keyword arguments at their positions), as NNX's transforms
    hand them to the function they wrap; as given where f's signature does not take them so."""
    if not kwargs:
        return args
    try:
        return tuple(inspect.signature(f).bind(*args, **kwargs).arguments.values())
    except (TypeError, ValueError):
        return (*args, *kwargs.values())


def _stacks_itself(rec: NnxRecorder, b: Built, t: Transform, kind: str, nnx) -> None:
    """b's __init__ runs under nnx.vmap (split by nnx.split_rngs): b is a stack, and what its __init__ builds is
    b's own (not stacks of their own)."""
    if kind != "vmap":
        raise UnsupportedError(
            f"{b.cls.__name__}.__init__ is itself under nnx.{kind}: capture reads a module that stacks itself with "
            "@nnx.split_rngs(splits=N) and @nnx.vmap on __init__; write this part of the spec by hand (README, Flax "
            "NNX specs)"
        )
    t.depth = -1
    if t.split is not None:
        b.stack = t.split.n
        b.split_of = rec.resolve(next((x for x in t.split.node if isinstance(x, nnx.Rngs)), None))
    else:
        b.stack = -1


def _scans_itself(rec: NnxRecorder, frame: Called, t: Transform) -> None:
    """A module's __call__ under nnx.scan / nnx.vmap over the module itself (the first argument): as if its
    parent's call ran the transform over it; what the call does inside is the module's own call."""
    parent = rec.calling[-2] if len(rec.calling) > 1 else None
    if parent is None or not parent.events or parent.events[-1][1] is not frame:
        raise UnsupportedError(
            f"{type(frame.obj).__name__}.__call__ is itself under nnx.{t.kind} and called from outside every module "
            "of the model; an NNX spec says that transform as its parent's call of it: build it inside a module of "
            "yours that calls it"
        )
    if parent.events[-1][2] is not None:
        raise UnsupportedError(
            f"{type(frame.obj).__name__}.__call__ is itself under nnx.{t.kind} and called under another transform"
        )
    parent.events[-1] = ("call", frame, (t, 0, 1))
    frame.transforms += 1


class _EagerJit:
    """A jax.jit function of the user's run as plain Python while capture observes (the jitted function's own
    attributes, .lower, .trace, .eval_shape, are the jitted one's)."""

    def __init__(self, eager, made, f):
        self._eager, self._made = eager, made
        functools.update_wrapper(self, f)

    def __call__(self, *a, **k):
        return self._eager(*a, **k)

    def __getattr__(self, name):
        return getattr(self._made, name)


def _note_copies(rec: NnxRecorder, inner) -> None:
    """Note the copies of the model and of nnx.Rngs in `inner` (paired with their originals)."""
    from flax import nnx

    seen: set[int] = set()

    def visit(x, depth: int) -> None:
        if depth > 6 or id(x) in seen:
            return
        seen.add(id(x))
        outer = rec.resolve(x)
        if outer is not x and (outer is rec.model or isinstance(x, nnx.Rngs)):
            # (a new copy of it: the one before has done its drawing, written back or not)
            _check_copies(rec, outer)
            rec.merged.append((x, outer))
        if isinstance(x, (tuple, list)):
            for v in x:
                visit(v, depth + 1)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v, depth + 1)

    visit(inner, 0)


def _check_copies(rec: NnxRecorder, of: object = None) -> None:
    """Whether the copies noted (of `of` only, where given) drew keys their originals do not have the counts of
    (their state not written back): noted in rec.dropped, and the copies forgotten."""
    kept = []
    for copy, outer in rec.merged:
        if of is not None and outer is not of:
            kept.append((copy, outer))
        elif _counts(copy) != _counts(outer):
            rec.dropped.add("model" if outer is rec.model else "rngs")
    rec.merged = kept


def _rebuilt(x):
    """x rebuilt from its pytree leaves, as jax.jit hands a function its arguments (new State, Variable and module
    objects holding the same arrays)."""
    import jax

    leaves, treedef = jax.tree.flatten(x)
    return jax.tree.unflatten(treedef, leaves)


def _counts(node) -> dict:
    """The count of every RngStream in a module's graph, by path."""
    from flax import nnx

    out = {}
    if isinstance(node, nnx.Rngs):
        node = {n: v for n, v in vars(node).items() if isinstance(v, nnx.RngStream)}
    for path, v in nnx.graph.iter_graph(node):
        if isinstance(v, nnx.RngStream):
            c = v.count
            out[path] = int(c.get_value() if hasattr(c, "get_value") else c.value)
    return out


def _graph_updates(kw: dict) -> bool:
    """Whether an NNX transform called with `kw` runs in graph mode and writes the graph's updates back (the
    RngState counts included): the default, and what makes it hand out the keys eager code does. flax 0.12.7 and
    later take `graph=` and `graph_updates=` (defaults from nnx.set_graph_mode / set_graph_updates)."""
    graphlib = sys.modules.get("flax.nnx.graph")  # (imported with flax.nnx where it exists: no tree mode before)
    for name, flag in (("graph", "set_graph_mode"), ("graph_updates", "set_graph_updates")):
        value = kw.get(name)
        if value is None:
            ctx = getattr(graphlib, flag, None)
            value = ctx.current_value() if ctx is not None else True
        if not value:
            return False
    return True


def _concrete(*xs) -> bool:
    import jax

    return not any(isinstance(x, jax.core.Tracer) for x in xs)


# (the packages whose jax.jit capture leaves alone: only a function of the user's code runs as plain Python)
_LIBRARIES = frozenset(("jax", "jaxlib", "flax", "optax", "chex", "orbax", "numpy", "equinox", "haiku", "rngaudit"))


def _eager_transforms(nnx, rec: NnxRecorder) -> list[tuple[object, str, object, object]]:
    """Hooks that run nnx.jit, nnx.remat and NNX's control flow as plain Python while capture observes: they hand
    out exactly the keys eager code does (FLAX_NNX_RULES.md §11-§12: no fork, the RngState carried in and out, a
    loop's iteration i drawing count c0 + i, only the taken branch drawing), but traced once and cached, so the
    keys would be out of capture's reach (and a cached call draws without running Python). A transform that does
    not write its graph updates back (`graph_updates=False`, tree mode) or whose branch or bounds are traced (inside
    nnx.vmap or nnx.scan) runs as Flax's: its draws stay traced, and capture says it cannot follow them."""
    import jax.numpy as jnp

    def wrapper(original, at):
        # nnx.jit(f, ...) / nnx.remat(f, ...), or their decorator forms nnx.jit(static_argnums=...)(f)
        def hook(*args, **kw):
            f = args[0] if args else kw.get(at)
            if not callable(f):
                return lambda g: hook(g, **{k: v for k, v in kw.items() if k != at})
            made = original(*args, **kw)  # (Flax's own checks: a bound method is refused by nnx.jit, ...)
            if not rec.active or not _graph_updates(kw):
                return made

            @functools.wraps(f)
            def eager(*a, **k):
                if not rec.active:  # (applied at import, called after capture: Flax's own)
                    return made(*a, **k)
                return f(*a, **k)

            return eager

        return hook

    def cond(original):
        def hook(pred, true_fun, false_fun, *operands, **kw):
            if not rec.active or not (_graph_updates(kw) and _concrete(pred)):
                return original(pred, true_fun, false_fun, *operands, **kw)
            return (true_fun if bool(pred) else false_fun)(*operands)

        return hook

    def switch(original):
        def hook(index, branches, *operands, **kw):
            if not rec.active or not (_graph_updates(kw) and _concrete(index)):
                return original(index, branches, *operands, **kw)
            return branches[min(max(int(index), 0), len(branches) - 1)](*operands)  # (clamped, as lax.switch)

        return hook

    def fori_loop(original):
        def hook(lower, upper, body_fun, init_val, **kw):
            if not rec.active or not (_graph_updates(kw) and _concrete(lower, upper)):
                return original(lower, upper, body_fun, init_val, **kw)
            val = init_val
            for i in range(int(lower), int(upper)):
                val = body_fun(jnp.asarray(i, jnp.asarray(lower).dtype), val)
            return val

        return hook

    def while_loop(original):
        def hook(cond_fun, body_fun, init_val, **kw):
            if not rec.active or not _graph_updates(kw):
                return original(cond_fun, body_fun, init_val, **kw)
            go = cond_fun(init_val)
            if not _concrete(go):  # (inside nnx.vmap or nnx.scan)
                return original(cond_fun, body_fun, init_val, **kw)
            val = init_val
            while bool(go):
                val = body_fun(val)
                go = cond_fun(val)
                if not _concrete(go):
                    raise UnsupportedError(
                        "nnx.while_loop's condition became traced after its first iterations: capture cannot "
                        "follow it; write that part of the spec by hand (README, Flax NNX specs)"
                    )
            return val

        return hook

    def jax_jit(original):
        # jax.jit over a function of the user's (a pure step: nnx.merge inside, the state returned), applied at
        # import of the model's files: plain Python while capture observes, as nnx.jit (JAX's and Flax's own
        # jitted functions, and libraries', are left as they are)
        def hook(*args, **kw):
            # (applied by the user's code, not inside a library: nnx.jit(graph_updates=False) jits a wrapper of
            # the user's function, named after it, that a step must not see run eagerly)
            return jit_from(str(sys._getframe(1).f_globals.get("__name__", "")).split(".")[0], args, kw)

        def jit_from(caller: str, args: tuple, kw: dict):
            f = args[0] if args else kw.get("fun")
            if not callable(f):  # (the decorator form, jax.jit(static_argnums=...)(f))
                return lambda g: jit_from(caller, (g,), {k: v for k, v in kw.items() if k != "fun"})
            made = original(*args, **kw)
            if not rec.active or caller in _LIBRARIES:
                return made

            def eager(*a, **k):
                if not rec.active or rec.calling or rec.building:
                    # (inside the model's call or construction: jitted, its draws traced, which capture refuses)
                    return made(*a, **k)
                # (jax.jit's boundary: the function sees its arguments rebuilt from their leaves, and its caller
                # gets its results so; what it does to an nnx.split state's RNG counts stays inside unless the
                # state it returns is written back)
                a2, k2 = _rebuilt(a), {n: _rebuilt(v) for n, v in k.items()}
                for inner, outer in zip((*a2, *k2.values()), (*a, *k.values())):
                    _pair(rec, inner, outer)
                    _note_copies(rec, inner)
                return _rebuilt(f(*a2, **k2))

            return _EagerJit(eager, made, f)

        return hook

    out: list[tuple[object, str, object, object]] = []
    import jax

    out.append((jax, "jit", jax.jit, jax_jit(jax.jit)))
    for name, make in (
        ("jit", lambda o: wrapper(o, "fun")),
        ("remat", lambda o: wrapper(o, "f")),
        ("cond", cond),
        ("switch", switch),
        ("fori_loop", fori_loop),
        ("while_loop", while_loop),
    ):
        original = getattr(nnx, name, None)
        if original is not None:
            out.append((nnx, name, original, make(original)))
    return out


def _tonnx():
    """flax.nnx.bridge.ToNNX, where this Flax has it."""
    try:
        from flax.nnx import bridge
    except ImportError:
        return None
    return getattr(bridge, "ToNNX", None)


def _patch(owner: object, name: str, value: object) -> None:
    setattr(owner, name, value)


def _call_hook(rec: NnxRecorder, original):
    from flax import nnx

    rngs_class, stream_class = nnx.Rngs, nnx.RngStream

    def __call__(self, *args, **kwargs):
        outside = rec.resolve(self)
        if rec.calling and rec.calling[-1].obj is outside:  # super().__call__ of the same module
            return original(self, *args, **kwargs)
        frame = Called(outside, transforms=len(rec.transforms))
        given = kwargs.get("rngs")
        if isinstance(given, stream_class) and _is_layer(outside):
            # drop(x, rngs=rngs.dropout), attention(x, rngs=self.rngs.dropout): a draw from that stream, as from
            # the Rngs holding it given whole (Dropout: rngs[rng_collection](); attention: rngs.dropout())
            given = _holder(rec, given, outside)
        if isinstance(given, rngs_class) and _is_layer(outside):
            frame.given = rec.given(given)
        elif given is not None and type(outside).__name__ == "Dropout" and _is_layer(outside):
            # drop(x, rngs=key): used as it is; a spec can say it (`key:`) where every call gives the same key
            frame.key = True
            data = _seed(given)
            rec.given_keys.setdefault(id(outside), set()).add(None if data is None else tuple(data))
        if rec.forked and rec.forked[-1][0] is outside:
            if rec.forked[-1][3]:
                rec.fork_problems.append(
                    f"a {type(outside).__name__} is called twice under one nnx.fork_rngs (an NNX spec's `fork_rngs:` "
                    "forks at each call it marks: fork for each call)"
                )
            rec.forked[-1][3] = True
            frame.fork = rec.forked[-1][1]
        if _is_rnn(outside) or _is_bidi(outside):
            frame.rnn = _rnn_call(rec, outside, args, kwargs, bool(rec.calling) and _is_bidi(rec.calling[-1].obj))
        if not rec.calling:
            rec.top.append(outside)
            if outside is rec.model and rec.invocation:
                rec.next_step()
                if frame.fork is not None:
                    rec.root_fork[rec.step] = frame.fork  # (`call: {fork_rngs: ...}` in run:)
                if rec.transforms:
                    # the step calls the model under nnx.vmap/nnx.scan (`call: {vmap: N, split: dropout}` in run:)
                    t = rec.transforms[-1]
                    pos = next((i for i, a in enumerate(t.outer) if rec.resolve(a) is outside), None)
                    rec.root_how[rec.step] = (t, pos, len(rec.transforms))
        if _is_layer(outside) and _draws_unless_deterministic(self):
            given_mode = _as_mode(kwargs.get("deterministic"))
            mode = _as_mode(getattr(self, "deterministic", None)) if given_mode is None else given_mode
            frame.quiet = mode is True  # (model.eval(), built deterministic, or deterministic=True at the call)
            inside = rec.invocation and rec.modes and rec.calling and rec.calling[0].obj is rec.model
            seen = (mode, given_mode is not None)
            before = rec.modes[-1].setdefault(id(outside), seen) if inside else seen
            if before != seen and before[0] == mode:
                # (the same mode, given as an argument at some of its calls only: it follows the model's mode)
                rec.modes[-1][id(outside)] = (mode, False)
            elif before != seen and rec.differs is None:
                rec.differs = type(outside).__name__  # (called in both modes in one call of the model)
        elif not type(outside).__module__.startswith("flax.") and frame.rnn is None:
            frame.mode = _user_mode(self, original, args, kwargs)  # (a module of yours)
            inside = rec.invocation and rec.modes and (rec.calling[0].obj if rec.calling else outside) is rec.model
            if frame.mode is not None and inside:
                rec.user_modes.setdefault(rec.step, {}).setdefault(id(outside), set()).add(frame.mode)
        if rec.calling:
            parent = rec.calling[-1]
            how = None
            if frame.transforms > parent.transforms:
                # called by the function of a transform that the parent's call started
                t = rec.transforms[-1]
                pos = next((i for i, a in enumerate(t.outer) if rec.resolve(a) is outside), None)
                how = (t, pos, frame.transforms - parent.transforms)
            parent.events.append(("call", frame, how))
        rec.calling.append(frame)
        try:
            out = original(self, *args, **kwargs)
            if frame.sealed is not None and len(frame.events) > frame.sealed:
                raise UnsupportedError(
                    f"{type(outside).__name__}.__call__ runs nnx.scan or nnx.vmap over the module itself and then "
                    "calls or draws more; capture reads such a call as its parent's call of the module under that "
                    "transform: write this part of the spec by hand (README, Flax NNX specs)"
                )
            return out
        finally:
            rec.calling.pop()
            if not rec.calling:
                if not frame.touched and outside is not rec.model and rec.top and rec.top[-1] is outside:
                    # a module the step calls besides the model that draws no key (a DQN target network, a frozen
                    # encoder without dropout): no business of the keys, left out
                    rec.top.pop()
                _remember(rec, frame)

    return __call__


def _holder(rec: NnxRecorder, stream, layer):
    """The nnx.Rngs whose stream a Dropout's or attention layer's call is given, where that stream is the one the
    layer would take from the Rngs given whole (its rng_collection; attention's `dropout`); else why not."""
    want = str(getattr(layer, "rng_collection", "dropout"))
    stream = rec.resolve(stream)
    for rngs in rec.rngs_made:
        for name, s in rngs.items():
            if rec.resolve(s) is stream:
                if name == want:
                    return rngs
                raise UnsupportedError(
                    f"{type(layer).__name__}'s call is given the stream {name!r} of an Rngs (rngs={name}), not its "
                    f"{want!r}: an NNX spec gives a layer's call the Rngs whole (`rngs: model` or `rngs: call`); "
                    f"write {type(layer).__name__.lower()}(x, rngs=rngs) or that part of the spec by hand"
                )
    raise UnsupportedError(
        f"{type(layer).__name__}'s call is given an RngStream capture does not know the Rngs of (a copy, or one "
        "made outside the model's factory): an NNX spec gives a layer's call an Rngs whole (`rngs: model` or `rngs: "
        "call`); pass the Rngs (rngs=rngs)"
    )


def _reseeded(rec: NnxRecorder, node) -> tuple[str, ...] | str:
    """Where in the model the node a training step reseeds is (() the model itself; attribute names), or why a
    spec cannot say it (not the model nor a module of it, or inside a stack)."""
    from flax import nnx

    node = rec.resolve(node)
    found = next(
        (tuple(map(str, path)) for path, n in nnx.graph.iter_graph(rec.model) if n is node),
        None,
    )
    if found is None or not isinstance(node, nnx.Module):
        return f"nnx.reseed of a {type(node).__name__}, not of the model nor of a module of it"
    stacks = set()
    todo = list(rec.roots)
    while todo:
        b = todo.pop()
        if b.stack or b.made:
            stacks.add(id(rec.resolve(b.obj)))  # (the stack nnx.vmap returns, not the member it built)
        todo += [e[1] for e in b.events if e[0] == "child"]
    at = rec.model
    for i, name in enumerate(found[:-1]):
        at = getattr(at, name, None) if not isinstance(at, (list, tuple)) else at[int(name)]
        if id(at) in stacks:
            return (
                f"nnx.reseed of {'.'.join(found)}, inside the stack {'.'.join(found[: i + 1])} (a spec's reseed "
                "names the stack or a module above it)"
            )
    return found


def _remember(rec: NnxRecorder, frame: Called) -> None:
    """Keep what each module's call did (the first time), and note a module that does something else later."""

    def flat(f: Called) -> list:
        out: list[tuple] = []
        for kind, what, *how in f.events:
            if kind == "draw":
                out.append(("draw", what, how[0]))  # (the stream: the module's own Rngs, or a submodule's)
            elif what.rnn is not None:
                # an nnx.RNN's call: its sequence length, initial_carry, the Rngs given (under a transform: not said)
                out.append(("call", id(what.obj), ("rnn", *what.rnn) if how[0] is None else "rnn_transformed"))
            elif what.given is not None:
                # drop(x, rngs=rngs): a draw from the Rngs the call was given (under a transform: not said)
                out.append(("call", id(what.obj), "call_rngs" if how[0] is None else "call_rngs_transformed"))
            elif what.fork is not None:
                out.append(("call", id(what.obj), ("fork", what.fork, how[0])))  # (in nnx.fork_rngs(it))
            elif what.key and how[0] is None:
                out.append(("call", id(what.obj), "key"))  # (drop(x, rngs=key): its key, if one, in the spec)
            elif what.quiet and how[0] is None:
                # (deterministic: it draws nothing, so it says nothing of how its other calls draw: given an Rngs or
                # a key, or from its own stream)
                out.append(("call", id(what.obj), "quiet"))
            elif what.drew or what.quiet or not _is_layer(what.obj):
                out.append(("call", id(what.obj), how[0]))
        return out

    sig = functools.partial(_signature, rec)

    def walk(f: Called) -> None:
        if f.rnn is not None:
            # an nnx.RNN: the spec says its calls in its parent's; of its own, the keys its initialize_carry draws
            if not f.rnn[1]:
                n = sum(1 for k, *_ in f.events if k == "draw") - (f.rnn[2] is not None)
                if rec.rnn_draws.setdefault(id(f.obj), n) != n and rec.differs is None:
                    rec.differs = type(f.obj).__name__
            for kind, what, *_ in f.events:
                if kind == "call":
                    walk(what)
            return
        if f.quiet:
            return  # (a layer that draws nothing while deterministic: its draws are those of its other calls)
        now = flat(f)
        # (a module of yours whose mode is known: its calls in each mode apart, _by_mode puts them together)
        calls: dict[Any, list] = rec.calls if f.mode is None else rec.mode_calls.setdefault(id(f.obj), {})
        if f.mode is not None:
            rec.mode_names[id(f.obj)] = type(f.obj).__name__
        at = id(f.obj) if f.mode is None else f.mode
        seen = calls.setdefault(at, now)
        both = _merged(seen, now, sig)
        if both is None and rec.differs is None:
            rec.differs = type(f.obj).__name__
        elif both is not None:
            calls[at] = both
        for kind, what, *_ in f.events:
            if kind == "call":
                walk(what)

    walk(frame)


def _signature(rec: NnxRecorder, x: list) -> list:
    """What of a call's statements (_remember's flat) must agree from call to call."""
    return [
        (
            k,
            w,
            # (a draw: which kept Rngs it is from, the module's or a submodule's; not the stream itself, which
            # an Rngs made for each step renews)
            rec.kept_streams.get(h, (None,))[0]
            if k == "draw"
            else h
            if h is None or isinstance(h, str) or h[0] == "rnn"
            else ("fork", h[1], _how_signature(h[2]))
            if h[0] == "fork"
            else _how_signature(h),
        )
        for k, w, h in x
    ]


def _how_signature(how) -> tuple | None:
    """A call's transform (t, the module's place among its arguments, depth) as compared from call to call."""
    return None if how is None else (how[0].kind, how[1], how[2])


# a __call__'s signature, read once per function (_user_mode runs at every call of every module of yours)
_parameters = functools.lru_cache(maxsize=None)(inspect.signature)


def _user_mode(obj, original, args: tuple, kwargs: dict) -> bool | None:
    """Whether a module of yours is deterministic at this call: its `deterministic` argument (or not its `train` /
    `training` / `is_training` one), as given or by default, else its `deterministic` attribute (which
    model.train()/eval() set); None where none is a concrete bool."""
    try:
        bound = _parameters(original).bind(obj, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
    except (TypeError, ValueError):
        given = {}
    for name, flip in (("deterministic", False), ("train", True), ("training", True), ("is_training", True)):
        v = _as_mode(given.get(name))
        if isinstance(v, bool):
            return not v if flip else v
    v = _as_mode(getattr(obj, "deterministic", None))
    return v if isinstance(v, bool) else None


def _aligned(rec: NnxRecorder, train: list, eval_: list) -> list | None:
    """A module's calls in train mode and in eval mode as one (the longest run of statements both did, in order; a
    draw or call only one mode made is `draw:train` / `call:eval`...); None where they differ otherwise (a
    submodule called under a transform in one mode only)."""

    sig = functools.partial(_signature, rec)

    def one(a, b):
        return _merged([a], [b], sig)

    n, m = len(train), len(eval_)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = best[i + 1][j + 1] + 1 if one(train[i], eval_[j]) else max(best[i + 1][j], best[i][j + 1])
    out: list = []
    i = j = 0
    while i < n or j < m:
        both = one(train[i], eval_[j]) if i < n and j < m else None
        if both is not None and best[i][j] == best[i + 1][j + 1] + 1:
            out += both
            i, j = i + 1, j + 1
        elif i < n and (j == m or best[i + 1][j] >= best[i][j + 1]):
            if train[i][0] != "draw" and train[i][2] not in (None, "quiet"):
                return None
            out.append((f"{train[i][0]}:train", *train[i][1:]))
            i += 1
        else:
            if eval_[j][0] != "draw" and eval_[j][2] not in (None, "quiet"):
                return None
            out.append((f"{eval_[j][0]}:eval", *eval_[j][1:]))
            j += 1
    return out


def _by_mode(rec: NnxRecorder) -> None:
    """Put together the calls of each module of yours whose mode is known at its calls: one list where every call did
    the same; where calls in train mode draw what calls in eval mode do not (or the other way), the draws one mode
    makes are said so (`when:`), and the module's mode at each call of the model joins the Dropouts' (`run:`'s
    train/eval events; drawing in train mode as built)."""

    sig = functools.partial(_signature, rec)
    for i, by in rec.mode_calls.items():
        lists = list(by.values()) + ([rec.calls[i]] if i in rec.calls else [])
        merged: list | None = lists[0]
        for other in lists[1:]:
            merged = _merged(merged, other, sig) if merged is not None else None
        if merged is not None:
            rec.calls[i] = merged
            continue
        tagged = _aligned(rec, by[False], by[True]) if i not in rec.calls and len(by) == 2 else None
        steps = [rec.user_modes.get(n, {}).get(i, set()) for n in range(1, len(rec.modes) + 1)]
        if tagged is None or any(len(modes) > 1 for modes in steps):
            # (more than draws differ, or one call of the model called it in both modes)
            rec.differs = rec.differs or rec.mode_names[i]
            continue
        rec.calls[i] = tagged
        rec.built_modes[i] = False
        for now, modes in zip(rec.modes, steps):
            if modes:
                now[i] = (next(iter(modes)), False)


def _draw_runs(signature: list) -> list:
    """A call's statements with each run of consecutive draws as a sorted run (the order of draws between two calls
    does not change their keys)."""
    out: list = []
    run: list = []
    for x in [*signature, None]:
        if x is not None and x[0] == "draw":
            run.append(repr(x))
            continue
        out += sorted(run)
        run = []
        if x is not None:
            out.append(repr(x))
    return out


def _merged(seen: list, now: list, sig) -> list | None:
    """What two calls of a module did, as one (a deterministic call of a layer, which draws nothing, agrees with any
    other call of it: model.eval() calls given no Rngs beside training calls given one); None where they differ."""
    if len(seen) != len(now):
        return None
    before, after = sig(seen), sig(now)
    if before != after and _draw_runs(before) == _draw_runs(after):
        # (the same draws in another order between the same calls: each stream counts on its own, so the keys are
        # the same; a bridge.ToNNX under nnx.grad draws its streams from a copy of its Rngs, in sorted order)
        return seen
    out = []
    for a, b, sa, sb in zip(seen, now, before, after):
        if sa == sb or (a[:2] == b[:2] and b[2] == "quiet"):
            out.append(a)
        elif a[:2] == b[:2] and a[2] == "quiet":
            out.append(b)
        else:
            return None
    return out


def _pair(rec: NnxRecorder, inner, outer) -> None:
    """Note that `inner` (an object a transform's function sees, or returns) stands for `outer`, and so do
    the modules and Rngs inside them, attribute by attribute."""
    from flax import nnx

    lists, dicts = _containers()

    def visit(i: Any, o: Any, depth: int) -> None:
        if i is o or depth > 12 or o is None:
            return
        if isinstance(i, (nnx.Module, nnx.Rngs, nnx.RngStream)):
            # (a stream too: a step's model.rngs.noise() under nnx.value_and_grad draws from the copy's)
            rec.alias[id(i)] = rec.resolve(o)
            rec.inner.append(i)
            for name, v in vars(i).items():
                if not name.startswith("_") and isinstance(
                    v, (nnx.Module, nnx.Rngs, nnx.RngStream, *lists, *dicts, list, tuple)
                ):
                    visit(v, getattr(o, name, None), depth + 1)
        seq: tuple[type, ...] = (list, tuple, *lists)
        if isinstance(i, seq) and isinstance(o, seq):
            ii: Any = i
            oo: Any = o
            for a, b in zip(ii, oo):
                visit(a, b, depth + 1)

    visit(inner, outer, 0)


def _draws_unless_deterministic(obj) -> bool:
    """A Dropout with 0 < rate < 1, or attention with dropout: its call draws a key unless it is deterministic."""
    from flax import nnx

    if isinstance(obj, nnx.Dropout):
        return 0 < obj.rate < 1
    return isinstance(obj, nnx.MultiHeadAttention) and obj.dropout_rate > 0


def _as_mode(v):
    """A `deterministic` as a bool where it is one (np.bool_, a concrete array: `deterministic=~train`); None, or a
    traced value, as it is."""
    if v is None or isinstance(v, bool):
        return v
    try:
        return bool(v)
    except Exception:  # noqa: BLE001 (traced: a jitted call's argument)
        return v


def _run_events(rec: NnxRecorder, target: CodeRef, fields: dict[int, dict]) -> list | None:
    """The calls of the model (each under the transform or fork `fields` gives it, if any: `{vmap: 4, split:
    [dropout]}`) and the model.train()/model.eval() between them (`run:`), from whether its Dropout
    and attention layers were deterministic at each call (as built, then as model.train()/eval() or a view set
    them, or as the call's `deterministic=` said: the keys are the same); None when that never changes (`steps:`
    says the calls). A layer every call gives the same `deterministic=` keeps it (its spec option says it, or its
    calls beside train/eval events); failing that, so does a layer in one mode at every call however it was set
    (a teacher model in eval mode while its student trains)."""
    seen: dict[int, set] = {}
    for now in rec.modes:
        for i, mode in now.items():
            seen.setdefault(i, set()).add(mode)
    constant = {i: next(iter(modes)) for i, modes in seen.items() if len(modes) == 1}
    fixed = {i: v for i, (v, given) in constant.items() if given and isinstance(v, bool)}
    # (failing that, a layer in one mode at every call, however it was set: a teacher model set to eval mode in a
    # step that trains its student, a layer built deterministic whose model.train() was never called)
    broader = {i: v for i, (v, _) in constant.items() if isinstance(v, bool)}
    try:
        return _events(rec, target, fixed, fields)
    except UnsupportedError:
        if broader == fixed:
            raise
        return _events(rec, target, broader, fields)


def _events(rec: NnxRecorder, target: CodeRef, fixed: dict[int, bool], fields: dict[int, dict]) -> list | None:
    """`run:` with the layers `fixed` says are in one mode at every call left out of the train/eval events (they
    say their mode themselves)."""
    state = {i: bool(v) for i, v in rec.built_modes.items()}  # (what the spec's layers say, then its events)
    run: list = []
    for n, now in enumerate(rec.modes, 1):
        modes = {i: mode for i, (mode, _) in now.items() if i not in fixed}
        for i, v in modes.items():
            state.setdefault(i, v)  # (a layer not in the model's graph as built: its spec says how it was called)
        if any(state[i] != v for i, v in modes.items()):
            values = set(modes.values())
            if len(values) != 1 or not isinstance(next(iter(values)), bool):
                names = _attribute_names(rec.model)
                mixed = sorted(
                    names.get(i) or (f"a {rec.mode_names[i]}" if i in rec.mode_names else "a layer the model holds")
                    for i, v in modes.items()
                    if v is not True
                )
                raise UnsupportedError(
                    f"capture of {target.text}: at call {n} of the model some of its Dropout/attention layers (or "
                    f"modules of yours drawing in one mode: `when:`) are deterministic and others "
                    f"({', '.join(mixed[:3])}) are not, and not as they were at the call before; an NNX spec says "
                    "model.eval() and model.train() (every layer and every module with a `deterministic` "
                    "attribute): use them, or the same `deterministic=` for every layer a call of the model calls"
                )
            (value,) = values
            run.append("eval" if value else "train")
            state = dict.fromkeys(state, value)
        _add_call(run, fields.get(n))
    if not any(e in ("train", "eval") for e in run):
        rec.built_modes.update(fixed)  # (the spec's layer says `deterministic:` as every call gave it)
        return run if fields else None
    # beside model.train()/eval(), a layer every call gives the same `deterministic=` says it at its calls (the
    # call's argument wins over what the events set)
    rec.pinned = fixed
    return run


def _own_fork(b: Built, obj) -> object | None:
    """The Rngs a module of yours forks from the one it is given as the first thing its __init__ does and keeps
    (self.rngs = rngs.fork(), as timm-style DropPath ports write it), where it uses no other: None if not so (a
    stack, a fork given to a child, a fork of some streams only or split; the model itself is not asked)."""
    if b.stack or b.made or not b.events or b.events[0][0] != "fork":
        return None
    own = b.events[0][1]
    if b.events[0][2] is not b.rngs or not any(v is own for v in vars(obj).values()):
        return None
    if any(e[0] == "fork" for e in b.events[1:]) or any(e[0] == "child" and e[1].rngs is b.rngs for e in b.events[1:]):
        return None  # (it gives its callers' Rngs to a child, or forks again: not one `rngs: fork`)
    streams = [v for v in vars(b.rngs).values() if type(v).__name__ == "RngStream"]
    forked = [v for v in vars(own).values() if type(v).__name__ == "RngStream"]
    if sorted(v.tag for v in streams) != sorted(v.tag for v in forked):
        return None  # (rngs.fork() of some streams only)
    try:
        if any(getattr(v.key[...], "shape", ()) != () for v in forked):
            return None  # (rngs.fork(split=N): lanes)
    except Exception:  # noqa: BLE001 (a key capture cannot read: not said)
        return None
    return own


def _kept_streams(rec: NnxRecorder, root: Built) -> dict[int, tuple[str, str]]:
    """id(stream) -> (the module keeping it: "" for the model, else its attribute path; its name) for the Rngs that
    the model and the modules of yours in it keep as built (self.rngs = rngs), the shallowest keeper first: a training
    step may draw from them (model.rngs.noise(), model.enc.rngs.noise()). Not through stacks, nor Flax's layers."""
    from flax import nnx

    out: dict[int, tuple[str, str]] = {}
    level = [("", root)]
    while level:
        below = []
        for path, b in level:
            obj = rec.resolve(b.obj)
            kept = b.rngs if b.rngs is not None and any(v is b.rngs for v in vars(obj).values()) else None
            if kept is None and b is not root:
                kept = _own_fork(b, obj)  # (self.rngs = rngs.fork(), first thing: `rngs: fork` + `keep_rngs`)
            if kept is not None:
                for name, s in vars(kept).items():
                    if isinstance(s, nnx.RngStream):
                        out.setdefault(id(s), (path, name))
            for e in b.events:  # (a stream it keeps by `fork:`, self.rng = rngs.dropout.fork(): `from: enc.rng`)
                attr = next((k for k, v in vars(obj).items() if e[0] == "stream_fork" and v is e[1]), None)
                if attr is not None:
                    out.setdefault(id(e[1]), (f"{path}.{attr}" if path else attr, e[1].tag))
            names = _attribute_names(obj)
            for e in b.events:
                child = rec.resolve(e[1].obj) if e[0] == "child" else None
                if child is None or e[1].stack or type(child).__module__.startswith("flax."):
                    continue
                attr = names.get(id(child))
                if attr is not None:
                    below.append((f"{path}.{attr}" if path else attr, e[1]))
        level = below
    return out


def _add_call(run: list, fields: dict | None = None) -> None:
    """One more call of the model at the end of `run:` (consecutive calls are one `{call: N}`); `fields`: the
    transform the step calls it under (`{vmap: 4, split: [dropout]}`: consecutive ones `{n: 2, vmap: 4, ...}`)."""
    last = run[-1] if run else None
    if fields:
        if isinstance(last, dict) and isinstance(last.get("call"), dict) and _call_fields(last) == fields:
            last["call"] = {"n": last["call"].get("n", 1) + 1, **fields}
        else:
            run.append({"call": dict(fields)})
    elif isinstance(last, dict) and isinstance(last.get("call"), int):
        last["call"] += 1
    elif last == "call":
        run[-1] = {"call": 2}
    else:
        run.append("call")


def _call_fields(event) -> dict | None:
    """The transform fields of a `run:` call event (None for a plain `call` / `{call: N}`)."""
    if isinstance(event, dict) and isinstance(event.get("call"), dict):
        return {k: v for k, v in event["call"].items() if k != "n"}
    return None


def _with_draws(run: list | None, rec: NnxRecorder) -> list | None:
    """`run:` with the draws a training step made from the Rngs the model (or a module of it) keeps, outside the
    model's calls (`draw: noise` before the call they lead into; after the last call, at the end; `from: enc` where
    enc keeps it)."""
    after = [(keeper, tag) for _, keeper, tag in rec.pending]
    if not rec.draws_before and not after:
        return run
    flat: list = []
    for e in run if run is not None else [{"call": len(rec.modes)}]:
        if e == "call" or (isinstance(e, dict) and "call" in e):
            made = e["call"] if isinstance(e, dict) else 1
            flat += [("call", _call_fields(e))] * (made if isinstance(made, int) else made.get("n", 1))
        else:
            flat.append(e)
    out: list = []

    def draws(tags: list[tuple[str | None, Any]]) -> None:
        for keeper, tag in tags:
            if keeper is None:  # (nnx.reseed(model, **seeds); of a module of it, with `streams:`)
                out.append({"reseed": tag if isinstance(tag.get("streams"), _Inline) else _Inline(tag)})
                continue
            last = out[-1].get("draw", {}) if out and isinstance(out[-1], dict) else {}
            if last.get("stream") == tag and last.get("from", "") == keeper:
                last["repeat"] += 1
            else:
                out.append({"draw": {"stream": tag, "repeat": 1, **({"from": keeper} if keeper else {})}})

    n = 0
    for e in flat:
        if isinstance(e, tuple):
            n += 1
            draws(rec.draws_before.get(n, []))
            _add_call(out, e[1])
        else:
            out.append(e)
    draws(after)
    return [_draw_event(e["draw"]) if isinstance(e, dict) and "draw" in e else e for e in out]


def _draw_event(d: dict) -> dict:
    """A `draw` event of `run:` as written: `draw: noise` where it says only its stream, else on one line
    (`draw: {stream: noise, repeat: 2, from: enc}`, repeat left out when 1)."""
    if d["repeat"] == 1 and "from" not in d:
        return {"draw": d["stream"]}
    return {"draw": _Inline({k: v for k, v in d.items() if k != "repeat" or v > 1})}


def _is_layer(obj) -> bool:
    return type(obj).__module__.startswith("flax.nnx") and type(obj).__name__ in LAYER_OPTIONS


def _is_lora(obj) -> bool:
    return type(obj).__module__.startswith("flax.nnx") and type(obj).__name__ == "LoRA"


def _is_rnn(obj) -> bool:
    return type(obj).__module__.startswith("flax.nnx") and type(obj).__name__ == "RNN"


def _is_bidi(obj) -> bool:
    return type(obj).__module__.startswith("flax.nnx") and type(obj).__name__ == "Bidirectional"


def _rnn_call(rec: NnxRecorder, rnn, args: tuple, kwargs: dict, in_bidi: bool) -> tuple:
    """An nnx.RNN (or nnx.Bidirectional) call's (sequence length, initial_carry given, the Rngs given or None), as
    RNN.__call__ reads its arguments (the time axis: 0 when time major, else the one before the cell's feature
    axes). Inside an nnx.Bidirectional's call, the stream it is given is Bidirectional's (said by its call)."""
    from flax import nnx

    cell = rnn.forward_rnn.cell if _is_bidi(rnn) else rnn.cell
    inputs = args[0] if args else kwargs.get("inputs")
    major = kwargs.get("time_major")
    major = rnn.time_major if major is None else major
    shape = getattr(inputs, "shape", None)
    if shape is None:
        raise UnsupportedError(
            "an nnx.RNN is called with inputs that are not one array (a pytree of sequences); write its `length:` "
            "by hand (README, Flax NNX specs)"
        )
    axis = 0 if major else len(shape) - (cell.num_feature_axes + 1)
    given = kwargs.get("rngs")
    if in_bidi:
        given = None
    elif given is not None and not isinstance(given, nnx.Rngs):
        raise UnsupportedError(
            "an nnx.RNN is called with rngs= an RngStream or a key; capture reads an nnx.Rngs given there (rngs.carry."
            "fork()), or none"
        )
    if given is not None:
        given = rec.given(given)
    return int(shape[axis]), kwargs.get("initial_carry") is not None, given


# ---------------------------------------------------------------- the spec
def _layer_options(obj, built_modes: dict[int, object]) -> dict:
    kind = type(obj).__name__
    out: dict = {}
    for opt, default in LAYER_OPTIONS[kind].items():
        value: object
        if opt == "deterministic" and id(obj) in built_modes:
            value = bool(built_modes[id(obj)])  # (as built: model.eval()/train() later are `run:` events)
        elif opt == "keep_rngs" and kind in CELLS:
            value = getattr(obj, "rngs", None) is not None  # (rngs.carry.fork(), kept for initialize_carry)
        elif opt == "keep_rngs":
            value = getattr(obj, "rngs", None) is not None or not getattr(obj, "dropout_rate", 0)
        elif opt == "rng_collection":
            value = getattr(obj, "rng_collection", "dropout")
        else:
            value = getattr(obj, opt, default)
        if opt in ("rate", "dropout_rate"):
            value = float(value)  # type: ignore[arg-type]
        elif isinstance(default, bool):
            value = bool(value)
        if value != default or default is None:
            out[opt] = value
    return out


def _containers() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from flax import nnx

    return tuple(t for t in (getattr(nnx, "List", None),) if t), tuple(t for t in (getattr(nnx, "Dict", None),) if t)


def _text_ordered_numbers(obj) -> str | None:
    """The attribute path of a dict (nnx.Dict or a plain one) the object holds whose keys are numbers as text that
    sort otherwise as text than as numbers ('10' < '2'): a spec names its items as a list's (`d.10`), which graph
    order walks by index. None if there is none."""
    _, dicts = _containers()
    for path, value, depth in _held(obj):
        if depth <= 3 and isinstance(value, (dict, *dicts)):
            held: Any = value
            keys = [k for k in held if isinstance(k, str) and k.isdigit()]
            if sorted(keys) != sorted(keys, key=int):
                return path
    return None


def _transparent(obj) -> bool:
    """Flax's containers of modules built elsewhere (nnx.Sequential, nnx.List, nnx.Dict): a spec names what they
    hold through them (`head.layers.0`) and calls what their call calls."""
    from flax import nnx

    lists, dicts = _containers()
    return isinstance(obj, (*lists, *dicts, *(t for t in (getattr(nnx, "Sequential", None),) if t)))


def _hollow(b: Built) -> bool:
    """A container built empty-handed: nothing drawn, nothing built but other such containers."""
    return _transparent(b.obj) and all(e[0] == "child" and _hollow(e[1]) for e in b.events)


def _held(obj) -> Iterator[tuple[str, Any, int]]:
    """(attribute path, value, depth) of everything an object holds, depth first: its attributes, and through
    lists, dicts and Flax's containers what they hold (`blocks.0`, `heads.a`), four levels down."""
    lists, dicts = _containers()
    lists, dicts = (list, tuple, *lists), (dict, *dicts)

    def visit(value: Any, path: str, depth: int) -> Iterator[tuple[str, Any, int]]:
        yield path, value, depth
        if depth > 3:
            return
        held: Any = value
        if _transparent(value) and not isinstance(value, (lists, dicts)):
            for name, v in vars(value).items():
                if not name.startswith("_"):
                    yield from visit(v, f"{path}.{name}", depth + 1)
        elif isinstance(value, lists):
            for i, v in enumerate(held):
                yield from visit(v, f"{path}.{i}", depth + 1)
        elif isinstance(value, dicts):
            for k, v in held.items():
                yield from visit(v, f"{path}.{k}", depth + 1)

    for name, value in vars(obj).items():
        if not name.startswith("_"):
            yield from visit(value, name, 0)


def _attribute_names(obj) -> dict[int, str]:
    """id(value) -> attribute path of every module and Rngs an object holds (lists and dicts inside too)."""
    names: dict[int, str] = {}
    for path, value, _ in _held(obj):
        if not isinstance(value, (str, bytes, int, float, bool)) and value is not None:
            names.setdefault(id(value), path)
    return names


class _SpecBuilder:
    def __init__(self, rec: NnxRecorder, target: str, root: Built):
        self.rec = rec
        self.target = target
        # what a Dropout's call given an Rngs is given (_call_rngs allows one Rngs): the model's own, or call_rngs
        self.given_rngs = "model" if any(r is root.rngs for r in rec.call_rngs.values()) else "call"
        self.root_rngs = root.rngs
        self.root = root
        self.built_of: dict[int, Built] = {}  # id(module, outside any transform) -> its construction
        self.attrs_of: dict[int, dict[int, str]] = {}  # id(module written) -> id(what it built) -> attribute
        self.plain: set[int] = set()  # the submodules written as `module` (not a stack): a dotted call reaches in
        self.kept: dict[int, set[int]] = {}  # id(module written with keep_rngs) -> ids of the streams it keeps
        # id(module written) -> id(a stream it keeps by `fork:`) -> its attribute
        self.stream_forks: dict[int, dict[int, str]] = {}
        todo = [root]
        while todo:
            b = todo.pop()
            self.built_of[id(rec.resolve(b.obj))] = b
            todo += [e[1] for e in b.events if e[0] == "child"]

    def inlined(self, statements: list, built: dict[int, str], depth: int = 0) -> list:
        """A call's statements, with a call of a container (nnx.Sequential) replaced by what it called."""
        out = []
        for kind, what, how in statements:
            inner = self.built_of.get(what) if kind == "call" else None
            if inner is not None and what not in built and _transparent(self.rec.resolve(inner.obj)) and depth < 8:
                if how is not None:
                    raise self.unsupported(f"a {type(inner.obj).__name__} is called under a transform")
                out += self.inlined(self.rec.calls.get(what, []), built, depth + 1)
            else:
                out.append((kind, what, how))
        return out

    def dotted(self, built: dict[int, str], what: int) -> str | None:
        """The dotted name (`enc.drop`, `enc.blocks.0.drop`) of module `what` inside the plain submodules of a
        module whose attributes are `built`, or None."""
        for cid, cname in built.items():
            sub = self.attrs_of.get(cid) if cid in self.plain else None
            if sub is None:
                continue
            inner = sub.get(what) or self.dotted(sub, what)
            if inner is not None:
                return f"{cname}.{inner}"
        return None

    def keeper(self, built: dict[int, str], stream: int) -> str | None:
        """The dotted name (`enc`, `enc.block`) of the plain submodule, of a module whose attributes are `built`,
        that keeps the Rngs holding `stream` (what a call's self.enc.rngs.noise() draws from), or None."""
        for cid, cname in built.items():
            if cid not in self.plain:
                continue
            if stream in self.kept.get(cid, ()):
                return cname
            if stream in self.stream_forks.get(cid, {}):
                return f"{cname}.{self.stream_forks[cid][stream]}"
            inner = self.keeper(self.attrs_of.get(cid, {}), stream)
            if inner is not None:
                return f"{cname}.{inner}"
        return None

    def takes_rngs(self, target_id: int) -> bool:
        """Whether it is a layer a spec gives an Rngs at its call (`rngs: call`): Dropout, attention."""
        b = self.built_of.get(target_id)
        return b is not None and type(b.obj).__name__ in ("Dropout", "MultiHeadAttention")

    def transform(self, how, target_id: int, where: str) -> dict:
        return _transform_of(self, how, target_id, where)

    def bridge(self, obj, where: str) -> dict:
        """A bridge.ToNNX statement: its Linen module read by Linen capture from its init (under bridge.lazy_init)
        with the keys that call gave Linen, and checked (init, and the first apply) as Linen capture checks a spec."""
        calls = self.rec.bridges.get(id(self.rec.resolve(obj)), [])
        if any(c.extra for c in calls):
            raise self.unsupported(f"{where} (bridge.ToNNX) is called with rngs=, method= or mutable=")
        if any(c.keys is None for c in calls):
            raise self.unsupported(f"{where} (bridge.ToNNX) draws its keys under a transform or from no Rngs")
        inits = [c for c in calls if c.init]
        if not inits or inits[0] is not calls[0] or inits[0].step != 0 or len(inits) > 1:
            raise self.unsupported(
                f"{where} (bridge.ToNNX) is not initialised once, by bridge.lazy_init before the model's first call"
            )
        first = inits[0]
        applies = [c for c in calls if not c.init]
        if any(_static(c) != _static(applies[0]) for c in applies):
            # (each call's Linen keys are replayed from the first apply's statements: they must do the same)
            raise self.unsupported(
                f"{where} (bridge.ToNNX) is called with different arguments from call to call (e.g. train=...), so "
                "its Linen module may draw differently each time; an NNX spec has one Linen module per ToNNX"
            )
        model = _linen_module(obj.to_nnx__module, first, applies[0] if applies else None, f"{self.target} ({where})")
        return {"name": where.split(".", 1)[1], "module": model, **({"lazy_init": False} if first.whole else {})}

    def rnn(self, b: Built, cells: dict, parent: Built, forks: list, where: str, name: str) -> dict:
        """An nnx.RNN statement: its cell (built just before it, from the parent's Rngs or a fork of them), what it
        keeps for initialize_carry (its own RngStream(0), rngs.carry.fork() or nothing), broadcast_rngs, and how
        many keys the cell's initialize_carry draws (read from its calls)."""
        from flax import nnx

        obj = self.rec.resolve(b.obj)
        cell_obj = self.rec.resolve(obj.cell)
        cell_b = cells.get(id(cell_obj))
        if cell_b is None:
            raise self.unsupported(
                f"{where} (nnx.RNN) is given a cell built elsewhere (capture reads nnx.RNN(Cell(..., rngs=rngs)), the "
                "cell built for it in the same __init__)"
            )
        sa = obj.state_axes
        if not (isinstance(sa, nnx.StateAxes) and list(sa.filters) == [...] and list(sa.axes) == [nnx.Carry]):
            raise self.unsupported(
                f"{where} (nnx.RNN) is given state_axes (capture reads the default, every state carried)"
            )
        broadcast: tuple[str, ...] | None = ()
        if obj.broadcast_rngs is not None:
            broadcast = _tags(obj.broadcast_rngs)
            if broadcast is None:
                raise self.unsupported(f"{where} (nnx.RNN) is given a broadcast_rngs filter other than stream tags")
        out: dict = {"name": name}
        kind = type(cell_obj).__name__
        standard = _is_layer(cell_obj) and kind in CELLS
        if standard:
            if cell_b.rngs is not parent.rngs:
                raise self.unsupported(f"{where}.cell ({kind}) is given another Rngs than its parent's")
            options = _layer_options(cell_obj, self.rec.built_modes)
            out["cell"] = {kind: options} if options else kind
        else:
            mode = "shared"
            if cell_b.rngs is not parent.rngs:
                if cell_b.rngs is None or not any(f is cell_b.rngs for f in forks):
                    raise self.unsupported(
                        f"{where}.cell ({kind}) is given an Rngs that is neither its parent's nor its rngs.fork()"
                    )
                mode = "fork"
                forks[:] = [f for f in forks if f is not cell_b.rngs]
            out["cell"] = {"module": {**({"rngs": "fork"} if mode == "fork" else {}), **self.module(cell_b)}}
        out.update(self.own_rngs(b, obj, parent, f"{where} (nnx.RNN)"))
        if broadcast:
            out["broadcast"] = list(broadcast)
        # the keys its cell's initialize_carry drew in a call (none given initial_carry=)
        draws = self.rec.rnn_draws.get(id(obj))
        if draws is not None:
            if standard and draws != CARRY_DRAWS[kind]:
                raise self.unsupported(
                    f"{where} (nnx.RNN) draws {draws} keys for its carry, and a {kind}'s initialize_carry draws "
                    f"{CARRY_DRAWS[kind]} (a subclass of the cell?)"
                )
            if not standard and draws:
                out["carry_draws"] = draws
        if (standard and getattr(cell_obj, "carry_init", None) is not None) or (not standard and draws):
            out["carry_init"] = "random"  # (a user cell's initialize_carry is taken to use the keys it draws)
        return out

    def replaced(self, b: Built, obj) -> str:
        """Why a module built in __init__ is no attribute now, where it reads so: an attribute holding a module
        that __init__ did not build (the factory wrapped a layer after building the model, `model.q =
        nnx.LoRA(..., base_module=model.q, rngs=rngs)`), or "" where none does."""
        from flax import nnx

        made = {id(self.rec.resolve(e[1].obj)) for e in b.events if e[0] == "child"}
        for attr, value in vars(obj).items():
            if isinstance(value, nnx.Module) and id(self.rec.resolve(value)) not in made:
                cls = type(obj).__name__
                return (
                    f": {cls}.{attr} holds a {type(value).__name__} that {cls}.__init__ did not build (made outside "
                    "it: the factory replaced or wrapped a layer, or passed a module in); an NNX spec builds the "
                    "model in __init__: build it there, or capture the model as __init__ builds it"
                )
        return ""

    def lora_base(self, parent: Built, lora: Built, at: int, bases: dict, where: str):
        """nnx.LoRA's base_module, as a spec's `base_module:`: a standard layer that draws nothing when called,
        built from the parent's Rngs just before the LoRA (its argument: `nnx.LoRA(..., base_module=nnx.Linear(...,
        rngs=rngs), rngs=rngs)`)."""
        from ..spec.nnx import LORA_BASES

        base = self.rec.resolve(getattr(lora.obj, "base_module", None))
        kind = type(base).__name__
        if not (_is_layer(base) and kind in LORA_BASES):
            raise self.unsupported(
                f"{where} (nnx.LoRA) wraps a {kind}; an NNX spec's base_module is a standard layer that draws nothing "
                f"when called ({', '.join(LORA_BASES)})"
            )
        i = bases.get(id(base))
        if i is None or i != at - 1:
            raise self.unsupported(
                f"{where} (nnx.LoRA) is given a base_module built elsewhere, or not just before it (capture reads "
                "nnx.LoRA(..., base_module=Layer(..., rngs=rngs), rngs=rngs), the layer built for it)"
            )
        base_b = parent.events[i][1]
        if base_b.rngs is not parent.rngs or lora.rngs is not parent.rngs:
            raise self.unsupported(f"{where} (nnx.LoRA) or its base_module is given another Rngs than its parent's")
        options = _layer_options(base, self.rec.built_modes)
        return {kind: options} if options else kind

    def own_rngs(self, b: Built, obj, parent: Built, where: str) -> dict:
        """What an nnx.RNN or nnx.Bidirectional keeps for the carry, as a spec's `rngs:` (nothing for `own`)."""
        if obj.rngs is None:
            if b.events:
                raise self.unsupported(f"{where} draws at construction without rngs")
            return {"rngs": "none"}
        if b.rngs is not None:
            if b.rngs is not parent.rngs or [e[0] for e in b.events] != ["draw"]:
                raise self.unsupported(f"{where} is given another Rngs than its parent's")
            return {"rngs": "fork"}
        if b.events:
            raise self.unsupported(f"{where} draws at construction from an Rngs capture did not see given")
        return {}

    def unsupported(self, what: str) -> UnsupportedError:
        return UnsupportedError(
            f"capture of {self.target}: {what}; an NNX spec cannot say this yet, so no spec was written"
        )

    def module(self, b: Built) -> dict:
        obj = self.rec.resolve(b.obj)
        cls = type(obj).__name__
        names = _attribute_names(obj)
        numbered = _text_ordered_numbers(obj)
        if numbered is not None:
            raise self.unsupported(
                f"{cls}.{numbered} is a dict keyed by numbers ('2', '10'), which NNX walks as text ('10' before "
                f"'2'), and a spec's `{numbered}.10` names the item of a list, walked by its index: key it by names "
                "that are not numbers, or write that part of the spec by hand"
            )
        out: dict = {"class": cls}
        own = _own_fork(b, obj) if b is not self.root else None
        if own is not None:
            # (self.rngs = rngs.fork() first thing in __init__: what `rngs: fork` says, the fork made by its caller)
            out["rngs"] = "fork"
            b = Built(b.cls, own, b.events[1:], b.obj, this=b.this)
        kept = [n for n, v in vars(obj).items() if b.rngs is not None and v is b.rngs]
        if kept:
            out["keep_rngs"] = True
            self.kept[id(obj)] = {id(s) for s in vars(b.rngs).values() if type(s).__name__ == "RngStream"}
        init: list = []
        built: dict[int, str] = {}
        forks: list = []
        # the cells of the nnx.RNNs built here (built first, as their argument): written inside their RNN
        cells: dict[int, Built | None] = {
            id(self.rec.resolve(e[1].obj.cell)): None for e in b.events if e[0] == "child" and _is_rnn(e[1].obj)
        }
        # the RNNs of the nnx.Bidirectionals built here (built first too): written inside their Bidirectional
        rnns: dict[int, Built | None] = {
            id(self.rec.resolve(getattr(e[1].obj, side))): None
            for e in b.events
            if e[0] == "child" and _is_bidi(e[1].obj)
            for side in ("forward_rnn", "backward_rnn")
        }
        # the layers given to the nnx.LoRAs built here as base_module (built first too): written inside their LoRA;
        # each one's event index once met
        bases: dict[int, int | None] = {
            id(self.rec.resolve(e[1].obj.base_module)): None
            for e in b.events
            if e[0] == "child" and _is_lora(e[1].obj) and e[1].obj.base_module is not None
        }
        for at, (kind, what, *rest) in enumerate(b.events):
            if kind == "draw":
                init.append({"draw": what})
            elif kind == "stream_fork":
                init.append({"fork": self.stream_fork(b, obj, what, rest[0], cls)})
            elif kind == "fork":
                if rest[0] is not b.rngs:
                    raise self.unsupported(f"{cls}.__init__ forks an Rngs it was not given")
                forks.append(what)
            else:
                child: Built = what
                cid = id(self.rec.resolve(child.obj))
                if cid in cells:
                    cells[cid] = child
                    continue
                if cid in rnns:
                    rnns[cid] = child
                    continue
                if cid in bases:
                    # (its LoRA follows, and says it: checked there)
                    bases[cid] = at
                    continue
                if _is_bidi(child.obj):
                    name = names.get(cid)
                    if name is None:
                        raise self.unsupported(
                            f"{cls}.__init__ builds an nnx.Bidirectional it does not keep as an attribute"
                        )
                    built[cid] = name
                    obj_b = self.rec.resolve(child.obj)
                    if obj_b.forward_rnn is obj_b.backward_rnn:
                        raise self.unsupported(
                            f"{cls}.{name} (nnx.Bidirectional) is given one RNN as both directions (they share "
                            "parameters and streams; an NNX spec builds two)"
                        )
                    sides = {}
                    for side in ("forward", "backward"):
                        rb = rnns.get(id(self.rec.resolve(getattr(obj_b, f"{side}_rnn"))))
                        if rb is None:
                            raise self.unsupported(
                                f"{cls}.{name} (nnx.Bidirectional) is given an RNN built elsewhere (capture reads "
                                "nnx.Bidirectional(nnx.RNN(...), nnx.RNN(...)), the RNNs built for it)"
                            )
                        sides[side] = self.rnn(rb, cells, b, forks, f"{cls}.{name}.{side}_rnn", f"{side}_rnn")
                        del sides[side]["name"]
                    own = self.own_rngs(child, obj_b, b, f"{cls}.{name} (nnx.Bidirectional)")
                    init.append({"Bidirectional": {"name": name, **sides, **own}})
                    continue
                if _is_rnn(child.obj):
                    name = names.get(cid)
                    if name is None:
                        raise self.unsupported(f"{cls}.__init__ builds an nnx.RNN it does not keep as an attribute")
                    built[cid] = name
                    init.append({"RNN": self.rnn(child, cells, b, forks, f"{cls}.{name}", name)})
                    continue
                if type(child.obj).__name__ == "ToNNX" and "bridge" in type(child.obj).__module__:
                    name = names.get(id(self.rec.resolve(child.obj)))
                    if name is None:
                        raise self.unsupported(f"{cls}.__init__ builds a bridge.ToNNX it does not keep as an attribute")
                    if child.rngs is not b.rngs:
                        raise self.unsupported(
                            f"{cls}.{name} (bridge.ToNNX) is given a key or another Rngs than {cls}'s (capture reads "
                            f"bridge.ToNNX(module, rngs=rngs) with {cls}'s Rngs)"
                        )
                    built[id(self.rec.resolve(child.obj))] = name
                    init.append({"ToNNX": self.bridge(child.obj, f"{cls}.{name}")})
                    continue
                if _hollow(child):
                    continue  # nnx.Sequential / List / Dict holding modules built here: named through it
                name = names.get(id(self.rec.resolve(child.obj)))
                if name is None:
                    raise self.unsupported(
                        f"{cls}.__init__ builds a {type(child.obj).__name__} it does not keep as an attribute "
                        f"(or keeps it inside another module){self.replaced(b, obj)}"
                    )
                built[id(self.rec.resolve(child.obj))] = name
                if child.stack:
                    if child.stack < 0 or child.split_of is not b.rngs:
                        raise self.unsupported(
                            f"{cls}.{name} is built inside nnx.vmap/nnx.scan other than as a stack (nnx.split_rngs"
                            f"(splits=N) around nnx.vmap(in_axes=0), or nnx.vmap over rngs.split(N), given {cls}'s "
                            "Rngs)"
                        )
                    sub = self.module(child)
                    made: dict = {}
                    if child.made:
                        mode, only = child.made
                        made = {"rngs": mode, **({"only": list(only)} if only else {})}
                    init.append({"module": {"name": name, "stack": child.stack, **made, **sub}})
                    continue
                if _is_layer(child.obj):
                    if child.rngs is None:
                        if any(child.events):
                            raise self.unsupported(f"{cls}.{name} draws without an Rngs")
                        if type(child.obj).__name__ == "Dropout":
                            # nnx.Dropout(rate) without rngs: it draws from the Rngs its calls are given
                            init.append({"Dropout": {"name": name, **_layer_options(child.obj, self.rec.built_modes)}})
                            continue
                        if self.rec.calls.get(id(child.obj)):
                            raise self.unsupported(f"{cls}.{name} draws at call time from an Rngs passed to the call")
                        continue  # built without rngs and never drawing: nothing to say
                    if child.rngs is not b.rngs:
                        raise self.unsupported(
                            f"{cls}.{name} ({type(child.obj).__name__}) is given another Rngs than {cls}'s"
                        )
                    options = _layer_options(child.obj, self.rec.built_modes)
                    if _is_lora(child.obj) and getattr(child.obj, "base_module", None) is not None:
                        options["base_module"] = self.lora_base(b, child, at, bases, f"{cls}.{name}")
                    init.append({type(child.obj).__name__: {"name": name, **options}})
                    continue
                mode = "shared"
                if child.rngs is None:
                    # built without an Rngs (a positional encoding, a LayerScale, nnx.PReLU()): it draws nothing
                    # of its own; what it builds is checked as the spec's `rngs: none` lets it build
                    init.append({"module": {"name": name, "rngs": "none", **self.module(child)}})
                    self.plain.add(id(self.rec.resolve(child.obj)))
                    continue
                if child.rngs is not b.rngs:
                    if not any(f is child.rngs for f in forks):
                        raise self.unsupported(
                            f"{cls}.{name} ({type(child.obj).__name__}) is given an Rngs that is neither "
                            f"{cls}'s nor its rngs.fork()"
                        )
                    mode = "fork"
                    forks = [f for f in forks if f is not child.rngs]
                sub = self.module(child)
                if mode == "fork" and sub.get("rngs") == "fork":
                    raise self.unsupported(f"{cls}.{name} forks the rngs.fork() it is given again")
                self.plain.add(id(self.rec.resolve(child.obj)))
                init.append({"module": {"name": name, **({"rngs": "fork"} if mode == "fork" else {}), **sub}})
        if forks:
            raise self.unsupported(f"{cls}.__init__ forks its Rngs without giving the fork to a submodule")
        if init:
            out["init"] = _runs(init)
        self.attrs_of[id(obj)] = built
        call: list[dict] = []
        for kind, what, how in self.inlined(self.rec.calls.get(id(obj), []), built):
            how = None if how == "quiet" else how  # (a layer every call of which was deterministic)
            # (`draw:train`, `call:train`: drawn or called in train mode only, `if not self.deterministic:`)
            kind, _, when = kind.partition(":")
            at = len(call)
            if kind == "draw" and how in self.kept.get(id(obj), ()):
                call.append({"draw": what})
            elif kind == "draw" and how in self.stream_forks.get(id(obj), {}):
                call.append({"draw": _Inline({"stream": what, "from": self.stream_forks[id(obj)][how]})})
            elif kind == "draw":
                from_ = self.keeper(built, how or 0)  # (self.enc.rngs.noise(), or self.enc.sample(x) drawing so)
                if from_ is None:
                    raise self.unsupported(
                        f"{cls}.__call__ draws from an Rngs that neither it nor a module of yours it builds keeps as "
                        "built (self.rngs = rngs) or by a fork (self.rng = rngs.dropout.fork()), outside a stack (a "
                        "stacked module keeping its Rngs is not modelled yet)"
                    )
                call.append({"draw": _Inline({"stream": what, "from": from_})})
            else:
                self.call_statement(call, what, how, built, cls)
            if when:
                call[at:] = [_with_when(st, when) for st in call[at:]]
        if call:
            out["call"] = _runs(call)
        return out

    def stream_fork(self, b: Built, obj, out, parent, cls: str):
        """`fork:` of self.<name> = rngs.<stream>.fork(): the attribute it is kept as, and its stream."""
        if b.rngs is None or not any(v is parent for v in vars(b.rngs).values()):
            raise self.unsupported(f"{cls}.__init__ forks a stream of an Rngs it was not given")
        name = next((k for k, v in vars(obj).items() if v is out), None)
        if name is None:
            # (a module nnx.vmap built, a stack's member: its attributes are the stacked streams, not the forks its
            # __init__ made; the n-th fork is the n-th stream it holds, of the same tag)
            forks = [e[1] for e in b.events if e[0] == "stream_fork"]
            held = [(k, v) for k, v in vars(obj).items() if type(v).__name__ == "RngStream"]
            n = next(i for i, f in enumerate(forks) if f is out)
            if len(held) == len(forks) and held[n][1].tag == out.tag:
                name = held[n][0]
        if name is None:
            raise self.unsupported(
                f"{cls}.__init__ forks rngs.{out.tag} and does not keep the fork as an attribute of its own "
                "(self.rng = rngs.dropout.fork())"
            )
        self.stream_forks.setdefault(id(obj), {})[id(out)] = name
        self.stream_forks[id(obj)][id(vars(obj)[name])] = name
        return out.tag if name == "rngs" else _Inline({"stream": out.tag, "name": name})

    def call_statement(self, call: list, what: int, how, built: dict[int, str], cls: str) -> None:
        """The statement of a call of module `what` (its attribute in `built`) that a call of `cls` made, added to
        `call` (none for a Dropout given keys that differ from call to call)."""
        name = built.get(what)
        if name is None:
            # a submodule's layer, called from a method of the submodule (self.enc.encode(x) calling
            # self.drop): the spec calls it by its dotted name, `enc.drop`
            name = self.dotted(built, what)
        if name is None:
            raise self.unsupported(
                f"{cls}.__call__ calls a module that {cls}.__init__ did not build (nor a submodule of it)"
            )
        if how == "call_rngs_transformed" or (how == "call_rngs" and not self.takes_rngs(what)):
            raise self.unsupported(
                f"{cls}.{name} is given an Rngs at its call under nnx.vmap/nnx.scan, or is not a Dropout or "
                "an attention layer"
            )
        # drop(x, deterministic=True) at every call, beside model.train()/eval()
        mode = {"deterministic": self.rec.pinned[what]} if what in self.rec.pinned else {}
        if how == "call_rngs":
            call.append({"call": {"name": name, "rngs": self.given_rngs, **mode}})
            return
        if how == "key":
            keys = self.rec.given_keys.get(what, set())
            if len(keys) == 1 and None not in keys:
                # the same key at every call (the same mask each time: collisions' keyless_dropout)
                call.append({"call": {"name": name, "key": _KeyData(next(iter(keys))), **mode}})
            return  # (keys that differ from call to call: the spec cannot say them; none is drawn)
        if isinstance(how, tuple) and len(how) == 3 and isinstance(how[0], str) and how[0] == "fork":
            _, tags, inner = how
            fields = self.transform(inner, what, f"{cls}.{name}") if inner else {}
            call.append({"call": {"name": name, **fields, "fork_rngs": _fork_field(tags), **mode}})
            return
        if how == "rnn_transformed":
            raise self.unsupported(f"{cls}.{name} (nnx.RNN) is called under nnx.vmap/nnx.scan")
        if isinstance(how, tuple) and how[0] == "rnn":
            _, length, initial, given = how
            rnn_call: dict = {"name": name, "length": length}
            if initial:
                rnn_call["initial_carry"] = True
            if given is not None:
                rnn_call["rngs"] = "model" if given is self.root_rngs else "call"
            call.append({"call": rnn_call})
            return
        if how or mode:
            call.append({"call": {"name": name, **(self.transform(how, what, f"{cls}.{name}") if how else {}), **mode}})
        else:
            call.append({"call": name})


def _with_when(st: dict, when: str) -> dict:
    """A `call:` statement run in that mode of the model only."""
    ((k, v),) = st.items()
    v = v if isinstance(v, dict) else {"stream" if k == "draw" else "name": v}
    return {k: _Inline({**v, "when": when})}


def _static(call: BridgeCall) -> tuple:
    """What a ToNNX call's arguments fix about its Linen computation: arrays by shape and dtype, the rest by
    value (or type, where a value cannot be compared)."""

    def one(v):
        shape = getattr(v, "shape", None)
        if shape is not None and hasattr(v, "dtype"):
            return ("array", tuple(shape), str(v.dtype))
        try:
            hash(v)
            return ("value", v)
        except TypeError:
            return ("object", type(v).__name__)

    return tuple(one(a) for a in call.args), tuple(sorted((k, one(v)) for k, v in call.kwargs.items()))


def _linen_module(module, init: BridgeCall, apply: BridgeCall | None, target: str) -> dict:
    """The Linen spec's `model:` of a ToNNX's module: observed by Linen capture in its init from the keys the
    ToNNX call gave it, checked to replay that init (and the first apply) key for key; nothing else is trusted."""
    from . import flax_hooks

    assert init.keys is not None
    with flax_hooks.installed():  # (already, when run_nnx_capture installed them before the model's import)
        return _linen_module_observed(module, init, apply, target)


def _linen_module_observed(module, init: BridgeCall, apply: BridgeCall | None, target: str) -> dict:
    from ..engine.nnx_bridge import linen_rngs
    from .capture import observe_module
    from .specgen import model_doc

    assert init.keys is not None
    args, kwargs = _untraced((init.args, init.kwargs))
    cap, rec = observe_module(module, args, kwargs, linen_rngs(init.keys), "init", target)
    if cap.settings["fix_rng_separator"]:
        raise UnsupportedError(
            f"capture of {target}: flax_fix_rng_separator is on, and an NNX spec's Linen modules replay Flax's "
            "default (off); no spec was written"
        )
    model = model_doc(rec, "init", target)
    _check_linen(model, cap)
    if apply is not None and apply.keys is not None:
        args, kwargs = _untraced((apply.args, apply.kwargs))
        applied = observe_module(module, args, kwargs, linen_rngs(apply.keys), "apply", target)[0]
        # the module read from its init must draw in apply as Flax does (a make_rng under
        # self.is_initializing(), or an argument init and apply differ in, makes them differ)
        try:
            _check_linen(model, applied)
        except InternalError:
            raise UnsupportedError(
                f"capture of {target}: the Linen module draws differently in apply than in init (a draw under "
                "self.is_initializing(), or an argument lazy_init and the calls differ in); an NNX spec replays "
                "one Linen module for both, so no spec was written"
            ) from None
    return model


def _untraced(tree):
    """A call's arguments with each traced array (the call ran under nnx.value_and_grad or nnx.jit) as zeros of its
    shape and dtype: what Linen draws depends on shapes, and a tracer must not leave its transform."""
    import jax
    import jax.numpy as jnp

    def one(x):
        return jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.core.Tracer) else x

    return jax.tree_util.tree_map(one, tree)


def _check_linen(model: dict, c) -> None:
    """The Linen spec of `model` replays capture `c` (its phase, keys and settings) key for key, or InternalError."""
    import yaml

    from .capture import verify_spec_text

    doc = {
        "rngaudit": 1,
        "flax": {"fix_rng_separator": c.settings["fix_rng_separator"], "version": c.settings["flax_version"]},
        "jax": {
            "version": c.settings["jax_version"],
            **{k: c.settings[k] for k in ("prng_impl", "threefry_partitionable")},
        },
        "phase": c.phase,
        "rngs": c.rngs,
        "model": model,
    }
    verify_spec_text(yaml.safe_dump(doc, sort_keys=False), c)


def _check_forks(rec: NnxRecorder, where: str) -> None:
    """At the end of a step (or a call of the model): nnx.fork_rngs used as an NNX spec cannot say it, or left
    unrestored (a spec's `fork_rngs:` gives the streams their keys back after the call), refused."""
    if rec.fork_problems:
        raise UnsupportedError(f"{where}: {rec.fork_problems[0]}; write that part of the spec by hand")
    if rec.split_backups:
        raise UnsupportedError(
            f"{where} leaves the streams nnx.split_rngs/nnx.fork_rngs split unrestored (no `with` around it ended, "
            "and its backups were not given to nnx.restore_rngs); restore them, or write that part of the spec by hand"
        )
    if rec.forked:
        node = rec.forked[-1][0]
        raise UnsupportedError(
            f"{where} leaves nnx.fork_rngs of a {type(node).__name__} unrestored (no `with` around it ended, and its "
            "backups were not given to nnx.restore_rngs); an NNX spec's `fork_rngs:` gives the streams their keys "
            "back after the call: restore them, or write that part of the spec by hand"
        )


def _fork_field(tags: tuple[str, ...]) -> list[str] | bool:
    """A spec's `fork_rngs:` for the tags nnx.fork_rngs forked (`true`: every stream)."""
    return list(tags) if tags else True


def _fork_tags(split) -> tuple[str, ...] | None:
    """nnx.fork_rngs's `split=` as a spec's `fork_rngs:` where it is one: None or {...: None} (every stream: ()),
    {tags: None, ...} (those streams); None for any other (splits, filters other than tags, a stream matched
    twice)."""
    if split is None:
        return ()
    if not isinstance(split, dict) or any(v is not None for v in split.values()):
        return None
    if list(split) == [...]:
        return ()
    out: list[str] = []
    for flt in split:
        tags = _tags(flt)
        if tags is None:
            return None
        out += tags
    return tuple(out) if out and len(set(out)) == len(out) else None


def _fork_split(split) -> tuple[int | None, object]:
    """nnx.fork_rngs's `split=` as nnx.split_rngs's (splits, only) where it is one: N (every stream split N ways)
    or {filter: N} (the streams it matches; the others untouched); (None, None) for any other (a scalar fork, or
    several entries)."""
    if isinstance(split, int) and not isinstance(split, bool):
        return split, ...
    if isinstance(split, dict) and len(split) == 1:
        ((only, n),) = split.items()
        if isinstance(n, int) and not isinstance(n, bool):
            return n, only
    return None, None


def _axis_of(in_axes, pos: int):
    return in_axes[pos] if isinstance(in_axes, (tuple, list)) else in_axes


def _size(t: Transform) -> int | None:
    """The size of the axis a transform maps: its length, or the first array argument's mapped axis."""
    if t.length is not None:
        return int(t.length)
    for i, a in enumerate(t.outer):
        ax = _axis_of(t.in_axes, i)
        if isinstance(ax, int) and not isinstance(ax, bool) and hasattr(a, "shape") and len(a.shape) > ax:
            return int(a.shape[ax])
    return None


def _tags(flt) -> tuple[str, ...] | None:
    """The stream tags a filter names (a tag, or a tuple of them), or None for any other filter."""
    if isinstance(flt, str):
        return (flt,)
    if isinstance(flt, (tuple, list)) and all(isinstance(f, str) for f in flt):
        return tuple(flt)
    return None


def _transform_of(builder, how, target_id: int, where: str) -> dict:
    from flax import nnx

    t, pos, depth = how
    if depth != 1:
        raise builder.unsupported(f"{where} is called under nested transforms")
    if pos is None:
        raise builder.unsupported(f"{where} is called inside nnx.{t.kind} without being one of its arguments")
    axis = _axis_of(t.in_axes, pos)
    target = builder.built_of.get(target_id)
    stacked = target is not None and target.stack > 0
    if stacked:
        if axis != 0:
            raise builder.unsupported(f"{where} is a stack, mapped by nnx.{t.kind} on axis {axis!r} (not 0)")
        return {t.kind: True}
    carried = nnx.Carry if t.kind == "scan" else 0
    if axis is (nnx.Carry if t.kind == "scan" else None):
        streams: tuple[str, ...] = ()
    elif isinstance(axis, nnx.StateAxes):
        other = dict(zip(axis.filters, axis.axes)).get(...)
        special = [(f, a) for f, a in zip(axis.filters, axis.axes) if f is not ...]
        want = None if t.kind == "scan" else carried
        if (other is not (nnx.Carry if t.kind == "scan" else None)) or any(a != want for _, a in special):
            raise builder.unsupported(f"{where}: nnx.{t.kind} with StateAxes {dict(zip(axis.filters, axis.axes))!r}")
        found = [_tags(f) for f, _ in special]
        if any(x is None for x in found):
            raise builder.unsupported(f"{where}: nnx.{t.kind} StateAxes filters other than stream names")
        streams = tuple(tag for x in found if x is not None for tag in x)
    else:
        raise builder.unsupported(f"{where} is mapped by nnx.{t.kind} with in_axes {axis!r}")
    n = _size(t)
    if t.kind == "vmap":
        if streams:
            if t.split is None or _tags(t.split.only) is None or set(_tags(t.split.only) or ()) != set(streams):
                raise builder.unsupported(
                    f"{where}: the StateAxes of nnx.vmap map {list(streams)} and nnx.split_rngs around it splits "
                    f"{t.split.only if t.split else 'nothing'!r}"
                )
            n = t.split.n
        if n is None:
            raise builder.unsupported(f"{where}: the size of the nnx.vmap axis is not known")
        return {"vmap": n, **({"split": list(streams)} if streams else {})}
    if n is None:
        raise builder.unsupported(f"{where}: the length of the nnx.scan is not known")
    return {"scan": n, **({"broadcast": list(streams)} if streams else {})}


def _runs(statements: list) -> list:
    """Consecutive equal statements (draws, calls with the same transform) as one with `repeat`."""

    def parts(st: dict) -> tuple[str, str, dict, int]:
        ((k, v),) = st.items()
        field = "stream" if k == "draw" else "name"
        if not isinstance(v, dict):
            return k, v, {}, 1
        extra = {x: y for x, y in v.items() if x not in (field, "repeat")}
        return k, v[field], extra, v.get("repeat", 1)

    out: list = []
    for st in statements:
        k, base, extra, n = parts(st)
        if out and k in ("draw", "call"):
            k0, base0, extra0, n0 = parts(out[-1])
            if (k0, base0, extra0) == (k, base, extra):
                field = "stream" if k == "draw" else "name"
                out[-1] = {k: {field: base, **extra, "repeat": n0 + n}}
                continue
        out.append(st)
    return out


# ---------------------------------------------------------------- running the target
def _factory(target: CodeRef):
    from flax import nnx

    obj = load(target, "TARGET")
    if isinstance(obj, type) and issubclass(obj, nnx.Module):
        return obj
    if callable(obj):
        return obj
    raise UserCodeError(
        f"TARGET {target.text}: {target.attr} is a {type(obj).__name__}, not an nnx.Module class or a function "
        "that builds one from an nnx.Rngs"
    )


def is_nnx_target(target: CodeRef) -> bool:
    """Whether TARGET names an NNX model: an nnx.Module class, or a function with a parameter (it takes the
    nnx.Rngs). flax.nnx is imported only where the answer needs it (it takes half a second)."""
    if importlib.util.find_spec("flax") is None:
        return False
    obj = load(target, "TARGET")
    if isinstance(obj, type):
        nnx = sys.modules.get("flax.nnx")  # (a subclass of nnx.Module exists only once flax.nnx is imported)
        return nnx is not None and issubclass(obj, nnx.Module)
    if not callable(obj):
        return False
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    takes = any(
        p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    ) or any(p.name == "rngs" for p in params)
    if not takes:
        return False
    try:
        importlib.import_module("flax.nnx")  # (an NNX model needs it importable)
    except ImportError:
        return False
    return True


def run_nnx_capture(
    target: CodeRef,
    inputs: list[InputSpec],
    seeds: dict[str, int | list[int]] | None,
    steps: int,
    step: CodeRef | None = None,
    calls: int | None = None,
) -> tuple[Capture, str]:
    """Capture TARGET (an NNX model) built from nnx.Rngs(**seeds) (seeds None: a factory without parameters that
    seeds the model itself, its nnx.Rngs(...) read) and called `steps` times (by the training step `step`,
    `step(model, *args)`, when given; each call of the model a step of the spec); `calls`: instead, steps until the
    model has been called that many times (verify of a spec). Returns the capture and the NNX spec's YAML text,
    checked: derive replays every key."""

    if not 0 <= steps <= MAX_STEPS:
        raise UserCodeError(f"--steps {steps}: give 0 to {MAX_STEPS} calls")
    from .capture import session

    # (Linen's hooks before the model is imported: a bridge.ToNNX's Linen module is read by Linen capture, and a
    # class transform keeps the function it was made with; NNX's: a transform applied at import is followed)
    with session(target, *([step] if step is not None else [])):
        return _run_nnx_capture(target, inputs, seeds, steps, step, calls)


def _check_step(step: CodeRef, model, rec: NnxRecorder) -> None:
    """A training step an NNX spec can say: it calls the model (once or more, each call a step of the spec), draws
    no key outside those calls but from the Rngs the model keeps, and reseeds the whole model if any of it."""
    from flax import nnx

    calls = [m for m in rec.top if m is not model]
    graph = {id(node) for _, node in nnx.graph.iter_graph(model)} if calls else set()
    reason = next((rec.excluded[id(m)] for m in calls if id(m) in rec.excluded), None)
    if reason is not None:
        raise UnsupportedError(reason)
    others = sorted({type(m).__name__ for m in calls if id(m) not in graph})
    if others:
        raise UnsupportedError(
            f"--step {step.text}: step {rec.invocation} calls a {' and a '.join(others)} that is neither the model "
            "nor a module of it (another model, held in a global?); capture records one model, or the models the "
            "step is given as its arguments (train_step(generator, discriminator, ...)) where the factory builds "
            "them from one Rngs (return the model and those arguments: return generator, (discriminator, ...))"
        )
    if calls:
        names = sorted({type(m).__name__ for m in calls})
        raise UnsupportedError(
            f"--step {step.text}: step {rec.invocation} calls {', '.join(names)} outside the model's call (a module "
            "of the model called directly, or a copy of it: nnx.split/merge, jax.grad); an NNX spec's steps are "
            "calls of the model: call the model (or nnx.view of it), or use nnx.grad / nnx.value_and_grad on it"
        )
    if not rec.top:
        raise UnsupportedError(
            f"--step {step.text}: step {rec.invocation} does not call the model; an NNX spec's steps are calls of "
            "the model"
        )
    if rec.reseeds:
        raise UnsupportedError(
            f"--step {step.text}: step {rec.invocation} calls {rec.reseeds[0]}; an NNX spec's `reseed:` event is "
            "nnx.reseed(model, stream=SEED, ...) of the model or a module of it (policy 'scalars_only' or "
            "'match_shape') with integer seeds or concrete keys"
        )
    _check_copies(rec)
    dropped, rec.dropped = rec.dropped, set()
    if "rngs" in dropped:
        raise UnsupportedError(
            f"--step {step.text}: step {rec.invocation} passes an nnx.Rngs into a jax.jit function and does not "
            "write its state back: its counts roll back, so it hands out the same keys again; an NNX spec cannot "
            "say this: write its state back as the model's (nnx.update), or make it for each step from a key "
            "folded with the step (nnx.Rngs(dropout=jax.random.fold_in(key, step)))"
        )
    if "model" in dropped:
        # a pure jax.jit step (nnx.merge of the model's nnx.split state inside) whose returned state is not written
        # back into the model: its RNG counts roll back, and the next step draws the same keys (`stale_call`)
        if len(rec.top) != 1:
            raise UnsupportedError(
                f"--step {step.text}: step {rec.invocation} calls the model {len(rec.top)} times in a jitted "
                "function whose state is not written back (nnx.update(model, state)); an NNX spec's stale_call is "
                "one call whose counts roll back: write the state back, or call the model once a step"
            )
        rec.stale.add(rec.step)
    if rec.stray:
        raise UnsupportedError(
            f"--step {step.text}: step {rec.invocation} draws {rec.stray} key(s) outside the model's calls from an "
            "Rngs the model and the modules of yours in it do not keep as built (an Rngs of the step's own, a "
            "stack's, one a module made for itself, one of Flax's layers: an nnx.RNN's, a bridge's), or under "
            "nnx.vmap/nnx.scan; an NNX spec says a step's draws from the Rngs the model or a module of yours in it "
            "keeps (model.rngs.noise(), model.enc.rngs.noise(): `draw:` in `run:`), outside any transform"
        )


def _forked_from(rec: NnxRecorder, rngs, base) -> bool:
    """Whether `rngs` is base.fork(), made by the factory outside every module (Actor(rngs=rngs.fork()))."""
    return any(out is rngs and parent is base for _, out, parent in rec.loose_forks)


def _other_models(rec: NnxRecorder, root: Built, base, model, args: tuple, kwargs: dict, fn, target) -> dict:
    """The models a training step is given besides the model (a GAN's discriminator, a critic), built by the
    factory from the model's Rngs: name -> construction, the model's first, in the order they were built; {} when
    the step is given no other model. Named by the step's parameters (train_step(generator, discriminator, ...))."""
    from flax import nnx

    given = [(i, a) for i, a in enumerate(args) if isinstance(a, nnx.Module)]
    given += [(k, a) for k, a in kwargs.items() if isinstance(a, nnx.Module)]
    if fn is None or not given:
        return {}
    graph = {id(node) for _, node in nnx.graph.iter_graph(model)}
    built = {id(b.obj): b for b in rec.roots}
    found: dict = {}
    for where, obj in given:
        if id(obj) in graph or id(obj) in found:
            continue  # (a module of the model given to the step as well)
        b = built.get(id(obj))
        # (one a spec cannot say is left out: refused if the step calls it, with this reason; an EMA copy the step
        # only updates, a frozen network that draws nothing, are no business of the keys)
        if b is None and _copied_streams(obj, model):
            rec.excluded[id(obj)] = (
                f"capture of {target.text}: the step calls a {type(obj).__name__} it is given besides the model whose "
                "RNG streams are copies of the model's, at the same keys and counts (nnx.clone(model), or a copy "
                "made with nnx.split/merge): its draws hand out the keys the model's draws hand out (a DQN target "
                "network's dropout masks repeat the online network's); an NNX spec cannot say a copy: build it "
                f"from the model's Rngs ({type(obj).__name__}(..., rngs=rngs)) and copy its parameters over"
            )
        elif b is None or b.stack or not (b.rngs is base or _forked_from(rec, b.rngs, base)):
            rec.excluded[id(obj)] = (
                f"capture of {target.text}: the step calls a {type(obj).__name__} it is given besides the model, not "
                "built by the factory from the Rngs it is given, or from rngs.fork() of it (an NNX spec has one "
                f"Rngs for its models: build each from it, {type(obj).__name__}(..., rngs=rngs) or rngs=rngs.fork())"
            )
        else:
            found[id(obj)] = (where, b)
    if not found:
        return {}
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def name(where) -> str | None:
        if isinstance(where, str):
            return where
        return positional[where + 1] if where + 1 < len(positional) else None  # (the model is the step's first)

    named = {"model": (positional[0] if positional else None, root)}
    named |= {f"arg {w}": (name(w), b) for w, b in found.values()}
    out: dict = {}

    def free(a: str) -> bool:  # (an attribute of the root: not one of nnx.Module's own, train, eval, sow ...)
        return a.isidentifier() and a not in out and not a.startswith("_") and not hasattr(nnx.Module, a)

    for i, (n, b) in enumerate(named.values()):
        out[n if n and free(n) else next(f"model_{j}" for j in itertools.count(i) if free(f"model_{j}"))] = b
    order = {id(b): i for i, b in enumerate(rec.roots)}
    return dict(sorted(out.items(), key=lambda kv: order[id(kv[1])]))


def _copied_streams(obj, model) -> bool:
    """Whether a module holds an RNG stream at the key and count of one of the model's (a copy of the model's
    streams: nnx.clone)."""
    from flax import nnx

    def streams(m) -> set:
        out = set()
        for _, node in nnx.graph.iter_graph(m):
            if isinstance(node, nnx.RngStream):
                with contextlib.suppress(Exception):  # (traced, or not readable: not compared)
                    out.add((node.tag, _key_words(node.key[...]), int(node.count[...])))
        return out

    return bool(streams(obj) & streams(model))


def _key_words(key) -> tuple:
    """A concrete key's data as its words."""
    import jax
    import numpy as np

    return tuple(int(w) for w in np.asarray(jax.random.key_data(key)).ravel())


def _models_root(rec: NnxRecorder, base, models: dict):
    """A module standing for the models a step trains together: each one an attribute of it (the name the step
    gives it), built from their Rngs in the order the factory built them; capture records the step's calls of them
    as calls of it."""
    from flax import nnx

    class Models(nnx.Module):
        pass

    held = len(rec.roots)
    obj = Models()
    del rec.roots[held:]  # (not a module the factory built)
    for name, b in models.items():
        setattr(obj, name, b.obj)
    # each model built in turn, a model built from rngs.fork() after its fork (made just before it)
    at = {id(b): i for i, b in enumerate(rec.roots)}
    events: list[tuple[tuple[int, int], tuple]] = [((at[id(b)], 1), ("child", b)) for b in models.values()]
    forks = {id(b.rngs) for b in models.values()}
    events += [((n, 0), ("fork", out, parent)) for n, out, parent in rec.loose_forks if id(out) in forks]
    built = Built(Models, base, [e for _, e in sorted(events, key=lambda x: x[0])], obj=obj)
    rec.roots.append(built)
    return obj, built


@contextlib.contextmanager
def _root_call(rec: NnxRecorder, root, step: CodeRef):
    """One step of the models a step trains together: a call of the module standing for them (what the call hook
    does for a model's call from outside every module); what the step draws or reseeds itself is outside it."""
    rec.top.append(root)
    rec.next_step()
    frame = Called(root, transforms=len(rec.transforms), synthetic=True)
    rec.calling.append(frame)
    try:
        yield
        models = {id(v) for v in vars(root).values()}
        # (a module besides the models that draws no key when the step calls it: left out, as in a step of one)
        frame.events = [
            e for e in frame.events if not (e[0] == "call" and id(e[1].obj) not in models and not e[1].touched)
        ]
        for kind, what, *_ in frame.events:
            if kind == "call" and id(what.obj) not in models:
                raise UnsupportedError(
                    rec.excluded.get(id(what.obj))
                    or f"--step {step.text}: step {rec.invocation} calls a {type(what.obj).__name__} that is neither "
                    "one of the models it is given nor a module of one (held in a global?)"
                )
    finally:
        rec.calling.pop()
        _remember(rec, frame)


def _step_function(step: CodeRef):
    """The training step `--step` names, as capture calls it: a step nnx.jit made when its module was imported
    (`@nnx.jit def train_step(...)`) is its Python function, run as plain Python (nnx.jit hands out eager code's
    keys, FLAX_NNX_RULES.md §11). A step that does not write its graph updates back stays as it is: its draws are
    traced, and capture says it cannot follow them."""
    from flax import nnx

    fn = load(step, "--step", reuse=True)  # (a step in the TARGET's file: the module the factory came from)
    jitted = getattr(getattr(nnx, "transforms", None), "compilation", None)
    wrapped = getattr(jitted, "JitWrapped", None)
    if wrapped is not None and type(fn) is wrapped and callable(getattr(fn, "fun", None)):
        fn = fn.fun  # (graph mode with its updates written back: SimpleJitWrapped is the other mode)
    if not callable(fn):
        raise UserCodeError(f"--step {step.text}: {step.attr} is not a function (it is a {type(fn).__name__})")
    return fn


def _run_nnx_capture(
    target: CodeRef,
    inputs: list[InputSpec],
    seeds: dict[str, int | list[int]] | None,
    steps: int,
    step: CodeRef | None = None,
    calls: int | None = None,
):
    import flax
    import jax
    import yaml
    from flax import nnx

    from ..engine.keys import jax_setting

    settings = {
        "fix_rng_separator": False,
        "prng_impl": str(jax_setting("jax_default_prng_impl")),
        "threefry_partitionable": bool(jax_setting("jax_threefry_partitionable")),
        "flax_version": flax.__version__,
        "jax_version": jax.__version__,
    }
    with observing() as rec:
        # the model's file imported under the hooks: a transform it applies at import (a decorated method,
        # `@nnx.split_rngs(splits=N) @nnx.vmap(...) def create_blocks(rngs)` at module level, `@nnx.jit def
        # train_step`) is then one capture follows
        factory = _factory(target)
        rec.reset()  # (what the imports built and drew is not the factory's)
        rngs: Any = None
        try:
            if seeds is None:  # a factory without parameters: it seeds the model itself (Model(rngs=nnx.Rngs(0)))
                made = factory()
            else:
                # (key data, from a spec's key: the typed key nnx.Rngs takes)
                rngs = nnx.Rngs(**{k: _key_array(v) for k, v in seeds.items()})
                made = factory(rngs=rngs) if _takes_rngs_keyword(factory) else factory(rngs)
        except RngauditError:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 (the model's own error)
            raise UserCodeError(
                f"TARGET {target.text}: building the model raises {type(e).__name__}: {first_line(e)}"
            ) from None
        model, args, kwargs = _unpack(made, target)
        if inputs:
            args, kwargs = example_inputs(inputs)
        # called in the factory: bridge.lazy_init(model, x)
        whole = id(model) in rec.calls or id(model) in rec.mode_calls
        tonnx = _tonnx()
        if tonnx is not None and isinstance(model, tonnx):
            raise UnsupportedError(
                f"capture of {target.text}: the model is a bridge.ToNNX itself; capture reads a module of yours that "
                "builds it (class Model(nnx.Module): self.enc = bridge.ToNNX(..., rngs=rngs)), so that a spec can "
                "say where it is"
            )
        if whole and not any(c.whole and c.init for calls in rec.bridges.values() for c in calls):
            raise UnsupportedError(
                f"capture of {target.text}: the factory calls the model (capture calls it --steps times itself); "
                "return it uncalled (bridge.lazy_init(model, x) is the one call a factory may make)"
            )
        root = next((b for b in rec.roots if b.obj is model), None)
        stack = next((b for b in rec.roots if b.stack and rec.resolve(b.obj) is model), None)
        if root is None and stack is not None:
            raise UnsupportedError(
                f"capture of {target.text}: the model, a {type(model).__name__}, is a stack an nnx.vmap built (an "
                "ensemble made by nnx.split_rngs(splits=N) and nnx.vmap over a function that builds it); an NNX spec "
                "says a stack as a module of the model: return a module of yours that builds it (self.members = "
                "create_model(rngs)) and calls it under nnx.vmap"
            )
        if root is None:
            raise UnsupportedError(
                f"capture of {target.text}: the model was not built by the factory's call (capture needs to see "
                "its construction: build it inside the factory, from the nnx.Rngs it is given)"
            )
        if root.stack:
            raise UnsupportedError(
                f"capture of {target.text}: the model, a {type(model).__name__}, stacks itself (nnx.vmap on its "
                "__init__); an NNX spec says such a stack as a module of the model: return a module of yours that "
                f"builds it (self.layers = {type(model).__name__}(rngs)) and calls it"
            )
        if root.rngs is None:
            raise UnsupportedError(
                f"capture of {target.text}: the model, a {type(model).__name__}, is not built from an nnx.Rngs (a "
                "container or a layer built from other modules as the root): return a module of yours that builds "
                "it from the factory's rngs"
            )
        if rngs is None:
            rngs = root.rngs
            seeds = rec.seeds.get(id(rngs))  # (the nnx.Rngs(stream=SEED, ...) the factory made)
            if seeds is None:
                raise UnsupportedError(
                    f"capture of {target.text}: the factory builds the model from an nnx.Rngs not made there with "
                    "integer seeds or concrete keys of the run's PRNG implementation (nnx.Rngs(0), nnx.Rngs(params=0, "
                    "dropout=1), nnx.Rngs(jax.random.key(0))); "
                    "make it so, or write a factory that takes the Rngs (def make_model(rngs): return "
                    "Model(rngs=rngs)) and give --rngs"
                )
        elif root.rngs is not rngs and not (step is not None and _forked_from(rec, root.rngs, rngs)):
            raise UnsupportedError(
                f"capture of {target.text}: the model is built from another Rngs than the one the factory is given; "
                "build it from that one (Model(rngs=rngs)), so --rngs seeds it"
            )
        fn = _step_function(step) if step is not None else None
        models = _other_models(rec, root, rngs, model, args, kwargs, fn, target)
        if root.rngs is not rngs and not models:
            raise UnsupportedError(
                f"capture of {target.text}: the model is built from another Rngs than the one the factory is given; "
                "build it from that one (Model(rngs=rngs)), so --rngs seeds it"
            )
        called = model  # (what capture calls, or gives the step: the model the factory returns)
        if models:
            # a GAN's generator and discriminator, an actor and a critic: models built from one Rngs and trained
            # together by the step, written as the submodules of one root whose call is the step
            model, root = _models_root(rec, rngs, models)
        rec.model = model
        rec.kept_streams = _kept_streams(rec, root)
        rec.built_modes = {
            id(node): getattr(node, "deterministic", None)
            for _, node in nnx.graph.iter_graph(model)
            if isinstance(node, (nnx.Dropout, nnx.MultiHeadAttention))
        }
        n = 0
        while n < steps if calls is None else rec.step < calls:
            n += 1
            rec.invocation, rec.top, rec.stray = n, [], 0
            try:
                if fn is None:
                    model(*args, **kwargs)
                elif models:
                    assert step is not None
                    with _root_call(rec, model, step):
                        fn(called, *args, **kwargs)
                else:
                    fn(model, *args, **kwargs)
                jax.effects_barrier()
            except RngauditError:
                raise
            except (Exception, SystemExit) as e:  # noqa: BLE001
                what = "calling the model" if step is None else f"--step {step.text}"
                built = {id(b.obj) for b in rec.roots}
                given = sorted({type(a).__name__ for a in (*args, *kwargs.values()) if id(a) in built})
                hint = (
                    f" (the factory returns other models beside it, a {' and a '.join(given)}: give the step that "
                    "trains them together, --step FILE.py:NAME)"
                    if step is None and given
                    else ""
                )
                raise UserCodeError(
                    f"TARGET {target.text}: {what} (step {n}) raises {type(e).__name__}: {first_line(e)}{hint}"
                ) from None
            _check_forks(rec, f"--step {step.text}: step {n}" if step else f"capture of {target.text}: call {n}")
            if step is not None:
                _check_step(step, model, rec)
            elif not rec.top:
                raise UnsupportedError(
                    f"capture of {target.text}: calling the model ran no module's __call__ capture sees (a model "
                    "whose __call__ is not its class's own?)"
                )
    if rec.traced:
        raise UnsupportedError(
            f"capture of {target.text}: the model draws keys under a transform capture does not follow: one "
            "applied at import by a module capture does not import afresh (an installed package's, or one from "
            "outside the directory of TARGET's file: apply nnx.jit or nnx.remat where the model is called), one "
            "with graph_updates=False or in tree mode, or a transform "
            "other than nnx.jit, nnx.remat, nnx.cond, nnx.switch, nnx.fori_loop, nnx.while_loop, nnx.vmap and "
            "nnx.scan; write that part of the spec by hand (README, Flax NNX specs)"
        )
    _by_mode(rec)
    if rec.differs is not None:
        raise UnsupportedError(
            f"capture of {target.text}: {rec.differs}.__call__ draws differently from one call to the next (a "
            "branch on the model's state or on an argument, or a module called both deterministic and not in one "
            "call of the model?); an NNX spec has one call per module, where what a module draws or calls in train "
            "or eval mode only (as its `deterministic` attribute, which model.train()/eval() set, or its "
            "`deterministic`/`train` argument says) is `when: train`"
        )
    assert seeds is not None  # (the factory's, where it was not given them)
    if calls is not None and rec.step > calls:
        # (a step that calls the model more than once went past the calls asked for: those are not compared)
        rec.records = [r for r in rec.records if r["step"] <= calls]
        del rec.modes[calls:]
        rec.pending = []
    builder = _SpecBuilder(rec, target.text, root)
    model_id = id(rec.resolve(root.obj))
    root_fields = {
        n: {
            **(builder.transform(rec.root_how[n], model_id, "the model") if n in rec.root_how else {}),
            **({"fork_rngs": _fork_field(rec.root_fork[n])} if n in rec.root_fork else {}),
        }
        for n in sorted({*rec.root_how, *rec.root_fork})
        if n <= len(rec.modes)
    }
    run = _with_draws(_run_events(rec, target, root_fields), rec)
    calls = len(rec.modes)
    stale = {n for n in rec.stale if n <= calls}
    if stale:
        # a pure jax.jit step whose returned state is dropped: every call draws from the counts the model had
        if stale != set(range(1, calls + 1)) or run is not None or whole or rec.call_rngs:
            raise UnsupportedError(
                f"capture of {target.text}: the step does not write the state its jitted function returns back into "
                "the model (nnx.update(model, state)) at some steps, or does so beside model.train()/eval(), "
                "draws of its own or an Rngs given at the calls; an NNX spec says `stale_call` (the counts roll "
                "back) for plain calls only: write the state back (the keys then move on), or write the spec by hand"
            )
        run = [{"stale_call": calls} if calls > 1 else "stale_call"]
    doc = {
        "rngaudit": 1,
        "flavour": "nnx",
        "flax": {"version": settings["flax_version"]},
        "jax": jax_doc(settings),
        "rngs": _flow_keys(seeds),
        **_call_rngs(rec, rngs, target),
        **(
            {"run": ["lazy_init", *(run or ([{"call": calls}] if calls else []))]}
            if whole
            else {"run": run}
            if run
            else {"steps": calls}
        ),
        "model": builder.module(root),
    }
    header = f"# captured from {target.text} by rngaudit (flax {flax.__version__}, jax {jax.__version__})\n"
    if models:
        header += (
            f"# the model: the {len(models)} models the step is given ({', '.join(models)}), built from one Rngs, as "
            "the submodules of one module whose call is the step\n"
        )
    spec_text = header + yaml.dump(doc, Dumper=_SpecDumper, sort_keys=False)
    sites, eval_steps = check_replay(spec_text, rec.records, target.text, rec.lanes or bool(rec.bridges))
    versions = {"flax": flax.__version__, "jax": jax.__version__}
    cap = Capture(target.text, "call", dict(seeds), settings, sites, {}, versions, flavour="nnx")
    cap.eval_steps = eval_steps
    return cap, spec_text


_GIVEN_NONE: dict = {}  # (a step whose call is given no Rngs: `null` in call_rngs)


def _call_rngs(rec: NnxRecorder, rngs, target: CodeRef) -> dict:
    """`call_rngs:` when the model's Dropouts are given an Rngs at their calls (drop(x, rngs=rngs)): one Rngs,
    made by nnx.Rngs(stream=SEED, ...) with integer seeds, not the one the model is built from."""
    given = list(rec.call_rngs.values())
    if not given:
        return {}
    if len(given) > 1:
        # an Rngs made for each step (model(x, rngs=nnx.Rngs(dropout=jax.random.fold_in(key, step)))): one a step,
        # new at every step, seeded with integers or keys capture read
        # (a step given none, an eval call model(x) between training steps: `null`)
        at = [list(rec.call_rngs_at.get(step, {}).values()) for step in range(1, rec.step + 1)]
        made_at = [a for a in at if a]
        if any(len(a) > 1 for a in at) or len({id(a[0]) for a in made_at}) != len(made_at) or rngs in given:
            raise UnsupportedError(
                f"capture of {target.text}: the model's layers are given {len(given)} different Rngs at their calls, "
                "not one made for each step (model(x, rngs=nnx.Rngs(dropout=fold_in(key, step))), every call of the "
                "step given it); an NNX spec says one Rngs for every call (call_rngs: {dropout: 1}), or one a step"
            )
        made = [rec.seeds.get(id(a[0])) if a else _GIVEN_NONE for a in at]
        if any(m is None for m in made):
            raise UnsupportedError(
                f"capture of {target.text}: a step's call is given an Rngs not made by nnx.Rngs(stream=SEED, ...) "
                "with integer seeds or concrete keys (one made inside a jitted function from a traced key?); make "
                "it before the jitted step and pass it in, or give every call one Rngs made in the factory"
            )
        return {"call_rngs": [None if m is _GIVEN_NONE else _flow_keys(m) for m in made if m is not None]}
    (r,) = given
    if r is rngs:
        return {}  # (the Rngs the model is built from: `rngs: model`)
    seeds = rec.seeds.get(id(r))
    if seeds is None:
        raise UnsupportedError(
            f"capture of {target.text}: a layer's call is given an Rngs not made by nnx.Rngs(stream=SEED, ...) with "
            "integer seeds or a concrete key; capture reads the Rngs the model is built from, or one made with "
            "seeds or keys and given to the model's calls (rngs = nnx.Rngs(dropout=1); return model, (x, rngs))"
        )
    return {"call_rngs": _flow_keys(seeds)}


def _key_array(seed: int | list[int]):
    if isinstance(seed, int):
        return seed
    import jax
    import jax.numpy as jnp

    return jax.random.wrap_key_data(jnp.asarray(seed, dtype=jnp.uint32))


class _KeyData(list):
    """Raw key data in a spec's `rngs:`, written on one line (`params: [3625411723, 1954958720]`)."""


def _flow_keys(seeds: dict) -> dict:
    return {k: _KeyData(v) if isinstance(v, list) else v for k, v in seeds.items()}


class _Inline(dict):
    """A short mapping written on one line (`draw: {stream: noise, from: enc}`)."""


class _SpecDumper(yaml.SafeDumper):
    """safe_dump, writing _KeyData and _Inline on one line."""


_SpecDumper.add_representer(
    _KeyData, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)
_SpecDumper.add_representer(
    _Inline, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)
)


def _takes_rngs_keyword(factory) -> bool:
    try:
        # (an nnx.Module class's own signature is its metaclass's (*args, **kwargs): read its __init__)
        fn = factory
        if isinstance(factory, type):
            fn = next((vars(k)["__init__"] for k in factory.__mro__ if "__init__" in vars(k)), factory)
        return "rngs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def example_inputs(inputs: list[InputSpec]) -> tuple[tuple, dict]:
    """--input arguments as arrays of ones; one that cannot be made is the option's error."""
    import jax.numpy as jnp

    out: tuple = ()
    kw: dict = {}
    for i in inputs:
        try:
            a = jnp.ones(i.shape, i.dtype)
        except Exception as e:  # noqa: BLE001 (out of memory, a shape JAX refuses)
            raise UsageError(f"--input {i.text}: cannot make it ({type(e).__name__}: {first_line(e)[:120]})") from None
        if i.name is None:
            out += (a,)
        else:
            kw[i.name] = a
    return out, kw


def _unpack(made, target: CodeRef):
    from flax import nnx

    from .target import unpack_made

    return unpack_made(made, nnx.Module, target, "(rngs)", "an nnx.Module")


def check_replay(
    spec_text: str, records: list[dict], target: str, lanes: bool = False
) -> tuple[list[Site], tuple[int, ...] | None]:
    """derive of the spec against what NNX handed out, key by key in order; the sites (from the replay, which
    names each key's site) and the steps made in eval mode if every one agrees, else an error and nothing
    written."""
    from ..engine.nnx import derive_nnx
    from ..errors import InternalError
    from ..spec.parse import parse_spec

    try:
        spec = parse_spec(spec_text, "<captured spec>")
        report = derive_nnx(spec, values=False)  # type: ignore[arg-type]
    except RngauditError as e:
        raise InternalError(
            f"capture of {target}: the generated NNX spec does not replay ({e}); please report this model"
        ) from None
    # (a bridge.ToNNX's Linen keys are checked against Linen by the capture of its module)
    # (a key given to a Dropout's call is drawn from no stream: NNX hands it out nowhere capture records)
    calls = [c for c in report.calls if not c.derivation.linen and not c.derivation.given]
    sites = nnx_sites(report)
    if lanes:
        # under transforms NNX hands out a draw's keys lane by lane, in JAX's order, and a stream nnx.vmap
        # broadcasts once for all lanes: compared step by step, in one order (as for a bridge.ToNNX's own streams,
        # whose keys do not depend on when it is initialised)
        calls = [c for c in calls if not ("vmap" in c.derivation.broadcast and c.derivation.lane > 0)]
        calls.sort(key=lambda c: (c.derivation.step, c.derivation.tag, c.derivation.count, tuple(c.key)))
        records = sorted(records, key=lambda r: (r["step"], r["tag"], r["count"], r["key"]))
    for i, (c, r) in enumerate(zip(calls, records)):
        d = c.derivation
        if (d.step, d.tag, d.count, tuple(c.key)) != (r["step"], r["tag"], r["count"], r["key"]):
            when = lambda step: "construction" if step == 0 else f"step {step}"
            where = (
                f"NNX drew it at {when(r['step'])}, the replay at {when(d.step)}"
                if d.step != r["step"]
                else f"NNX handed out {list(r['key'])}, the replay gives {list(c.key)} at {d.site}"
            )
            raise UnsupportedError(
                f"capture of {target}: the NNX spec does not reproduce key {i} ({when(r['step'])}, stream "
                f"{r['tag']!r} count {r['count']}): {where}; the model does something capture cannot express yet "
                "(it draws keys capture does not see drawn where they are), so no spec was written"
            )
    if len(calls) != len(records):
        raise UnsupportedError(
            f"capture of {target}: NNX handed out {len(records)} keys and the captured spec replays {len(calls)}; "
            "no spec was written"
        )
    return sites, report.spec.eval_steps


def nnx_sites(report) -> list[Site]:
    """An NNX derive report's keys as call sites (path: the site's parts; step, stream path and chain kept)."""
    return [
        Site(
            tuple(c.derivation.site.split(".")),
            c.derivation.requested,
            c.derivation.tag,
            c.derivation.count,
            c.derivation.linen_lane or ((c.derivation.lane,) if c.derivation.lane >= 0 else ()),
            tuple(c.key),
            c.derivation.kind,
            c.derivation.label,
            ("stale_call",) if c.derivation.stale else (),  # (a jitted step whose returned state is dropped)
            None,
            c.derivation.step,
            c.derivation.stream,
            c.derivation.chain,
            c.derivation.iteration,
        )
        for c in report.calls
    ]
