"""Derivations -> key data on Python ints (exact Threefry, no NumPy or JAX): quicker than importing NumPy for a few keys."""
from __future__ import annotations

from typing import Sequence

from ..spec.keyexpr import FoldIn, KeyExpr, Raw, Seed, Split
from ..spec.tree import Spec
from . import threefry
from .records import Derivation
from .refs import FoldKey, ForkKey, RootKey, SplitKey

KeyData = tuple[int, ...]
IMPLS = ("threefry2x32", "rbg")  # unsafe_rbg keys need JAX: rngaudit.keys


def _fold_in(impl: str, key: KeyData, word: int) -> KeyData:
    if impl == "threefry2x32":
        return threefry.fold_in_int(key, word)
    # mirrors jax/_src/random/rbg.py _rbg_fold_in: threefry fold_in on each 2-word half
    return threefry.fold_in_int(key[:2], word) + threefry.fold_in_int(key[2:], word)


def _split(impl: str, key: KeyData, n: int, i: int, partitionable: bool) -> KeyData:
    if impl == "threefry2x32":
        return threefry.split_one(key, n, i, partitionable)
    # mirrors jax/_src/random/rbg.py _rbg_split: threefry split of each half, rows concatenated
    return threefry.split_one(key[:2], n, i, partitionable) + threefry.split_one(key[2:], n, i, partitionable)


def _eval(spec: Spec, expr: KeyExpr) -> KeyData:
    """What rngaudit.keys.KeyEngine.eval computes, on ints."""
    if isinstance(expr, Seed):
        half = threefry.seed_data(expr.seed)
        # mirrors jax/_src/random/rbg.py _rbg_seed: the threefry seed twice
        return half if spec.prng_impl == "threefry2x32" else half + half
    if isinstance(expr, Raw):
        return expr.words
    if isinstance(expr, Split):
        return _split(spec.prng_impl, _eval(spec, expr.parent), expr.n, expr.index, spec.threefry_partitionable)
    if isinstance(expr, FoldIn):
        return _fold_in(spec.prng_impl, _eval(spec, expr.parent), expr.data)
    raise TypeError(expr)


def derive_keys_int(spec: Spec, rows: Sequence[Derivation], cache: dict | None = None) -> list[KeyData]:
    """rngaudit.keys.derive_keys as a list of tuples (threefry2x32 and rbg only): the key data of every
    derivation; rows whose base is None (a per-step key of a trace Flax discards) get zeros. `cache`
    keeps (base key, hash word) -> key across calls for one impl: a renamed copy of a model changes
    few keys, so checking a rename then costs lookups, not Threefry."""
    if spec.prng_impl not in IMPLS:
        raise ValueError(f"{spec.prng_impl} keys need JAX: use rngaudit.keys.derive_keys")
    impl, partitionable = spec.prng_impl, spec.threefry_partitionable
    width = 2 if impl == "threefry2x32" else 4
    roots: dict[str, KeyData] = {}
    bases: dict = {}
    out: list[KeyData] = []

    def base_key(ref) -> KeyData:
        hit = bases.get(ref)
        if hit is None:
            if isinstance(ref, RootKey):
                hit = roots.get(ref.stream)
                if hit is None:
                    hit = roots[ref.stream] = _eval(spec, spec.rngs[ref.stream].expr)
            elif isinstance(ref, SplitKey):
                hit = _split(impl, base_key(ref.parent), ref.n, ref.index, partitionable)
            elif isinstance(ref, FoldKey):
                hit = _fold_in(impl, base_key(ref.parent), ref.data)
            elif isinstance(ref, ForkKey):
                # the fork row comes before every row that uses it
                hit = out[ref.index]
            else:
                raise TypeError(ref)
            bases[ref] = hit
        return hit

    folds = {} if cache is None else cache
    zeros = (0,) * width
    for d in rows:
        if d.base is None:
            out.append(zeros)
            continue
        base = base_key(d.base)
        key = folds.get((base, d.hash_word))
        if key is None:
            key = folds[(base, d.hash_word)] = _fold_in(impl, base, d.hash_word)
        out.append(key)
    return out
