"""Key references: which key a make_rng folds its hash word into, as the replay records it (per lane, a
template: a split or fold whose index is a lane axis still to be chosen) and as every reported Derivation
carries it (concrete: equal references mean equal base keys)."""

from __future__ import annotations

from dataclasses import dataclass


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
class PathFoldKey:
    """jax.random.fold_in(parent, data), `data` the SHA-1 word of a module path (flax 0.9.0 to 0.10.1 nn.jit):
    apart from FoldKey because the word depends on fix_rng_separator."""

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
class Discovered:
    """What a make_rng of apply's pre-init run returns instead of a template: its key reference."""

    ref: object


@dataclass(frozen=True)
class LaneSplit:
    """A base key split into one key per lane along `axis` (resolved per lane)."""

    parent: object
    n: int
    axis: int


@dataclass(frozen=True)
class LaneFold:
    """A base key folded with the lane index along `axis` (resolved per lane)."""

    parent: object
    axis: int
    negate: bool


@dataclass(frozen=True)
class StaticFold:
    """A base key with a hashed path folded in (flax 0.9.0-0.10.1 nn.jit's LazyRng.fold()): resolved per lane as
    its parent is, then fold_in(parent, data)."""

    parent: object
    data: int


@dataclass(frozen=True)
class ForkOf:
    """A jit fork's key: the key of the call `template` (resolved per lane)."""

    template: int


def concrete(ref, assign: dict, memo: dict, templates: list, fork):
    """The concrete key reference of template reference `ref` in the lane `assign` (axis -> index);
    None for a key that never exists. `fork(template, lane)` gives a jit fork's ForkKey (or None)."""
    if ref is None or type(ref) is RootKey:
        return ref
    if type(ref) is ForkOf:
        axes = templates[ref.template].axes
        if any(a not in assign for a in axes):
            return None
        return fork(ref.template, tuple(assign[a] for a in axes))
    if type(ref) is StaticFold:
        parent = concrete(ref.parent, assign, memo, templates, fork)
        return None if parent is None else PathFoldKey(parent, ref.data)
    if ref.axis not in assign:
        return None  # a per-step key of a trace Flax discards: it never exists
    key = (ref, assign[ref.axis], tuple(sorted(assign.items())))
    hit = memo.get(key)
    if hit is None:
        parent = concrete(ref.parent, assign, memo, templates, fork)
        if parent is None:
            hit = None
        elif type(ref) is LaneSplit:
            hit = SplitKey(parent, ref.n, assign[ref.axis])
        else:
            i = assign[ref.axis]
            hit = FoldKey(parent, (-i if ref.negate else i) & 0xFFFFFFFF)
        memo[key] = hit
    return hit
