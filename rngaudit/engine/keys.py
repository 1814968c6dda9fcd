"""The one key engine: JAX's seeding, fold_in and split of raw key data, key expressions, and the key data
of base-key references, exact on Python ints (one key), vectorised in NumPy (many keys) or through JAX
(unsafe_rbg, whose bits come from XLA's RngBitGenerator).

NumPy and JAX are imported only by the functions that need them: a few keys of threefry2x32 or rbg start
faster on Python ints than NumPy imports."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..spec.keyexpr import FoldIn, KeyExpr, Raw, Seed, Split
from . import threefry
from .refs import FoldKey, ForkKey, PathFoldKey, RootKey, SplitKey

if TYPE_CHECKING:
    import numpy as np

    from ..spec.tree import Spec
    from .records import Derivation

KeyData = tuple[int, ...]
EXACT_IMPLS = ("threefry2x32", "rbg")  # computed here; unsafe_rbg keys need JAX
K = TypeVar("K")


class KeyOps(Protocol[K]):
    """What evaluating a key expression needs: key data here, or typed JAX keys on the devices."""

    def seed(self, seed: int) -> K: ...

    def raw(self, words: tuple[int, ...]) -> K: ...

    def split(self, key: K, n: int, index: int) -> K: ...

    def fold_in(self, key: K, data: int) -> K: ...


def evaluate(expr: KeyExpr, ops: KeyOps[K]) -> K:
    """The key a key expression (`key(0)`, `split(k, n)[i]`, `fold_in(k, d)`, raw data) denotes."""
    if isinstance(expr, Seed):
        return ops.seed(expr.seed)
    if isinstance(expr, Raw):
        return ops.raw(expr.words)
    if isinstance(expr, Split):
        return ops.split(evaluate(expr.parent, ops), expr.n, expr.index)
    if isinstance(expr, FoldIn):
        return ops.fold_in(evaluate(expr.parent, ops), expr.data)
    raise TypeError(expr)


class KeyEngine:
    """The key math of one PRNG impl and threefry_partitionable setting, on raw key data."""

    def __init__(self, impl: str, partitionable: bool):
        self.impl = impl
        self.partitionable = partitionable
        self.width = 2 if impl == "threefry2x32" else 4
        self.exact = impl in EXACT_IMPLS

    # ---------------------------------------------------------------- one key
    def seed(self, seed: int) -> KeyData:
        half = threefry.seed_data(seed)
        # mirrors jax/_src/random/rbg.py _rbg_seed: the threefry seed twice
        return half if self.width == 2 else half + half

    def raw(self, words: tuple[int, ...]) -> KeyData:
        return words

    def fold_in(self, key: KeyData, data: int) -> KeyData:
        if self.impl == "threefry2x32":
            return threefry.fold_in_int(key, data)
        if self.impl == "rbg":
            # mirrors jax/_src/random/rbg.py _rbg_fold_in: threefry fold_in on each 2-word half
            return threefry.fold_in_int(key[:2], data) + threefry.fold_in_int(key[2:], data)
        return tuple(int(w) for w in self.fold_in_many(key, [data])[0])

    def split(self, key: KeyData, n: int, index: int) -> KeyData:
        """Row `index` of jax.random.split(key, n)."""
        if self.impl == "threefry2x32":
            return threefry.split_one(key, n, index, self.partitionable)
        if self.impl == "rbg":
            # mirrors jax/_src/random/rbg.py _rbg_split: threefry split of each half, rows concatenated
            return threefry.split_one(key[:2], n, index, self.partitionable) + threefry.split_one(
                key[2:], n, index, self.partitionable
            )
        jax, jnp = _jax()
        with jax.threefry_partitionable(self.partitionable):
            k = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=self.impl)
            return tuple(int(w) for w in _numpy().asarray(jax.random.key_data(jax.random.split(k, n)[index])))

    def eval(self, expr: KeyExpr) -> KeyData:
        return evaluate(expr, self)

    # ---------------------------------------------------------------- many keys (NumPy arrays)
    def fold_in_many(self, key: KeyData, words) -> np.ndarray:
        """fold_in(key, w) for every uint32 w: shape (len(words), width)."""
        np = _numpy()
        words = np.asarray(words, dtype=np.uint32)
        if self.impl == "threefry2x32":
            return threefry.fold_in(key, words)
        if self.impl == "rbg":
            return np.concatenate([threefry.fold_in(key[:2], words), threefry.fold_in(key[2:], words)], axis=-1)
        jax, jnp = _jax()
        k = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=self.impl)
        # lax.map, not vmap: jax/_src/lax/control_flow/loops.py _rng_bit_generator_batching_rule
        # seeds a vmapped rng_bit_generator from keys[0] only, so a vmapped unsafe_rbg fold_in
        # (jax/_src/random/rbg.py _unsafe_rbg_fold_in) is not Flax's one-word-at-a-time fold_in.
        out = jax.jit(lambda ws: jax.lax.map(lambda w: jax.random.key_data(jax.random.fold_in(k, w)), ws))(
            jnp.asarray(words)
        )
        return np.asarray(out, dtype=np.uint32).reshape(len(words), self.width)

    def fold_in_rows(self, keys: np.ndarray, words) -> np.ndarray:
        """fold_in(keys[i], words[i]) for every row: keys (n, width), words (n,) -> (n, width)."""
        np = _numpy()
        words = np.asarray(words, dtype=np.uint32)
        if self.impl == "threefry2x32":
            return _threefry_fold_in_rows(keys, words)
        if self.impl == "rbg":
            # mirrors jax/_src/random/rbg.py _rbg_fold_in: threefry fold_in on each 2-word half
            return np.concatenate(
                [_threefry_fold_in_rows(keys[:, :2], words), _threefry_fold_in_rows(keys[:, 2:], words)], axis=1
            )
        out = np.zeros((len(words), self.width), dtype=np.uint32)
        if len(words):
            distinct, which = np.unique(keys, axis=0, return_inverse=True)
            which = which.ravel()
            for b, key in enumerate(distinct.tolist()):
                idx = np.flatnonzero(which == b)
                out[idx] = self.fold_in_many(tuple(key), words[idx])
        return out

    def split_all(self, key: KeyData, n: int) -> np.ndarray:
        """Every row of jax.random.split(key, n), shape (n, width)."""
        np = _numpy()
        if self.impl == "threefry2x32":
            return _threefry_split_rows(key, n, self.partitionable)
        if self.impl == "rbg":
            return np.concatenate(
                [
                    _threefry_split_rows(key[:2], n, self.partitionable),
                    _threefry_split_rows(key[2:], n, self.partitionable),
                ],
                axis=1,
            )
        return np.array([self.split(key, n, i) for i in range(n)], dtype=np.uint32).reshape(n, self.width)


def engine_for(spec: Spec) -> KeyEngine:
    return KeyEngine(spec.prng_impl, spec.threefry_partitionable)


def root_keys(spec: Spec, engine: KeyEngine | None = None) -> dict[str, KeyData]:
    """The key data of every stream of the spec's `rngs`."""
    engine = engine or engine_for(spec)
    return {stream: engine.eval(src.expr) for stream, src in spec.rngs.items()}


class BaseKeys:
    """The key data of base-key references (RootKey, SplitKey, FoldKey, ForkKey), memoised. `fork(i)` is the
    key of call #i (a jit fork's key); with `split_rows`, a lane split computes all its rows at once in NumPy
    and keeps them (a vmap of a thousand lanes is one split, not a thousand)."""

    def __init__(
        self, engine: KeyEngine, roots: dict[str, KeyData], fork: Callable[[int], KeyData], split_rows: bool = False
    ):
        self.engine = engine
        self.roots = roots
        self.fork = fork
        self.split_rows = split_rows
        self.memo: dict[Any, KeyData] = {}
        self.splits: dict[tuple[KeyData, int], Any] = {}

    def key(self, ref) -> KeyData:
        hit = self.memo.get(ref)
        if hit is not None:
            return hit
        e = self.engine
        if type(ref) is RootKey:
            hit = self.roots[ref.stream]
        elif type(ref) is SplitKey:
            parent = self.key(ref.parent)
            if self.split_rows:
                rows = self.splits.get((parent, ref.n))
                if rows is None:
                    rows = self.splits[(parent, ref.n)] = e.split_all(parent, ref.n)
                hit = tuple(int(w) for w in rows[ref.index])
            else:
                hit = e.split(parent, ref.n, ref.index)
        elif type(ref) is FoldKey or type(ref) is PathFoldKey:
            hit = e.fold_in(self.key(ref.parent), ref.data)
        elif type(ref) is ForkKey:
            hit = self.fork(ref.index)
        else:
            raise TypeError(ref)
        self.memo[ref] = hit
        return hit


def derive_keys(spec: Spec, rows: Sequence[Derivation], engine: KeyEngine | None = None) -> np.ndarray:
    """Key data for every derivation, shape (len(rows), width), vectorised per base key. Rows whose base is
    None (a per-step key of a trace Flax discards) get zeros."""
    np = _numpy()
    engine = engine or engine_for(spec)
    out = np.zeros((len(rows), engine.width), dtype=np.uint32)
    groups: dict = defaultdict(list)
    for i, d in enumerate(rows):
        if d.base is not None:
            groups[d.base].append(i)
    # the fork row comes before every row that uses it, so its group is already done
    bases = BaseKeys(engine, root_keys(spec, engine), lambda i: tuple(int(w) for w in out[i]))
    # groups are in order of first use, and a fork row precedes the rows derived from it
    for base, idx in groups.items():
        words = np.fromiter((rows[i].hash_word for i in idx), dtype=np.uint32, count=len(idx))
        out[np.asarray(idx)] = engine.fold_in_many(bases.key(base), words)
    return out


def derive_keys_exact(spec: Spec, rows: Sequence[Derivation], cache: dict | None = None) -> list[KeyData]:
    """derive_keys on Python ints, as a list of tuples (threefry2x32 and rbg, no NumPy). `cache` keeps
    (base key, hash word) -> key across calls for one impl: a renamed copy of a model changes few keys, so
    checking a rename then costs lookups, not Threefry."""
    engine = engine_for(spec)
    if not engine.exact:
        raise ValueError(f"{spec.prng_impl} keys need JAX: use derive_keys")
    out: list[KeyData] = []
    bases = BaseKeys(engine, root_keys(spec, engine), out.__getitem__)  # the fork row comes first
    folds = {} if cache is None else cache
    zeros = (0,) * engine.width
    for d in rows:
        if d.base is None:
            out.append(zeros)
            continue
        base = bases.key(d.base)
        key = folds.get((base, d.hash_word))
        if key is None:
            key = folds[(base, d.hash_word)] = engine.fold_in(base, d.hash_word)
        out.append(key)
    return out


class JaxKeys:
    """Typed JAX keys of one impl (None: JAX's default), for evaluating key expressions under jax.jit."""

    def __init__(self, impl: str | None):
        self.impl = impl

    def seed(self, seed: int):
        jax, _ = _jax()
        return jax.random.key(seed, impl=self.impl)

    def raw(self, words: tuple[int, ...]):
        jax, jnp = _jax()
        return jax.random.wrap_key_data(jnp.asarray(words, jnp.uint32), impl=self.impl)

    def split(self, key, n: int, index: int):
        jax, _ = _jax()
        return jax.random.split(key, n)[index]

    def fold_in(self, key, data: int):
        jax, _ = _jax()
        return jax.random.fold_in(key, _numpy().uint32(data))


def jax_setting(name: str) -> Any:
    """The JAX config value `name` (jax.config holds them as attributes its type does not declare)."""
    jax, _ = _jax()
    return getattr(jax.config, name)


def _numpy():
    import numpy as np

    return np


def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


def _threefry_fold_in_rows(keys: np.ndarray, words: np.ndarray) -> np.ndarray:
    """threefry fold_in with a key per row: keys (n, 2), words (n,) -> (n, 2)."""
    np = _numpy()
    # mirrors jax/_src/random/threefry2x32.py threefry_fold_in: threefry_2x32(key, threefry_seed(data))
    y0, y1 = threefry.threefry2x32(keys[:, 0], keys[:, 1], np.zeros_like(words), words)
    return np.stack([y0, y1], axis=-1)


def _threefry_split_rows(key: KeyData, n: int, partitionable: bool) -> np.ndarray:
    """jax.random.split(key, n) for threefry2x32 key data, shape (n, 2)."""
    np = _numpy()
    if partitionable:
        # mirrors _threefry_split_foldlike: the counts are (hi, lo) of the row index
        i = np.arange(n, dtype=np.uint64)
        y0, y1 = threefry.threefry2x32(
            key[0], key[1], (i >> np.uint64(32)).astype(np.uint32), (i & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        )
        return np.stack([y0, y1], axis=-1)
    # mirrors _threefry_split_original: threefry_2x32(key, iota(2n)).reshape(n, 2)
    y0, y1 = threefry.threefry2x32(key[0], key[1], np.arange(n, dtype=np.uint32), np.arange(n, 2 * n, dtype=np.uint32))
    return np.concatenate([y0, y1]).reshape(n, 2)
