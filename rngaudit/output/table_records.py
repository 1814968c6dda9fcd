"""A Linen replay's call records (`--format jsonl` and `json`) made from its columns a chunk of rows at a time:
each template's record is encoded once, with a placeholder where a row's value goes (base, count, discarded, the
hash input's count bytes, the count in hash_items, hash word, index, key, lane); a chunk's pieces are laid out as
NumPy object columns (a template's text is indexed, not copied) and joined once, the numbers made text by `str`
in C loops. Byte for byte what encoding each record whole makes (tests compare it with the plain path's)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..engine.derive import TableCalls
from ..engine.hashing import hash_input
from ..engine.table import KeyTable

SLOTS = ("base", "count", "discarded", "hash_hex", "count_item", "hash_word", "index", "key", "lane")
CHUNK = (
    1 << 10
)  # rows laid out at once: a chunk's text stays well under a MB (large transient strings cost page faults)
_SMALL = 1 << 16  # counts whose text (decimal and hex) is kept


def slot(name: str) -> str:
    return f"\x00rngaudit:{name}\x00"


@dataclass(frozen=True)
class Layout:
    """How one format lays a call record out: `encode` (a record dict -> its text as it stands in the output),
    the text around a key's words and a lane's indices (`open`, `between`, `close`; an empty lane is `[]`),
    `lead` before every record but the first, `end` after each, `extra` fields of every record, and `whole`
    (row position -> the record encoded whole, for rows with drawn values)."""

    encode: Callable[[dict], str]
    open: str
    between: str
    close: str
    lead: str
    end: str
    extra: dict
    whole: Callable[[int], str]


def record_template(table: KeyTable, t: int, layout: Layout) -> list[str] | None:
    """Template t's record as `layout` encodes it, cut at the placeholders (in SLOTS order): 10 pieces of text
    around 9 slots; None if a placeholder is not found exactly once (a name holding its text)."""
    tpl = table.templates[t]
    sep = "00" if table.sep else ""
    record = {
        **layout.extra,
        "index": slot("index"),
        "path": list(tpl.path),
        "path_str": "/".join(tpl.path) if tpl.path else "(root)",
        "stream_requested": tpl.stream_requested,
        "stream": tpl.stream,
        "fallback": tpl.stream_requested != tpl.stream,
        "count": slot("count"),
        "kind": tpl.kind,
        "label": tpl.label,
        "hash_items": [*tpl.suffix, slot("count_item")],
        "hash_input_hex": hash_input(tpl.suffix, table.sep).hex() + sep + slot("hash_hex"),
        "hash_word": slot("hash_word"),
        "base": slot("base"),
        "key": slot("key"),
        "lane": slot("lane"),
        "discarded": slot("discarded"),
        "notes": list(tpl.notes),
        "location": tpl.location.as_json(),
    }
    text = layout.encode(record)
    pieces = []
    for marker in _MARKERS:
        before, found, text = text.partition(marker)
        if not found or marker in text or marker in before:
            return None
        pieces.append(before)
    pieces.append(text)
    return pieces


# each slot's placeholder as it stands in the encoded record (the hex one inside its string)
_MARKERS = tuple(json.dumps(slot(name))[1:-1] if name == "hash_hex" else json.dumps(slot(name)) for name in SLOTS)


def objects(texts) -> np.ndarray:
    out = np.empty(len(texts), dtype=object)
    out[:] = texts
    return out


_BOOLS = objects(["false", "true"])


def _hex(c: int) -> str:
    return c.to_bytes((c.bit_length() + 7) // 8, "big").hex()


class _Texts:
    """What rows share, made once: each template's pieces (object columns indexed by template), each base's
    JSON, the small counts' decimal and hex text."""

    def __init__(self, table: KeyTable, layout: Layout):
        self.table, self.layout = table, layout
        nt = len(table.templates)
        self.pieces = np.empty((10, nt), dtype=object)
        self.whole = np.zeros(nt, dtype=bool)  # templates whose records are encoded whole
        self.made = np.zeros(nt, dtype=bool)
        self.bases = np.empty(len(table.bases) + 1, dtype=object)  # base b at b + 1 (-1: null)
        self.bases[0] = "null"
        self.base_made = np.zeros(len(table.bases) + 1, dtype=bool)
        self.base_made[0] = True
        self.counts = self.hexes = np.empty(0, dtype=object)

    def templates(self, ts: np.ndarray) -> None:
        table = self.table
        for t in np.unique(ts[~self.made[ts]]).tolist():
            self.made[t] = True
            pieces = record_template(table, t, self.layout)
            if pieces is None:
                self.whole[t] = True
                continue
            self.pieces[:, t] = pieces

    def base_texts(self, b: np.ndarray) -> np.ndarray:
        for x in np.unique(b[~self.base_made[b + 1]]).tolist():
            self.base_made[x + 1] = True
            self.bases[x + 1] = json.dumps(str(self.table.bases[x]), ensure_ascii=False)
        return self.bases[b + 1]

    def count_texts(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        top = int(c.max())
        if top >= _SMALL:
            cs = c.tolist()
            return objects(list(map(str, cs))), objects(list(map(_hex, cs)))
        if top >= len(self.counts):
            n = max(top + 1, min(2 * len(self.counts), _SMALL), 256)
            self.counts = objects(list(map(str, range(n))))
            self.hexes = objects(list(map(_hex, range(n))))
        return self.counts[c], self.hexes[c]


class LaneTexts:
    """Each row's lane as text (its indices inside `open`, `between`, `close`, padded to `width`; `none` where its
    template has no lane axes), each lane made once."""

    def __init__(self, table: KeyTable, open: str, between: str, close: str, none: str, width: int = 0):
        self.table, self.open, self.between, self.close, self.none = table, open, between, close, none
        self.width = width  # each text padded with spaces to this width (0: as it is)
        self.axes_set = np.full(len(table.templates), -2, dtype=np.int64)  # -2: not looked at; -1: no axes
        self.sizes: list[tuple[int, ...]] = []
        self.known: list[dict[int, str]] = []

    def __call__(self, t: np.ndarray, lix: np.ndarray) -> np.ndarray:
        """The lane texts of rows of templates `t` with lane indices `lix`."""
        table = self.table
        for x in np.unique(t[self.axes_set[t] == -2]).tolist():
            axes = table.templates[x].axes
            if not axes:
                self.axes_set[x] = -1
                continue
            sizes = tuple(table.axis_size[a] for a in axes)
            if sizes not in self.sizes:
                self.sizes.append(sizes)
                self.known.append({})
            self.axes_set[x] = self.sizes.index(sizes)
        sets = self.axes_set[t]
        out = np.full(len(t), self.none, dtype=object)
        for s in np.unique(sets[sets >= 0]).tolist():
            at = np.flatnonzero(sets == s)
            known, sizes = self.known[s], self.sizes[s]
            ix = lix[at]
            for li in np.unique(ix).tolist():
                if li not in known:
                    lane, rest = [], li
                    for size in reversed(sizes):
                        rest, x = divmod(rest, size)
                        lane.append(str(x))
                    known[li] = (self.open + self.between.join(reversed(lane)) + self.close).ljust(self.width)
            out[at] = [known[li] for li in ix.tolist()]
        return out


def table_records(
    calls: TableCalls, layout: Layout, start: int = 0, stop: int | None = None
) -> Iterator[tuple[str, int]]:
    """The call records of `calls`' rows (those at positions start..stop-1; start a multiple of CHUNK), in order,
    as (text, rows) a chunk at a time; a record with drawn values, or of a template whose names hold a
    placeholder's text, is `layout.whole` of its row."""
    table, rows, keys = calls.table, calls.rows, calls.keys
    texts = _Texts(table, layout)
    lanes = LaneTexts(table, layout.open, layout.between, layout.close, "[]")
    special = np.array(sorted(calls.values), dtype=np.int64)
    width = keys.shape[1] if keys.ndim == 2 else 0
    n_cols = 21 + 2 * width
    step = CHUNK
    stop = len(rows) if stop is None else stop
    for j0 in range(start, stop, step):
        r = rows[j0 : min(j0 + step, stop)]
        m = len(r)
        t = table.block[r]
        texts.templates(t)
        b = table.base[r]
        cs, ch = texts.count_texts(table.count[r])
        p = texts.pieces
        cols = np.empty((m, n_cols), dtype=object)
        cols[:, 0] = layout.lead
        if j0 == 0:
            cols[0, 0] = ""
        cols[:, 1] = p[0, t]
        cols[:, 2] = texts.base_texts(b)
        cols[:, 3] = p[1, t]
        cols[:, 4] = cs
        cols[:, 5] = p[2, t]
        cols[:, 6] = _BOOLS[table.discarded[r].astype(np.intp)]
        cols[:, 7] = p[3, t]
        cols[:, 8] = ch
        cols[:, 9] = p[4, t]
        cols[:, 10] = cs
        cols[:, 11] = p[5, t]
        cols[:, 12] = list(map(str, table.words_of(r).tolist()))
        cols[:, 13] = p[6, t]
        cols[:, 14] = list(map(str, r.tolist()))
        cols[:, 15] = p[7, t]
        exists = b >= 0
        k = keys[j0 : j0 + m]
        for w in range(width):
            cols[:, 16 + 2 * w] = layout.open if w == 0 else layout.between
            cols[:, 17 + 2 * w] = list(map(str, k[:, w].tolist()))
        key_end = 16 + 2 * width
        cols[:, key_end] = layout.close
        if not exists.all():
            gone = np.flatnonzero(~exists)
            cols[gone, 16:key_end] = ""
            cols[gone, key_end] = "null"
        cols[:, key_end + 1] = p[8, t]
        cols[:, key_end + 2] = lanes(t, table.lane_ix[r])
        cols[:, key_end + 3] = p[9, t]
        cols[:, key_end + 4] = layout.end
        yield _joined(cols, texts.whole[t], special, j0, layout), m


_NNX_MARKERS = tuple(json.dumps(slot(name)) for name in ("count", "index", "key"))


def nnx_records(
    calls, layout: Layout, template: Callable[[int], dict], start: int = 0, stop: int | None = None
) -> Iterator[tuple[str, int]]:
    """The call records of an NNX report's rows (NnxCalls; those at positions start..stop-1, start a multiple of
    CHUNK), in order, as (text, rows) a chunk at a time:
    `template(b)` is block b's record with placeholders for the count, index and key (a block's rows differ in
    those only); a row with drawn values, or of a block whose names hold a placeholder's text, is
    `layout.whole` of its row."""
    table = calls.table
    rows = calls.rows()
    nb = len(table.blocks)
    pieces = np.empty((4, nb), dtype=object)
    whole = np.zeros(nb, dtype=bool)
    made = np.zeros(nb, dtype=bool)
    special = np.array(sorted(calls.values), dtype=np.int64)
    width = table.keys.shape[1]
    step = CHUNK
    stop = len(rows) if stop is None else stop
    for j0 in range(start, stop, step):
        r = rows[j0 : min(j0 + step, stop)]
        m = len(r)
        t = table.block[r]
        for b in np.unique(t[~made[t]]).tolist():
            made[b] = True
            text = layout.encode(template(b))
            cut = []
            for marker in _NNX_MARKERS:
                before, found, text = text.partition(marker)
                if not found or marker in text or marker in before:
                    whole[b] = True
                    break
                cut.append(before)
            else:
                pieces[:, b] = [*cut, text]
        k = table.keys[r]
        cols = np.empty((m, 9 + 2 * width), dtype=object)
        cols[:, 0] = layout.lead
        if j0 == 0:
            cols[0, 0] = ""
        cols[:, 1] = pieces[0, t]
        cols[:, 2] = list(map(str, table.count[r].tolist()))
        cols[:, 3] = pieces[1, t]
        cols[:, 4] = list(map(str, r.tolist()))
        cols[:, 5] = pieces[2, t]
        for w in range(width):
            cols[:, 6 + 2 * w] = layout.open if w == 0 else layout.between
            cols[:, 7 + 2 * w] = list(map(str, k[:, w].tolist()))
        cols[:, 6 + 2 * width] = layout.close
        cols[:, 7 + 2 * width] = pieces[3, t]
        cols[:, 8 + 2 * width] = layout.end
        yield _joined(cols, whole[t], special, j0, layout), m


def _joined(cols: np.ndarray, whole: np.ndarray, special: np.ndarray, j0: int, layout: Layout) -> str:
    """A chunk's text (its first row at position j0): the pieces of each row joined, but the rows `whole` marks
    and those at the positions `special` (drawn values) are `layout.whole` of the row, between its lead and end."""
    redo = np.flatnonzero(whole)
    if len(special):
        lo, hi = np.searchsorted(special, [j0, j0 + len(cols)])
        redo = np.union1d(redo, special[lo:hi] - j0)
    for x in redo.tolist():
        lead = cols[x, 0]
        cols[x, :] = ""
        cols[x, 0] = lead + layout.whole(j0 + x)
        cols[x, -1] = layout.end
    return "".join(cols.ravel().tolist())


__all__ = [
    "SLOTS",
    "LaneTexts",
    "Layout",
    "nnx_records",
    "objects",
    "record_template",
    "slot",
    "table_records",
]
