"""Flax's lifted-transform rules: the traces nn.vmap, nn.scan, nn.jit, nn.fold_rngs, nn.remat and
nn.map_variables make of a module's method, and nn.cond, nn.switch and nn.while_loop inside one (which
streams each trace sees, split or folded per lane, which collections, which keys Flax throws away)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..errors import FlaxError, Location
from ..spec.tree import Cond, Lift, WhileLoop
from .filters import (
    EVERY,
    AllBut,
    combine_discard,
    filter_set,
    select,
    union_cols,
    vmap_broadcast,
)
from .hashing import hash_input, hash_word
from .refs import Discovered, ForkOf, LaneFold, LaneSplit, StaticFold
from .scope import MAP_RUN1, SCAN_CHECK, Instance, Run, Scope
from .variables import raise_carry

if TYPE_CHECKING:
    from .replay import Replayer


def validate_setup(r: Replayer, inst: Instance) -> None:
    """Before a lifted transform, Flax evaluates setup() abstractly on a fresh clone bound to a
    TestScope: no variables, every collection mutable, no rngs, and a make_rng that hands out a
    dummy key at that root only; its children's scopes are plain ones without rngs. Its errors
    (a child called in setup that needs a key, a name clash) are raised; nothing else is kept."""
    # mirrors flax/linen/module.py Module._try_setup(shallow=True) -> _validate_setup
    # (transforms.py get_module_scopes); a fresh Replayer keeps this run's templates untouched
    from .replay import Replayer  # (a cycle at import time: replay imports these rules)

    probe = Replayer(r.spec)
    clone = Instance(inst.mod, Scope((), {}, abstract=True), clone=inst.clone)
    probe.setup(clone, Run("init", True, tuple(r.spec.rngs), False))


def traces(r: Replayer, lift: Lift, inst: Instance, run: Run):
    """Yield the lifted scope once per trace Flax makes of the wrapped function (R10-R17)."""
    scope = inst.scope
    kind = lift.kind
    if kind in ("vmap", "scan"):
        n = lift.opt("axis_size") if kind == "vmap" else lift.opt("length")
        axis = r.new_axis(n, kind)
        rngs = {}
        # mirrors flax/core/lift.py vmap/scan: split_rngs keys filter the streams; split acts on
        # the raw base key (tree_map_rngs over LazyRng.rng) and keeps the suffix
        for s, split in select(scope.rngs, lift.opt("split_rngs", ())):
            ref, suffix = scope.rngs[s]
            rngs[s] = (LaneSplit(ref, n, axis) if split else ref, suffix)
        axes_cols = tuple(c for c, _ in lift.opt("variable_axes", ()))
        broadcast = lift.opt("variable_broadcast", False)
        cols: frozenset | AllBut | None = union_cols(*axes_cols, broadcast, lift.opt("variable_carry", False))
        if cols is not None and scope.cols is not None:
            cols &= scope.cols
        elif cols is None:
            cols = scope.cols
        bset = filter_set(broadcast)  # None: every collection is broadcast
        if kind == "vmap":
            bset = vmap_broadcast(lift.opt("variable_axes", ()))
        lanes = scope.lanes + ((axis, kind, bset, frozenset()),)
        carry = scope.carry | carried(lift.opt("variable_carry", False), broadcast)
        if kind == "scan" and lift.opt("check_constancy_invariants", True):
            # mirrors flax/core/axes_scan.py scan_fn: trace 1 (pe.trace_to_jaxpr) only checks that
            # broadcast values are loop invariant; its keys are thrown away, except initialisers
            # of broadcast variables, whose values are kept. Scanned variables made there are
            # dropped and made again in trace 2.
            before = set(run.store)
            keep = True if bset is None else bset
            yield scope.lifted(
                kind,
                rngs=rngs,
                cols=cols,
                discard=combine_discard(scope.discard, keep),
                context=scope.context + (SCAN_CHECK,),
                lanes=lanes,
                carry=carry,
            )
            raise_carry(run, axis)
            if bset is not None:
                for key in set(run.store) - before:
                    if key[1] not in bset:
                        del run.store[key]
            yield scope.lifted(kind, rngs=rngs, axes=scope.axes + (axis,), cols=cols, lanes=lanes, carry=carry)
            raise_carry(run, axis)
        elif kind == "scan":
            # mirrors flax/core/axes_scan.py simple_scan_fn: without the constancy check the
            # broadcast outputs are dropped, so broadcast variables the body made do not persist
            before = set(run.store)
            # and the broadcast variables are never checked against the body: no dependency error
            # (and the broadcast variables the body makes never reach the lifts around it)
            lanes = scope.lanes + ((axis, kind, frozenset(), bset),)
            yield scope.lifted(kind, rngs=rngs, axes=scope.axes + (axis,), cols=cols, lanes=lanes, carry=carry)
            raise_carry(run, axis)
            for key in set(run.store) - before:
                if bset is None or key[1] in bset:
                    del run.store[key]
        else:
            yield scope.lifted(kind, rngs=rngs, axes=scope.axes + (axis,), cols=cols, lanes=lanes)
            raise_carry(run, axis, carry=False)
    elif kind == "jit" and r.rules.jit != "fork":
        yield from _old_jit(r, lift, inst, run)
    elif kind in ("jit", "fold_rngs"):
        # mirrors flax/linen/transforms.py fork_rngs: one make_rng per visible stream, at the
        # module's own scope, on every call; inside, keys derive from the fork with no suffix,
        # and the streams come in sorted order (the forks pass through JAX as a dict)
        forked = {}
        for s in list(scope.rngs):
            t = r.make_rng(
                scope,
                s,
                f"{kind}_fork",
                f"fork of {s!r}",
                None,
                lift.loc,
                run,
                note=f"nn.{kind} forks every visible stream here on every call: this uses "
                "up a count, and keys inside derive from this key",
            )
            # (apply's pre-init run records no template: the fork's own reference carries the
            # lanes it depends on, for broadcast checks inside)
            forked[s] = (ForkOf(t) if isinstance(t, int) else t.ref if isinstance(t, Discovered) else None, ())
        rngs = {s: forked[s] for s, _ in select(forked, ((lift.opt("rngs", True), None),), jax_pytree=True)}
        where = "/".join(scope.path) or "(root)"
        if not inst.setup_done:
            # The first call runs the module's setup() outside the trace but inside fork_rngs,
            # which has replaced the scope's rngs with the forks (every stream, no suffix).
            inst.scope = scope.lifted(
                rngs=forked,
                context=scope.context
                + (f"setup() of a module under nn.{kind}: runs once, after the fork, and derives from it",),
            )
            r.setup(inst, run)
            inst.scope = scope
        yield scope.lifted(
            kind,
            rngs=rngs,
            context=scope.context
            + (
                (
                    f"inside nn.{kind} at {where}: derived from the fork key made there on this call, not from "
                    "rngs, so it differs from the un-transformed module's key"
                ),
            ),
        )
    elif kind in ("remat", "map_variables"):
        rngs = {
            s: scope.rngs[s]
            for s, _ in select(scope.rngs, ((lift.opt("rngs", True), None),), jax_pytree=kind == "remat")
        }
        inner = scope.lifted(kind, rngs=rngs)
        if kind == "map_variables" and not (lift.opt("init") or lift.opt("mutable")):
            # mirrors flax/core/lift.py map_variables: mapped collections are read-only unless
            # init=True or mutable=True
            mapped = filter_set(lift.opt("mapped_collections", True))
            inner.frozen = scope.frozen | (mapped if mapped is not None else {EVERY})
        second = inner
        if kind == "map_variables" and lift.opt("init", False) and any_mutable(run, scope):
            # mirrors flax/core/lift.py map_variables: with init=True and a collection mutable here, the body
            # runs once to create the variables (its keys thrown away), on every collection, then again on
            # what that run's repack returns: in apply with a `mutable` list, a mapped collection only
            # where it is mutable, and every other collection whole (measured against Flax)
            mapped = filter_set(lift.opt("mapped_collections", True))
            # Only the mapped collections of that run are kept (`target, _ = repack(scopes)`):
            # variables it made in the others (their initialisers did run) are made again, with
            # new counts, in the second run.
            before = set(run.store)
            yield inner.lifted(discard=combine_discard(scope.discard, True), context=scope.context + (MAP_RUN1,))
            if mapped is not None:
                for key in set(run.store) - before:
                    if key[1] not in mapped:
                        del run.store[key]
            if isinstance(run.mutable, tuple):
                mutable = frozenset(run.mutable)
                seen = mutable if mapped is None else AllBut(mapped - mutable)
                second = inner.lifted(cols=seen if inner.cols is None else inner.cols & seen)
        yield second
    else:
        raise AssertionError(kind)


def _old_jit(r: Replayer, lift: Lift, inst: Instance, run: Run):
    """nn.jit before flax 0.10.2: no fork. Up to 0.8.5 keys pass in as they are (transparent); from 0.9.0 to
    0.10.1 each visible stream's lazy key is folded (LazyRng.fold: its path suffix hashed into the key) at the
    boundary, so keys inside hash only the path below the jitted module and the count. The counters inside
    are the module's own (shared, not forked). jax may reuse an earlier trace: see _reused_trace."""
    # mirrors flax 0.9.0 linen/transforms.py module_class_lift_transform_cached (no fork_rngs) and
    # flax/core/lift.py jit: from 0.9.0 the module's setup() runs on its own scope first (before, in
    # module_class_lift_transform_jit, only the clone inside the trace runs it), and lift.pack shares its counters
    scope = inst.scope
    if r.rules.jit == "fold" and not inst.setup_done:
        inst.scope = scope.lifted(
            context=scope.context
            + ("setup() of a module under nn.jit (flax 0.9.0 to 0.10.1): runs once on its own scope, before the trace",)
        )
        r.setup(inst, run)
        inst.scope = scope
    visible = {s: scope.rngs[s] for s, _ in select(scope.rngs, ((lift.opt("rngs", True), None),), jax_pytree=True)}
    where = "/".join(scope.path) or "(root)"
    context = scope.context
    if r.rules.jit == "fold":
        rngs = {
            s: ((StaticFold(ref, hash_word(hash_input(suffix, r.sep))), ()) if suffix else (ref, ()))
            for s, (ref, suffix) in visible.items()
        }
        context += (
            (
                f"inside nn.jit at {where} (flax 0.9.0 to 0.10.1): the path up to it is folded into the key at "
                "the jit boundary, and this key hashes only the path below it and the count"
            ),
        )
    else:
        rngs = visible
        context += (
            (
                f"inside nn.jit at {where} (before flax 0.9.0 nn.jit is transparent: the module gets the key it "
                "would get without nn.jit)"
            ),
        )
    p, n = scope.path, len(scope.path)
    saved = {k: c for k, c in run.counters.items() if k[0][:n] == p}
    hit = _reused_trace(inst, lift, scope, run, rngs, r.rules.jit_counters_in_cache_key, saved)
    if hit is None:
        yield scope.lifted("jit", rngs=rngs, context=context)
        return
    # the trace reused: the keys that trace made (its counts, on this call's keys), but Python does not run,
    # so the counters (of the module and every module below it) stay where they were
    first, start = hit
    for k in saved:
        del run.counters[k]
    run.counters.update({(p + rel, stream): c for (rel, stream), c in start.items()})
    context += (
        (
            f"jax reused the trace nn.jit made at {first} (before flax 0.10.2, when the module's "
            + ("fields, counters" if r.rules.jit_counters_in_cache_key else "fields")
            + " and variables are the same), so this call does not advance the counters: a later call here "
            "repeats these counts"
        ),
    )
    yield scope.lifted("jit", rngs=rngs, context=context)
    for k in [k for k in run.counters if k[0][:n] == p]:
        del run.counters[k]
    run.counters.update(saved)


def _reused_trace(
    inst: Instance, lift: Lift, scope: Scope, run: Run, rngs: dict, counters_in_key: bool, counters: dict
) -> tuple[str, dict] | None:
    """Whether jax reuses an earlier trace of this nn.jit class (before flax 0.10.2): the path that traced it
    and the counters it started from (relative to the module), or None (this call is traced, and recorded). The trace cache's key is the module's hash (its class
    and fields, not its name; from 0.8.2 also its scope's rng counters, every module below included), the
    streams passed in with their static path suffixes, the variables, and the mutable collections.
    rngaudit takes equal module definitions as one class (a `JitBlock = nn.jit(Block)` made once) and
    equal argument shapes."""
    # mirrors flax 0.9.0 linen/transforms.py _module_fingerprint (0.8.1: _module_pytree_hash, fields only)
    # and flax/core/lift.py jit: jax.jit(jitted)(fingerprint, variable_groups, rng_groups, ...)
    p, n = scope.path, len(scope.path)
    start = {(k[0][n:], k[1]): c for k, c in counters.items() if c}
    variables = tuple(sorted((k[0][n:], k[1], k[2], v) for k, v in run.store.items() if k[0][:n] == p))
    streams = tuple(sorted((s, suffix) for s, (_, suffix) in rngs.items()))
    fingerprint = tuple(sorted(start.items())) if counters_in_key else ()
    # (not the lanes around it: inside a vmap or a scan jax traces the function on one lane's values; which of the
    # module's transforms this is: each nn.jit of a chain is its own jitted function with its own cache)
    which = next((i for i, other in enumerate(inst.mod.lifts) if other is lift), None)
    key = (module_shape(inst.mod), which, fingerprint, variables, streams, run.phase, run.mutable)
    hit = run.jit_traces.get(key)
    if hit is None:
        run.jit_traces[key] = ("/".join(p) or "(root)", start)
    return hit


def module_shape(mod, memo: dict | None = None):
    """A module definition as Flax's fingerprint sees it: every field but its name and where the spec wrote it."""
    return _shape(mod, {} if memo is None else memo, top=True)


def _shape(x, memo: dict, top: bool = False):
    if isinstance(x, (tuple, list)):
        return tuple(_shape(v, memo) for v in x)
    if not dataclasses.is_dataclass(x) or isinstance(x, (type, Location)):
        return x
    hit = memo.get((id(x), top))
    if hit is None:
        hit = memo[(id(x), top)] = (type(x).__name__,) + tuple(
            (f.name, _shape(getattr(x, f.name), memo))
            for f in dataclasses.fields(x)
            if f.name != "loc" and not (top and f.name == "name")
        )
    return hit


def carried(carry, broadcast) -> frozenset:
    """The collections a scan carries: those its variable_carry filter takes and variable_broadcast does not
    (broadcast comes first: flax/core/lift.py scan packs (variable_broadcast, variable_carry, ...) and
    group_collections gives each collection to the first filter that takes it). Names, EVERY, or an
    AllBut (every collection but the broadcast ones)."""
    if carry is False:
        return frozenset()
    cset, bset = filter_set(carry), filter_set(broadcast)
    if bset is None:
        return frozenset()
    if cset is None:
        return frozenset({AllBut(bset)}) if bset else frozenset({EVERY})
    return cset - bset


def any_mutable(run: Run, scope: Scope) -> bool:
    """Whether some collection is mutable at `scope`: the run's mutable collections that every
    enclosing lift lets out (its out filters, Scope.cols) and none makes read-only."""
    # mirrors flax/core/lift.py pack: scope_mutable = intersect(scope.mutable, union of out filters)
    if scope.immutable or EVERY in scope.frozen or not run.mutable:
        return False
    cols = scope.cols
    if run.mutable is True:
        if cols is None or isinstance(cols, AllBut):
            return True  # every collection but finitely many
        return bool(cols - scope.frozen)
    mutable = frozenset(run.mutable) if isinstance(run.mutable, tuple) else frozenset()
    return bool((mutable if cols is None else cols & mutable) - scope.frozen)


# the note on the draws of a submodule made before an nn.while_loop and called in it; collisions finds it by
# OUTSIDE_LOOP_MARK
OUTSIDE_LOOP_MARK = " was made before the nn.while_loop, outside it, "
OUTSIDE_LOOP = (
    "{name}" + OUTSIDE_LOOP_MARK + "and keeps the scope outside: its draws in the loop get "
    "the same key in every iteration, whatever split_rngs says; for keys that differ per iteration, define it in "
    "setup and call it as an attribute of the module the loop hands its body (body_fn(mdl, c): mdl.block(c), not "
    "self.block(c))"
)


def trace_branch(
    r: Replayer, inst: Instance, scope: Scope, items, cursor: dict, local: dict, run: Run, axis: int | None = None
) -> dict:
    """Trace `items` as a function of the module (nn.cond/switch/while_loop): on a clone bound
    to the lifted scope, starting from the module's current auto-name cursor. A submodule the module's compact
    method made before (`local`) stays bound to its scope outside: called in the branch, it draws the outer
    stream's keys, counting on, the same in every iteration of a loop (`axis`; measured against Flax)."""
    # mirrors flax/linen/transforms.py decorator_lift_transform core_fn: state.export() per target
    clone = Instance(inst.mod, scope, clone=inst.clone)
    r.setup(clone, run)
    branch_cursor = dict(cursor)
    outer = dict(local)
    if axis is not None:
        for name, child in local.items():
            # (read-only inside the loop, as its other variables are)
            note = OUTSIDE_LOOP.format(name=name)
            at = child.scope.lifted(axes=child.scope.axes + (axis,), immutable=True, context=scope.context + (note,))
            outer[name] = Instance(child.mod, at, clone=child.clone)
    r.items(clone, items, outer, branch_cursor, run)
    return branch_cursor


def cond(r: Replayer, inst: Instance, item: Cond, cursor: dict, local: dict, run: Run) -> None:
    # mirrors flax/core/lift.py cond/switch: jax.lax.cond/switch trace every branch, in order
    scope = inst.scope
    # (the branches get the streams in the scope's order: measured against Flax, unlike while_loop)
    rngs = {s: scope.rngs[s] for s, _ in select(scope.rngs, ((item.rngs, None),), jax_pytree=False)}
    last = cursor
    n = len(item.branches)
    before = dict(run.store)
    made = None
    for k, branch in enumerate(item.branches):
        which = ("true", "false")[k] if item.kind == "cond" else str(k)
        inner = scope.lifted(
            item.kind,
            rngs=rngs,
            context=scope.context
            + (
                (
                    f"nn.{item.kind} branch {which}: every branch is traced, in order, so its counts are "
                    f"taken even when branch {which} does not run ({n} branches share counters)"
                ),
            ),
        )
        # every branch starts from the same variables (scope_fn(variable_groups, ...))
        run.store = dict(before)
        last = trace_branch(r, inst, inner, branch, cursor, local, run)
        new = {key: v for key, v in run.store.items() if key not in before}
        if made is not None and set(new) != set(made):
            raise FlaxError(
                "TypeError",
                f"{item.kind} branch outputs must have the same pytree structure, but they differ: "
                f"nn.{item.kind} branches must create the same variables; create them before the "
                f"{item.kind} or in every branch",
                item.loc,
            )
        made = new
    cursor.clear()
    cursor.update(last)


def while_loop(r: Replayer, inst: Instance, item: WhileLoop, cursor: dict, local: dict, run: Run) -> None:
    # mirrors flax/core/lift.py while_loop: cond traced before body; a split stream is folded with
    # the iteration index, negated for cond (make_loop_rngs(-i)); cond sees immutable variables
    scope = inst.scope
    selected = select(scope.rngs, item.split_rngs)
    last = cursor
    for items, negate, size, what in (
        (item.cond_items, True, item.iterations + 1, "cond"),
        (item.body_items, False, item.iterations, "body"),
    ):
        axis = r.new_axis(size, "while_loop")
        rngs = {}
        for s, split in sorted(selected):
            # the loop's rngs pass through jax.lax.while_loop as a dict: in sorted order inside
            ref, suffix = scope.rngs[s]
            rngs[s] = (LaneFold(ref, axis, negate) if split else ref, suffix)
        # linen's nn.while_loop lifts every collection read-only (broadcast_variables=True)
        inner = scope.lifted(
            "while_loop",
            rngs=rngs,
            axes=scope.axes + (axis,),
            immutable=True,
            context=scope.context + (f"nn.while_loop {what}",),
        )
        last = trace_branch(r, inst, inner, items, cursor, local, run, axis)
    cursor.clear()
    cursor.update(last)
