"""Latent collisions: paths of one base key whose hashed bytes differ by a tail that a count can spell, so
that the shorter path's keys would meet the longer one's if it drew more keys."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .results import (
    LatentCollision,
    LatentPartner,
    Rename,
    SeparatorCheck,
    frozen_record,
)
from .sites import Sites, count_bytes

if TYPE_CHECKING:
    from .audit import Grouping

# Latent collisions are reported when the smaller colliding count is at most this (two-byte counts).
DEFAULT_LATENT_MAX_COUNT = 65535


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


def max_rest(bound: int) -> int:
    """The longest `rest` whose smallest colliding count can be <= bound."""
    return max(0, (bound.bit_length() + 7) // 8 - 1)


class Entry(NamedTuple):
    """A distinct (unit, path) of the input: its hashed path bytes and the counts it reaches."""

    unit: int
    path_id: int
    first: int  # its first call site
    max_count: int
    data: bytes  # the hash input of the path alone (without the count)


class Entries:
    """Every distinct (unit, path), in arrays (or lists, as the sites' columns), with a per-unit index from
    hashed path bytes."""

    def __init__(self, sites: Sites):
        # combo: sorted distinct (unit << 32 | path id); first: its first call site; top: its highest count
        given = sites.entry_columns()
        self.combo: Any  # the distinct (unit << 32 | path id), sorted: NumPy, then a list
        self.top: Any
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
                    tops[k] = max(tops[k], c)
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

    def entry(self, k: int) -> Entry:
        c = self.combo[k]
        return Entry(c >> 32, c & 0xFFFFFFFF, self.first[k], self.top[k], self.data[k])

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


class LatentSearch:
    """The latent search of one audit: distinct (unit, path) entries and the pairs whose counts would meet."""

    def __init__(self, ctx: Grouping):
        self.ctx = ctx
        self._entries: Entries | None = None
        self._pairs: dict[bytes, tuple[int, int] | None] = {}

    def pair(self, rest: bytes) -> tuple[int, int] | None:
        """smallest_counts, cached (a tail is one or two bytes), and None beyond the bound."""
        if rest not in self._pairs:
            p = smallest_counts(rest, self.ctx.sep)
            self._pairs[rest] = p if p is not None and p[0] <= self.ctx.bound else None
        return self._pairs[rest]

    def entries(self) -> Entries:
        if self._entries is None:
            self._entries = Entries(self.ctx.s)
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
            for cut in range(1, self.ctx.rest + 1):
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

    def first_pairs(self) -> set[tuple[int, int]]:
        """The latent pairs as (first call site of the short path, first call site of the long one)."""
        first = self.entries().first
        return {(int(first[a]), int(first[b])) for a, longs in self.latent_pairs().items() for b in longs}

    def find(self) -> list:
        es = self.entries()
        groups: dict[tuple, dict] = {}
        for short, longs in self.latent_pairs().items():
            e = es.entry(short)
            g = groups.setdefault(
                (self.ctx.s.stream(e.first), self.ctx.s.paths[e.path_id]), {"entry": e, "partners": {}}
            )
            for k, pair in longs.items():
                long = es.entry(k)
                g["partners"].setdefault(self.ctx.s.paths[long.path_id], (long, pair))
        found = []
        for g in groups.values():
            partners = sorted(g["partners"].values(), key=lambda p: p[0].first)
            found.append(self._latent_one(g["entry"], partners))
        found.sort(key=lambda f: f.first)
        return found

    def _latent_one(self, e: Entry, partners: list) -> PendingLatent:
        flipped = not self.ctx.sep
        a = self.ctx.s.path_bytes(e.first, flipped)
        rows = []
        removes = True
        for other, pair in partners:
            b = self.ctx.s.path_bytes(other.first, flipped)
            sep_pair: tuple[int, int] | None
            if a == b:
                sep_pair = (1, 1)
            elif b.startswith(a):
                sep_pair = smallest_counts(b[len(a) :], flipped)
            elif a.startswith(b):  # with the flag flipped the other path may be the short one
                back = smallest_counts(a[len(b) :], flipped)
                sep_pair = back[::-1] if back else None
            else:
                sep_pair = None
            removes = removes and sep_pair is None
            rows.append((other, pair, e.data + count_bytes(pair[0], self.ctx.sep), sep_pair))
        n = self.ctx.s.n
        if self.ctx.sep:
            check = SeparatorCheck(True, None, "fix_rng_separator is on already", n)
        elif removes:
            check = SeparatorCheck(False, True, "with it these paths never hash the same bytes, whatever the counts", n)
        else:
            check = SeparatorCheck(
                False, False, "with it some of these paths still hash the same bytes for some counts", n
            )
        renames, note = self.ctx.renames.for_latent(e, [o for o, _ in partners])
        self.ctx.want([e.first] + [o.first for o, _ in partners])
        return PendingLatent(e, rows, check, renames, note)

    def relations(self, unit: int, data: bytes, max_count: int, skip: set, extra: dict) -> set:
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

        out: set[tuple[int, bool]] = set()
        for cut in range(1, min(self.ctx.rest, len(data)) + 1):
            pair = self.pair(data[-cut:])
            if pair is not None:
                out.update((pid, False) for pid, top in others(data[:-cut]) if top < pair[0])
        longer = {b for b in extra if b.startswith(data) and 0 < len(b) - len(data) <= self.ctx.rest}
        if self.ctx.rest == 1:  # 255 lookups beat a scan of everything whose bytes start with these
            table = es.by_data.get(unit, {})
            longer.update(b for b in (data + bytes([x]) for x in range(1, 256)) if b in table)
        elif self.ctx.rest > 1:
            ordered = es.sorted_data(unit)
            j = bisect.bisect_right(ordered, data)
            while j < len(ordered) and ordered[j].startswith(data):
                if len(ordered[j]) - len(data) <= self.ctx.rest:
                    longer.add(ordered[j])
                j += 1
        for b in longer:
            pair = self.pair(b[len(data) :])
            if pair is not None and max_count < pair[0]:
                out.update((pid, True) for pid, _ in others(b))
        return out


@dataclass
class PendingLatent:
    """A latent collision found, built into a LatentCollision once its call sites are described."""

    entry: Entry
    rows: list
    separator: SeparatorCheck
    renames: list[Rename]
    rename_note: str

    @property
    def first(self) -> int:
        return self.entry.first

    def build(self, ctx: Grouping) -> LatentCollision:
        partners = tuple(
            frozen_record(LatentPartner, ctx.site(o.first), o.max_count, pair, data, sep_pair)
            for o, pair, data, sep_pair in self.rows
        )
        return LatentCollision(
            ctx.site(self.entry.first),
            self.entry.max_count,
            partners,
            self.separator,
            tuple(self.renames),
            self.rename_note,
        )
