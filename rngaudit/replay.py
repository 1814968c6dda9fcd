"""Replays Flax Linen's naming and per-scope, per-stream counters: a spec -> the derivation of every key. No JAX."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import FlaxError, Location, SpecError
from .hashing import hash_input, hash_word
from .nodes import (Call, Child, Define, Draw, Item, MakeRng, ModuleDef, Param, Sequential, Spec,
                    Variable)

MAX_DERIVATIONS = 50_000_000


@dataclass(frozen=True)
class RootKey:
    """The key the user passed to init/apply for a stream."""

    stream: str

    def __str__(self) -> str:
        return f"rngs[{self.stream!r}]"


@dataclass(frozen=True)
class Derivation:
    """One key Flax hands out: key = fold_in(base, hash_word(hash_input(suffix + (count,))))."""

    index: int
    path: tuple[str, ...]
    stream_requested: str
    stream: str
    count: int
    kind: str  # make_rng | param | variable | dropout | attention_dropout
    label: str | None
    hash_items: tuple
    hash_input: bytes
    hash_word: int
    base: RootKey
    location: Location
    draw: Draw | None = None
    notes: tuple[str, ...] = ()

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"

    @property
    def fallback(self) -> bool:
        return self.stream != self.stream_requested


class _Instance:
    """A bound module instance: a scope path plus the state Flax keeps on the Module object."""

    __slots__ = ("mod", "path", "setup_done", "setup_children", "reserved", "seq_layers")

    def __init__(self, mod: ModuleDef | None, path: tuple[str, ...]):
        self.mod = mod
        self.path = path
        self.setup_done = False
        self.setup_children: dict[str, _Instance] = {}
        self.reserved: dict[str, set] = {}
        self.seq_layers: list[_Instance] | None = None

    @property
    def cls(self) -> str:
        return self.mod.cls if self.mod is not None else "Sequential"

    @property
    def scope_name(self) -> str:
        return self.path[-1] if self.path else "None"


@dataclass
class _Run:
    phase: str
    mutable: tuple[str, ...] | bool
    streams: tuple[str, ...]
    discover: bool
    store: dict = field(default_factory=dict)  # (path, collection, name) -> is a variable (not a subtree)
    counters: dict = field(default_factory=dict)


class Replayer:
    """Walks a spec's model the way Flax executes it and records every key request."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.sep = spec.fix_rng_separator
        self.rows: list[Derivation] = []

    # -------------------------------------------------------------- entry
    def run(self) -> list[Derivation]:
        store: dict = {}
        if self.spec.phase == "apply":
            # The variables apply() receives are those init() of the same model created.
            pre = _Run("init", True, tuple(self.spec.rngs), discover=True)
            self._call(_Instance(self.spec.model, ()), pre)
            store = pre.store
        run = _Run(self.spec.phase, self.spec.mutable, tuple(self.spec.rngs), False, store)
        self._call(_Instance(self.spec.model, ()), run)
        return self.rows

    # -------------------------------------------------------------- modules
    def _call(self, inst: _Instance, run: _Run) -> None:
        if inst.seq_layers is not None:
            for layer in inst.seq_layers:
                self._call(layer, run)
            return
        if not inst.setup_done:
            # mirrors flax/linen/module.py _try_setup: setup runs once, before the first method call
            inst.setup_done = True
            self._items(inst, inst.mod.setup, inst.setup_children, {}, run)
        self._items(inst, inst.mod.body, {}, {}, run)
        # mirrors module.py _call_wrapped_method: a compact call ends with scope.rewound()
        inst.reserved.clear()

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
        return _Instance(mod, inst.path + (name,))

    # -------------------------------------------------------------- statements
    def _items(self, inst: _Instance, items: tuple[Item, ...], local: dict, cursor: dict, run: _Run) -> None:
        for item in items:
            if item.when is not None and item.when != run.phase:
                continue
            if isinstance(item, MakeRng):
                for _ in range(item.repeat):
                    self._make_rng(inst, item.stream, item.kind, item.label, item.draw, item.loc, run)
            elif isinstance(item, Param):
                self._param(inst, item, run)
            elif isinstance(item, Variable):
                self._variable(inst, item, run)
            elif isinstance(item, Child):
                for _ in range(item.repeat):
                    child = self._new_child(inst, item.module, cursor, item.loc)
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
                seq.seq_layers.append(_Instance(layer, seq.path + (f"layers_{i}",)))
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

    def _require_collection(self, inst: _Instance, col: str, name: str, loc: Location, run: _Run) -> None:
        # mirrors flax/core/scope.py Scope.param / Scope.variable: a missing variable of an immutable
        # collection that holds no variable at all (is_collection_empty) is ScopeCollectionNotFound
        if not any(stored[1] == col for stored in run.store):
            raise FlaxError(
                "ScopeCollectionNotFound",
                f'Tried to access "{name}" from collection "{col}" in "/{"/".join(inst.path)}" but the '
                f"collection is empty. init of this model makes no {col!r}: check `when:` and `mutable`",
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

    def _mutable(self, run: _Run, col: str) -> bool:
        return run.mutable is True or (isinstance(run.mutable, tuple) and col in run.mutable)

    def _param(self, inst: _Instance, item: Param, run: _Run) -> None:
        # mirrors flax/linen/module.py Module.param and flax/core/scope.py Scope.param
        self._reserve(inst, item.name, "params", "param", item.loc)
        key = (inst.path, "params", item.name)
        if self._exists(inst, "params", item.name, item.loc, run):
            return
        if not self._mutable(run, "params"):
            self._require_collection(inst, "params", item.name, item.loc, run)
            raise FlaxError(
                "ScopeParamNotFoundError",
                f'Could not find parameter named "{item.name}" in scope "/{"/".join(inst.path)}". '
                "In apply, params come from init of the same model: check `when:` on this param",
                item.loc,
            )
        self._make_rng(inst, "params", "param", item.name, item.draw, item.loc, run)
        self._put(run, key)

    def _variable(self, inst: _Instance, item: Variable, run: _Run) -> None:
        if item.eager:
            # self.variable(col, name, f, self.make_rng(s)): the argument is evaluated on every call
            for s in item.streams:
                self._make_rng(inst, s, "variable", item.name, item.draw, item.loc, run)
        self._reserve(inst, item.name, item.collection, "variable", item.loc)
        key = (inst.path, item.collection, item.name)
        if self._exists(inst, item.collection, item.name, item.loc, run):
            return
        if not self._mutable(run, item.collection):
            self._require_collection(inst, item.collection, item.name, item.loc, run)
            raise FlaxError(
                "ScopeVariableNotFoundError",
                f'No Variable named "{item.name}" for collection "{item.collection}" exists in '
                f'"/{"/".join(inst.path)}". Pass the collection to apply, or list it in `mutable`',
                item.loc,
            )
        if not item.eager:
            for s in item.streams:
                self._make_rng(inst, s, "variable", item.name, item.draw, item.loc, run)
        self._put(run, key)

    # -------------------------------------------------------------- the key itself
    def _make_rng(self, inst: _Instance, stream: str, kind: str, label: str | None, draw: Draw | None,
                  loc: Location, run: _Run) -> None:
        # mirrors flax/core/scope.py Scope.make_rng
        notes: tuple[str, ...] = ()
        used = stream
        if stream not in run.streams:
            if "params" in run.streams:
                used = "params"
                notes = (f"stream {stream!r} was not passed to {run.phase}; Flax falls back to 'params' "
                         "and advances the params counter",)
            elif run.discover:
                used = stream
            else:
                raise FlaxError(
                    "InvalidRngError",
                    f'{inst.scope_name} needs PRNG for "{stream}". Add `{stream}:` (or `params:`) to rngs',
                    loc,
                )
        ckey = (inst.path, used)
        count = run.counters.get(ckey, 0) + 1
        run.counters[ckey] = count
        if run.discover:
            return
        if len(self.rows) >= MAX_DERIVATIONS:
            raise SpecError(f"the model asks for more than {MAX_DERIVATIONS} keys; reduce `repeat`", loc)
        items = inst.path + (count,)
        data = hash_input(items, self.sep)
        self.rows.append(Derivation(
            index=len(self.rows), path=inst.path, stream_requested=stream, stream=used, count=count,
            kind=kind, label=label, hash_items=items, hash_input=data, hash_word=hash_word(data),
            base=RootKey(used), location=loc, draw=draw, notes=notes,
        ))


def replay(spec: Spec) -> list[Derivation]:
    """Every key request the spec's model makes, in execution order."""
    return Replayer(spec).run()
