"""The rename search: explicit `name:`s for modules that end a finding, each verified to create no new
collision or latent pair (by recomputing the renamed keys, or for small specs by replaying the renamed model)."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.hashing import hash_input
from .results import Rename
from .sites import RenameTarget, Unknown, ident_as_key

if TYPE_CHECKING:
    from .audit import Grouping
    from .latent import Entry

RENAME_TRIES = 40  # candidate names tried per module
RENAME_BUDGET = 4_000_000  # call sites re-derived per module at most (fewer tries for a module with many keys)
RENAME_MAX_EXPECTED = 3  # a rename expected to meet more keys by chance than this is not tried
REPLAY_TRIES = 4  # candidate names per module when each costs a replay
# call sites an audit replays to check renames (each check runs the whole model again): a model of hundreds of
# sibling layers has a latent finding per layer, each checked as it comes; past this the later findings say so
REPLAY_BUDGET = 150_000


@dataclass
class _Overlay:
    """Renames accepted so far while fixing one finding."""

    moved: set = dataclasses.field(default_factory=set)  # site indices whose key changed
    idents: dict = dataclasses.field(default_factory=dict)  # new ident bytes -> site
    current: dict = dataclasses.field(default_factory=dict)  # site -> new ident
    entries: dict = dataclasses.field(default_factory=dict)  # (unit, path id) -> (new bytes, max count)
    moved_pids: set = dataclasses.field(default_factory=set)
    forbid: dict = dataclasses.field(default_factory=dict)  # (unit, path id) -> relations that must end


class RenameSearch:
    """The rename search of one audit."""

    def __init__(self, ctx: Grouping):
        self.ctx = ctx
        self._paths_sorted: list[int] | None = None
        self._by_path: dict | tuple | None = None
        self._base: tuple[list[int], set] | None = None
        self.replayed = 0  # call sites replayed by rename checks so far (REPLAY_BUDGET)

    def _sorted_paths(self) -> list[int]:
        """Path ids in the order of their paths (ids, not (path, id) pairs: a million paths)."""
        if self._paths_sorted is None:
            paths = self.ctx.s.paths
            self._paths_sorted = sorted(range(len(paths)), key=paths.__getitem__)
        return self._paths_sorted

    def paths_under(self, prefix: tuple[str, ...]) -> list[int]:
        """Path ids of `prefix` and everything below it."""
        ps, paths, n = self._sorted_paths(), self.ctx.s.paths, len(prefix)
        j = bisect.bisect_left(ps, prefix, key=paths.__getitem__)
        out = []
        while j < len(ps) and paths[ps[j]][:n] == prefix:
            out.append(ps[j])
            j += 1
        return out

    def _name_taken(self, path: tuple[str, ...]) -> bool:
        ps, paths = self._sorted_paths(), self.ctx.s.paths
        j = bisect.bisect_left(ps, path, key=paths.__getitem__)
        return j < len(ps) and paths[ps[j]][: len(path)] == path

    def sites_of_paths(self, pids: list[int]):
        """The call sites of the paths `pids`, in order."""
        if not self.ctx.vec:
            if self._by_path is None:
                by_path: dict[int, list[int]] = {}
                for i, p in enumerate(self.ctx.s.path_id):
                    by_path.setdefault(p, []).append(i)
                self._by_path = by_path
            assert isinstance(self._by_path, dict)
            return sorted(i for p in pids for i in self._by_path.get(p, ()))
        import numpy as np

        if self._by_path is None:
            order = np.argsort(self.ctx.s.path_id, kind="stable")
            starts = np.zeros(len(self.ctx.s.paths) + 1, dtype=np.int64)
            np.cumsum(np.bincount(self.ctx.s.path_id, minlength=len(self.ctx.s.paths)), out=starts[1:])
            self._by_path = (order, starts)
        order, starts = self._by_path
        parts = [order[starts[p] : starts[p + 1]] for p in pids]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def _try(self, target: RenameTarget, new_name: str, state: _Overlay):
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
            items = self.ctx.items(i)
            path = self.ctx.s.paths[self.ctx.s.path_id[i]]
            j = len(m) - 1 - (len(path) - (len(items) - 1))
            if j < 0:
                continue  # the renamed module is above this site's base: that base key changes
            change_idx.append(i)
            change_items.append(items[:j] + (new_name,) + items[j + 1 :])
        try:
            idents = self.ctx.idents_for(change_idx, change_items, self.ctx.sep) if change_idx else None
        except Unknown:
            return None
        gone = state.moved | set(moved)
        hashed = None
        if idents is not None:
            hashed = self.ctx.hashable(idents)
            if len(set(hashed)) != len(hashed):
                return None
            for x, (a, b) in zip(idents, self._equal_ranges(idents)):
                if b > a and any(i not in gone for i in self._holders(x, a, b)):
                    return None
            if any(x in state.idents for x in hashed):
                return None
        # latent pairs: the relations of each renamed path with everyone else, before and after
        es = self.ctx.latent.entries()
        new_entries: dict[tuple[int, int], tuple[bytes, int]] = {}
        for i, items in zip(change_idx, change_items):
            key = (int(self.ctx.s.unit[i]), int(self.ctx.s.path_id[i]))
            if key not in new_entries:
                new_entries[key] = (hash_input(items[:-1], self.ctx.sep), int(es.top[es.of(*key)]))
        moved_pids = {pid for _, pid in new_entries} | state.moved_pids
        everything = list(new_entries.items()) + list(state.entries.items())
        for (unit, pid), (data, top) in new_entries.items():
            extra: dict[bytes, list] = {}
            for (u2, p2), (d2, t2) in everything:
                if u2 == unit and p2 != pid:
                    extra.setdefault(d2, []).append((p2, t2))
            after = self.ctx.latent.relations(unit, data, top, moved_pids, extra)
            if after - self.ctx.latent.relations(unit, es.data[es.of(unit, pid)], top, set(), {}):
                return None
            if after & state.forbid.get((unit, pid), set()):
                return None
        return moved, (dict(zip(change_idx, hashed)) if hashed is not None else {}), new_entries

    def _holders(self, ident, a: int, b: int) -> list[int]:
        """The sites whose ident is `ident`, found at sorted_ident[a:b]."""
        if self.ctx.order is None:
            import numpy as np

            return np.flatnonzero(self.ctx.ident == ident).tolist()
        return [int(self.ctx.order[p]) for p in range(a, b)]

    def _equal_ranges(self, idents) -> list[tuple[int, int]]:
        """For each ident, the range of sorted_ident that equals it."""
        si = self.ctx.sorted_ident
        if self.ctx.vec:
            import numpy as np

            return list(zip(np.searchsorted(si, idents, "left"), np.searchsorted(si, idents, "right")))
        return [(bisect.bisect_left(si, x), bisect.bisect_right(si, x)) for x in idents]

    def _rename(self, i: int, state: _Overlay) -> Rename | None:
        target = self.ctx.target(i)
        if target is None or not target.path:
            return None
        # A renamed module's keys are fresh draws: about keys * n / 2**32 of them meet another key (the
        # birthday bound). Past a few, every try fails, each at the cost of re-deriving them all.
        keys_changed = len(self.sites_of_paths(self.paths_under(target.path)))
        if keys_changed * self.ctx.s.n > RENAME_MAX_EXPECTED * 2**32:
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
            return Rename(target.path, name, target.module_class, target.explicit, target.location, keys_changed)
        return None

    def _still_colliding(self, members: list[int], state: _Overlay) -> list[int]:
        now = {}
        for i in members:
            if i in state.moved:
                now[i] = state.current.get(i)  # None: on a new base key
            else:
                now[i] = ident_as_key(self.ctx.ident[i], self.ctx.vec)
        seen: dict = {}
        for v in now.values():
            if v is not None:
                seen[v] = seen.get(v, 0) + 1
        return [i for i in members if now[i] is not None and seen[now[i]] > 1]

    def _cost(self, i: int):
        """Which site to rename first: one whose rename changes the fewest keys; among equals, the later."""
        t = self.ctx.target(i)
        if t is None or not t.path:
            return (1, 0, 0)
        return (0 if t.local else 1, len(self.sites_of_paths(self.paths_under(t.path))), -i)

    def for_collision(self, members: list[int]) -> tuple[list[Rename], str]:
        """Greedy: rename the module of one colliding site at a time until no two sites of the group
        share a key; each rename is checked to create no collision and no latent pair."""
        if self.ctx.s.replayable:
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
        return renames, (
            "verified: afterwards no two of these call sites share a key, and no new collision or latent pair appears"
        )

    @staticmethod
    def _no_rename(renames: list[Rename]) -> tuple[list[Rename], str]:
        if renames:
            return renames, (
                "these renames are verified, but no verified rename was found for the call sites that still share a key"
            )
        return [], (
            "no verified rename was found: the modules are the root, repeated or named by a layer, or "
            "every rename tried keeps this finding or makes another (a module with so many keys that "
            "its renamed keys would meet others by chance, keys x call sites / 2**32 > 3, is not tried)"
        )

    def for_latent(self, e: Entry, partners: list[Entry]) -> tuple[list[Rename], str]:
        ok = "afterwards these paths pair with no other path for counts up to the bound, and no collision appears"
        if self.ctx.s.replayable:
            pairs = {(e.first, p.first) for p in partners}
            # renaming the short path ends all its pairs; renaming a long one ends one pair
            renames, note = self._replayed_renames(
                [e.first] + ([partners[0].first] if len(partners) == 1 else []), pairs
            )
            return (renames, "verified by running the renamed model again: " + ok) if renames else (renames, note)
        ok = "verified: " + ok
        pids = {p.path_id for p in partners} | {e.path_id}
        # renaming the short path ends all its pairs; renaming a long one ends one pair
        for i in sorted([e.first] + ([partners[0].first] if len(partners) == 1 else []), key=self._cost):
            target = self.ctx.target(i)
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

    def _baseline(self) -> tuple[list[int], set]:
        """Per site, the id of the group of sites sharing its key (-1: none); and the latent pairs."""
        if self._base is None:
            groups = [-1] * self.ctx.s.n
            for g, members in enumerate(self.ctx.runs()):
                for i in members:
                    groups[i] = g
            self._base = (groups, self.ctx.latent.first_pairs() if self.ctx.bound > 0 else set())
        return self._base

    def _check_replayed(self, changes, ending: set) -> Grouping | None:
        """The audit of the renamed model, if it shares no key and has no latent pair that the original
        does not (and none of `ending`)."""
        self.replayed += self.ctx.s.n
        sites = self.ctx.s.renamed(changes)
        if sites is None or sites.n != self.ctx.s.n:
            return None
        new = type(self.ctx)(sites, self.ctx.bound)
        groups, latent = self._baseline()
        for run in new.runs():
            g = groups[run[0]]
            if g < 0 or any(groups[i] != g for i in run):
                return None
        pairs = new.latent.first_pairs() if self.ctx.bound > 0 else set()
        if not pairs <= latent or pairs & ending:
            return None
        return new

    def _replayed_renames(self, members: list[int], ending: set) -> tuple[list[Rename], str]:
        """The greedy of for_collision, each step checked on the renamed model run again: exact, including
        Flax's auto-naming (naming a module explicitly shifts the auto-names of its later siblings)."""
        if self.replayed >= REPLAY_BUDGET:
            return [], (
                f"not checked: the rename checks of earlier findings replayed the model {self.replayed:,} call sites' "
                "worth (each check runs it again), and the later findings are left unchecked; rename as one of "
                "those findings says, then audit again"
            )
        changes: list[tuple[RenameTarget, str]] = []
        renames: list[Rename] = []
        now = self.ctx
        while True:
            colliding = now.colliding(members)
            if len(colliding) < 2 and not ending:
                break
            step = None
            for i in sorted(colliding or members, key=self._cost):
                target = self.ctx.target(i)
                if target is None or not target.path or any(t.module is target.module for t, _ in changes):
                    continue
                for k in range(1, REPLAY_TRIES + 1):
                    name = f"{target.path[-1]}_{k}"
                    if self._name_taken(target.path[:-1] + (name,)):
                        continue
                    new = self._check_replayed(changes + [(target, name)], ending)
                    if new is None:
                        continue
                    if not ending and len(new.colliding(members)) >= len(colliding):
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
        return renames, (
            "verified by running the renamed model again: afterwards no two of these call sites "
            "share a key, and no new collision or latent pair appears"
        )

    def _describe_rename(self, target: RenameTarget, name: str, before: Grouping, after: Grouping) -> Rename:
        if self.ctx.vec:
            changed = int((before.ident != after.ident).sum())
        else:
            changed = sum(1 for a, b in zip(before.ident, after.ident) if a != b)
        shifted: dict[str, str] = {}
        m = target.path
        for i in range(before.s.n):
            old = before.s.paths[before.s.path_id[i]]
            new = after.s.paths[after.s.path_id[i]]
            if old != new and old[: len(m)] != m:
                d = next(d for d in range(min(len(old), len(new))) if old[d] != new[d])
                shifted.setdefault("/".join(old[: d + 1]), "/".join(new[: d + 1]))
        note = ""
        if shifted:
            shown = ", ".join(f"{a} -> {b}" for a, b in sorted(shifted.items())[:3])
            more = f" and {len(shifted) - 3} more" if len(shifted) > 3 else ""
            note = (
                f"Flax's auto-naming then also renames {len(shifted)} later module"
                f"{'s' if len(shifted) != 1 else ''}: {shown}{more}"
            )
        return Rename(target.path, name, target.module_class, target.explicit, target.location, changed, note)
