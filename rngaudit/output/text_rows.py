"""`derive`'s text report for Linen specs, written as it is made: fixed-width columns whose widths are known before
the first row (from the templates and the key columns), so a million rows stream in flat memory, as ruff and mypy
print. It never crops: in a terminal narrower than every column, the secondary columns (bytes, hash input, word,
label) are left out, in that order, and the report says so; what matters (row, path, lane, stream, count, key) is
always whole, even if the line then runs past the terminal's edge. `--wide` shows every column, `--columns` picks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from ..engine.derive import DeriveReport, TableCalls
from ..engine.hashing import encode_item, hash_input
from .halves import in_two
from .table_records import CHUNK
from .text_columns import table_lines
from .text_derive import _items, _notes, _ranges, _values

COLUMNS = ("path", "lane", "stream", "count", "label", "hash-input", "bytes", "word", "key")
ESSENTIAL = ("path", "lane", "stream", "count", "key")
DROP_ORDER = ("bytes", "hash-input", "word", "label")  # left out first to last when the terminal is narrow
_TITLE = {"hash-input": "hash input"}
_RIGHT = {"#", "count", "word"}
GAP = "  "
_CHUNK = 1 << 14


@dataclass(frozen=True)
class Style:
    """ANSI styles, or none (piped, NO_COLOR)."""

    color: bool

    def bold(self, s: str) -> str:
        return f"\x1b[1m{s}\x1b[0m" if self.color else s

    def yellow(self, s: str) -> str:
        return f"\x1b[33m{s}\x1b[0m" if self.color else s

    def dim(self, s: str) -> str:
        return f"\x1b[2m{s}\x1b[0m" if self.color else s


def terminal(output: str | None) -> tuple[int | None, bool]:
    """The width to fit and whether to colour: a terminal's (COLUMNS wins), else no limit and no colour."""
    import os
    import shutil
    import sys

    if output is not None or not sys.stdout.isatty():
        return None, False
    return shutil.get_terminal_size().columns, "NO_COLOR" not in os.environ


def cells(s: str) -> int:
    """Columns `s` takes in a terminal (wide characters take two)."""
    if s.isascii():
        return len(s)
    from rich.cells import cell_len

    return cell_len(s)


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)}


def shown(s: str) -> str:
    """A name as a terminal can show it: control characters (a NUL in a module name) escaped, as repr does."""
    return s.translate(_CONTROL) if not s.isprintable() else s


def _pad(v: str, width: int, right: bool) -> str:
    fill = " " * (width - cells(v))
    return fill + v if right else v + fill


def _key_text(key) -> str:
    return "[" + " ".join(str(w) for w in key) + "]" if key is not None else "(traced, discarded)"


def _digits(n: int) -> int:
    return len(str(int(n)))


class _Rows:
    """Each row's cells (strings, by column name) and flags (fallback, discarded), and each column's width."""

    def __init__(self, report: DeriveReport):
        self.report = report
        calls = report.calls
        self.table = calls.table if isinstance(calls, TableCalls) else None
        self.n = len(calls)

    def lanes(self) -> bool:
        if self.table is None:
            return any(c.derivation.lane or c.derivation.discarded for c in self.report.calls)
        t, rows = self.table, self.report.calls.rows  # type: ignore[attr-defined]
        if not len(rows):
            return False
        blocks = np.unique(t.block[rows])
        return any(t.templates[int(b)].axes for b in blocks) or bool(t.discarded[rows].any())

    def widths(self, listing: int | None = None) -> dict[str, int]:
        """The widest cell of each column (headers included); the hash word and the key of the first `listing`
        rows only (None: of every row), the rows a report lists: it need not hash the others."""
        w = {c: len(_TITLE.get(c, c)) for c in COLUMNS}
        w["#"] = max(1, _digits(max(self.n - 1, 0)))
        if self.table is None:
            for j, (row, _, _) in enumerate(self.cells()):
                for c, v in row.items():
                    if listing is None or j < listing or c not in ("word", "key"):
                        w[c] = max(w[c], cells(v))
            return w
        t = self.table
        rows = self.report.calls.rows  # type: ignore[attr-defined]
        if not len(rows):
            return w
        w["#"] = max(1, _digits(int(rows.max())))
        sizes = t.axis_size
        for b in np.unique(t.block[rows]).tolist():
            tpl = t.templates[b]
            top = tpl.first_count + tpl.n - 1  # (a longer count is never shorter text)
            w["path"] = max(w["path"], cells(shown("/".join(tpl.path) if tpl.path else "(root)")))
            stream = tpl.stream if tpl.stream == tpl.stream_requested else f"{tpl.stream_requested}->{tpl.stream}"
            w["stream"] = max(w["stream"], cells(shown(stream)))
            w["label"] = max(w["label"], cells(shown(tpl.label or "")))
            w["hash-input"] = max(w["hash-input"], cells(_items(tpl.suffix + (top,))))
            w["bytes"] = max(w["bytes"], 2 * len(hash_input(tpl.suffix, t.sep)) + 2 * len(encode_item(top)) + 2 * t.sep)
            if tpl.axes:
                w["lane"] = max(w["lane"], sum(_digits(sizes[a] - 1) for a in tpl.axes) + len(tpl.axes) - 1)
        if t.discarded[rows].any():
            w["lane"] = max(w["lane"], len("discarded"))
        w["count"] = max(w["count"], _digits(int(t.count[rows].max())))
        listed = rows[:listing]
        if len(listed):
            w["word"] = max(w["word"], _digits(int(t.words_of(listed).max())))
        keys = self.report.calls.keys_upto(len(listed))  # type: ignore[attr-defined]
        exists = t.base[listed] >= 0
        if exists.any():
            k = keys[exists]
            w["key"] = max(w["key"], 2 + sum(_digits(int(k[:, j].max())) for j in range(k.shape[1])) + k.shape[1] - 1)
        if not exists.all():
            w["key"] = max(w["key"], len("(traced, discarded)"))
        return w

    def cells(self, limit: int | None = None) -> Iterator[tuple[dict[str, str], bool, bool]]:
        """Per row (the first `limit`; None: every row): its cells, whether its stream fell back, whether Flax
        discards it."""
        if self.table is None:
            for c in islice(self.report.calls, limit):
                d = c.derivation
                yield (
                    {
                        "#": str(d.index),
                        "path": shown(d.path_str),
                        "lane": "discarded" if d.discarded else ",".join(map(str, d.lane)),
                        "stream": shown(d.stream if not d.fallback else f"{d.stream_requested}->{d.stream}"),
                        "count": str(d.count),
                        "label": shown(d.label or ""),
                        "hash-input": _items(d.hash_items),
                        "bytes": d.hash_input.hex(),
                        "word": str(d.hash_word),
                        "key": _key_text(c.key),
                    },
                    d.fallback,
                    d.discarded,
                )
            return
        yield from self._table_cells(limit)

    def _table_cells(self, limit: int | None) -> Iterator[tuple[dict[str, str], bool, bool]]:
        t = self.table
        assert t is not None
        calls = self.report.calls
        rows = calls.rows[:limit]  # type: ignore[attr-defined]
        keys = calls.keys_upto(len(rows))  # type: ignore[attr-defined]
        consts: dict = {}
        sep = t.sep
        for j0 in range(0, len(rows), _CHUNK):
            r = rows[j0 : j0 + _CHUNK]
            cols = zip(
                range(j0, j0 + len(r)),
                r.tolist(),
                t.block[r].tolist(),
                t.count[r].tolist(),
                t.words_of(r).tolist(),
                t.base[r].tolist(),
                t.discarded[r].tolist(),
                keys[j0 : j0 + _CHUNK].tolist(),
            )
            for j, i, b, c, w, base, disc, key in cols:
                const = consts.get(b)
                if const is None:
                    tpl = t.templates[b]
                    fallback = tpl.stream != tpl.stream_requested
                    const = consts[b] = (
                        shown("/".join(tpl.path) if tpl.path else "(root)"),
                        shown(f"{tpl.stream_requested}->{tpl.stream}" if fallback else tpl.stream),
                        shown(tpl.label or ""),
                        _items(tpl.suffix + (0,))[: -(2 if tpl.suffix else 3)],  # "(items, " without the count
                        hash_input(tpl.suffix, sep).hex(),
                        fallback,
                        bool(tpl.axes),
                    )
                path, stream, label, items, pre_hex, fallback, has_axes = const
                if disc:
                    lane = "discarded"
                elif has_axes:
                    lane = ",".join(map(str, t.lane_of(i)))
                else:
                    lane = ""
                yield (
                    {
                        "#": str(i),
                        "path": path,
                        "lane": lane,
                        "stream": stream,
                        "count": str(c),
                        "label": label,
                        "hash-input": f"{items}{c}{',)' if items == '(' else ')'}",
                        "bytes": pre_hex + ("00" if sep else "") + encode_item(c).hex(),
                        "word": str(w),
                        "key": _key_text(key) if base >= 0 else "(traced, discarded)",
                    },
                    fallback,
                    bool(disc),
                )


def _row_notes(report: DeriveReport) -> dict:
    """Each distinct note once, with the rows it applies to: from the templates on the fast path (a note is a
    statement's, so a million rows need not be made)."""
    calls = report.calls
    if not isinstance(calls, TableCalls):
        return _notes(report)
    t, rows = calls.table, calls.rows
    out: dict = {}
    if not len(rows):
        return out
    blocks = t.block[rows]
    for b in np.unique(blocks).tolist():
        tpl = t.templates[b]
        if tpl.notes:
            at = rows[blocks == b].tolist()
            for note in tpl.notes:
                out.setdefault((note, tpl.location), []).extend(at)
    return {k: sorted(v) for k, v in sorted(out.items(), key=lambda kv: min(kv[1]))}


def fit_columns(
    every: Sequence[str],
    drop_order: Sequence[str],
    widths: dict[str, int],
    width: int | None,
    wide: bool,
    picked: Sequence[str] | None,
) -> tuple[list[str], list[str]]:
    """The columns to show (after `#`) of `every`, and those left out, in `drop_order`, to fit `width` (None: no
    limit); `picked` (--columns) or `wide` (--wide) decide instead. Both flavours' reports fit their rows so."""
    if picked:
        return [c for c in every if c in picked], []
    if wide or width is None:
        return list(every), []
    shown = list(every)
    left_out: list[str] = []

    def total(cols) -> int:
        return widths["#"] + sum(len(GAP) + widths[c] for c in cols)

    for c in drop_order:
        if total(shown) <= width:
            break
        shown.remove(c)
        left_out.append(c)
    return shown, left_out


def choose_columns(
    widths: dict[str, int], lanes: bool, width: int | None, wide: bool, picked: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """A Linen report's columns to show (after `#`), and those left out to fit `width` (None: no limit)."""
    return fit_columns([c for c in COLUMNS if c != "lane" or lanes], DROP_ORDER, widths, width, wide, picked)


def left_out_line(st: Style, width: int | None, titles: Sequence[str]) -> str:
    """The line saying which columns a narrow terminal left out, and how to see them."""
    return (
        st.dim(
            f"(left out to fit {width} columns: {', '.join(titles)}; --wide shows every column, --columns picks them)"
        )
        + "\n"
    )


def _line(cells: dict[str, str], cols: list[str], widths: dict[str, int], styled: dict | None = None) -> str:
    """One row, each cell padded to its column; `styled` (column -> style) wraps a padded cell in its escapes."""
    parts = []
    for c in ["#", *cols]:
        v = cells[c]
        v = _pad(v, widths[c], c in _RIGHT)
        if styled and c in styled:
            v = styled[c](v)
        parts.append(v)
    return GAP.join(parts).rstrip()


def render_rows(
    report: DeriveReport,
    *,
    width: int | None = None,
    color: bool = False,
    wide: bool = False,
    columns: Sequence[str] | None = None,
    max_rows: int | None = None,
    advance=None,
) -> Iterator[str]:
    """The text report of a Linen derive, in chunks of lines: the header, the rows, the notes, the drawn values
    and the summary. `width`: the terminal's (None: piped, every column). `max_rows` (None or 0: every row): list
    the first rows only, then how many more there are, per stream and per top-level module, and how to see them.
    `advance(n)` is called as rows are written (a progress bar's)."""
    st = Style(color)
    spec = report.spec
    yield (
        st.bold(spec.file)
        + f"  phase={spec.phase}  impl={spec.prng_impl}  threefry_partitionable="
        + f"{str(spec.threefry_partitionable).lower()}  fix_rng_separator={str(spec.fix_rng_separator).lower()}\n"
    )
    yield f"  rules: {spec.rules.name}" + (f"; jax {spec.jax_version}" if spec.jax_version else "") + "\n"
    for s in sorted(report.roots):
        yield f"  rngs[{s!r}] = {spec.rngs[s].text} -> {list(report.roots[s])}\n"
    n = len(report.calls)
    limit = n if not max_rows else min(max_rows, n)
    rows = _Rows(report)
    lanes = rows.lanes()
    widths = rows.widths(limit)
    cols, left_out = choose_columns(widths, lanes, width, wide, columns)
    head = {c: _TITLE.get(c, c) for c in COLUMNS}
    head["#"] = "#"
    yield st.bold(_line(head, cols, widths)) + "\n"
    chunk: list[str] = []
    yellow = {"stream": st.yellow} if st.color else None
    if rows.table is not None and not st.color and cols and cols[-1] == "key":
        # the fast path's rows, laid out from the columns (uncoloured: no row needs styling)
        calls = report.calls
        for text, m in in_two(lambda a, b: table_lines(calls, cols, widths, b, a), limit, CHUNK):  # type: ignore[arg-type]
            yield text
            if advance is not None:
                advance(m)
        limit_rows: Iterator = iter(())
    else:
        limit_rows = enumerate(rows.cells(limit))
    for k, (cells, fallback, discarded) in limit_rows:
        if k == limit:
            break
        if discarded:
            line = st.dim(_line(cells, cols, widths))
        else:
            line = _line(cells, cols, widths, yellow if fallback else None)
        chunk.append(line)
        if len(chunk) == 4096:
            yield "\n".join(chunk) + "\n"
            if advance is not None:
                advance(len(chunk))
            chunk = []
    if chunk:
        yield "\n".join(chunk) + "\n"
        if advance is not None:
            advance(len(chunk))
    if limit < n:
        yield from more_rows(n - limit, *_index_range(report, limit), *_breakdown(report), "call sites")
    if left_out:
        yield left_out_line(st, width, [_TITLE.get(c, c) for c in left_out])
    for (note, loc), at in _row_notes(report).items():
        yield st.yellow(f"note: {_ranges(at)} ({loc}): {note}") + "\n"
    calls = report.calls
    if isinstance(calls, TableCalls):
        drawn = (calls[j] for j in sorted(calls.values_upto(limit)))
    else:
        drawn = (calls[j] for j in range(limit))
    for c in drawn:
        if c.values is not None and c.draw is not None:
            d = c.derivation
            yield f"#{d.index} {d.path_str} {d.label or d.stream} {c.draw.describe()}:\n{_values(c.values)}\n"
    count = f"{len(report.calls)}" + (f" of {report.total}" if report.total is not None else "")
    yield f"{count} keys, {report.fallbacks} falling back to 'params'\n"


def derive_text(
    report,
    *,
    width: int | None,
    color: bool,
    wide: bool = False,
    columns: Sequence[str] | None = None,
    max_rows: int | None = None,
    advance=None,
):
    """derive's text report of either flavour, in chunks: Linen's streamed rows, an NNX spec's rows (`advance(n)`
    is called as a Linen report's rows are written)."""
    if not isinstance(report, DeriveReport):  # (an NNX spec's)
        from .text_nnx import render_nnx_rows

        yield from render_nnx_rows(report, width=width, color=color, wide=wide, columns=columns, max_rows=max_rows)
        return
    yield from render_rows(
        report, width=width, color=color, wide=wide, columns=columns, max_rows=max_rows, advance=advance
    )
    for run in report.to_linen:
        # the NNX module a bridge.ToLinen call builds and calls (its keys come from the make_rng rows above)
        from .text_nnx import render_nnx_rows

        yield "\n"
        yield from render_nnx_rows(
            run.report,
            width=width,
            color=color,
            wide=wide,
            max_rows=max_rows,
            title=(f"{run.where}: the NNX module {run.report.spec.model.cls} it builds (step init) and calls (step 1)"),
        )


MODULES_SHOWN = 10


def _natural(name: str) -> tuple:
    """A sort key reading the digit runs of `name` as numbers."""
    import re

    return tuple((0, int(part), part) if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name) if part)


def more_rows(more: int, first: int, last: int, by_stream: Counter, by_module: Counter, what: str) -> Iterator[str]:
    """The lines after the first rows of a long report: how many more (and which), per stream and per top-level
    module (the largest first), and how to see them."""

    def listed(counts: Counter, cap: int | None = None) -> str:
        # the largest first; ties in the order a person numbers them (Block_2 before Block_10)
        items = sorted(counts.items(), key=lambda kv: (-kv[1], _natural(str(kv[0]))))
        shown_items = items[:cap] if cap else items
        text = ", ".join(f"{shown(str(k))} {v:,}" for k, v in shown_items)
        return text + (f" and {len(items) - cap:,} more" if cap and len(items) > cap else "")

    yield (
        f"... {more:,} more {what} not listed (#{first}-#{last}): --max-rows 0 lists every row, --path/--stream "
        "pick some, --format jsonl streams them all\n"
    )
    total = sum(by_stream.values())
    yield f"{what} by stream ({total:,}): {listed(by_stream)}\n"
    yield f"{what} by top-level module: {listed(by_module, MODULES_SHOWN)}\n"


def _index_range(report: DeriveReport, limit: int) -> tuple[int, int]:
    calls = report.calls
    if isinstance(calls, TableCalls):
        return int(calls.rows[limit]), int(calls.rows[-1])
    return calls[limit].derivation.index, calls[len(calls) - 1].derivation.index


def _breakdown(report: DeriveReport) -> tuple[Counter, Counter]:
    """Call sites per requested stream and per top-level module (`(root)` for the root), of every row."""
    calls = report.calls
    streams: Counter = Counter()
    modules: Counter = Counter()
    if isinstance(calls, TableCalls):
        t = calls.table
        per = np.bincount(t.block[calls.rows], minlength=len(t.templates))
        for b in np.flatnonzero(per).tolist():
            tpl = t.templates[b]
            streams[tpl.stream_requested] += int(per[b])
            modules[tpl.path[0] if tpl.path else "(root)"] += int(per[b])
        return streams, modules
    for c in calls:
        d = c.derivation
        streams[d.stream_requested] += 1
        modules[d.path[0] if d.path else "(root)"] += 1
    return streams, modules
