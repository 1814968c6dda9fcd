"""Human-readable `derive` output of an NNX spec: every key a stream hands out, with the chain its stream key was
made by, in fixed-width columns fitted to the terminal (as text_rows does for Linen)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

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
            + f"  flavour=nnx  steps={spec.steps}  impl={spec.prng_impl}  "
            + f"threefry_partitionable={str(spec.threefry_partitionable).lower()}\n"
        )
    yield f"  rules: {report.rules}\n"
    for s in report.roots if title is not None else sorted(report.roots):
        yield f"  rngs[{s!r}] = {spec.rngs[s].text} -> {list(report.roots[s])}\n"
    for s in sorted(spec.call_rngs or ()):
        yield f"  call_rngs[{s!r}] = {spec.call_rngs[s].text} (the Rngs given to every call)\n"  # type: ignore[index]
    calls = list(report.calls)
    limit = len(calls) if not max_rows else min(max_rows, len(calls))
    rows = [_cells(c) for c in calls[:limit]]
    widths = {c: len(c) for c in ("#", *NNX_COLUMNS)}
    for cells, _ in rows:
        for k, v in cells.items():
            widths[k] = max(widths[k], text_cells(v))
    picked = [_ALIAS.get(c, c) for c in columns] if columns else None
    cols, left_out = fit_columns(NNX_COLUMNS, NNX_DROP_ORDER, widths, width, wide, picked)
    cols = cols or list(NNX_COLUMNS)
    yield st.bold(line_of({k: k for k in ("#", *NNX_COLUMNS)}, cols, widths)) + "\n"
    yellow = {"stream": st.yellow} if st.color else None
    out = []
    for cells, fallback in rows:
        out.append(line_of(cells, cols, widths, yellow if fallback else None))
    if out:
        yield "\n".join(out) + "\n"
    if limit < len(calls):
        yield from more_rows(
            len(calls) - limit,
            calls[limit].index,
            calls[-1].index,
            Counter(c.derivation.requested for c in calls),
            Counter(c.derivation.site.split("/")[0].split(".")[0] for c in calls),
            "draws",
        )
    if left_out:
        yield left_out_line(st, width, left_out)
    lanes = []
    for c in calls[:limit]:
        if c.values is not None and c.draw is not None:
            d = c.derivation
            yield f"#{c.index} {d.site} {d.label or d.requested} {c.draw.describe()}:\n{_values(c.values)}\n"
            if d.batched and spec.prng_impl in RBG_IMPLS:
                lanes.append(f"#{c.index}")
    if lanes:
        yield st.dim(f"note ({_rows(lanes)}): {RBG_LANES}") + "\n"
    total = f"{len(calls)}" + (f" of {report.total}" if report.total is not None else "") + " keys"
    yield f"{total}, {report.fallbacks} served by 'default' for another stream\n"


def _rows(rows: list[str]) -> str:
    return ", ".join(rows) if len(rows) <= 4 else f"{', '.join(rows[:3])} and {len(rows) - 3} more"
