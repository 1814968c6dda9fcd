"""rngaudit.threefry: Threefry-2x32 on Python ints is bit-identical to the NumPy version and to jax.random.

The int functions (threefry2x32_int, fold_in_int, split_one) let small inputs start without NumPy; the
NumPy functions vectorise large ones. Both must give JAX's bits for every key and count.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rngaudit.engine import threefry

u32 = st.integers(0, 2**32 - 1)
keys = st.tuples(u32, u32)
EDGES = [(0, 0), (2**32 - 1, 2**32 - 1), (0x1BD11BDA, 0), (1, 2**31)]


@settings(max_examples=300, deadline=None)
@given(keys, u32, u32)
@example((0, 0), 0, 0)
@example((2**32 - 1, 2**32 - 1), 2**32 - 1, 2**32 - 1)
def test_int_block_equals_numpy_block(key, x0, x1):
    y0, y1 = threefry.threefry2x32(key[0], key[1], np.uint32(x0), np.uint32(x1))
    assert threefry.threefry2x32_int(key[0], key[1], x0, x1) == (int(y0), int(y1))


@settings(max_examples=100, deadline=None)
@given(keys, st.lists(u32, min_size=1, max_size=64))
def test_int_fold_in_equals_numpy_fold_in(key, words):
    want = threefry.fold_in(key, np.asarray(words, np.uint32)).tolist()
    assert [list(threefry.fold_in_int(key, w)) for w in words] == want


@pytest.mark.parametrize("partitionable", [True, False], ids=["partitionable", "original"])
@settings(max_examples=60, deadline=None)
@given(key=keys, n=st.integers(1, 40))
def test_split_one_equals_numpy_split(partitionable, key, n):
    """split_one (ints) against the whole split computed in NumPy, as JAX computes it."""
    if partitionable:
        # jax/_src/random/threefry2x32.py _threefry_split_foldlike: counts (hi, lo) of each index
        y0, y1 = threefry.threefry2x32(key[0], key[1], np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32))
        want = np.stack([y0, y1], axis=-1).tolist()
    else:
        # _threefry_split_original: threefry_2x32(key, iota(2n)).reshape(n, 2)
        y0, y1 = threefry.threefry2x32(
            key[0], key[1], np.arange(n, dtype=np.uint32), np.arange(n, 2 * n, dtype=np.uint32)
        )
        want = np.concatenate([y0, y1]).reshape(n, 2).tolist()
    assert [list(threefry.split_one(key, n, i, partitionable)) for i in range(n)] == want


# ---------------------------------------------------------------- against jax.random itself
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys, st.lists(u32, min_size=1, max_size=8))
def test_int_fold_in_matches_jax(key, words):
    jax = pytest.importorskip("jax")
    k = jax.random.wrap_key_data(np.asarray(key, np.uint32), impl="threefry2x32")
    for w in words + [0, 2**32 - 1]:
        want = np.asarray(jax.random.key_data(jax.random.fold_in(k, np.uint32(w)))).tolist()
        assert list(threefry.fold_in_int(key, w)) == want


@pytest.mark.parametrize("partitionable", [True, False], ids=["partitionable", "original"])
@pytest.mark.parametrize("key", EDGES)
def test_split_one_matches_jax(partitionable, key):
    jax = pytest.importorskip("jax")
    k = jax.random.wrap_key_data(np.asarray(key, np.uint32), impl="threefry2x32")
    for n in (1, 2, 3, 7):
        with jax.threefry_partitionable(partitionable):
            want = np.asarray(jax.random.key_data(jax.random.split(k, n))).tolist()
        assert [list(threefry.split_one(key, n, i, partitionable)) for i in range(n)] == want


def test_importing_threefry_imports_no_numpy():
    code = "import sys, rngaudit.engine.threefry, rngaudit.engine.keys; print(sorted(m for m in sys.modules if m == 'numpy'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
