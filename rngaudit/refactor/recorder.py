"""What capture records while real Flax runs a model: the call tree of modules and lifted transforms, every
make_rng as a trace-time event, and the keys that really ran, attributed to their call site and lane."""

from __future__ import annotations

# At TRACE time every make_rng becomes an event (path, stream requested and used, the count Flax hashed,
# the transforms around it); its VALUE is recorded at RUN time by `jax.debug.callback`, once per vmap lane /
# scan step that really runs. Keys inside nn.jit are attributed to the fork whose key they derive from.
# (The hooks that feed the recorder are rngaudit.refactor.flax_hooks.)
import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import Scope, in_filter
from jax._src import core as jax_core

from ..errors import UnsupportedError


class CaptureUnsupported(UnsupportedError):
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
        return tuple((f.stmt, f.branch) for f in self.frames if isinstance(f, BranchFrame))

    @property
    def jit(self):
        return next((f for f in reversed(self.frames) if isinstance(f, JitFrame)), None)

    @property
    def jit_depth(self) -> int:
        return sum(1 for f in self.frames if isinstance(f, JitFrame))


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
    options: dict = field(default_factory=dict)  # its plain-valued fields (features: 4), for a spec's layer statement
    origin: str = ""  # the Python module its class comes from (flax.linen.linear for nn.Dense)


# ---------------------------------------------------------------- frames (for runtime attribution)
@dataclass(eq=False)
class VmapFrame:
    name: str
    context = "vmap"

    def index(self):
        return jax.lax.axis_index(self.name)


@dataclass(eq=False)
class ScanFrame:
    idx: object
    constancy: bool
    broadcast: Any  # the scan's variable_broadcast filter
    context = "scan"

    def index(self):
        return self.idx


@dataclass(eq=False)
class JitFrame:
    path: tuple
    forks: dict
    context = "jit"


@dataclass(eq=False)
class WhileFrame:
    idx: object  # the iteration index capture carries beside the loop's own carry
    context = "while_loop"

    def index(self):
        return self.idx


@dataclass(eq=False)
class BranchFrame:
    stmt: int  # which nn.cond/switch call of the run (trace order, the same in every run)
    branch: int
    context: str  # cond | switch


@dataclass(eq=False)
class MapFrame:
    run1: bool  # map_variables(init=True)'s first run: only the variables it creates are kept
    context = "map_variables"


_LANES = (VmapFrame, ScanFrame, WhileFrame)


def _current_trace():
    """The JAX trace now in effect (its identity only), or None where this JAX does not say (then every key
    callback is its own)."""
    ctx = getattr(jax_core, "trace_ctx", None)
    return getattr(ctx, "trace", None)


@dataclass(eq=False)
class _Batch:
    """The key callbacks made directly in one traced body (not in a transform nested in it), sent as one
    `jax.debug.callback` when the body's trace ends: a scan of 1,000 remat blocks runs 1,000 host callbacks,
    not one per key per step."""

    trace: object
    parts: list = field(default_factory=list)  # (event seq, has lanes, has fork) per key
    args: list = field(default_factory=list)  # their arguments, 1 to 3 per key, in order


def is_concrete(x) -> bool:
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


def _discarded(frames, init_col) -> bool:
    # mirrors flax/core/axes_scan.py: the constancy-check trace's outputs are thrown away, except the
    # initial values of broadcast variables
    # and flax/linen/transforms.py map_variables: with init=True the first run only creates variables
    for f in frames:
        if isinstance(f, ScanFrame) and f.constancy:
            if init_col is None or not in_filter(f.broadcast, init_col):
                return True
        elif isinstance(f, MapFrame) and f.run1 and init_col is None:
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
        self.batches: list[_Batch] = []  # the traced bodies now running, innermost last
        self.mutable: list[str] | bool = False  # the collections apply made mutable (capture sets it)
        self.recording = False
        self.axis_names = itertools.count()
        self.root = TraceNode()
        self.stack: list = [self.root]
        self.modules: dict[tuple, ModuleInfo] = {}
        self.setups: list[CallNode] = []
        self.binding: list = []  # the modules whose __post_init__ is running, innermost last
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
    def batch(self):
        """Collect the key callbacks of one traced body and send them together when it returns."""
        trace = _current_trace()
        if trace is None:
            yield
            return
        b = _Batch(trace)
        self.batches.append(b)
        try:
            yield
        finally:
            self.batches.pop()
        if b.parts:  # one flat uint32 array: a host callback's cost is mostly per argument
            words = jnp.concatenate([jnp.ravel(a).astype(jnp.uint32) for a in b.args])
            sizes = tuple(int(np.prod(jnp.shape(a))) for a in b.args)
            jax.debug.callback(functools.partial(self._fire_batch, tuple(b.parts), sizes), words)

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
        raise CaptureUnsupported(
            f"a key was drawn at scope {'/'.join(path) or '(root)'} from outside a method of "
            "that module (e.g. a parent calling the child's make_rng, or nn.share_scope); "
            "capture cannot describe that as a spec"
        )

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
        if path not in self.modules:
            self.modules[path] = ModuleInfo(
                path, type(m).__name__, "root" if not path else "explicit", _fields(m), _options(m), type(m).__module__
            )
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
        if path not in self.modules:
            self.modules[path] = ModuleInfo(
                path, type(module).__name__, naming, _fields(module), _options(module), type(module).__module__
            )
        if parent_setup:
            top = self.stack[-1]
            if (
                isinstance(top, CallNode)
                and top.method == "setup"
                and top.path == path[:-1]
                and ("define", module.name) not in top.items
            ):
                top.items.append(("define", module.name))

    # ---------------------------------------------------------- events
    def make_rng(self, scope, name, key) -> None:
        used = name if name in scope.rngs else "params"
        init_col, var_name = self.inits[-1] if self.inits else (None, None)
        ev = Event(
            self.next_seq(),
            tuple(scope.path),
            name,
            used,
            int(scope.rng_counters[used]),
            tuple(self.frames),
            init_col,
            var_name,
            bool(self.fork_stack),
        )
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
        j = max((i for i, f in enumerate(frames) if isinstance(f, JitFrame)), default=-1)
        lanes = [
            f.index()
            for f in frames[j + 1 :]
            if isinstance(f, _LANES) and not (isinstance(f, ScanFrame) and f.constancy)
        ]
        args = [jax.random.key_data(key)]
        if lanes:
            args.append(jnp.stack([jnp.asarray(i, jnp.int32) for i in lanes]))
        if j >= 0:
            args.append(jax.random.key_data(frames[j].forks[ev.stream]))
        fire = functools.partial(self._fire, ev.seq, bool(lanes), j >= 0)
        if is_concrete(args):
            fire(*args)
        elif (
            self.batches
            and self.batches[-1].trace is _current_trace()
            and all(jnp.result_type(a) in (jnp.uint32, jnp.int32) for a in args)
        ):
            self.batches[-1].parts.append((ev.seq, bool(lanes), j >= 0))
            self.batches[-1].args.extend(args)
        else:  # a trace capture does not see begin (the model's own jax transform inside a module)
            jax.debug.callback(fire, *args)

    def _fire(self, seq, has_lanes, has_fork, data, *rest) -> None:
        if not self.recording:
            return
        more = list(rest)
        lanes = tuple(int(i) for i in np.asarray(more.pop(0)).ravel()) if has_lanes else ()
        fork = tuple(int(w) for w in np.asarray(more.pop(0)).ravel()) if has_fork else ()
        self.fired.append((seq, tuple(int(w) for w in np.asarray(data).ravel()), lanes, fork))

    def _fire_batch(self, parts, sizes, words) -> None:
        words = np.asarray(words).ravel()
        args, at = [], 0
        for n in sizes:
            args.append(words[at : at + n])
            at += n
        at = 0
        for seq, has_lanes, has_fork in parts:
            n = 1 + has_lanes + has_fork
            self._fire(seq, has_lanes, has_fork, *args[at : at + n])
            at += n

    def branches_traced_and_run(self) -> tuple[set, set]:
        """The nn.cond/switch branch paths in which a kept key was traced, and those in which one ran."""
        traced = {ev.branch for ev in self.events.values() if ev.branch and not (ev.discarded and not ev.fork)}
        ran = {self.events[seq].branch for seq, *_ in self.fired if self.events[seq].branch}
        return traced, ran

    def signature(self) -> list:
        """What was traced, in order: the same in every run when branch choices do not change the trace."""
        return [
            (ev.path, ev.requested, ev.stream, ev.count, ev.branch, ev.discarded)
            for _, ev in sorted(self.events.items())
        ]

    def records(self) -> list[dict]:
        """Every key that ran, attributed (inside a jit: to the fork it derives from) and ordered."""
        groups: dict = {}
        for seq, data, lanes, fork in self.fired:
            seen = groups.setdefault((seq, lanes, fork), data)
            if seen != data:
                raise CaptureUnsupported(f"two different keys for one call site (event {seq}, lane {lanes})")
        forks: dict = {}
        out: dict = {}
        for (seq, lanes, fork), key in sorted(
            groups.items(), key=lambda kv: (self.events[kv[0][0]].jit_depth, kv[0][0], kv[0][1])
        ):
            ev = self.events[seq]
            jit = ev.jit
            if jit is None:
                places = [((), ev.path, lanes)]
            else:
                cands = [f for f in forks.get((ev.stream, fork), ()) if f["event"].jit_depth == ev.jit_depth - 1]
                if not cands:
                    raise CaptureUnsupported(
                        f"a key inside nn.jit/fold_rngs at {'/'.join(ev.path)} could not be "
                        "attributed to the fork it derives from"
                    )
                rel = ev.path[len(jit.path) :]
                places = [(f["call"], f["path"] + rel, f["lane"] + lanes) for f in cands]
            for prefix, path, lane in places:
                order = prefix + (seq,) + lane
                rec = {
                    "path": path,
                    "requested": ev.requested,
                    "stream": ev.stream,
                    "count": ev.count,
                    "lane": lane,
                    "key": key,
                    "order": order,
                    "event": ev,
                }
                if ev.fork:
                    rec["call"] = prefix + (ev.call_seq,)
                    forks.setdefault((ev.stream, key), []).append(rec)
                out.setdefault(order, rec)
        return [r for _, r in sorted(out.items()) if not r["event"].discarded]


def _plain(v):
    """A field value a spec can hold (numbers, strings, booleans, tuples of them), else None."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    return None


def _own_fields(module):
    """(field, value) of the module's own hyper-parameters: dataclass fields other than parent and name."""
    import dataclasses

    for f in dataclasses.fields(module):
        if f.name not in ("parent", "name") and f.init:
            yield f, getattr(module, f.name, None)


def _options(module) -> dict:
    """The fields set to a plain value other than their default (a spec keeps what the user wrote)."""
    import dataclasses

    out = {}
    for f, v in _own_fields(module):
        plain = _plain(v)
        if plain is None and v is not None:
            continue
        if f.default is not dataclasses.MISSING and _plain(f.default) == plain:
            continue
        out[f.name] = plain
    return out


def _fields(module) -> str:
    """The module's own hyper-parameters (dataclass fields other than parent and name)."""
    parts = []
    for f, v in _own_fields(module):
        if isinstance(v, nn.Module):
            v = type(v).__name__
        text = repr(v)
        if " at 0x" in text:
            text = text.split(" at 0x")[0] + ">"
        parts.append(f"{f.name}={text}")
    return f"{type(module).__name__}({', '.join(parts)})"
