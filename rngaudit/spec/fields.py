"""Typed reading of YAML mappings: known keys only, each value checked, every problem at its file:line:col."""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload

from ..errors import SpecError
from .yaml_source import YNode


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice `word` was most likely meant to be (for "did you mean" in error messages), if any is close."""
    import difflib  # only for error messages

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: str, choices: Iterable[str]) -> str:
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


def type_name(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "a mapping"


class Fields:
    """Reads a mapping node: known keys only, each one checked for type."""

    def __init__(self, node: YNode, what: str, allowed: Iterable[str], required: Iterable[str] = ()):
        if not node.is_map:
            raise SpecError(f"{what} must be a mapping, not {type_name(node.value)}", node.loc)
        self.node = node
        self.what = what
        for key in node.value:
            if key not in allowed:
                raise SpecError(
                    f"unknown key {key!r} in {what}{suggest(key, allowed)}; allowed: {', '.join(sorted(allowed))}",
                    node.key_locs[key],
                )
        for key in required:
            if key not in node.value:
                raise SpecError(f"{what} needs `{key}`", node.loc)

    def has(self, key: str) -> bool:
        return key in self.node.value

    def get(self, key: str) -> YNode | None:
        return self.node.value.get(key)

    def need(self, key: str) -> YNode:
        """A key the constructor's `required` made sure of."""
        node: YNode = self.node.value[key]
        return node

    def name(self, key: str) -> str:
        """A required string."""
        return as_str(self.need(key), f"`{key}` of {self.what}")

    @overload
    def text(self, key: str, default: str) -> str: ...

    @overload
    def text(self, key: str, default: None = None) -> str | None: ...

    def text(self, key: str, default: str | None = None) -> str | None:
        n = self.get(key)
        if n is None:
            return default
        return as_str(n, f"`{key}` of {self.what}")

    def flag(self, key: str, default: bool) -> bool:
        n = self.get(key)
        if n is None:
            return default
        if not isinstance(n.value, bool):
            raise SpecError(f"`{key}` must be true or false, not {type_name(n.value)}", n.loc)
        return n.value

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        n = self.get(key)
        if n is None:
            return default
        return as_int(n, f"`{key}`", lo, hi)


def as_str(n: YNode, what: str) -> str:
    if not isinstance(n.value, str):
        hint = "; quote it" if not isinstance(n.value, (list, dict)) else ""
        raise SpecError(f"{what} must be a string, not {type_name(n.value)}{hint}", n.loc)
    return n.value


def as_int(n: YNode, what: str, lo: int, hi: int) -> int:
    v = n.value
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f"{what} must be an integer, not {type_name(v)}", n.loc)
    if not lo <= v <= hi:
        raise SpecError(f"{what} must be between {lo} and {hi}, not {v}", n.loc)
    return v
