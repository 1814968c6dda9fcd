"""Exact Threefry-2x32 in NumPy: JAX's fold_in, split and seeding, vectorised, no JAX."""
from __future__ import annotations

import numpy as np

# mirrors jax/_src/random/threefry2x32.py _threefry2x32_lowering (Salmon et al., Threefry-2x32, 20 rounds)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)
U32 = np.uint32


def _rotl(v: np.ndarray, r: int) -> np.ndarray:
    return (v << U32(r)) | (v >> U32(32 - r))


def threefry2x32(k0, k1, x0, x1) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 block cipher on uint32 arrays (broadcasting)."""
    k0 = np.asarray(k0, dtype=U32)
    k1 = np.asarray(k1, dtype=U32)
    x0 = np.array(x0, dtype=U32, copy=True)
    x1 = np.array(x1, dtype=U32, copy=True)
    x0, x1 = np.broadcast_arrays(x0, x1)
    x0 = x0.copy()
    x1 = x1.copy()
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    with np.errstate(over="ignore"):
        x0 = x0 + ks[0]
        x1 = x1 + ks[1]
        for block in range(5):
            for r in _ROTATIONS[block % 2]:
                x0 = x0 + x1
                x1 = _rotl(x1, r)
                x1 = x0 ^ x1
            x0 = x0 + ks[(block + 1) % 3]
            x1 = x1 + ks[(block + 2) % 3] + U32(block + 1)
    return x0, x1


def fold_in(key: tuple[int, int], data) -> np.ndarray:
    """jax.random.fold_in for threefry2x32 key data; `data` is a uint32 scalar or array.
    Returns an array of shape data.shape + (2,)."""
    # mirrors jax/_src/random/threefry2x32.py threefry_fold_in: threefry_2x32(key, threefry_seed(data))
    d = np.asarray(data, dtype=U32)
    y0, y1 = threefry2x32(key[0], key[1], np.zeros_like(d), d)
    return np.stack([y0, y1], axis=-1)


def split_one(key: tuple[int, int], n: int, i: int, partitionable: bool) -> tuple[int, int]:
    """Row i of jax.random.split(key, n) for threefry2x32 key data."""
    if partitionable:
        # mirrors jax/_src/random/threefry2x32.py _threefry_split_foldlike: counts are (hi, lo) of the index
        y0, y1 = threefry2x32(key[0], key[1], U32(i >> 32), U32(i & 0xFFFFFFFF))
        return int(y0), int(y1)
    # mirrors _threefry_split_original: threefry_2x32(key, iota(2n)).reshape(n, 2)
    return _original_out(key, n, 2 * i), _original_out(key, n, 2 * i + 1)


def _original_out(key: tuple[int, int], n: int, p: int) -> int:
    lo = p if p < n else p - n
    y0, y1 = threefry2x32(key[0], key[1], U32(lo), U32(lo + n))
    return int(y0) if p < n else int(y1)


def seed_data(seed: int) -> tuple[int, int]:
    """Key data of jax.random.key(seed) for threefry2x32 with x64 off."""
    return (0, seed & 0xFFFFFFFF)
