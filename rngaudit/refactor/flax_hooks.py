"""Observe real Flax while it runs a model: every key it hands out, and the module/transform tree around it."""
from __future__ import annotations

# This module imports Flax and JAX at import time; only `capture` imports it, lazily.
#
# How keys are captured (the same technique as tests/flax_oracle.py): Scope.make_rng, Scope.param,
# Scope.variable, Module.__post_init__, the lifting functions of flax.core.lift (vmap, scan, jit,
# checkpoint, fold_rngs, map_variables, cond, switch, while_loop), flax.core.axes_scan.scan and
# flax.linen.transforms.fork_rngs are wrapped; each wrapper calls the original with the same arguments,
# except additions that cannot change a key: nn.vmap gets an `axis_name` (when it has none) so a lane
# can ask `jax.lax.axis_index`; the scan body gets one extra scanned input, `arange(length)`, its step
# index; nn.while_loop's carry gets one more value, the iteration index (the carry starts behind
# `jax.lax.optimization_barrier`, so XLA cannot work out a trip count and skip evaluating cond); and
# when capture runs the model again to see the other nn.cond/switch branches run, their predicate or
# index is replaced (every branch is traced whatever it is, so no count moves). At TRACE time every
# make_rng becomes an event (path, stream requested and used, the count Flax hashed, the transforms
# around it); its VALUE is recorded at RUN time by `jax.debug.callback`, once per vmap lane / scan step
# that really runs. Keys inside nn.jit are attributed to the fork whose key they derive from.
#
# The wrappers are installed once and pass straight through unless a capture is active, because a
# class-level `nn.jit(Block)` made while capturing keeps a reference to the lifting function.
import contextlib
import functools
import inspect
import itertools
from dataclasses import dataclass, field

import flax.linen as nn
import flax.linen.transforms as linen_transforms
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import axes_scan, lift
from flax.core.scope import Scope, in_filter, is_filter_empty

from ..errors import SpecError


class CaptureUnsupported(SpecError):
    """The model uses something capture cannot describe as a spec (yet)."""


# ---------------------------------------------------------------- the recorded structure
@dataclass(eq=False)
class Event:
    """One make_rng as Flax traced it."""

    seq: int
    path: tuple
    requested: str
    stream: str
    count: int
    frames: tuple
    init_col: str | None  # the collection whose variable this key initialises (params: a param)
    var_name: str | None  # the param / variable name
    fork: bool  # made by nn.jit / nn.fold_rngs' fork_rngs
    call_seq: int | None = None
    discarded: bool = False

    @property
    def branch(self) -> tuple:
        """The nn.cond/switch branches this key is traced in: ((statement, branch), ...), outermost first."""
        return tuple((f.stmt, f.branch) for f in self.frames if isinstance(f, _BranchFrame))

    @property
    def jit(self):
        return next((f for f in reversed(self.frames) if isinstance(f, _JitFrame)), None)

    @property
    def jit_depth(self) -> int:
        return sum(1 for f in self.frames if isinstance(f, _JitFrame))


@dataclass(eq=False)
class CallNode:
    """A method call of the module at `path` (or its setup()): what happened at its scope, in order."""

    seq: int
    path: tuple
    cls: str | None
    method: str
    items: list = field(default_factory=list)  # Event | CallNode | LiftNode | ("define", name)


@dataclass(eq=False)
class LiftNode:
    """One call of a lifted transform at a module's scope, and the traces of its body."""

    seq: int
    kind: str
    options: dict
    traces: list = field(default_factory=list)


FLOW = ("cond", "switch", "while_loop")  # lifted inside a method: statements, not class transforms


@dataclass(eq=False)
class TraceNode:
    """One trace of a lifted body (nn.scan's constancy check traces twice). A branch of nn.cond/switch or
    the cond/body of nn.while_loop runs at the scope of the module that calls it: `owner_path` is that
    module's path, and `label` which branch (0, 1, ...) or part ("cond", "body") it is."""

    items: list = field(default_factory=list)
    owner_path: tuple | None = None
    label: object = None


@dataclass(frozen=True)
class ModuleInfo:
    path: tuple
    cls: str
    naming: str  # root | auto | explicit | setup
    fields: str  # the module's hyper-parameters, to recognise it after a rename


# ---------------------------------------------------------------- frames (for runtime attribution)
@dataclass(eq=False)
class _VmapFrame:
    name: str
    context = "vmap"

    def index(self):
        return jax.lax.axis_index(self.name)


@dataclass(eq=False)
class _ScanFrame:
    idx: object
    constancy: bool
    broadcast: object
    context = "scan"

    def index(self):
        return self.idx


@dataclass(eq=False)
class _JitFrame:
    path: tuple
    forks: dict
    context = "jit"


@dataclass(eq=False)
class _WhileFrame:
    idx: object  # the iteration index capture carries beside the loop's own carry
    context = "while_loop"

    def index(self):
        return self.idx


@dataclass(eq=False)
class _BranchFrame:
    stmt: int  # which nn.cond/switch call of the run (trace order, the same in every run)
    branch: int
    context: str  # cond | switch


@dataclass(eq=False)
class _MapFrame:
    run1: bool  # map_variables(init=True)'s first run: only the variables it creates are kept
    context = "map_variables"


_LANES = (_VmapFrame, _ScanFrame, _WhileFrame)


def _concrete(x) -> bool:
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


def _discarded(frames, init_col) -> bool:
    # mirrors flax/core/axes_scan.py: the constancy-check trace's outputs are thrown away, except the
    # initial values of broadcast variables
    # and flax/linen/transforms.py map_variables: with init=True the first run only creates variables
    for f in frames:
        if isinstance(f, _ScanFrame) and f.constancy:
            if init_col is None or not in_filter(f.broadcast, init_col):
                return True
        elif isinstance(f, _MapFrame) and f.run1 and init_col is None:
            return True
    return False


class Recorder:
    """Trace-time events, the call tree, and the runtime values of keys."""

    def __init__(self):
        self.events: dict[int, Event] = {}
        self._seq = itertools.count()
        self.frames: list = []
        self.inits: list = []  # (collection, name) of the param/variable being created
        self.fork_stack: list = []
        self.pending_scan: list = []
        self.pending_forks: list = []
        self.fired: list = []
        self.recording = False
        self._axis_names = itertools.count()
        self.root = TraceNode()
        self.stack: list = [self.root]
        self.modules: dict[tuple, ModuleInfo] = {}
        self.setups: list[CallNode] = []
        self.selection: dict[int, int] = {}  # nn.cond/switch call -> the branch to run instead
        self.branch_calls = itertools.count()
        self.loop_iterations: dict[tuple, set] = {}  # a while_loop's (owner path, ordinal) -> counts run

    def next_seq(self) -> int:
        return next(self._seq)

    @contextlib.contextmanager
    def frame(self, f):
        self.frames.append(f)
        try:
            yield
        finally:
            self.frames.pop()

    @contextlib.contextmanager
    def push(self, node):
        self.stack.append(node)
        try:
            yield node
        finally:
            self.stack.pop()

    # ---------------------------------------------------------- the call tree
    def _container(self, path: tuple):
        """Where a call of the module at `path` belongs: its parent's call, or the trace it runs in."""
        for node in reversed(self.stack):
            if isinstance(node, TraceNode):
                return node
            if isinstance(node, CallNode) and node.path == path[:-1]:
                return node
        return self.root

    def _owner(self, path: tuple):
        """The call node whose scope an event at `path` belongs to."""
        for node in reversed(self.stack):
            if isinstance(node, CallNode) and node.path == path:
                return node
            if isinstance(node, TraceNode):
                if node.owner_path == path:
                    return node  # a make_rng of the module an nn.cond/switch/while_loop branch runs on
                break
        raise CaptureUnsupported(f"a key was drawn at scope {'/'.join(path) or '(root)'} from outside a method of "
                                 "that module (e.g. a parent calling the child's make_rng, or nn.share_scope); "
                                 "capture cannot describe that as a spec")

    def owner_of_lift(self, scopes):
        """The call node of the module a lifted transform runs for. A class transform's method is not
        seen by the interceptor: its call node is made here, from the scope the transform lifts."""
        leaves = jax.tree_util.tree_leaves(scopes, is_leaf=lambda s: isinstance(s, Scope))
        first = next((s for s in leaves if isinstance(s, Scope)), None)
        top = self.stack[-1]
        if first is None:
            if isinstance(top, CallNode):
                return top
            raise CaptureUnsupported("a lifted transform called outside a module method")
        path = tuple(first.path)
        if isinstance(top, CallNode) and top.path == path:
            return top
        info = self.modules.get(path)
        node = CallNode(self.next_seq(), path, info.cls if info is not None else None, "__call__")
        self._container(path).items.append(node)
        return node

    def intercept(self, next_fun, args, kwargs, context):
        m = context.module
        scope = m.scope
        if scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(scope.path)
        method = context.method_name
        top = self.stack[-1]
        if isinstance(top, CallNode) and top.path == path:
            return next_fun(*args, **kwargs)  # a method calling another method of the same module
        node = CallNode(self.next_seq(), path, type(m).__name__, method)
        self.modules.setdefault(path, ModuleInfo(path, type(m).__name__, "root" if not path else "explicit",
                                                 _fields(m)))
        if method == "setup":
            self.setups.append(node)
        self._container(path).items.append(node)
        with self.push(node):
            return next_fun(*args, **kwargs)

    def post_init(self, module, name_before, parent_setup: bool, parent_compact: bool):
        scope = getattr(module, "scope", None)
        if scope is None or module.name is None:
            return
        path = tuple(scope.path)
        naming = "setup" if parent_setup else ("auto" if name_before is None and parent_compact else "explicit")
        self.modules.setdefault(path, ModuleInfo(path, type(module).__name__, naming, _fields(module)))
        if parent_setup:
            top = self.stack[-1]
            if isinstance(top, CallNode) and top.method == "setup" and top.path == path[:-1]:
                if ("define", module.name) not in top.items:
                    top.items.append(("define", module.name))

    # ---------------------------------------------------------- events
    def make_rng(self, scope, name, key) -> None:
        used = name if name in scope.rngs else "params"
        init_col, var_name = self.inits[-1] if self.inits else (None, None)
        ev = Event(self.next_seq(), tuple(scope.path), name, used, int(scope.rng_counters[used]),
                   tuple(self.frames), init_col, var_name, bool(self.fork_stack))
        if self.fork_stack:
            self.fork_stack[-1].append(ev)
        else:
            self._owner(ev.path).items.append(ev)
        self.events[ev.seq] = ev
        ev.discarded = _discarded(ev.frames, init_col)
        self._emit(ev, key)

    def _emit(self, ev: Event, key) -> None:
        if ev.discarded and not ev.fork:
            return
        frames = ev.frames
        j = max((i for i, f in enumerate(frames) if isinstance(f, _JitFrame)), default=-1)
        lanes = [f.index() for f in frames[j + 1:]
                 if isinstance(f, _LANES) and not (isinstance(f, _ScanFrame) and f.constancy)]
        args = [jax.random.key_data(key)]
        if lanes:
            args.append(jnp.stack([jnp.asarray(i, jnp.int32) for i in lanes]))
        if j >= 0:
            args.append(jax.random.key_data(frames[j].forks[ev.stream]))
        fire = functools.partial(self._fire, ev.seq, bool(lanes), j >= 0)
        if _concrete(args):
            fire(*args)
        else:
            jax.debug.callback(fire, *args)

    def _fire(self, seq, has_lanes, has_fork, data, *rest) -> None:
        if not self.recording:
            return
        rest = list(rest)
        lanes = tuple(int(i) for i in np.asarray(rest.pop(0)).ravel()) if has_lanes else ()
        fork = tuple(int(w) for w in np.asarray(rest.pop(0)).ravel()) if has_fork else ()
        self.fired.append((seq, tuple(int(w) for w in np.asarray(data).ravel()), lanes, fork))

    def branches_traced_and_run(self) -> tuple[set, set]:
        """The nn.cond/switch branch paths in which a kept key was traced, and those in which one ran."""
        traced = {ev.branch for ev in self.events.values() if ev.branch and not (ev.discarded and not ev.fork)}
        ran = {self.events[seq].branch for seq, *_ in self.fired if self.events[seq].branch}
        return traced, ran

    def signature(self) -> list:
        """What was traced, in order: the same in every run when branch choices do not change the trace."""
        return [(ev.path, ev.requested, ev.stream, ev.count, ev.branch, ev.discarded)
                for _, ev in sorted(self.events.items())]

    def records(self) -> list[dict]:
        """Every key that ran, attributed (inside a jit: to the fork it derives from) and ordered."""
        groups: dict = {}
        for seq, data, lanes, fork in self.fired:
            seen = groups.setdefault((seq, lanes, fork), data)
            if seen != data:
                raise CaptureUnsupported(f"two different keys for one call site (event {seq}, lane {lanes})")
        forks: dict = {}
        out: dict = {}
        for (seq, lanes, fork), key in sorted(groups.items(), key=lambda kv: (
                self.events[kv[0][0]].jit_depth, kv[0][0], kv[0][1])):
            ev = self.events[seq]
            jit = ev.jit
            if jit is None:
                places = [((), ev.path, lanes)]
            else:
                cands = [f for f in forks.get((ev.stream, fork), ()) if f["event"].jit_depth == ev.jit_depth - 1]
                if not cands:
                    raise CaptureUnsupported(f"a key inside nn.jit/fold_rngs at {'/'.join(ev.path)} could not be "
                                             "attributed to the fork it derives from")
                rel = ev.path[len(jit.path):]
                places = [(f["call"], f["path"] + rel, f["lane"] + lanes) for f in cands]
            for prefix, path, lane in places:
                order = prefix + (seq,) + lane
                rec = {"path": path, "requested": ev.requested, "stream": ev.stream, "count": ev.count,
                       "lane": lane, "key": key, "order": order, "event": ev}
                if ev.fork:
                    rec["call"] = prefix + (ev.call_seq,)
                    forks.setdefault((ev.stream, key), []).append(rec)
                out.setdefault(order, rec)
        return [r for _, r in sorted(out.items()) if not r["event"].discarded]


def _fields(module) -> str:
    """The module's own hyper-parameters (dataclass fields other than parent and name)."""
    import dataclasses

    parts = []
    for f in dataclasses.fields(module):
        if f.name in ("parent", "name") or not f.init:
            continue
        v = getattr(module, f.name, None)
        if isinstance(v, nn.Module):
            v = type(v).__name__
        text = repr(v)
        if " at 0x" in text:
            text = text.split(" at 0x")[0] + ">"
        parts.append(f"{f.name}={text}")
    return f"{type(module).__name__}({', '.join(parts)})"


# ---------------------------------------------------------------- the hooks
ACTIVE: list[Recorder] = []
_ORIG: dict = {}
_UNSUPPORTED = ("vjp", "jvp", "custom_vjp")


def _bind(fn, args, kwargs) -> dict:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _rec() -> Recorder | None:
    return ACTIVE[-1] if ACTIVE else None


def _axis_size(in_axes, args) -> int | None:
    axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    for ax, x in zip(axes, args):
        if ax is None or ax is axes_scan.broadcast:
            continue
        for leaf in jax.tree_util.tree_leaves(x):
            if hasattr(leaf, "shape") and len(leaf.shape) > ax:
                return int(leaf.shape[ax])
    return None


def install() -> None:
    """Wrap Flax's functions once; the wrappers pass through while no capture is active."""
    if _ORIG:
        return
    _ORIG.update({
        "make_rng": Scope.make_rng, "param": Scope.param, "variable": Scope.variable,
        "post_init": nn.Module.__post_init__,
        "vmap": lift.vmap, "scan": lift.scan, "jit": lift.jit, "fold_rngs": lift.fold_rngs,
        "checkpoint": lift.checkpoint, "axes_scan": axes_scan.scan, "fork_rngs": linen_transforms.fork_rngs,
        "map_variables": lift.map_variables, "cond": lift.cond, "switch": lift.switch,
        "while_loop": lift.while_loop,
    })
    for name in _UNSUPPORTED:
        _ORIG[name] = getattr(lift, name)
    orig = _ORIG

    def make_rng(scope, name="params"):
        key = orig["make_rng"](scope, name)
        rec = _rec()
        if rec is not None:
            rec.make_rng(scope, name, key)
        return key

    def param(scope, name, init_fn, *args, **kwargs):
        rec = _rec()
        if rec is None:
            return orig["param"](scope, name, init_fn, *args, **kwargs)
        rec.inits.append(("params", name))
        try:
            return orig["param"](scope, name, init_fn, *args, **kwargs)
        finally:
            rec.inits.pop()

    def variable(scope, col, name, *args, **kwargs):
        rec = _rec()
        if rec is None:
            return orig["variable"](scope, col, name, *args, **kwargs)
        rec.inits.append((col, name))
        try:
            return orig["variable"](scope, col, name, *args, **kwargs)
        finally:
            rec.inits.pop()

    def post_init(self):
        rec = _rec()
        if rec is None:
            return orig["post_init"](self)
        name_before = self.name
        out = orig["post_init"](self)
        # the parent is only known after Flax's __post_init__ (it is taken from the module stack there)
        parent = self.parent
        is_mod = isinstance(parent, nn.Module)
        parent_setup = bool(is_mod and parent._state.in_setup)
        parent_compact = bool(is_mod and parent._state.in_compact_method)
        rec.post_init(self, name_before, parent_setup, parent_compact)
        return out

    def lifted(kind, a, inner, options):
        @functools.wraps(inner)
        def call(*xs, **kw):
            rec = _rec()
            if rec is None:
                return inner(*xs, **kw)
            opts = dict(options)
            if kind == "vmap" and opts.get("axis_size") is None:
                opts["axis_size"] = _axis_size(a["in_axes"], xs[1:])
            node = LiftNode(rec.next_seq(), kind, opts)
            owner = rec.owner_of_lift(xs[0] if xs else None)
            owner.items.append(node)
            if kind in ("jit", "fold_rngs"):
                call_seq = rec.next_seq()
                for ev in rec.pending_forks:
                    ev.call_seq = call_seq
                rec.pending_forks = []
            with rec.push(node):
                if kind == "scan":
                    rec.pending_scan.append(a["variable_broadcast"])
                try:
                    return inner(*xs, **kw)
                finally:
                    if kind == "scan":
                        rec.pending_scan.pop()

        return call

    def traced(fn, extra=None):
        @functools.wraps(fn)
        def body(*xs, **kw):
            rec = _rec()
            if rec is None:
                return fn(*xs, **kw)
            node = rec.stack[-1]
            trace = TraceNode()
            if isinstance(node, LiftNode):
                node.traces.append(trace)
            with rec.push(trace), (rec.frame(extra(xs)) if extra else contextlib.nullcontext()):
                return fn(*xs, **kw)

        return body

    @functools.wraps(orig["vmap"])
    def vmap(fn, *args, **kwargs):
        if _rec() is None:
            return orig["vmap"](fn, *args, **kwargs)
        a = _bind(orig["vmap"], (fn,) + args, kwargs)
        if a["axis_name"] is None:
            a["axis_name"] = f"_rngaudit_lane_{next(_rec()._axis_names)}"
        name = a["axis_name"]
        a["fn"] = traced(fn, lambda xs: _VmapFrame(name))
        opts = {"axis_size": a["axis_size"], "split_rngs": a["split_rngs"], "variable_axes": a["variable_axes"]}
        return lifted("vmap", a, orig["vmap"](**a), opts)

    @functools.wraps(orig["scan"])
    def scan(fn, *args, **kwargs):
        if _rec() is None:
            return orig["scan"](fn, *args, **kwargs)
        a = _bind(orig["scan"], (fn,) + args, kwargs)
        a["fn"] = traced(fn)
        opts = {k: a[k] for k in ("length", "split_rngs", "variable_axes", "variable_broadcast", "variable_carry",
                                  "check_constancy_invariants")}
        return lifted("scan", a, orig["scan"](**a), opts)

    def axes_scan_fn(fn, in_axes, out_axes, length=None, reverse=False, unroll=1, _split_transpose=False,
                     check_constancy_invariants=True):
        rec = _rec()
        if rec is None:
            return orig["axes_scan"](fn, in_axes, out_axes, length=length, reverse=reverse, unroll=unroll,
                                     _split_transpose=_split_transpose,
                                     check_constancy_invariants=check_constancy_invariants)
        broadcast = rec.pending_scan[-1] if rec.pending_scan else False
        traces = [0]
        holder = {"length": length}

        def body(broadcast_in, carry, step, *xs):
            traces[0] += 1
            constancy = check_constancy_invariants and traces[0] == 1
            with rec.frame(_ScanFrame(step, constancy, broadcast)):
                return fn(broadcast_in, carry, *xs)

        def run(broadcast_in, init, *args):
            n = holder["length"] if holder["length"] is not None else _axis_size(tuple(in_axes), args)
            if n is None:
                raise CaptureUnsupported("nn.scan whose length cannot be told from its inputs")
            node = next((x for x in reversed(rec.stack) if isinstance(x, LiftNode)), None)
            if node is not None and node.kind == "scan":
                node.options["length"] = n
            traces[0] = 0
            inner = orig["axes_scan"](body, (0,) + tuple(in_axes), out_axes, length=n, reverse=reverse,
                                      unroll=unroll, _split_transpose=_split_transpose,
                                      check_constancy_invariants=check_constancy_invariants)
            return inner(broadcast_in, init, jnp.arange(n, dtype=jnp.int32), *args)

        return run

    def forked(kind):
        @functools.wraps(orig[kind])
        def transform(fn, *args, **kwargs):
            if _rec() is None:
                return orig[kind](fn, *args, **kwargs)
            a = _bind(orig[kind], (fn,) + args, kwargs)

            def body(scope, hash_key, *xs, **kw):
                rec = _rec()
                first = jax.tree_util.tree_leaves(scope, is_leaf=lambda s: isinstance(s, Scope))[0]
                frame = _JitFrame(tuple(first.path), {s: lz.rng for s, lz in first.rngs.items()})
                with rec.frame(frame):
                    return fn(scope, hash_key, *xs, **kw)

            inner = orig[kind](traced(functools.wraps(fn)(body)), *args, **kwargs)
            return lifted(kind, a, inner, {"rngs": a["rngs"]})

        return transform

    @functools.wraps(orig["checkpoint"])
    def checkpoint(fn, *args, **kwargs):
        if _rec() is None:
            return orig["checkpoint"](fn, *args, **kwargs)
        a = _bind(orig["checkpoint"], (fn,) + args, kwargs)
        a["fn"] = traced(fn)
        return lifted("remat", a, orig["checkpoint"](**a), {"rngs": a["rngs"]})

    @functools.wraps(orig["map_variables"])
    def map_variables(fn, *args, **kwargs):
        if _rec() is None:
            return orig["map_variables"](fn, *args, **kwargs)
        a = _bind(orig["map_variables"], (fn,) + args, kwargs)
        runs = [0]

        def body(scopes, *xs, **kw):
            runs[0] += 1
            leaves = jax.tree_util.tree_leaves(scopes, is_leaf=lambda s: isinstance(s, Scope))
            # mirrors flax/core/lift.py map_variables: init=True with a mutable collection runs fn twice
            run1 = bool(a["init"]) and runs[0] == 1 and any(not is_filter_empty(s.mutable) for s in leaves)
            with _rec().frame(_MapFrame(run1)):
                return fn(scopes, *xs, **kw)

        a["fn"] = traced(functools.wraps(fn)(body))
        opts = {k: a[k] for k in ("mapped_collections", "init", "mutable", "rngs", "variables")}
        return lifted("map_variables", a, orig["map_variables"](**a), opts)

    def branching(kind, index, fns, scope, call, kw):
        """nn.cond / nn.switch: every branch is traced, in order; each trace is recorded at the calling
        module's scope. A re-run may force the branch that runs (`Recorder.selection`)."""
        rec = _rec()
        stmt = next(rec.branch_calls)
        owner = rec.owner_of_lift(scope)
        node = LiftNode(rec.next_seq(), kind, {"rngs": kw.get("rngs", True), "variables": kw.get("variables", True),
                                               "branches": len(fns)})
        owner.items.append(node)
        pick = rec.selection.get(stmt)
        if pick is not None:
            index = jnp.asarray(pick == 0) if kind == "cond" else jnp.asarray(pick, jnp.int32)

        def tagged(k, fn):
            @functools.wraps(fn)
            def branch(scope, *xs):
                trace = TraceNode(owner_path=owner.path, label=k)
                node.traces.append(trace)
                with rec.push(trace), rec.frame(_BranchFrame(stmt, k, kind)):
                    return fn(scope, *xs)

            return branch

        with rec.push(node):
            return call(index, [tagged(k, f) for k, f in enumerate(fns)])

    @functools.wraps(orig["cond"])
    def cond(pred, true_fun, false_fun, scope, *operands, **kw):
        if _rec() is None:
            return orig["cond"](pred, true_fun, false_fun, scope, *operands, **kw)
        return branching("cond", pred, (true_fun, false_fun), scope,
                         lambda p, fns: orig["cond"](p, fns[0], fns[1], scope, *operands, **kw), kw)

    @functools.wraps(orig["switch"])
    def switch(index, branches, scope, *operands, **kw):
        if _rec() is None:
            return orig["switch"](index, branches, scope, *operands, **kw)
        return branching("switch", index, tuple(branches), scope,
                         lambda i, fns: orig["switch"](i, fns, scope, *operands, **kw), kw)

    @functools.wraps(orig["while_loop"])
    def while_loop(cond_fn, body_fn, scope, init, *args, **kwargs):
        rec = _rec()
        if rec is None:
            return orig["while_loop"](cond_fn, body_fn, scope, init, *args, **kwargs)
        a = _bind(orig["while_loop"], (cond_fn, body_fn, scope, init) + args, kwargs)
        owner = rec.owner_of_lift(scope)
        ordinal = sum(1 for x in owner.items if isinstance(x, LiftNode) and x.kind == "while_loop")
        loop = (owner.path, ordinal)
        node = LiftNode(rec.next_seq(), "while_loop", {"split_rngs": a["split_rngs"], "loop": loop})
        owner.items.append(node)

        def looped(fn, part):
            def step(scope, c):
                carry, i = c
                trace = TraceNode(owner_path=owner.path, label=part)
                node.traces.append(trace)
                with rec.push(trace), rec.frame(_WhileFrame(i)):
                    out = fn(scope, carry)
                return out if part == "cond" else (out, i + 1)

            return step

        def note(n):
            if rec.recording:
                rec.loop_iterations.setdefault(loop, set()).update(int(v) for v in np.asarray(n).ravel())

        a["init"] = jax.lax.optimization_barrier((init, jnp.asarray(0, jnp.int32)))
        a["cond_fn"], a["body_fn"] = looped(cond_fn, "cond"), looped(body_fn, "body")
        with rec.push(node):
            out, n = orig["while_loop"](**a)
        if _concrete(n):
            note(n)
        else:
            jax.debug.callback(note, n)
        return out

    def unsupported(name):
        @functools.wraps(orig[name])
        def transform(*args, **kwargs):
            if _rec() is not None:
                raise CaptureUnsupported(f"capture does not describe nn.{name} yet; write that part of the "
                                         "model's spec by hand (see README, Lifted transforms)")
            return orig[name](*args, **kwargs)

        return transform

    @contextlib.contextmanager
    def fork_rngs(module):
        rec = _rec()
        if rec is None:
            with orig["fork_rngs"](module):
                yield
            return
        forks: list = []
        rec.fork_stack.append(forks)
        try:
            cm = orig["fork_rngs"](module)
            cm.__enter__()
        finally:
            rec.fork_stack.pop()
        rec.pending_forks = forks
        try:
            yield
        except BaseException as e:  # noqa: BLE001 - re-raised unless the original swallows it
            if not cm.__exit__(type(e), e, e.__traceback__):
                raise
        else:
            cm.__exit__(None, None, None)

    Scope.make_rng, Scope.param, Scope.variable = make_rng, param, variable
    nn.Module.__post_init__ = post_init
    lift.vmap, lift.scan, lift.checkpoint = vmap, scan, checkpoint
    lift.remat = checkpoint
    lift.jit, lift.fold_rngs = forked("jit"), forked("fold_rngs")
    lift.map_variables, lift.cond, lift.switch, lift.while_loop = map_variables, cond, switch, while_loop
    axes_scan.scan = axes_scan_fn
    linen_transforms.fork_rngs = fork_rngs
    for name in _UNSUPPORTED:
        setattr(lift, name, unsupported(name))


@contextlib.contextmanager
def recording(selection: dict | None = None):
    """Record everything Flax does inside the block; `selection` forces nn.cond/switch calls (by their
    order in the trace) to run the given branch."""
    install()
    rec = Recorder()
    rec.selection = dict(selection or {})
    ACTIVE.append(rec)
    # nn.jit/fold_rngs keep traces in a global cache: a cached call would replay without telling us
    lift._side_effect_cache.cache.clear()
    try:
        with nn.intercept_methods(rec.intercept):
            yield rec
    finally:
        ACTIVE.remove(rec)
        rec.recording = False
        lift._side_effect_cache.cache.clear()
