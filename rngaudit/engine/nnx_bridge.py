"""Linen inside NNX: the keys of a `bridge.ToNNX` module's Linen init or apply, given the keys its call drew.

Mirrors flax/nnx/bridge/wrappers.py ToNNX.__call__ (flax 0.12 and later): the call draws one key from every
stream of the Rngs ToNNX keeps (`{name: stream()}`, in the Rngs' order), renames `default` to `params` when
there is no `params`, and runs the Linen module's `init_with_output(rngs, x)` (under `bridge.lazy_init`) or
`apply(variables, x, rngs=rngs)`, whose keys follow Linen's rules (path and count hashed into each stream's
key): the Linen replay computes them from those keys as if they were a Linen spec's `rngs`."""

from __future__ import annotations

from typing import TypeVar

from ..errors import Location
from ..spec import keyexpr
from ..spec.tree import ModuleDef, RngSource, Spec
from .keys import KeyData
from .records import Derivation

T = TypeVar("T")


def linen_rngs(drawn: dict[str, T]) -> dict[str, T]:
    """The rngs ToNNX passes to Linen: `default` becomes `params` when there is no `params`."""
    rngs = dict(drawn)
    if "params" not in rngs and "default" in rngs:
        rngs["params"] = rngs.pop("default")
    return rngs


def linen_keys(
    module: ModuleDef,
    rngs: dict[str, KeyData],
    init: bool,
    prng_impl: str,
    partitionable: bool,
    file: str,
    loc: Location,
) -> list[tuple[Derivation, KeyData]]:
    """Every key the Linen module's init (or apply on the variables init made) hands out from `rngs`, in
    order; keys of a trace Flax throws away (scan's constancy check) are left out, as Flax never hands them
    out."""
    from .derive import derive

    spec = Spec(
        file,
        False,
        prng_impl,
        partitionable,
        "init" if init else "apply",
        bool(init),
        {name: RngSource(keyexpr.Raw(tuple(key)), str(list(key)), loc) for name, key in rngs.items()},
        module,
    )
    report = derive(spec, values=False)
    return [(c.derivation, c.key) for c in report.calls if c.key is not None and not c.derivation.discarded]
