"""The oracle: builds a spec's model in real Flax, runs it, and records every key Flax hands out,
including the keys made inside lifted transforms (nn.vmap, nn.scan, nn.jit, nn.remat, nn.fold_rngs,
nn.map_variables, nn.remat_scan, nn.while_loop, nn.cond, nn.switch), lane by lane.

How keys are captured
---------------------
Flax's own objects are observed, never replaced: Scope.make_rng, Scope.param and Scope.variable are
wrapped, and so are the lifting functions in flax.core.lift (vmap, scan, jit, fold_rngs,
map_variables), flax.core.axes_scan.scan and flax.linen.transforms.fork_rngs, only to learn where a
make_rng happens. Each wrapper calls the original with the same arguments, except two additions that
cannot change any key: nn.vmap gets an `axis_name` (when it has none) so a lane can ask
`jax.lax.axis_index`, and the scan body gets one extra scanned input, `arange(length)`, its step index.

At TRACE time, each make_rng call becomes an event: path, stream requested, stream used (after the
`params` fallback), the scope's counter read right after the call (the count Flax hashed), and the
stack of transforms it sits in. The key Flax returned is often a tracer, so its VALUE is captured at
RUN time: `jax.debug.callback` receives the key data and the lane indices (vmap: axis_index; scan:
the step input; while_loop: the loop counter the oracle carries). The callback fires once per lane
that really runs, with the data that really flows, so:

* vmap lanes and scan steps come back one by one; an unsplit (broadcast) key is recorded once per
  lane because the lane index is a batched argument of the callback.
* the first, constancy-check trace of nn.scan is traced with pe.trace_to_jaxpr and thrown away: a
  callback on an unknown (per-step) value is never executed, and the oracle does not emit one there
  at all unless the key initialises a variable that survives that trace (a variable of a collection
  in `variable_broadcast`, in every enclosing scan in its first trace). Such a key is concrete (or
  depends only on enclosing transforms) and is recorded without the step of the checking scan. The
  first run of nn.map_variables(init=True) is treated the same way (its outputs are thrown away,
  the variables it creates are kept).
* nn.cond / nn.switch trace every branch but run one: the model runs again with other branch choices
  (pred / index per cond statement) until every branch in which a key was traced has run, and the
  keys of the branches that ran are merged (the traces, and so the counts, do not depend on the
  choice).
* nn.while_loop: the oracle carries (i, iterations) behind jax.lax.optimization_barrier. With a
  trip count XLA can work out, the CPU runtime runs the body that many times and never evaluates
  cond, so the cond's callbacks (and keys) would never run inside jit or scan.
* nn.jit / nn.fold_rngs: a jitted function may be REUSED from jax's cache (a second instance of the
  same jitted class with the same state), so Python never sees the make_rng calls of that call.
  Inside a jit the callback therefore also carries the fork key the jitted function received; the
  fork itself (a make_rng at the module's scope, outside the jitted function) is recorded, and each
  inner key is attributed to the fork(s) whose key it was derived from: path = that fork's path +
  the path below the jitted module, lane = that fork's lane + the lanes inside the jit. Lane indices
  of transforms outside a jit are never referenced inside it (that would close over outer tracers
  and change how jax caches the jitted function).

Each record: path, requested, stream, count, lane (outermost first), key (key data words),
discarded=False, and, where the spec draws values, value (and label for params).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import re
from dataclasses import dataclass, field

import flax
import flax.linen as nn
import flax.linen.transforms as linen_transforms
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import axes_scan, lift
from flax.core.scope import Scope, in_filter, is_filter_empty

from rngaudit.engine.lifts import module_shape
from rngaudit.spec import keyexpr
from rngaudit.spec import tree as _nodes
from rngaudit.spec.releases import LINEN_SINCE
from rngaudit.spec.tree import (
    Call,
    Child,
    Define,
    Draw,
    MakeRng,
    ModuleDef,
    Param,
    Sequential,
    Spec,
    Variable,
)

Transform = getattr(_nodes, "Transform", None)
Cond = getattr(_nodes, "Cond", None)
WhileLoop = getattr(_nodes, "WhileLoop", None)


def _barrier(x):
    """jax.lax.optimization_barrier (JAX 0.4.31 on; before, jax._src.ad_checkpoint's own)."""
    barrier = getattr(jax.lax, "optimization_barrier", None)
    if barrier is None:
        from jax._src.ad_checkpoint import _optimization_barrier as barrier
    return barrier(x)


# JAX's own error messages that older JAX words otherwise (rngaudit gives the newest JAX's words): a pattern of the
# old words at the start -> the new
JAX_MESSAGES = {
    "true_fun and false_fun output must have same type structure": (
        "cond branch outputs must have the same pytree structure"
    ),
    r"argument of type '[\w.]*ArrayImpl' is not iterable": "Array.__contains__: unsupported operand type <class 'str'>",
    r"branch \d+ and \d+ outputs must have same type structure": "switch branch outputs must have the same pytree structure",
    "Scanned function carry input and carry output must have the same pytree structure": (
        "scan body function carry input and carry output must have the same pytree structure"
    ),
}

# nn.jit forks a key per stream from flax 0.10.2 on; before, it passes the (folded) keys in
FLAX_RELEASE = tuple(int(x) for x in re.findall(r"\d+", flax.__version__)[:3])
FORK_JIT = FLAX_RELEASE >= (0, 10, 2)
OLD_XLA = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3]) < (0, 5, 0)

# Every module is called with X (or its own input); layers keep the shape, so Sequential can chain them.
FEATURES = 4
X = jnp.ones((1, 2, FEATURES), jnp.float32)
TOKENS = jnp.zeros((1, 2), jnp.int32)
SCALAR = jnp.zeros((), jnp.float32)  # the value of params and variables that draw nothing
PASSED_KEY_SEED = 12345  # the key handed to Dropout(rng=...) / attention(dropout_rng=...)
MAX_BRANCH_RUNS = 32  # nn.cond/switch: at most this many runs to see every branch run


def _drawn_value(draw: Draw | None, keys) -> jnp.ndarray:
    """A variable's value: a scalar whatever the keys (so a param of the same name sees a consistent
    shape) that, with a `draw:`, depends on the values drawn from each key, as an initializer that
    uses its keys does (what JAX's vmap and scan see as a data dependency)."""
    if draw is None:
        return SCALAR
    return SCALAR + 0 * sum(jnp.sum(draw_fn(draw)(k)).astype(jnp.float32) for k in keys)


# Flax's default initializer of a layer param, written as the draw that reproduces it.
_DEFAULT_INIT = {
    "kernel": ("lecun_normal", {"in_axis": -2, "out_axis": -1}),
    "embedding": (
        "variance_scaling",
        {"scale": 1.0, "mode": "fan_in", "distribution": "normal", "in_axis": -2, "out_axis": 0},
    ),
}
_INIT_KWARG = {"kernel": "kernel_init", "bias": "bias_init", "embedding": "embedding_init", "scale": "scale_init"}
_MHA = ("MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention")


class OracleUnsupported(Exception):
    """The spec uses something this oracle cannot build in Flax."""


# ---------------------------------------------------------------- global settings
@contextlib.contextmanager
def flax_settings(spec: Spec):
    """Sets the separator flag, the threefry mode and the PRNG impl from the spec; restores them."""
    saved = (
        flax.config.flax_fix_rng_separator,
        jax.config.jax_threefry_partitionable,
        jax.config.jax_default_prng_impl,
    )
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
    """Records every key Scope.make_rng returns, in call order, for models without lifted transforms
    (the keys must be concrete): dicts with path, requested, stream, key, and label/value for params."""
    records: list[dict] = []
    make_rng, param = Scope.make_rng, Scope.param

    def recording_make_rng(scope, name="params"):
        used = name if scope.has_rng(name) else "params"
        key = make_rng(scope, name)
        records.append({"path": tuple(scope.path), "requested": name, "stream": used, "key": key_words(key)})
        return key

    def recording_param(scope, name, init_fn, *args, **kwargs):
        def init(key, *a, **kw):
            value = init_fn(key, *a, **kw)
            last = records[-1] if records else None
            if (
                _concrete(key)
                and _concrete(value)
                and last is not None
                and last["path"] == tuple(scope.path)
                and last["key"] == key_words(key)
            ):
                last["label"] = name
                last.setdefault("value", np.asarray(value))
            return value

        return param(scope, name, init, *args, **kwargs)

    Scope.make_rng, Scope.param = recording_make_rng, recording_param
    try:
        yield records
    finally:
        Scope.make_rng, Scope.param = make_rng, param


# ---------------------------------------------------------------- the runtime capture of keys
@dataclass(eq=False)
class _VmapFrame:
    name: str

    def index(self):
        return jax.lax.axis_index(self.name)


@dataclass(eq=False)
class _ScanFrame:
    idx: object  # the step (a tracer of the scan body)
    constancy: bool  # the first trace of axes_scan.scan_fn: thrown away
    broadcast: object  # the scan's variable_broadcast filter

    def index(self):
        return self.idx


@dataclass(eq=False)
class _WhileFrame:
    idx: object  # the loop counter the oracle carries

    def index(self):
        return self.idx


@dataclass(eq=False)
class _JitFrame:
    path: tuple
    forks: dict  # stream -> the key the jitted (or fold_rngs) function received


@dataclass(eq=False)
class _MapRun1Frame:
    """map_variables(init=True)'s first run: only the variables it creates are kept."""


_LANES = (_VmapFrame, _ScanFrame, _WhileFrame)


@dataclass(eq=False)
class _Event:
    seq: int
    path: tuple
    requested: str
    stream: str
    count: int
    frames: tuple
    init_col: str | None
    fork: bool
    call_seq: int | None = None
    label: str | None = None
    discarded: bool = False
    deferred: list | None = None  # (kind, payload) to emit once init_col is known
    branch: tuple = ()  # ((id of the cond/switch statement, branch), ...) this key is traced in
    emitted: bool = False

    @property
    def jit(self) -> _JitFrame | None:
        return next((f for f in reversed(self.frames) if isinstance(f, _JitFrame)), None)

    @property
    def jit_depth(self) -> int:
        return sum(1 for f in self.frames if isinstance(f, _JitFrame))


def _discarded(frames, init_col) -> bool:
    """Whether Flax throws away what a key made here computes (scan's constancy trace, map_variables'
    first run), except the initial value of a variable that survives."""
    for f in frames:
        if isinstance(f, _ScanFrame) and f.constancy:
            if init_col is None or not in_filter(f.broadcast, init_col):
                return True
        elif isinstance(f, _MapRun1Frame) and init_col is None:
            return True
    return False


class _Capture:
    """Trace-time events and the runtime values of their keys."""

    def __init__(self):
        self.events: dict[int, _Event] = {}
        self._seq = itertools.count()
        self.frames: list = []
        self.init_cols: list = []
        self.fork_stack: list = []
        self.pending_scan: list = []
        self.pending_forks: list = []  # the forks of the nn.jit/fold_rngs call about to start
        self.branches: list = []  # the cond/switch branches being traced
        self.pending_cond = None  # id of the cond/switch statement about to call lift.cond/switch
        self.deferring: list | None = None
        self.fired: list = []
        self.recording = False
        self.last_event: _Event | None = None
        self.last_key = None
        self._axis_names = itertools.count()

    def next_seq(self) -> int:
        return next(self._seq)

    @contextlib.contextmanager
    def frame(self, f):
        self.frames.append(f)
        try:
            yield
        finally:
            self.frames.pop()

    # ---------------------------------------------------------- events
    def make_rng(self, scope, name, key) -> _Event:
        used = name if name in scope.rngs else "params"
        init_col = self.init_cols[-1] if self.init_cols else None
        ev = _Event(
            self.next_seq(),
            tuple(scope.path),
            name,
            used,
            int(scope.rng_counters[used]),
            tuple(self.frames),
            init_col,
            bool(self.fork_stack),
            branch=tuple(self.branches),
        )
        if self.fork_stack:
            self.fork_stack[-1].append(ev)
        self.events[ev.seq] = ev
        self.last_event, self.last_key = ev, key
        if self.deferring is not None:
            ev.deferred = [("key", key)]
            self.deferring.append(ev)
        else:
            ev.discarded = _discarded(ev.frames, ev.init_col)
            self._emit(ev, "key", key)
        return ev

    def value(self, ev: _Event | None, value, label: str | None = None) -> None:
        if ev is None:
            return
        if label is not None:
            ev.label = label
        if ev.deferred is not None:
            ev.deferred.append(("value", value))
        else:
            self._emit(ev, "value", value)

    def flush(self, events: list, init_col: str | None) -> None:
        """Emit deferred events (eager variable keys) once it is known whether they initialised."""
        for ev in events:
            ev.init_col = init_col
            ev.discarded = _discarded(ev.frames, init_col)
            pending, ev.deferred = ev.deferred, None
            for kind, payload in pending:
                self._emit(ev, kind, payload)

    def _emit(self, ev: _Event, kind: str, payload) -> None:
        if ev.discarded and not ev.fork:
            return  # Flax throws it away (forks are still recorded: inner keys are attributed to them)
        ev.emitted = True
        frames = ev.frames
        j = max((i for i, f in enumerate(frames) if isinstance(f, _JitFrame)), default=-1)
        lanes = [
            f.index()
            for f in frames[j + 1 :]
            if isinstance(f, _LANES) and not (isinstance(f, _ScanFrame) and f.constancy)
        ]
        # (only non-empty arguments: an empty numpy constant passed to a callback inside lax.cond
        # makes XLA fail with "Invalid sharding" on jax 0.10.2)
        args = [jax.random.key_data(payload) if kind == "key" else payload]
        if lanes:
            args.append(jnp.stack([jnp.asarray(i, jnp.int32) for i in lanes]))
        if j >= 0:
            args.append(jax.random.key_data(frames[j].forks[ev.stream]))
        fire = functools.partial(self._fire, ev.seq, kind, bool(lanes), j >= 0)
        if _concrete(args):
            fire(*args)
        else:
            jax.debug.callback(fire, *args)

    def _fire(self, seq, kind, has_lanes, has_fork, data, *rest) -> None:
        if not self.recording:
            return
        rest = list(rest)
        lanes = tuple(int(i) for i in np.asarray(rest.pop(0)).ravel()) if has_lanes else ()
        fork = tuple(int(w) for w in np.asarray(rest.pop(0)).ravel()) if has_fork else ()
        if kind == "key":
            data = tuple(int(w) for w in np.asarray(data).ravel())
        else:
            data = np.asarray(data)
        self.fired.append((seq, kind, data, lanes, fork))

    # ---------------------------------------------------------- records
    def records(self) -> list[dict]:
        """Every key that ran, attributed and ordered: by trace order, then lane (inside a jit:
        after the fork of that call)."""
        groups: dict = {}
        for seq, kind, data, lanes, fork in self.fired:
            g = groups.setdefault((seq, lanes, fork), {})
            if kind == "key":
                if "key" in g and g["key"] != data:
                    if not FORK_JIT:
                        # flax before 0.10.2: jax ran a jitted function again from its trace cache (the same
                        # module fingerprint), so Python made no events for that call
                        raise OracleUnsupported("an nn.jit trace reused from jax's cache (flax < 0.10.2)")
                    raise AssertionError(f"event {seq} lane {lanes}: two different keys {g['key']} {data}")
                g["key"] = data
            else:
                g["value"] = data
        forks: dict = {}
        out: dict = {}
        for (seq, lanes, fork), g in sorted(
            groups.items(), key=lambda kv: (self.events[kv[0][0]].jit_depth, kv[0][0], kv[0][1])
        ):
            ev = self.events[seq]
            if "key" not in g:
                continue  # a concrete value made from a key that never exists (scan's first trace)
            jit = ev.jit
            if jit is None:
                places = [((), ev.path, lanes)]
            else:
                cands = [f for f in forks.get((ev.stream, fork), ()) if f["event"].jit_depth == ev.jit_depth - 1]
                if not cands:
                    raise OracleUnsupported(
                        f"a key inside nn.jit/fold_rngs at {ev.path} could not be "
                        "attributed to the fork it derives from"
                    )
                assert ev.path[: len(jit.path)] == jit.path, (ev.path, jit.path)
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
                    "key": g["key"],
                    "order": order,
                    "event": ev,
                    "branch": ev.branch,
                }
                if "value" in g:
                    rec["value"] = g["value"]
                if ev.label is not None:
                    rec["label"] = ev.label
                if ev.fork:
                    rec["call"] = prefix + (ev.call_seq,)
                    forks.setdefault((ev.stream, g["key"]), []).append(rec)
                out.setdefault(order, rec)
        return [r for _, r in sorted(out.items()) if not r["event"].discarded]


# ---------------------------------------------------------------- the hooks into Flax
def _bind(fn, args, kwargs) -> dict:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


@contextlib.contextmanager
def _hooks(cap: _Capture):
    """Observe Flax: every wrapper calls the original (see the module docstring)."""
    orig = {
        "make_rng": Scope.make_rng,
        "param": Scope.param,
        "variable": Scope.variable,
        "vmap": lift.vmap,
        "scan": lift.scan,
        "jit": lift.jit,
        "fold_rngs": getattr(lift, "fold_rngs", None),  # (flax 0.10.2 and later)
        "map_variables": lift.map_variables,
        "axes_scan": axes_scan.scan,
        "fork_rngs": getattr(linen_transforms, "fork_rngs", None),
        "cond": lift.cond,
        "switch": lift.switch,
        "while_loop": lift.while_loop,
    }

    def make_rng(scope, name="params"):
        key = orig["make_rng"](scope, name)
        cap.make_rng(scope, name, key)
        return key

    def param(scope, name, init_fn, *args, **kwargs):
        def init(key, *a, **kw):
            value = init_fn(key, *a, **kw)
            if cap.last_key is key:
                cap.value(cap.last_event, value, label=name)
            return value

        cap.init_cols.append("params")
        try:
            return orig["param"](scope, name, init, *args, **kwargs)
        finally:
            cap.init_cols.pop()

    def variable(scope, col, name, *args, **kwargs):
        cap.init_cols.append(col)
        try:
            return orig["variable"](scope, col, name, *args, **kwargs)
        finally:
            cap.init_cols.pop()

    @functools.wraps(orig["vmap"])
    def vmap(fn, *args, **kwargs):
        a = _bind(orig["vmap"], (fn,) + args, kwargs)
        if a["axis_name"] is None:
            a["axis_name"] = f"_rngaudit_lane_{next(cap._axis_names)}"
        frame_name = a["axis_name"]

        def body(scope, *xs):
            with cap.frame(_VmapFrame(frame_name)):
                return fn(scope, *xs)

        a["fn"] = body
        return orig["vmap"](**a)

    @functools.wraps(orig["scan"])
    def scan(fn, *args, **kwargs):
        a = _bind(orig["scan"], (fn,) + args, kwargs)
        inner = orig["scan"](**a)

        @functools.wraps(inner)
        def call(*xs, **kw):
            cap.pending_scan.append(a["variable_broadcast"])
            try:
                return inner(*xs, **kw)
            finally:
                cap.pending_scan.pop()

        return call

    def axes_scan_fn(
        fn,
        in_axes,
        out_axes,
        length=None,
        reverse=False,
        unroll=1,
        _split_transpose=False,
        check_constancy_invariants=True,
    ):
        if length is None:
            raise OracleUnsupported("nn.scan without an explicit length")
        broadcast = cap.pending_scan[-1] if cap.pending_scan else False
        traces = [0]

        def body(broadcast_in, carry, step, *xs):
            traces[0] += 1
            constancy = check_constancy_invariants and traces[0] == 1
            with cap.frame(_ScanFrame(step, constancy, broadcast)):
                return fn(broadcast_in, carry, *xs)

        inner = orig["axes_scan"](
            body,
            (0,) + tuple(in_axes),
            out_axes,
            length=length,
            reverse=reverse,
            unroll=unroll,
            **({"_split_transpose": _split_transpose} if _split_transpose else {}),
            **({} if check_constancy_invariants else {"check_constancy_invariants": False}),
        )

        def run(broadcast_in, init, *args):
            traces[0] = 0
            return inner(broadcast_in, init, jnp.arange(length, dtype=jnp.int32), *args)

        return run

    def forked(name):
        @functools.wraps(orig[name])
        def transform(fn, *args, **kwargs):
            def body(scope, hash_key, *xs, **kw):
                first = jax.tree_util.tree_leaves(scope, is_leaf=lambda s: isinstance(s, Scope))[0]
                frame = _JitFrame(tuple(first.path), {s: lz.rng for s, lz in first.rngs.items()})
                with cap.frame(frame):
                    return fn(scope, hash_key, *xs, **kw)

            inner = orig[name](functools.wraps(fn)(body), *args, **kwargs)

            @functools.wraps(inner)
            def call(*xs, **kw):
                # the call itself starts here (after the fork and the module's setup): keys inside are
                # ordered from this point, whether jax traces the function again or reuses it
                call_seq = cap.next_seq()
                for ev in cap.pending_forks:
                    ev.call_seq = call_seq
                cap.pending_forks = []
                return inner(*xs, **kw)

            return call

        return transform

    @functools.wraps(orig["map_variables"])
    def map_variables(fn, *args, **kwargs):
        a = _bind(orig["map_variables"], (fn,) + args, kwargs)
        calls = [0]

        def body(scopes, *xs, **kw):
            calls[0] += 1
            leaves = jax.tree_util.tree_leaves(scopes, is_leaf=lambda s: isinstance(s, Scope))
            run1 = a["init"] and calls[0] == 1 and any(not is_filter_empty(s.mutable) for s in leaves)
            with cap.frame(_MapRun1Frame()) if run1 else contextlib.nullcontext():
                return fn(scopes, *xs, **kw)

        a["fn"] = body
        inner = orig["map_variables"](**a)

        @functools.wraps(inner)
        def call(*xs, **kw):
            calls[0] = 0
            return inner(*xs, **kw)

        return call

    # cond/switch/while_loop: mark the trace of each branch (and the loop counter) at the scope level,
    # before linen clones the module and runs its setup() there
    def branches(fns, stmt):
        def tagged(k, fn):
            @functools.wraps(fn)
            def branch(scope, *xs):
                cap.branches.append((stmt, k))
                try:
                    return fn(scope, *xs)
                finally:
                    cap.branches.pop()

            return branch

        return [tagged(k, fn) for k, fn in enumerate(fns)]

    @functools.wraps(orig["cond"])
    def cond(pred, true_fun, false_fun, scope, *operands, **kw):
        stmt, cap.pending_cond = cap.pending_cond, None
        t, f = branches((true_fun, false_fun), stmt)
        return orig["cond"](pred, t, f, scope, *operands, **kw)

    @functools.wraps(orig["switch"])
    def switch(index, fns, scope, *operands, **kw):
        stmt, cap.pending_cond = cap.pending_cond, None
        return orig["switch"](index, branches(fns, stmt), scope, *operands, **kw)

    @functools.wraps(orig["while_loop"])
    def while_loop(cond_fn, body_fn, scope, init, *args, **kw):
        def looped(fn):
            @functools.wraps(fn)
            def step(scope, c):
                with cap.frame(_WhileFrame(c[0])):
                    return fn(scope, c)

            return step

        return orig["while_loop"](looped(cond_fn), looped(body_fn), scope, init, *args, **kw)

    @contextlib.contextmanager
    def fork_rngs(module):
        forks: list = []
        cap.fork_stack.append(forks)
        try:
            cm = orig["fork_rngs"](module)
            cm.__enter__()
        finally:
            cap.fork_stack.pop()
        cap.pending_forks = forks
        try:
            yield
        except BaseException as e:
            if not cm.__exit__(type(e), e, e.__traceback__):
                raise
        else:
            cm.__exit__(None, None, None)

    Scope.make_rng, Scope.param, Scope.variable = make_rng, param, variable
    lift.vmap, lift.scan, lift.map_variables = vmap, scan, map_variables
    if FORK_JIT:
        lift.jit, lift.fold_rngs = forked("jit"), forked("fold_rngs")
        linen_transforms.fork_rngs = fork_rngs
        # a fresh process: nn.jit/fold_rngs keep the counter deltas of every trace in a global cache
        lift._side_effect_cache.cache.clear()
    # (before flax 0.10.2 nn.jit forks nothing: keys inside are made and attributed like any other)
    if not FORK_JIT and FLAX_RELEASE < (0, 8, 2):

        @functools.wraps(orig["jit"])
        def old_jit(fn, *args, **kwargs):
            inner = orig["jit"](fn, *args, **kwargs)

            @functools.wraps(inner)
            def call(*xs, **kw):
                if any((isinstance(f, _ScanFrame) and f.constancy) or isinstance(f, _MapRun1Frame) for f in cap.frames):
                    # flax 0.8.0/0.8.1 key jax's trace cache on the module's fields alone: the scan's second trace
                    # (map_variables' second run) reuses this one, whose keys (callbacks) are thrown away with it
                    raise OracleUnsupported("nn.jit in a trace Flax throws away (flax < 0.8.2 reuses it)")
                return inner(*xs, **kw)

            return call

        lift.jit = old_jit
    axes_scan.scan = axes_scan_fn
    lift.cond, lift.switch, lift.while_loop = cond, switch, while_loop
    try:
        yield cap
    finally:
        Scope.make_rng, Scope.param, Scope.variable = orig["make_rng"], orig["param"], orig["variable"]
        lift.vmap, lift.scan, lift.map_variables = orig["vmap"], orig["scan"], orig["map_variables"]
        lift.jit = orig["jit"]
        if FORK_JIT:
            lift.fold_rngs = orig["fold_rngs"]
            linen_transforms.fork_rngs = orig["fork_rngs"]
            lift._side_effect_cache.cache.clear()
        axes_scan.scan = orig["axes_scan"]
        lift.cond, lift.switch, lift.while_loop = orig["cond"], orig["switch"], orig["while_loop"]


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
        init = jax.nn.initializers.variance_scaling(
            p["scale"], p["mode"], p["distribution"], in_axis=p["in_axis"], out_axis=p["out_axis"]
        )
    else:
        init = getattr(jax.nn.initializers, kind)(in_axis=p["in_axis"], out_axis=p["out_axis"])
    return lambda k: init(k, shape, dtype)


def _is_flax_default(param: str, draw: Draw) -> bool:
    want = _DEFAULT_INIT.get(param)
    return want is not None and draw.kind == want[0] and dict(draw.params) == want[1] and draw.dtype == "float32"


# ---------------------------------------------------------------- lifted transforms of a ModuleDef
# The parsed spec keeps a transformed module as one ModuleDef: `cls` is the transformed class name
# (VmapJitBlock), `lifts` the class transforms (outermost first) followed by the module's own
# method decorators, and nn.remat_scan expanded to its scans (one Lift per level and remat between
# them, all with the remat_scan statement's location). The oracle rebuilds the Flax calls from that.
_PREFIX = {
    "vmap": "Vmap",
    "scan": "Scan",
    "jit": "Jit",
    "remat": "Checkpoint",
    "fold_rngs": "Fold_rngs",
    "map_variables": "Map_variables",
    "remat_scan": "Remat_scan",
}


@dataclass(frozen=True)
class _Group:
    """One Flax transform call: kind and options (remat_scan: lengths and its scan options), and how
    many entries of ModuleDef.lifts it stands for."""

    kind: str
    options: dict = field(hash=False)
    n_lifts: int = 1


def _groups(mod: ModuleDef) -> list[_Group]:
    out: list[_Group] = []
    lifts = list(mod.lifts)
    i = 0
    while i < len(lifts):
        j = i + 1
        while j < len(lifts) and lifts[j].loc == lifts[i].loc:
            j += 1
        run = lifts[i:j]
        if len(run) == 1:
            out.append(_Group(run[0].kind, dict(run[0].options)))
        else:
            scans = [lf for lf in run if lf.kind == "scan"]
            opts = dict(scans[0].options)
            opts["lengths"] = tuple(lf.opt("length") for lf in scans)
            out.append(_Group("remat_scan", opts, len(run)))
        i = j
    return out


def _prefixes(g: _Group) -> tuple[str, ...]:
    if g.kind == "scan" and g.options.get("check_constancy_invariants", True):
        return ("Scan", "Remat_scan")  # remat_scan with one level is that scan
    return (_PREFIX[g.kind],)


def _split(mod: ModuleDef, mode: str) -> tuple[list[_Group], int, str]:
    """(groups, how many leading groups are class transforms, the base class name). mode: 'class'
    (a transform statement: at least one), 'decorators' (a module statement: none) or 'unknown'
    (the root, a setup attribute, a Sequential layer): the longest run of leading groups whose
    prefixes the class name starts with."""
    groups = _groups(mod)
    if mode == "decorators" or not groups:
        return groups, 0, mod.cls
    best = None
    for k in range(1, len(groups) + 1):
        for choice in itertools.product(*(_prefixes(g) for g in groups[:k])):
            prefix = "".join(choice)
            if mod.cls.startswith(prefix) and len(mod.cls) > len(prefix):
                gs = list(groups)
                for i, p in enumerate(choice):
                    if p == "Remat_scan" and gs[i].kind == "scan":
                        gs[i] = _Group("remat_scan", dict(gs[i].options, lengths=(gs[i].options["length"],)))
                best = (gs, k, mod.cls[len(prefix) :])
                break
    if best is None:
        if mode == "class":
            raise OracleUnsupported(f"cannot tell the transforms of {mod.cls} from its class name")
        return groups, 0, mod.cls
    return best


def _inner_req(g: _Group, req: str) -> str:
    """What the wrapped function must return, given what the transformed call must return:
    'any', 'carry' (the input, same shape: nn.remat_scan's body) or 'scanbody' ((carry, ys))."""
    if g.kind == "scan":
        if req == "carry":
            raise OracleUnsupported("nn.scan inside nn.remat_scan (the scan returns (carry, ys))")
        return "scanbody"
    if g.kind == "remat_scan":
        if req == "scanbody":
            raise OracleUnsupported("nn.remat_scan as the body of nn.scan (it returns only the carry)")
        return "carry"
    return req


def _flax_filter(f):
    return f if f is True or f is False or isinstance(f, str) else tuple(f)


def _apply_transform(g: _Group, target, req: str):
    """nn.<kind>(target, ...) with the spec's options: target is a Module class or a method."""
    o = g.options
    split = {_flax_filter(k) if k is not True else True: v for k, v in o.get("split_rngs", ())}
    axes = {_flax_filter(k) if k is not True else True: v for k, v in o.get("variable_axes", ())}
    if g.kind == "vmap":
        return nn.vmap(
            target,
            variable_axes=axes,
            split_rngs=split,
            in_axes=None,
            out_axes=0 if req == "any" else None,
            axis_size=o["axis_size"],
        )
    if g.kind == "scan":
        return nn.scan(
            target,
            variable_axes=axes,
            split_rngs=split,
            variable_broadcast=_flax_filter(o.get("variable_broadcast", False)),
            variable_carry=_flax_filter(o.get("variable_carry", False)),
            length=o["length"],
            # (an option of flax 0.11 and later: passed only where the spec sets it)
            **({} if o.get("check_constancy_invariants", True) else {"check_constancy_invariants": False}),
        )
    if g.kind == "remat_scan":
        return nn.remat_scan(
            target,
            lengths=tuple(o["lengths"]),
            variable_axes=axes,
            split_rngs=split,
            variable_broadcast=_flax_filter(o.get("variable_broadcast", False)),
            variable_carry=_flax_filter(o.get("variable_carry", False)),
        )
    rngs = _flax_filter(o.get("rngs", True))
    if g.kind == "jit":
        return nn.jit(target, rngs=rngs)
    if g.kind == "remat":
        return nn.remat(target, rngs=rngs)
    if g.kind == "fold_rngs":
        return nn.fold_rngs(target, rngs=rngs)
    if g.kind == "map_variables":
        return nn.map_variables(
            target,
            mapped_collections=_flax_filter(o.get("mapped_collections", True)),
            init=o.get("init", False),
            mutable=o.get("mutable", False),
            rngs=rngs,
            variables=_flax_filter(o.get("variables", True)),
        )
    raise OracleUnsupported(f"transform {g.kind}")


# ---------------------------------------------------------------- the model
class _Builder:
    """Turns ModuleDefs into nn.Module subclasses whose methods execute the spec's statements."""

    def __init__(self, cap: _Capture, selection: dict | None = None):
        self.cap = cap
        self.phase = "init"
        self.selection = selection or {}  # id(Cond item) -> the branch to run
        self._classes: dict = {}

    # -------------------------------------------------------------- construction
    def construct(self, mod: ModuleDef, name: str | None, mode: str = "unknown"):
        kw = {} if name is None else {"name": name}
        if mod.to_linen is not None:
            from nnx_oracle import to_linen_module  # (the NNX side of the oracle builds the NNX class)

            return to_linen_module(mod, kw)
        if not mod.lifts:
            if mod.layer is not None:
                cls, lkw = _layer(mod)
                return cls(**lkw, **kw)
            return self._class(mod, "any")(**kw)
        return self._transformed(mod, mode)(**kw)

    def _transformed(self, mod: ModuleDef, mode: str):
        """functools.partial(nn.vmap(nn.jit(Block)), **layer args): the class a transform statement makes."""
        # (before flax 0.10.2 jax may reuse an nn.jit trace of the same class: rngaudit takes equal definitions
        # as one class, made once, and so does this oracle there)
        key = (id(mod) if FORK_JIT else module_shape(mod), "transformed")
        hit = self._classes.get(key)
        if hit is not None:
            return hit[1]
        groups, k, base = _split(mod, mode)
        reqs, req = [], "any"
        for g in groups:
            reqs.append(req)
            req = _inner_req(g, req)
        if mod.layer is not None:
            if k != len(groups):
                raise OracleUnsupported("a method decorator on a standard layer")
            if req == "scanbody":
                raise OracleUnsupported(f"nn.scan over {mod.layer} (its __call__ does not return (carry, ys))")
            if req == "carry" and (mod.layer in ("Embed",) + _MHA or _dims(mod)["in"] != _dims(mod)["out"]):
                raise OracleUnsupported(f"nn.remat_scan over {mod.layer}: the layer changes the carry")
            opts = dict(mod.layer_options)
            if opts.get("rng") or opts.get("dropout_rng"):
                raise OracleUnsupported(f"{mod.layer} with a key passed to the call, inside a transform")
            target, lkw = _layer(dataclasses_replace(mod, cls=base, lifts=()))
            if any(g.kind == "vmap" and r != "any" for g, r in zip(groups, reqs)):
                raise OracleUnsupported(f"{mod.layer} under nn.vmap inside a scan body")
        else:
            basedef = dataclasses_replace(mod, cls=base, lifts=mod.lifts[sum(g.n_lifts for g in groups[:k]) :])
            target, lkw = self._class(basedef, req, groups[k:], reqs[k:]), {}
        for g, r in reversed(list(zip(groups[:k], reqs[:k]))):
            target = _apply_transform(g, target, r)
        made = functools.partial(target, **lkw) if lkw else target
        self._classes[key] = (mod, made)
        return made

    def _class(self, mod: ModuleDef, req: str, decorators=(), reqs=()) -> type:
        key = (id(mod), req)
        hit = self._classes.get(key)
        if hit is None:
            hit = self._classes[key] = (mod, self._make_class(mod, req, list(decorators), list(reqs)))
        return hit[1]

    def _make_class(self, mod: ModuleDef, req: str, decorators: list, reqs: list) -> type:
        builder = self

        def setup(m):
            object.__setattr__(m, "_oracle_setup_children", {})
            builder.run(m, mod.setup, m.__dict__["_oracle_setup_children"])

        def __call__(m, x=None):
            builder.run(m, mod.body, {})
            x = X if x is None else x
            return (x, None) if req == "scanbody" else x

        call = nn.compact(__call__)
        for g, r in reversed(list(zip(decorators, reqs))):
            call = _apply_transform(g, call, r)
        attrs = {"__call__": call, "__module__": __name__}
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
            elif isinstance(item, Child) or (Transform is not None and isinstance(item, Transform)):
                mod = item.module if isinstance(item, Child) else item.target
                mode = "decorators" if isinstance(item, Child) else "class"
                for _ in range(item.repeat):
                    child = self.construct(mod, mod.name, mode)
                    local[child.name] = (child, mod)
                    self.invoke(child, mod)
            elif isinstance(item, Define):
                child = self._attribute(
                    m,
                    item.module.name,
                    lambda: self.construct(item.module, None),
                    lambda: self.construct(item.module, item.module.name),
                )
                local[child.name] = (child, item.module)
            elif isinstance(item, Call):
                child, mod = local.get(item.name) or m.__dict__.get("_oracle_setup_children", {})[item.name]
                for _ in range(item.repeat):
                    self.invoke(child, mod)
            elif isinstance(item, Sequential):
                self._sequential(m, item, local)
            elif Cond is not None and isinstance(item, Cond):
                self._cond(m, item, local)
            elif WhileLoop is not None and isinstance(item, WhileLoop):
                self._while(m, item, local)
            else:
                raise OracleUnsupported(type(item).__name__)

    def rng(self, m, stream: str, draw: Draw | None):
        key = m.make_rng(stream)
        if draw is not None:
            self.cap.value(self.cap.last_event, draw_fn(draw)(key))
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
            # self.variable(col, name, f, self.make_rng(s)): the argument is evaluated on every call;
            # whether the keys initialise anything is known only after the call (R8)
            self.cap.deferring, outer = [], self.cap.deferring
            try:
                keys = [self.rng(m, s, item.draw) for s in item.streams]
            finally:
                pending, self.cap.deferring = self.cap.deferring, outer
            created = []

            def init(*ks):
                created.append(True)
                return _drawn_value(item.draw, ks)

            try:
                m.variable(item.collection, item.name, init, *keys)
            finally:
                self.cap.flush(pending, item.collection if created else None)
        else:

            def init():
                return _drawn_value(item.draw, [self.rng(m, s, item.draw) for s in item.streams])

            m.variable(item.collection, item.name, init)

    @staticmethod
    def _attribute(m, name: str, unnamed, named):
        """self.<name> = Module() in setup; an explicit name= where `name` cannot be an attribute."""
        plain = (
            name.isidentifier() and not name.startswith("_") and not hasattr(type(m), name) and name not in m.__dict__
        )
        if not plain:
            return named()
        setattr(m, name, unnamed())
        return m.__dict__[name]

    def _sequential(self, m, item: Sequential, local: dict) -> None:
        for layer in item.layers:
            _check_chainable(layer)
        if item.in_setup:
            seq = self._attribute(
                m,
                item.name,
                lambda: nn.Sequential([self.construct(l, None) for l in item.layers]),
                lambda: nn.Sequential([self.construct(l, None) for l in item.layers], name=item.name),
            )
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

    # -------------------------------------------------------------- control flow
    def _branch_fn(self, items, local: dict):
        # (a submodule made before the branch is called as users write it: the Python object, a closure)
        def branch(mdl, x):
            self.run(mdl, items, dict(local))
            return x

        return branch

    def _cond(self, m, item, local: dict) -> None:
        n = len(item.branches)
        pick = self.selection.get(id(item), 0)
        fns = [self._branch_fn(b, local) for b in item.branches]
        rngs = _flax_filter(item.rngs)
        self.cap.pending_cond = id(item)  # lift.cond/switch (hooked) tag each branch's trace with it
        if getattr(item, "kind", "cond") == "cond" and n == 2:
            nn.cond(jnp.asarray(pick == 0), fns[0], fns[1], m, X, rngs=rngs)
        else:
            nn.switch(jnp.asarray(pick, jnp.int32), fns, m, X, rngs=rngs)

    def _while(self, m, item, local: dict) -> None:
        split = {_flax_filter(k) if k is not True else True: v for k, v in item.split_rngs}

        # The carry is (i, iterations) behind an optimization barrier: with a trip count XLA can work
        # out, the CPU runtime runs the body that many times and never evaluates cond, so the cond's
        # callbacks (and keys) would never run inside jit/scan. (The hooked lift.while_loop reads i.)
        def cond_fn(mdl, c):
            self.run(mdl, item.cond_items, dict(local))
            return c[0] < c[1]

        def body_fn(mdl, c):
            self.run(mdl, item.body_items, dict(local))
            return c[0] + 1, c[1]

        init = _barrier((jnp.asarray(0, jnp.int32), jnp.asarray(item.iterations, jnp.int32)))
        nn.while_loop(cond_fn, body_fn, m, init, split_rngs=split)

    # -------------------------------------------------------------- calls
    def input_for(self, mod: ModuleDef | None):
        if mod is None or mod.layer is None:
            return X
        return _input(mod)

    def invoke(self, child, mod: ModuleDef | None):
        if mod is None:
            return child(X)
        if mod.lifts:
            return child(self.input_for(mod))
        if mod.layer is None:
            return child(X)
        opts = dict(mod.layer_options)
        x = _input(mod)
        if mod.layer == "Dropout":
            mask = _mask_draw(mod)
            x = x if mask is None else jnp.ones(mask.shape, jnp.float32)
            before = self.cap.last_event
            out = child(x, rng=jax.random.key(PASSED_KEY_SEED)) if opts["rng"] else child(x)
            if mask is not None and self.cap.last_event is not before:
                self.cap.value(self.cap.last_event, out != 0)
            return out
        if mod.layer in _MHA and opts["dropout_rng"]:
            return child(x, dropout_rng=jax.random.key(PASSED_KEY_SEED))
        return child(x)


def dataclasses_replace(obj, **kw):

    return dataclasses.replace(obj, **kw)


def _mask_draw(mod: ModuleDef) -> Draw | None:
    return next((it.draw for it in mod.body if isinstance(it, MakeRng)), None)


def _check_chainable(mod: ModuleDef) -> None:
    opts = dict(mod.layer_options)
    if mod.layer == "Embed" or opts.get("rng") or opts.get("dropout_rng"):
        raise OracleUnsupported(f"{mod.layer} inside Sequential (it needs its own call arguments)")
    if any(g.kind in ("vmap", "scan", "remat_scan") for g in _groups(mod)):
        raise OracleUnsupported("a vmapped or scanned layer inside Sequential (it changes the shapes)")
    if mod.layer is not None and _dims(mod) != {"in": FEATURES, "out": FEATURES, "k": 3}:
        raise OracleUnsupported("a layer inside Sequential must keep the canonical shapes")


_NORMS = ("LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm")


def _dims(mod: ModuleDef) -> dict:
    """Input features, output features and kernel size of a layer: canonical unless a draw fixes them."""
    d = {"in": FEATURES, "out": FEATURES, "k": 3}
    for item in mod.setup + mod.body:
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


def _layer(mod: ModuleDef):
    """The real Flax layer class and constructor arguments for a standard-layer ModuleDef (shapes:
    canonical, or those its draws give)."""
    return _layer_call(mod, {})


def _layer_call(mod: ModuleDef, kw: dict):
    o = dict(mod.layer_options)
    kind = mod.layer
    d = _dims(mod)
    for item in mod.setup + mod.body:
        if isinstance(item, Param) and item.draw is not None and not _is_flax_default(item.name, item.draw):
            kw[_INIT_KWARG[item.name]] = _draw_init(item.draw)
    if kind in ("Dense", "DenseGeneral"):
        return getattr(nn, kind), dict(features=d["out"], use_bias=o["use_bias"], **kw)
    if kind == "Einsum":
        return nn.Einsum, dict(shape=(d["in"], d["out"]), einsum_str="abc,cd->abd", use_bias=o["use_bias"], **kw)
    if kind in ("Conv", "ConvTranspose", "ConvLocal"):
        return getattr(nn, kind), dict(features=d["out"], kernel_size=(d["k"],), use_bias=o["use_bias"], **kw)
    if kind == "Embed":
        return nn.Embed, dict(num_embeddings=d["in"], features=d["out"], **kw)
    if kind == "LayerNorm":
        return nn.LayerNorm, dict(use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "RMSNorm":
        return nn.RMSNorm, dict(use_scale=o["use_scale"], **kw)
    if kind == "BatchNorm":
        return nn.BatchNorm, dict(use_running_average=True, use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "GroupNorm":
        return nn.GroupNorm, dict(num_groups=1, use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "InstanceNorm":
        return nn.InstanceNorm, dict(use_scale=o["use_scale"], use_bias=o["use_bias"], **kw)
    if kind == "Dropout":
        return nn.Dropout, dict(
            rate=o["rate"], deterministic=o["deterministic"], rng_collection=o["rng_collection"], **kw
        )
    if kind in _MHA:
        return getattr(nn, kind), dict(
            num_heads=2,
            use_bias=o["use_bias"],
            normalize_qk=o["normalize_qk"],
            dropout_rate=o["dropout_rate"],
            deterministic=o["deterministic"],
            **kw,
        )
    raise OracleUnsupported(f"layer {kind}")


def _draw_init(draw: Draw):
    f = draw_fn(draw)
    return lambda key, *shape_dtype: f(key)


# ---------------------------------------------------------------- entry point
def _run_once(spec: Spec, raw_keys: bool, selection: dict) -> tuple[list[dict], set]:
    """One init (or init and apply) of the model with the given cond/switch branch choices: the keys
    that ran, and the branch paths in which some key was traced (and emitted)."""
    cap = _Capture()
    builder = _Builder(cap, selection)
    with flax_settings(spec), _hooks(cap):
        rngs = {s: eval_key(src.expr, raw_keys) for s, src in spec.rngs.items()}
        model = builder.construct(spec.model, spec.model.name)
        x = builder.input_for(spec.model)
        try:
            if spec.phase == "init":
                cap.recording = True
                model.init(rngs, x)
            else:
                # apply() gets the variables that init() of the same model (the same classes, in the
                # same process) makes; init only needs a params key
                variables = model.init({"params": jax.random.key(0), **init_streams(spec), **rngs}, x)
                jax.effects_barrier()
                builder.phase = "apply"
                mutable = list(spec.mutable) if isinstance(spec.mutable, tuple) else spec.mutable
                cap.recording = True
                for ev in cap.events.values():
                    ev.emitted = False  # only the apply run's branches count
                model.apply(variables, x, rngs=rngs, mutable=mutable)
            jax.effects_barrier()
        finally:
            cap.recording = False
    traced = {ev.branch for ev in cap.events.values() if ev.branch and ev.emitted}
    return cap.records(), traced


def init_streams(spec: Spec) -> dict:
    """The streams the init before an apply is given besides `params` and apply's: those the NNX modules of the
    spec's ToLinen modules draw from (ToLinen's NNX module raises KeyError at init without them), as a user's
    init has them."""
    from rngaudit.engine.replay import to_linen_streams

    names = to_linen_streams(spec.model)
    return {s: jax.random.key(1) for s in sorted(names - {"params"})}


def _selection(paths) -> dict:
    """One choice of branch per cond/switch statement that runs as many of `paths` as it can."""
    chosen: dict = {}
    for path in sorted(paths, key=len, reverse=True):
        if all(chosen.get(stmt, b) == b for stmt, b in path):
            chosen.update(path)
    return chosen


def flax_keys(spec: Spec, raw_keys: bool = False) -> list[dict]:
    """Builds spec.model in Flax, runs init (or init, then apply on its variables) and returns every
    key Flax hands out and uses, in trace order and then lane order: dicts with path, requested,
    stream, count, lane, key (key data words), order (the sort key) and, where an initializer or a
    draw used the key, value (and label, for params). nn.cond/switch trace every branch but run one:
    the model runs again with other branch choices until every branch in which a key was traced has
    run, and the keys are merged. Flax's own exception propagates unchanged when the model fails."""
    records, traced = _run_once(spec, raw_keys, {})
    if traced:
        merged = {r["order"]: r for r in records}
        ran = {r["branch"] for r in records}
        todo = traced - ran
        runs = 1
        while todo:
            runs += 1
            if runs > MAX_BRANCH_RUNS:
                raise OracleUnsupported(f"more than {MAX_BRANCH_RUNS} runs to see every cond/switch branch run")
            selection = _selection(todo)
            more, _ = _run_once(spec, raw_keys, selection)
            for r in more:
                seen = merged.setdefault(r["order"], r)
                assert seen["key"] == r["key"] and seen["path"] == r["path"], (seen, r)
            ran = {r["branch"] for r in more}
            # a branch path this selection ran, or had to run, is done (it may hold no key that runs)
            todo = {p for p in todo - ran if not all(selection.get(stmt) == b for stmt, b in p)}
        records = [merged[k] for k in sorted(merged)]
    for r in records:
        r.pop("event", None)
        r.pop("branch", None)
    return records


# ---------------------------------------------------------------- the differential check
FLAX_DOCS = " (https://flax.readthedocs.io"


@dataclass
class Agreement:
    """What a differential check compared: keys, drawn values, or the error both sides report."""

    keys: int = 0
    values: int = 0
    fallbacks: int = 0
    error: str | None = None
    discarded: int = 0  # derive's rows of traces Flax throws away (not compared: they never exist)
    lanes: int = 0  # compared rows inside a vmap/scan/while


ROW = ("path", "requested", "stream", "count", "lane", "key")


def _row(c) -> tuple:
    d = c.derivation
    return d.path, d.stream_requested, d.stream, d.count, getattr(d, "lane", ()), c.key


def flax_rows(records: list[dict]) -> list[tuple]:
    return [tuple(r[k] for k in ROW) for r in records]


def derive_rows(report) -> list[tuple]:
    """derive's keys that exist at run time: every row not marked discarded."""
    return [_row(c) for c in report.calls if not getattr(c.derivation, "discarded", False)]


def _first_difference(ours: list, theirs: list) -> str:
    from collections import Counter

    a, b = Counter(ours), Counter(theirs)
    if a == b:
        head = "the same keys (as a multiset), in a different order; "
    else:
        only_ours, only_theirs = list((a - b).elements()), list((b - a).elements())
        head = (
            f"{len(only_ours)} rows only in rngaudit (first: {only_ours[:1]}), {len(only_theirs)} only "
            f"in flax (first: {only_theirs[:1]}); "
        )
    for i, (x, y) in enumerate(zip(ours, theirs)):
        if x != y:
            return head + f"row {i}: rngaudit {x} != flax {y}  [{', '.join(ROW)}]"
    return (
        head
        + f"rngaudit has {len(ours)} rows, flax {len(theirs)}; first extra: "
        + repr((ours if len(ours) > len(theirs) else theirs)[min(len(ours), len(theirs))])
    )


def _raised_in(e: BaseException, function: str) -> bool:
    """Whether `function` is the innermost frame that raised `e` (in the traceback JAX keeps unfiltered)."""
    import traceback

    frames = [f for f in traceback.format_exception(e) if f.lstrip().startswith("File ")]
    return bool(frames) and f"in {function}" in frames[-1]


def _lacking(spec: Spec) -> str | None:
    """A construct of the spec that its release lacks (the parser refuses it in a spec that names the release)."""

    rules = spec.rules
    seen: set = set()

    def walk(x):
        if isinstance(x, (tuple, list)):
            for v in x:
                found = walk(v)
                if found:
                    return found
            return None
        if not dataclasses.is_dataclass(x) or isinstance(x, type) or id(x) in seen:
            return None
        seen.add(id(x))
        if isinstance(x, _nodes.Lift):
            if x.kind == "fold_rngs" and rules.lacks("nn.fold_rngs"):
                return "nn.fold_rngs"
            if (
                x.kind == "scan"
                and x.opt("check_constancy_invariants") is False
                and rules.lacks("nn.scan's check_constancy_invariants")
            ):
                return "nn.scan's check_constancy_invariants"
        if isinstance(x, ModuleDef) and x.layer and f"nn.{x.layer}" in LINEN_SINCE and rules.lacks(f"nn.{x.layer}"):
            return f"nn.{x.layer}"
        return walk([getattr(x, f.name) for f in dataclasses.fields(x)])

    return walk(spec.model)


def check_against_flax(spec: Spec, raw_keys: bool = False) -> Agreement:
    """Asserts that rngaudit and real Flax agree on the spec: the same sequence of (path, stream
    requested, stream used, count, lane, key data) for every key that exists at run time (derive's
    rows not marked discarded; the oracle's captured keys), the same drawn values, or the same Flax
    error class and message. Returns what was compared."""
    from rngaudit import FlaxError, derive

    if not FORK_JIT and spec.flax_version is None:
        # an older oracle Flax (the version matrix): a spec that names no release is checked under that one's rules,
        # unless it uses what that release lacks (nothing to compare: the spec is refused under those rules)
        spec = dataclasses_replace(spec, flax_version=flax.__version__)
        lacking = _lacking(spec)
        if lacking:
            import pytest

            pytest.skip(f"flax {flax.__version__} has no {lacking}")
    ours_error = theirs_error = None
    try:
        report = derive(spec)
    except FlaxError as e:
        ours_error = e
    try:
        filtering = jax.config.jax_traceback_filtering
        jax.config.update("jax_traceback_filtering", "off")  # (the frames _raised_in looks for)
        try:
            records = flax_keys(spec, raw_keys)
        finally:
            jax.config.update("jax_traceback_filtering", filtering)
    except OracleUnsupported:
        raise
    except Exception as e:  # noqa: BLE001 - whatever Flax raises is the expected answer
        if isinstance(e, NameError) and "unbound axis name: _rngaudit_lane" in str(e):
            # the oracle's own lane instrumentation (an axis name of its own) failed, not Flax
            raise OracleUnsupported(f"the oracle cannot capture lanes here: {e}") from None
        if isinstance(e, ValueError) and _raised_in(e, "_while_partial_eval_custom"):
            # JAX's own partial evaluation of a while_loop (under remat, in a scan's constancy-check trace)
            # fails with this internal error on the oracle's model: a JAX failure rngaudit does not model
            # (not a Flax rule), so there is nothing to compare
            raise OracleUnsupported(f"JAX cannot partially evaluate the oracle's while_loop here: {e}") from None
        theirs_error = e
    if ours_error is not None or theirs_error is not None:
        assert theirs_error is not None, f"rngaudit predicts an error Flax does not raise: {ours_error}"
        assert ours_error is not None, (
            f"Flax raises {type(theirs_error).__name__}: {theirs_error}; rngaudit derived keys"
        )
        name = type(theirs_error).__name__
        assert ours_error.flax_error == name, f"rngaudit: {ours_error}; flax: {name}: {theirs_error}"
        # JAX's own errors (cond/scan structure, vmap out_axes) go on over several lines that name
        # internal functions: compare their first sentence; the oracle's own vmap axis names go
        core = str(theirs_error).split(FLAX_DOCS)[0].rstrip(".").split("\n")[0].rstrip(":")
        core = re.sub(r" \(axis_name='?_rngaudit_lane_\d+'?\)", "", core)
        if name == "KeyError" and core.startswith('"'):
            core = core.strip('"')  # (a KeyError's text is its message quoted: NNX's missing stream)
        for before, now in JAX_MESSAGES.items():
            if re.match(before, core):
                core = now
        assert ours_error.message.startswith(f"Flax raises {name}: {core}"), (
            f"rngaudit: {ours_error.message!r}; flax: {core!r}"
        )
        return Agreement(error=name)
    ours = derive_rows(report)
    theirs = flax_rows(records)
    assert ours == theirs, _first_difference(ours, theirs)
    values = 0
    live = [c for c in report.calls if not getattr(c.derivation, "discarded", False)]
    for i, (c, r) in enumerate(zip(live, records)):
        if c.values is None or c.derivation.kind == "attention_dropout":
            continue
        if "value" not in r and c.derivation.kind == "dropout" and getattr(c.derivation, "lane", ()):
            continue  # a Dropout mask inside a vmap/scan: the oracle does not see its output per lane
        assert "value" in r, f"call {i}: rngaudit drew {c.draw.describe()}, the oracle has no value"
        v = r["value"]
        assert c.values.dtype == v.dtype and c.values.shape == v.shape, (
            f"call {i}: rngaudit {c.values.dtype}{c.values.shape} != flax {v.dtype}{v.shape}"
        )
        if OLD_XLA and np.issubdtype(v.dtype, np.floating):
            # JAX before 0.5's XLA computes a draw inside Flax's traced scan/jit a unit in the last place apart
            # from the same draw run eagerly (the keys, compared above, are equal bit for bit)
            ok = np.allclose(c.values, v, rtol=4 * np.finfo(v.dtype).eps, atol=0)
        else:
            ok = np.array_equal(c.values, v)
        assert ok, f"call {i}: values differ:\n{c.values}\n{v}"
        values += 1
    return Agreement(
        len(ours),
        values,
        sum(1 for c in live if c.derivation.fallback),
        discarded=len(report.calls) - len(live),
        lanes=sum(1 for c in live if getattr(c.derivation, "lane", ())),
    )


def flax_params(f) -> dict:
    """What real Flax initialises for the model file `f` (its `make()` returns (module, args)), with
    params=key(0) and dropout=key(1): {(path..., param): value}."""
    spec = importlib.util.spec_from_file_location(f"_oracle_{f.stem}_{id(f)}", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, args = mod.make()
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, *args)
    return {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(variables["params"]).items()}
