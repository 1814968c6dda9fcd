"""Finds call sites that end with identical keys, says why, and checks the fixes (no typer, rich or JAX)."""
from __future__ import annotations

import bisect
import dataclasses
import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

from ..engine.hashing import encode_item, hash_input, hash_word
from ..errors import Location
from ..gcpause import paused
from ..spec.tree import (
    Child,
    Cond,
    Define,
    MakeRng,
    ModuleDef,
    Param,
    Sequential,
    Spec,
    Transform,
    Variable,
    WhileLoop,
)

if TYPE_CHECKING:
    import numpy as np

# The collision classes (issue 4). 1-3 are decided by hashing alone; 4 needs key data.
CONCATENATION = 1  # identical hash input from different string items
COUNT_MEETS_NAME = 2  # identical hash input where an integer count meets string bytes
HASH_WORD = 3  # different hash inputs, identical 32-bit SHA-1 word, same base key
SHARED_KEY = 4  # identical keys from different base keys, streams or lanes

CATEGORIES = {
    CONCATENATION: "concatenation",
    COUNT_MEETS_NAME: "count_meets_name",
    HASH_WORD: "hash_word",
}
SHARED_SEED = "shared_seed"  # class 4, failing: streams (or bases) seeded with the same key
UNSPLIT_LANES = "unsplit_lanes"  # class 4, information: the lanes of one call share a key (split_rngs false)

# Latent collisions are reported when the smaller colliding count is at most this (two-byte counts).
DEFAULT_LATENT_MAX_COUNT = 65535
RENAME_TRIES = 40  # candidate names tried per module
RENAME_BUDGET = 4_000_000  # call sites re-derived per module at most (fewer tries for a module with many keys)
RENAME_MAX_EXPECTED = 3  # a rename expected to meet more keys by chance than this is not tried
REPLAY_LIMIT = 20_000  # specs with at most this many keys check renames by replaying the renamed model
REPLAY_TRIES = 4  # candidate names per module when each costs a replay
# Inputs with fewer call sites keep their columns in Python lists and their keys on Python ints: that
# is quicker than importing NumPy (tens of ms) for them. Larger inputs use NumPy arrays. Both give the
# same report (tests/test_collisions_paths.py).
SMALL_SITES = 4096
_BYTEORDER = sys.byteorder


def vectorised(n: int) -> bool:
    """Whether an input of n call sites keeps its columns in NumPy arrays."""
    return n >= SMALL_SITES


# ---------------------------------------------------------------- results
@dataclass(frozen=True)
class CallSite:
    """One key request: where it comes from, what Flax hashes for it, and the key it gets."""

    index: int
    path: tuple[str, ...]
    stream_requested: str
    stream: str
    count: int
    lane: tuple[int, ...]
    base: str
    kind: str
    label: str | None
    hash_items: tuple
    hash_input: bytes
    hash_word: int
    key: tuple[int, ...] | None
    location: Location

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"


_FIELDS: dict[type, tuple[str, ...]] = {}


def _frozen(cls, *values):
    """cls(*values) for a frozen dataclass of plain fields, without its __setattr__ per field: a large
    report describes tens of thousands of call sites."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    obj = object.__new__(cls)
    obj.__dict__.update(zip(names, values))
    return obj


@dataclass(frozen=True)
class HashInput:
    """The call sites of a finding that hash exactly the same bytes."""

    data: bytes
    word: int
    key: tuple[int, ...] | None  # None when key data was not computed (hash-only run)
    sites: tuple[CallSite, ...]


@dataclass(frozen=True)
class SeparatorCheck:
    """Whether `fix_rng_separator: true` removes a finding, found by recomputing the keys with it."""

    flag: bool  # the model's fix_rng_separator now
    removes: bool | None  # None: the flag is on already, or the keys could not be recomputed
    detail: str
    keys_in_model: int  # every one of them changes when the flag flips


@dataclass(frozen=True)
class Rename:
    """An explicit `name:` for one module, verified to remove the finding without creating a new one."""

    path: tuple[str, ...]  # the module's path now
    new_name: str
    module_class: str | None
    explicit: bool  # the module has an explicit name now (else Flax auto-names it)
    location: Location | None  # where the module is written
    keys_changed: int  # call sites whose key the rename changes (every stream)
    note: str = ""  # what else changes, e.g. later auto-named modules that Flax then names differently

    @property
    def old_name(self) -> str:
        return self.path[-1]

    @property
    def path_str(self) -> str:
        return "/".join(self.path)


@dataclass(frozen=True)
class Collision:
    """Distinct call sites that end with one identical key."""

    collision_class: int
    category: str
    failing: bool
    inputs: tuple[HashInput, ...]  # grouped by key and hashed bytes, in order of first call
    separator: SeparatorCheck
    renames: tuple[Rename, ...]  # () when no rename helps or none could be verified
    rename_note: str

    @property
    def sites(self) -> tuple[CallSite, ...]:
        return tuple(sorted((s for h in self.inputs for s in h.sites), key=lambda s: s.index))

    @property
    def keys(self) -> tuple[tuple[int, ...] | None, ...]:
        """The distinct keys the call sites share (one, except for class 4 across several keys)."""
        return tuple(dict.fromkeys(h.key for h in self.inputs))


@dataclass(frozen=True)
class LatentPartner:
    """A longer path that collides with a latent finding's path once the counts meet."""

    site: CallSite  # its first call site
    max_count: int  # the highest count it reaches now
    counts: tuple[int, int]  # the smallest colliding counts: (short path's, this path's)
    data: bytes  # the bytes both would hash at those counts
    separator_counts: tuple[int, int] | None  # the same with fix_rng_separator flipped; None: never


@dataclass(frozen=True)
class LatentCollision:
    """A module path whose keys would equal those of other paths if it drew more keys."""

    site: CallSite  # the first call site of the short path
    max_count: int
    partners: tuple[LatentPartner, ...]
    separator: SeparatorCheck
    renames: tuple[Rename, ...]
    rename_note: str


@dataclass(frozen=True)
class Audit:
    """Every collision and latent collision of one input (a spec, or a JSON file of module paths)."""

    source: str
    input_kind: str  # spec | paths | params_tree
    call_sites: int
    fix_rng_separator: bool
    prng_impl: str | None
    keys_checked: bool  # class 4 needs key data; False for hash-only runs and JSON inputs
    latent_max_count: int
    collisions: tuple[Collision, ...]
    latent: tuple[LatentCollision, ...]

    @property
    def failing(self) -> int:
        return sum(1 for c in self.collisions if c.failing)

    @property
    def info(self) -> int:
        return sum(1 for c in self.collisions if not c.failing)


# ---------------------------------------------------------------- inputs
@dataclass(frozen=True)
class RenameTarget:
    """The module that makes a call, if a `name:` can rename it, and where it is written."""

    path: tuple[str, ...]
    module_class: str | None
    explicit: bool
    location: Location | None  # None: the input finds it later (Sites.describe)
    local: bool = True  # only this module's subtree changes (else: auto-names shift, or it has several paths)
    module: object = dataclasses.field(default=None, compare=False)  # what Sites.renamed() renames


class Sites:
    """One input's call sites as columns, which is all the grouping needs; a CallSite is built only
    for a reported site. Subclasses fill the columns and answer the per-site questions. The columns
    are NumPy arrays when `vectorised` (see SMALL_SITES), else lists of ints (keys: of tuples)."""

    source: str
    input_kind: str
    separator: bool
    prng_impl: str | None
    vectorised: bool
    unit: np.ndarray | list  # int32: dense id of (base, lane): sites of one unit fold into the same base key
    word: np.ndarray | list  # uint32 hash words
    path_id: np.ndarray | list  # int32 index into `paths`
    count: np.ndarray | list  # int64
    paths: list[tuple[str, ...]]
    keys: np.ndarray | list | None  # (n, width) uint32 key data, or None (hash-only)

    @property
    def n(self) -> int:
        return len(self.word)

    def items(self, i: int) -> tuple:
        """What Flax hashes for site i: the path since its base, then the count."""
        raise NotImplementedError

    def path_bytes(self, i: int, separator: bool | None = None) -> bytes:
        """The bytes Flax hashes for site i's path, before the count (with `separator`, default the
        input's)."""
        return hash_input(self.items(i)[:-1], self.separator if separator is None else separator)

    def paths_bytes(self, indices: Sequence[int]) -> list[bytes]:
        """path_bytes of each of `indices` (ints)."""
        return [self.path_bytes(i) for i in indices]

    def stream(self, i: int) -> str:
        raise NotImplementedError

    def base_of(self, i: int):
        """The (hashable) base key reference site i folds into."""
        raise NotImplementedError

    def describe(self, indices: Sequence[int], module_paths: Sequence[tuple[str, ...]]
                 ) -> tuple[dict[int, CallSite], dict[tuple[str, ...], Location]]:
        """CallSites for `indices`, and where the modules at `module_paths` are written."""
        raise NotImplementedError

    def rename_target(self, i: int) -> RenameTarget | None:
        raise NotImplementedError

    def keys_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool
                 ) -> np.ndarray | list | None:
        """Key data sites `indices` would get if they hashed `items` with `separator` (in the form of
        `keys`); None if hash-only."""
        return None

    @property
    def keys_checked(self) -> bool:
        """Whether sites are grouped by key (else by base and hash word: class 4 unchecked)."""
        return self.keys is not None

    def idents(self):
        """One sortable value per site, equal exactly where the keys are equal (hash-only: where the
        unit and the hash word are)."""
        if self.keys is not None:
            return _key_idents(self.keys, self.vectorised)
        return _word_idents(self.unit, self.word, self.vectorised)

    def idents_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool):
        """The idents sites `indices` would have if they hashed `items` with `separator`, comparable
        with idents(); None where the keys cannot be recomputed."""
        if self.keys is not None:
            keys = self.keys_for(indices, items, separator)
            return None if keys is None else _key_idents(keys, self.vectorised)
        return _word_idents([self.unit[i] for i in indices], _words(items, separator), self.vectorised)

    def entry_columns(self):
        """The distinct (unit, path) of the sites, for the latent audit: (sorted unit << 32 | path id,
        its first site, its highest count); None to have them found from the columns."""
        return None

    @property
    def replayable(self) -> bool:
        """Whether renames are checked by running the renamed model again (exact, for small specs)."""
        return False

    def renamed(self, changes: Sequence[tuple[RenameTarget, str]]) -> "Sites | None":
        """The call sites of the input with these modules renamed; None when the renamed model fails."""
        return None


def _words(items: Sequence[tuple], separator: bool) -> list[int]:
    """hash_word(hash_input(it, separator)) for each of `items`, the bytes of a path hashed once for
    all its counts."""
    from hashlib import sha1

    pre: dict[tuple, bytes] = {}
    out = []
    for it in items:
        path = it[:-1]
        head = pre.get(path)
        if head is None:
            head = pre[path] = hash_input(path, separator)
        out.append(int.from_bytes(sha1(head + count_bytes(it[-1], separator)).digest()[:4], "big"))
    return out


def _key_idents(keys, vectorised: bool):
    """One comparable, sortable value per key: its raw bytes (native uint32s, as NumPy sorts them)."""
    if not vectorised:
        return [b"".join(w.to_bytes(4, _BYTEORDER) for w in k) for k in keys]
    import numpy as np

    k = np.ascontiguousarray(keys, dtype=np.uint32)
    if k.ndim == 2 and k.shape[1] == 2:
        # the 8 bytes read big-endian: integers sort (quickly) in the bytes' order, as the lists do
        return k.view(">u8").ravel().astype(np.uint64)
    return k.view(np.dtype((np.void, 4 * k.shape[1]))).ravel()


def _word_idents(unit, words, vectorised: bool):
    """One comparable, sortable value per (unit, hash word)."""
    if not vectorised:
        return [(u << 32) | w for u, w in zip(unit, words)]
    import numpy as np

    return (np.asarray(unit, dtype=np.uint64) << np.uint64(32)) | np.asarray(words, dtype=np.uint64)


def _hashable(ident, vectorised: bool):
    """An ident as a dict key: the same value for the same key, in both column forms' own terms."""
    return ident.tobytes() if vectorised else ident


def count_bytes(count: int, separator: bool) -> bytes:
    return (b"\x00" if separator else b"") + encode_item(count)


def smallest_counts(rest: bytes, separator: bool) -> tuple[int, int] | None:
    """For paths whose hashed bytes are P and P + rest: the smallest counts (c_short, c_long) with
    P + C(c_short) == P + rest + C(c_long), where C is the count's encoding; None if there are none."""
    # enc(c) is minimal big-endian: it never starts with a zero byte, and c >= 1
    if separator:
        if len(rest) < 2 or rest[0] != 0 or rest[1] == 0:
            return None
        return int.from_bytes(rest[1:] + b"\x00\x01", "big"), 1
    if not rest or rest[0] == 0:
        return None
    return int.from_bytes(rest + b"\x01", "big"), 1


def _max_rest(bound: int) -> int:
    """The longest `rest` whose smallest colliding count can be <= bound."""
    return max(0, (bound.bit_length() + 7) // 8 - 1)


# ---------------------------------------------------------------- the audit
@paused
def audit(sites: Sites, latent_max_count: int = DEFAULT_LATENT_MAX_COUNT) -> Audit:
    """Every group of distinct call sites with one key, and every latent pair of paths."""
    ctx = _Context(sites, latent_max_count)
    pending = ctx.collisions()
    latent = ctx.latent() if latent_max_count > 0 else []
    ctx.describe(pending + latent)
    return Audit(
        source=sites.source, input_kind=sites.input_kind, call_sites=sites.n,
        fix_rng_separator=sites.separator, prng_impl=sites.prng_impl,
        keys_checked=sites.keys_checked, latent_max_count=latent_max_count,
        collisions=tuple(f.build(ctx) for f in pending),
        latent=tuple(f.build(ctx) for f in latent),
    )


class _Entry(NamedTuple):
    """A distinct (unit, path) of the input: its hashed path bytes and the counts it reaches."""

    unit: int
    path_id: int
    first: int  # its first call site
    max_count: int
    data: bytes  # the hash input of the path alone (without the count)


class _Entries:
    """Every distinct (unit, path), in arrays (or lists, as the sites' columns), with a per-unit index from
    hashed path bytes."""

    def __init__(self, sites: Sites):
        # combo: sorted distinct (unit << 32 | path id); first: its first call site; top: its highest count
        given = sites.entry_columns()
        if given is not None:
            self.combo, first, self.top = given
            combos = self.combo.tolist()
        elif sites.vectorised:
            import numpy as np

            combo = (sites.unit.astype(np.int64) << 32) | sites.path_id.astype(np.int64)
            self.combo, first, inverse = np.unique(combo, return_index=True, return_inverse=True)
            self.top = np.zeros(len(self.combo), dtype=np.int64)
            np.maximum.at(self.top, inverse.ravel(), sites.count)
            combos = self.combo.tolist()
        else:
            firsts: dict[int, int] = {}
            tops: dict[int, int] = {}
            for i, (u, p, c) in enumerate(zip(sites.unit, sites.path_id, sites.count)):
                k = (u << 32) | p
                if k in firsts:
                    if c > tops[k]:
                        tops[k] = c
                else:
                    firsts[k] = i
                    tops[k] = c
            self.combo = combos = sorted(firsts)
            first = [firsts[k] for k in combos]
            self.top = [tops[k] for k in combos]
        # Python lists from here on (the audit reads them one entry at a time), but for the units below
        self.first = first.tolist() if hasattr(first, "tolist") else list(first)
        self.top = self.top.tolist() if hasattr(self.top, "tolist") else list(self.top)
        self.data = sites.paths_bytes(self.first)
        # the entries of one unit are consecutive (combo is sorted): (unit, start, stop) per unit
        if hasattr(self.combo, "dtype"):
            import numpy as np

            units = self.combo >> 32
            starts = [0] + (np.flatnonzero(units[1:] != units[:-1]) + 1).tolist() if len(units) else []
            self.units = [(combos[a] >> 32, a, b) for a, b in zip(starts, starts[1:] + [len(combos)])]
        else:
            self.units = []
            start = 0
            for k in range(1, len(combos) + 1):
                if k == len(combos) or combos[k] >> 32 != combos[start] >> 32:
                    self.units.append((combos[start] >> 32, start, k))
                    start = k
        self.combo = combos
        self.by_data: dict[int, dict[bytes, int]] = {}
        self.more: dict[tuple[int, bytes], list[int]] = {}  # further paths with the same bytes (rare)
        for u, a, b in self.units:
            table = self.by_data[u] = dict(zip(reversed(self.data[a:b]), range(b - 1, a - 1, -1)))  # the first wins
            if len(table) != b - a:
                for k in range(a, b):
                    if table[self.data[k]] != k:
                        self.more.setdefault((u, self.data[k]), []).append(k)
        self._sorted: dict[int, list[bytes]] = {}

    def entry(self, k: int) -> _Entry:
        c = self.combo[k]
        return _Entry(c >> 32, c & 0xFFFFFFFF, self.first[k], self.top[k], self.data[k])

    def of(self, unit: int, path_id: int) -> int:
        return bisect.bisect_left(self.combo, (unit << 32) | path_id)

    def ids(self, unit: int, data: bytes) -> list[int]:
        k = self.by_data.get(unit, {}).get(data)
        if k is None:
            return []
        return [k] + self.more.get((unit, data), [])

    def sorted_data(self, unit: int) -> list[bytes]:
        if unit not in self._sorted:
            self._sorted[unit] = sorted(self.by_data.get(unit, {}))
        return self._sorted[unit]


class _Context:
    """One audit: the call sites sorted by key (or by base and word), the distinct paths for latent
    pairs, and the checks of each fix."""

    def __init__(self, sites: Sites, latent_max_count: int):
        self.s = sites
        self.sep = sites.separator
        self.bound = latent_max_count
        self.rest = _max_rest(latent_max_count)
        self.vec = sites.vectorised
        self.ident = sites.idents()
        if self.vec:
            import numpy as np

            # (no stable sort needed: a run of equal idents is used as a set, sorted when reported)
            if self.ident.dtype == np.uint64:
                # a sort of the values is a third of an argsort: the few repeated ones are found after
                self.order = None
                self.sorted_ident = np.sort(self.ident)
            else:
                self.order = np.argsort(self.ident)
                self.sorted_ident = self.ident[self.order]
        else:
            self.order = sorted(range(len(self.ident)), key=self.ident.__getitem__)
            self.sorted_ident = [self.ident[i] for i in self.order]
        self._entries: _Entries | None = None
        self._pairs: dict[bytes, tuple[int, int] | None] = {}
        self._paths_sorted: list[int] | None = None
        self._by_path: dict[int, list[int]] | tuple[np.ndarray, np.ndarray] | None = None
        self._sites: dict[int, CallSite] = {}
        self._wanted: set[int] = set()
        self._base: tuple[list[int], set] | None = None
        self._targets: dict[int, RenameTarget | None] = {}

    # ------------------------------------------------------------ call sites
    def want(self, indices) -> list[int]:
        out = [int(i) for i in indices]
        self._wanted.update(out)
        return out

    def describe(self, pending: list) -> None:
        """Build the reported CallSites, and locate renamed modules the input did not locate yet, in one go."""
        unplaced = sorted({r.path for f in pending for r in f.renames if r.location is None})
        sites, where = self.s.describe(sorted(self._wanted), unplaced)
        self._sites = sites
        for f in pending:
            f.renames = [dataclasses.replace(r, location=where.get(r.path)) if r.location is None else r
                         for r in f.renames]

    def site(self, i: int) -> CallSite:
        return self._sites[i]

    def target(self, i: int) -> RenameTarget | None:
        """The module whose `name:` renames site i (None: none can), asked once per site."""
        if i not in self._targets:
            self._targets[i] = self.s.rename_target(i)
        return self._targets[i]

    def items(self, i: int) -> tuple:
        return self.s.items(i)

    def pair(self, rest: bytes) -> tuple[int, int] | None:
        """smallest_counts, cached (a tail is one or two bytes), and None beyond the bound."""
        if rest not in self._pairs:
            p = smallest_counts(rest, self.sep)
            self._pairs[rest] = p if p is not None and p[0] <= self.bound else None
        return self._pairs[rest]

    # ------------------------------------------------------------ actual collisions
    def _runs(self) -> list:
        """The groups of call sites with one key (or one base and word), found on the sorted idents."""
        si = self.sorted_ident
        if self.vec:
            import numpy as np

            same = si[1:] == si[:-1]
            if self.order is None:
                repeated = si[1:][same]
                at = np.flatnonzero(np.isin(self.ident, repeated))
                at = at[np.argsort(self.ident[at], kind="stable")]
                cuts = np.flatnonzero(self.ident[at][1:] != self.ident[at][:-1]) + 1
                return np.split(at, cuts) if len(at) else []
            edges = np.diff(np.concatenate(([0], same.astype(np.int8), [0])))
            starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            return [self.order[a:b + 1] for a, b in zip(starts, stops)]
        runs = []
        start = 0
        for b in range(1, len(si) + 1):
            if b == len(si) or si[b] != si[start]:
                if b - start > 1:
                    runs.append(self.order[start:b])
                start = b
        return runs

    def _hashable(self, idents) -> list:
        return [_hashable(x, self.vec) for x in idents]

    def collisions(self) -> list:
        found = []
        shared: dict[frozenset, list[tuple[list[int], dict]]] = {}
        for run in self._runs():
            group = sorted(int(i) for i in run)
            by_unit: dict[int, list[int]] = {}
            for i in group:
                by_unit.setdefault(int(self.s.unit[i]), []).append(i)
            for members in by_unit.values():
                if len(members) > 1:
                    found.append(self._hash_collision(members))
            if len(by_unit) > 1:
                # one finding per set of bases (or lanes) that share keys, however many keys they share
                shared.setdefault(frozenset(by_unit), []).append((group, by_unit))
        found.extend(self._shared_key(groups) for groups in shared.values())
        found.sort(key=lambda f: (f.first, f.collision_class))
        return found

    def _by_bytes(self, members: list[int]) -> list[list[int]]:
        groups: dict[bytes, list[int]] = {}
        for i in members:
            groups.setdefault(hash_input(self.items(i), self.sep), []).append(i)
        return list(groups.values())

    def _hash_collision(self, members: list[int]) -> "_Pending":
        inputs = self._by_bytes(members)
        if len(inputs) > 1:
            klass = HASH_WORD
        else:
            counts = {count_bytes(self.items(i)[-1], self.sep) for i in members}
            klass = COUNT_MEETS_NAME if len(counts) > 1 else CONCATENATION
        renames, note = self._renames_for(members)
        return _Pending(members, inputs, klass, CATEGORIES[klass], True, self._separator(members),
                        renames, note, self.want(members))

    def _lanes_only(self, group: list[int], by_unit: dict[int, list[int]]) -> bool:
        # The lanes of one call (one base key, one stream, the same path and count) sharing a key is what
        # split_rngs=False asks for; keys shared across base keys or streams are a shared seed.
        calls = {frozenset((int(self.s.path_id[i]), int(self.s.count[i])) for i in m) for m in by_unit.values()}
        return (len({self.s.base_of(i) for i in group}) == 1 and len({self.s.stream(i) for i in group}) == 1
                and len(calls) == 1)

    def _shared_key(self, groups: list[tuple[list[int], dict]]) -> "_Pending":
        lanes_only = all(self._lanes_only(g, by_unit) for g, by_unit in groups)
        members = sorted(i for g, _ in groups for i in g)
        inputs = [part for g, _ in groups for part in self._by_bytes(g)]
        if lanes_only:
            note = ("every lane of a transform gets the same key for this stream (split_rngs is false for it); "
                    "split the stream if the lanes should differ")
        else:
            note = ("no rename helps: the stream name is not hashed, so streams (or bases) seeded with the same "
                    "key hand out the same keys; pass each stream its own key, e.g. split(key(0), 2)[0] and [1]")
        return _Pending(members, inputs, SHARED_KEY, UNSPLIT_LANES if lanes_only else SHARED_SEED,
                        not lanes_only, self._separator(members), [], note, self.want(members))

    # ------------------------------------------------------------ the separator flag
    def _idents_for(self, indices: list[int], items: list[tuple], separator: bool):
        idents = self.s.idents_for(indices, items, separator)
        if idents is None:
            raise _Unknown()
        return idents

    def _separator(self, members: list[int]) -> SeparatorCheck:
        n = self.s.n
        if self.sep:
            return SeparatorCheck(True, None, "fix_rng_separator is on already", n)
        try:
            idents = self._idents_for(members, [self.items(i) for i in members], True)
        except _Unknown:
            return SeparatorCheck(False, None, "the keys could not be recomputed with the separator", n)
        shared = sum(1 for c in Counter(self._hashable(idents)).values() if c > 1)
        if shared == 0:
            return SeparatorCheck(False, True, "with it every call site of this finding gets its own key", n)
        return SeparatorCheck(False, False, f"with it {shared} key{'s are' if shared > 1 else ' is'} still shared "
                              "by call sites of this finding", n)

    # ------------------------------------------------------------ latent collisions
    def entries(self) -> _Entries:
        if self._entries is None:
            self._entries = _Entries(self.s)
        return self._entries

    def latent_pairs(self) -> dict[int, dict[int, tuple[int, int]]]:
        """Short entry -> long entry -> smallest counts, for the paths of one unit whose hashed bytes
        differ by a tail that a count can spell, the counts needed within the bound and not met here."""
        es = self.entries()
        found: list[tuple[int, int, tuple[int, int]]] = []
        top = es.top
        data = es.data
        for unit, a, b in es.units:
            table = es.by_data[unit]
            for cut in range(1, self.rest + 1):
                # the entries whose bytes, but for a tail of `cut`, are another path's (a set lookup each)
                hits = [k for k, d in zip(range(a, b), data[a:b]) if len(d) >= cut and d[:-cut] in table]
                for k in hits:
                    pair = self.pair(data[k][-cut:])
                    if pair is None:
                        continue
                    for short in es.ids(unit, data[k][:-cut]):
                        if top[short] < pair[0]:  # else the counts meet: an actual collision, reported as such
                            found.append((k, short, pair))
        out: dict[int, dict[int, tuple[int, int]]] = {}
        for k, short, pair in sorted(found, key=lambda f: f[0]):  # (longs in entry order, as they were found)
            out.setdefault(short, {})[k] = pair
        return out

    def _first_pairs(self) -> set[tuple[int, int]]:
        """The latent pairs as (first call site of the short path, first call site of the long one)."""
        first = self.entries().first
        return {(int(first[a]), int(first[b])) for a, longs in self.latent_pairs().items() for b in longs}

    def latent(self) -> list:
        es = self.entries()
        groups: dict[tuple, dict] = {}
        for short, longs in self.latent_pairs().items():
            e = es.entry(short)
            g = groups.setdefault((self.s.stream(e.first), self.s.paths[e.path_id]), {"entry": e, "partners": {}})
            for k, pair in longs.items():
                long = es.entry(k)
                g["partners"].setdefault(self.s.paths[long.path_id], (long, pair))
        found = []
        for g in groups.values():
            partners = sorted(g["partners"].values(), key=lambda p: p[0].first)
            found.append(self._latent_one(g["entry"], partners))
        found.sort(key=lambda f: f.first)
        return found

    def _latent_one(self, e: _Entry, partners: list) -> "_PendingLatent":
        flipped = not self.sep
        a = self.s.path_bytes(e.first, flipped)
        rows = []
        removes = True
        for other, pair in partners:
            b = self.s.path_bytes(other.first, flipped)
            if a == b:
                sep_pair = (1, 1)
            elif b.startswith(a):
                sep_pair = smallest_counts(b[len(a):], flipped)
            elif a.startswith(b):  # with the flag flipped the other path may be the short one
                back = smallest_counts(a[len(b):], flipped)
                sep_pair = back[::-1] if back else None
            else:
                sep_pair = None
            removes = removes and sep_pair is None
            rows.append((other, pair, e.data + count_bytes(pair[0], self.sep), sep_pair))
        n = self.s.n
        if self.sep:
            check = SeparatorCheck(True, None, "fix_rng_separator is on already", n)
        elif removes:
            check = SeparatorCheck(False, True, "with it these paths never hash the same bytes, whatever the counts",
                                   n)
        else:
            check = SeparatorCheck(False, False, "with it some of these paths still hash the same bytes for some "
                                   "counts", n)
        renames, note = self._latent_renames(e, [o for o, _ in partners])
        self.want([e.first] + [o.first for o, _ in partners])
        return _PendingLatent(e, rows, check, renames, note)

    def _relations(self, unit: int, data: bytes, max_count: int, skip: set, extra: dict) -> set:
        """The latent relations between a path of `unit` with hashed bytes `data` that reaches `max_count`
        and the other paths of `unit` (those in `skip` left out; `extra`: further paths, bytes ->
        [(path id, max count)]), as {(other path id, whether this path is the short one)}."""
        es = self.entries()

        def others(b: bytes):
            for k in es.ids(unit, b):
                pid = int(es.combo[k]) & 0xFFFFFFFF
                if pid not in skip:
                    yield pid, int(es.top[k])
            yield from extra.get(b, ())

        out = set()
        for cut in range(1, min(self.rest, len(data)) + 1):
            pair = self.pair(data[-cut:])
            if pair is not None:
                out.update((pid, False) for pid, top in others(data[:-cut]) if top < pair[0])
        longer = {b for b in extra if b.startswith(data) and 0 < len(b) - len(data) <= self.rest}
        if self.rest == 1:  # 255 lookups beat a scan of everything whose bytes start with these
            table = es.by_data.get(unit, {})
            longer.update(b for b in (data + bytes([x]) for x in range(1, 256)) if b in table)
        elif self.rest > 1:
            ordered = es.sorted_data(unit)
            j = bisect.bisect_right(ordered, data)
            while j < len(ordered) and ordered[j].startswith(data):
                if len(ordered[j]) - len(data) <= self.rest:
                    longer.add(ordered[j])
                j += 1
        for b in longer:
            pair = self.pair(b[len(data):])
            if pair is not None and max_count < pair[0]:
                out.update((pid, True) for pid, _ in others(b))
        return out

    # ------------------------------------------------------------ renames
    def _sorted_paths(self) -> list[int]:
        """Path ids in the order of their paths (ids, not (path, id) pairs: a million paths)."""
        if self._paths_sorted is None:
            paths = self.s.paths
            self._paths_sorted = sorted(range(len(paths)), key=paths.__getitem__)
        return self._paths_sorted

    def paths_under(self, prefix: tuple[str, ...]) -> list[int]:
        """Path ids of `prefix` and everything below it."""
        ps, paths, n = self._sorted_paths(), self.s.paths, len(prefix)
        j = bisect.bisect_left(ps, prefix, key=paths.__getitem__)
        out = []
        while j < len(ps) and paths[ps[j]][:n] == prefix:
            out.append(ps[j])
            j += 1
        return out

    def _name_taken(self, path: tuple[str, ...]) -> bool:
        ps, paths = self._sorted_paths(), self.s.paths
        j = bisect.bisect_left(ps, path, key=paths.__getitem__)
        return j < len(ps) and paths[ps[j]][:len(path)] == path

    def sites_of_paths(self, pids: list[int]):
        """The call sites of the paths `pids`, in order."""
        if not self.vec:
            if self._by_path is None:
                self._by_path = {}
                for i, p in enumerate(self.s.path_id):
                    self._by_path.setdefault(p, []).append(i)
            return sorted(i for p in pids for i in self._by_path.get(p, ()))
        import numpy as np

        if self._by_path is None:
            order = np.argsort(self.s.path_id, kind="stable")
            starts = np.zeros(len(self.s.paths) + 1, dtype=np.int64)
            np.cumsum(np.bincount(self.s.path_id, minlength=len(self.s.paths)), out=starts[1:])
            self._by_path = (order, starts)
        order, starts = self._by_path
        parts = [order[starts[p]:starts[p + 1]] for p in pids]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def _try(self, target: RenameTarget, new_name: str, state: "_Overlay"):
        """What renaming the module at target.path to `new_name` changes, if that creates no collision
        and no latent pair (and ends the relations `state.forbid` names); else None."""
        m = target.path
        if not target.local or self._name_taken(m[:-1] + (new_name,)):
            return None
        affected = [int(i) for i in self.sites_of_paths(self.paths_under(m))]
        moved = [i for i in affected if i not in state.moved]
        if not moved:
            return None
        change_idx, change_items = [], []
        for i in moved:
            items = self.items(i)
            path = self.s.paths[self.s.path_id[i]]
            j = len(m) - 1 - (len(path) - (len(items) - 1))
            if j < 0:
                continue  # the renamed module is above this site's base: that base key changes
            change_idx.append(i)
            change_items.append(items[:j] + (new_name,) + items[j + 1:])
        try:
            idents = self._idents_for(change_idx, change_items, self.sep) if change_idx else None
        except _Unknown:
            return None
        gone = state.moved | set(moved)
        hashed = None
        if idents is not None:
            hashed = self._hashable(idents)
            if len(set(hashed)) != len(hashed):
                return None
            for x, (a, b) in zip(idents, self._equal_ranges(idents)):
                if b > a and any(i not in gone for i in self._holders(x, a, b)):
                    return None
            if any(x in state.idents for x in hashed):
                return None
        # latent pairs: the relations of each renamed path with everyone else, before and after
        es = self.entries()
        new_entries: dict[tuple[int, int], tuple[bytes, int]] = {}
        for i, items in zip(change_idx, change_items):
            key = (int(self.s.unit[i]), int(self.s.path_id[i]))
            if key not in new_entries:
                new_entries[key] = (hash_input(items[:-1], self.sep), int(es.top[es.of(*key)]))
        moved_pids = {pid for _, pid in new_entries} | state.moved_pids
        everything = list(new_entries.items()) + list(state.entries.items())
        for (unit, pid), (data, top) in new_entries.items():
            extra: dict[bytes, list] = {}
            for (u2, p2), (d2, t2) in everything:
                if u2 == unit and p2 != pid:
                    extra.setdefault(d2, []).append((p2, t2))
            after = self._relations(unit, data, top, moved_pids, extra)
            if after - self._relations(unit, es.data[es.of(unit, pid)], top, set(), {}):
                return None
            if after & state.forbid.get((unit, pid), set()):
                return None
        return moved, (dict(zip(change_idx, hashed)) if hashed is not None else {}), new_entries

    def _holders(self, ident, a: int, b: int) -> list[int]:
        """The sites whose ident is `ident`, found at sorted_ident[a:b]."""
        if self.order is None:
            import numpy as np

            return np.flatnonzero(self.ident == ident).tolist()
        return [int(self.order[p]) for p in range(a, b)]

    def _equal_ranges(self, idents) -> list[tuple[int, int]]:
        """For each ident, the range of sorted_ident that equals it."""
        si = self.sorted_ident
        if self.vec:
            import numpy as np

            return list(zip(np.searchsorted(si, idents, "left"), np.searchsorted(si, idents, "right")))
        return [(bisect.bisect_left(si, x), bisect.bisect_right(si, x)) for x in idents]

    def _rename(self, i: int, state: "_Overlay") -> Rename | None:
        target = self.target(i)
        if target is None or not target.path:
            return None
        # A renamed module's keys are fresh draws: about keys * n / 2**32 of them meet another key (the
        # birthday bound). Past a few, every try fails, each at the cost of re-deriving them all.
        keys_changed = len(self.sites_of_paths(self.paths_under(target.path)))
        if keys_changed * self.s.n > RENAME_MAX_EXPECTED * 2**32:
            return None
        for k in range(1, min(RENAME_TRIES, max(1, RENAME_BUDGET // max(keys_changed, 1))) + 1):
            name = f"{target.path[-1]}_{k}"
            result = self._try(target, name, state)
            if result is None:
                continue
            moved, idents, new_entries = result
            state.moved.update(moved)
            state.idents.update({v: k for k, v in idents.items()})
            state.current.update(idents)
            state.entries.update(new_entries)
            state.moved_pids.update(pid for _, pid in new_entries)
            return Rename(target.path, name, target.module_class, target.explicit, target.location,
                          keys_changed)
        return None

    def _still_colliding(self, members: list[int], state: "_Overlay") -> list[int]:
        now = {}
        for i in members:
            if i in state.moved:
                now[i] = state.current.get(i)  # None: on a new base key
            else:
                now[i] = _hashable(self.ident[i], self.vec)
        seen: dict = {}
        for v in now.values():
            if v is not None:
                seen[v] = seen.get(v, 0) + 1
        return [i for i in members if now[i] is not None and seen[now[i]] > 1]

    def _cost(self, i: int):
        """Which site to rename first: one whose rename changes the fewest keys; among equals, the later."""
        t = self.target(i)
        if t is None or not t.path:
            return (1, 0, 0)
        return (0 if t.local else 1, len(self.sites_of_paths(self.paths_under(t.path))), -i)

    def _renames_for(self, members: list[int]) -> tuple[list[Rename], str]:
        """Greedy: rename the module of one colliding site at a time until no two sites of the group
        share a key; each rename is checked to create no collision and no latent pair."""
        if self.s.replayable:
            return self._replayed_renames(members, set())
        state = _Overlay()
        renames: list[Rename] = []
        colliding = list(members)
        while len(colliding) > 1:
            for i in sorted(colliding, key=self._cost):
                r = self._rename(i, state)
                if r is not None:
                    renames.append(r)
                    break
            else:
                return self._no_rename(renames)
            colliding = self._still_colliding(members, state)
        return renames, ("verified: afterwards no two of these call sites share a key, and no new collision "
                         "or latent pair appears")

    @staticmethod
    def _no_rename(renames: list[Rename]) -> tuple[list[Rename], str]:
        if renames:
            return renames, ("these renames are verified, but no verified rename was found for the call sites "
                             "that still share a key")
        return [], ("no verified rename was found: the modules are the root, repeated or named by a layer, or "
                    "every rename tried keeps this finding or makes another (a module with so many keys that "
                    "its renamed keys would meet others by chance, keys x call sites / 2**32 > 3, is not tried)")

    def _latent_renames(self, e: _Entry, partners: list[_Entry]) -> tuple[list[Rename], str]:
        ok = ("afterwards these paths pair with no other path for counts up to the bound, and no collision "
              "appears")
        if self.s.replayable:
            pairs = {(e.first, p.first) for p in partners}
            # renaming the short path ends all its pairs; renaming a long one ends one pair
            renames, note = self._replayed_renames([e.first] + ([partners[0].first] if len(partners) == 1 else []),
                                                   pairs)
            return (renames, "verified by running the renamed model again: " + ok) if renames else (renames, note)
        ok = "verified: " + ok
        pids = {p.path_id for p in partners} | {e.path_id}
        # renaming the short path ends all its pairs; renaming a long one ends one pair
        for i in sorted([e.first] + ([partners[0].first] if len(partners) == 1 else []), key=self._cost):
            target = self.target(i)
            if target is None or not target.path:
                continue
            state = _Overlay()
            # the rename must end this finding's pairs too
            ends = {(b, short) for b in pids for short in (True, False)}
            state.forbid = {(e.unit, a): ends for a in pids}
            r = self._rename(i, state)
            if r is not None:
                return [r], ok
        return self._no_rename([])

    # ------------------------------------------------------------ renames, checked by running the model again
    def _baseline(self) -> tuple[list[int], set]:
        """Per site, the id of the group of sites sharing its key (-1: none); and the latent pairs."""
        if self._base is None:
            groups = [-1] * self.s.n
            for g, members in enumerate(self._runs()):
                for i in members:
                    groups[i] = g
            self._base = (groups, self._first_pairs() if self.bound > 0 else set())
        return self._base

    def _check_replayed(self, changes, ending: set) -> "_Context | None":
        """The audit of the renamed model, if it shares no key and has no latent pair that the original
        does not (and none of `ending`)."""
        sites = self.s.renamed(changes)
        if sites is None or sites.n != self.s.n:
            return None
        new = _Context(sites, self.bound)
        groups, latent = self._baseline()
        for run in new._runs():
            g = groups[run[0]]
            if g < 0 or any(groups[i] != g for i in run):
                return None
        pairs = new._first_pairs() if self.bound > 0 else set()
        if not pairs <= latent or pairs & ending:
            return None
        return new

    def _replayed_renames(self, members: list[int], ending: set) -> tuple[list[Rename], str]:
        """The greedy of _renames_for, each step checked on the renamed model run again: exact, including
        Flax's auto-naming (naming a module explicitly shifts the auto-names of its later siblings)."""
        changes: list[tuple[RenameTarget, str]] = []
        renames: list[Rename] = []
        now = self
        while True:
            colliding = now._colliding(members)
            if len(colliding) < 2 and not ending:
                break
            step = None
            for i in sorted(colliding or members, key=self._cost):
                target = self.target(i)
                if target is None or not target.path or any(t.module is target.module for t, _ in changes):
                    continue
                for k in range(1, REPLAY_TRIES + 1):
                    name = f"{target.path[-1]}_{k}"
                    if self._name_taken(target.path[:-1] + (name,)):
                        continue
                    new = self._check_replayed(changes + [(target, name)], ending)
                    if new is None:
                        continue
                    if not ending and len(new._colliding(members)) >= len(colliding):
                        continue  # no progress
                    step = (target, name, new)
                    break
                if step is not None:
                    break
            if step is None:
                return self._no_rename(renames)
            target, name, new = step
            changes.append((target, name))
            renames.append(self._describe_rename(target, name, now, new))
            now = new
            if ending:
                break
        return renames, ("verified by running the renamed model again: afterwards no two of these call sites "
                         "share a key, and no new collision or latent pair appears")

    def _colliding(self, members: list[int]) -> list[int]:
        """The members that share their key with another member."""
        hashed = self._hashable(self.ident[i] for i in members)
        counts = Counter(hashed)
        return [m for m, h in zip(members, hashed) if counts[h] > 1]

    def _describe_rename(self, target: RenameTarget, name: str, before: "_Context", after: "_Context") -> Rename:
        if self.vec:
            changed = int((before.ident != after.ident).sum())
        else:
            changed = sum(1 for a, b in zip(before.ident, after.ident) if a != b)
        shifted: dict[str, str] = {}
        m = target.path
        for i in range(before.s.n):
            old = before.s.paths[before.s.path_id[i]]
            new = after.s.paths[after.s.path_id[i]]
            if old != new and old[:len(m)] != m:
                d = next(d for d in range(min(len(old), len(new))) if old[d] != new[d])
                shifted.setdefault("/".join(old[:d + 1]), "/".join(new[:d + 1]))
        note = ""
        if shifted:
            shown = ", ".join(f"{a} -> {b}" for a, b in sorted(shifted.items())[:3])
            more = f" and {len(shifted) - 3} more" if len(shifted) > 3 else ""
            note = (f"Flax's auto-naming then also renames {len(shifted)} later module"
                    f"{'s' if len(shifted) != 1 else ''}: {shown}{more}")
        return Rename(target.path, name, target.module_class, target.explicit, target.location, changed, note)


class _Unknown(Exception):
    """Key data that cannot be recomputed."""


@dataclass
class _Overlay:
    """Renames accepted so far while fixing one finding."""

    moved: set = dataclasses.field(default_factory=set)  # site indices whose key changed
    idents: dict = dataclasses.field(default_factory=dict)  # new ident bytes -> site
    current: dict = dataclasses.field(default_factory=dict)  # site -> new ident
    entries: dict = dataclasses.field(default_factory=dict)  # (unit, path id) -> (new bytes, max count)
    moved_pids: set = dataclasses.field(default_factory=set)
    forbid: dict = dataclasses.field(default_factory=dict)  # (unit, path id) -> relations that must end


@dataclass
class _Pending:
    """A collision found, built into a Collision once its call sites are described."""

    members: list[int]
    inputs: list[list[int]]
    collision_class: int
    category: str
    failing: bool
    separator: SeparatorCheck
    renames: list[Rename]
    rename_note: str
    wanted: list[int]

    @property
    def first(self) -> int:
        return min(self.members)

    def build(self, ctx: _Context) -> Collision:
        inputs = []
        for group in sorted(self.inputs, key=min):
            sites = tuple(ctx.site(i) for i in sorted(group))
            inputs.append(HashInput(sites[0].hash_input, sites[0].hash_word, sites[0].key, sites))
        return Collision(self.collision_class, self.category, self.failing, tuple(inputs), self.separator,
                         tuple(self.renames), self.rename_note)


@dataclass
class _PendingLatent:
    """A latent collision found, built into a LatentCollision once its call sites are described."""

    entry: _Entry
    rows: list
    separator: SeparatorCheck
    renames: list[Rename]
    rename_note: str

    @property
    def first(self) -> int:
        return self.entry.first

    def build(self, ctx: _Context) -> LatentCollision:
        partners = tuple(_frozen(LatentPartner, ctx.site(o.first), o.max_count, pair, data, sep_pair)
                         for o, pair, data, sep_pair in self.rows)
        return LatentCollision(ctx.site(self.entry.first), self.entry.max_count, partners, self.separator,
                               tuple(self.renames), self.rename_note)


# ---------------------------------------------------------------- a spec as call sites
class SpecSites(Sites):
    """A replayed spec: one call site per Derivation whose key Flax uses. Keys of threefry2x32 and rbg are
    exact Threefry: on Python ints for small specs, else NumPy (rngaudit.engine.keys);
    unsafe_rbg needs JAX."""

    def __init__(self, spec: Spec, keys: bool = True, rows=None, key_cache: dict | None = None):
        from ..engine.replay import replay

        self.spec = spec
        # fold_in results on Python ints, shared with this spec's renamed copies (derive_keys_exact)
        self.key_cache = {} if key_cache is None else key_cache
        self.all_rows = replay(spec) if rows is None else rows
        # keys of a trace Flax throws away (scan's constancy check) share no randomness with anything
        keep = [p for p, d in enumerate(self.all_rows) if not getattr(d, "discarded", False)]
        self.rows = self.all_rows if len(keep) == len(self.all_rows) else [self.all_rows[p] for p in keep]
        self.source = spec.file
        self.input_kind = "spec"
        self.separator = spec.fix_rng_separator
        self.prng_impl = spec.prng_impl
        n = len(self.rows)
        self.vectorised = vectorised(n)
        units: dict = {}
        path_ids: dict = {}
        if self.vectorised:
            import numpy as np

            self.keep = np.asarray(keep, dtype=np.int64)
            self.unit = np.empty(n, dtype=np.int32)
            self.path_id = np.empty(n, dtype=np.int32)
            self.count = np.empty(n, dtype=np.int64)
            self.word = np.empty(n, dtype=np.uint32)
        else:
            self.keep = keep
            self.unit, self.path_id, self.count, self.word = [0] * n, [0] * n, [0] * n, [0] * n
        unit, path_id, count, word = self.unit, self.path_id, self.count, self.word
        for i, d in enumerate(self.rows):
            # `base` is a hashable key reference; `lane` the vmap/scan/while lane (() outside transforms)
            unit[i] = units.setdefault((d.base, getattr(d, "lane", ())), len(units))
            path_id[i] = path_ids.setdefault(d.path, len(path_ids))
            count[i] = d.count
            word[i] = d.hash_word
        self.paths = list(path_ids)
        self.keys = self._take(self._derive(self.spec, self.all_rows), self.keep) if keys else None
        self._flipped_keys: np.ndarray | list | bool | None = None
        self._modules: dict[Location, list] | None = None

    def _derive(self, spec: Spec, rows):
        """Key data of `rows`: a (len(rows), width) uint32 array, or a list of tuples when not vectorised."""
        if not self.vectorised:
            from ..engine.keys import EXACT_IMPLS, derive_keys_exact

            if spec.prng_impl in EXACT_IMPLS:
                return derive_keys_exact(spec, rows, self.key_cache)
        from ..engine.keys import derive_keys

        keys = derive_keys(spec, rows)
        return keys if self.vectorised else [tuple(k) for k in keys.tolist()]

    def _take(self, keys, positions):
        """keys[positions], in the form of `keys`."""
        if self.vectorised:
            import numpy as np

            return keys[np.asarray(positions, dtype=np.int64)]
        return [keys[p] for p in positions]

    def items(self, i: int) -> tuple:
        return self.rows[i].hash_items

    def stream(self, i: int) -> str:
        return self.rows[i].stream

    def base_of(self, i: int):
        return self.rows[i].base

    def describe(self, indices, module_paths):
        out = {}
        for i in indices:
            d = self.rows[i]
            key = tuple(int(w) for w in self.keys[i]) if self.keys is not None else None
            out[i] = CallSite(d.index, d.path, d.stream_requested, d.stream, d.count, tuple(getattr(d, "lane", ())),
                              str(d.base), d.kind, d.label, d.hash_items, d.hash_input, d.hash_word, key,
                              d.location)
        return out, {}  # every rename target of a spec carries its location

    def keys_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool
                 ) -> np.ndarray | list | None:
        if self.keys is None:
            return None
        rows = [self.rows[i] for i in indices]
        contained = all(_without_fork(d.base) for d in rows)
        if separator != self.separator and not contained:
            # a jit fork's key is a make_rng key itself, hashed with the flag: replay the model flipped
            if any(tuple(it) != d.hash_items for it, d in zip(items, rows)):
                return None
            flipped = self._flipped()
            return None if flipped is None else self._take(flipped, indices)
        changed = []
        for d, it in zip(rows, items):
            data = hash_input(it, separator)
            changed.append(dataclasses.replace(d, hash_items=tuple(it), hash_input=data, hash_word=hash_word(data)))
        if contained:
            return self._derive(self.spec, changed)
        # a fork key is the key of an earlier row: derive the whole model with these rows changed
        full = list(self.all_rows)
        for i, d in zip(indices, changed):
            full[self.keep[i]] = d
        return self._take(self._derive(self.spec, full), [self.keep[i] for i in indices])

    def _flipped(self) -> np.ndarray | list | None:
        if self._flipped_keys is None:
            from ..engine.replay import replay

            spec = dataclasses.replace(self.spec, fix_rng_separator=not self.spec.fix_rng_separator)
            rows = replay(spec)
            self._flipped_keys = (self._take(self._derive(spec, rows), self.keep) if len(rows) == len(self.all_rows)
                                  else False)
        return None if self._flipped_keys is False else self._flipped_keys

    @property
    def replayable(self) -> bool:
        return self.n <= REPLAY_LIMIT

    def renamed(self, changes):
        from ..errors import RngauditError

        names = {id(t.module): name for t, name in changes}
        spec = dataclasses.replace(self.spec, model=_renamed_module(self.spec.model, names))
        try:
            return self._sites_of(spec)
        except RngauditError:
            return None  # e.g. Flax's NameInUseError, or a `call:` of the old name

    def _sites_of(self, spec: Spec) -> "SpecSites":
        """Call sites of a variant of this spec (a rename), on this input's path."""
        from ..engine.replay import replay

        return SpecSites(spec, keys=self.keys is not None, rows=replay(spec), key_cache=self.key_cache)

    def rename_target(self, i: int) -> RenameTarget | None:
        d = self.rows[i]
        return self._target_at(d.path, d.location)

    def _target_at(self, path: tuple[str, ...], location: Location) -> RenameTarget | None:
        """The module at `path` whose statement at `location` makes the key, if `name:` renames it."""
        if not path:
            return None
        name = path[-1]
        for m, renamable, single, where in self._module_index().get(location, ()):
            if m.name == name or (m.name is None and re.fullmatch(re.escape(m.cls) + r"_\d+", name)):
                if not renamable:
                    return None
                # an explicit name does not move Flax's auto-name cursor: naming an auto-named module
                # renames its later auto-named siblings too
                return RenameTarget(path, m.cls, m.name is not None, where, m.name is not None and single, m)
        return None

    def _module_index(self) -> dict[Location, list]:
        """statement location -> the modules whose statements hold it: (module, whether `name:` renames
        it, whether it is one instance at one path, where its `name:` goes)."""
        if self._modules is None:
            index: dict[Location, list] = {}
            # the root's name is not hashed
            stack: list[tuple] = [(self.spec.model, self.spec.model.setup + self.spec.model.body, False, True, None)]
            while stack:
                m, items, renamable, single, where = stack.pop()
                for item in items:
                    if isinstance(item, (MakeRng, Param, Variable)):
                        index.setdefault(item.loc, []).append((m, renamable, single, where))
                    elif isinstance(item, Child):
                        # `name:` on a repeated statement names every instance alike; a layer names its children
                        c = item.module
                        stack.append((c, c.setup + c.body, item.repeat == 1 and m.layer is None,
                                      single and item.repeat == 1, c.loc))
                    elif isinstance(item, Transform):
                        # a transformed module is named on the transform statement
                        c = item.target
                        stack.append((c, c.setup + c.body, item.repeat == 1, single and item.repeat == 1, item.loc))
                    elif isinstance(item, Define):
                        c = item.module
                        stack.append((c, c.setup + c.body, m.layer is None, single,
                                      item.loc if c.lifts else c.loc))
                    elif isinstance(item, Sequential):
                        # built in setup, its layers are named layers_0, layers_1, ... by Flax
                        stack.extend((c, c.setup + c.body, not item.in_setup, single, c.loc) for c in item.layers)
                    elif isinstance(item, Cond):
                        # every branch runs in this module; a child of a branch may share its path with
                        # one of another branch
                        stack.extend((m, branch, renamable, False, where) for branch in item.branches)
                    elif isinstance(item, WhileLoop):
                        stack.append((m, item.cond_items + item.body_items, renamable, single, where))
            self._modules = index
        return self._modules




class _Rows(Sequence):
    """A KeyTable's rows as Derivations, made when read (a million rows stay columns)."""

    def __init__(self, table, positions):
        self.table = table
        self.positions = positions  # None: every row

    def __len__(self) -> int:
        return self.table.n if self.positions is None else len(self.positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.table.derivation(int(i if self.positions is None else self.positions[i]))


class TableSites(SpecSites):
    """A large replayed spec on derive's fast path (rngaudit.fast): the same columns SpecSites makes
    from one Derivation per call, computed with NumPy per lane entry (one template in one lane) and
    spread over the rows.

    Keys of threefry2x32 and rbg are not computed row by row: fold_in(k, .) is a bijection of the
    32-bit word for each key k (one Threefry block cipher, per half for rbg), so two rows of one base
    key share a key exactly when they share a hash word. A site's ident is (id of its base key's
    value, word); the key itself is computed for reported sites only. (Keys of different base key
    values meet only by a Threefry coincidence, about n*n/2**65 for n rows, which is not searched
    for.) unsafe_rbg keys are computed for every row."""

    BIJECTIVE = ("threefry2x32", "rbg")

    def __init__(self, spec: Spec, keys: bool = True, blocks=None, registry: dict | None = None):
        import numpy as np

        from ..engine.keys import engine_for
        from ..engine.table import key_table

        self.spec = spec
        self.key_cache = {}
        t = self.table = key_table(spec, blocks)
        self.source = spec.file
        self.input_kind = "spec"
        self.separator = spec.fix_rng_separator
        self.prng_impl = spec.prng_impl
        self.vectorised = True
        nt = len(t.templates)
        n_ent = int(t.lane_base_off[-1])
        ent_t = np.repeat(np.arange(nt, dtype=np.int64), t.n_lanes)
        ent_first = t.start[ent_t] + (np.arange(n_ent, dtype=np.int64) - t.lane_base_off[ent_t])  # its first row
        live = (t.start[1:] - t.start[:-1])[ent_t] > 0
        ent_base = t.lane_base
        kept = live & ~t.lane_disc & (ent_base >= 0)
        if (live & ~kept).any():
            keep = np.flatnonzero(~t.discarded)

            def pick(col):
                return col[keep]
        else:  # (every row kept: the columns as they are)
            keep = np.arange(t.n, dtype=np.int64)

            def pick(col):
                return col
        self.keep = keep
        self.all_rows = _Rows(t, None)
        self.rows = _Rows(t, keep)
        kept_e = np.flatnonzero(kept)
        # path ids in order of first appearance (rows come template by template)
        path_ids: dict = {}
        of_template = np.zeros(nt, dtype=np.int32)
        for tt in np.unique(ent_t[kept_e]).tolist():
            of_template[tt] = path_ids.setdefault(t.templates[tt].path, len(path_ids))
        self.paths = list(path_ids)
        # units: (base, lane) numbered in order of first appearance, as SpecSites numbers them
        lane = t.lane_entry_ids()
        combo = ent_base[kept_e] * (int(lane.max()) + 1 if len(lane) else 1) + lane[kept_e]
        firsts = ent_first[kept_e]
        uniq, inv = np.unique(combo, return_inverse=True)
        inv = inv.ravel()
        first_of = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first_of, inv, firsts)
        rank = np.empty(len(uniq), dtype=np.int32)
        rank[np.argsort(first_of, kind="stable")] = np.arange(len(uniq), dtype=np.int32)
        unit_e = np.full(n_ent, -1, dtype=np.int32)
        unit_e[kept_e] = rank[inv]
        self.unit = pick(unit_e[t.rows_lane])
        self.path_id = pick(of_template[t.block])
        self.count = pick(t.count)
        self.word = pick(t.word)
        self._base = pick(t.base)
        self._used_bases = np.unique(ent_base[kept_e])
        # the distinct (unit, path): a lane entry's highest count is its last row's
        ecombo = (unit_e[kept_e].astype(np.int64) << 32) | of_template[ent_t[kept_e]].astype(np.int64)
        site_first = np.searchsorted(keep, firsts) if len(keep) != t.n else firsts
        uniq, inv = np.unique(ecombo, return_inverse=True)
        inv = inv.ravel()
        e_first = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(e_first, inv, site_first)
        e_top = np.zeros(len(uniq), dtype=np.int64)
        np.maximum.at(e_top, inv, t.count[t.start[ent_t[kept_e] + 1] - 1])
        self._entry_cols = (uniq, e_first, e_top)
        self._checked = keys
        self._engine = engine_for(spec) if keys else None
        self._registry = {} if registry is None else registry  # base key value -> id, shared with renamed copies
        self._resolver = None
        self._flip = None
        self._prefixes: dict[tuple[tuple, bool], bytes] = {}
        # unsafe_rbg: keys row by row
        self.keys = t.keys(self._engine, keep) if keys and spec.prng_impl not in self.BIJECTIVE else None
        self._flipped_keys = None
        self._modules = None

    @property
    def keys_checked(self) -> bool:
        return self._checked

    def entry_columns(self):
        return self._entry_cols

    def items(self, i: int) -> tuple:
        j = int(self.keep[i])
        return self.table.templates[int(self.table.block[j])].suffix + (int(self.table.count[j]),)

    def _block(self, i: int) -> int:
        """The template of site i."""
        return int(self.table.block[int(self.keep[i])])

    def _prefix(self, template: int, separator: bool) -> bytes:
        """The hashed bytes of a template's path (what comes before the count), made once."""
        key = (self.table.templates[template].suffix, separator)  # (templates of one path share it)
        pre = self._prefixes.get(key)
        if pre is None:
            pre = self._prefixes[key] = hash_input(key[0], separator)
        return pre

    def path_bytes(self, i: int, separator: bool | None = None) -> bytes:
        return self._prefix(self._block(i), self.separator if separator is None else separator)

    def paths_bytes(self, indices: Sequence[int]) -> list[bytes]:
        import numpy as np

        blocks = self.table.block[self.keep[np.asarray(indices, dtype=np.int64)]].tolist() if len(indices) else []
        return [self._prefix(b, self.separator) for b in blocks]

    # ------------------------------------------------------------ idents from base keys and words
    def _bases(self, table, words: dict | None = None):
        """Base key values of `table` (this table's memoised; `words`: rows hashed differently)."""
        if table is self.table and not words:
            if self._resolver is None:
                self._resolver = table.base_keys(self._engine)
            return self._resolver
        return table.base_keys(self._engine, words)

    def _base_id(self, value) -> int:
        return self._registry.setdefault(value, len(self._registry))

    def idents(self):
        if self.keys is not None or not self._checked:
            return super().idents()
        import numpy as np

        res = self._bases(self.table)
        ids = np.zeros(len(self.table.bases), dtype=np.uint64)
        for b in self._used_bases.tolist():
            ids[b] = self._base_id(res.key(self.table.bases[b]))
        return (ids[self._base] << np.uint64(32)) | self.word.astype(np.uint64)

    def idents_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool):
        if self.keys is not None or not self._checked:
            return super().idents_for(indices, items, separator)
        import numpy as np

        t = self.table
        rows = [int(self.keep[i]) for i in indices]
        words = _words(items, separator)
        override = None
        if separator != self.separator:
            if not all(_without_fork(t.bases[int(t.base[j])]) for j in rows):
                # a jit fork's key is a make_rng key itself, hashed with the flag: the model replayed flipped
                if any(tuple(it) != self.items(i) for it, i in zip(items, indices)):
                    return None
                t = self._flipped_table()
                if t is None:
                    return None
                words = [int(t.word[j]) for j in rows]
        else:
            # a jit fork's key is the key of an earlier row: a changed row changes the keys derived from it
            override = dict(zip(rows, words))
            if len(override) != len(rows):
                return None
        res = self._bases(t, override)
        out = np.empty(len(rows), dtype=np.uint64)
        for k, (j, w) in enumerate(zip(rows, words)):
            out[k] = (self._base_id(res.key(t.bases[int(t.base[j])])) << 32) | w
        return out

    def _flipped_table(self):
        """The key table of the model with fix_rng_separator flipped (None if it has other rows)."""
        if self._flip is None:
            from ..engine.table import key_table

            t = key_table(dataclasses.replace(self.spec, fix_rng_separator=not self.spec.fix_rng_separator))
            self._flip = t if t.n == self.table.n else False
        return None if self._flip is False else self._flip

    def _flipped(self):
        """SpecSites._flipped (unsafe_rbg: keys row by row): the flipped model's keys of the kept rows."""
        if self._flipped_keys is None:
            t = self._flipped_table()
            self._flipped_keys = False if t is None else t.keys(self._engine, self.keep)
        return None if self._flipped_keys is False else self._flipped_keys

    def _keys_at(self, indices: list[int], rows) -> list | None:
        """Key data of sites `indices` (table rows `rows`), as tuples."""
        if not self._checked:
            return None
        if self.keys is not None:
            return [tuple(k) for k in self.keys[indices].tolist()]
        import numpy as np

        t = self.table
        res = self._bases(t)
        used, inverse = np.unique(t.base[rows], return_inverse=True)
        base_keys = np.array([res.key(t.bases[b]) for b in used.tolist()], dtype=np.uint32).reshape(len(used), -1)
        return [tuple(k) for k in self._engine.fold_in_rows(base_keys[inverse.ravel()], t.word[rows]).tolist()]

    # ------------------------------------------------------------ reported sites
    def describe(self, indices, module_paths):
        """SpecSites.describe from the columns: what a template fixes is worked out once."""
        import numpy as np

        t = self.table
        indices = [int(i) for i in indices]
        if not indices:
            return {}, {}
        rows = self.keep[np.asarray(indices, dtype=np.int64)]
        keys = self._keys_at(indices, rows) or [None] * len(indices)
        per_template: dict = {}
        bases: dict = {}
        out = {}
        head = b"\x00" if self.separator else b""  # (count_bytes, inline)
        for i, j, b, c, base, w, key in zip(indices, rows.tolist(), t.block[rows].tolist(), t.count[rows].tolist(),
                                            t.base[rows].tolist(), t.word[rows].tolist(), keys):
            const = per_template.get(b)
            if const is None:
                tpl = t.templates[b]
                const = per_template[b] = (tpl.path, tpl.stream_requested, tpl.stream, tpl.kind, tpl.label,
                                           tpl.suffix, self._prefix(b, self.separator), tpl.location,
                                           bool(tpl.axes))
            path, req, used, kind, label, suffix, pre, loc, lanes = const
            text = bases.get(base)
            if text is None:
                text = bases[base] = str(t.bases[base])
            out[i] = _frozen(CallSite, j, path, req, used, c, t.lane_of(j) if lanes else (), text, kind, label,
                             suffix + (c,), pre + head + c.to_bytes((c.bit_length() + 7) // 8, "big"), w, key, loc)
        return out, {}

    def rename_target(self, i: int) -> RenameTarget | None:
        tpl = self.table.templates[self._block(i)]
        return self._target_at(tpl.path, tpl.location)

    def stream(self, i: int) -> str:
        return self.table.templates[self._block(i)].stream

    def base_of(self, i: int):
        return self.table.bases[int(self.table.base[int(self.keep[i])])]

    def keys_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool):
        """SpecSites.keys_for without a Derivation per row (unsafe_rbg, whose keys are computed per
        row): under the same separator, the changed rows' keys come from their new words and the
        table's base keys (a changed jit fork's row changes the keys derived from it)."""
        if self.keys is None or separator != self.separator:
            return super().keys_for(indices, items, separator)
        rows = [int(self.keep[i]) for i in indices]
        if len(set(rows)) != len(rows):
            return super().keys_for(indices, items, separator)
        return self.table.keys_with_words(self._engine, dict(zip(rows, _words(items, separator))))

    def _sites_of(self, spec: Spec) -> "TableSites":
        return TableSites(spec, keys=self._checked, registry=self._registry)


@paused
def spec_sites(spec: Spec, keys: bool = True) -> SpecSites:
    """A spec's call sites: small ones on the plain replay (Python lists, keys on Python ints, no
    NumPy), large ones on derive's fast path (TableSites). Both give the same report."""
    from ..engine.replay import Replayer

    blocks = Replayer(spec, blocks=True).walk()
    if vectorised(blocks.rows):
        return TableSites(spec, keys, blocks)
    return SpecSites(spec, keys)
def _without_fork(ref) -> bool:
    """Whether a key reference derives from the root keys alone (no jit fork, which is a make_rng key)."""
    from ..engine.refs import ForkKey

    while ref is not None:
        if isinstance(ref, ForkKey):
            return False
        if not hasattr(ref, "parent"):
            return True
        ref = ref.parent
    return False


def _renamed_module(m: ModuleDef, names: dict[int, str]) -> ModuleDef:
    """`m` with the modules whose id is in `names` given those explicit names."""
    def items(xs: tuple) -> tuple:
        new = tuple(item(x) for x in xs)
        return xs if all(a is b for a, b in zip(new, xs)) else new

    def item(x):
        if isinstance(x, (Child, Define)):
            new = _renamed_module(x.module, names)
            return x if new is x.module else dataclasses.replace(x, module=new)
        if isinstance(x, Transform):
            new = _renamed_module(x.target, names)
            return x if new is x.target else dataclasses.replace(x, target=new)
        if isinstance(x, Sequential):
            layers = tuple(_renamed_module(c, names) for c in x.layers)
            return x if all(a is b for a, b in zip(layers, x.layers)) else dataclasses.replace(x, layers=layers)
        if isinstance(x, Cond):
            branches = tuple(items(b) for b in x.branches)
            return x if all(a is b for a, b in zip(branches, x.branches)) else dataclasses.replace(x, branches=branches)
        if isinstance(x, WhileLoop):
            c, b = items(x.cond_items), items(x.body_items)
            return x if c is x.cond_items and b is x.body_items else dataclasses.replace(x, cond_items=c, body_items=b)
        return x

    setup, body = items(m.setup), items(m.body)
    out = m if setup is m.setup and body is m.body else dataclasses.replace(m, setup=setup, body=body)
    if id(m) in names:
        out = dataclasses.replace(out, name=names[id(m)])
    return out


def audit_spec(spec: Spec, keys: bool = True, latent_max_count: int = DEFAULT_LATENT_MAX_COUNT) -> Audit:
    """Replay `spec` and audit its call sites; `keys=False` checks hash inputs and words only."""
    return audit(spec_sites(spec, keys=keys), latent_max_count)
