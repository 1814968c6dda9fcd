"""Key expressions of a spec (`key(0)`, `split(key(0), 3)[2]`, `fold_in(k, 7)`, raw data), parsed, never eval'd."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import Location, SpecError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SPLIT = 2**31 - 1


class KeyExpr:
    """A key expression node."""


@dataclass(frozen=True)
class Seed(KeyExpr):
    """`key(seed)`: jax.random.key(seed)."""

    seed: int

    def __str__(self) -> str:
        return f"key({self.seed})"


@dataclass(frozen=True)
class Raw(KeyExpr):
    """`[w0, w1, ...]`: raw key data."""

    words: tuple[int, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(str(w) for w in self.words) + "]"


@dataclass(frozen=True)
class Split(KeyExpr):
    """`split(parent, n)[index]`: one row of jax.random.split."""

    parent: KeyExpr
    n: int
    index: int

    def __str__(self) -> str:
        return f"split({self.parent}, {self.n})[{self.index}]"


@dataclass(frozen=True)
class FoldIn(KeyExpr):
    """`fold_in(parent, data)`: jax.random.fold_in."""

    parent: KeyExpr
    data: int

    def __str__(self) -> str:
        return f"fold_in({self.parent}, {self.data})"


_TOKEN = re.compile(
    r"\s*(?:(?P<int>-?(?:0[xX][0-9a-fA-F]+|0[bB][01]+|0[oO][0-7]+|\d+))(?![A-Za-z_0-9])"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9.]*)|(?P<punct>[(),\[\]]))",
    re.ASCII,  # (\d is 0-9 only: Python's int() would read '٣' and '３' too)
)
_SPACE = re.compile(r"\s*")
_PREFIXES = ("jax.random.", "random.", "jr.")
_FUNCS = {"key": "key", "PRNGKey": "key", "split": "split", "fold_in": "fold_in"}
USAGE = "write key(N), split(KEY, N)[I], fold_in(KEY, N) or raw key data [W0, W1, ...]"
MAX_EXPR_DEPTH = 100


def _skip_space(text: str, pos: int) -> int:
    m = _SPACE.match(text, pos)
    return m.end() if m else pos


def _offset(tok: tuple[str, str, int] | None) -> int | None:
    """Where a token starts in the text (None: at the end)."""
    return tok[2] if tok is not None else None


class _Parser:
    def __init__(self, text: str, loc: Location, quoted: bool = True):
        self.text = text
        self.loc = loc
        self._quoted = quoted  # set before tokenizing: its errors point into the text too
        self.tokens: list[tuple[str, str, int]] = []
        self.i = 0
        self.depth = 0
        pos = 0
        n = len(text)
        while True:
            pos = _skip_space(text, pos)
            if pos >= n:
                break
            m = _TOKEN.match(text, pos)
            if not m:
                bad = re.compile(r"-?\w+").match(text, pos)
                if bad and (text[pos].isdigit() or text[pos] == "-"):
                    raise self.error(f"{bad.group(0)!r} is not a number (decimal, 0x.., 0o.. or 0b..)", pos)
                raise self.error(f"unexpected character {text[pos]!r}", pos)
            kind = m.lastgroup or ""
            self.tokens.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()

    def error(self, msg: str, offset: int | None = None) -> SpecError:
        if offset is None:
            offset = self.tokens[self.i][2] if self.i < len(self.tokens) else len(self.text)
        # the YAML value may be quoted: point inside the string where we can
        loc = Location(self.loc.file, self.loc.line, self.loc.col + offset + (1 if self._quoted else 0))
        shown = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        t = self.text
        if not self._quoted and (t.count("(") != t.count(")") or t.count("[") != t.count("]")):
            # `{params: fold_in(key(0), 3)}`: YAML cut the plain value at the comma
            msg += "; inside {...} or [...] YAML cuts a plain value at commas: quote the expression"
        return SpecError(f"bad key expression {shown!r}: {msg}; {USAGE}", loc)

    def _next_is(self, text: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[1] == text

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str, value: str | None = None) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            want = repr(value) if value is not None else {"int": "a number", "name": "a function"}[kind]
            got = "the end" if tok is None else repr(tok[1])
            raise self.error(f"expected {want}, found {got}")
        self.i += 1
        return tok

    def integer(self) -> int:
        tok = self.take("int")
        text = tok[1]
        digits = text.lstrip("-")
        if len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
            raise self.error(
                f"{text!r} has a leading zero; write {text[: -len(digits)]}{digits.lstrip('0') or '0'}", tok[2]
            )
        if len(digits) > 100:
            raise self.error(f"the number {text[:20]}... is far too large", tok[2])
        return int(text, 0)

    def parse(self) -> KeyExpr:
        expr = self.expr()
        if self.peek() is not None:
            raise self.error(f"unexpected {self.tokens[self.i][1]!r} after the expression")
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
                name = name[len(p) :]
                break
        func = _FUNCS.get(name)
        if func is None:
            from .fields import suggest  # only for this error

            raise self.error(f"unknown function {tok[1]!r}{suggest(name, _FUNCS)}")
        self.depth += 1
        if self.depth > MAX_EXPR_DEPTH:
            raise self.error(f"the expression nests deeper than {MAX_EXPR_DEPTH} calls")
        self.i += 1
        self.take("punct", "(")
        if func == "key":
            at = self.peek()
            seed = self.integer()
            if not INT64_MIN <= seed <= INT64_MAX:
                raise self.error("the seed must fit in a signed 64-bit integer (JAX raises OverflowError)", _offset(at))
            self.take("punct", ")")
            return Seed(seed)
        parent = self.expr()
        if func == "fold_in":
            self.take("punct", ",")
            at = self.peek()
            data = self.integer()
            if not 0 <= data < 2**32:
                raise self.error("fold_in data must be in [0, 2**32)", _offset(at))
            self.take("punct", ")")
            return FoldIn(parent, data)
        n = 2
        if self._next_is(","):
            self.take("punct", ",")
            at = self.peek()
            n = self.integer()
            if not 1 <= n <= MAX_SPLIT:
                raise self.error(f"split count must be in [1, {MAX_SPLIT}]", _offset(at))
        self.take("punct", ")")
        if not self._next_is("["):
            raise self.error(f"split gives {n} keys; pick one with [i]")
        self.take("punct", "[")
        at = self.peek()
        idx = self.integer()
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise self.error(f"index out of range for split(..., {n})", _offset(at))
        self.take("punct", "]")
        return Split(parent, n, idx)

    def raw(self) -> Raw:
        self.take("punct", "[")
        words = [self.word()]
        while self._next_is(","):
            self.take("punct", ",")
            words.append(self.word())
        self.take("punct", "]")
        return Raw(tuple(words))

    def word(self) -> int:
        at = self.peek()
        w = self.integer()
        if not 0 <= w < 2**32:
            raise self.error("raw key data must be unsigned 32-bit integers", _offset(at))
        return w


def make_raw(words: list, error) -> Raw:
    for w in words:
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < 2**32:
            raise error("raw key data must be unsigned 32-bit integers")
    return Raw(tuple(words))


def raw_words(expr: KeyExpr) -> tuple[int, ...] | None:
    """The raw key data an expression starts from, or None when it starts from a seed."""
    while isinstance(expr, (Split, FoldIn)):
        expr = expr.parent
    return expr.words if isinstance(expr, Raw) else None


def largest_split(expr: KeyExpr) -> int:
    """The most keys any split in the expression makes (0: no split)."""
    if isinstance(expr, Split):
        return max(expr.n, largest_split(expr.parent))
    if isinstance(expr, FoldIn):
        return largest_split(expr.parent)
    return 0


def parse(text: str, loc: Location, quoted: bool = True) -> KeyExpr:
    """Parse a key expression string found at `loc`."""
    return _Parser(text, loc, quoted).parse()
