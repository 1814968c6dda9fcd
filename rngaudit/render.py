"""Human-readable `derive` output with rich (the only module that imports rich)."""
from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .report import DeriveReport


def _items(items) -> str:
    return "(" + ", ".join(repr(x) for x in items) + ("," if len(items) == 1 else "") + ")"


def _values(v: np.ndarray) -> str:
    with np.printoptions(precision=8, suppress=False, threshold=64, linewidth=120):
        return np.array2string(v)


def render_derive(report: DeriveReport, console: Console) -> None:
    spec = report.spec
    head = Text()
    head.append(f"{spec.file}", style="bold")
    head.append(f"  phase={spec.phase}  impl={spec.prng_impl}  "
                f"threefry_partitionable={str(spec.threefry_partitionable).lower()}  "
                f"fix_rng_separator={str(spec.fix_rng_separator).lower()}")
    console.print(head)
    for s in sorted(report.roots):
        console.print(f"  rngs[{s!r}] = {spec.rngs[s].text} -> {list(report.roots[s])}")
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for col, just in (("#", "right"), ("path", "left"), ("stream", "left"), ("count", "right"),
                      ("label", "left"), ("hash input", "left"), ("bytes", "left"),
                      ("word", "right"), ("key", "left")):
        table.add_column(col, justify=just, no_wrap=col != "label")
    for c in report.calls:
        d = c.derivation
        stream = d.stream if not d.fallback else f"{d.stream_requested}->{d.stream}"
        table.add_row(str(d.index), d.path_str, Text(stream, style="yellow" if d.fallback else ""),
                      str(d.count), d.label or "", _items(d.hash_items), d.hash_input.hex(),
                      str(d.hash_word), "[" + " ".join(str(w) for w in c.key) + "]")
    console.print(table)
    for c in report.calls:
        d = c.derivation
        for note in d.notes:
            console.print(f"note: #{d.index} {d.path_str} ({d.location}): {note}", style="yellow")
    for c in report.calls:
        if c.values is not None:
            d = c.derivation
            console.print(f"#{d.index} {d.path_str} {d.label or d.stream} {c.draw.describe()}:")
            console.print(Text(_values(c.values)))
    console.print(f"{len(report.calls)} keys, {report.notes} with notes")
