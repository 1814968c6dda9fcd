"""Safe YAML loading into plain values that remember their file:line:col."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import Location, SpecError
from .limits import MAX_DEPTH, current_limits, read_bounded

# Only the YAML core schema is allowed; anything else (!!python/object, !!binary,
# timestamps, sets, custom tags) is refused rather than constructed.
_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"


def _too_many_nodes(max_nodes: int) -> str:
    return (
        f"the spec expands to more than {max_nodes} YAML nodes (an alias bomb?); write it without repeating "
        "anchors, or raise the limit with --max-yaml-nodes for a spec this large"
    )


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


class _Loader(yaml.SafeLoader):
    """The safe loader's parser and composer, with nesting and alias expansion bounded while
    composing: a deep or alias-bomb document is refused at the offending node, before any
    recursion or expansion can hurt."""

    def __init__(self, text: str, file: str):
        super().__init__(text)
        self._file = file
        self._open: list[list[int]] = [[0, 0]]  # per open node: [expanded size, height]
        self._open_anchors: set[str] = set()
        self._stats: dict[str, tuple[int, int]] = {}  # anchor -> (expanded size, height)
        self._total = 0
        self._max_nodes = current_limits().max_nodes

    def _grow(self, size: int, mark) -> None:
        self._total += size
        if self._total > self._max_nodes:
            raise SpecError(_too_many_nodes(self._max_nodes), _loc(self._file, mark))

    def compose_node(self, parent, index):
        depth = len(self._open)  # the depth of the node about to be composed, root = 1
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            anchor = event.anchor
            if anchor in self._open_anchors:
                raise SpecError(
                    f"alias *{anchor} is inside the node it refers to (a recursive structure); "
                    "rngaudit needs a tree: write the value out",
                    _loc(self._file, event.start_mark),
                )
            if anchor in self._stats:
                size, height = self._stats[anchor]
                if depth - 1 + height > MAX_DEPTH:
                    raise SpecError(
                        f"alias *{anchor} makes the spec nest deeper than {MAX_DEPTH} levels; flatten the spec",
                        _loc(self._file, event.start_mark),
                    )
                self._grow(size, event.start_mark)
                acc = self._open[-1]
                acc[0] += size
                acc[1] = max(acc[1], height)
            return super().compose_node(parent, index)
        event = self.peek_event()
        if depth > MAX_DEPTH:
            raise SpecError(
                f"YAML nested deeper than {MAX_DEPTH} levels; flatten the spec", _loc(self._file, event.start_mark)
            )
        self._grow(1, event.start_mark)
        anchor = event.anchor
        if anchor is not None and anchor in self.anchors:
            first = self.anchors[anchor].start_mark
            raise SpecError(
                f"duplicate anchor &{anchor} (first at line {first.line + 1}); rename one",
                _loc(self._file, event.start_mark),
            )
        self._open.append([1, 0])
        if anchor is not None:
            self._open_anchors.add(anchor)
        node = super().compose_node(parent, index)
        size, height = self._open.pop()
        height += 1
        if anchor is not None:
            self._open_anchors.discard(anchor)
            self._stats[anchor] = (size, height)
        acc = self._open[-1]
        acc[0] += size
        acc[1] = max(acc[1], height)
        return node


_SURROGATE = re.compile("[\ud800-\udfff]")


def not_a_spec(more: str, loc: Location) -> SpecError:
    """A YAML document that is no spec at all (a CI workflow, a config): it has no `rngaudit:` key, and `more` says
    what else shows it."""
    return SpecError(f"not an rngaudit spec: no `rngaudit: 1` at the top{more}; a spec starts with `rngaudit: 1`", loc)


def _paired(text: str, loc: Location) -> str:
    """`text` with each UTF-16 pair of halves (as JSON writes a character past U+FFFF, `\\ud83d\\ude00`) joined
    into its character; a half alone is no character at all: an error."""
    try:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError:
        i, half = 0, 0
        while i < len(text):  # the first half that has no partner
            c = ord(text[i])
            if 0xD800 <= c <= 0xDBFF and i + 1 < len(text) and 0xDC00 <= ord(text[i + 1]) <= 0xDFFF:
                i += 2
                continue
            if 0xD800 <= c <= 0xDFFF:
                half = c
                break
            i += 1
        raise SpecError(
            f"the string holds \\u{half:04x}, half of a UTF-16 pair and no character: write the character itself "
            "(or its \\U escape)",
            loc,
        ) from None


_SCALAR_KIND = {_INT: "integer", _FLOAT: "number", _BOOL: "boolean"}


class _Converter:
    def __init__(self, file: str):
        self.file = file
        self.count = 0
        self.max_nodes = current_limits().max_nodes
        self.scalars = yaml.SafeLoader("")

    def convert(self, node: yaml.Node, depth: int) -> YNode:
        self.count += 1
        loc = _loc(self.file, node.start_mark)
        # The loader bounds both already; these guard YNode trees built some other way.
        if self.count > self.max_nodes:
            raise SpecError(_too_many_nodes(self.max_nodes), loc)
        if depth > MAX_DEPTH:
            raise SpecError(f"YAML nested deeper than {MAX_DEPTH} levels; flatten the spec", loc)
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
                    raise SpecError(
                        f"a mapping key must be a plain string, not a "
                        f"{'list' if isinstance(knode, yaml.SequenceNode) else 'mapping'}",
                        kloc,
                    )
                key = self.convert(knode, depth + 1).value
                if isinstance(key, bool) or key is None:
                    reads = f"the key {knode.value!r} reads as {'a boolean' if isinstance(key, bool) else 'null'}"
                    if depth == 0 and not any(k.value == "rngaudit" for k, _ in node.value):  # (a workflow's on:)
                        raise not_a_spec(f" (and {reads} in YAML)", _loc(self.file, node.start_mark))
                    raise SpecError(f'{reads} in YAML; quote it ("{knode.value}") to use it as a name', kloc)
                if not isinstance(key, str):
                    key = knode.value  # 1, 0x10, 1.5: the name as written
                if key in items:
                    first = key_locs[key]
                    raise SpecError(f"duplicate key {key!r} (first at line {first.line}); keep one", kloc)
                items[key] = self.convert(vnode, depth + 1)
                key_locs[key] = kloc
            return YNode(items, loc, key_locs)
        if isinstance(node, yaml.SequenceNode):
            if tag != _SEQ:
                raise self._bad_tag(node, loc)
            return YNode([self.convert(n, depth + 1) for n in node.value], loc)
        assert isinstance(node, yaml.ScalarNode)  # (a document holds mappings, sequences and scalars only)
        if tag == _STR:
            value = node.value
            if _SURROGATE.search(value):  # ("\ud83d\ude00" in double quotes: PyYAML leaves the pair's two halves)
                value = _paired(value, loc)
            return YNode(value, loc, quoted=node.style in ("'", '"'))
        if tag in _SCALAR_KIND:
            construct = {
                _INT: self.scalars.construct_yaml_int,
                _FLOAT: self.scalars.construct_yaml_float,
                _BOOL: self.scalars.construct_yaml_bool,
            }[tag]
            if tag == _INT and len(node.value) > 400:
                # (past Python's int-to-text limit too: not a number any field holds)
                raise SpecError(
                    f"an integer of {len(node.value)} characters; the numbers of a spec (seeds, counts, sizes) have "
                    "at most 20 digits",
                    loc,
                )
            try:
                return YNode(construct(node), loc)
            except (ValueError, KeyError, IndexError, TypeError):
                short = tag.replace("tag:yaml.org,2002:", "!!")
                raise SpecError(
                    f"{node.value!r} is not a valid {_SCALAR_KIND[tag]} for {short}; "
                    f"fix the value or drop the {short} tag",
                    loc,
                ) from None
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
            "(strings, numbers, booleans, null, lists, mappings): drop the tag",
            loc,
        )


_HINTS = (
    ("found unexpected end of stream", "close the quote or bracket"),
    ("mapping values are not allowed here", "quote a value that contains ': '"),
    ("found undefined alias", "define the anchor (&name) before the alias (*name)"),
    ("but got '<stream end>'", "close the bracket"),
    (
        "expected ',' or '}', but got",
        ('inside {...} quote a value that holds commas or brackets, e.g. "split(key(0), 3)[1]"'),
    ),
    ("expected ',' or ']', but got", "inside [...] quote a value that holds commas or brackets"),
    ("expected <block end>", "check the indentation of this line"),
)


def _yaml_problem(e: yaml.MarkedYAMLError):
    """(message, mark) for a PyYAML error: its problem, the context that explains it, a fix."""
    problem = e.problem or e.context or "invalid YAML"
    mark = e.problem_mark or e.context_mark
    if "expected a single document" in str(e.context or ""):
        return "the file holds several YAML documents; keep one (drop the extra '---')", mark
    if "cannot start any token" in problem and ("'\\t'" in problem or "\t" in problem):
        return "found a tab character; indent with spaces, not tabs", mark
    if problem == "found unexpected end of stream" and e.context and e.context_mark is not None:
        what = e.context.replace("while scanning ", "")
        if what == "a quoted scalar":
            return "this quoted string is never closed; close the quote", e.context_mark
        return f"{what} that starts here is never closed; close it", e.context_mark
    if problem == "could not find expected ':'" and e.context_mark is not None:
        return (
            "this line has no `key: value` (a colon followed by a space); write `key: value` or quote the text"
        ), e.context_mark
    text = problem
    if e.problem and e.context:
        cm = e.context_mark
        where = f" at line {cm.line + 1}, column {cm.column + 1}" if cm is not None else ""
        text = f"{problem} ({e.context}{where})"
    for needle, hint in _HINTS:
        if needle in problem:
            text += f"; {hint}"
            break
    return text, mark


def load_text(text: str, file: str) -> YNode:
    """Parse one YAML document safely; raise SpecError with file:line:col on any problem."""
    try:
        loader = _Loader(text, file)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as e:
        pos = e.position if isinstance(e.position, int) else 0
        before = text[:pos]
        line = before.count("\n") + 1
        col = pos - (before.rfind("\n") + 1) + 1
        char = e.character if isinstance(e.character, int) else ord(str(e.character)[:1] or "?")
        raise SpecError(
            f"invalid YAML: the control character U+{char:04X} is not allowed in YAML; "
            "remove it (or write it as an escape in a double-quoted string)",
            Location(file, line, col),
        ) from None
    except yaml.MarkedYAMLError as e:
        problem, mark = _yaml_problem(e)
        loc = _loc(file, mark) if mark is not None else Location(file, 1, 1)
        raise SpecError(f"invalid YAML: {problem}", loc) from None
    except yaml.YAMLError as e:
        raise SpecError(f"invalid YAML: {' '.join(str(e).split())}", Location(file, 1, 1)) from None
    except RecursionError:
        raise SpecError(f"YAML nested too deeply (the limit is {MAX_DEPTH} levels)", Location(file, 1, 1)) from None
    if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL and node.value == ""):
        raise SpecError("the spec is empty; start with `rngaudit: 1`", Location(file, 1, 1))
    try:
        return _Converter(file).convert(node, 0)
    except RecursionError:
        raise SpecError(f"YAML nested too deeply (the limit is {MAX_DEPTH} levels)", Location(file, 1, 1)) from None


def load_file(path: str) -> YNode:
    """Read and parse a spec file, refusing directories, huge files and non-UTF-8 bytes."""
    top = Location(path, 1, 1)
    max_bytes = current_limits().max_bytes
    if os.path.isdir(path):
        raise SpecError("is a directory, not a spec file; name a YAML file", top)
    data = read_bounded(
        path,
        max_bytes,
        lambda message: SpecError(message, top),
        directory="is a directory, not a spec file; name a YAML file",
    )
    return load_bytes(data, path)


def load_bytes(data: bytes, path: str) -> YNode:
    """Parse a spec's bytes (a file's, or standard input's) as load_file does: size, UTF-8, then YAML."""
    top = Location(path, 1, 1)
    max_bytes = current_limits().max_bytes
    if len(data) > max_bytes:
        raise SpecError(
            f"the file is larger than {max_bytes / (1024 * 1024):g} MiB; a spec this large needs --max-spec-mib", top
        )
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]  # a UTF-8 BOM: not part of the text, and not a column
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start]
        line = before.count(b"\n") + 1
        line_start = before.rfind(b"\n") + 1
        col = len(before[line_start:].decode("utf-8", errors="replace")) + 1
        raise SpecError(
            f"the file is not UTF-8 (byte 0x{data[e.start]:02x}); save it as UTF-8",
            Location(path, line, col),
        ) from None
    return load_text(text, path)
