"""derive's fast path: a block replay (Replayer(blocks=True): a repeated `make_rng` is one template whose
counts are consecutive) expanded into columns. A template made inside vmap/scan lanes is hashed once and
expanded over its lanes with NumPy; SHA-1 runs once per distinct hash input (rngaudit.engine.hash_words);
Threefry runs once, vectorised over every selected row (rngaudit.engine.keys). The plain path
(`replay.replay` + `keys.derive_keys`) stays the reference: tests check the two agree row for row."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import numpy as np

from ..gcpause import paused
from ..spec.tree import Spec
from .hash_words import hash_templates, start_words
from .hashing import hash_input, hash_word
from .keys import BaseKeys, KeyData, KeyEngine, root_keys
from .records import Derivation
from .refs import ForkKey, RootKey
from .refs import concrete as resolve
from .replay import Replayer


class KeyTable:
    """Every key request of a replay, as columns (one entry per row, rows in execution order):
    `block` (its template), `count`, `word` (the hash word), `base` (an index into `bases`, -1 for a
    key that never exists), `lane_ix` (index of its lane in the template's lanes) and `discarded`.
    `hashed=False` leaves the words to be hashed when first read: `words_of(rows)` then hashes only those rows
    (a report that lists its first rows need not hash a million), `word` every row."""

    def __init__(self, r: Replayer, hashed: bool = True):
        self.spec: Spec = r.spec
        self.unmatched: tuple[str, ...] = ()  # set by select(): the filters that match no call site
        self.sep = r.sep
        self.templates = r.templates
        self.to_linen = r.to_linen  # every call of a bridge.ToLinen module
        self.axis_size = r.axis_size
        nt = len(self.templates)
        sizes = self.axis_size
        n_counts = np.empty(nt, dtype=np.int64)
        n_lanes = np.empty(nt, dtype=np.int64)
        count0 = np.empty(nt, dtype=np.int64)
        for t, tpl in enumerate(self.templates):
            lanes = 1
            for a in tpl.axes:
                lanes *= sizes[a]
            n_lanes[t] = lanes
            n_counts[t] = tpl.n
            count0[t] = tpl.first_count
        self.n_lanes = n_lanes
        per = n_counts * n_lanes
        self.start = np.zeros(nt + 1, dtype=np.int64)
        np.cumsum(per, out=self.start[1:])
        n = int(self.start[-1])
        self.n = n
        self.word_off = np.zeros(nt + 1, dtype=np.int64)
        np.cumsum(n_counts, out=self.word_off[1:])
        self._word: np.ndarray | None = None
        self._seen: dict[int, int] = {}  # row -> its word, of the rows words_of hashed one by one
        if not hashed:
            self._columns(nt, n, per, n_lanes, count0)
            return
        # the hash words: a large replay's last ones come from a forked child while this process
        # makes the other columns
        head, child = start_words(self.templates, self.sep, self.word_off)
        try:
            self._columns(nt, n, per, n_lanes, count0)
        except BaseException:
            if child is not None:
                child.cancel()
            raise
        words = head if child is None else np.concatenate([head, child.finish()])
        self._word = words[self._word_ix]
        del self._word_ix

    @property
    def word(self) -> np.ndarray:
        """The hash word of every row (hashed now if the table was made with hashed=False)."""
        if self._word is None:
            self._word = hash_templates(self.templates, self.sep, int(self.word_off[-1]))[self._word_ix]
            del self._word_ix
        return self._word

    def word_at(self, i: int) -> int:
        """Row i's hash word."""
        w = self._word
        return int(w[i]) if w is not None else int(self.words_of(np.asarray([i]))[0])

    def words_of(self, rows: np.ndarray) -> np.ndarray:
        """The hash words of `rows`, hashing only those rows if the words are not yet all made."""
        if self._word is not None or 4 * len(rows) >= self.n:  # (most rows: hash them all, in one loop)
            return self.word[rows]
        out = np.empty(len(rows), dtype=np.uint32)
        templates, block, count, sep, seen = self.templates, self.block, self.count, self.sep, self._seen
        for j, i in enumerate(np.asarray(rows, dtype=np.int64).tolist()):
            w = seen.get(i)
            if w is None:
                w = seen[i] = hash_word(hash_input(templates[int(block[i])].suffix + (int(count[i]),), sep))
            out[j] = w
        return out

    def _columns(self, nt: int, n: int, per: np.ndarray, n_lanes: np.ndarray, count0: np.ndarray) -> None:
        """Every column but the words: rows, counts, lanes, bases."""
        sizes = self.axis_size
        block = np.repeat(np.arange(nt, dtype=np.int64), per)
        off = np.arange(n, dtype=np.int64) - self.start[block]
        nl = n_lanes[block]
        ci = off // nl
        self.block = block
        self.lane_ix = off - ci * nl
        self.count = count0[block] + ci
        self._word_ix = self.word_off[block] + ci
        # bases: one per (template, lane), shared between templates of the same reference and axes
        self.bases: list = []
        base_id: dict = {}
        lane_base_off = np.zeros(nt + 1, dtype=np.int64)
        np.cumsum(n_lanes, out=lane_base_off[1:])
        lane_base = np.empty(int(lane_base_off[-1]), dtype=np.int64)
        lane_disc = np.zeros(int(lane_base_off[-1]), dtype=bool)
        shared: dict = {}
        memo: dict = {}
        self.lane_base, self.lane_base_off = lane_base, lane_base_off  # read by _concrete for forks
        for t, tpl in enumerate(self.templates):
            ref, axes, discarded = tpl.ref, tpl.axes, tpl.discarded
            lo, hi = lane_base_off[t], lane_base_off[t + 1]
            lane_disc[lo:hi] = discarded
            if type(ref) is RootKey:
                bid = base_id.get(ref)
                if bid is None:
                    bid = base_id[ref] = len(self.bases)
                    self.bases.append(ref)
                lane_base[lo:hi] = bid
                continue
            key = (ref, axes)
            ids = shared.get(key)
            if ids is None:
                ids = []
                for lane in _lanes(axes, sizes):
                    concrete = resolve(ref, dict(zip(axes, lane)), memo, self.templates, self._fork)
                    if concrete is None:
                        ids.append(-1)
                        continue
                    bid = base_id.get(concrete)
                    if bid is None:
                        bid = base_id[concrete] = len(self.bases)
                        self.bases.append(concrete)
                    ids.append(bid)
                shared[key] = ids
            lane_base[lo:hi] = ids
        # a lane entry: one (template, lane); every row belongs to one (rows_lane)
        self.lane_disc = lane_disc
        self.rows_lane = lane_base_off[block] + self.lane_ix
        self.base = lane_base[self.rows_lane]
        self.discarded = lane_disc[self.rows_lane] | (self.base < 0)

    # ------------------------------------------------------------------ construction helpers
    def _fork(self, template: int, lane: tuple):
        """A jit fork's ForkKey in `lane`, found from the template's start (forks have n = 1)."""
        li = _lane_index(lane, self.templates[template].axes, self.axis_size)
        if self.lane_base[self.lane_base_off[template] + li] < 0:
            return None  # a fork of a key that never exists never exists either
        return ForkKey(int(self.start[template]) + li)

    # ------------------------------------------------------------------ rows
    def lane_ids(self) -> np.ndarray:
        """Per row, an id of its lane tuple (0 for `()`, outside every transform): rows with equal
        ids have equal `Derivation.lane`."""
        return self.lane_entry_ids()[self.rows_lane]

    def lane_entry_ids(self) -> np.ndarray:
        """lane_ids per lane entry (template, lane)."""
        ids: dict = {(): 0}
        per = np.zeros(len(self.lane_base), dtype=np.int64)
        sizes = self.axis_size
        for t, tpl in enumerate(self.templates):
            axes = tpl.axes
            if axes:
                lo = int(self.lane_base_off[t])
                per[lo : lo + int(self.n_lanes[t])] = [ids.setdefault(lane, len(ids)) for lane in _lanes(axes, sizes)]
        return per

    def __len__(self) -> int:
        return self.n

    def lane_of(self, i: int) -> tuple[int, ...]:
        axes = self.templates[int(self.block[i])].axes
        li = int(self.lane_ix[i])
        out = []
        for a in reversed(axes):
            li, x = divmod(li, self.axis_size[a])
            out.append(x)
        return tuple(reversed(out))

    def derivation(self, i: int) -> Derivation:
        """Row i as the plain path's Derivation."""
        tpl = self.templates[int(self.block[i])]
        path, req, used, kind, label, suffix, loc, draw, notes = (
            tpl.path,
            tpl.stream_requested,
            tpl.stream,
            tpl.kind,
            tpl.label,
            tpl.suffix,
            tpl.location,
            tpl.draw,
            tpl.notes,
        )
        count = int(self.count[i])
        items = suffix + (count,)
        b = int(self.base[i])
        return Derivation(
            i,
            path,
            req,
            used,
            count,
            kind,
            label,
            items,
            hash_input(items, self.sep),
            self.word_at(i),
            self.bases[b] if b >= 0 else None,
            loc,
            draw,
            notes,
            self.lane_of(i),
            bool(self.discarded[i]),
            tpl.batched,
        )

    def derivations(self, rows: Iterable[int] | None = None) -> list[Derivation]:
        return [self.derivation(int(i)) for i in (range(self.n) if rows is None else rows)]

    # ------------------------------------------------------------------ selection
    def select(self, streams: Sequence[str] = (), paths: Sequence[str] = (), limit: int | None = None) -> np.ndarray:
        """Row indices kept by the filters: a stream (requested or used) in `streams`, a path
        ('/'-joined, '(root)' for the root) matching a glob in `paths`, the first `limit` of them."""
        keep_t = np.ones(len(self.templates), dtype=bool)
        self.unmatched = ()
        if streams or paths:
            cache: dict = {}
            seen_streams: set[str] = set()
            texts: set[str] = set()
            for t, tpl in enumerate(self.templates):
                seen_streams.update((tpl.stream_requested, tpl.stream))
                p = tpl.path
                text = "/".join(p) if p else "(root)"
                texts.add(text)
                if streams and tpl.stream_requested not in streams and tpl.stream not in streams:
                    keep_t[t] = False
                    continue
                if paths:
                    hit = cache.get(p)
                    if hit is None:
                        hit = cache[p] = any(fnmatch.fnmatchcase(text, g) for g in paths)
                    keep_t[t] = hit
            self.unmatched = unmatched_filters(streams, paths, seen_streams, texts)
        rows = np.flatnonzero(keep_t[self.block]) if not keep_t.all() else np.arange(self.n, dtype=np.int64)
        if limit is not None:
            rows = rows[:limit]
        return rows

    # ------------------------------------------------------------------ keys
    def base_keys(self, engine: KeyEngine, words: dict[int, int] | None = None) -> BaseKeys:
        """The key data of `bases`, resolved on demand; `words` (row -> hash word) overrides the hash
        word of some rows, as if they hashed differently (a jit fork's row changes the keys derived from it)."""
        words = words or {}

        def fork(i: int) -> KeyData:
            word = words[i] if i in words else self.word_at(i)
            return engine.fold_in(bases.key(self.bases[int(self.base[i])]), word)

        bases = BaseKeys(engine, root_keys(self.spec, engine), fork, split_rows=True)
        return bases

    @paused
    def keys(self, engine: KeyEngine, rows: np.ndarray | None = None) -> np.ndarray:
        """Key data of `rows` (all rows by default), shape (len(rows), width); zeros where the key
        never exists (base -1)."""
        rows = np.arange(self.n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        resolver = self.base_keys(engine)
        base = self.base[rows]
        exists = base >= 0
        out = np.zeros((len(rows), engine.width), dtype=np.uint32)
        if not exists.any():
            return out
        used = np.unique(base[exists])
        table = np.zeros((len(self.bases), engine.width), dtype=np.uint32)
        for b in used.tolist():
            table[b] = resolver.key(self.bases[b])
        sel = np.flatnonzero(exists)
        out[sel] = engine.fold_in_rows(table[base[sel]], self.words_of(rows[sel]))
        return out

    def keys_with_words(self, engine: KeyEngine, words: dict[int, int]) -> np.ndarray:
        """Key data rows `words` (row -> hash word) would get if they hashed to those words, every other
        row as it is (a changed jit fork's row changes the keys derived from it); in `words`' order."""
        res = self.base_keys(engine, words)
        out = np.zeros((len(words), engine.width), dtype=np.uint32)
        for k, (i, w) in enumerate(words.items()):
            b = int(self.base[i])
            if b >= 0:
                out[k] = engine.fold_in(res.key(self.bases[b]), w)
        return out


def unmatched_filters(streams, paths, seen_streams: set[str], texts: set[str]) -> tuple[str, ...]:
    """A warning for each --stream / --path that matches no call site of the whole replay (a typo must not pass
    for an empty answer)."""
    out = []
    for s in dict.fromkeys(streams):
        if s not in seen_streams:
            have = ", ".join(sorted(seen_streams)) or "none"
            out.append(f"--stream {s} matches no call site (the streams asked for: {have})")
    for g in dict.fromkeys(paths):
        if not any(fnmatch.fnmatchcase(t, g) for t in texts):
            out.append(f"--path {g} matches no module path ('/'-joined, '(root)' for the root)")
    return tuple(out)


def _lanes(axes, sizes):
    from itertools import product

    return product(*(range(sizes[a]) for a in axes)) if axes else ((),)


def _lane_index(lane, axes, sizes) -> int:
    li = 0
    for x, a in zip(lane, axes):
        li = li * sizes[a] + x
    return li


@paused
def key_table(spec: Spec, blocks: Replayer | None = None, hashed: bool = True) -> KeyTable:
    """Replay `spec` on the fast path (or expand the replay `blocks` already made of it); `hashed=False`: hash
    words as they are read (KeyTable)."""
    return KeyTable(Replayer(spec, blocks=True).walk() if blocks is None else blocks, hashed)


__all__ = ["KeyTable", "key_table"]
