"""derive's text rows of a Linen replay made from its columns a chunk at a time, without a dict of cells per row:
each template's path, stream, label and hash-input prefix padded once, the numbers made text in C loops and
right-aligned by their digit counts (NumPy), a chunk's cells laid out as object columns and joined once. Line for
line what text_rows makes of each row's cells (tests compare both); used for uncoloured reports whose last column
is the key (a key never ends in a space, so no line needs stripping)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..engine.derive import TableCalls
from ..engine.hashing import hash_input
from .table_records import CHUNK, LaneTexts, objects
from .text_derive import _items

GAP = "  "
_POW10 = np.array([10**k for k in range(1, 20)], dtype=np.uint64)
_POW256 = np.array([256**k for k in range(8)], dtype=np.uint64)


def digits(x: np.ndarray) -> np.ndarray:
    """Decimal digits of each non-negative int."""
    return np.searchsorted(_POW10, x.astype(np.uint64), side="right") + 1


def _spaces(prefix: str, n: int) -> np.ndarray:
    return objects([prefix + " " * k for k in range(n + 1)])


def table_lines(
    calls: TableCalls, cols: list[str], widths: dict[str, int], limit: int, start: int = 0
) -> Iterator[tuple[str, int]]:
    """The lines of the rows at positions start..limit-1 (start a multiple of CHUNK), as (text, rows) a chunk at a
    time: `#` then `cols` (the last one `key`), each cell padded to its column's width, GAP between."""
    from .text_rows import cells, shown

    assert cols and cols[-1] == "key"
    table, rows, keys = calls.table, calls.rows[:limit], calls.keys_upto(limit)
    nt = len(table.templates)
    sep = "00" if table.sep else ""
    widest = max(widths.values()) + 2
    pad = _spaces("", widest)  # pad[k]: k spaces
    gap_pad = _spaces(GAP, widest)  # GAP then k spaces (a right-aligned number's lead)
    made = np.zeros(nt, dtype=bool)
    path = np.empty(nt, dtype=object)
    stream = np.empty(nt, dtype=object)
    label = np.empty(nt, dtype=object)
    items = np.empty(nt, dtype=object)  # GAP, "(items, " (the hash input without its count)
    items_cells = np.zeros(nt, dtype=np.int64)
    one_item = np.zeros(nt, dtype=bool)  # the count is the only item: "(3,)"
    pre_hex = np.empty(nt, dtype=object)
    pre_len = np.zeros(nt, dtype=np.int64)

    def cell(text: str, column: str) -> str:
        return GAP + text + " " * (widths[column] - cells(text))

    def templates(ts: np.ndarray) -> None:
        for x in np.unique(ts[~made[ts]]).tolist():
            made[x] = True
            tpl = table.templates[x]
            fallback = tpl.stream != tpl.stream_requested
            path[x] = cell(shown("/".join(tpl.path) if tpl.path else "(root)"), "path")
            stream[x] = cell(shown(f"{tpl.stream_requested}->{tpl.stream}" if fallback else tpl.stream), "stream")
            label[x] = cell(shown(tpl.label or ""), "label")
            text = _items(tpl.suffix + (0,))[: -(2 if tpl.suffix else 3)]
            items[x] = GAP + text
            items_cells[x] = cells(text)
            one_item[x] = not tpl.suffix
            pre_hex[x] = GAP + hash_input(tpl.suffix, table.sep).hex() + sep
            pre_len[x] = len(pre_hex[x]) - len(GAP)

    lanes = LaneTexts(table, GAP, ",", "", GAP + " " * widths.get("lane", 0), len(GAP) + widths.get("lane", 0))
    discarded_lane = cell("discarded", "lane") if "lane" in widths else ""
    close_one, close_more = _spaces(",)", widest), _spaces(")", widest)
    counts = objects(list(map(str, range(1 << 12))))
    hexes = objects([c.to_bytes((c.bit_length() + 7) // 8, "big").hex() for c in range(1 << 12)])
    width = keys.shape[1] if keys.ndim == 2 else 0
    for j0 in range(start, len(rows), CHUNK):
        r = rows[j0 : j0 + CHUNK]
        m = len(r)
        t = table.block[r]
        templates(t)
        c = table.count[r]
        if int(c.max()) < len(counts):
            cs = counts[c]
            ch = hexes[c]
        else:
            cl = c.tolist()
            cs = objects(list(map(str, cl)))
            ch = objects([x.to_bytes((x.bit_length() + 7) // 8, "big").hex() for x in cl])
        nd = digits(c)
        pieces: list = [pad[np.maximum(widths["#"] - digits(r), 0)], objects(list(map(str, r.tolist())))]
        for col in cols:
            w = widths[col]
            if col == "path":
                pieces.append(path[t])
            elif col == "stream":
                pieces.append(stream[t])
            elif col == "label":
                pieces.append(label[t])
            elif col == "lane":
                lane = lanes(t, table.lane_ix[r])
                disc = np.flatnonzero(table.discarded[r])
                lane[disc] = discarded_lane
                pieces.append(lane)
            elif col == "count":
                pieces += [gap_pad[np.maximum(w - nd, 0)], cs]
            elif col == "word":
                word = table.words_of(r)
                pieces += [gap_pad[np.maximum(w - digits(word), 0)], objects(list(map(str, word.tolist())))]
            elif col == "hash-input":
                one = one_item[t]
                room = np.maximum(w - items_cells[t] - nd - np.where(one, 2, 1), 0)
                pieces += [items[t], cs, np.where(one, close_one[room], close_more[room])]
            elif col == "bytes":
                hex_len = 2 * np.searchsorted(_POW256, c.astype(np.uint64), side="right")
                pieces += [pre_hex[t], ch, pad[np.maximum(w - pre_len[t] - hex_len, 0)]]
            elif col == "key":
                k = keys[j0 : j0 + m]
                key: list = [GAP + "["]
                for x in range(width):
                    key += [objects(list(map(str, k[:, x].tolist()))), " " if x < width - 1 else "]"]
                gone = np.flatnonzero(table.base[r] < 0)
                if len(gone):
                    key = [np.full(m, p, dtype=object) if isinstance(p, str) else p for p in key]
                    key[0][gone] = GAP + "(traced, discarded)"
                    for p in key[1:]:
                        p[gone] = ""
                pieces += key
            else:
                raise AssertionError(f"no column {col!r}")  # (text_rows.COLUMNS names every column)
        pieces.append("\n")
        out = np.empty((m, len(pieces)), dtype=object)
        for x, p in enumerate(pieces):
            out[:, x] = p
        yield "".join(out.ravel().tolist()), m
