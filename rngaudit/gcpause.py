"""Pause Python's cyclic garbage collector for a bounded piece of work that allocates many objects.

A million-site replay or audit allocates millions of tuples, lists and call sites that stay alive
until the work ends. Each time the allocation count passes a threshold the collector walks the
objects already alive, looking for cycles that this work does not make; on a million call sites
that walk was a quarter of the whole run. Reference counting still frees everything that is
dropped, so memory stays as it was; only cycles wait for the collector's next run, after the work.

    @paused
    def audit(...): ...

Nested pauses are free; the collector is turned back on only by the outermost one, and only if it
was on before.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def paused(fn: F) -> F:
    """`fn` with the cyclic collector off while it runs (not for generator functions: the pause would
    end when the generator is made, before it runs)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper  # type: ignore[return-value]
