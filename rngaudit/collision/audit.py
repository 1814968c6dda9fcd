"""The audit of one input's call sites: group them by key, classify each group (collision classes 1-4), check
whether fix_rng_separator removes it, and build the report (the latent search and the rename search are
rngaudit.collision.latent and rngaudit.collision.renames)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..engine.hashing import hash_input
from ..gcpause import paused
from ..spec.tree import Spec
from .latent import DEFAULT_LATENT_MAX_COUNT, LatentSearch, max_rest
from .renames import RenameSearch
from .results import (
    CATEGORIES,
    CONCATENATION,
    COUNT_MEETS_NAME,
    HASH_WORD,
    JIT_TRACE_REUSE,
    SHARED_KEY,
    SHARED_SEED,
    UNSPLIT_LANES,
    Audit,
    CallSite,
    Collision,
    HashInput,
    Rename,
    SeparatorCheck,
)
from .sites import RenameTarget, Sites, Unknown, count_bytes, ident_as_key


@paused
def audit(sites: Sites, latent_max_count: int = DEFAULT_LATENT_MAX_COUNT) -> Audit:
    """Every group of distinct call sites with one key, and every latent pair of paths."""
    ctx = Grouping(sites, latent_max_count)
    pending = ctx.collisions()
    latent = ctx.latent.find() if latent_max_count > 0 else []
    ctx.describe(pending + latent)
    return Audit(
        source=sites.source,
        input_kind=sites.input_kind,
        call_sites=sites.n,
        fix_rng_separator=sites.separator,
        prng_impl=sites.prng_impl,
        keys_checked=sites.keys_checked,
        latent_max_count=latent_max_count,
        collisions=tuple(f.build(ctx) for f in pending),
        latent=tuple(f.build(ctx) for f in latent),
        rules=sites.rules,
    )


class Grouping:
    """One audit: the call sites sorted by key (or by base and word), the reported sites, and the finding of
    collisions; its `latent` search and `renames` search work on the same sites."""

    def __init__(self, sites: Sites, latent_max_count: int):
        self.s = sites
        self.sep = sites.separator
        self.bound = latent_max_count
        self.rest = max_rest(latent_max_count)
        self.vec = sites.vectorised
        self.ident = sites.idents()
        # sorted idents, and the order that sorts them (None: only the values were sorted): NumPy or lists
        self.order: Any
        self.sorted_ident: Any
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
        self._sites: dict[int, CallSite] = {}
        self._wanted: set[int] = set()
        self._targets: dict[int, RenameTarget | None] = {}
        self.latent = LatentSearch(self)
        self.renames = RenameSearch(self)

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
            f.renames = [
                dataclasses.replace(r, location=where.get(r.path)) if r.location is None else r for r in f.renames
            ]

    def site(self, i: int) -> CallSite:
        return self._sites[i]

    def target(self, i: int) -> RenameTarget | None:
        """The module whose `name:` renames site i (None: none can), asked once per site."""
        if i not in self._targets:
            self._targets[i] = self.s.rename_target(i)
        return self._targets[i]

    def items(self, i: int) -> tuple:
        return self.s.items(i)

    def runs(self) -> list:
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
            return [self.order[a : b + 1] for a, b in zip(starts, stops)]
        runs = []
        start = 0
        for b in range(1, len(si) + 1):
            if b == len(si) or si[b] != si[start]:
                if b - start > 1:
                    runs.append(self.order[start:b])
                start = b
        return runs

    def hashable(self, idents) -> list:
        return [ident_as_key(x, self.vec) for x in idents]

    def collisions(self) -> list:
        found = []
        shared: dict[frozenset, list[tuple[list[int], dict]]] = {}
        for run in self.runs():
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

    def _hash_collision(self, members: list[int]) -> Pending:
        inputs = self._by_bytes(members)
        if len(inputs) > 1:
            klass = HASH_WORD
        else:
            counts = {count_bytes(self.items(i)[-1], self.sep) for i in members}
            klass = COUNT_MEETS_NAME if len(counts) > 1 else CONCATENATION
        if len({(int(self.s.path_id[i]), int(self.s.count[i])) for i in members}) == 1:
            # one path and one count hashed again: no names concatenate, the count did not move (jax reused an
            # nn.jit trace before flax 0.10.2), so neither a rename nor the separator helps
            return Pending(
                members,
                inputs,
                CONCATENATION,
                JIT_TRACE_REUSE,
                True,
                self._separator(members),
                [],
                "no rename helps: it is one call site, drawing with a count that did not move",
                self.want(members),
            )
        renames, note = self.renames.for_collision(members)
        return Pending(
            members, inputs, klass, CATEGORIES[klass], True, self._separator(members), renames, note, self.want(members)
        )

    def _lanes_only(self, group: list[int], by_unit: dict[int, list[int]]) -> bool:
        # The lanes of one call (one base key, one stream, the same path and count) sharing a key is what
        # split_rngs=False asks for; keys shared across base keys or streams are a shared seed.
        calls = {frozenset((int(self.s.path_id[i]), int(self.s.count[i])) for i in m) for m in by_unit.values()}
        return (
            len({self.s.base_of(i) for i in group}) == 1
            and len({self.s.stream(i) for i in group}) == 1
            and len(calls) == 1
        )

    def _made_outside(self, members: list[int]) -> str | None:
        """The note of a submodule made before an nn.while_loop and called in it, where every member draws so
        (its lanes share the key whatever split_rngs says); None otherwise."""
        from ..engine.lifts import OUTSIDE_LOOP_MARK

        found = {next((n for n in self.s.notes_of(i) if OUTSIDE_LOOP_MARK in n), None) for i in members}
        return found.pop() if len(found) == 1 and None not in found else None

    def _shared_key(self, groups: list[tuple[list[int], dict]]) -> Pending:
        lanes_only = all(self._lanes_only(g, by_unit) for g, by_unit in groups)
        members = sorted(i for g, _ in groups for i in g)
        inputs = [part for g, _ in groups for part in self._by_bytes(g)]
        outside = self._made_outside(members) if lanes_only else None
        if outside is not None:
            note = outside
        elif lanes_only:
            note = (
                "every lane of a transform gets the same key for this stream (split_rngs is false for it); "
                "split the stream if the lanes should differ"
            )
        else:
            note = (
                "no rename helps: the stream name is not hashed, so streams (or bases) seeded with the same "
                "key hand out the same keys; pass each stream its own key, e.g. split(key(0), 2)[0] and [1]"
            )
        return Pending(
            members,
            inputs,
            SHARED_KEY,
            UNSPLIT_LANES if lanes_only else SHARED_SEED,
            not lanes_only,
            self._separator(members),
            [],
            note,
            self.want(members),
        )

    def idents_for(self, indices: list[int], items: list[tuple], separator: bool):
        idents = self.s.idents_for(indices, items, separator)
        if idents is None:
            raise Unknown()
        return idents

    def _separator(self, members: list[int]) -> SeparatorCheck:
        n = self.s.n
        if self.sep:
            return SeparatorCheck(True, None, "fix_rng_separator is on already", n)
        try:
            idents = self.idents_for(members, [self.items(i) for i in members], True)
        except Unknown:
            return SeparatorCheck(False, None, "the keys could not be recomputed with the separator", n)
        shared = sum(1 for c in Counter(self.hashable(idents)).values() if c > 1)
        if shared == 0:
            return SeparatorCheck(False, True, "with it every call site of this finding gets its own key", n)
        return SeparatorCheck(
            False,
            False,
            f"with it {shared} key{'s are' if shared > 1 else ' is'} still shared by call sites of this finding",
            n,
        )

    def colliding(self, members: list[int]) -> list[int]:
        """The members that share their key with another member."""
        hashed = self.hashable(self.ident[i] for i in members)
        counts = Counter(hashed)
        return [m for m, h in zip(members, hashed) if counts[h] > 1]


@dataclass
class Pending:
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

    def build(self, ctx: Grouping) -> Collision:
        inputs = []
        for group in sorted(self.inputs, key=min):
            sites = tuple(ctx.site(i) for i in sorted(group))
            inputs.append(HashInput(sites[0].hash_input, sites[0].hash_word, sites[0].key, sites))
        return Collision(
            self.collision_class,
            self.category,
            self.failing,
            tuple(inputs),
            self.separator,
            tuple(self.renames),
            self.rename_note,
        )


def audit_spec(spec: Spec, keys: bool = True, latent_max_count: int = DEFAULT_LATENT_MAX_COUNT) -> Audit:
    """Replay `spec` and audit its call sites; `keys=False` checks hash inputs and words only."""
    from .spec_sites import spec_sites

    return audit(spec_sites(spec, keys=keys), latent_max_count)
