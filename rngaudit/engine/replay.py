"""Replays Flax Linen's naming and per-scope, per-stream counters: a spec -> the derivation of every key. No JAX."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import NamedTuple

from ..errors import FlaxError, Location, SpecError
from ..gcpause import paused
from .hashing import hash_input, hash_word
from ..spec.tree import (Call, Child, Cond, Define, Draw, Item, Lift, MakeRng, ModuleDef, Param, Sequential,
                    Spec, Transform, Variable, WhileLoop)

MAX_DERIVATIONS = 50_000_000


# ------------------------------------------------------------------ key references
# A key reference says which key a make_rng folds its hash word into. The engine builds
# templates (a split or fold whose index is a lane axis still to be chosen); every reported
# Derivation carries a concrete one, so equal references mean equal base keys.


@dataclass(frozen=True)
class RootKey:
    """The key the user passed to init/apply for a stream."""

    stream: str

    def __str__(self) -> str:
        return f"rngs[{self.stream!r}]"


@dataclass(frozen=True)
class SplitKey:
    """Row `index` of jax.random.split(parent, n): a vmap lane or scan step (R11, R12)."""

    parent: object
    n: int
    index: int

    def __str__(self) -> str:
        return f"split({self.parent}, {self.n})[{self.index}]"


@dataclass(frozen=True)
class FoldKey:
    """jax.random.fold_in(parent, data): a while_loop iteration (R15)."""

    parent: object
    data: int

    def __str__(self) -> str:
        return f"fold_in({self.parent}, {self.data})"


@dataclass(frozen=True)
class ForkKey:
    """The key that call #index received: nn.jit / nn.fold_rngs fork every stream with one (R13)."""

    index: int

    def __str__(self) -> str:
        return f"key of #{self.index}"


@dataclass(frozen=True)
class _Discovered:
    """What a make_rng of apply's pre-init run returns instead of a template: its key reference."""

    ref: object


@dataclass(frozen=True)
class _LaneSplit:
    """A base key split into one key per lane along `axis` (resolved per lane)."""

    parent: object
    n: int
    axis: int


@dataclass(frozen=True)
class _LaneFold:
    """A base key folded with the lane index along `axis` (resolved per lane)."""

    parent: object
    axis: int
    negate: bool


@dataclass(frozen=True)
class _Fork:
    """A jit fork's key: the key of the call `template` (resolved per lane)."""

    template: int


@dataclass(frozen=True)
class Derivation:
    """One key Flax hands out: key = fold_in(base, hash_word(hash_input(suffix + (count,))))."""

    index: int
    path: tuple[str, ...]
    stream_requested: str
    stream: str
    count: int
    kind: str  # make_rng | param | variable | dropout | attention_dropout | jit_fork | fold_rngs_fork
    label: str | None
    hash_items: tuple
    hash_input: bytes
    hash_word: int
    base: object  # RootKey | SplitKey | FoldKey | ForkKey, or None: a traced key Flax discards
    location: Location
    draw: Draw | None = None
    notes: tuple[str, ...] = ()
    lane: tuple[int, ...] = ()  # vmap lane / scan step / while iteration indices, outermost first
    discarded: bool = False  # made in a trace whose keys Flax throws away (scan's constancy check)

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"

    @property
    def fallback(self) -> bool:
        return self.stream != self.stream_requested


class Template(NamedTuple):
    """What the replay records for a make_rng statement at one place: `n` consecutive calls, counts
    `count` .. `count + n - 1` (n is 1 on the plain path, which records every call), made in every lane
    of the vmap/scan/while axes `axes`. Each call's key is fold_in(base, hash_word(suffix + (count,))),
    its base `ref` resolved per lane."""

    path: tuple[str, ...]
    stream_requested: str
    stream: str
    count: int
    kind: str
    label: str | None
    suffix: tuple  # what Flax hashes before the count: the path since the base key
    ref: object  # RootKey, or a lane template (_LaneSplit, _LaneFold, _Fork) resolved per lane
    location: Location
    draw: Draw | None
    notes: tuple[str, ...]
    axes: tuple[int, ...]  # lane axes (indices into Replayer.axis_size), outermost first
    discarded: bool  # made in a trace whose keys Flax throws away
    n: int = 1


@dataclass
class _Scope:
    """What Flax's Scope holds for key purposes: a path, the visible streams as lazy keys
    (base reference, path suffix since the base), the active lane axes, the collections a lift
    lets through, and whether keys made here are thrown away."""

    path: tuple[str, ...]
    rngs: dict  # stream -> (key reference template, suffix)
    axes: tuple[int, ...] = ()
    cols: "frozenset | _AllBut | None" = None  # lifted collections; None: all
    immutable: bool = False
    discard: object = None  # None | True (keep variable inits) | frozenset (keep inits in these)
    context: tuple[str, ...] = ()  # notes for every key made here
    frozen: frozenset = frozenset()  # collections a lift makes read-only here
    debug: tuple[str, ...] = ()  # Flax's debug_path: the path with transform names, for messages
    root: tuple[str, ...] = ()  # path of the scope that is root here (a lift's scope has no parent)
    lanes: tuple = ()  # (axis, transform, collections broadcast over its lanes or None for all)
    carry: frozenset = frozenset()  # scan carry collections: the body cannot create them
    abstract: bool = False  # Flax's TestScope root: make_rng hands out a dummy key, counts nothing

    def push(self, name: str) -> "_Scope":
        # mirrors flax/core/scope.py Scope.push: LazyRng.create(rng, name) appends to the suffix
        return _Scope(self.path + (name,), {s: (r, suf + (name,)) for s, (r, suf) in self.rngs.items()},
                      self.axes, self.cols, self.immutable, self.discard, self.context, self.frozen,
                      self.debug + (name,), self.root, self.lanes, self.carry)

    def lifted(self, pack: str | None = None, **kw) -> "_Scope":
        new = _Scope(self.path, self.rngs, self.axes, self.cols, self.immutable, self.discard, self.context,
                     self.frozen, self.debug, self.root, self.lanes, self.carry)
        if pack is not None:
            new.root = self.path
            # mirrors flax/core/lift.py _partial_pack: the packed scope's debug path names the transform
            new.debug = self.debug[:-1] + (f"{pack}({self.debug[-1]})",) if self.debug else (f"{pack}()",)
        for k, v in kw.items():
            setattr(new, k, v)
        return new

    @property
    def path_text(self) -> str:
        return "/" + "/".join(self.debug)


class _Instance:
    """A bound module instance: its scope plus the state Flax keeps on the Module object."""

    __slots__ = ("mod", "scope", "setup_done", "setup_children", "reserved", "seq_layers", "clone")

    def __init__(self, mod: ModuleDef | None, scope: _Scope, clone: bool = False):
        self.mod = mod
        self.scope = scope
        self.clone = clone  # a clone made by a lifted transform: an instance of the untransformed class
        self.setup_done = False
        self.setup_children: dict[str, _Instance] = {}
        self.reserved: dict[str, set] = {}
        self.seq_layers: list[_Instance] | None = None

    @property
    def path(self) -> tuple[str, ...]:
        return self.scope.path

    @property
    def cls(self) -> str:
        if self.mod is None:
            return "Sequential"
        return (self.mod.impl_cls or self.mod.cls) if self.clone else self.mod.cls

    @property
    def scope_name(self) -> str:
        return self.path[-1] if self.path else "None"


@dataclass
class _Run:
    """What one replay shares: the phase, the mutable collections, the streams and the variables made."""

    phase: str
    mutable: tuple[str, ...] | bool
    streams: tuple[str, ...]
    discover: bool
    store: dict = field(default_factory=dict)  # (path, collection, name) -> is a variable (not a subtree)
    counters: dict = field(default_factory=dict)
    carry_error: FlaxError | None = None  # raised when the scan body's trace ends
    lane_errors: dict = field(default_factory=dict)  # lane axis -> broadcast error, raised when its trace ends


_EVERY = "*every collection*"  # in _Scope.frozen: map_variables over every collection
_SCAN_CHECK = ("made in nn.scan's first trace (the constancy check, check_constancy_invariants=True): "
               "Flax throws this key away, but its count is used up")
_MAP_RUN1 = ("made in nn.map_variables' first run (init=True with a mutable collection): Flax throws this "
             "key away, but its count is used up")
_KEPT = ("made in a first trace that Flax otherwise throws away, but kept: it initialises a variable "
         "(a broadcast one, for nn.scan)")


def _matches(flt, name: str) -> bool:
    if flt is True or flt is False:
        return flt
    if isinstance(flt, str):
        return flt == name
    return name in flt


def _select(names, filters, jax_pytree: bool = True) -> list[tuple[str, object]]:
    """(name, value) for each name some filter takes, filter by filter. Within a filter's group the
    names keep their order, or are sorted when the group passes through a JAX transform as a dict
    (jax flattens dicts in sorted key order), which is what the inner scope then sees."""
    # mirrors flax/core/scope.py group_collections
    taken: set = set()
    out = []
    for flt, value in filters:
        group = [n for n in names if n not in taken and _matches(flt, n)]
        taken.update(group)
        out.extend((n, value) for n in (sorted(group) if jax_pytree else group))
    return out


class _AllBut:
    """Every collection but `names` (vmap's `variable_axes` with a catch-all `True: None`)."""

    def __init__(self, names):
        self.names = frozenset(names)

    def __contains__(self, col) -> bool:
        return col not in self.names


def _vmap_broadcast(variable_axes):
    """The collections a vmap broadcasts (axis None): first matching filter wins, as in Flax's
    group_collections."""
    mapped: set = set()
    out: set = set()
    for c, ax in variable_axes:
        if c is True:
            return _AllBut(mapped) if ax is None else frozenset(out)
        names = (c,) if isinstance(c, str) else tuple(c)
        for n in names:
            if n not in mapped and n not in out:
                (out if ax is None else mapped).add(n)
    return frozenset(out)


class _AllBut:
    """The collections a scope sees when that is every collection but some (`in`, and `&` with a
    frozenset or another _AllBut, as _Scope.cols is used)."""

    def __init__(self, out: frozenset):
        self.out = frozenset(out)

    def __contains__(self, col) -> bool:
        return col not in self.out

    def __and__(self, other):
        if isinstance(other, _AllBut):
            return _AllBut(self.out | other.out)
        return frozenset(c for c in other if c not in self.out)

    __rand__ = __and__

    def __eq__(self, other) -> bool:
        return isinstance(other, _AllBut) and other.out == self.out

    def __hash__(self) -> int:
        return hash((_AllBut, self.out))


def _filter_set(flt) -> frozenset | None:
    if flt is True:
        return None
    if flt is False:
        return frozenset()
    return frozenset((flt,) if isinstance(flt, str) else flt)


def _union_cols(*filters) -> frozenset | None:
    out: set = set()
    for f in filters:
        fs = _filter_set(f)
        if fs is None:
            return None
        out |= fs
    return frozenset(out)


def _combine_discard(outer, inner):
    if outer is None:
        return inner
    if inner is None:
        return outer
    if outer is True:
        return inner
    if inner is True:
        return outer
    return outer & inner


class Replayer:
    """Walks a spec's model the way Flax executes it and records every key request."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.sep = spec.fix_rng_separator
        self.templates: list[Template] = []
        self.axis_size: list[int] = []

    # -------------------------------------------------------------- entry
    def run(self) -> list[Derivation]:
        store: dict = {}
        if self.spec.phase == "apply":
            # The variables apply() receives are those init() of the same model created.
            # That init is taken to have passed apply's streams and `params` (else it could not
            # make them): a key it cannot make fails it, and apply with it.
            streams = tuple(self.spec.rngs) + (() if "params" in self.spec.rngs else ("params",))
            pre = _Run("init", True, streams, discover=True)
            self._call(self._root(streams), pre)
            store = pre.store
        run = _Run(self.spec.phase, self.spec.mutable, tuple(self.spec.rngs), False, store)
        self._call(self._root(), run)
        return self._expand()

    def _root(self, streams=None) -> _Instance:
        streams = self.spec.rngs if streams is None else streams
        return _Instance(self.spec.model, _Scope((), {s: (RootKey(s), ()) for s in streams}))

    def _new_axis(self, size: int) -> int:
        self.axis_size.append(size)
        return len(self.axis_size) - 1

    # -------------------------------------------------------------- modules
    def _call(self, inst: _Instance, run: _Run) -> None:
        if inst.seq_layers is not None:
            for layer in inst.seq_layers:
                self._call(layer, run)
            return
        self._lifted(inst, inst.mod.lifts, run)
        # mirrors module.py _call_wrapped_method: a compact call ends with scope.rewound()
        inst.reserved.clear()

    def _setup(self, inst: _Instance, run: _Run) -> None:
        if not inst.setup_done:
            # mirrors flax/linen/module.py _try_setup: setup runs once, before the first method call
            inst.setup_done = True
            self._items(inst, inst.mod.setup, inst.setup_children, {}, run)

    def _validate_setup(self, inst: _Instance) -> None:
        """Before a lifted transform, Flax evaluates setup() abstractly on a fresh clone bound to a
        TestScope: no variables, every collection mutable, no rngs, and a make_rng that hands out a
        dummy key at that root only; its children's scopes are plain ones without rngs. Its errors
        (a child called in setup that needs a key, a name clash) are raised; nothing else is kept."""
        # mirrors flax/linen/module.py Module._try_setup(shallow=True) -> _validate_setup
        # (transforms.py get_module_scopes); a fresh Replayer keeps this run's templates untouched
        probe = Replayer(self.spec)
        clone = _Instance(inst.mod, _Scope((), {}, abstract=True), clone=inst.clone)
        probe._setup(clone, _Run("init", True, tuple(self.spec.rngs), False))

    def _lifted(self, inst: _Instance, lifts: tuple[Lift, ...], run: _Run) -> None:
        """Run the instance's __call__ through its lifted transforms, outermost first. Each trace
        runs on a clone bound to the lifted scope (linen/transforms.py core_fn clones the module
        and sets its scopes), and the clone runs setup() again. Outside the transform, the others
        take a shallow setup (get_module_scopes: _try_setup(shallow=True)) that runs no user code;
        nn.jit and nn.fold_rngs run the module's setup() after their fork (see _traces)."""
        if lifts and not inst.setup_done and inst.mod.setup:
            self._validate_setup(inst)
        if not lifts:
            self._setup(inst, run)
            self._items(inst, inst.mod.body, {}, {}, run)
            return
        for inner in self._traces(lifts[0], inst, run):
            self._lifted(_Instance(inst.mod, inner, clone=True), lifts[1:], run)

    def _traces(self, lift: Lift, inst: _Instance, run: _Run):
        """Yield the lifted scope once per trace Flax makes of the wrapped function (R10-R17)."""
        scope = inst.scope
        kind = lift.kind
        if kind in ("vmap", "scan"):
            n = lift.opt("axis_size") if kind == "vmap" else lift.opt("length")
            axis = self._new_axis(n)
            rngs = {}
            # mirrors flax/core/lift.py vmap/scan: split_rngs keys filter the streams; split acts on
            # the raw base key (tree_map_rngs over LazyRng.rng) and keeps the suffix
            for s, split in _select(scope.rngs, lift.opt("split_rngs", ())):
                ref, suffix = scope.rngs[s]
                rngs[s] = (_LaneSplit(ref, n, axis) if split else ref, suffix)
            axes_cols = tuple(c for c, _ in lift.opt("variable_axes", ()))
            broadcast = lift.opt("variable_broadcast", False)
            cols = _union_cols(*axes_cols, broadcast, lift.opt("variable_carry", False))
            if cols is not None and scope.cols is not None:
                cols &= scope.cols
            elif cols is None:
                cols = scope.cols
            bset = _filter_set(broadcast)  # None: every collection is broadcast
            if kind == "vmap":
                bset = _vmap_broadcast(lift.opt("variable_axes", ()))
            lanes = scope.lanes + ((axis, kind, bset),)
            carry = scope.carry | (_filter_set(lift.opt("variable_carry", False)) or frozenset({_EVERY}))
            if lift.opt("variable_carry", False) is False:
                carry = scope.carry
            if kind == "scan" and lift.opt("check_constancy_invariants", True):
                # mirrors flax/core/axes_scan.py scan_fn: trace 1 (pe.trace_to_jaxpr) only checks that
                # broadcast values are loop invariant; its keys are thrown away, except initialisers
                # of broadcast variables, whose values are kept. Scanned variables made there are
                # dropped and made again in trace 2.
                before = set(run.store)
                keep = True if bset is None else bset
                yield scope.lifted(kind, rngs=rngs, cols=cols, discard=_combine_discard(scope.discard, keep),
                                   context=scope.context + (_SCAN_CHECK,), lanes=lanes, carry=carry)
                self._raise_carry(run, axis)
                if bset is not None:
                    for key in set(run.store) - before:
                        if key[1] not in bset:
                            del run.store[key]
                yield scope.lifted(kind, rngs=rngs, axes=scope.axes + (axis,), cols=cols, lanes=lanes, carry=carry)
                self._raise_carry(run, axis)
            elif kind == "scan":
                # mirrors flax/core/axes_scan.py simple_scan_fn: without the constancy check the
                # broadcast outputs are dropped, so broadcast variables the body made do not persist
                before = set(run.store)
                # and the broadcast variables are never checked against the body: no dependency error
                lanes = scope.lanes + ((axis, kind, frozenset()),)
                yield scope.lifted(kind, rngs=rngs, axes=scope.axes + (axis,), cols=cols, lanes=lanes, carry=carry)
                self._raise_carry(run, axis)
                for key in set(run.store) - before:
                    if bset is None or key[1] in bset:
                        del run.store[key]
            else:
                yield scope.lifted(kind, rngs=rngs, axes=scope.axes + (axis,), cols=cols, lanes=lanes)
                self._raise_carry(run, axis, carry=False)
        elif kind in ("jit", "fold_rngs"):
            # mirrors flax/linen/transforms.py fork_rngs: one make_rng per visible stream, at the
            # module's own scope, on every call; inside, keys derive from the fork with no suffix,
            # and the streams come in sorted order (the forks pass through JAX as a dict)
            forked = {}
            for s in list(scope.rngs):
                t = self._make_rng(scope, s, f"{kind}_fork", f"fork of {s!r}", None, lift.loc, run,
                                   note=f"nn.{kind} forks every visible stream here on every call: this uses "
                                        "up a count, and keys inside derive from this key")
                # (apply's pre-init run records no template: the fork's own reference carries the
                # lanes it depends on, for broadcast checks inside)
                forked[s] = (_Fork(t) if isinstance(t, int) else t.ref if isinstance(t, _Discovered) else None, ())
            rngs = {s: forked[s] for s, _ in _select(forked, ((lift.opt("rngs", True), None),),
                                                     jax_pytree=True)}
            where = "/".join(scope.path) or "(root)"
            if not inst.setup_done:
                # The first call runs the module's setup() outside the trace but inside fork_rngs,
                # which has replaced the scope's rngs with the forks (every stream, no suffix).
                inst.scope = scope.lifted(rngs=forked, context=scope.context + (
                    f"setup() of a module under nn.{kind}: runs once, after the fork, and derives from it",))
                self._setup(inst, run)
                inst.scope = scope
            yield scope.lifted(kind, rngs=rngs, context=scope.context + (
                f"inside nn.{kind} at {where}: derived from the fork key made there on this call, not from "
                "rngs, so it differs from the un-transformed module's key",))
        elif kind in ("remat", "map_variables"):
            rngs = {s: scope.rngs[s] for s, _ in _select(scope.rngs, ((lift.opt("rngs", True), None),),
                                                           jax_pytree=kind == "remat")}
            inner = scope.lifted(kind, rngs=rngs)
            if kind == "map_variables" and not (lift.opt("init") or lift.opt("mutable")):
                # mirrors flax/core/lift.py map_variables: mapped collections are read-only unless
                # init=True or mutable=True
                mapped = _filter_set(lift.opt("mapped_collections", True))
                inner.frozen = scope.frozen | (mapped if mapped is not None else {_EVERY})
            if kind == "map_variables" and lift.opt("init", False) and self._any_mutable(run, scope):
                # mirrors flax/linen/transforms.py map_variables: with init=True and a mutable
                # collection the body runs once to create the variables, then again.
                # In apply with a `mutable` list, that first run sees the mapped collections only where
                # they are mutable, and every other collection whole (measured against Flax)
                mapped = _filter_set(lift.opt("mapped_collections", True))
                cols = inner.cols
                if isinstance(run.mutable, tuple):
                    mutable = frozenset(run.mutable)
                    seen = mutable if mapped is None else _AllBut(mapped - mutable)
                    cols = seen if cols is None else cols & seen
                # Only the mapped collections of that run are kept (`target, _ = repack(scopes)`):
                # variables it made in the others (their initialisers did run) are made again, with
                # new counts, in the second run.
                before = set(run.store)
                yield inner.lifted(discard=_combine_discard(scope.discard, True),
                                   context=scope.context + (_MAP_RUN1,), cols=cols)
                if mapped is not None:
                    for key in set(run.store) - before:
                        if key[1] not in mapped:
                            del run.store[key]
            yield inner
        else:
            raise AssertionError(kind)

    @staticmethod
    def _any_mutable(run: _Run, scope: _Scope) -> bool:
        return not scope.immutable and (run.mutable is True or bool(run.mutable))

    def _reserve(self, inst: _Instance, name: str, col: str | None, what: str, loc: Location) -> None:
        # mirrors flax/core/scope.py Scope.name_reserved / reserve
        cols = inst.reserved.get(name)
        if cols is not None and (None in cols or col is None or col in cols):
            raise FlaxError(
                "NameInUseError",
                f'Could not create {what} "{name}" in Module {inst.cls}: Name in use. '
                "Give it another name",
                loc,
            )
        inst.reserved.setdefault(name, set()).add(col)

    def _new_child(self, inst: _Instance, mod: ModuleDef, cursor: dict, loc: Location) -> _Instance:
        # mirrors flax/linen/module.py Module.__post_init__ auto-naming
        if mod.name is None:
            n = cursor.get(mod.cls, 0)
            name = f"{mod.cls}_{n}"
            cursor[mod.cls] = n + 1
        else:
            name = mod.name
        self._reserve(inst, name, None, "submodule", loc)
        return _Instance(mod, inst.scope.push(name))

    # -------------------------------------------------------------- statements
    def _items(self, inst: _Instance, items: tuple[Item, ...], local: dict, cursor: dict, run: _Run) -> None:
        for item in items:
            if item.when is not None and item.when != run.phase:
                continue
            if isinstance(item, MakeRng):
                self._make_rng_item(inst, item, run)
            elif isinstance(item, Param):
                self._param(inst, item, run)
            elif isinstance(item, Variable):
                self._variable(inst, item, run)
            elif isinstance(item, (Child, Transform)):
                mod = item.module if isinstance(item, Child) else item.target
                for _ in range(item.repeat):
                    child = self._new_child(inst, mod, cursor, item.loc)
                    local[child.path[-1]] = child
                    self._call(child, run)
            elif isinstance(item, Define):
                child = self._new_child(inst, item.module, cursor, item.loc)
                local[child.path[-1]] = child
            elif isinstance(item, Call):
                target = local.get(item.name) or inst.setup_children.get(item.name)
                if target is None:
                    known = sorted(set(local) | set(inst.setup_children))
                    raise SpecError(
                        f"`call: {item.name}`: module {inst.cls} has no child {item.name!r} at this point"
                        + (f"; children so far: {', '.join(known)}" if known else
                           "; create it first (a module/layer statement or a setup attribute)"),
                        item.loc,
                    )
                for _ in range(item.repeat):
                    self._call(target, run)
            elif isinstance(item, Sequential):
                self._sequential(inst, item, local, cursor, run)
            elif isinstance(item, Cond):
                self._cond(inst, item, cursor, run)
            elif isinstance(item, WhileLoop):
                self._while(inst, item, cursor, run)

    def _branch(self, inst: _Instance, scope: _Scope, items, cursor: dict, run: _Run) -> dict:
        """Trace `items` as a function of the module (nn.cond/switch/while_loop): on a clone bound
        to the lifted scope, starting from the module's current auto-name cursor."""
        # mirrors flax/linen/transforms.py decorator_lift_transform core_fn: state.export() per target
        clone = _Instance(inst.mod, scope, clone=inst.clone)
        self._setup(clone, run)
        branch_cursor = dict(cursor)
        self._items(clone, items, {}, branch_cursor, run)
        return branch_cursor

    def _cond(self, inst: _Instance, item: Cond, cursor: dict, run: _Run) -> None:
        # mirrors flax/core/lift.py cond/switch: jax.lax.cond/switch trace every branch, in order
        scope = inst.scope
        # (the branches get the streams in the scope's order: measured against Flax, unlike while_loop)
        rngs = {s: scope.rngs[s] for s, _ in _select(scope.rngs, ((item.rngs, None),), jax_pytree=False)}
        last = cursor
        n = len(item.branches)
        before = dict(run.store)
        made = None
        for k, branch in enumerate(item.branches):
            which = ("true", "false")[k] if item.kind == "cond" else str(k)
            inner = scope.lifted(item.kind, rngs=rngs, context=scope.context + (
                f"nn.{item.kind} branch {which}: every branch is traced, in order, so its counts are "
                f"taken even when branch {which} does not run ({n} branches share counters)",))
            # every branch starts from the same variables (scope_fn(variable_groups, ...))
            run.store = dict(before)
            last = self._branch(inst, inner, branch, cursor, run)
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

    def _while(self, inst: _Instance, item: WhileLoop, cursor: dict, run: _Run) -> None:
        # mirrors flax/core/lift.py while_loop: cond traced before body; a split stream is folded with
        # the iteration index, negated for cond (make_loop_rngs(-i)); cond sees immutable variables
        scope = inst.scope
        selected = _select(scope.rngs, item.split_rngs)
        last = cursor
        for items, negate, size, what in ((item.cond_items, True, item.iterations + 1, "cond"),
                                          (item.body_items, False, item.iterations, "body")):
            axis = self._new_axis(size)
            rngs = {}
            for s, split in sorted(selected):
                # the loop's rngs pass through jax.lax.while_loop as a dict: in sorted order inside
                ref, suffix = scope.rngs[s]
                rngs[s] = (_LaneFold(ref, axis, negate) if split else ref, suffix)
            # linen's nn.while_loop lifts every collection read-only (broadcast_variables=True)
            inner = scope.lifted("while_loop", rngs=rngs, axes=scope.axes + (axis,), immutable=True,
                                 context=scope.context + (f"nn.while_loop {what}",))
            last = self._branch(inst, inner, items, cursor, run)
        cursor.clear()
        cursor.update(last)

    def _sequential(self, inst: _Instance, item: Sequential, local: dict, cursor: dict, run: _Run) -> None:
        if item.in_setup:
            # Built in setup(): the layers are adopted under the Sequential's `layers` field.
            seq = self._new_child(inst, ModuleDef("Sequential", item.name, (), (), item.loc), cursor, item.loc)
            seq.seq_layers = []
            for i, layer in enumerate(item.layers):
                if layer.name is not None:
                    raise SpecError(
                        "layers of a Sequential built in setup() are named layers_0, layers_1, ...; "
                        "drop `name:` from this layer",
                        layer.loc,
                    )
                seq.seq_layers.append(_Instance(layer, seq.scope.push(f"layers_{i}")))
            local[seq.path[-1]] = seq
            return
        # Built in @compact: the layers are created (and auto-named) in the enclosing module first.
        layers = []
        for layer in item.layers:
            child = self._new_child(inst, layer, cursor, layer.loc)
            local[child.path[-1]] = child
            layers.append(child)
        seq = self._new_child(inst, ModuleDef("Sequential", item.name, (), (), item.loc), cursor, item.loc)
        seq.seq_layers = layers
        local[seq.path[-1]] = seq
        self._call(seq, run)

    # -------------------------------------------------------------- variables
    @staticmethod
    def _visible(scope: _Scope, col: str) -> bool:
        return scope.cols is None or col in scope.cols

    def _require_collection(self, inst: _Instance, col: str, name: str, loc: Location, run: _Run) -> None:
        # mirrors flax/core/scope.py Scope.param / Scope.variable: a missing variable of an immutable
        # collection that holds no variable at all under the root (is_collection_empty) is
        # ScopeCollectionNotFound; inside a lift the root is the lifted scope
        root = inst.scope.root
        n = len(root)
        if not self._visible(inst.scope, col) or not any(
                c == col and p[:n] == root for p, c, _ in run.store):
            raise FlaxError(
                "ScopeCollectionNotFound",
                f'Tried to access "{name}" from collection "{col}" in "{inst.scope.path_text}" but the '
                f"collection is empty. " + (
                    f"The enclosing transform does not lift {col!r}: add it to variable_axes or "
                    "variable_broadcast" if not self._visible(inst.scope, col) else
                    f"init of this model makes no {col!r}: check `when:` and `mutable`"),
                loc,
            )

    @staticmethod
    def _put(run: _Run, key: tuple) -> None:
        # mirrors flax/core/scope.py Scope.put_variable / has_variable: a collection is one nested dict,
        # so a child's variables make its name a variable of that collection in every ancestor scope
        # (in apply, self.param('enc') finds the subtree a child named 'enc' made in init: no key)
        path, col, name = key
        run.store[key] = True
        for i in range(len(path)):
            run.store.setdefault((path[:i], col, path[i]), False)

    def _exists(self, inst: _Instance, col: str, name: str, loc: Location, run: _Run) -> bool:
        # mirrors flax/core/scope.py Scope.has_variable: a scope's collection is its entry in the parent's;
        # where that entry is a variable (an array), `name in array` raises TypeError
        if not self._visible(inst.scope, col):
            return False
        path = inst.path
        for i in range(len(path)):
            if run.store.get((path[:i], col, path[i])):
                raise FlaxError(
                    "TypeError",
                    "Array.__contains__: unsupported operand type <class 'str'>. "
                    f'"/{"/".join(path[:i + 1])}" is a {col!r} variable that init made, so the module of '
                    f"that name cannot read {col!r}: rename the module or the variable",
                    loc,
                )
        return (path, col, name) in run.store

    def _mutable(self, run: _Run, scope: _Scope, col: str) -> bool:
        if scope.immutable or not self._visible(scope, col):
            return False
        if col in scope.frozen or _EVERY in scope.frozen:
            return False
        return run.mutable is True or (isinstance(run.mutable, tuple) and col in run.mutable)

    def _param(self, inst: _Instance, item: Param, run: _Run) -> None:
        # mirrors flax/linen/module.py Module.param and flax/core/scope.py Scope.param
        self._reserve(inst, item.name, "params", "param", item.loc)
        key = (inst.path, "params", item.name)
        if self._exists(inst, "params", item.name, item.loc, run):
            return
        if not self._mutable(run, inst.scope, "params"):
            self._require_collection(inst, "params", item.name, item.loc, run)
            raise FlaxError(
                "ScopeParamNotFoundError",
                f'Could not find parameter named "{item.name}" in scope "{inst.scope.path_text}". '
                "In apply, params come from init of the same model: check `when:` on this param",
                item.loc,
            )
        self._check_create(inst.scope, "params", item.name, item.loc, run)
        t = self._make_rng(inst.scope, "params", "param", item.name, item.draw, item.loc, run, "params")
        if item.uses_key:
            self._check_broadcast(inst.scope, t, "params", item.name, item.loc, run)
        self._put(run, key)

    def _variable(self, inst: _Instance, item: Variable, run: _Run) -> None:
        key = (inst.path, item.collection, item.name)
        if item.eager:
            # self.variable(col, name, f, self.make_rng(s)): the argument is evaluated on every call;
            # its key is kept (in a thrown-away trace) only when it initialises the variable
            creates = (self._visible(inst.scope, item.collection) and key not in run.store
                       and self._mutable(run, inst.scope, item.collection))
            made = [self._make_rng(inst.scope, s, "variable", item.name, item.draw, item.loc, run,
                                   item.collection if creates else None) for s in item.streams]
        else:
            made = []
        self._reserve(inst, item.name, item.collection, "variable", item.loc)
        if self._exists(inst, item.collection, item.name, item.loc, run):
            return
        if not self._mutable(run, inst.scope, item.collection):
            self._require_collection(inst, item.collection, item.name, item.loc, run)
            raise FlaxError(
                "ScopeVariableNotFoundError",
                f'No Variable named "{item.name}" for collection "{item.collection}" exists in '
                f'"{inst.scope.path_text}". Pass the collection to apply, or list it in `mutable`',
                item.loc,
            )
        self._check_create(inst.scope, item.collection, item.name, item.loc, run)
        if not item.eager:
            made = [self._make_rng(inst.scope, s, "variable", item.name, item.draw, item.loc, run,
                                   item.collection) for s in item.streams]
        if item.draw is not None:
            # (as for a param: only a value drawn from the key depends on it; without a draw the
            # initializer is taken to ignore its keys, and JAX sees no dependency)
            for t in made:
                self._check_broadcast(inst.scope, t, item.collection, item.name, item.loc, run)
        self._put(run, key)

    @staticmethod
    def _check_create(scope: _Scope, col: str, name: str, loc: Location, run: _Run) -> None:
        if (col in scope.carry or _EVERY in scope.carry) and run.carry_error is None:
            # mirrors jax.lax.scan: the carry must keep its structure from step to step; jax checks
            # that once the body is traced, so errors of the rest of the body come first
            run.carry_error = FlaxError(
                "TypeError",
                "scan body function carry input and carry output must have the same pytree structure, "
                f"but they differ: the nn.scan body creates {name!r} in the carried collection {col!r}; "
                "create the variable before the scan",
                loc,
            )

    @staticmethod
    def _raise_carry(run: _Run, axis: int | None = None, carry: bool = True) -> None:
        """After a vmap or scan body's trace: the broadcast error of its lanes, then (a scan's) the
        carry structure error, that the trace recorded."""
        if axis is not None and axis in run.lane_errors:
            raise run.lane_errors[axis]
        if carry and run.carry_error is not None:
            raise run.carry_error

    def _check_broadcast(self, scope: _Scope, t: int | None, col: str, name: str, loc: Location,
                         run: _Run) -> None:
        """A variable shared by every lane or step cannot be initialised from a per-lane key. JAX
        finds that when the lift's trace ends (vmap's outputs, scan's constancy check), so the error
        is raised then (_raise_lane), after the errors the rest of the trace raises."""
        if t is None:
            return
        depends = self._lane_axes(t.ref if isinstance(t, _Discovered) else self.templates[t].ref)
        for axis, kind, bset in scope.lanes:
            if axis in depends and (bset is None or col in bset):
                what = ("vmap has mapped output but out_axes is None" if kind == "vmap" else
                        "broadcasted variable has a data dependency on the scan body")
                run.lane_errors.setdefault(axis, FlaxError(
                    "ValueError",
                    f"{what}: {name!r} in {col!r} is shared by every {'lane' if kind == 'vmap' else 'step'} "
                    f"but initialised from a split key; split_rngs false for its stream, or map {col!r} "
                    "over the axis",
                    loc,
                ))
                # (no return: each lift whose axis the key depends on finds it when its own trace ends,
                # the innermost first)

    def _lane_axes(self, ref) -> set:
        out: set = set()
        while ref is not None and type(ref) is not RootKey:
            if type(ref) is _Fork:
                ref = self.templates[ref.template].ref
                continue
            out.add(ref.axis)
            ref = ref.parent
        return out

    # -------------------------------------------------------------- the key itself
    def _make_rng_item(self, inst: _Instance, item: MakeRng, run: _Run) -> None:
        """A `make_rng` statement: `repeat` calls, one template each (the plain path)."""
        for _ in range(item.repeat):
            self._make_rng(inst.scope, item.stream, item.kind, item.label, item.draw, item.loc, run)

    def _make_rng(self, scope: _Scope, stream: str, kind: str, label: str | None, draw: Draw | None,
                  loc: Location, run: _Run, collection: str | None = None, note: str | None = None,
                  n: int = 1) -> int | None:
        """Count `n` make_rng calls at `scope` (n > 1 only for a repeated statement: the calls are
        consecutive and alike but for their counts) and record their template; returns its number."""
        # mirrors flax/core/scope.py Scope.make_rng
        if scope.abstract:
            return None
        notes: tuple[str, ...] = ()
        used = stream
        if stream not in scope.rngs:
            if "params" in scope.rngs:
                used = "params"
                if stream in run.streams:
                    notes = (f"stream {stream!r} is hidden here by a transform's rng filter (split_rngs "
                             "keys or rngs=); Flax falls back to 'params' and advances the params counter",)
                else:
                    notes = (f"stream {stream!r} was not passed to {run.phase}; Flax falls back to "
                             "'params' and advances the params counter",)
            else:
                name = scope.path[-1] if scope.path else "None"
                hidden = stream in run.streams
                raise FlaxError(
                    "InvalidRngError",
                    f'{name} needs PRNG for "{stream}". ' + (
                        f"The stream is passed but hidden by a transform's rng filter: list {stream!r} in "
                        "its split_rngs (or rngs=)" if hidden else
                        f"Add `{stream}:` " + ("" if stream == "params" else "(or `params:`) ") + "to rngs"),
                    loc,
                )
        ckey = (scope.path, used)
        count = run.counters.get(ckey, 0) + 1
        run.counters[ckey] = count + n - 1
        if run.discover:
            # no template (apply's pre-init reports nothing), but the key's reference still decides
            # whether a broadcast variable is initialised from a per-lane key
            return _Discovered(scope.rngs[used][0]) if used in scope.rngs else None
        if len(self.templates) >= MAX_DERIVATIONS:
            raise SpecError(f"the model asks for more than {MAX_DERIVATIONS} keys; reduce `repeat`", loc)
        ref, suffix = scope.rngs[used]
        discarded = False
        context = scope.context
        if scope.discard is not None:
            keep = scope.discard
            discarded = not (collection is not None and (keep is True or collection in keep))
            if not discarded:
                context = tuple(_KEPT if c in (_SCAN_CHECK, _MAP_RUN1) else c for c in context)
        if note:
            notes += (note,)
        return self._record(scope.path, stream, used, count, kind, label, suffix, ref, loc, draw, notes + context,
                            scope.axes, discarded, n)

    def _record(self, path, stream, used, count, kind, label, suffix, ref, loc, draw, notes, axes, discarded,
                n: int) -> int:
        """Append a template; returns its number."""
        self.templates.append(Template(path, stream, used, count, kind, label, suffix, ref, loc, draw, notes, axes,
                                       discarded, n))
        return len(self.templates) - 1

    # -------------------------------------------------------------- lanes
    def _expand(self) -> list[Derivation]:
        """One Derivation per template and lane of its axes, with concrete key references."""
        rows: list[Derivation] = []
        index_of: dict = {}
        memo: dict = {}
        sep = self.sep
        for t, (path, req, used, count, kind, label, suffix, ref, loc, draw, notes, axes, discarded,
                _) in enumerate(self.templates):
            items = suffix + (count,)
            data = hash_input(items, sep)
            word = hash_word(data)
            for lane in product(*(range(self.axis_size[a]) for a in axes)) if axes else ((),):
                assign = dict(zip(axes, lane))
                base = ref if type(ref) is RootKey else self._concrete(ref, assign, index_of, memo)
                # a fork of a key that never exists never exists either
                index_of[(t, lane)] = len(rows) if base is not None else None
                # a key whose base is a per-step key of a thrown-away trace never exists
                rows.append(Derivation(len(rows), path, req, used, count, kind, label, items, data, word,
                                       base, loc, draw, notes, lane, discarded or base is None))
        return rows

    def _concrete(self, ref, assign: dict, index_of: dict, memo: dict):
        def fork(template: int, lane: tuple):
            row = index_of[(template, lane)]
            return None if row is None else ForkKey(row)

        return concrete(ref, assign, memo, self.templates, fork)


def concrete(ref, assign: dict, memo: dict, templates: list, fork):
    """The concrete key reference of template reference `ref` in the lane `assign` (axis -> index);
    None for a key that never exists. `fork(template, lane)` gives a jit fork's ForkKey (or None)."""
    if ref is None or type(ref) is RootKey:
        return ref
    if type(ref) is _Fork:
        axes = templates[ref.template].axes
        if any(a not in assign for a in axes):
            return None
        return fork(ref.template, tuple(assign[a] for a in axes))
    if ref.axis not in assign:
        return None  # a per-step key of a trace Flax discards: it never exists
    key = (ref, assign[ref.axis], tuple(sorted(assign.items())))
    hit = memo.get(key)
    if hit is None:
        parent = concrete(ref.parent, assign, memo, templates, fork)
        if parent is None:
            hit = None
        elif type(ref) is _LaneSplit:
            hit = SplitKey(parent, ref.n, assign[ref.axis])
        else:
            i = assign[ref.axis]
            hit = FoldKey(parent, (-i if ref.negate else i) & 0xFFFFFFFF)
        memo[key] = hit
    return hit


@paused
def replay(spec: Spec) -> list[Derivation]:
    """Every key request the spec's model makes, in execution order."""
    return Replayer(spec).run()
