"""JSON laid out as every report writes it (`json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)`),
without the pure-Python encoder's generators: the standard library's C encoder does not indent, and a
diff's or a capture's 100,000 entries spent most of their time in those generators (and memory in their pieces).
Byte for byte the json module's layout (a property test compares them)."""

from __future__ import annotations

import json
from typing import Any

_string = json.encoder.encode_basestring  # (ensure_ascii=False)
_int = int.__repr__
_CONSTANTS = {None: "null", True: "true", False: "false"}
_INDENTED = json.JSONEncoder(sort_keys=True, indent=2, ensure_ascii=False)


def dumps(doc: Any) -> str:
    """JSON as every report writes it: sorted keys, indented, UTF-8 text, one trailing newline."""
    return indented(doc) + "\n"


def indented(value: Any, level: int = 0, step: str = "  ") -> str:
    """`value` as json.dumps(indent=2, sort_keys=True, ensure_ascii=False) lays it out at nesting `level`: dicts
    with string keys, lists, tuples, strings, ints, bools and None here, anything else as the json module does."""
    t = type(value)
    if t is str:
        return _string(value)
    if t is int:
        return _int(value)
    if value is None or value is True or value is False:
        return _CONSTANTS[value]
    if t is dict or t is list or t is tuple:
        if not value:
            return "{}" if t is dict else "[]"
        inner = "\n" + step * (level + 1)
        # (the scalar cases are written out in both loops below: one shared helper per container made a SARIF
        # log's many small containers 40% slower to lay out)
        deeper, parts = level + 1, []
        if t is dict:
            if not all(type(k) is str for k in value):  # (json's rules for other keys: ints, None, floats)
                return _nest(_INDENTED.encode(value), level, step)
            for k, v in sorted(value.items()):
                tv = type(v)
                if tv is str:
                    parts.append(_string(k) + ": " + _string(v))
                elif tv is int:
                    parts.append(_string(k) + ": " + _int(v))
                elif v is None or tv is bool:
                    parts.append(_string(k) + ": " + _CONSTANTS[v])
                else:
                    parts.append(_string(k) + ": " + indented(v, deeper, step))
            return "{" + inner + ("," + inner).join(parts) + "\n" + step * level + "}"
        for v in value:
            tv = type(v)
            if tv is str:
                parts.append(_string(v))
            elif tv is int:
                parts.append(_int(v))
            elif v is None or tv is bool:
                parts.append(_CONSTANTS[v])
            else:
                parts.append(indented(v, deeper, step))
        return "[" + inner + ("," + inner).join(parts) + "\n" + step * level + "]"
    if isinstance(value, str):  # (subclasses: as their base type)
        return _string(value)
    if isinstance(value, dict):
        return indented(dict(value), level, step)
    if isinstance(value, list | tuple):
        return indented(list(value), level, step)
    return _nest(_INDENTED.encode(value), level, step)  # (a float, an int subclass, or what json makes of it)


def _nest(text: str, level: int, step: str) -> str:
    return text.replace("\n", "\n" + step * level)
