"""Flax's rules for params and variables: whether one exists, may be created here, and whether its key
may depend on a lane (a variable shared by every lane of a vmap or scan cannot be initialised per lane)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import FlaxError, Location
from ..spec.tree import Param, Variable
from .filters import EVERY, AllBut
from .records import Template
from .refs import Discovered, ForkOf, RootKey, StaticFold
from .scope import Instance, Run, Scope

if TYPE_CHECKING:
    from .replay import Replayer


def visible(scope: Scope, col: str) -> bool:
    return scope.cols is None or col in scope.cols


def require_collection(inst: Instance, col: str, name: str, loc: Location, run: Run) -> None:
    # mirrors flax/core/scope.py Scope.param / Scope.variable: a missing variable of an immutable
    # collection that holds no variable at all under the root (is_collection_empty) is
    # ScopeCollectionNotFound; inside a lift the root is the lifted scope
    root = inst.scope.root
    n = len(root)
    if not visible(inst.scope, col) or not any(c == col and p[:n] == root for p, c, _ in run.store):
        raise FlaxError(
            "ScopeCollectionNotFound",
            f'Tried to access "{name}" from collection "{col}" in "{inst.scope.path_text}" but the '
            f"collection is empty. "
            + (
                f"The enclosing transform does not lift {col!r}: add it to variable_axes or variable_broadcast"
                if not visible(inst.scope, col)
                else f"init of this model makes no {col!r}: check `when:` and `mutable`"
            ),
            loc,
        )


def put(run: Run, key: tuple) -> None:
    # mirrors flax/core/scope.py Scope.put_variable / has_variable: a collection is one nested dict,
    # so a child's variables make its name a variable of that collection in every ancestor scope
    # (in apply, self.param('enc') finds the subtree a child named 'enc' made in init: no key)
    path, col, _name = key
    run.store[key] = True
    for i in range(len(path)):
        run.store.setdefault((path[:i], col, path[i]), False)


def exists(inst: Instance, col: str, name: str, loc: Location, run: Run) -> bool:
    # mirrors flax/core/scope.py Scope.has_variable: a scope's collection is its entry in the parent's;
    # where that entry is a variable (an array), `name in array` raises TypeError
    if not visible(inst.scope, col):
        return False
    path = inst.path
    for i in range(len(path)):
        if run.store.get((path[:i], col, path[i])):
            raise FlaxError(
                "TypeError",
                "Array.__contains__: unsupported operand type <class 'str'>. "
                f'"/{"/".join(path[: i + 1])}" is a {col!r} variable that init made, so the module of '
                f"that name cannot read {col!r}: rename the module or the variable",
                loc,
            )
    return (path, col, name) in run.store


def is_mutable(run: Run, scope: Scope, col: str) -> bool:
    if scope.immutable or not visible(scope, col):
        return False
    if col in scope.frozen or EVERY in scope.frozen:
        return False
    return run.mutable is True or (isinstance(run.mutable, tuple) and col in run.mutable)


def param(r: Replayer, inst: Instance, item: Param, run: Run) -> None:
    # mirrors flax/linen/module.py Module.param and flax/core/scope.py Scope.param
    inst.reserve(item.name, "params", "param", item.loc)
    key = (inst.path, "params", item.name)
    if exists(inst, "params", item.name, item.loc, run):
        return
    if not is_mutable(run, inst.scope, "params"):
        require_collection(inst, "params", item.name, item.loc, run)
        raise FlaxError(
            "ScopeParamNotFoundError",
            f'Could not find parameter named "{item.name}" in scope "{inst.scope.path_text}". '
            "In apply, params come from init of the same model: check `when:` on this param",
            item.loc,
        )
    check_create(inst.scope, "params", item.name, item.loc, run)
    t = r.make_rng(inst.scope, "params", "param", item.name, item.draw, item.loc, run, "params")
    if item.uses_key:
        check_broadcast(r, inst.scope, t, "params", item.name, item.loc, run)
    put(run, key)


def variable(r: Replayer, inst: Instance, item: Variable, run: Run) -> None:
    key = (inst.path, item.collection, item.name)
    if item.eager:
        # self.variable(col, name, f, self.make_rng(s)): the argument is evaluated on every call;
        # its key is kept (in a thrown-away trace) only when it initialises the variable
        creates = (
            visible(inst.scope, item.collection)
            and key not in run.store
            and is_mutable(run, inst.scope, item.collection)
        )
        made = [
            r.make_rng(
                inst.scope, s, "variable", item.name, item.draw, item.loc, run, item.collection if creates else None
            )
            for s in item.streams
        ]
    else:
        made = []
    inst.reserve(item.name, item.collection, "variable", item.loc)
    if exists(inst, item.collection, item.name, item.loc, run):
        return
    if not is_mutable(run, inst.scope, item.collection):
        require_collection(inst, item.collection, item.name, item.loc, run)
        raise FlaxError(
            "ScopeVariableNotFoundError",
            f'No Variable named "{item.name}" for collection "{item.collection}" exists in '
            f'"{inst.scope.path_text}". Pass the collection to apply, or list it in `mutable`',
            item.loc,
        )
    check_create(inst.scope, item.collection, item.name, item.loc, run)
    if not item.eager:
        made = [
            r.make_rng(inst.scope, s, "variable", item.name, item.draw, item.loc, run, item.collection)
            for s in item.streams
        ]
    if item.draw is not None:
        # (as for a param: only a value drawn from the key depends on it; without a draw the
        # initializer is taken to ignore its keys, and JAX sees no dependency)
        for t in made:
            check_broadcast(r, inst.scope, t, item.collection, item.name, item.loc, run)
    put(run, key)


def check_create(scope: Scope, col: str, name: str, loc: Location, run: Run) -> None:
    carried = col in scope.carry or EVERY in scope.carry or any(isinstance(c, AllBut) and col in c for c in scope.carry)
    if carried and run.carry_error is None:
        # mirrors jax.lax.scan: the carry must keep its structure from step to step; jax checks
        # that once the body is traced, so errors of the rest of the body come first
        run.carry_error = FlaxError(
            "TypeError",
            "scan body function carry input and carry output must have the same pytree structure, "
            f"but they differ: the nn.scan body creates {name!r} in the carried collection {col!r}; "
            "create the variable before the scan",
            loc,
        )


def raise_carry(run: Run, axis: int | None = None, carry: bool = True) -> None:
    """After a vmap or scan body's trace: the broadcast error of its lanes, then (a scan's) the
    carry structure error, that the trace recorded."""
    if axis is not None and axis in run.lane_errors:
        raise run.lane_errors[axis]
    if carry and run.carry_error is not None:
        raise run.carry_error


def check_broadcast(
    r: Replayer, scope: Scope, t: int | Discovered | None, col: str, name: str, loc: Location, run: Run
) -> None:
    """A variable shared by every lane or step cannot be initialised from a per-lane key. JAX
    finds that when the lift's trace ends (vmap's outputs, scan's constancy check), so the error
    is raised then (_raise_lane), after the errors the rest of the trace raises."""
    if t is None:
        return
    depends = lane_axes(r.templates, t.ref if isinstance(t, Discovered) else r.templates[t].ref)
    for axis, kind, bset, drops in reversed(scope.lanes):
        if axis in depends and (bset is None or col in bset):
            what = (
                "vmap has mapped output but out_axes is None"
                if kind == "vmap"
                else "broadcasted variable has a data dependency on the scan body"
            )
            run.lane_errors.setdefault(
                axis,
                FlaxError(
                    "ValueError",
                    f"{what}: {name!r} in {col!r} is shared by every {'lane' if kind == 'vmap' else 'step'} "
                    f"but initialised from a split key; split_rngs false for its stream, or map {col!r} "
                    "over the axis",
                    loc,
                ),
            )
            # (no return: each lift whose axis the key depends on finds it when its own trace ends,
            # the innermost first)
        if drops is None or col in drops:
            break  # the variable never leaves this lift: the lifts around it do not see it


def lane_axes(templates: list[Template], ref) -> set:
    out: set = set()
    while ref is not None and type(ref) is not RootKey:
        if type(ref) is ForkOf:
            ref = templates[ref.template].ref
            continue
        if type(ref) is not StaticFold:
            out.add(ref.axis)
        ref = ref.parent
    return out
