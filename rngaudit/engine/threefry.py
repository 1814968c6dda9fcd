"""Exact Threefry-2x32: JAX's fold_in, split and seeding, on Python ints (one key) or vectorised in NumPy, no JAX."""

from __future__ import annotations

from collections.abc import Sequence

# NumPy is imported by the vectorised functions only: a few keys on Python ints start faster without it.

# mirrors jax/_src/random/threefry2x32.py _threefry2x32_lowering (Salmon et al., Threefry-2x32, 20 rounds)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
_MASK = 0xFFFFFFFF


def threefry2x32_int(k0: int, k1: int, x0: int, x1: int) -> tuple[int, int]:
    """Threefry-2x32 block cipher on one block of Python ints (each a uint32); bit-identical to threefry2x32."""
    m = _MASK
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0 = (x0 + k0) & m
    x1 = (x1 + k1) & m
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x0 = (x0 + x1) & m
            x1 = (((x1 << r) & m) | (x1 >> (32 - r))) ^ x0
        x0 = (x0 + ks[(block + 1) % 3]) & m
        x1 = (x1 + ks[(block + 2) % 3] + block + 1) & m
    return x0, x1


def fold_in_int(key: Sequence[int], data: int) -> tuple[int, int]:
    """jax.random.fold_in for threefry2x32 key data and one uint32 `data`, on Python ints."""
    # mirrors jax/_src/random/threefry2x32.py threefry_fold_in: threefry_2x32(key, threefry_seed(data))
    return threefry2x32_int(key[0], key[1], 0, data & _MASK)


def _rotl(v, r: int):
    import numpy as np

    return (v << np.uint32(r)) | (v >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 block cipher on uint32 arrays (broadcasting)."""
    import numpy as np

    u32 = np.uint32
    k0 = np.asarray(k0, dtype=u32)
    k1 = np.asarray(k1, dtype=u32)
    x0 = np.array(x0, dtype=u32, copy=True)
    x1 = np.array(x1, dtype=u32, copy=True)
    x0, x1 = np.broadcast_arrays(x0, x1)
    x0 = x0.copy()
    x1 = x1.copy()
    ks = (k0, k1, k0 ^ k1 ^ u32(_PARITY))
    with np.errstate(over="ignore"):
        x0 = x0 + ks[0]
        x1 = x1 + ks[1]
        for block in range(5):
            for r in _ROTATIONS[block % 2]:
                x0 = x0 + x1
                x1 = _rotl(x1, r)
                x1 = x0 ^ x1
            x0 = x0 + ks[(block + 1) % 3]
            x1 = x1 + ks[(block + 2) % 3] + u32(block + 1)
    return x0, x1


def fold_in(key: Sequence[int], data):
    """jax.random.fold_in for threefry2x32 key data; `data` is a uint32 scalar or array.
    Returns an array of shape data.shape + (2,)."""
    import numpy as np

    # mirrors jax/_src/random/threefry2x32.py threefry_fold_in: threefry_2x32(key, threefry_seed(data))
    d = np.asarray(data, dtype=np.uint32)
    y0, y1 = threefry2x32(key[0], key[1], np.zeros_like(d), d)
    return np.stack([y0, y1], axis=-1)


def split_one(key: Sequence[int], n: int, i: int, partitionable: bool) -> tuple[int, int]:
    """Row i of jax.random.split(key, n) for threefry2x32 key data (on Python ints)."""
    if partitionable:
        # mirrors jax/_src/random/threefry2x32.py _threefry_split_foldlike: counts are (hi, lo) of the index
        return threefry2x32_int(key[0], key[1], (i >> 32) & _MASK, i & _MASK)
    # mirrors _threefry_split_original: threefry_2x32(key, iota(2n)).reshape(n, 2)
    return _original_out(key, n, 2 * i), _original_out(key, n, 2 * i + 1)


def _original_out(key: Sequence[int], n: int, p: int) -> int:
    lo = p if p < n else p - n
    y0, y1 = threefry2x32_int(key[0], key[1], lo & _MASK, (lo + n) & _MASK)
    return y0 if p < n else y1


def seed_data(seed: int) -> tuple[int, int]:
    """Key data of jax.random.key(seed) for threefry2x32 with x64 off."""
    return (0, seed & 0xFFFFFFFF)
