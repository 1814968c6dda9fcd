"""Flax's filters over streams and collections: which names a filter takes, and the sets of collections a
lifted transform lets through (mirrors flax/core/scope.py group_collections and in_filter)."""

from __future__ import annotations

EVERY = "*every collection*"  # in Scope.frozen and Scope.carry: every collection at once


def matches(flt, name: str) -> bool:
    if flt is True or flt is False:
        return flt
    if isinstance(flt, str):
        return flt == name
    return name in flt


def select(names, filters, jax_pytree: bool = True) -> list[tuple[str, object]]:
    """(name, value) for each name some filter takes, filter by filter. Within a filter's group the
    names keep their order, or are sorted when the group passes through a JAX transform as a dict
    (jax flattens dicts in sorted key order), which is what the inner scope then sees."""
    # mirrors flax/core/scope.py group_collections
    taken: set = set()
    out: list[tuple[str, object]] = []
    for flt, value in filters:
        group = [n for n in names if n not in taken and matches(flt, n)]
        taken.update(group)
        out.extend((n, value) for n in (sorted(group) if jax_pytree else group))
    return out


def vmap_broadcast(variable_axes):
    """The collections a vmap broadcasts (axis None): first matching filter wins, as in Flax's
    group_collections."""
    mapped: set = set()
    out: set = set()
    for c, ax in variable_axes:
        if c is True:
            return AllBut(mapped) if ax is None else frozenset(out)
        names = (c,) if isinstance(c, str) else tuple(c)
        for n in names:
            if n not in mapped and n not in out:
                (out if ax is None else mapped).add(n)
    return frozenset(out)


class AllBut:
    """The collections a scope sees when that is every collection but some (`in`, and `&` with a
    frozenset or another AllBut, as Scope.cols is used)."""

    def __init__(self, out: frozenset):
        self.out = frozenset(out)

    def __contains__(self, col) -> bool:
        return col not in self.out

    def __and__(self, other):
        if isinstance(other, AllBut):
            return AllBut(self.out | other.out)
        return frozenset(c for c in other if c not in self.out)

    __rand__ = __and__

    def __eq__(self, other) -> bool:
        return isinstance(other, AllBut) and other.out == self.out

    def __hash__(self) -> int:
        return hash((AllBut, self.out))


def filter_set(flt) -> frozenset | None:
    if flt is True:
        return None
    if flt is False:
        return frozenset()
    return frozenset((flt,) if isinstance(flt, str) else flt)


def union_cols(*filters) -> frozenset | None:
    out: set = set()
    for f in filters:
        fs = filter_set(f)
        if fs is None:
            return None
        out |= fs
    return frozenset(out)


def combine_discard(outer, inner):
    if outer is None:
        return inner
    if inner is None:
        return outer
    if outer is True:
        return inner
    if inner is True:
        return outer
    return outer & inner
