"""Human-readable `derive` output of an NNX spec: every key a stream hands out, with the chain its stream key was
made by, in fixed-width columns fitted to the terminal (as text_rows does for Linen)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np

from ..engine.draws import RBG_IMPLS, RBG_LANES
from ..engine.nnx import NnxDeriveReport
from .text_derive import _values
from .text_rows import Style, fit_columns, left_out_line, more_rows, shown
from .text_rows import _line as line_of
from .text_rows import cells as text_cells


def chain_text(chain: tuple[str, ...], count: int, linen: str = "") -> str:
    """The stream key's chain and the last step: fold_in of the count, or (a bridge.ToNNX's Linen key) Linen's
    path and count hashed into the key the call drew."""
    return " -> ".join(chain + (linen or f"fold_in {count}",))


def site_text(d) -> str:
    """A draw's site with what drew (fork, draw, split) and where under a transform: `[lane 2]`, `[scan 3]`,
    and whether the stream was broadcast there."""
    where = []
    if d.lane >= 0:
        where.append(f"lane {d.lane}")
    if d.linen_lane:
        where.append(f"lane {', '.join(map(str, d.linen_lane))}")
    if d.iteration >= 0:
        where.append(f"scan {d.iteration}")
    if d.broadcast:
        where.append("broadcast")
    kind = (
        f" ({d.kind})"
        if d.kind in ("fork", "draw", "split", "broadcast")
        else " (ToNNX call)"
        if d.kind == "bridge"
        else " (unused: the carry is zeros)"
        if d.unused
        else ""
    )
    return d.site + kind + (f" [{', '.join(where)}]" if where else "")


NNX_COLUMNS = ("step", "site", "stream", "count", "key", "chain")  # (the long chain last: it may run on)
NNX_DROP_ORDER = ("chain",)  # left out when the terminal is narrow; never the site, stream, count or key
_ALIAS = {"path": "site"}  # --columns names Linen's columns; an NNX report reads `path` as its `site`


def _cells(c) -> tuple[dict[str, str], bool]:
    d = c.derivation
    stream = d.requested if d.requested == d.tag else f"{d.requested}->{d.tag}"
    return (
        {
            "#": str(c.index),
            "step": "init" if d.step == 0 else str(d.step),
            "site": shown(site_text(d)),
            "stream": shown(stream),
            "count": str(d.count),
            "chain": shown(chain_text(d.chain, d.count, d.linen or ("used as it is" if d.given else ""))),
            "key": "[" + " ".join(str(w) for w in c.key) + "]",
        },
        bool(d.fallback),
    )


def render_nnx_rows(
    report: NnxDeriveReport,
    *,
    width: int | None = None,
    color: bool = False,
    wide: bool = False,
    columns: Sequence[str] | None = None,
    max_rows: int | None = None,
    title: str | None = None,
) -> Iterator[str]:
    """derive's text report of an NNX spec, in chunks of lines, in fixed-width columns as Linen's (text_rows): a
    narrow terminal leaves out the chain (and says so), never the site, stream, count or key. `max_rows`: list the
    first rows only, then counts per stream and per top-level module. `title`: the first line (a bridge.ToLinen
    call's NNX module, inside a Linen report), in place of the spec's."""
    st = Style(color)
    spec = report.spec
    if title is not None:
        yield st.bold(title) + "\n"
    else:
        yield (
            st.bold(spec.file)
            + f"  flavour=nnx  steps={spec.steps}{_eval_steps(spec.eval_steps)}  impl={spec.prng_impl}  "
            + f"threefry_partitionable={str(spec.threefry_partitionable).lower()}\n"
        )
    yield f"  rules: {report.rules}\n"
    for s in report.roots if title is not None else sorted(report.roots):
        yield f"  rngs[{s!r}] = {spec.rngs[s].text} -> {list(report.roots[s])}\n"
    for s in sorted(spec.call_rngs or ()):
        yield f"  call_rngs[{s!r}] = {spec.call_rngs[s].text} (the Rngs given to every call)\n"  # type: ignore[index]
    for i, given in enumerate(spec.call_rngs_steps or (), 1):
        if given is None:
            yield f"  call_rngs = null (step {i}'s call is given no Rngs)\n"
            continue
        for s in sorted(given):
            yield f"  call_rngs[{s!r}] = {given[s].text} (the Rngs made for step {i}'s call)\n"
    calls = report.calls
    n = len(calls)
    limit = n if not max_rows else min(max_rows, n)
    listed = calls.rows()[:limit]
    table = calls.table
    texts = _BlockTexts(table)
    widths = texts.widths(listed)
    picked = [_ALIAS.get(c, c) for c in columns] if columns else None
    cols, left_out = fit_columns(NNX_COLUMNS, NNX_DROP_ORDER, widths, width, wide, picked)
    cols = cols or list(NNX_COLUMNS)
    yield st.bold(line_of({k: k for k in ("#", *NNX_COLUMNS)}, cols, widths)) + "\n"
    if not st.color and cols[-1] in ("chain", "key") and texts.unstripped(listed):
        # laid out from the columns a chunk at a time (no line needs stripping: the last cell ends in a digit,
        # `]` or a text that does not end in a space)
        yield from texts.lines(listed, cols, widths)
    else:
        yellow = {"stream": st.yellow} if st.color else None
        out = []
        for j in range(limit):
            cells, fallback = _cells(calls[j])
            out.append(line_of(cells, cols, widths, yellow if fallback else None))
            if len(out) == 4096:
                yield "\n".join(out) + "\n"
                out = []
        if out:
            yield "\n".join(out) + "\n"
    if limit < n:
        per = np.bincount(table.block[calls.rows()], minlength=len(table.blocks))
        streams: Counter = Counter()
        modules: Counter = Counter()
        for b in np.flatnonzero(per).tolist():
            k = table.blocks[b]
            streams[k.requested] += int(per[b])
            modules[k.site.split("/")[0].split(".")[0]] += int(per[b])
        yield from more_rows(n - limit, calls.row(limit), calls.row(n - 1), streams, modules, "draws")
    if left_out:
        yield left_out_line(st, width, left_out)
    lanes = []
    for j in sorted(calls.values_upto(limit)):
        c = calls[j]
        if c.values is not None and c.draw is not None:
            d = c.derivation
            yield f"#{c.index} {d.site} {d.label or d.requested} {c.draw.describe()}:\n{_values(c.values)}\n"
            if d.batched and spec.prng_impl in RBG_IMPLS:
                lanes.append(f"#{c.index}")
    if lanes:
        yield st.dim(f"note ({_rows(lanes)}): {RBG_LANES}") + "\n"
    total = f"{n}" + (f" of {report.total}" if report.total is not None else "") + " keys"
    yield f"{total}, {report.fallbacks} served by 'default' for another stream\n"


def _rows(rows: list[str]) -> str:
    return ", ".join(rows) if len(rows) <= 4 else f"{', '.join(rows[:3])} and {len(rows) - 3} more"


class _BlockTexts:
    """What a block of consecutive draws fixes in its rows' cells (step, site, stream, the chain up to the count),
    made once; the widths of every column from the blocks and the columns; the rows laid out a chunk at a time."""

    def __init__(self, table):
        self.table = table
        self.made: dict[int, tuple] = {}

    def of(self, b: int) -> tuple:
        """(step, site, stream, chain before the count or the whole chain, whether the count ends the chain)."""
        t = self.made.get(b)
        if t is None:
            d = self.table.blocks[b]
            stream = d.requested if d.requested == d.tag else f"{d.requested}->{d.tag}"
            tail = d.linen or ("used as it is" if d.given else "")
            chain = shown(chain_text(d.chain, 0, tail))
            if not tail:
                chain = chain[: -len("0")]  # (the count follows)
            t = self.made[b] = (
                "init" if d.step == 0 else str(d.step),
                shown(site_text(d)),
                shown(stream),
                chain,
                not tail,
            )
        return t

    def widths(self, rows: np.ndarray) -> dict[str, int]:
        """Each column's width over `rows` (headers included): what laying out each row's cells gives."""
        from .text_columns import digits

        w = {c: len(c) for c in ("#", *NNX_COLUMNS)}
        if not len(rows):
            return w
        table = self.table
        block, count, keys = table.block[rows], table.count[rows], table.keys[rows]
        w["#"] = max(w["#"], len(str(int(rows.max()))))
        w["count"] = max(w["count"], len(str(int(count.max()))))
        key_digits = np.zeros(len(rows), dtype=np.int64)
        for x in range(keys.shape[1]):
            key_digits += digits(keys[:, x])
        w["key"] = max(w["key"], 2 + keys.shape[1] - 1 + int(key_digits.max()))
        top = np.zeros(len(table.blocks), dtype=np.int64)
        np.maximum.at(top, block, count.astype(np.int64))
        for b in np.unique(block).tolist():
            step, site, stream, chain, counted = self.of(b)
            w["step"] = max(w["step"], text_cells(step))
            w["site"] = max(w["site"], text_cells(site))
            w["stream"] = max(w["stream"], text_cells(stream))
            w["chain"] = max(w["chain"], text_cells(chain) + (len(str(int(top[b]))) if counted else 0))
        return w

    def unstripped(self, rows: np.ndarray) -> bool:
        """No row's chain ends in whitespace (a line is stripped of its trailing spaces)."""
        return all(
            self.of(b)[4] or self.of(b)[3] == self.of(b)[3].rstrip() for b in np.unique(self.table.block[rows]).tolist()
        )

    def lines(self, rows: np.ndarray, cols: list[str], widths: dict[str, int]) -> Iterator[str]:
        from .table_records import CHUNK, objects
        from .text_columns import GAP, digits

        table = self.table
        widest = max(widths.values()) + 2
        pad = objects([" " * k for k in range(widest + 1)])
        gap_pad = objects([GAP + " " * k for k in range(widest + 1)])
        nb = len(table.blocks)
        const = {c: np.empty(nb, dtype=object) for c in ("step", "site", "stream", "chain")}
        room = np.zeros(nb, dtype=np.int64)  # the chain's cells before the count
        counted = np.zeros(nb, dtype=bool)
        done = np.zeros(nb, dtype=bool)
        last = cols[-1]
        for j0 in range(0, len(rows), CHUNK):
            r = rows[j0 : j0 + CHUNK]
            b = table.block[r]
            for x in np.unique(b[~done[b]]).tolist():
                done[x] = True
                step, site, stream, chain, counts = self.of(x)
                for c, v in (("step", step), ("site", site), ("stream", stream)):
                    const[c][x] = GAP + v + " " * (widths[c] - text_cells(v))
                const["chain"][x] = GAP + chain
                room[x] = text_cells(chain)
                counted[x] = counts
            c = table.count[r]
            cs = objects(list(map(str, c.tolist())))
            nd = digits(c)
            pieces: list = [pad[np.maximum(widths["#"] - digits(r), 0)], objects(list(map(str, r.tolist())))]
            for col in cols:
                if col in ("step", "site", "stream"):
                    pieces.append(const[col][b])
                elif col == "count":
                    pieces += [gap_pad[np.maximum(widths["count"] - nd, 0)], cs]
                elif col == "chain":
                    count_text = np.where(counted[b], cs, "")
                    pieces += [const["chain"][b], count_text]
                    if col != last:
                        used = room[b] + np.where(counted[b], nd, 0)
                        pieces.append(pad[np.maximum(widths["chain"] - used, 0)])
                elif col == "key":
                    k = table.keys[r]
                    pieces.append(GAP + "[")
                    for x in range(k.shape[1]):
                        pieces += [objects(list(map(str, k[:, x].tolist()))), " " if x < k.shape[1] - 1 else "]"]
                    if col != last:
                        used = 2 + k.shape[1] - 1 + sum(digits(k[:, x]) for x in range(k.shape[1]))
                        pieces.append(pad[np.maximum(widths["key"] - used, 0)])
            pieces.append("\n")
            out = np.empty((len(r), len(pieces)), dtype=object)
            for x, p in enumerate(pieces):
                out[:, x] = p
            yield "".join(out.ravel().tolist())


def _eval_steps(steps: tuple[int, ...] | None) -> str:
    """` (eval mode: 3-4, 7)`: the steps made in eval mode (model.eval()), where their Dropout and attention layers
    draw nothing; "" when there are none."""
    if not steps:
        return ""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return " (eval mode: " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + ")"
