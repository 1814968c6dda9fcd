"""`derive` results as data, and their versioned, deterministic JSON form."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import __version__
from .errors import SpecError
from .keys import KeyData, derive_keys, draw_values, engine_for, root_keys
from .nodes import Draw, Spec
from .replay import Derivation, replay

JSON_FORMAT = "rngaudit.derive"
JSON_FORMAT_VERSION = 1


@dataclass(frozen=True)
class KeyedCall:
    """A derivation with the key Flax hands out and, when asked, the values drawn from it."""

    derivation: Derivation
    key: KeyData
    draw: Draw | None
    values: np.ndarray | None


class _LazyCalls(Sequence):
    """The fast path's calls: a KeyedCall made when a row is read (1,000,000 rows stay columns)."""

    def __init__(self, table, rows: np.ndarray, keys: np.ndarray, default_draw: Draw | None, values: dict):
        self.table = table
        self.rows = rows
        self.keys = keys
        self.default_draw = default_draw
        self.values = values

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        d = self.table.derivation(int(self.rows[j]))
        key = tuple(int(w) for w in self.keys[j]) if d.base is not None else None
        return KeyedCall(d, key, d.draw or self.default_draw, self.values.get(j))

    def __iter__(self):
        for j in range(len(self)):
            yield self[j]


@dataclass(frozen=True)
class DeriveReport:
    spec: Spec
    roots: dict[str, KeyData]
    calls: Sequence[KeyedCall]
    total: int | None = None  # call sites before --stream/--path/--limit; None: no filter

    @property
    def fallbacks(self) -> int:
        """Keys whose stream fell back to 'params' (the findings of `derive --strict`)."""
        table = getattr(self.calls, "table", None)
        if table is not None:
            fb = np.array([tpl[1] != tpl[2] for tpl in table.templates], dtype=bool)
            return int(fb[table.block[self.calls.rows]].sum()) if len(fb) else 0
        return sum(1 for c in self.calls if c.derivation.fallback)

    @property
    def discarded(self) -> int:
        table = getattr(self.calls, "table", None)
        if table is not None:
            return int(table.discarded[self.calls.rows].sum())
        return sum(1 for c in self.calls if c.derivation.discarded)


def _draw(spec: Spec, key: KeyData, draw: Draw) -> np.ndarray:
    try:
        return draw_values(spec, key, draw)
    except (ValueError, TypeError, ArithmeticError, IndexError) as e:
        raise SpecError(f"cannot draw {draw.describe()}: {e}", draw.loc) from None


def derive(spec: Spec, values: bool = True, default_draw: Draw | None = None, engine: str = "fast",
           streams: Sequence[str] = (), paths: Sequence[str] = (), limit: int | None = None) -> DeriveReport:
    """Replay the spec and compute every key (and the requested draws). `engine` "fast" (columns,
    vectorised keys) or "plain" (one Derivation per call, the reference). `streams`, `paths` (globs)
    and `limit` select call sites before any key is computed."""
    keng = engine_for(spec)
    if engine == "fast":
        from .fast import key_table

        table = key_table(spec)
        filtered = bool(streams or paths or limit is not None)
        rows = table.select(streams, paths, limit)
        keys = table.keys(keng, rows)
        drawn: dict = {}
        if values:
            tdraw = [tpl[11] or default_draw for tpl in table.templates]
            has_draw = np.array([d is not None for d in tdraw], dtype=bool)
            # only the rows whose statement draws, and whose key exists
            for j in np.flatnonzero(has_draw[table.block[rows]] & (table.base[rows] >= 0)).tolist():
                draw = tdraw[int(table.block[rows[j]])]
                drawn[j] = _draw(spec, tuple(int(w) for w in keys[j]), draw)
        calls = _LazyCalls(table, rows, keys, default_draw, drawn)
        return DeriveReport(spec, root_keys(spec, keng), calls, table.n if filtered else None)
    if engine != "plain":
        raise ValueError(f"engine must be 'fast' or 'plain', not {engine!r}")
    rows = replay(spec)
    keys = derive_keys(spec, rows, keng)
    calls = []
    for d, k in zip(rows, keys):
        key = tuple(int(w) for w in k) if d.base is not None else None
        draw = d.draw or default_draw
        vals = _draw(spec, key, draw) if values and draw is not None and key is not None else None
        calls.append(KeyedCall(d, key, draw, vals))
    return DeriveReport(spec, root_keys(spec, keng), calls)


def _values_json(v: np.ndarray):
    if v.dtype == np.bool_:
        return v.tolist()
    if np.issubdtype(v.dtype, np.integer):
        return v.astype(np.int64).tolist()
    return v.astype(np.float64).tolist()


def call_json(c: KeyedCall) -> dict:
    d = c.derivation
    out = {
        "index": d.index,
        "path": list(d.path),
        "path_str": d.path_str,
        "stream_requested": d.stream_requested,
        "stream": d.stream,
        "fallback": d.fallback,
        "count": d.count,
        "kind": d.kind,
        "label": d.label,
        "hash_items": list(d.hash_items),
        "hash_input_hex": d.hash_input.hex(),
        "hash_word": d.hash_word,
        "base": str(d.base) if d.base is not None else None,
        "key": list(c.key) if c.key is not None else None,
        "lane": list(d.lane),
        "discarded": d.discarded,
        "notes": list(d.notes),
        "location": d.location.as_json(),
    }
    if c.values is not None:
        out["values"] = {
            "draw": c.draw.describe(),
            "kind": c.draw.kind,
            "shape": list(c.draw.shape),
            "dtype": c.draw.dtype,
            "data": _values_json(c.values),
        }
    return out


def _meta(report: DeriveReport) -> dict:
    spec = report.spec
    return {
        "format": JSON_FORMAT,
        "format_version": JSON_FORMAT_VERSION,
        "rngaudit_version": __version__,
        "spec": spec.file,
        "phase": spec.phase,
        "flax": {"fix_rng_separator": spec.fix_rng_separator},
        "jax": {"prng_impl": spec.prng_impl, "threefry_partitionable": spec.threefry_partitionable},
        "rngs": {
            s: {"expr": spec.rngs[s].text, "key": list(report.roots[s])} for s in sorted(spec.rngs)
        },
    }


def _summary(report: DeriveReport) -> dict:
    out = {"calls": len(report.calls), "fallbacks": report.fallbacks, "discarded": report.discarded}
    if report.total is not None:
        out["selected_from"] = report.total
    return out


def to_json(report: DeriveReport) -> dict:
    return {**_meta(report), "calls": [call_json(c) for c in report.calls], "summary": _summary(report)}


def jsonl_lines(report: DeriveReport, advance=None):
    """`--format jsonl`: one JSON object a line, made as it is written (flat memory): a `header`
    record (the JSON format's fields but calls and summary), one `call` record per call site (the
    JSON format's call objects), and a closing `summary` record."""
    dumps = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode
    yield dumps({"record": "header", **_meta(report)}) + "\n"
    chunk: list[str] = []
    calls = report.calls
    if isinstance(calls, _LazyCalls):
        # the fast path: lines straight from the columns; rows with drawn values the generic way
        lines = calls.table.call_lines(calls.rows, calls.keys, dumps, calls.values)
        records = (line if line is not None else dumps({"record": "call", **call_json(calls[j])})
                   for j, line in enumerate(lines))
    else:
        records = (dumps({"record": "call", **call_json(c)}) for c in calls)
    for line in records:
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
    yield dumps({"record": "summary", **_summary(report)}) + "\n"
