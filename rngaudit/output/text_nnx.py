"""Human-readable `derive` output of an NNX spec, with rich: every key a stream hands out, with the chain its
stream key was made by."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..engine.draws import RBG_IMPLS, RBG_LANES
from ..engine.nnx import NnxDeriveReport
from .text_derive import _values


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
        else ""
    )
    return d.site + kind + (f" [{', '.join(where)}]" if where else "")


def render_nnx_derive(report: NnxDeriveReport, console: Console) -> None:
    spec = report.spec
    head = Text()
    head.append(spec.file, style="bold")
    head.append(
        f"  flavour=nnx  steps={spec.steps}  impl={spec.prng_impl}  "
        f"threefry_partitionable={str(spec.threefry_partitionable).lower()}"
    )
    console.print(head)
    console.print(f"  rules: {report.rules}")
    for s in sorted(report.roots):
        console.print(f"  rngs[{s!r}] = {spec.rngs[s].text} -> {list(report.roots[s])}")
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for col, just in (
        ("#", "right"),
        ("step", "left"),
        ("site", "left"),
        ("stream", "left"),
        ("count", "right"),
        ("chain", "left"),
        ("key", "left"),
    ):
        table.add_column(col, justify=just, no_wrap=col != "chain")  # type: ignore[arg-type]
    for c in report.calls:
        d = c.derivation
        stream = d.requested if d.requested == d.tag else f"{d.requested}->{d.tag}"
        table.add_row(
            str(c.index),
            "init" if d.step == 0 else str(d.step),
            Text(site_text(d)),
            Text(stream, style="yellow" if d.fallback else ""),
            str(d.count),
            Text(chain_text(d.chain, d.count, d.linen or ("used as it is" if d.given else ""))),
            "[" + " ".join(str(w) for w in c.key) + "]",
        )
    console.print(table)
    lanes = []
    for c in report.calls:
        if c.values is not None and c.draw is not None:
            d = c.derivation
            console.print(f"#{c.index} {d.site} {d.label or d.requested} {c.draw.describe()}:")
            console.print(Text(_values(c.values)))
            if d.batched and spec.prng_impl in RBG_IMPLS:
                lanes.append(f"#{c.index}")
    if lanes:
        console.print(Text(f"note ({_rows(lanes)}): {RBG_LANES}", style="dim"))
    shown = f"{len(report.calls)}" + (f" of {report.total}" if report.total is not None else "") + " keys"
    console.print(f"{shown}, {report.fallbacks} served by 'default' for another stream")


def _rows(rows: list[str]) -> str:
    return ", ".join(rows) if len(rows) <= 4 else f"{', '.join(rows[:3])} and {len(rows) - 3} more"
