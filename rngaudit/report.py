"""`derive` results as data, and their versioned, deterministic JSON form."""
from __future__ import annotations

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


@dataclass(frozen=True)
class DeriveReport:
    spec: Spec
    roots: dict[str, KeyData]
    calls: list[KeyedCall]

    @property
    def fallbacks(self) -> int:
        """Keys whose stream fell back to 'params' (the findings of `derive --strict`)."""
        return sum(1 for c in self.calls if c.derivation.fallback)


def derive(spec: Spec, values: bool = True, default_draw: Draw | None = None) -> DeriveReport:
    """Replay the spec and compute every key (and the requested draws)."""
    rows = replay(spec)
    engine = engine_for(spec)
    keys = derive_keys(spec, rows, engine)
    calls = []
    for d, k in zip(rows, keys):
        key = tuple(int(w) for w in k) if d.base is not None else None
        draw = d.draw or default_draw
        vals = None
        if values and draw is not None and key is not None:
            try:
                vals = draw_values(spec, key, draw)
            except (ValueError, TypeError, ArithmeticError, IndexError) as e:
                raise SpecError(f"cannot draw {draw.describe()}: {e}", draw.loc) from None
        calls.append(KeyedCall(d, key, draw, vals))
    return DeriveReport(spec, root_keys(spec, engine), calls)


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


def to_json(report: DeriveReport) -> dict:
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
        "calls": [call_json(c) for c in report.calls],
        "summary": {
            "calls": len(report.calls),
            "fallbacks": report.fallbacks,
            "discarded": sum(1 for c in report.calls if c.derivation.discarded),
        },
    }
