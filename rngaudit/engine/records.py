"""What the replay records: a Template per make_rng statement and place, expanded into a Derivation per key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..errors import Location
from ..spec.tree import Draw

if TYPE_CHECKING:
    from ..spec.nnx import NnxModule


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
    batched: tuple[int, ...] = ()  # positions in `lane` of the nn.vmap axes the key is batched along

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"

    @property
    def fallback(self) -> bool:
        return self.stream != self.stream_requested


class Template(NamedTuple):
    """What the replay records for a make_rng statement at one place: `n` consecutive calls, counts
    `first_count` .. `first_count + n - 1` (n is 1 on the plain path, which records every call), made in
    every lane of the vmap/scan/while axes `axes`. Each call's key is
    fold_in(base, hash_word(suffix + (count,))), its base `ref` resolved per lane."""

    path: tuple[str, ...]
    stream_requested: str
    stream: str
    first_count: int
    kind: str
    label: str | None
    suffix: tuple  # what Flax hashes before the count: the path since the base key
    ref: object  # RootKey, or a lane template (LaneSplit, LaneFold, ForkOf) resolved per lane
    location: Location
    draw: Draw | None
    notes: tuple[str, ...]
    axes: tuple[int, ...]  # lane axes (indices into Replayer.axis_size), outermost first
    discarded: bool  # made in a trace whose keys Flax throws away
    n: int = 1
    batched: tuple[int, ...] = ()  # positions in `axes` of the nn.vmap axes its key is batched along


@dataclass(frozen=True)
class ToLinenSite:
    """One call of a bridge.ToLinen module: the make_rng templates (one per stream of the scope's rngs, in
    their order) whose keys seed the nnx.Rngs of the NNX module it builds, and whether Linen is initialising
    (then no `default` stream is added)."""

    path: tuple[str, ...]
    call: int  # the module's n-th call in this init/apply (1, 2, ...)
    templates: tuple[tuple[str, int], ...]  # (stream, template number)
    module: NnxModule
    init: bool
    location: Location
    skip_rng: bool = False  # built with no Rngs at all (so no `default` either)
    lanes: tuple[int, ...] = ()  # the sizes of the Linen vmap/scan/while axes it is called in, outermost first
    discarded: bool = False  # in a trace whose Linen keys Flax throws away (nn.scan's constancy check): the NNX
    # module still runs there, on those keys, where they exist

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"


class LazyRows:
    """Indexing for a report's calls made when read: an int (negative from the end) or a slice, then `_at`."""

    def __len__(self) -> int:
        raise NotImplementedError

    def _at(self, j: int):
        raise NotImplementedError

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self._at(k) for k in range(*j.indices(len(self)))]
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self._at(j)

    def __iter__(self):
        for j in range(len(self)):
            yield self._at(j)
