"""Safe YAML loading into plain values that remember their file:line:col."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import Location, SpecError

# Only the YAML core schema is allowed; anything else (!!python/object, !!binary,
# timestamps, sets, custom tags) is refused rather than constructed.
_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"

MAX_BYTES = 16 * 1024 * 1024
MAX_NODES = 2_000_000
MAX_DEPTH = 200


@dataclass
class YNode:
    """A YAML value with its position. `value` is a str/int/float/bool/None,
    a dict[str, YNode] (mapping) or a list[YNode] (sequence)."""

    value: Any
    loc: Location
    key_locs: dict[str, Location] = field(default_factory=dict)
    quoted: bool = False

    @property
    def is_map(self) -> bool:
        return isinstance(self.value, dict)

    @property
    def is_seq(self) -> bool:
        return isinstance(self.value, list)

    def plain(self) -> Any:
        """The value with all positions dropped."""
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value


def _loc(file: str, mark) -> Location:
    return Location(file, mark.line + 1, mark.column + 1)


class _Converter:
    def __init__(self, file: str):
        self.file = file
        self.count = 0
        self.scalars = yaml.SafeLoader("")

    def convert(self, node: yaml.Node, depth: int) -> YNode:
        self.count += 1
        loc = _loc(self.file, node.start_mark)
        if self.count > MAX_NODES:
            raise SpecError(
                f"the spec has more than {MAX_NODES} YAML nodes (alias expansion?); "
                "write it without repeating anchors",
                loc,
            )
        if depth > MAX_DEPTH:
            raise SpecError(f"YAML nested deeper than {MAX_DEPTH} levels", loc)
        tag = node.tag
        if isinstance(node, yaml.MappingNode):
            if tag != _MAP:
                raise self._bad_tag(node, loc)
            items: dict[str, YNode] = {}
            key_locs: dict[str, Location] = {}
            for knode, vnode in node.value:
                kloc = _loc(self.file, knode.start_mark)
                if knode.tag == "tag:yaml.org,2002:merge":
                    raise SpecError("YAML merge keys (<<) are not supported; write the keys out", kloc)
                if not isinstance(knode, yaml.ScalarNode):
                    raise SpecError("mapping keys must be plain strings", kloc)
                key = self.convert(knode, depth + 1).value
                if not isinstance(key, str):
                    key = str(key) if not isinstance(key, bool) and key is not None else None
                    if key is None:
                        raise SpecError("mapping keys must be strings; quote this key", kloc)
                if key in items:
                    first = key_locs[key]
                    raise SpecError(
                        f"duplicate key {key!r} (first at line {first.line}); keep one", kloc
                    )
                items[key] = self.convert(vnode, depth + 1)
                key_locs[key] = kloc
            return YNode(items, loc, key_locs)
        if isinstance(node, yaml.SequenceNode):
            if tag != _SEQ:
                raise self._bad_tag(node, loc)
            return YNode([self.convert(n, depth + 1) for n in node.value], loc)
        if tag == _STR:
            return YNode(node.value, loc, quoted=node.style in ("'", '"'))
        if tag == _INT:
            return YNode(self.scalars.construct_yaml_int(node), loc)
        if tag == _FLOAT:
            return YNode(self.scalars.construct_yaml_float(node), loc)
        if tag == _BOOL:
            return YNode(self.scalars.construct_yaml_bool(node), loc)
        if tag == _NULL:
            return YNode(None, loc)
        raise self._bad_tag(node, loc)

    @staticmethod
    def _bad_tag(node: yaml.Node, loc: Location) -> SpecError:
        tag = node.tag
        if tag == "tag:yaml.org,2002:timestamp":
            return SpecError(f"{node.value!r} reads as a date; quote it to make it a string", loc)
        short = tag.replace("tag:yaml.org,2002:", "!!")
        return SpecError(
            f"YAML tag {short} is not allowed; rngaudit reads plain YAML only "
            "(strings, numbers, booleans, null, lists, mappings)",
            loc,
        )


def load_text(text: str, file: str) -> YNode:
    """Parse one YAML document safely; raise SpecError with file:line:col on any problem."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = _loc(file, mark) if mark is not None else Location(file, 1, 1)
        problem = e.problem or e.context or "invalid YAML"
        if "expected a single document" in str(e.context or ""):
            problem = "the file holds several YAML documents; keep one"
        raise SpecError(f"invalid YAML: {problem}", loc) from None
    except yaml.YAMLError as e:
        raise SpecError(f"invalid YAML: {e}", Location(file, 1, 1)) from None
    except RecursionError:
        raise SpecError(
            f"YAML nested too deeply (the limit is {MAX_DEPTH} levels)", Location(file, 1, 1)
        ) from None
    if node is None:
        raise SpecError("the spec is empty; start with `rngaudit: 1`", Location(file, 1, 1))
    try:
        return _Converter(file).convert(node, 0)
    except RecursionError:
        raise SpecError(
            f"YAML nested too deeply (the limit is {MAX_DEPTH} levels)", Location(file, 1, 1)
        ) from None


def load_file(path: str) -> YNode:
    """Read and parse a spec file, refusing directories, huge files and non-UTF-8 bytes."""
    top = Location(path, 1, 1)
    if os.path.isdir(path):
        raise SpecError("is a directory, not a spec file", top)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise SpecError("no such file", top) from None
    except OSError as e:
        raise SpecError(f"cannot read: {e.strerror or e}", top) from None
    if len(data) > MAX_BYTES:
        raise SpecError(f"the file is larger than {MAX_BYTES // (1024 * 1024)} MiB", top)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start]
        line = before.count(b"\n") + 1
        col = len(before) - (before.rfind(b"\n") + 1) + 1
        raise SpecError(
            f"the file is not UTF-8 (byte 0x{data[e.start]:02x}); save it as UTF-8",
            Location(path, line, col),
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return load_text(text, path)
