"""JSON module paths or a params tree -> call sites: each module's params take its `params` counts 1, 2, ..."""

from __future__ import annotations

import hashlib
import sys

from ..engine.hashing import hash_input
from ..errors import InputError, Location
from ..gcpause import paused
from ..spec.json_source import JsonDoc, load_json
from .results import CallSite
from .sites import RenameTarget, Sites, count_bytes, vectorised

STREAM = "params"
BASE = "rngs['params']"
MAX_SITES = 50_000_000


def parse_path(text: str) -> tuple[str, ...]:
    """ "a/b/c" (or "/a/b/c", as Flax prints scope paths) -> ('a', 'b', 'c'); "" or "/" is the root.
    The names are interned: a million paths of a few modules each share their names' strings."""
    text = text.removeprefix("/")
    return tuple(map(sys.intern, text.split("/"))) if text else ()


def _type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def _path_bytes(path: tuple[str, ...], separator: bool) -> bytes:
    """hash_input(path, separator) for names only, fast: the UTF-8 of a concatenation is the
    concatenation of the UTF-8s."""
    if separator:
        return ("\x00" + "\x00".join(path)).encode("utf-8") if path else b""
    return "".join(path).encode("utf-8")


class ModuleSites(Sites):
    """Call sites of a JSON input. A list of module paths ("a/b/c" or ["a", "b", "c"]): each entry is one
    key its module draws, so a path listed three times draws counts 1, 2, 3. A params tree (nested objects
    whose leaves are anything but objects, e.g. shape lists; a top-level {"params": ...} is unwrapped):
    every leaf is one param, and a module's params draw counts 1, 2, ... in file order."""

    @paused
    def __init__(self, doc: JsonDoc, separator: bool = False):
        self.doc = doc
        self.source = doc.file
        self.separator = separator
        self.prng_impl = None
        self.keys = None
        self._path_ids: dict[tuple[str, ...], int] = {}
        self.paths = []
        self._prefix: list[bytes] = []  # path id -> hashed bytes of the path
        self._module_ptr: list[tuple] | None = None  # params tree: path id -> pointer to the module's key
        self._first_entry: list[int] | None = None  # path list: path id -> its first entry
        self._leaves: list[list[str]] | None = None  # params tree: path id -> its param names in file order
        value = doc.value
        if isinstance(value, list):
            self.input_kind = "paths"
            self._from_paths(value)
        elif isinstance(value, dict):
            self.input_kind = "params_tree"
            self._from_tree(value)
        else:
            raise InputError(
                f"expected a list of module paths or a params tree (an object), not {_type(value)}",
                Location(doc.file, 1, 1),
            )
        self.doc = JsonDoc(doc.file, doc.text, None)  # locations come from the text; drop the parsed value

    def _columns(self, pids: list[int], counts: list[int]) -> None:
        """Fill the columns from every site's path id and count: arrays when vectorised, else the lists."""
        sha1 = hashlib.sha1
        prefix = self._prefix
        top = max(counts, default=0)
        cb = [count_bytes(c, self.separator) if c else b"" for c in range(top + 1)]
        self.vectorised = vectorised(len(pids))
        if not self.vectorised:
            self.path_id, self.count, self.unit = pids, counts, [0] * len(pids)
            self.word = [int.from_bytes(sha1(prefix[p] + cb[c]).digest()[:4], "big") for p, c in zip(pids, counts)]
            return
        import numpy as np

        digests = b"".join([sha1(prefix[p] + cb[c]).digest()[:4] for p, c in zip(pids, counts)])
        self.word = np.frombuffer(digests, dtype=">u4").astype(np.uint32)
        self.path_id = np.asarray(pids, dtype=np.int32)
        self.count = np.asarray(counts, dtype=np.int64)
        self.unit = np.zeros(len(pids), dtype=np.int32)

    def _from_paths(self, entries: list) -> None:
        if len(entries) > MAX_SITES:
            raise InputError(f"more than {MAX_SITES} entries", Location(self.doc.file, 1, 1))
        path_ids = self._path_ids
        paths, prefix, first = self.paths, self._prefix, []
        sep = self.separator
        next_count: list[int] = []
        pids = [0] * len(entries)
        counts = [0] * len(entries)
        for k, entry in enumerate(entries):
            if isinstance(entry, str):
                path = parse_path(entry)
            elif isinstance(entry, list) and _names(entry):
                path = tuple(entry)
            else:
                where = self.doc.locate([(k,)]).get((k,), Location(self.doc.file, 1, 1))
                raise InputError(
                    f'entry {k}: a module path is a string "a/b/c" or a list of names '
                    f'["a", "b", "c"], not {_type(entry)}',
                    where,
                )
            pid = path_ids.get(path)
            if pid is None:
                pid = path_ids[path] = len(paths)
                paths.append(path)
                prefix.append(_path_bytes(path, sep))
                first.append(k)
                next_count.append(0)
            c = next_count[pid] = next_count[pid] + 1
            pids[k] = pid
            counts[k] = c
        self._first_entry = first
        self._columns(pids, counts)

    def _from_tree(self, tree: dict) -> None:
        ptr: tuple = ()
        if isinstance(tree.get("params"), dict) and all(isinstance(v, dict) for v in tree.values()):
            tree, ptr = tree["params"], ("params",)  # a dump of `variables`: {"params": {...}, ...}
        self._module_ptr, self._leaves = [], []
        pids: list[int] = []
        counts: list[int] = []
        stack: list[tuple[tuple[str, ...], tuple, dict]] = [((), ptr, tree)]
        while stack:
            path, at, node = stack.pop()
            pid = self._path_ids[path] = len(self.paths)
            self.paths.append(path)
            self._prefix.append(_path_bytes(path, self.separator))
            self._module_ptr.append(at)
            leaves: list[str] = []
            self._leaves.append(leaves)
            children: list[tuple[tuple[str, ...], tuple, dict]] = []
            for name, v in node.items():
                if isinstance(v, dict):
                    children.append((path + (name,), at + (name,), v))
                else:
                    leaves.append(name)
                    pids.append(pid)
                    counts.append(len(leaves))
            if len(pids) > MAX_SITES:
                raise InputError(f"more than {MAX_SITES} params", Location(self.doc.file, 1, 1))
            stack.extend(reversed(children))
        self._columns(pids, counts)

    # ------------------------------------------------------------ per site
    def items(self, i: int) -> tuple:
        return self.paths[self.path_id[i]] + (int(self.count[i]),)

    def path_bytes(self, i: int, separator: bool | None = None) -> bytes:
        if separator is None or separator == self.separator:
            return self._prefix[self.path_id[i]]
        return _path_bytes(self.paths[self.path_id[i]], separator)

    def paths_bytes(self, indices) -> list[bytes]:
        prefix = self._prefix
        pids = self.path_id[indices].tolist() if self.vectorised else [self.path_id[i] for i in indices]
        return [prefix[p] for p in pids]

    def stream(self, i: int) -> str:
        return STREAM

    def base_of(self, i: int) -> str:
        return BASE

    def _site_pointer(self, i: int) -> tuple:
        if self._leaves is None or self._module_ptr is None:
            return (i,)
        pid = int(self.path_id[i])
        return self._module_ptr[pid] + (self._leaves[pid][int(self.count[i]) - 1],)

    def _module_pointer(self, path: tuple[str, ...]) -> tuple | None:
        pid = self._path_ids.get(path)
        if pid is None:
            return None
        if self._module_ptr is None:
            assert self._first_entry is not None  # (a path list)
            return (self._first_entry[pid],)
        return self._module_ptr[pid]

    def describe(self, indices, module_paths):
        site_ptrs = {i: self._site_pointer(i) for i in indices}
        module_ptrs = {p: self._module_pointer(p) for p in module_paths}
        where = self.doc.locate(list(site_ptrs.values()) + [p for p in module_ptrs.values() if p is not None])
        top = Location(self.source, 1, 1)
        sites = {}
        for i, ptr in site_ptrs.items():
            items = self.items(i)
            label = self._leaves[int(self.path_id[i])][items[-1] - 1] if self._leaves is not None else None
            sites[i] = CallSite(
                i,
                items[:-1],
                STREAM,
                STREAM,
                items[-1],
                (),
                BASE,
                "param",
                label,
                items,
                hash_input(items, self.separator),
                int(self.word[i]),
                None,
                where.get(ptr, top),
            )
        return sites, {p: where[ptr] for p, ptr in module_ptrs.items() if ptr in where}

    def rename_target(self, i: int) -> RenameTarget | None:
        path = self.paths[self.path_id[i]]
        return RenameTarget(path, None, True, None) if path else None


def is_spec(value) -> bool:
    """A JSON file that holds a spec (JSON is YAML) rather than module paths."""
    return isinstance(value, dict) and "rngaudit" in value and "model" in value


def _names(entry: list) -> bool:
    return all(isinstance(x, str) for x in entry)


def load_module_sites(path: str, separator: bool = False) -> ModuleSites:
    return ModuleSites(load_json(path), separator)
