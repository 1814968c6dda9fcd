"""How two arrays differ: the values that differ (bit for bit, or beyond a tolerance), the largest
difference and its distance in units in the last place."""

from __future__ import annotations

import numpy as np


def is_float(dtype) -> bool:
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def max_ulp(a: np.ndarray, b: np.ndarray) -> int | None:
    """The largest distance in units in the last place between finite floats of a and b."""
    if not is_float(a.dtype) or a.dtype.itemsize not in (2, 4, 8):
        return None
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    finite = np.isfinite(a.astype(np.float64)) & np.isfinite(b.astype(np.float64))
    if not finite.any():
        return None

    def ordered(x):
        bits = np.ascontiguousarray(x).view(ints).astype(object if ints is np.int64 else np.int64)
        return np.where(bits < 0, np.iinfo(ints).min - bits, bits)

    return int(np.max(np.abs(ordered(a)[finite] - ordered(b)[finite])))


def compare(a: np.ndarray, b: np.ndarray, atol: float = 0.0) -> dict:
    """How b differs from a: values that differ (bit for bit when atol is 0), the largest |a - b| and ulp distance."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"mismatched": max(a.size, b.size), "max_abs_diff": None, "max_ulp": None}
    if not a.size:
        return {"mismatched": 0, "max_abs_diff": None, "max_ulp": None}
    if atol == 0 or not is_float(a.dtype):
        bits_a = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, -1)
        bits_b = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(b.size, -1)
        differ = int((bits_a != bits_b).any(axis=1).sum())
    else:
        differ = int(
            (~np.isclose(a.astype(np.float64), b.astype(np.float64), rtol=0.0, atol=atol, equal_nan=True)).sum()
        )
    if a.dtype == np.bool_:
        return {"mismatched": differ, "max_abs_diff": None, "max_ulp": None}
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {
        "mismatched": differ,
        "max_abs_diff": None if np.isnan(diff).all() else float(np.nanmax(diff)),
        "max_ulp": max_ulp(a, b),
    }


def beyond_rounding(a: np.ndarray, b: np.ndarray, ulps: int) -> int:
    """How many values of b differ from a by more than rounding: `ulps` units in the last place of the larger
    of the two values or of the output's scale (its largest magnitude), so that rounding in a sum that
    cancels to near zero is not mistaken for a different value. Non-floats compare bit for bit."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.size, b.size)
    if not is_float(a.dtype) or not a.size:
        return compare(a, b)["mismatched"]
    x, y = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(x) & np.isfinite(y)
    scale = float(np.max(np.abs(x[finite]))) if finite.any() else 0.0
    eps = float(np.finfo(a.dtype).eps) if a.dtype.kind == "f" else 2.0**-7  # bfloat16 and float8: coarse
    allowed = ulps * eps * np.maximum(np.maximum(np.abs(x), np.abs(y)), scale)
    same = np.where(finite, np.abs(x - y) <= allowed, (x == y) | (np.isnan(x) & np.isnan(y)))
    return int((~same).sum())
