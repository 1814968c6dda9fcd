"""derive's fast path: the same replay as `replay.Replayer`, recorded in blocks and expanded into
columns. A repeated `make_rng` is one template whose counts are consecutive; a template made inside
vmap/scan lanes is hashed once and expanded over its lanes with NumPy; SHA-1 runs once per distinct
hash input, in one tight loop; Threefry runs once, vectorised over every selected row. The plain path
(`replay.replay` + `keys.derive_keys`) stays the reference: tests check the two agree row for row.

No JAX here, except for the unsafe_rbg impl (`keys.KeyEngine`)."""
from __future__ import annotations

import fnmatch
import hashlib
from typing import Iterable, Sequence

import numpy as np

from ..gcpause import paused
from ..spec.tree import Spec
from . import threefry
from .hashing import hash_input
from .keys import KeyData, KeyEngine, root_keys
from .records import Derivation
from .refs import FoldKey, ForkKey, RootKey, SplitKey
from .refs import concrete as resolve
from .replay import Replayer

_sha1 = hashlib.sha1
ENC_CACHE = 1 << 17  # counts whose bytes are kept (per separator setting); larger ones are made as needed
_ENC: list[bytes] = [b""]  # _ENC[c]: Flax's bytes for the int c (minimal big-endian)
_ENC_SEP: list[bytes] = [b"\x00"]
CHUNK = 1 << 16  # hash inputs per chunk: the digests in flight stay bounded


def _encodings(upto: int, sep: bool) -> list[bytes]:
    """The bytes Flax hashes for counts 0..upto (with the separator's 0 byte first), cached up to
    ENC_CACHE; beyond it, use _encode_range."""
    enc = _ENC_SEP if sep else _ENC
    upto = min(upto, ENC_CACHE)
    if len(enc) <= upto:
        start = len(enc)
        fresh = [c.to_bytes((c.bit_length() + 7) // 8, "big") for c in range(start, min(max(upto + 1, 2 * start),
                                                                                          ENC_CACHE + 1))]
        enc.extend([b"\x00" + e for e in fresh] if sep else fresh)
    return enc


def _encode_range(c0: int, c1: int, sep: bool) -> list[bytes]:
    """The bytes of counts c0..c1-1 (any size): from the cache where it has them."""
    if c1 - 1 <= ENC_CACHE:
        return _encodings(c1 - 1, sep)[c0:c1]
    head = b"\x00" if sep else b""
    return [head + c.to_bytes((c.bit_length() + 7) // 8, "big") for c in range(c0, c1)]


class KeyTable:
    """Every key request of a replay, as columns (one entry per row, rows in execution order):
    `block` (its template), `count`, `word` (the hash word), `base` (an index into `bases`, -1 for a
    key that never exists), `lane_ix` (index of its lane in the template's lanes) and `discarded`."""

    def __init__(self, r: Replayer):
        self.spec: Spec = r.spec
        self.sep = r.sep
        self.templates = r.templates
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
            count0[t] = tpl.count
        self.n_lanes = n_lanes
        per = n_counts * n_lanes
        self.start = np.zeros(nt + 1, dtype=np.int64)
        np.cumsum(per, out=self.start[1:])
        n = int(self.start[-1])
        self.n = n
        self.word_off = np.zeros(nt + 1, dtype=np.int64)
        np.cumsum(n_counts, out=self.word_off[1:])
        # the hash words: a large replay's last ones come from a forked child while this process
        # makes the other columns
        head, child = self._start_words()
        try:
            self._columns(nt, n, per, n_lanes, count0)
        except BaseException:
            if child is not None:
                child.cancel()
            raise
        self.words = head if child is None else np.concatenate([head, child.finish()])
        self.word = self.words[self._word_ix]
        del self._word_ix

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
    def _start_words(self) -> tuple[np.ndarray, "_Child | None"]:
        """The hash word of every (template, count): SHA-1 once per distinct input. A large replay
        is hashed by two processes: a forked child hashes the last templates and writes their words
        to a pipe, read by child.finish(); this process hashes the first ones (a little fewer: it
        makes the other columns next). Returns (this process's words, the child or None)."""
        templates = self.templates
        total = int(self.word_off[-1])
        if total >= PARALLEL_HASHES and _can_fork():
            # the first template whose words start past this process's share
            mid = int(np.searchsorted(self.word_off[1:], int(total * PARENT_SHARE), side="right"))
            split = int(self.word_off[mid])
            if 0 < split < total:
                child = _Child.start(lambda: _hash_templates(templates[mid:], self.sep, total - split), total - split)
                if child is not None:
                    try:
                        return _hash_templates(templates[:mid], self.sep, split), child
                    except BaseException:
                        child.cancel()
                        raise
        return _hash_templates(templates, self.sep, total), None

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
                per[lo:lo + int(self.n_lanes[t])] = [ids.setdefault(lane, len(ids)) for lane in _lanes(axes, sizes)]
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
        path, req, used, kind, label, suffix, loc, draw, notes = (tpl.path, tpl.stream_requested, tpl.stream, tpl.kind,
                                                                  tpl.label, tpl.suffix, tpl.location, tpl.draw,
                                                                  tpl.notes)
        count = int(self.count[i])
        items = suffix + (count,)
        b = int(self.base[i])
        return Derivation(i, path, req, used, count, kind, label, items, hash_input(items, self.sep),
                          int(self.word[i]), self.bases[b] if b >= 0 else None, loc, draw, notes, self.lane_of(i),
                          bool(self.discarded[i]))

    def derivations(self, rows: Iterable[int] | None = None) -> list[Derivation]:
        return [self.derivation(int(i)) for i in (range(self.n) if rows is None else rows)]

    # ------------------------------------------------------------------ selection
    def select(self, streams: Sequence[str] = (), paths: Sequence[str] = (), limit: int | None = None) -> np.ndarray:
        """Row indices kept by the filters: a stream (requested or used) in `streams`, a path
        ('/'-joined, '(root)' for the root) matching a glob in `paths`, the first `limit` of them."""
        keep_t = np.ones(len(self.templates), dtype=bool)
        if streams or paths:
            cache: dict = {}
            for t, tpl in enumerate(self.templates):
                if streams and tpl.stream_requested not in streams and tpl.stream not in streams:
                    keep_t[t] = False
                    continue
                if paths:
                    p = tpl.path
                    hit = cache.get(p)
                    if hit is None:
                        text = "/".join(p) if p else "(root)"
                        hit = cache[p] = any(fnmatch.fnmatchcase(text, g) for g in paths)
                    keep_t[t] = hit
        rows = np.flatnonzero(keep_t[self.block]) if not keep_t.all() else np.arange(self.n, dtype=np.int64)
        if limit is not None:
            rows = rows[:limit]
        return rows

    # ------------------------------------------------------------------ keys
    @paused
    def keys(self, engine: KeyEngine, rows: np.ndarray | None = None) -> np.ndarray:
        """Key data of `rows` (all rows by default), shape (len(rows), width); zeros where the key
        never exists (base -1)."""
        rows = np.arange(self.n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        resolver = _Bases(self, engine)
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
        if engine.impl == "unsafe_rbg":
            for b in used.tolist():
                idx = sel[base[sel] == b]
                out[idx] = engine.fold_in_many(tuple(int(w) for w in table[b]), self.word[rows[idx]])
            return out
        out[sel] = _fold_in_rows(engine, table[base[sel]], self.word[rows[sel]])
        return out


def keys_with_words(table: "KeyTable", engine: KeyEngine, words: dict) -> np.ndarray:
    """Key data rows `words` (row -> hash word) would get if they hashed to those words, every other
    row as it is (a changed jit fork's row changes the keys derived from it); in `words`' order."""
    res = _Bases(table, engine, words)
    out = np.zeros((len(words), engine.width), dtype=np.uint32)
    for k, (i, w) in enumerate(words.items()):
        b = int(table.base[i])
        if b >= 0:
            out[k] = engine.fold_in_many(res.key(table.bases[b]), np.array([w], dtype=np.uint32))[0]
    return out


class _Bases:
    """Key data of base references, memoised; a split is computed for all its rows at once.
    `words` overrides the hash word of some rows (a jit fork's row hashed differently)."""

    def __init__(self, table: KeyTable, engine: KeyEngine, words: dict | None = None):
        self.t = table
        self.engine = engine
        self.words = words or {}
        self.roots = root_keys(table.spec, engine)
        self.memo: dict = {}
        self.splits: dict = {}

    def key(self, ref) -> KeyData:
        hit = self.memo.get(ref)
        if hit is not None:
            return hit
        e = self.engine
        if type(ref) is RootKey:
            hit = self.roots[ref.stream]
        elif type(ref) is SplitKey:
            parent = self.key(ref.parent)
            rows = self.splits.get((parent, ref.n))
            if rows is None:
                rows = self.splits[(parent, ref.n)] = _split_all(e, parent, ref.n)
            hit = tuple(int(w) for w in rows[ref.index])
        elif type(ref) is FoldKey:
            hit = tuple(int(w) for w in e.fold_in_many(self.key(ref.parent), np.array([ref.data]))[0])
        elif type(ref) is ForkKey:
            i = ref.index
            b = int(self.t.base[i])
            word = np.array([self.words[i]], dtype=np.uint32) if i in self.words else self.t.word[i:i + 1]
            hit = tuple(int(w) for w in e.fold_in_many(self.key(self.t.bases[b]), word)[0])
        else:
            raise TypeError(ref)
        self.memo[ref] = hit
        return hit


def _split_all(e: KeyEngine, key: KeyData, n: int) -> np.ndarray:
    """Every row of jax.random.split(key, n) as key data, shape (n, width)."""
    if e.impl == "threefry2x32":
        return _split_rows(key, n, e.partitionable)
    if e.impl == "rbg":
        return np.concatenate([_split_rows(key[:2], n, e.partitionable),
                               _split_rows(key[2:], n, e.partitionable)], axis=1)
    return np.array([e.split(key, n, i) for i in range(n)], dtype=np.uint32).reshape(n, e.width)


def _fold_in_rows(e: KeyEngine, keys: np.ndarray, words: np.ndarray) -> np.ndarray:
    """fold_in(keys[i], words[i]) for every row (threefry2x32 and rbg), shape (len, width)."""
    words = np.asarray(words, dtype=np.uint32)
    if e.impl == "threefry2x32":
        return _threefry_fold_in_rows(keys, words)
    # mirrors jax/_src/random/rbg.py _rbg_fold_in: threefry fold_in on each 2-word half
    return np.concatenate([_threefry_fold_in_rows(keys[:, :2], words),
                           _threefry_fold_in_rows(keys[:, 2:], words)], axis=1)


PARALLEL_HASHES = 200_000  # replays with at least this many hash inputs are hashed by two processes
PARENT_SHARE = 0.45  # of them, this process hashes this share (it makes the other columns meanwhile)


def _can_fork() -> bool:
    """Forking is safe here: a POSIX fork, two CPUs, no JAX (its runtime's threads), and no other thread
    but a progress bar's (rngaudit.progress.THREADS: they hold nothing the child, which only hashes and
    writes to its pipe, needs)."""
    import os
    import sys
    import threading

    if not hasattr(os, "fork") or os.environ.get("RNGAUDIT_HASH_PROCESSES") == "1" or "jax" in sys.modules:
        return False
    progress = sys.modules.get("rngaudit.output.progress")
    ours = progress.THREADS if progress is not None else ()
    me = threading.current_thread()
    if any(t is not me and t not in ours for t in threading.enumerate()):
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except AttributeError:
        return (os.cpu_count() or 1) >= 2


def _hash_templates(templates, sep: bool, total: int) -> np.ndarray:
    """Hash words of `templates`' inputs, in order: one tight SHA-1 loop, words taken in chunks."""
    sha1 = _sha1
    out = np.empty(total, dtype=np.uint32)
    done = 0
    digests: list[bytes] = []

    def flush() -> None:
        # the digests so far -> their first 4 bytes, big-endian
        nonlocal done
        words = np.frombuffer(b"".join(digests), dtype=">u4").reshape(-1, 5)[:, 0]
        out[done:done + len(words)] = words
        done += len(words)
        digests.clear()

    enc = _encodings(0, sep)
    for tpl in templates:
        pre = hash_input(tpl.suffix, sep)
        c0, k = tpl.count, tpl.n
        if k == 1 and c0 <= ENC_CACHE:
            if c0 >= len(enc):
                enc = _encodings(c0, sep)
            digests.append(sha1(pre + enc[c0]).digest())
        else:
            for a in range(c0, c0 + k, CHUNK):
                digests += [sha1(pre + e).digest() for e in _encode_range(a, min(a + CHUNK, c0 + k), sep)]
                if len(digests) >= CHUNK:
                    flush()
        if len(digests) >= CHUNK:
            flush()
    if digests:
        flush()
    return out


class _Child:
    """uint32 words make() made by a forked child and written to a pipe, read when finish() is called
    (the parent works meanwhile). Start only where _can_fork() allows."""

    def __init__(self, pid: int, r: int, n: int, make):
        self.pid, self.r, self.n, self.make = pid, r, n, make

    @classmethod
    def start(cls, make, n: int) -> "_Child | None":
        """Fork a child that writes make() (n uint32 words); None if no child could be made."""
        import os
        import warnings

        try:
            r, w = os.pipe()
        except OSError:
            return None
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns of any fork beside threads; _can_fork allowed only a progress bar's
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:  # e.g. EAGAIN under a process limit, ENOMEM
            os.close(r)
            os.close(w)
            return None
        if pid == 0:  # the child: hash, write the words, leave without running any cleanup
            code = 1
            try:
                os.close(r)
                data = memoryview(np.ascontiguousarray(make(), dtype=np.uint32).tobytes())
                while data:
                    data = data[os.write(w, data):]
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        return cls(pid, r, n, make)

    def finish(self) -> np.ndarray:
        """The child's words; made here if the child failed."""
        import os

        chunks: list[bytes] = []
        try:
            while True:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:  # the pipe failed
            self.cancel()
            return self.make()
        except BaseException:
            self.cancel()
            raise
        status = self._reap()
        data = b"".join(chunks)
        if status != 0 or len(data) != 4 * self.n:
            return self.make()
        return np.frombuffer(data, dtype=np.uint32)

    def cancel(self) -> None:
        """End the child at once (an interrupt or an error in the parent meanwhile)."""
        import os
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self._reap()

    def _reap(self) -> int:
        import os

        if self.r is not None:
            os.close(self.r)
            self.r = None
        while True:
            try:
                return os.waitpid(self.pid, 0)[1]
            except InterruptedError:
                continue
            except ChildProcessError:
                return 1




def _threefry_fold_in_rows(keys: np.ndarray, words: np.ndarray) -> np.ndarray:
    """threefry fold_in with a key per row: keys (n, 2), words (n,) -> (n, 2)."""
    # mirrors jax/_src/random/threefry2x32.py threefry_fold_in: threefry_2x32(key, threefry_seed(data))
    y0, y1 = threefry.threefry2x32(keys[:, 0], keys[:, 1], np.zeros_like(words), words)
    return np.stack([y0, y1], axis=-1)


def _split_rows(key: KeyData, n: int, partitionable: bool) -> np.ndarray:
    """jax.random.split(key, n) for threefry2x32 key data, shape (n, 2)."""
    if partitionable:
        # mirrors _threefry_split_foldlike: the counts are (hi, lo) of the row index
        i = np.arange(n, dtype=np.uint64)
        y0, y1 = threefry.threefry2x32(key[0], key[1], (i >> np.uint64(32)).astype(np.uint32),
                                       (i & np.uint64(0xFFFFFFFF)).astype(np.uint32))
        return np.stack([y0, y1], axis=-1)
    # mirrors _threefry_split_original: threefry_2x32(key, iota(2n)).reshape(n, 2)
    y0, y1 = threefry.threefry2x32(key[0], key[1], np.arange(n, dtype=np.uint32),
                                   np.arange(n, 2 * n, dtype=np.uint32))
    return np.concatenate([y0, y1]).reshape(n, 2)


def _lanes(axes, sizes):
    from itertools import product

    return product(*(range(sizes[a]) for a in axes)) if axes else ((),)


def _lane_index(lane, axes, sizes) -> int:
    li = 0
    for x, a in zip(lane, axes):
        li = li * sizes[a] + x
    return li


@paused
def key_table(spec: Spec, blocks: Replayer | None = None) -> KeyTable:
    """Replay `spec` on the fast path (or expand the replay `blocks` already made of it)."""
    return KeyTable(Replayer(spec, blocks=True).walk() if blocks is None else blocks)


__all__ = ["KeyTable", "key_table"]
