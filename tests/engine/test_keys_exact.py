"""derive_keys_exact (Python ints) derives exactly the keys derive_keys does (NumPy Threefry, checked against JAX there),
for every fixture spec, for threefry2x32 and rbg, with and without jax_threefry_partitionable."""

from __future__ import annotations

import dataclasses

import pytest
from support import LINEN_EXAMPLES, REPO

from rngaudit import load_spec
from rngaudit.engine.keys import derive_keys, derive_keys_exact
from rngaudit.engine.replay import replay
from rngaudit.spec.keyexpr import FoldIn, Raw, Split

SPECS = sorted(
    [
        *REPO.glob("fixtures/collisions/*.yaml"),
        *REPO.glob("fixtures/guide/*.yaml"),
        *REPO.glob("fixtures/shard/*.yaml"),
        *LINEN_EXAMPLES,
    ]
)


def _raw(expr) -> bool:
    """Whether a key expression holds raw key data (whose width belongs to one impl)."""
    while isinstance(expr, (Split, FoldIn)):
        expr = expr.parent
    return isinstance(expr, Raw)


def variants(spec):
    yield spec
    yield dataclasses.replace(spec, threefry_partitionable=not spec.threefry_partitionable)
    if spec.prng_impl == "threefry2x32" and not any(_raw(src.expr) for src in spec.rngs.values()):
        yield dataclasses.replace(spec, prng_impl="rbg")


@pytest.mark.parametrize("path", SPECS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_int_keys_equal_numpy_keys(path):
    cache: dict = {}  # shared by the variants, as SpecSites shares it with a spec's renamed copies
    for spec in variants(load_spec(str(path))):
        rows = replay(spec)
        want = [tuple(k) for k in derive_keys(spec, rows).tolist()]
        assert derive_keys_exact(spec, rows) == want
        assert derive_keys_exact(spec, rows, cache) == want
        assert derive_keys_exact(spec, rows, cache) == want  # now from the cache


def test_unsafe_rbg_is_refused():
    spec = dataclasses.replace(load_spec(str(REPO / "rngaudit" / "examples" / "guide.yaml")), prng_impl="unsafe_rbg")
    with pytest.raises(ValueError, match="need JAX"):
        derive_keys_exact(spec, replay(spec))
