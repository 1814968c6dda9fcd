"""Derivations -> key data (exact NumPy Threefry for threefry2x32 and rbg; JAX for unsafe_rbg) and drawn values."""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

from ..spec.keyexpr import FoldIn, KeyExpr, Raw, Seed, Split
from ..spec.tree import Draw, Spec
from . import threefry
from .records import Derivation
from .refs import FoldKey, ForkKey, RootKey, SplitKey

KeyData = tuple[int, ...]


class KeyEngine:
    """The PRNG primitives of one JAX impl: seeding, fold_in and split on raw key data."""

    def __init__(self, impl: str, partitionable: bool):
        self.impl = impl
        self.partitionable = partitionable
        self.width = 2 if impl == "threefry2x32" else 4

    # ---------------------------------------------------------------- primitives
    def seed(self, s: int) -> KeyData:
        half = threefry.seed_data(s)
        # mirrors jax/_src/random/rbg.py _rbg_seed: the threefry seed twice
        return half if self.width == 2 else half + half

    def fold_in_many(self, key: KeyData, words: np.ndarray) -> np.ndarray:
        """fold_in(key, w) for every uint32 w: shape (len(words), width)."""
        words = np.asarray(words, dtype=np.uint32)
        if self.impl == "threefry2x32":
            return threefry.fold_in(key, words)
        if self.impl == "rbg":
            # mirrors jax/_src/random/rbg.py _rbg_fold_in: threefry fold_in on each 2-word half
            return np.concatenate([threefry.fold_in(key[:2], words), threefry.fold_in(key[2:], words)], axis=-1)
        return self._jax_fold_in_many(key, words)

    def split(self, key: KeyData, n: int, i: int) -> KeyData:
        if self.impl == "threefry2x32":
            return threefry.split_one(key, n, i, self.partitionable)
        if self.impl == "rbg":
            # mirrors jax/_src/random/rbg.py _rbg_split: threefry split of each half, rows concatenated
            return (threefry.split_one(key[:2], n, i, self.partitionable)
                    + threefry.split_one(key[2:], n, i, self.partitionable))
        jax, jnp = _jax()
        with jax.threefry_partitionable(self.partitionable):
            k = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=self.impl)
            return tuple(int(w) for w in np.asarray(jax.random.key_data(jax.random.split(k, n)[i])))

    def _jax_fold_in_many(self, key: KeyData, words: np.ndarray) -> np.ndarray:
        jax, jnp = _jax()
        k = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=self.impl)
        # lax.map, not vmap: jax/_src/lax/control_flow/loops.py _rng_bit_generator_batching_rule
        # seeds a vmapped rng_bit_generator from keys[0] only, so a vmapped unsafe_rbg fold_in
        # (jax/_src/random/rbg.py _unsafe_rbg_fold_in) is not Flax's one-word-at-a-time fold_in.
        out = jax.jit(lambda ws: jax.lax.map(lambda w: jax.random.key_data(jax.random.fold_in(k, w)), ws))(
            jnp.asarray(words))
        return np.asarray(out, dtype=np.uint32).reshape(len(words), self.width)

    # ---------------------------------------------------------------- expressions
    def eval(self, expr: KeyExpr) -> KeyData:
        if isinstance(expr, Seed):
            return self.seed(expr.seed)
        if isinstance(expr, Raw):
            return expr.words
        if isinstance(expr, Split):
            return self.split(self.eval(expr.parent), expr.n, expr.index)
        if isinstance(expr, FoldIn):
            return tuple(int(w) for w in self.fold_in_many(self.eval(expr.parent), np.array([expr.data]))[0])
        raise TypeError(expr)


def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


def engine_for(spec: Spec) -> KeyEngine:
    return KeyEngine(spec.prng_impl, spec.threefry_partitionable)


def root_keys(spec: Spec, engine: KeyEngine | None = None) -> dict[str, KeyData]:
    engine = engine or engine_for(spec)
    return {stream: engine.eval(src.expr) for stream, src in spec.rngs.items()}


def derive_keys(spec: Spec, rows: Sequence[Derivation], engine: KeyEngine | None = None) -> np.ndarray:
    """Key data for every derivation, shape (len(rows), width), vectorised per base key.
    Rows whose base is None (a per-step key of a trace Flax discards) get zeros."""
    engine = engine or engine_for(spec)
    roots = root_keys(spec, engine)
    out = np.zeros((len(rows), engine.width), dtype=np.uint32)
    groups: dict = defaultdict(list)
    for i, d in enumerate(rows):
        if d.base is not None:
            groups[d.base].append(i)
    bases: dict = {}

    def base_key(ref) -> KeyData:
        hit = bases.get(ref)
        if hit is None:
            if isinstance(ref, RootKey):
                hit = roots[ref.stream]
            elif isinstance(ref, SplitKey):
                hit = engine.split(base_key(ref.parent), ref.n, ref.index)
            elif isinstance(ref, FoldKey):
                hit = tuple(int(w) for w in engine.fold_in_many(base_key(ref.parent), np.array([ref.data]))[0])
            elif isinstance(ref, ForkKey):
                # the fork row comes before every row that uses it, so its group is already done
                hit = tuple(int(w) for w in out[ref.index])
            else:
                raise TypeError(ref)
            bases[ref] = hit
        return hit

    # groups are in order of first use, and a fork row precedes the rows derived from it
    for base, idx in groups.items():
        words = np.fromiter((rows[i].hash_word for i in idx), dtype=np.uint32, count=len(idx))
        out[np.asarray(idx)] = engine.fold_in_many(base_key(base), words)
    return out


def draw_values(spec: Spec, key: KeyData, draw: Draw) -> np.ndarray:
    """The values jax.random (or jax.nn.initializers) draws from `key` for `draw`."""
    jax, jnp = _jax()
    params = dict(draw.params)
    dtype = jnp.dtype(draw.dtype)
    with jax.threefry_partitionable(spec.threefry_partitionable):
        k = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=spec.prng_impl)
        shape = draw.shape
        kind = draw.kind
        if kind == "normal":
            v = jax.random.normal(k, shape, dtype)
        elif kind == "uniform":
            v = jax.random.uniform(k, shape, dtype, params["minval"], params["maxval"])
        elif kind == "bernoulli":
            v = jax.random.bernoulli(k, params["p"], shape)
        elif kind == "randint":
            v = jax.random.randint(k, shape, params["minval"], params["maxval"], dtype)
        elif kind == "truncated_normal":
            v = jax.random.truncated_normal(k, params["lower"], params["upper"], shape, dtype)
        elif kind == "variance_scaling":
            v = jax.nn.initializers.variance_scaling(
                params["scale"], params["mode"], params["distribution"],
                in_axis=params["in_axis"], out_axis=params["out_axis"])(k, shape, dtype)
        else:
            init = getattr(jax.nn.initializers, kind)
            v = init(in_axis=params["in_axis"], out_axis=params["out_axis"])(k, shape, dtype)
        return np.asarray(v)
