"""Upper bounds on what replaying a spec costs (keys, drawn values, module calls), checked before any replay."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from ..errors import Location, SpecError
from .tree import (
    Call,
    Child,
    Cond,
    Define,
    Draw,
    Item,
    Lift,
    MakeRng,
    ModuleDef,
    Param,
    Sequential,
    Transform,
    Variable,
    WhileLoop,
)

# Upper bounds on a whole replay (every repeat multiplied out, `when` ignored). derive's fast path
# (rngaudit.engine.table) needs about 1 us and 100 bytes per key, so ten million keys are seconds and ~1 GiB.
MAX_KEYS = 10_000_000
MAX_CALLS = 1_000_000
MAX_DRAWN_VALUES = 20_000_000


class Cost(NamedTuple):
    """What replaying something costs at most: keys handed out, values drawn, module calls."""

    keys: int
    values: int
    calls: int

    def plus(self, other: Cost) -> Cost:
        return Cost(self.keys + other.keys, self.values + other.values, self.calls + other.calls)

    def times(self, n: int) -> Cost:
        return Cost(n * self.keys, n * self.values, n * self.calls)

    def most(self, other: Cost) -> Cost:
        return Cost(max(self.keys, other.keys), max(self.values, other.values), max(self.calls, other.calls))


NOTHING = Cost(0, 0, 0)


class _Budget:
    """Upper bounds on what replaying a module costs per call: (keys handed out, values drawn,
    module calls). Repeats multiply, so a few innocent-looking numbers can ask for 10**20 keys;
    such specs are refused here, at the statement that crosses a limit, instead of exhausting
    time and memory later."""

    def __init__(self) -> None:
        self.memo: dict[int, Cost] = {}

    def check(self, model: ModuleDef) -> None:
        self.module(model)

    def _limit(self, cost: Cost, loc: Location, what: str) -> Cost:
        keys, values, calls = cost
        if keys > MAX_KEYS:
            raise SpecError(
                f"{what} asks for up to {_big(keys)} keys (repeats multiplied out); rngaudit "
                f"replays at most {MAX_KEYS}: lower `repeat`",
                loc,
            )
        if calls > MAX_CALLS:
            raise SpecError(
                f"{what} makes up to {_big(calls)} module calls (repeats multiplied out); "
                f"rngaudit replays at most {MAX_CALLS}: lower `repeat`",
                loc,
            )
        if values > MAX_DRAWN_VALUES:
            raise SpecError(
                f"{what} draws up to {_big(values)} values (shapes times repeats); rngaudit "
                f"draws at most {MAX_DRAWN_VALUES}: draw smaller shapes or fewer times",
                loc,
            )
        return cost

    def module(self, m: ModuleDef) -> Cost:
        if id(m) in self.memo:
            return self.memo[id(m)]
        children: dict[str, Cost] = {}
        for items in (m.setup, m.body):
            for item in items:
                for name, c in self._defined(item):
                    children[name] = children.get(name, NOTHING).most(c)
        total = Cost(0, 0, 1)
        for items in (m.setup, m.body):
            total = total.plus(self.items(items, children))
        factor = 1
        for lift in m.lifts:
            factor *= _lift_factor(lift)
        # lifted transforms repeat the call per lane and trace (and re-run setup on each clone)
        cost = self._limit(total.times(factor * (2 if m.lifts else 1)), m.loc, f"module {m.cls}")
        self.memo[id(m)] = cost
        return cost

    def items(self, items: tuple[Item, ...], children: dict[str, Cost]) -> Cost:
        total = NOTHING
        for item in items:
            total = total.plus(self._limit(self.item(item, children), item.loc, "this statement"))
        return total

    def _defined(self, item: Item) -> Iterator[tuple[str, Cost]]:
        """(name, cost per call) for each child the statement creates; auto-names by class."""
        if isinstance(item, (Child, Define)):
            yield (item.module.name or item.module.cls), self.module(item.module)
        elif isinstance(item, Transform):
            yield (item.target.name or item.target.cls), self.module(item.target)
        elif isinstance(item, Sequential):
            for layer in item.layers:
                yield (layer.name or layer.cls), self.module(layer)
            yield (item.name or "Sequential"), self.item(item, {})

    def item(self, item: Item, children: dict[str, Cost]) -> Cost:
        def drawn(n: int, draw: Draw | None) -> Cost:
            return Cost(n, (n * math.prod(draw.shape) if draw is not None else 0), 0)

        if isinstance(item, MakeRng):
            return drawn(item.repeat, item.draw)
        if isinstance(item, Param):
            return drawn(1, item.draw)
        if isinstance(item, Variable):
            return drawn(len(item.streams), item.draw)
        if isinstance(item, Child):
            return self.module(item.module).times(item.repeat)
        if isinstance(item, Transform):
            return self.module(item.target).times(item.repeat)
        if isinstance(item, Cond):
            total = NOTHING
            for branch in item.branches:
                total = total.plus(self.items(branch, children))
            return total
        if isinstance(item, WhileLoop):
            c = self.items(item.cond_items, children)
            b = self.items(item.body_items, children)
            return c.times(item.iterations + 1).plus(b.times(item.iterations))
        if isinstance(item, Call):
            name = item.name
            target = children.get(name)
            if target is None:
                cls, _, num = name.rpartition("_")
                target = children.get(cls) if num.isdigit() else None
            return (target or NOTHING).times(item.repeat)
        if isinstance(item, Sequential):
            total = Cost(0, 0, 1)
            for layer in item.layers:
                total = total.plus(self.module(layer))
            return total
        return NOTHING


def _lift_factor(lift: Lift) -> int:
    if lift.kind == "vmap":
        return lift.opt("axis_size")
    if lift.kind == "scan":
        return lift.opt("length") + (1 if lift.opt("check_constancy_invariants", True) else 0)
    if lift.kind == "map_variables" and lift.opt("init"):
        return 2
    return 1


def budget(model: ModuleDef) -> Cost:
    """Upper bounds on one replay of `model`: (keys, drawn values, module calls)."""
    return _Budget().module(model)


def _big(n: int) -> str:
    return str(n) if n < 10**12 else f"about 10**{len(str(n)) - 1}"


def check_budget(model: ModuleDef) -> None:
    """Refuse a model whose replay would cost more than the limits, at the statement that crosses one."""
    _Budget().check(model)
