"""The `derive` stage: replay a spec, compute every key and the values drawn from them, as a DeriveReport."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SpecError
from ..spec.tree import Draw, Spec
from .draws import draw_values
from .keys import KeyData, KeyEngine, derive_keys, engine_for, root_keys
from .records import Derivation, LazyRows
from .replay import replay
from .table import KeyTable, key_table


@dataclass(frozen=True)
class KeyedCall:
    """A derivation with the key Flax hands out and, when asked, the values drawn from it."""

    derivation: Derivation
    key: KeyData | None  # None: a key of a trace Flax throws away, which never exists
    draw: Draw | None
    values: np.ndarray | None


class Calls(Sequence[KeyedCall]):
    """A report's calls, and how many of them fall back to 'params' or are thrown away by Flax."""

    def fallbacks(self) -> int:
        return sum(1 for c in self if c.derivation.fallback)

    def discarded(self) -> int:
        return sum(1 for c in self if c.derivation.discarded)


class ListCalls(Calls):
    """The plain path's calls: one KeyedCall per derivation, made up front."""

    def __init__(self, calls: list[KeyedCall]):
        self.calls = calls

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, j):
        return self.calls[j]


class TableCalls(LazyRows, Calls):
    """The fast path's calls: a KeyedCall made when a row is read (1,000,000 rows stay columns)."""

    def __init__(self, table: KeyTable, rows: np.ndarray, keys: np.ndarray, default_draw: Draw | None, values: dict):
        self.table = table
        self.rows = rows
        self.keys = keys
        self.default_draw = default_draw
        self.values = values

    def __len__(self) -> int:
        return len(self.rows)

    def _at(self, j: int) -> KeyedCall:
        d = self.table.derivation(int(self.rows[j]))
        key = tuple(int(w) for w in self.keys[j]) if d.base is not None else None
        return KeyedCall(d, key, d.draw or self.default_draw, self.values.get(j))

    def fallbacks(self) -> int:
        table = self.table
        fb = np.array([tpl.stream_requested != tpl.stream for tpl in table.templates], dtype=bool)
        return int(fb[table.block[self.rows]].sum()) if len(fb) else 0

    def discarded(self) -> int:
        return int(self.table.discarded[self.rows].sum())


@dataclass(frozen=True)
class DeriveReport:
    spec: Spec
    roots: dict[str, KeyData]
    calls: Calls
    total: int | None = None  # call sites before --stream/--path/--limit; None: no filter

    @property
    def fallbacks(self) -> int:
        """Keys whose stream fell back to 'params' (the findings of `derive --strict`)."""
        return self.calls.fallbacks()

    @property
    def discarded(self) -> int:
        return self.calls.discarded()


def _draw(spec: Spec, key: KeyData, draw: Draw) -> np.ndarray:
    try:
        return draw_values(spec, key, draw)
    except (ValueError, TypeError, ArithmeticError, IndexError) as e:
        raise SpecError(f"cannot draw {draw.describe()}: {e}", draw.loc) from None


def derive(
    spec: Spec,
    values: bool = True,
    default_draw: Draw | None = None,
    engine: str = "fast",
    streams: Sequence[str] = (),
    paths: Sequence[str] = (),
    limit: int | None = None,
) -> DeriveReport:
    """Replay the spec and compute every key (and the requested draws). `engine` "fast" (columns,
    vectorised keys) or "plain" (one Derivation per call, the reference). `streams`, `paths` (globs)
    and `limit` select call sites before any key is computed."""
    keng = engine_for(spec)
    if engine == "fast":
        return _derive_fast(spec, keng, values, default_draw, streams, paths, limit)
    if engine != "plain":
        raise ValueError(f"engine must be 'fast' or 'plain', not {engine!r}")
    return _derive_plain(spec, keng, values, default_draw)


def _derive_fast(
    spec: Spec,
    keng: KeyEngine,
    values: bool,
    default_draw: Draw | None,
    streams: Sequence[str],
    paths: Sequence[str],
    limit: int | None,
) -> DeriveReport:
    table = key_table(spec)
    filtered = bool(streams or paths or limit is not None)
    rows = table.select(streams, paths, limit)
    keys = table.keys(keng, rows)
    drawn: dict[int, np.ndarray] = {}
    if values:
        tdraw = [tpl.draw or default_draw for tpl in table.templates]
        has_draw = np.array([d is not None for d in tdraw], dtype=bool)
        # only the rows whose statement draws, and whose key exists
        for j in np.flatnonzero(has_draw[table.block[rows]] & (table.base[rows] >= 0)).tolist():
            draw = tdraw[int(table.block[rows[j]])]
            assert draw is not None
            drawn[j] = _draw(spec, tuple(int(w) for w in keys[j]), draw)
    calls = TableCalls(table, rows, keys, default_draw, drawn)
    return DeriveReport(spec, root_keys(spec, keng), calls, table.n if filtered else None)


def _derive_plain(spec: Spec, keng: KeyEngine, values: bool, default_draw: Draw | None) -> DeriveReport:
    rows = replay(spec)
    keys = derive_keys(spec, rows, keng)
    calls = []
    for d, k in zip(rows, keys):
        key = tuple(int(w) for w in k) if d.base is not None else None
        draw = d.draw or default_draw
        vals = _draw(spec, key, draw) if values and draw is not None and key is not None else None
        calls.append(KeyedCall(d, key, draw, vals))
    return DeriveReport(spec, root_keys(spec, keng), ListCalls(calls))
