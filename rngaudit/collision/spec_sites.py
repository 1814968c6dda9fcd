"""A replayed spec as call sites: small specs on the plain replay (Python lists, keys on Python ints, no
NumPy), large ones on derive's fast path (TableSites, columns from the key table); both give one report."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..engine.hashing import hash_input, hash_word
from ..errors import Location
from ..gcpause import paused
from ..spec.tree import (
    Child,
    Cond,
    Define,
    MakeRng,
    Param,
    Sequential,
    Spec,
    Transform,
    Variable,
    WhileLoop,
    renamed_modules,
)
from .results import CallSite, frozen_record
from .sites import RenameTarget, Sites, vectorised, words_of

if TYPE_CHECKING:
    import numpy as np

    from ..engine.keys import BaseKeys

REPLAY_LIMIT = 20_000  # specs with at most this many keys check renames by replaying the renamed model


class SpecSites(Sites):
    """A replayed spec: one call site per Derivation whose key Flax uses. Keys of threefry2x32 and rbg are
    exact Threefry: on Python ints for small specs, else NumPy (rngaudit.engine.keys);
    unsafe_rbg needs JAX."""

    def __init__(self, spec: Spec, keys: bool = True, rows=None, key_cache: dict | None = None):
        from ..engine.replay import replay

        self.spec = spec
        self.rules = spec.rules.name
        # fold_in results on Python ints, shared with this spec's renamed copies (derive_keys_exact)
        self.key_cache = {} if key_cache is None else key_cache
        self.all_rows = replay(spec) if rows is None else rows
        # keys of a trace Flax throws away (scan's constancy check) share no randomness with anything
        keep = [p for p, d in enumerate(self.all_rows) if not getattr(d, "discarded", False)]
        self.rows = self.all_rows if len(keep) == len(self.all_rows) else [self.all_rows[p] for p in keep]
        self.source = spec.file
        self.input_kind = "spec"
        self.separator = spec.fix_rng_separator
        self.prng_impl = spec.prng_impl
        n = len(self.rows)
        self.vectorised = vectorised(n)
        units: dict = {}
        path_ids: dict = {}
        if self.vectorised:
            import numpy as np

            self.keep: Any = np.asarray(keep, dtype=np.int64)  # a NumPy array, or a list
            self.unit = np.empty(n, dtype=np.int32)
            self.path_id = np.empty(n, dtype=np.int32)
            self.count = np.empty(n, dtype=np.int64)
            self.word = np.empty(n, dtype=np.uint32)
        else:
            self.keep = keep
            self.unit, self.path_id, self.count, self.word = [0] * n, [0] * n, [0] * n, [0] * n
        unit, path_id, count, word = self.unit, self.path_id, self.count, self.word
        for i, d in enumerate(self.rows):
            # `base` is a hashable key reference; `lane` the vmap/scan/while lane (() outside transforms)
            unit[i] = units.setdefault((d.base, getattr(d, "lane", ())), len(units))
            path_id[i] = path_ids.setdefault(d.path, len(path_ids))
            count[i] = d.count
            word[i] = d.hash_word
        self.paths = list(path_ids)
        self.keys = self._take(self._derive(self.spec, self.all_rows), self.keep) if keys else None
        self._flipped_keys: Any = None  # the keys with the separator flipped; False: they differ in number
        self._modules: dict[Location, list] | None = None

    def _derive(self, spec: Spec, rows):
        """Key data of `rows`: a (len(rows), width) uint32 array, or a list of tuples when not vectorised."""
        if not self.vectorised:
            from ..engine.keys import EXACT_IMPLS, derive_keys_exact

            if spec.prng_impl in EXACT_IMPLS:
                return derive_keys_exact(spec, rows, self.key_cache)
        from ..engine.keys import derive_keys

        keys = derive_keys(spec, rows)
        return keys if self.vectorised else [tuple(k) for k in keys.tolist()]

    def _take(self, keys, positions):
        """keys[positions], in the form of `keys`."""
        if self.vectorised:
            import numpy as np

            return keys[np.asarray(positions, dtype=np.int64)]
        return [keys[p] for p in positions]

    def items(self, i: int) -> tuple:
        return self.rows[i].hash_items

    def stream(self, i: int) -> str:
        return self.rows[i].stream

    def base_of(self, i: int):
        return self.rows[i].base

    def describe(self, indices, module_paths):
        out = {}
        for i in indices:
            d = self.rows[i]
            key = tuple(int(w) for w in self.keys[i]) if self.keys is not None else None
            out[i] = CallSite(
                d.index,
                d.path,
                d.stream_requested,
                d.stream,
                d.count,
                tuple(getattr(d, "lane", ())),
                str(d.base),
                d.kind,
                d.label,
                d.hash_items,
                d.hash_input,
                d.hash_word,
                key,
                d.location,
            )
        return out, {}  # every rename target of a spec carries its location

    def keys_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool) -> np.ndarray | list | None:
        if self.keys is None:
            return None
        rows = [self.rows[i] for i in indices]
        contained = all(_without_fork(d.base) for d in rows)
        if separator != self.separator and not contained:
            # a jit fork's key is a make_rng key itself, hashed with the flag: replay the model flipped
            if any(tuple(it) != d.hash_items for it, d in zip(items, rows)):
                return None
            flipped = self._flipped()
            return None if flipped is None else self._take(flipped, indices)
        changed = []
        for d, it in zip(rows, items):
            data = hash_input(it, separator)
            changed.append(dataclasses.replace(d, hash_items=tuple(it), hash_input=data, hash_word=hash_word(data)))
        if contained:
            return self._derive(self.spec, changed)
        # a fork key is the key of an earlier row: derive the whole model with these rows changed
        full = list(self.all_rows)
        for i, d in zip(indices, changed):
            full[self.keep[i]] = d
        return self._take(self._derive(self.spec, full), [self.keep[i] for i in indices])

    def _flipped(self) -> np.ndarray | list | None:
        if self._flipped_keys is None:
            from ..engine.replay import replay

            spec = dataclasses.replace(self.spec, fix_rng_separator=not self.spec.fix_rng_separator)
            rows = replay(spec)
            self._flipped_keys = (
                self._take(self._derive(spec, rows), self.keep) if len(rows) == len(self.all_rows) else False
            )
        return None if self._flipped_keys is False else self._flipped_keys

    @property
    def replayable(self) -> bool:
        return self.n <= REPLAY_LIMIT

    def renamed(self, changes):
        from ..errors import RngauditError

        names = {id(t.module): name for t, name in changes}
        spec = dataclasses.replace(self.spec, model=renamed_modules(self.spec.model, names))
        try:
            return self._sites_of(spec)
        except RngauditError:
            return None  # e.g. Flax's NameInUseError, or a `call:` of the old name

    def _sites_of(self, spec: Spec) -> SpecSites:
        """Call sites of a variant of this spec (a rename), on this input's path."""
        from ..engine.replay import replay

        return SpecSites(spec, keys=self.keys is not None, rows=replay(spec), key_cache=self.key_cache)

    def notes_of(self, i: int) -> tuple[str, ...]:
        return tuple(self.rows[i].notes)

    def rename_target(self, i: int) -> RenameTarget | None:
        d = self.rows[i]
        return self._target_at(d.path, d.location)

    def _target_at(self, path: tuple[str, ...], location: Location) -> RenameTarget | None:
        """The module at `path` whose statement at `location` makes the key, if `name:` renames it."""
        if not path:
            return None
        name = path[-1]
        for m, renamable, single, where in self._module_index().get(location, ()):
            if m.name == name or (m.name is None and re.fullmatch(re.escape(m.cls) + r"_\d+", name)):
                if not renamable:
                    return None
                # an explicit name does not move Flax's auto-name cursor: naming an auto-named module
                # renames its later auto-named siblings too
                return RenameTarget(path, m.cls, m.name is not None, where, m.name is not None and single, m)
        return None

    def _module_index(self) -> dict[Location, list]:
        """statement location -> the modules whose statements hold it: (module, whether `name:` renames
        it, whether it is one instance at one path, where its `name:` goes)."""
        if self._modules is None:
            index: dict[Location, list] = {}
            # the root's name is not hashed
            stack: list[tuple] = [(self.spec.model, self.spec.model.setup + self.spec.model.body, False, True, None)]
            while stack:
                m, items, renamable, single, where = stack.pop()
                for item in items:
                    if isinstance(item, (MakeRng, Param, Variable)):
                        index.setdefault(item.loc, []).append((m, renamable, single, where))
                    elif isinstance(item, Child):
                        # `name:` on a repeated statement names every instance alike; a layer names its children
                        c = item.module
                        stack.append(
                            (
                                c,
                                c.setup + c.body,
                                item.repeat == 1 and m.layer is None,
                                single and item.repeat == 1,
                                c.loc,
                            )
                        )
                    elif isinstance(item, Transform):
                        # a transformed module is named on the transform statement
                        c = item.target
                        stack.append((c, c.setup + c.body, item.repeat == 1, single and item.repeat == 1, item.loc))
                    elif isinstance(item, Define):
                        c = item.module
                        stack.append((c, c.setup + c.body, m.layer is None, single, item.loc if c.lifts else c.loc))
                    elif isinstance(item, Sequential):
                        # built in setup, its layers are named layers_0, layers_1, ... by Flax
                        stack.extend((c, c.setup + c.body, not item.in_setup, single, c.loc) for c in item.layers)
                    elif isinstance(item, Cond):
                        # every branch runs in this module; a child of a branch may share its path with
                        # one of another branch
                        stack.extend((m, branch, renamable, False, where) for branch in item.branches)
                    elif isinstance(item, WhileLoop):
                        stack.append((m, item.cond_items + item.body_items, renamable, single, where))
            self._modules = index
        return self._modules


class _Rows(Sequence):
    """A KeyTable's rows as Derivations, made when read (a million rows stay columns)."""

    def __init__(self, table, positions):
        self.table = table
        self.positions = positions  # None: every row

    def __len__(self) -> int:
        return self.table.n if self.positions is None else len(self.positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.table.derivation(int(i if self.positions is None else self.positions[i]))


class TableSites(SpecSites):
    """A large replayed spec on derive's fast path (rngaudit.fast): the same columns SpecSites makes
    from one Derivation per call, computed with NumPy per lane entry (one template in one lane) and
    spread over the rows.

    Keys of threefry2x32 and rbg are not computed row by row: fold_in(k, .) is a bijection of the
    32-bit word for each key k (one Threefry block cipher, per half for rbg), so two rows of one base
    key share a key exactly when they share a hash word. A site's ident is (id of its base key's
    value, word); the key itself is computed for reported sites only. (Keys of different base key
    values meet only by a Threefry coincidence, about n*n/2**65 for n rows, which is not searched
    for.) unsafe_rbg keys are computed for every row."""

    BIJECTIVE = ("threefry2x32", "rbg")

    def __init__(self, spec: Spec, keys: bool = True, blocks=None, registry: dict | None = None):
        import numpy as np

        from ..engine.keys import engine_for
        from ..engine.table import key_table

        self.spec = spec
        self.rules = spec.rules.name
        self.key_cache = {}
        t = self.table = key_table(spec, blocks)
        self.source = spec.file
        self.input_kind = "spec"
        self.separator = spec.fix_rng_separator
        self.prng_impl = spec.prng_impl
        self.vectorised = True
        nt = len(t.templates)
        n_ent = int(t.lane_base_off[-1])
        ent_t = np.repeat(np.arange(nt, dtype=np.int64), t.n_lanes)
        ent_first = t.start[ent_t] + (np.arange(n_ent, dtype=np.int64) - t.lane_base_off[ent_t])  # its first row
        live = (t.start[1:] - t.start[:-1])[ent_t] > 0
        ent_base = t.lane_base
        kept = live & ~t.lane_disc & (ent_base >= 0)
        if (live & ~kept).any():
            keep = np.flatnonzero(~t.discarded)

            def pick(col):
                return col[keep]
        else:  # (every row kept: the columns as they are)
            keep = np.arange(t.n, dtype=np.int64)

            def pick(col):
                return col

        self.keep = keep
        self.all_rows = _Rows(t, None)
        self.rows = _Rows(t, keep)
        kept_e = np.flatnonzero(kept)
        # path ids in order of first appearance (rows come template by template)
        path_ids: dict = {}
        of_template = np.zeros(nt, dtype=np.int32)
        for tt in np.unique(ent_t[kept_e]).tolist():
            of_template[tt] = path_ids.setdefault(t.templates[tt].path, len(path_ids))
        self.paths = list(path_ids)
        # units: (base, lane) numbered in order of first appearance, as SpecSites numbers them
        lane = t.lane_entry_ids()
        combo = ent_base[kept_e] * (int(lane.max()) + 1 if len(lane) else 1) + lane[kept_e]
        firsts = ent_first[kept_e]
        uniq, inv = np.unique(combo, return_inverse=True)
        inv = inv.ravel()
        first_of = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first_of, inv, firsts)
        rank = np.empty(len(uniq), dtype=np.int32)
        rank[np.argsort(first_of, kind="stable")] = np.arange(len(uniq), dtype=np.int32)
        unit_e = np.full(n_ent, -1, dtype=np.int32)
        unit_e[kept_e] = rank[inv]
        self.unit = pick(unit_e[t.rows_lane])
        self.path_id = pick(of_template[t.block])
        self.count = pick(t.count)
        self.word = pick(t.word)
        self._base = pick(t.base)
        self._used_bases = np.unique(ent_base[kept_e])
        # the distinct (unit, path): a lane entry's highest count is its last row's
        ecombo = (unit_e[kept_e].astype(np.int64) << 32) | of_template[ent_t[kept_e]].astype(np.int64)
        site_first = np.searchsorted(keep, firsts) if len(keep) != t.n else firsts
        uniq, inv = np.unique(ecombo, return_inverse=True)
        inv = inv.ravel()
        e_first = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(e_first, inv, site_first)
        e_top = np.zeros(len(uniq), dtype=np.int64)
        np.maximum.at(e_top, inv, t.count[t.start[ent_t[kept_e] + 1] - 1])
        self._entry_cols = (uniq, e_first, e_top)
        self._checked = keys
        self._engine = engine_for(spec)
        self._registry = {} if registry is None else registry  # base key value -> id, shared with renamed copies
        self._resolver: BaseKeys | None = None
        self._flip = None
        self._prefixes: dict[tuple[tuple, bool], bytes] = {}
        # unsafe_rbg: keys row by row
        self.keys = t.keys(self._engine, keep) if keys and spec.prng_impl not in self.BIJECTIVE else None
        self._flipped_keys = None
        self._modules = None

    @property
    def keys_checked(self) -> bool:
        return self._checked

    def entry_columns(self):
        return self._entry_cols

    def items(self, i: int) -> tuple:
        j = int(self.keep[i])
        return self.table.templates[int(self.table.block[j])].suffix + (int(self.table.count[j]),)

    def _block(self, i: int) -> int:
        """The template of site i."""
        return int(self.table.block[int(self.keep[i])])

    def _prefix(self, template: int, separator: bool) -> bytes:
        """The hashed bytes of a template's path (what comes before the count), made once."""
        key = (self.table.templates[template].suffix, separator)  # (templates of one path share it)
        pre = self._prefixes.get(key)
        if pre is None:
            pre = self._prefixes[key] = hash_input(key[0], separator)
        return pre

    def path_bytes(self, i: int, separator: bool | None = None) -> bytes:
        return self._prefix(self._block(i), self.separator if separator is None else separator)

    def paths_bytes(self, indices: Sequence[int]) -> list[bytes]:
        import numpy as np

        blocks = self.table.block[self.keep[np.asarray(indices, dtype=np.int64)]].tolist() if len(indices) else []
        return [self._prefix(b, self.separator) for b in blocks]

    # ------------------------------------------------------------ idents from base keys and words
    def _bases(self, table, words: dict | None = None):
        """Base key values of `table` (this table's memoised; `words`: rows hashed differently)."""
        if table is self.table and not words:
            if self._resolver is None:
                self._resolver = table.base_keys(self._engine)
            return self._resolver
        return table.base_keys(self._engine, words)

    def _base_id(self, value) -> int:
        return self._registry.setdefault(value, len(self._registry))

    def idents(self):
        if self.keys is not None or not self._checked:
            return super().idents()
        import numpy as np

        res = self._bases(self.table)
        ids = np.zeros(len(self.table.bases), dtype=np.uint64)
        for b in self._used_bases.tolist():
            ids[b] = self._base_id(res.key(self.table.bases[b]))
        return (ids[self._base] << np.uint64(32)) | self.word.astype(np.uint64)

    def idents_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool):
        if self.keys is not None or not self._checked:
            return super().idents_for(indices, items, separator)
        import numpy as np

        t = self.table
        rows = [int(self.keep[i]) for i in indices]
        words = words_of(items, separator)
        override = None
        if separator != self.separator:
            if not all(_without_fork(t.bases[int(t.base[j])]) for j in rows):
                # a jit fork's key is a make_rng key itself, hashed with the flag: the model replayed flipped
                if any(tuple(it) != self.items(i) for it, i in zip(items, indices)):
                    return None
                t = self._flipped_table()
                if t is None:
                    return None
                words = [int(t.word[j]) for j in rows]
        else:
            # a jit fork's key is the key of an earlier row: a changed row changes the keys derived from it
            override = dict(zip(rows, words))
            if len(override) != len(rows):
                return None
        res = self._bases(t, override)
        out = np.empty(len(rows), dtype=np.uint64)
        for k, (j, w) in enumerate(zip(rows, words)):
            out[k] = (self._base_id(res.key(t.bases[int(t.base[j])])) << 32) | w
        return out

    def _flipped_table(self):
        """The key table of the model with fix_rng_separator flipped (None if it has other rows)."""
        if self._flip is None:
            from ..engine.table import key_table

            t = key_table(dataclasses.replace(self.spec, fix_rng_separator=not self.spec.fix_rng_separator))
            self._flip = t if t.n == self.table.n else False
        return None if self._flip is False else self._flip

    def _flipped(self):
        """SpecSites._flipped (unsafe_rbg: keys row by row): the flipped model's keys of the kept rows."""
        if self._flipped_keys is None:
            t = self._flipped_table()
            self._flipped_keys = False if t is None else t.keys(self._engine, self.keep)
        return None if self._flipped_keys is False else self._flipped_keys

    def _keys_at(self, indices: list[int], rows) -> list | None:
        """Key data of sites `indices` (table rows `rows`), as tuples."""
        if not self._checked:
            return None
        if self.keys is not None:
            return [tuple(k) for k in self.keys[indices].tolist()]
        import numpy as np

        t = self.table
        res = self._bases(t)
        used, inverse = np.unique(t.base[rows], return_inverse=True)
        base_keys = np.array([res.key(t.bases[b]) for b in used.tolist()], dtype=np.uint32).reshape(len(used), -1)
        return [tuple(k) for k in self._engine.fold_in_rows(base_keys[inverse.ravel()], t.word[rows]).tolist()]

    # ------------------------------------------------------------ reported sites
    def describe(self, indices, module_paths):
        """SpecSites.describe from the columns: what a template fixes is worked out once."""
        import numpy as np

        t = self.table
        indices = [int(i) for i in indices]
        if not indices:
            return {}, {}
        rows = self.keep[np.asarray(indices, dtype=np.int64)]
        keys = self._keys_at(indices, rows) or [None] * len(indices)
        per_template: dict = {}
        bases: dict = {}
        out = {}
        head = b"\x00" if self.separator else b""  # (count_bytes, inline)
        for i, j, b, c, base, w, key in zip(
            indices,
            rows.tolist(),
            t.block[rows].tolist(),
            t.count[rows].tolist(),
            t.base[rows].tolist(),
            t.word[rows].tolist(),
            keys,
        ):
            const = per_template.get(b)
            if const is None:
                tpl = t.templates[b]
                const = per_template[b] = (
                    tpl.path,
                    tpl.stream_requested,
                    tpl.stream,
                    tpl.kind,
                    tpl.label,
                    tpl.suffix,
                    self._prefix(b, self.separator),
                    tpl.location,
                    bool(tpl.axes),
                )
            path, req, used, kind, label, suffix, pre, loc, lanes = const
            text = bases.get(base)
            if text is None:
                text = bases[base] = str(t.bases[base])
            out[i] = frozen_record(
                CallSite,
                j,
                path,
                req,
                used,
                c,
                t.lane_of(j) if lanes else (),
                text,
                kind,
                label,
                suffix + (c,),
                pre + head + c.to_bytes((c.bit_length() + 7) // 8, "big"),
                w,
                key,
                loc,
            )
        return out, {}

    def notes_of(self, i: int) -> tuple[str, ...]:
        return tuple(self.table.templates[self._block(i)].notes)

    def rename_target(self, i: int) -> RenameTarget | None:
        tpl = self.table.templates[self._block(i)]
        return self._target_at(tpl.path, tpl.location)

    def stream(self, i: int) -> str:
        return self.table.templates[self._block(i)].stream

    def base_of(self, i: int):
        return self.table.bases[int(self.table.base[int(self.keep[i])])]

    def keys_for(self, indices: Sequence[int], items: Sequence[tuple], separator: bool):
        """SpecSites.keys_for without a Derivation per row (unsafe_rbg, whose keys are computed per
        row): under the same separator, the changed rows' keys come from their new words and the
        table's base keys (a changed jit fork's row changes the keys derived from it)."""
        if self.keys is None or separator != self.separator:
            return super().keys_for(indices, items, separator)
        rows = [int(self.keep[i]) for i in indices]
        if len(set(rows)) != len(rows):
            return super().keys_for(indices, items, separator)
        return self.table.keys_with_words(self._engine, dict(zip(rows, words_of(items, separator))))

    def _sites_of(self, spec: Spec) -> TableSites:
        return TableSites(spec, keys=self._checked, registry=self._registry)


@paused
def spec_sites(spec: Spec, keys: bool = True) -> SpecSites:
    """A spec's call sites: small ones on the plain replay (Python lists, keys on Python ints, no
    NumPy), large ones on derive's fast path (TableSites). Both give the same report."""
    from ..engine.replay import Replayer

    blocks = Replayer(spec, blocks=True).walk()
    if vectorised(blocks.rows):
        return TableSites(spec, keys, blocks)
    return SpecSites(spec, keys)


def _without_fork(ref) -> bool:
    """Whether a key reference derives from the root keys alone (no jit fork, which is a make_rng key, and no path
    folded in by an nn.jit before flax 0.10.2, whose word is hashed with the separator flag)."""
    from ..engine.refs import ForkKey, PathFoldKey

    while ref is not None:
        if isinstance(ref, (ForkKey, PathFoldKey)):
            return False
        if not hasattr(ref, "parent"):
            return True
        ref = ref.parent
    return False
