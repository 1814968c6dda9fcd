"""Key expressions of a spec (`key(0)`, `split(key(0), 3)[2]`, `fold_in(k, 7)`, raw data), parsed, never eval'd."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import Location, SpecError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SPLIT = 2**31 - 1


class KeyExpr:
    """A key expression node."""


@dataclass(frozen=True)
class Seed(KeyExpr):
    seed: int

    def __str__(self) -> str:
        return f"key({self.seed})"


@dataclass(frozen=True)
class Raw(KeyExpr):
    words: tuple[int, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(str(w) for w in self.words) + "]"


@dataclass(frozen=True)
class Split(KeyExpr):
    parent: KeyExpr
    n: int
    index: int

    def __str__(self) -> str:
        return f"split({self.parent}, {self.n})[{self.index}]"


@dataclass(frozen=True)
class FoldIn(KeyExpr):
    parent: KeyExpr
    data: int

    def __str__(self) -> str:
        return f"fold_in({self.parent}, {self.data})"


_TOKEN = re.compile(
    r"\s*(?:(?P<int>-?(?:0[xX][0-9a-fA-F]+|0[bB][01]+|\d+))|(?P<name>[A-Za-z_][A-Za-z_0-9.]*)|(?P<punct>[(),\[\]]))"
)
_PREFIXES = ("jax.random.", "random.", "jr.")
_FUNCS = {"key": "key", "PRNGKey": "key", "split": "split", "fold_in": "fold_in"}
USAGE = "write key(N), split(KEY, N)[I], fold_in(KEY, N) or raw key data [W0, W1, ...]"


class _Parser:
    def __init__(self, text: str, loc: Location):
        self.text = text
        self.loc = loc
        self.tokens: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if not m:
                raise self.error(f"unexpected character {text[pos:].lstrip()[0]!r}", pos + len(text[pos:]) - len(text[pos:].lstrip()))
            kind = m.lastgroup
            start = m.start(kind)
            self.tokens.append((kind, m.group(kind), start))
            pos = m.end()
        self.i = 0

    def error(self, msg: str, offset: int | None = None) -> SpecError:
        if offset is None:
            offset = self.tokens[self.i][2] if self.i < len(self.tokens) else len(self.text)
        # the YAML value may be quoted: point inside the string where we can
        loc = Location(self.loc.file, self.loc.line, self.loc.col + offset + (1 if self._quoted else 0))
        return SpecError(f"bad key expression {self.text!r}: {msg}; {USAGE}", loc)

    _quoted = True

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str, value: str | None = None) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            want = value if value is not None else kind
            got = "the end" if tok is None else repr(tok[1])
            raise self.error(f"expected {want!r}, found {got}")
        self.i += 1
        return tok

    def integer(self) -> int:
        return int(self.take("int")[1], 0)

    def parse(self) -> KeyExpr:
        expr = self.expr()
        if self.peek() is not None:
            raise self.error(f"unexpected {self.peek()[1]!r} after the expression")
        return expr

    def expr(self) -> KeyExpr:
        tok = self.peek()
        if tok is None:
            raise self.error("empty expression")
        if tok[0] == "punct" and tok[1] == "[":
            return self.raw()
        if tok[0] != "name":
            raise self.error(f"unexpected {tok[1]!r}")
        name = tok[1]
        for p in _PREFIXES:
            if name.startswith(p):
                name = name[len(p):]
        func = _FUNCS.get(name)
        if func is None:
            raise self.error(f"unknown function {tok[1]!r}")
        self.i += 1
        self.take("punct", "(")
        if func == "key":
            at = self.peek()
            seed = self.integer()
            if not INT64_MIN <= seed <= INT64_MAX:
                raise self.error("the seed must fit in a signed 64-bit integer (JAX raises OverflowError)", at[2])
            self.take("punct", ")")
            return Seed(seed)
        parent = self.expr()
        if func == "fold_in":
            self.take("punct", ",")
            at = self.peek()
            data = self.integer()
            if not 0 <= data < 2**32:
                raise self.error("fold_in data must be in [0, 2**32)", at[2] if at else None)
            self.take("punct", ")")
            return FoldIn(parent, data)
        n = 2
        if self.peek() and self.peek()[1] == ",":
            self.take("punct", ",")
            at = self.peek()
            n = self.integer()
            if not 1 <= n <= MAX_SPLIT:
                raise self.error(f"split count must be in [1, {MAX_SPLIT}]", at[2] if at else None)
        self.take("punct", ")")
        if not (self.peek() and self.peek()[1] == "["):
            raise self.error(f"split gives {n} keys; pick one with [i]")
        self.take("punct", "[")
        at = self.peek()
        idx = self.integer()
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise self.error(f"index out of range for split(..., {n})", at[2] if at else None)
        self.take("punct", "]")
        return Split(parent, n, idx)

    def raw(self) -> Raw:
        self.take("punct", "[")
        words = [self.integer()]
        while self.peek() and self.peek()[1] == ",":
            self.take("punct", ",")
            words.append(self.integer())
        self.take("punct", "]")
        return make_raw(words, lambda m: self.error(m))


def make_raw(words: list, error) -> Raw:
    for w in words:
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < 2**32:
            raise error("raw key data must be unsigned 32-bit integers")
    return Raw(tuple(words))


def parse(text: str, loc: Location, quoted: bool = True) -> KeyExpr:
    """Parse a key expression string found at `loc`."""
    p = _Parser(text, loc)
    p._quoted = quoted
    return p.parse()
