"""Replays Flax Linen's execution of a spec's model: the statement walk, naming and per-scope, per-stream
counters, every make_rng recorded as a Template, expanded into a Derivation per key. No JAX."""

from __future__ import annotations

from itertools import product

from ..errors import FlaxError, Location, SpecError
from ..gcpause import paused
from ..spec.releases import version_text
from ..spec.tree import (
    Call,
    Child,
    Cond,
    Define,
    Draw,
    Item,
    Lift,
    MakeRng,
    ModuleDef,
    Param,
    Sequential,
    Spec,
    Transform,
    Variable,
    WhileLoop,
)
from .draws import RBG_IMPLS, RBG_LANES, UNSAFE_RBG_LANES
from .hashing import hash_input, hash_word
from .lifts import cond, traces, validate_setup, while_loop
from .records import Derivation, Template, ToLinenSite
from .refs import Discovered, ForkKey, ForkOf, LaneSplit, RootKey, concrete
from .scope import KEPT, MAP_RUN1, SCAN_CHECK, Instance, Run, Scope
from .variables import lane_axes, param, variable

MAX_DERIVATIONS = 50_000_000


class Replayer:
    """Walks a spec's model the way Flax executes it and records every key request: one Template per
    make_rng call, or with `blocks`, one per make_rng statement (its `repeat` calls are consecutive counts,
    expanded into columns by rngaudit.engine.table; nothing is hashed while it walks)."""

    def __init__(self, spec: Spec, blocks: bool = False):
        self.spec = spec
        self.sep = spec.fix_rng_separator
        self.rules = spec.rules
        self.blocks = blocks
        self.templates: list[Template] = []
        self.axis_size: list[int] = []
        self.axis_kind: list[str] = []  # per axis: vmap | scan | while_loop
        self.modules: dict[tuple[str, ...], ModuleDef] = {}  # each submodule path -> the module made there first
        self.to_linen: list[ToLinenSite] = []  # every call of a bridge.ToLinen module, in order

    def run(self) -> list[Derivation]:
        """Every key request, in execution order."""
        self.walk()
        return self.expand()

    @property
    def rows(self) -> int:
        """How many rows (call sites, per lane) the templates expand to."""
        return sum(self._rows_of(tpl) for tpl in self.templates)

    def _rows_of(self, tpl: Template) -> int:
        lanes = 1
        for a in tpl.axes:
            lanes *= self.axis_size[a]
        return tpl.n * lanes

    def first_rows(self) -> list[int]:
        """Per template, the number of its first row (its calls and lanes follow, in order)."""
        out, at = [], 0
        for tpl in self.templates:
            out.append(at)
            at += self._rows_of(tpl)
        return out

    def walk(self) -> Replayer:
        """Run the model as Flax does (init, or apply after the init that made its variables)."""
        store: dict = {}
        if self.spec.phase == "apply":
            # The variables apply() receives are those init() of the same model created.
            # That init is taken to have passed apply's streams and `params` (else it could not
            # make them): a key it cannot make fails it, and apply with it.
            streams = tuple(self.spec.rngs) + (() if "params" in self.spec.rngs else ("params",))
            # and the streams the NNX modules of its bridge.ToLinen modules draw from (without them ToLinen raises
            # KeyError at init)
            streams += tuple(s for s in sorted(to_linen_streams(self.spec.model)) if s not in streams)
            pre = Run("init", True, streams, discover=True)
            self.call(self.root(streams), pre)
            store = pre.store
        run = Run(self.spec.phase, self.spec.mutable, tuple(self.spec.rngs), False, store)
        self.call(self.root(), run)
        return self

    def root(self, streams=None) -> Instance:
        streams = self.spec.rngs if streams is None else streams
        return Instance(self.spec.model, Scope((), {s: (RootKey(s), ()) for s in streams}))

    def new_axis(self, size: int, kind: str) -> int:
        self.axis_size.append(size)
        self.axis_kind.append(kind)
        return len(self.axis_size) - 1

    def call(self, inst: Instance, run: Run) -> None:
        if inst.seq_layers is not None:
            for layer in inst.seq_layers:
                self.call(layer, run)
            return
        self.lifted(inst, inst.mod.lifts, run)
        # mirrors module.py _call_wrapped_method: a compact call ends with scope.rewound()
        inst.reserved.clear()

    def setup(self, inst: Instance, run: Run) -> None:
        if not inst.setup_done:
            # mirrors flax/linen/module.py _try_setup: setup runs once, before the first method call
            inst.setup_done = True
            self.items(inst, inst.mod.setup, inst.setup_children, {}, run)

    def lifted(self, inst: Instance, lifts: tuple[Lift, ...], run: Run) -> None:
        """Run the instance's __call__ through its lifted transforms, outermost first. Each trace
        runs on a clone bound to the lifted scope (linen/transforms.py core_fn clones the module
        and sets its scopes), and the clone runs setup() again. Outside the transform, the others
        take a shallow setup (get_module_scopes: _try_setup(shallow=True)) that runs no user code;
        nn.jit and nn.fold_rngs run the module's setup() after their fork (see _traces)."""
        if lifts and not inst.setup_done and inst.mod.setup:
            validate_setup(self, inst)
        if not lifts:
            if inst.mod.to_linen is not None:
                self.to_linen_call(inst, run)
                return
            self.setup(inst, run)
            self.items(inst, inst.mod.body, {}, {}, run)
            return
        for inner in traces(self, lifts[0], inst, run):
            self.lifted(Instance(inst.mod, inner, clone=True), lifts[1:], run)

    def new_child(self, inst: Instance, mod: ModuleDef, cursor: dict, loc: Location, run: Run) -> Instance:
        # mirrors flax/linen/module.py Module.__post_init__ auto-naming
        if mod.name is None:
            n = cursor.get(mod.cls, 0)
            name = f"{mod.cls}_{n}"
            cursor[mod.cls] = n + 1
        else:
            name = mod.name
        inst.reserve(name, None, "submodule", loc)
        child = Instance(mod, self.push(inst.scope, name, run))
        self.modules.setdefault(child.path, mod)
        return child

    @staticmethod
    def push(scope: Scope, name: str, run: Run) -> Scope:
        child = scope.push(name)
        # mirrors flax/core/scope.py Scope.push: the child's counters live in the parent's
        # rng_counters under its name, made at the first push with the streams visible then, and
        # every later push of that name (a cond handing its name back, a lift's clone) reuses them
        run.counted.setdefault(child.path, (frozenset(child.rngs), child.path_text))
        return child

    def items(self, inst: Instance, items: tuple[Item, ...], local: dict, cursor: dict, run: Run) -> None:
        for item in items:
            if item.when is not None and item.when != run.phase:
                continue
            if isinstance(item, MakeRng):
                self.make_rng_item(inst, item, run)
            elif isinstance(item, Param):
                param(self, inst, item, run)
            elif isinstance(item, Variable):
                variable(self, inst, item, run)
            elif isinstance(item, (Child, Transform)):
                mod = item.module if isinstance(item, Child) else item.target
                for _ in range(item.repeat):
                    child = self.new_child(inst, mod, cursor, item.loc, run)
                    local[child.path[-1]] = child
                    self.call(child, run)
            elif isinstance(item, Define):
                child = self.new_child(inst, item.module, cursor, item.loc, run)
                local[child.path[-1]] = child
            elif isinstance(item, Call):
                target = local.get(item.name) or inst.setup_children.get(item.name)
                if target is None:
                    known = sorted(set(local) | set(inst.setup_children))
                    raise SpecError(
                        f"`call: {item.name}`: module {inst.cls} has no child {item.name!r} at this point"
                        + (
                            f"; children so far: {', '.join(known)}"
                            if known
                            else "; create it first (a module/layer statement or a setup attribute)"
                        ),
                        item.loc,
                    )
                for _ in range(item.repeat):
                    self.call(target, run)
            elif isinstance(item, Sequential):
                self.sequential(inst, item, local, cursor, run)
            elif isinstance(item, Cond):
                cond(self, inst, item, cursor, local, run)
            elif isinstance(item, WhileLoop):
                while_loop(self, inst, item, cursor, local, run)

    def to_linen_call(self, inst: Instance, run: Run) -> None:
        """A call of a bridge.ToLinen module (mirrors flax/nnx/bridge/wrappers.py ToLinen.__call__ and
        linen_rngs_dict): one make_rng per stream of the scope's rngs, in their order, whose keys the NNX module
        built at this call is given as its nnx.Rngs (rngaudit.engine.nnx_bridge runs it)."""
        tl = inst.mod.to_linen
        assert tl is not None
        scope = inst.scope
        loc = inst.mod.loc
        streams = () if tl.skip_rng else tuple(scope.rngs)
        if not run.discover and scope.abstract:
            raise SpecError(
                f"bridge.ToLinen at /{'/'.join(scope.path)} is called in an abstract scope (Flax's TestScope): "
                "rngaudit does not model that",
                loc,
            )
        made = []
        for s in streams:
            t = self.make_rng(
                scope,
                s,
                "make_rng",
                None,
                None,
                loc,
                run,
                note=f"bridge.ToLinen: the key of stream {s!r} of the Rngs its NNX module {tl.module.cls} is built from",
            )
            if isinstance(t, int):  # (a template's number; apply's pre-init records none)
                made.append((s, t))
        if run.discover:
            # the init that made apply's variables (its streams: walk()); what the module raises there, it raised
            from .nnx_bridge import check_to_linen

            check_to_linen(self.spec, ToLinenSite(scope.path, 0, (), tl.module, True, loc, tl.skip_rng), streams)
            return
        calls = sum(1 for site in self.to_linen if site.path == scope.path) + 1
        lanes = tuple(self.axis_size[a] for a in scope.axes)
        site = ToLinenSite(
            scope.path,
            calls,
            tuple(made),
            tl.module,
            run.phase == "init",
            loc,
            tl.skip_rng,
            lanes,
            scope.discard is not None,
        )
        # the NNX module runs here, in Flax: an error it raises comes before any later Linen statement's (its keys
        # are computed once the Linen keys are: rngaudit.engine.nnx_bridge.to_linen_runs)
        from .nnx_bridge import check_to_linen

        check_to_linen(self.spec, site, streams)
        self.to_linen.append(site)

    def sequential(self, inst: Instance, item: Sequential, local: dict, cursor: dict, run: Run) -> None:
        if item.in_setup:
            # Built in setup(): the layers are adopted under the Sequential's `layers` field.
            seq = self.new_child(inst, ModuleDef("Sequential", item.name, (), (), item.loc), cursor, item.loc, run)
            seq.seq_layers = []
            for i, layer in enumerate(item.layers):
                if layer.name is not None:
                    raise SpecError(
                        "layers of a Sequential built in setup() are named layers_0, layers_1, ...; "
                        "drop `name:` from this layer",
                        layer.loc,
                    )
                seq.seq_layers.append(Instance(layer, self.push(seq.scope, f"layers_{i}", run)))
            local[seq.path[-1]] = seq
            return
        # Built in @compact: the layers are created (and auto-named) in the enclosing module first.
        layers = []
        for layer in item.layers:
            child = self.new_child(inst, layer, cursor, layer.loc, run)
            local[child.path[-1]] = child
            layers.append(child)
        seq = self.new_child(inst, ModuleDef("Sequential", item.name, (), (), item.loc), cursor, item.loc, run)
        seq.seq_layers = layers
        local[seq.path[-1]] = seq
        self.call(seq, run)

    def make_rng_item(self, inst: Instance, item: MakeRng, run: Run) -> None:
        """A `make_rng` statement: `repeat` calls, one template each, or one for all of them in blocks."""
        if self.blocks:
            self.make_rng(inst.scope, item.stream, item.kind, item.label, item.draw, item.loc, run, n=item.repeat)
            return
        for _ in range(item.repeat):
            self.make_rng(inst.scope, item.stream, item.kind, item.label, item.draw, item.loc, run)

    def make_rng(
        self,
        scope: Scope,
        stream: str,
        kind: str,
        label: str | None,
        draw: Draw | None,
        loc: Location,
        run: Run,
        collection: str | None = None,
        note: str | None = None,
        n: int = 1,
    ) -> int | Discovered | None:
        """Count `n` make_rng calls at `scope` (n > 1 only for a repeated statement: the calls are
        consecutive and alike but for their counts) and record their template; returns its number."""
        # mirrors flax/core/scope.py Scope.make_rng
        if scope.abstract:
            return None
        notes: tuple[str, ...] = ()
        used = stream
        if stream not in scope.rngs:
            if "params" in scope.rngs and self.rules.stream_fallback:
                used = "params"
                if stream in run.streams:
                    notes = (
                        (
                            f"stream {stream!r} is hidden here by a transform's rng filter (split_rngs "
                            "keys or rngs=); Flax falls back to 'params' and advances the params counter"
                        ),
                    )
                else:
                    notes = (
                        (
                            f"stream {stream!r} was not passed to {run.phase}; Flax falls back to "
                            "'params' and advances the params counter"
                        ),
                    )
            else:
                name = scope.path[-1] if scope.path else "None"
                hidden = stream in run.streams
                old = (
                    f" (flax {version_text(self.rules.version)} has no fallback to 'params': it came in 0.8.2)"
                    if "params" in scope.rngs
                    else ""
                )
                raise FlaxError(
                    "InvalidRngError",
                    f'{name} needs PRNG for "{stream}"{old}. '
                    + (
                        f"The stream is passed but hidden by a transform's rng filter: list {stream!r} in "
                        "its split_rngs (or rngs=)"
                        if hidden
                        else f"Add `{stream}:` "
                        + ("" if stream == "params" or not self.rules.stream_fallback else "(or `params:`) ")
                        + "to rngs"
                    ),
                    loc,
                )
        counted = run.counted.get(scope.path)
        if counted is not None and used not in counted[0]:
            name = scope.path[-1]
            raise FlaxError(
                "KeyError",
                f"{used!r}: {name} asks for a {used!r} key, but its scope was first created at "
                f"{counted[1]} where {used!r} was hidden by a transform's rng filter; Flax keeps that "
                f"scope's rng counters, which have no {used!r}, for every later module of that name. "
                f"Give the later module another name, or let the transform pass {used!r} "
                "(its rngs= or split_rngs)",
                loc,
            )
        ckey = (scope.path, used)
        count = run.counters.get(ckey, 0) + 1
        run.counters[ckey] = count + n - 1
        if run.discover:
            # no template (apply's pre-init reports nothing), but the key's reference still decides
            # whether a broadcast variable is initialised from a per-lane key
            return Discovered(scope.rngs[used][0]) if used in scope.rngs else None
        if len(self.templates) >= MAX_DERIVATIONS:
            raise SpecError(f"the model asks for more than {MAX_DERIVATIONS} keys; reduce `repeat`", loc)
        ref, suffix = scope.rngs[used]
        discarded = False
        context = scope.context
        if scope.discard is not None:
            keep = scope.discard
            discarded = not (collection is not None and (keep is True or collection in keep))
            if not discarded:
                context = tuple(KEPT if c in (SCAN_CHECK, MAP_RUN1) else c for c in context)
        if note:
            notes += (note,)
        return self.record(
            scope.path,
            stream,
            used,
            count,
            kind,
            label,
            suffix,
            ref,
            loc,
            draw,
            notes + context,
            scope.axes,
            discarded,
            n,
        )

    def record(
        self, path, stream, used, count, kind, label, suffix, ref, loc, draw, notes, axes, discarded, n: int
    ) -> int:
        """Append a template; returns its number."""
        batched = self.batched(ref, axes)
        if self.spec.prng_impl == "unsafe_rbg" and not discarded:
            self.refuse_unsafe_split(ref, loc)
        if batched and self.spec.prng_impl in RBG_IMPLS and draw is not None:
            notes = (RBG_LANES,) + notes
        self.templates.append(
            Template(path, stream, used, count, kind, label, suffix, ref, loc, draw, notes, axes, discarded, n, batched)
        )
        return len(self.templates) - 1

    def refuse_unsafe_split(self, ref, loc) -> None:
        """An unsafe_rbg key split (nn.vmap, nn.scan) where the key is already batched by an nn.vmap around:
        JAX's split there is not the per-lane split rngaudit computes."""
        split_below = False  # a split nearer the key than `ref`: done on what `ref` gives
        while ref is not None and type(ref) is not RootKey:
            if type(ref) is ForkOf:
                ref = self.templates[ref.template].ref
                continue
            if type(ref) is LaneSplit:
                if split_below and self.axis_kind[ref.axis] == "vmap":
                    raise SpecError(UNSAFE_RBG_LANES.format(what="split", whose="key", op="split"), loc)
                split_below = True
            ref = ref.parent

    def batched(self, ref, axes: tuple[int, ...]) -> tuple[int, ...]:
        """The positions in `axes` of the nn.vmap axes a key of reference `ref` is batched along (those it
        was split along, or a key it derives from was): inside jax.vmap the key is one traced array."""
        if not axes or ref is None or type(ref) is RootKey:
            return ()
        depends = lane_axes(self.templates, ref)
        kinds = self.axis_kind
        return tuple(i for i, a in enumerate(axes) if a in depends and kinds[a] == "vmap")

    def expand(self) -> list[Derivation]:
        """One Derivation per template and lane of its axes, with concrete key references."""
        rows: list[Derivation] = []
        index_of: dict = {}
        memo: dict = {}
        sep = self.sep
        for t, (
            path,
            req,
            used,
            count,
            kind,
            label,
            suffix,
            ref,
            loc,
            draw,
            notes,
            axes,
            discarded,
            _,
            batched,
        ) in enumerate(self.templates):
            items = suffix + (count,)
            data = hash_input(items, sep)
            word = hash_word(data)
            for lane in product(*(range(self.axis_size[a]) for a in axes)) if axes else ((),):
                assign = dict(zip(axes, lane))
                base = ref if type(ref) is RootKey else self._concrete(ref, assign, index_of, memo)
                # a fork of a key that never exists never exists either
                index_of[(t, lane)] = len(rows) if base is not None else None
                # a key whose base is a per-step key of a thrown-away trace never exists
                rows.append(
                    Derivation(
                        len(rows),
                        path,
                        req,
                        used,
                        count,
                        kind,
                        label,
                        items,
                        data,
                        word,
                        base,
                        loc,
                        draw,
                        notes,
                        lane,
                        discarded or base is None,
                        batched,
                    )
                )
        return rows

    def _concrete(self, ref, assign: dict, index_of: dict, memo: dict):
        def fork(template: int, lane: tuple):
            row = index_of[(template, lane)]
            return None if row is None else ForkKey(row)

        return concrete(ref, assign, memo, self.templates, fork)


@paused
def replay(spec: Spec) -> list[Derivation]:
    """Every key request the spec's model makes, in execution order."""
    return Replayer(spec).run()


def to_linen_streams(model: ModuleDef) -> set[str]:
    """The streams the NNX modules of a Linen model's bridge.ToLinen modules draw from."""
    from ..spec.layers import to_linen_modules
    from ..spec.nnx import drawn_streams

    return {s for tl in to_linen_modules(model) for s in drawn_streams(tl.module)}
