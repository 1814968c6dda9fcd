"""What derive's text reports share: hashed items, drawn values, notes by rows (the Linen report streams its rows:
rngaudit.output.text_rows; NNX's: rngaudit.output.text_nnx)."""

from __future__ import annotations

import numpy as np

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
