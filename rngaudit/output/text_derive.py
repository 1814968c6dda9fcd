"""Human-readable `derive` output with rich."""

from __future__ import annotations

from typing import Literal

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..engine.derive import DeriveReport


def _items(items) -> str:
    return "(" + ", ".join(repr(x) for x in items) + ("," if len(items) == 1 else "") + ")"


def _values(v: np.ndarray) -> str:
    with np.printoptions(precision=8, suppress=False, threshold=64, linewidth=120):
        return np.array2string(v)


def _notes(report: DeriveReport) -> dict:
    """Each distinct note once, with the rows it applies to (lanes repeat notes many times)."""
    out: dict = {}
    for c in report.calls:
        d = c.derivation
        for note in d.notes:
            out.setdefault((note, d.location), []).append(d.index)
    return out


def _ranges(rows: list[int]) -> str:
    parts = []
    start = prev = rows[0]
    for r in rows[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"#{start}" if start == prev else f"#{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def render_derive(report: DeriveReport, console: Console) -> None:
    spec = report.spec
    head = Text()
    head.append(f"{spec.file}", style="bold")
    head.append(
        f"  phase={spec.phase}  impl={spec.prng_impl}  "
        f"threefry_partitionable={str(spec.threefry_partitionable).lower()}  "
        f"fix_rng_separator={str(spec.fix_rng_separator).lower()}"
    )
    console.print(head)
    console.print(f"  rules: {spec.rules.name}" + (f"; jax {spec.jax_version}" if spec.jax_version else ""))
    for s in sorted(report.roots):
        console.print(f"  rngs[{s!r}] = {spec.rngs[s].text} -> {list(report.roots[s])}")
    lanes = any(c.derivation.lane or c.derivation.discarded for c in report.calls)
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        (("#", "right"), ("path", "left"))
        + ((("lane", "left"),) if lanes else ())
        + (
            ("stream", "left"),
            ("count", "right"),
            ("label", "left"),
            ("hash input", "left"),
            ("bytes", "left"),
            ("word", "right"),
            ("key", "left"),
        )
    )
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=col != "label")
    for c in report.calls:
        d = c.derivation
        stream = d.stream if not d.fallback else f"{d.stream_requested}->{d.stream}"
        key = "[" + " ".join(str(w) for w in c.key) + "]" if c.key is not None else "(traced, discarded)"
        lane = ["discarded" if d.discarded else ",".join(map(str, d.lane))] if lanes else []
        table.add_row(
            str(d.index),
            d.path_str,
            *lane,
            Text(stream, style="yellow" if d.fallback else ""),
            str(d.count),
            d.label or "",
            _items(d.hash_items),
            d.hash_input.hex(),
            str(d.hash_word),
            key,
            style="dim" if d.discarded else None,
        )
    console.print(table)
    for (note, loc), rows in _notes(report).items():
        console.print(f"note: {_ranges(rows)} ({loc}): {note}", style="yellow")
    for c in report.calls:
        if c.values is not None and c.draw is not None:
            d = c.derivation
            console.print(f"#{d.index} {d.path_str} {d.label or d.stream} {c.draw.describe()}:")
            console.print(Text(_values(c.values)))
    shown = f"{len(report.calls)}" + (f" of {report.total}" if report.total is not None else "")
    console.print(f"{shown} keys, {report.fallbacks} falling back to 'params'")
