"""The state Flax keeps while a model runs, as the replay needs it: a scope (path, visible streams, lanes,
collections), a bound module instance (its setup, children and reserved names) and one run's variables
and per-scope, per-stream counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import FlaxError, Location
from ..spec.tree import ModuleDef
from .filters import AllBut

# Notes a key carries when it is made in a trace Flax throws away
SCAN_CHECK = (
    "made in nn.scan's first trace (the constancy check, check_constancy_invariants=True): "
    "Flax throws this key away, but its count is used up"
)
MAP_RUN1 = (
    "made in nn.map_variables' first run (init=True with a mutable collection): Flax throws this "
    "key away, but its count is used up"
)
KEPT = (
    "made in a first trace that Flax otherwise throws away, but kept: it initialises a variable "
    "(a broadcast one, for nn.scan)"
)


@dataclass
class Scope:
    """What Flax's Scope holds for key purposes: a path, the visible streams as lazy keys
    (base reference, path suffix since the base), the active lane axes, the collections a lift
    lets through, and whether keys made here are thrown away."""

    path: tuple[str, ...]
    rngs: dict  # stream -> (key reference template, suffix)
    axes: tuple[int, ...] = ()
    cols: frozenset | AllBut | None = None  # lifted collections; None: all
    immutable: bool = False
    discard: Literal[True] | frozenset | None = (
        None  # None | True (keep variable inits) | frozenset (keep inits in these)
    )
    context: tuple[str, ...] = ()  # notes for every key made here
    frozen: frozenset = frozenset()  # collections a lift makes read-only here
    debug: tuple[str, ...] = ()  # Flax's debug_path: the path with transform names, for messages
    root: tuple[str, ...] = ()  # path of the scope that is root here (a lift's scope has no parent)
    # (axis, transform, collections broadcast over its lanes, collections whose variables made inside never
    # reach the enclosing lifts (a scan without the constancy check drops its broadcast outputs); None: all)
    lanes: tuple = ()
    carry: frozenset = frozenset()  # scan carry collections: the body cannot create them
    abstract: bool = False  # Flax's TestScope root: make_rng hands out a dummy key, counts nothing

    def push(self, name: str) -> Scope:
        # mirrors flax/core/scope.py Scope.push: LazyRng.create(rng, name) appends to the suffix
        return Scope(
            self.path + (name,),
            {s: (r, suf + (name,)) for s, (r, suf) in self.rngs.items()},
            self.axes,
            self.cols,
            self.immutable,
            self.discard,
            self.context,
            self.frozen,
            self.debug + (name,),
            self.root,
            self.lanes,
            self.carry,
        )

    def lifted(self, pack: str | None = None, **kw) -> Scope:
        new = Scope(
            self.path,
            self.rngs,
            self.axes,
            self.cols,
            self.immutable,
            self.discard,
            self.context,
            self.frozen,
            self.debug,
            self.root,
            self.lanes,
            self.carry,
        )
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


class Instance:
    """A bound module instance: its scope plus the state Flax keeps on the Module object."""

    __slots__ = ("clone", "mod", "reserved", "scope", "seq_layers", "setup_children", "setup_done")

    def __init__(self, mod: ModuleDef, scope: Scope, clone: bool = False):
        self.mod = mod
        self.scope = scope
        self.clone = clone  # a clone made by a lifted transform: an instance of the untransformed class
        self.setup_done = False
        self.setup_children: dict[str, Instance] = {}
        self.reserved: dict[str, set] = {}
        self.seq_layers: list[Instance] | None = None

    @property
    def path(self) -> tuple[str, ...]:
        return self.scope.path

    @property
    def cls(self) -> str:
        return (self.mod.impl_cls or self.mod.cls) if self.clone else self.mod.cls

    @property
    def scope_name(self) -> str:
        return self.path[-1] if self.path else "None"

    def reserve(self, name: str, col: str | None, what: str, loc: Location) -> None:
        """Claim `name` for a submodule (col None) or a variable of `col`, as Flax does."""
        # mirrors flax/core/scope.py Scope.name_reserved / reserve
        cols = self.reserved.get(name)
        if cols is not None and (None in cols or col is None or col in cols):
            raise FlaxError(
                "NameInUseError",
                f'Could not create {what} "{name}" in Module {self.cls}: Name in use. Give it another name',
                loc,
            )
        self.reserved.setdefault(name, set()).add(col)


@dataclass
class Run:
    """What one replay shares: the phase, the mutable collections, the streams and the variables made."""

    phase: str
    mutable: tuple[str, ...] | bool
    streams: tuple[str, ...]
    discover: bool
    store: dict = field(default_factory=dict)  # (path, collection, name) -> is a variable (not a subtree)
    counters: dict = field(default_factory=dict)
    # path -> (the streams its counters have, the debug path it was first created at): Flax keeps a
    # child scope's counters in its parent, made once, at the first push of that name
    counted: dict = field(default_factory=dict)
    carry_error: FlaxError | None = None  # raised when the scan body's trace ends
    lane_errors: dict = field(default_factory=dict)  # lane axis -> broadcast error, raised when its trace ends
    # before flax 0.10.2: jax's nn.jit trace cache, key -> (the path traced, the counters it started from)
    jit_traces: dict = field(default_factory=dict)
