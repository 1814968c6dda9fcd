"""The `# rngaudit: ignore[RULE,...]` comment, one grammar for every input that carries one: a spec line (collisions'
findings at a call site) and a line of the user's Python (shard-check's draw of a training step)."""

from __future__ import annotations

import re
from collections.abc import Iterator

# `# rngaudit: ignore` or `# rngaudit: ignore[hash-word, collisions/latent]`, as a comment (at a line's start or
# after a blank)
_ANY = re.compile(r"#\s*rngaudit:\s*ignore", re.IGNORECASE)
_COMMENT = re.compile(r"(?:^|\s)#\s*rngaudit:\s*ignore\b(?:\[([^\]]*)\])?", re.IGNORECASE)


def ignore_comment(line: str) -> re.Match | None:
    """The ignore comment on `line`; its group 1 is the text between the brackets (None: no brackets). A `#` inside
    a quoted string (`label: "x # rngaudit: ignore"`) is the string's, no comment."""
    for m in _COMMENT.finditer(line):
        if not _quoted(line, line.index("#", m.start())):
            return m
    return None


def _quoted(line: str, pos: int) -> bool:
    """Whether `pos` of `line` is inside a quoted string: one that opens at the start of a value (YAML's quoted
    scalars, Python's strings), `''` inside single quotes and backslash escapes inside double ones."""
    quote = ""
    i = 0
    while i < pos:
        ch = line[i]
        if not quote:
            if ch in "'\"" and (i == 0 or line[i - 1] in " \t[{(,:="):
                quote = ch
        elif ch == "\\" and quote == '"':
            i += 1
        elif ch == quote:
            if quote == "'" and line[i + 1 : i + 2] == "'":
                i += 1
            else:
                quote = ""
        i += 1
    if not quote:
        return False
    # a quote that never closes on the line opened no string (`rock 'n roll`, `say "hi`): the `#` is a comment's
    rest = line[pos:]
    return quote in (rest.replace("''", "") if quote == "'" else re.sub(r"\\.", "", rest))


def ignore_comments(text: str) -> Iterator[tuple[int, re.Match]]:
    """(line number, match) of each ignore comment of a text."""
    if _ANY.search(text) is None:  # (one scan of the whole text: most inputs have no ignore comment)
        return
    for n, line in enumerate(text.splitlines(), 1):
        m = ignore_comment(line)
        if m is not None:
            yield n, m


def named_rules(m: re.Match) -> list[str] | None:
    """The rule names a comment gives, stripped; None for a bare comment (or empty brackets): every rule."""
    inner = m.group(1)
    if inner is None or not inner.strip():
        return None
    return [name.strip() for name in inner.split(",") if name.strip()]
