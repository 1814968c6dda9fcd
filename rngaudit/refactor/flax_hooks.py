"""Hooks into real Flax, one per function capture observes, installed for the length of a capture and removed
after it: each calls Flax's own function and tells the active Recorder what happened."""

from __future__ import annotations

# What is hooked (the same technique as tests/flax_oracle.py): Scope.make_rng, Scope.param, Scope.variable,
# Module.__post_init__, the lifting functions of flax.core.lift (vmap, scan, jit, checkpoint/remat,
# fold_rngs, map_variables, cond, switch, while_loop), flax.core.axes_scan.scan and
# flax.linen.transforms.fork_rngs. Each hook calls the original with the same arguments, except additions
# that cannot change a key: nn.vmap gets an `axis_name` (when it has none) so a lane can ask
# `jax.lax.axis_index`; the scan body gets one extra scanned input, `arange(length)`, its step index;
# nn.while_loop's carry gets one more value, the iteration index (the carry starts behind
# `jax.lax.optimization_barrier`, so XLA cannot work out a trip count and skip evaluating cond); and when
# capture runs the model again to see the other nn.cond/switch branches run, their predicate or index is
# replaced (every branch is traced whatever it is, so no count moves).
#
# A class transform made while the hooks are installed (`nn.jit(Block)` in the user's module or factory)
# keeps the hook it was made with for as long as the class lives, so a hook passes straight through to
# Flax's function whenever no recording is active, also after `installed()` has ended.
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import flax.linen.transforms as linen_transforms
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import axes_scan, lift
from flax.core.scope import Scope, is_filter_empty

from .recorder import (
    BranchFrame,
    CaptureUnsupported,
    JitFrame,
    LiftNode,
    MapFrame,
    Recorder,
    ScanFrame,
    TraceNode,
    VmapFrame,
    WhileFrame,
    is_concrete,
)

ACTIVE: list[Recorder] = []  # the recordings in progress, innermost last
_ORIG: dict[str, Any] = {}  # Flax's own functions, by hook name (kept: a class transform may outlive a capture)
_UNSUPPORTED = ("vjp", "jvp", "custom_vjp")


def _rec() -> Recorder | None:
    return ACTIVE[-1] if ACTIVE else None


def _bind(fn, args, kwargs) -> dict:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _axis_size(in_axes, args) -> int | None:
    """The size of the mapped axis, from the first array an axis maps: `in_axes` is a prefix tree of `args`
    (an int for all of them, a tuple per argument, nested tuples or dicts inside one), as jax.vmap and Flax's
    axes_scan read it; None and axes_scan.broadcast map nothing."""
    sizes: list[int] = []

    def visit(ax, sub) -> None:
        if isinstance(ax, int) and not isinstance(ax, bool):
            for leaf in jax.tree_util.tree_leaves(sub):
                shape = getattr(leaf, "shape", None)
                if shape is not None and -len(shape) <= ax < len(shape):
                    sizes.append(int(shape[ax]))

    try:
        jax.tree_util.tree_map(visit, in_axes, tuple(args), is_leaf=lambda a: a is None or a is axes_scan.broadcast)
    except (ValueError, TypeError):  # in_axes is not a prefix of args: Flax itself will say so
        return None
    return sizes[0] if sizes else None


# ---------------------------------------------------------------- scopes and modules
def make_rng(scope, name="params"):
    key = _ORIG["make_rng"](scope, name)
    rec = _rec()
    if rec is not None:
        rec.make_rng(scope, name, key)
    return key


def param(scope, name, init_fn, *args, **kwargs):
    rec = _rec()
    if rec is None:
        return _ORIG["param"](scope, name, init_fn, *args, **kwargs)
    rec.inits.append(("params", name))
    try:
        return _ORIG["param"](scope, name, init_fn, *args, **kwargs)
    finally:
        rec.inits.pop()


def variable(scope, col, name, *args, **kwargs):
    rec = _rec()
    if rec is None:
        return _ORIG["variable"](scope, col, name, *args, **kwargs)
    rec.inits.append((col, name))
    try:
        return _ORIG["variable"](scope, col, name, *args, **kwargs)
    finally:
        rec.inits.pop()


def post_init(self):
    rec = _rec()
    if rec is None:
        return _ORIG["post_init"](self)
    name_before = self.name
    # a bound module adopts the modules in its dataclass fields (nn.Sequential's layers) inside its own
    # __post_init__: such a child lives as long as its parent, as one defined in the parent's setup() does
    adopted = bool(rec.binding) and rec.binding[-1] is self.parent
    rec.binding.append(self)
    try:
        out = _ORIG["post_init"](self)
    finally:
        rec.binding.pop()
    # the parent is only known after Flax's __post_init__ (it is taken from the module stack there)
    parent = self.parent
    is_mod = isinstance(parent, nn.Module)
    parent_setup = bool(is_mod and (parent._state.in_setup or adopted))
    parent_compact = bool(is_mod and parent._state.in_compact_method)
    rec.post_init(self, name_before, parent_setup, parent_compact)
    return out


# ---------------------------------------------------------------- lifted transforms
def _lifted(kind: str, a: dict, inner, options: dict):
    """The lifted function `inner`, recording one LiftNode at its owner's call per call."""

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


def _traced(fn, extra: Callable | None = None):
    """The body `fn`, recording one TraceNode per trace (and a frame made by `extra` from its arguments)."""

    @functools.wraps(fn)
    def body(*xs, **kw):
        rec = _rec()
        if rec is None:
            return fn(*xs, **kw)
        node = rec.stack[-1]
        trace = TraceNode()
        if isinstance(node, LiftNode):
            node.traces.append(trace)
        with rec.push(trace), rec.frame(extra(xs)) if extra else contextlib.nullcontext(), rec.batch():
            return fn(*xs, **kw)

    return body


def vmap(fn, *args, **kwargs):
    rec = _rec()
    if rec is None:
        return _ORIG["vmap"](fn, *args, **kwargs)
    a = _bind(_ORIG["vmap"], (fn,) + args, kwargs)
    if a["axis_name"] is None:
        a["axis_name"] = f"_rngaudit_lane_{next(rec.axis_names)}"
    name = a["axis_name"]
    a["fn"] = _traced(fn, lambda xs: VmapFrame(name))
    opts = {"axis_size": a["axis_size"], "split_rngs": a["split_rngs"], "variable_axes": a["variable_axes"]}
    return _lifted("vmap", a, _ORIG["vmap"](**a), opts)


def scan(fn, *args, **kwargs):
    if _rec() is None:
        return _ORIG["scan"](fn, *args, **kwargs)
    a = _bind(_ORIG["scan"], (fn,) + args, kwargs)
    a["fn"] = _traced(fn)
    opts = {
        k: a[k]
        for k in (
            "length",
            "split_rngs",
            "variable_axes",
            "variable_broadcast",
            "variable_carry",
            "check_constancy_invariants",
        )
    }
    return _lifted("scan", a, _ORIG["scan"](**a), opts)


def axes_scan_scan(
    fn, in_axes, out_axes, length=None, reverse=False, unroll=1, _split_transpose=False, check_constancy_invariants=True
):
    """flax.core.axes_scan.scan: the step index goes in as one more scanned input, and the first trace of a
    scan that checks constancy is told apart (Flax throws its keys away)."""
    rec = _rec()
    if rec is None:
        return _ORIG["axes_scan"](
            fn,
            in_axes,
            out_axes,
            length=length,
            reverse=reverse,
            unroll=unroll,
            _split_transpose=_split_transpose,
            check_constancy_invariants=check_constancy_invariants,
        )
    broadcast = rec.pending_scan[-1] if rec.pending_scan else False
    traces = [0]

    def body(broadcast_in, carry, step, *xs):
        traces[0] += 1
        constancy = check_constancy_invariants and traces[0] == 1
        with rec.frame(ScanFrame(step, constancy, broadcast)):
            return fn(broadcast_in, carry, *xs)

    def run(broadcast_in, init, *args):
        n = length if length is not None else _axis_size(in_axes, args)
        if n is None:
            raise CaptureUnsupported("nn.scan whose length cannot be told from its inputs")
        node = next((x for x in reversed(rec.stack) if isinstance(x, LiftNode)), None)
        if node is not None and node.kind == "scan":
            node.options["length"] = n
        traces[0] = 0
        inner = _ORIG["axes_scan"](
            body,
            (0,) + tuple(in_axes),
            out_axes,
            length=n,
            reverse=reverse,
            unroll=unroll,
            _split_transpose=_split_transpose,
            check_constancy_invariants=check_constancy_invariants,
        )
        return inner(broadcast_in, init, jnp.arange(n, dtype=jnp.int32), *args)

    return run


def _forked(kind: str):
    """lift.jit or lift.fold_rngs: keys inside derive from the fork key each stream got (fork_rngs)."""

    def transform(fn, *args, **kwargs):
        if _rec() is None:
            return _ORIG[kind](fn, *args, **kwargs)
        a = _bind(_ORIG[kind], (fn,) + args, kwargs)

        def body(scope, hash_key, *xs, **kw):
            rec = _rec()
            first = jax.tree_util.tree_leaves(scope, is_leaf=lambda s: isinstance(s, Scope))[0]
            frame = JitFrame(tuple(first.path), {s: lz.rng for s, lz in first.rngs.items()})
            with rec.frame(frame):
                return fn(scope, hash_key, *xs, **kw)

        traced = _traced(functools.wraps(fn)(body))
        cached = _ORIG[kind](traced, *args, **kwargs)

        def inner(*xs, **kw):
            if _rec() is None:
                return cached(*xs, **kw)
            # (recording: a lifted function of its own each call, traced afresh; jax.jit's cache would reuse the
            # trace of another instance of the same jitted class, `JBlock = nn.jit(Block)` called in a loop, and
            # capture would see none of its draws. The keys are the same: they derive from the fork keys passed in)
            return _ORIG[kind](traced, *args, **kwargs)(*xs, **kw)

        return _lifted(kind, a, inner, {"rngs": a["rngs"]})

    transform.__name__ = transform.__qualname__ = kind
    return transform


jit = _forked("jit")
fold_rngs = _forked("fold_rngs")


@contextlib.contextmanager
def fork_rngs(module):
    """flax.linen.transforms.fork_rngs: the make_rng calls of the fork are recorded as forks."""
    rec = _rec()
    if rec is None:
        with _ORIG["fork_rngs"](module):
            yield
        return
    forks: list = []
    rec.fork_stack.append(forks)
    try:
        cm = _ORIG["fork_rngs"](module)
        cm.__enter__()
    finally:
        rec.fork_stack.pop()
    rec.pending_forks = forks
    try:
        yield
    except BaseException as e:
        if not cm.__exit__(type(e), e, e.__traceback__):
            raise
    else:
        cm.__exit__(None, None, None)


def checkpoint(fn, *args, **kwargs):
    if _rec() is None:
        return _ORIG["checkpoint"](fn, *args, **kwargs)
    a = _bind(_ORIG["checkpoint"], (fn,) + args, kwargs)
    a["fn"] = _traced(fn)
    return _lifted("remat", a, _ORIG["checkpoint"](**a), {"rngs": a["rngs"]})


def map_variables(fn, *args, **kwargs):
    if _rec() is None:
        return _ORIG["map_variables"](fn, *args, **kwargs)
    a = _bind(_ORIG["map_variables"], (fn,) + args, kwargs)
    runs = [0]

    def body(scopes, *xs, **kw):
        runs[0] += 1
        leaves = jax.tree_util.tree_leaves(scopes, is_leaf=lambda s: isinstance(s, Scope))
        # mirrors flax/core/lift.py map_variables: init=True with a mutable collection runs fn twice
        run1 = bool(a["init"]) and runs[0] == 1 and any(not is_filter_empty(s.mutable) for s in leaves)
        with _rec().frame(MapFrame(run1)):
            return fn(scopes, *xs, **kw)

    a["fn"] = _traced(functools.wraps(fn)(body))
    opts = {k: a[k] for k in ("mapped_collections", "init", "mutable", "rngs", "variables")}
    return _lifted("map_variables", a, _ORIG["map_variables"](**a), opts)


# ---------------------------------------------------------------- control flow inside a method
def _branching(kind: str, index, fns, scope, call, kw):
    """nn.cond / nn.switch: every branch is traced, in order; each trace is recorded at the calling module's
    scope. A re-run may force the branch that runs (`Recorder.selection`)."""
    rec = _rec()
    assert rec is not None  # (cond and switch call this only while recording)
    stmt = next(rec.branch_calls)
    owner = rec.owner_of_lift(scope)
    node = LiftNode(
        rec.next_seq(),
        kind,
        {"rngs": kw.get("rngs", True), "variables": kw.get("variables", True), "branches": len(fns)},
    )
    owner.items.append(node)
    pick = rec.selection.get(stmt)
    if pick is not None:
        index = jnp.asarray(pick == 0) if kind == "cond" else jnp.asarray(pick, jnp.int32)

    def tagged(k, fn):
        @functools.wraps(fn)
        def branch(scope, *xs):
            trace = TraceNode(owner_path=owner.path, label=k)
            node.traces.append(trace)
            with rec.push(trace), rec.frame(BranchFrame(stmt, k, kind)):
                return fn(scope, *xs)

        return branch

    with rec.push(node):
        return call(index, [tagged(k, f) for k, f in enumerate(fns)])


def cond(pred, true_fun, false_fun, scope, *operands, **kw):
    if _rec() is None:
        return _ORIG["cond"](pred, true_fun, false_fun, scope, *operands, **kw)
    return _branching(
        "cond",
        pred,
        (true_fun, false_fun),
        scope,
        lambda p, fns: _ORIG["cond"](p, fns[0], fns[1], scope, *operands, **kw),
        kw,
    )


def switch(index, branches, scope, *operands, **kw):
    if _rec() is None:
        return _ORIG["switch"](index, branches, scope, *operands, **kw)
    return _branching(
        "switch", index, tuple(branches), scope, lambda i, fns: _ORIG["switch"](i, fns, scope, *operands, **kw), kw
    )


def while_loop(cond_fn, body_fn, scope, init, *args, **kwargs):
    rec = _rec()
    if rec is None:
        return _ORIG["while_loop"](cond_fn, body_fn, scope, init, *args, **kwargs)
    a = _bind(_ORIG["while_loop"], (cond_fn, body_fn, scope, init) + args, kwargs)
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
            with rec.push(trace), rec.frame(WhileFrame(i)):
                out = fn(scope, carry)
            return out if part == "cond" else (out, i + 1)

        return step

    def note(n):
        if rec.recording:
            rec.loop_iterations.setdefault(loop, set()).update(int(v) for v in np.asarray(n).ravel())

    a["init"] = jax.lax.optimization_barrier((init, jnp.asarray(0, jnp.int32)))
    a["cond_fn"], a["body_fn"] = looped(cond_fn, "cond"), looped(body_fn, "body")
    with rec.push(node):
        out, n = _ORIG["while_loop"](**a)
    if is_concrete(n):
        note(n)
    else:
        jax.debug.callback(note, n)
    return out


def _unsupported(name: str):
    def transform(*args, **kwargs):
        if _rec() is not None:
            raise CaptureUnsupported(
                f"capture does not describe nn.{name} yet; write that part of the "
                "model's spec by hand (see README, Lifted transforms)"
            )
        return _ORIG[name](*args, **kwargs)

    transform.__name__ = transform.__qualname__ = name
    return transform


# ---------------------------------------------------------------- installing them
# (hook name, the object Flax keeps the function on, its attribute, the hook)
_HOOKS: tuple[tuple[str, Any, str, Any], ...] = (
    ("make_rng", Scope, "make_rng", make_rng),
    ("param", Scope, "param", param),
    ("variable", Scope, "variable", variable),
    ("post_init", nn.Module, "__post_init__", post_init),
    ("vmap", lift, "vmap", vmap),
    ("scan", lift, "scan", scan),
    ("axes_scan", axes_scan, "scan", axes_scan_scan),
    ("jit", lift, "jit", jit),
    ("fold_rngs", lift, "fold_rngs", fold_rngs),
    ("fork_rngs", linen_transforms, "fork_rngs", fork_rngs),
    ("checkpoint", lift, "checkpoint", checkpoint),
    ("remat", lift, "remat", checkpoint),  # flax.core.lift.remat is checkpoint
    ("map_variables", lift, "map_variables", map_variables),
    ("cond", lift, "cond", cond),
    ("switch", lift, "switch", switch),
    ("while_loop", lift, "while_loop", while_loop),
) + tuple((name, lift, name, _unsupported(name)) for name in _UNSUPPORTED)
_INSTALLED = [0]  # nesting depth of installed()


def missing() -> list[str]:
    """The Flax functions the hooks replace that this Flax does not have (an older release)."""
    names = {lift: "flax.core.lift", axes_scan: "flax.core.axes_scan", linen_transforms: "flax.linen.transforms"}
    return [f"{names.get(owner, owner.__name__)}.{attr}" for _, owner, attr, _ in _HOOKS if not hasattr(owner, attr)]


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Flax's functions replaced by the hooks inside the block, Flax's own again after it (nested blocks
    share one installation). Import the user's model inside: a class transform keeps the function it was
    made with."""
    if _INSTALLED[0]:
        _INSTALLED[0] += 1
        try:
            yield
        finally:
            _INSTALLED[0] -= 1
        return
    originals = [(owner, attr, getattr(owner, attr)) for _, owner, attr, _ in _HOOKS]
    for (name, owner, attr, hook), (_, _, original) in zip(_HOOKS, originals):
        if name != "remat":
            _ORIG.setdefault(name, original)
        setattr(owner, attr, hook)
    _INSTALLED[0] = 1
    try:
        yield
    finally:
        _INSTALLED[0] = 0
        for owner, attr, original in originals:
            setattr(owner, attr, original)


@contextlib.contextmanager
def recording(selection: dict | None = None) -> Iterator[Recorder]:
    """Record everything Flax does inside the block (the hooks must be installed); `selection` forces
    nn.cond/switch calls (by their order in the trace) to run the given branch."""
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
