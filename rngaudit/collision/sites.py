"""One input's call sites as the audit reads them (the `Sites` interface: columns of units, paths, counts
and hash words, and per-site questions), and the idents that group sites by key."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.hashing import encode_item, hash_input
from ..errors import Location
from .results import CallSite

if TYPE_CHECKING:
    import numpy as np

# Inputs with fewer call sites keep their columns in Python lists and their keys on Python ints: that
# is quicker than importing NumPy (tens of ms) for them. Larger inputs use NumPy arrays. Both give the
# same report (tests/test_collisions_paths.py).
SMALL_SITES = 4096
_BYTEORDER = sys.byteorder


def vectorised(n: int) -> bool:
    """Whether an input of n call sites keeps its columns in NumPy arrays."""
    return n >= SMALL_SITES


@dataclass(frozen=True)
class RenameTarget:
    """The module that makes a call, if a `name:` can rename it, and where it is written."""

    path: tuple[str, ...]
    module_class: str | None
    explicit: bool
    location: Location | None  # None: the input finds it later (Sites.describe)
    local: bool = True  # only this module's subtree changes (else: auto-names shift, or it has several paths)
    module: object = field(default=None, compare=False)  # what Sites.renamed() renames


class Sites:
    """One input's call sites as columns, which is all the grouping needs; a CallSite is built only
    for a reported site. Subclasses fill the columns and answer the per-site questions. The columns
    are NumPy arrays when `vectorised` (see SMALL_SITES), else lists of ints (keys: of tuples)."""

    source: str
    input_kind: str
    separator: bool
    prng_impl: str | None
    vectorised: bool
    rules: str | None = None  # the Flax rule set a spec's sites follow (None: a JSON list of paths)
    # Each column is a NumPy array when `vectorised`, else a list of ints (Any: either)
    unit: Any  # int32: dense id of (base, lane): sites of one unit fold into the same base key
    word: Any  # uint32 hash words
    path_id: Any  # int32 index into `paths`
    count: Any  # int64
    paths: list[tuple[str, ...]]
    keys: Any  # (n, width) uint32 key data, or None (hash-only)

    @property
    def n(self) -> int:
        return len(self.word)

    def items(self, i: int) -> tuple:
        """What Flax hashes for site i: the path since its base, then the count."""
        raise NotImplementedError

    def path_bytes(self, i: int, separator: bool | None = None) -> bytes:
        """The bytes Flax hashes for site i's path, before the count (with `separator`, default the
        input's)."""
        return hash_input(self.items(i)[:-1], self.separator if separator is None else separator)

    def paths_bytes(self, indices: Sequence[int]) -> list[bytes]:
        """path_bytes of each of `indices` (ints)."""
        return [self.path_bytes(i) for i in indices]

    def stream(self, i: int) -> str:
        raise NotImplementedError

    def base_of(self, i: int):
        """The (hashable) base key reference site i folds into."""
        raise NotImplementedError

    def describe(
        self, indices: Sequence[int], module_paths: Sequence[tuple[str, ...]]
    ) -> tuple[dict[int, CallSite], dict[tuple[str, ...], Location]]:
        """CallSites for `indices`, and where the modules at `module_paths` are written."""
        raise NotImplementedError

    def rename_target(self, i: int) -> RenameTarget | None:
        raise NotImplementedError

    def notes_of(self, i: int) -> tuple[str, ...]:
        """What derive notes on site i's draw (the transforms it is traced in, ...); () where unknown."""
        return ()

    def keys_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool) -> np.ndarray | list | None:
        """Key data sites `indices` would get if they hashed `items` with `separator` (in the form of
        `keys`); None if hash-only."""
        return None

    @property
    def keys_checked(self) -> bool:
        """Whether sites are grouped by key (else by base and hash word: class 4 unchecked)."""
        return self.keys is not None

    def idents(self):
        """One sortable value per site, equal exactly where the keys are equal (hash-only: where the
        unit and the hash word are)."""
        if self.keys is not None:
            return key_idents(self.keys, self.vectorised)
        return word_idents(self.unit, self.word, self.vectorised)

    def idents_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool):
        """The idents sites `indices` would have if they hashed `items` with `separator`, comparable
        with idents(); None where the keys cannot be recomputed."""
        if self.keys is not None:
            keys = self.keys_for(indices, items, separator)
            return None if keys is None else key_idents(keys, self.vectorised)
        return word_idents([self.unit[i] for i in indices], words_of(items, separator), self.vectorised)

    def entry_columns(self):
        """The distinct (unit, path) of the sites, for the latent audit: (sorted unit << 32 | path id,
        its first site, its highest count); None to have them found from the columns."""
        return

    @property
    def replayable(self) -> bool:
        """Whether renames are checked by running the renamed model again (exact, for small specs)."""
        return False

    def renamed(self, changes: Sequence[tuple[RenameTarget, str]]) -> Sites | None:
        """The call sites of the input with these modules renamed; None when the renamed model fails."""
        return None


def words_of(items: Sequence[tuple], separator: bool) -> list[int]:
    """hash_word(hash_input(it, separator)) for each of `items`, the bytes of a path hashed once for
    all its counts."""
    from hashlib import sha1

    pre: dict[tuple, bytes] = {}
    out = []
    for it in items:
        path = it[:-1]
        head = pre.get(path)
        if head is None:
            head = pre[path] = hash_input(path, separator)
        out.append(int.from_bytes(sha1(head + count_bytes(it[-1], separator)).digest()[:4], "big"))
    return out


def key_idents(keys, vectorised: bool):
    """One comparable, sortable value per key: its raw bytes (native uint32s, as NumPy sorts them)."""
    if not vectorised:
        return [b"".join(w.to_bytes(4, _BYTEORDER) for w in k) for k in keys]
    import numpy as np

    k = np.ascontiguousarray(keys, dtype=np.uint32)
    if k.ndim == 2 and k.shape[1] == 2:
        # the 8 bytes read big-endian: integers sort (quickly) in the bytes' order, as the lists do
        return k.view(">u8").ravel().astype(np.uint64)
    return k.view(np.dtype((np.void, 4 * k.shape[1]))).ravel()


def word_idents(unit, words, vectorised: bool):
    """One comparable, sortable value per (unit, hash word)."""
    if not vectorised:
        return [(u << 32) | w for u, w in zip(unit, words)]
    import numpy as np

    return (np.asarray(unit, dtype=np.uint64) << np.uint64(32)) | np.asarray(words, dtype=np.uint64)


def ident_as_key(ident, vectorised: bool):
    """An ident as a dict key: the same value for the same key, in both column forms' own terms."""
    return ident.tobytes() if vectorised else ident


def count_bytes(count: int, separator: bool) -> bytes:
    return (b"\x00" if separator else b"") + encode_item(count)


class Unknown(Exception):
    """Key data that cannot be recomputed."""
