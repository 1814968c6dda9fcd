"""The `derive` stage: replay a spec, compute every key and the values drawn from them, as a DeriveReport."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..errors import SpecError
from ..gcpause import paused
from ..spec.tree import Draw, Spec
from .draws import RBG_IMPLS, draw_values_lanes
from .keys import KeyData, KeyEngine, derive_keys, engine_for, root_keys
from .nnx_bridge import ToLinenRun, to_linen_runs
from .records import Derivation, LazyRows
from .replay import Replayer
from .table import KeyTable, key_table

PARTIAL_FROM = 100_000  # derive(keyed=N) with N at least this: every row is hashed up front anyway


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
    """The fast path's calls: a KeyedCall made when a row is read (1,000,000 rows stay columns). The keys and
    values may be made for the first rows only (a report listing its first rows): `keys_upto`/`values_upto` read
    those; `keys`, `values` or a later row make the rest first (`rest(k0)`: the keys and values of rows k0..,
    the values keyed from k0)."""

    def __init__(
        self,
        table: KeyTable,
        rows: np.ndarray,
        keys: np.ndarray,
        default_draw: Draw | None,
        values: dict,
        rest: Callable[[int], tuple[np.ndarray, dict]] | None = None,
    ):
        self.table = table
        self.rows = rows
        self._keys = keys
        self.default_draw = default_draw
        self._values = values
        self._rest = rest if len(keys) < len(rows) else None

    def __len__(self) -> int:
        return len(self.rows)

    def _complete(self) -> None:
        rest = self._rest
        if rest is not None:
            k0 = len(self._keys)
            keys, values = rest(k0)  # (may raise: a draw that fails; nothing changes then)
            self._rest = None
            self._keys = np.concatenate([self._keys, keys])
            self._values = {**self._values, **{k0 + j: v for j, v in values.items()}}

    @property
    def keys(self) -> np.ndarray:
        """Every row's key data (zeros where the key never exists)."""
        self._complete()
        return self._keys

    @property
    def values(self) -> dict:
        """Row position -> the values drawn there, for every row that draws."""
        self._complete()
        return self._values

    def keys_upto(self, n: int) -> np.ndarray:
        """The key data of the first n rows (making no other row's)."""
        return self._keys[:n] if n <= len(self._keys) else self.keys[:n]

    def values_upto(self, n: int) -> dict:
        """`values` of the first n rows (making no other row's)."""
        values = self._values if n <= len(self._keys) else self.values
        return {j: v for j, v in values.items() if j < n}

    def _at(self, j: int) -> KeyedCall:
        if j >= len(self._keys):
            self._complete()
        d = self.table.derivation(int(self.rows[j]))
        key = tuple(int(w) for w in self._keys[j]) if d.base is not None else None
        return KeyedCall(d, key, d.draw or self.default_draw, self._values.get(j))

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
    unmatched: tuple[str, ...] = ()  # a warning per --stream/--path that matches no call site
    to_linen: tuple[ToLinenRun, ...] = ()  # every call of a bridge.ToLinen module: its NNX module's keys

    @property
    def fallbacks(self) -> int:
        """Keys whose stream fell back to 'params' (the findings of `derive --strict`)."""
        return self.calls.fallbacks()

    @property
    def discarded(self) -> int:
        return self.calls.discarded()


def _draw(spec: Spec, key: KeyData | np.ndarray, draw: Draw) -> np.ndarray:
    """The values of `draw` from `key`, or in every lane of the keys `key` (an array: lane sizes, then words)."""
    try:
        return draw_values_lanes(spec, np.asarray(key, dtype=np.uint32), draw)
    except (ValueError, TypeError, ArithmeticError, IndexError) as e:
        raise SpecError(f"cannot draw {draw.describe()}: {e}", draw.loc) from None


class _LaneDraws:
    """Values drawn inside nn.vmap with rbg keys: jax draws all lanes of a call at once, each lane's bits a row
    of a draw from the first lane's key (rngaudit.engine.draws.draw_values_lanes). One draw per call and lanes
    of the other axes, its lanes' keys given by `keys(members)`; None where a lane's key never exists."""

    def __init__(self, spec: Spec, keys):
        self.spec = spec
        self.keys = keys
        self.done: dict = {}

    def values(self, group, members, shape: tuple[int, ...], at: tuple[int, ...], draw: Draw):
        """Lane `at` of the call `group`, drawn once; `members()` gives its rows in every lane, row-major."""
        hit = self.done.get(group, False)
        if hit is False:
            ks = self.keys(members())
            hit = None if ks is None else _draw(self.spec, ks.reshape(shape + ks.shape[-1:]), draw)
            self.done[group] = hit
        return None if hit is None else hit[at]


def _fast_lane_draw(table: KeyTable, lane_draws: _LaneDraws, row: int, draw: Draw):
    """Row `row`'s values as jax.vmap draws them with rbg keys (its template has batched axes)."""
    t = int(table.block[row])
    tpl = table.templates[t]
    sizes = table.axis_size
    axes = tpl.axes
    lane = table.lane_of(row)
    nl = int(table.n_lanes[t])
    first = int(table.start[t]) + (row - int(table.start[t])) // nl * nl
    pos = tpl.batched
    shape = tuple(sizes[axes[p]] for p in pos)
    group = (first, tuple(x for i, x in enumerate(lane) if i not in pos))

    def members() -> list[int]:
        out = []
        for combo in _lanes_of(shape):
            other = list(lane)
            for p, x in zip(pos, combo):
                other[p] = x
            li = 0
            for x, a in zip(other, axes):
                li = li * sizes[a] + x
            out.append(first + li)
        return out

    return lane_draws.values(group, members, shape, tuple(lane[p] for p in pos), draw)


def _plain_lane_groups(rows: list[Derivation]) -> dict:
    """Per row whose key is batched along nn.vmap axes: (the rows of the same call in every lane of those axes,
    row-major, and their shape). The plain path's rows of one template are consecutive, lanes in order."""
    groups: dict = {}
    for d in rows:
        if d.batched:
            rest = tuple(x for i, x in enumerate(d.lane) if i not in d.batched)
            where = (d.location, d.path, d.stream, d.count, d.hash_input, d.discarded, rest)
            groups.setdefault(where, []).append(d)
    out: dict = {}
    for members in groups.values():
        pos = members[0].batched
        shape = tuple(max(d.lane[p] for d in members) + 1 for p in pos)
        if len(members) != int(np.prod(shape)):
            continue  # (not every lane there: each drawn from its own key)
        ids = tuple(d.index for d in members)
        for d in members:
            out[d.index] = (ids, shape)
    return out


def _lanes_of(shape: tuple[int, ...]):
    from itertools import product

    return product(*(range(n) for n in shape))


def derive(
    spec: Spec,
    values: bool = True,
    default_draw: Draw | None = None,
    engine: str = "fast",
    streams: Sequence[str] = (),
    paths: Sequence[str] = (),
    limit: int | None = None,
    keyed: int | None = None,
) -> DeriveReport:
    """Replay the spec and compute every key (and the requested draws). `engine` "fast" (columns,
    vectorised keys) or "plain" (one Derivation per call, the reference). `streams`, `paths` (globs)
    and `limit` select call sites before any key is computed. `keyed` (fast engine): hash, key and draw
    only the first `keyed` selected call sites now, the others when first read (TableCalls)."""
    keng = engine_for(spec)
    if engine == "fast":
        return _derive_fast(spec, keng, values, default_draw, streams, paths, limit, keyed)
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
    keyed: int | None = None,
) -> DeriveReport:
    # (the first rows only, of --limit or of a text report: hashed one by one as they are keyed; every row: hashed
    # up front, by two processes)
    first = min((x for x in (keyed, limit) if x is not None), default=None)
    table = key_table(spec, hashed=first is None or first >= PARTIAL_FROM)
    filtered = bool(streams or paths or limit is not None)
    rows = table.select(streams, paths, limit)
    lane_draws = None
    if values and spec.prng_impl in RBG_IMPLS:

        def lane_keys(members: list):
            m = np.asarray(members, dtype=np.int64)
            return None if (table.base[m] < 0).any() else table.keys(keng, m)

        lane_draws = _LaneDraws(spec, lane_keys)
    tdraw = [tpl.draw or default_draw for tpl in table.templates]
    has_draw = np.array([d is not None for d in tdraw], dtype=bool)

    def keyed_rows(k0: int, k1: int | None = None) -> tuple[np.ndarray, dict]:
        # the keys of rows[k0:k1] and the values drawn there (keyed by position from k0)
        part = rows[k0:k1]
        keys = table.keys(keng, part)
        drawn: dict[int, np.ndarray] = {}
        if not values:
            return keys, drawn
        # only the rows whose statement draws, and whose key exists
        for j in np.flatnonzero(has_draw[table.block[part]] & (table.base[part] >= 0)).tolist():
            row = int(part[j])
            draw = tdraw[int(table.block[row])]
            assert draw is not None
            vals = None
            if lane_draws is not None and table.templates[int(table.block[row])].batched:
                vals = _fast_lane_draw(table, lane_draws, row, draw)
            drawn[j] = _draw(spec, tuple(int(w) for w in keys[j]), draw) if vals is None else vals
        return keys, drawn

    keys, drawn = keyed_rows(0, keyed)
    calls = TableCalls(table, rows, keys, default_draw, drawn, keyed_rows)
    bridged: tuple[ToLinenRun, ...] = ()
    if table.to_linen:

        def key_of(t: int, lane: int) -> tuple[int, KeyData | None]:
            row = int(table.start[t]) + lane
            if table.base[row] < 0:
                return row, None  # (a key that never exists)
            return row, tuple(int(w) for w in table.keys(keng, np.asarray([row], dtype=np.int64))[0])

        bridged = to_linen_runs(
            spec, table.to_linen, key_of, values, default_draw, lambda t: table.templates[t].first_count
        )
    return DeriveReport(spec, root_keys(spec, keng), calls, table.n if filtered else None, table.unmatched, bridged)


def _derive_plain(spec: Spec, keng: KeyEngine, values: bool, default_draw: Draw | None) -> DeriveReport:
    r = Replayer(spec)
    rows = paused(r.run)()
    keys = derive_keys(spec, rows, keng)
    lanes = _plain_lane_groups(rows) if values and spec.prng_impl in RBG_IMPLS else {}
    lane_draws = _LaneDraws(
        spec,
        lambda members: (
            None
            if any(rows[i].base is None for i in members)
            else np.asarray([keys[i] for i in members], dtype=np.uint32)
        ),
    )
    calls = []
    for d, k in zip(rows, keys):
        key = tuple(int(w) for w in k) if d.base is not None else None
        draw = d.draw or default_draw
        vals = None
        if values and draw is not None and key is not None:
            group = lanes.get(d.index)
            if group is not None:
                members, shape = group
                vals = lane_draws.values(
                    members, partial(list, members), shape, tuple(d.lane[p] for p in d.batched), draw
                )
            if vals is None:
                vals = _draw(spec, key, draw)
        calls.append(KeyedCall(d, key, draw, vals))
    bridged: tuple[ToLinenRun, ...] = ()
    if r.to_linen:
        first = r.first_rows()
        bridged = to_linen_runs(
            spec,
            r.to_linen,
            lambda t, lane: (first[t] + lane, calls[first[t] + lane].key),
            values,
            default_draw,
            lambda t: r.templates[t].first_count,
        )
    return DeriveReport(spec, root_keys(spec, keng), ListCalls(calls), to_linen=bridged)
