"""JSON files read strictly, with the file:line:col of any entry found on request."""

from __future__ import annotations

import bisect
import json
import os
import re
from collections.abc import Callable
from typing import cast

from ..errors import InputError, Location
from ..gcpause import paused
from .limits import read_bounded

MAX_BYTES = 512 * 1024 * 1024

_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*(,)?[ \t\n\r]*")
# both patterns match anywhere (every part is optional): typed so, at no cost per call
_ws = cast(Callable[[str, int], re.Match[str]], _WS.match)
_sep = cast(Callable[[str, int], re.Match[str]], _SEP.match)
_scanstring = cast(Callable[[str, int], tuple[str, int]], json.decoder.scanstring)  # type: ignore[attr-defined]
_DECODER = json.JSONDecoder()
_HERE = object()  # marks, in a tree of wanted pointers, that the pointer ends here

# The end of a value that is a flat array or an object of scalars and flat arrays (a module of a
# params tree: {"kernel": [4, 4], ...}), found by the regex engine without building the value. The
# text is valid JSON already (json.loads read it), so a match ends exactly where the value does;
# anything deeper does not match and is skipped by raw_decode.
_STR = r'"(?:[^"\\]|\\.)*+"'
_SCALAR = r"(?:" + _STR + r'|[^\s,:\[\]{}"]++)'
_ARR = r"\[\s*+(?:" + _SCALAR + r"\s*+(?:,\s*+" + _SCALAR + r"\s*+)*+)?\]"
_LEAF = r"(?:" + _SCALAR + r"|" + _ARR + r")"
_MEMBER = _STR + r"\s*+:\s*+" + _LEAF + r"\s*+"
_FLAT = re.compile(r"(?:" + _ARR + r"|\{\s*+(?:" + _MEMBER + r"(?:,\s*+" + _MEMBER + r")*+)?\})")


# JUMP list elements (scalars or flat arrays), each with its comma, matched at once: a walk to the
# entries wanted from a list of a million module paths takes a step per JUMP elements, not per element
JUMP = 64
_JUMP = re.compile(r"(?:(?:" + _SCALAR + r"|" + _ARR + r")\s*+,\s*+){" + str(JUMP) + "}")
# The same for strings and arrays of strings without escapes, five to twenty times faster: without a
# backslash in what it matched, a '"' always opens or closes a string, so `"[^"]*"` is exactly a string
_W = r"[ \t\n\r]*+"
_PLAIN_STR = r'"[^"]*+"'
_PLAIN_ARR = r"\[" + _W + r"(?:" + _PLAIN_STR + _W + r"(?:," + _W + _PLAIN_STR + _W + r")*+)?\]"
_JUMP_PLAIN = re.compile(r"(?:(?:" + _PLAIN_STR + r"|" + _PLAIN_ARR + r")" + _W + r"," + _W + r"){" + str(JUMP) + "}")


def _jump(text: str, pos: int) -> int | None:
    """The offset past the next JUMP list elements at `pos` and their commas (None: fewer than JUMP + 1
    elements are left, or one is an object or a nested array)."""
    m = _JUMP_PLAIN.match(text, pos)
    if m is not None and text.find("\\", pos, m.end()) < 0:
        return m.end()
    m = _JUMP.match(text, pos)
    return None if m is None else m.end()


def _skip(text: str, pos: int) -> int:
    """The offset just past the JSON value at `pos` (no leading whitespace)."""
    m = _FLAT.match(text, pos)
    return m.end() if m is not None else _DECODER.raw_decode(text, pos)[1]


class _Duplicate(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


class _Found(Exception):
    def __init__(self, offset: int):
        super().__init__(offset)
        self.offset = offset


class _Done(Exception):
    """Every wanted pointer is located: stop reading."""


def _no_duplicates(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


class JsonDoc:
    """A parsed JSON document that can say where its entries are. A pointer is a tuple of object
    keys and list indices from the top; its location is that of the key (in an object) or of the
    value (in a list)."""

    def __init__(self, file: str, text: str, value):
        self.file = file
        self.text = text
        self.value = value
        self._lines: list[int] | None = None

    def location(self, offset: int) -> Location:
        if self._lines is None:
            self._lines = [m.end() for m in re.finditer("\n", self.text)]
        line = bisect.bisect_right(self._lines, offset)
        start = self._lines[line - 1] if line else 0
        return Location(self.file, line + 1, offset - start + 1)

    def locate(self, pointers) -> dict[tuple, Location]:
        """Location of every pointer that exists, in one pass over the text."""
        pointers = set(pointers)
        tree: dict = {}
        wanted = 0
        for p in pointers:
            node = tree
            for part in p:
                node = node.setdefault(part, {})
            if _HERE not in node:
                node[_HERE] = True
                wanted += 1
        found: dict[tuple, int] = {}
        self._left = wanted
        try:
            if () in pointers:
                found[()] = _ws(self.text, 0).end()
                self._left -= 1
            if self._left:
                self._visit(_ws(self.text, 0).end(), tree, (), found)
        except _Done:
            pass
        except RecursionError:
            pass  # a document nested deeper than Python recurses: the entries found so far
        return {p: self.location(o) for p, o in found.items()}

    def _mark(self, node: dict, path: tuple, offset: int, found: dict) -> None:
        if _HERE in node and path not in found:
            found[path] = offset
            self._left -= 1
            if self._left == 0:
                raise _Done()

    def _visit(self, pos: int, tree: dict, path: tuple, found: dict) -> int:
        """Walk the value at `pos` (no leading whitespace) looking for the pointers in `tree`; return the
        offset after it (members not wanted are skipped whole: _skip). The document is valid JSON
        (json.loads read it), so the walk trusts the syntax."""
        text = self.text
        ws, sep = _ws, _sep
        is_object = text[pos] == "{"
        if not is_object and text[pos] != "[":
            return _skip(text, pos)
        start = pos
        left = len(tree) - (1 if _HERE in tree else 0)  # wanted members not reached yet
        close = "}" if is_object else "]"
        pos = ws(text, pos + 1).end()
        if text[pos] == close:
            return pos + 1
        index = 0
        if not is_object:  # the wanted indices, ascending; the walk jumps over runs of others
            targets = sorted(k for k in tree if type(k) is int)
            t = 0
        while True:
            if not is_object:
                while t < len(targets) and targets[t] < index:
                    t += 1
                gap = (targets[t] if t < len(targets) else len(text)) - index
                while gap >= JUMP:
                    end = _jump(text, pos)
                    if end is None:
                        break
                    pos = end
                    index += JUMP
                    gap -= JUMP
            at = pos
            key: str | int
            if is_object:
                key, pos = _scanstring(text, pos + 1)
                pos = ws(text, ws(text, pos).end() + 1).end()  # past ':'
            else:
                key = index
                index += 1
            node = tree.get(key)
            if node is None:
                pos = _skip(text, pos)
            else:
                self._mark(node, path + (key,), at, found)
                if len(node) > (1 if _HERE in node else 0):
                    pos = self._visit(pos, node, path + (key,), found)
                else:
                    pos = _skip(text, pos)
                left -= 1
                if left == 0 and path:
                    return _skip(text, start)  # the rest holds nothing wanted: skip it whole
            m = sep(text, pos)
            if m.group(1) is None:
                return m.end() + 1  # past the closing bracket
            pos = m.end()

    def duplicate_key(self, key: str) -> Location:
        """Where `key` occurs a second time in one object (the first such place)."""
        try:
            self._find_duplicate(_ws(self.text, 0).end(), key)
        except _Found as f:
            return self.location(f.offset)
        except RecursionError:
            pass
        return Location(self.file, 1, 1)

    def _find_duplicate(self, pos: int, key: str) -> int:
        text = self.text
        ch = text[pos]
        if ch not in "{[":
            return _DECODER.raw_decode(text, pos)[1]
        close = "}" if ch == "{" else "]"
        pos = _ws(text, pos + 1).end()
        if text[pos] == close:
            return pos + 1
        seen = False
        while True:
            if ch == "{":
                at = pos
                k, pos = _scanstring(text, pos + 1)
                if k == key:
                    if seen:
                        raise _Found(at)
                    seen = True
                pos = _ws(text, _ws(text, pos).end() + 1).end()
            pos = self._find_duplicate(pos, key)
            pos = _ws(text, pos).end()
            if text[pos] == close:
                return pos + 1
            pos = _ws(text, pos + 1).end()


@paused
def load_json(path: str) -> JsonDoc:
    """Read a JSON file: UTF-8, one value, no duplicate keys; errors carry file:line:col."""
    top = Location(path, 1, 1)
    if os.path.isdir(path):
        raise InputError("is a directory, not a JSON file", top)
    too_big = InputError(f"the file is larger than {MAX_BYTES // (1024 * 1024)} MiB", top)
    data = read_bounded(path, MAX_BYTES, lambda message: InputError(message, top))
    if len(data) > MAX_BYTES:
        raise too_big
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start]
        line_start = before.rfind(b"\n") + 1
        col = len(before[line_start:].decode("utf-8", errors="replace")) + 1
        raise InputError(
            f"the file is not UTF-8 (byte 0x{data[e.start]:02x}); save it as UTF-8",
            Location(path, before.count(b"\n") + 1, col),
        ) from None
    return parse_json(text, path)


class _Huge(Exception):
    def __init__(self, digits: str):
        self.digits = digits


def _bounded_int(digits: str) -> int:
    """An integer of a JSON document (json.loads' parse_int): one past what any field holds is refused with its
    place, before Python's own limit (4,300 digits) raises a bare ValueError."""
    if len(digits) > 400:
        raise _Huge(digits)
    return int(digits)


def parse_json(text: str, file: str = "<json>") -> JsonDoc:
    if not text.strip():
        raise InputError(
            "the file is empty; expected JSON (a list of module paths or a params tree)", Location(file, 1, 1)
        )
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_bounded_int)
    except _Huge as h:
        at = text.find(h.digits)
        before = text[:at]
        raise InputError(
            f"an integer of {len(h.digits.lstrip('-'))} digits; the numbers of these files (keys, counts, seeds, "
            "steps) have at most 20",
            Location(file, before.count("\n") + 1, at - before.rfind("\n")),
        ) from None
    except json.JSONDecodeError as e:
        # (the json module's message reads on into the position it leaves out: "Unterminated string starting at")
        msg = e.msg.removesuffix(" at").removesuffix(" starting")
        raise InputError(f"invalid JSON: {msg}", Location(file, e.lineno, e.colno)) from None
    except _Duplicate as d:
        doc = JsonDoc(file, text, None)
        raise InputError(f"duplicate key {d.key!r} in one JSON object; keep one", doc.duplicate_key(d.key)) from None
    except RecursionError:
        raise InputError("JSON nested too deeply", Location(file, 1, 1)) from None
    lone = _lone_surrogate(text)
    if lone is not None:
        before = text[:lone]
        raise InputError(
            f"{text[lone : lone + 6]} is half of a UTF-16 pair and no character; write the character (or its pair)",
            Location(file, before.count("\n") + 1, lone - before.rfind("\n")),
        )
    return JsonDoc(file, text, value)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(text: str) -> int | None:
    """Where a `\\udXXX` escape of the (valid) JSON text stands for half a UTF-16 pair alone, if one does (json.loads
    takes it, and the string then cannot be written as UTF-8); a backslash escaped itself starts none."""
    if "\\u" not in text:
        return None
    pending = -1  # a high half's position, waiting for its low half right after it
    for m in _SURROGATE_ESCAPE.finditer(text):
        at = m.start()
        j = at
        while j and text[j - 1] == "\\":
            j -= 1
        if (at - j) % 2:  # (`\\udxxx`: a backslash, then text)
            continue
        low = m.group()[3] in "cdefCDEF"
        if pending >= 0:
            if low and at == pending + 6:
                pending = -1
                continue
            return pending
        if low:
            return at
        pending = at
    return pending if pending >= 0 else None
