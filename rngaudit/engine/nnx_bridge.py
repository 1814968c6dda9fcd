"""The bridges between Linen and NNX.

Linen inside NNX: the keys of a `bridge.ToNNX` module's Linen init or apply, given the keys its call drew.
Mirrors flax/nnx/bridge/wrappers.py ToNNX.__call__ (flax 0.12 and later): the call draws one key from every
stream of the Rngs ToNNX keeps (`{name: stream()}`, in the Rngs' order), renames `default` to `params` when
there is no `params`, and runs the Linen module's `init_with_output(rngs, x)` (under `bridge.lazy_init`) or
`apply(variables, x, rngs=rngs)`, whose keys follow Linen's rules (path and count hashed into each stream's
key): the Linen replay computes them from those keys as if they were a Linen spec's `rngs`.

NNX inside Linen: a `bridge.ToLinen` module builds a new NNX module at every call from
`nnx.Rngs(**{s: self.make_rng(s) for s in scope.rngs})`, adding `default=0` at apply when there is no
`default` (FLAX_NNX_RULES.md §14), and calls it once; its RngState is not kept, so counts start again at every
call: the NNX replay runs it with those keys as its spec's `rngs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ..errors import Location
from ..spec import keyexpr
from ..spec.tree import ModuleDef, RngSource, Spec
from .keys import KeyData
from .records import Derivation, ToLinenSite

if TYPE_CHECKING:
    from .nnx import NnxDeriveReport

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


# ---------------------------------------------------------------- NNX inside Linen: bridge.ToLinen
@dataclass(frozen=True)
class ToLinenRun:
    """One call of a bridge.ToLinen module: the NNX module it built at that call and called once, with every key
    its streams handed out. `streams`: per stream of its nnx.Rngs, the Linen call (index into the report's
    calls) whose make_rng key seeds it, or None for the `default` stream of key(0) added at apply."""

    site: ToLinenSite
    streams: tuple[tuple[str, int | None], ...]
    report: NnxDeriveReport
    lane: tuple[int, ...] = ()  # its Linen vmap lane / scan step / while iteration, outermost first

    @property
    def where(self) -> str:
        """`bridge.ToLinen at /t, call 1 (apply)`, with `, lane [2]` inside Linen's lanes."""
        site = self.site
        lane = f", lane {list(self.lane)}" if self.lane else ""
        thrown = ", in a trace Flax throws away" if site.discarded else ""
        return (
            f"bridge.ToLinen at /{site.path_str}, call {site.call}{lane} ({'init' if site.init else 'apply'}{thrown})"
        )

    @property
    def constant_default(self) -> bool:
        """The `default` stream is the constant key(0) ToLinen adds at apply."""
        return any(row is None for _, row in self.streams)


def to_linen_spec(spec: Spec, site: ToLinenSite, keys: dict[str, KeyData], rows: dict[str, int]):
    """The NNX spec of one ToLinen call: `nnx.Rngs(**{s: make_rng(s)})` (and `default=0` at apply when there is
    no `default`: flax/nnx/bridge/wrappers.py linen_rngs_dict), the module built, then called once."""
    from ..spec.nnx import NnxSpec, NnxStep

    loc = site.location
    where = f"/{site.path_str}"
    rngs = {
        s: RngSource(keyexpr.Raw(tuple(k)), f"make_rng({s!r}) at {where} count {rows[s]}", loc) for s, k in keys.items()
    }
    if not site.init and not site.skip_rng and "default" not in rngs:
        rngs["default"] = RngSource(keyexpr.Seed(0), "0 (ToLinen's default at apply)", loc)
    return NnxSpec(
        spec.file,
        spec.prng_impl,
        spec.threefry_partitionable,
        rngs,
        site.module,
        (NnxStep(loc, 1),),
        flax_version=spec.flax_version,
        jax_version=spec.jax_version,
    )


def _without(report: NnxDeriveReport, roots: set[str]) -> NnxDeriveReport:
    """The report without the keys of streams whose key never exists (their chain starts at one of `roots`)."""
    import dataclasses

    import numpy as np

    from .nnx import NnxCalls

    table = report.calls.table
    starts = {(r,) for r in roots}
    kept = np.asarray([k.chain[:1] not in starts for k in table.blocks], dtype=bool)
    keep = np.flatnonzero(kept[table.block]) if len(table.block) else np.zeros(0, dtype=np.int64)
    return dataclasses.replace(report, calls=NnxCalls(table, keep, None, {}))


def check_to_linen(spec: Spec, site: ToLinenSite, streams: tuple[str, ...]) -> None:
    """Raise what building and calling the ToLinen call's NNX module, given keys of `streams`, raises (any keys
    will do: an NNX error does not depend on them)."""
    from .keys import KeyEngine
    from .nnx import NnxReplayer

    engine = KeyEngine(spec.prng_impl, spec.threefry_partitionable)
    zero = engine.seed(0)
    nspec = to_linen_spec(spec, site, dict.fromkeys(streams, zero), dict.fromkeys(streams, 0))
    NnxReplayer(nspec, engine).run()


def to_linen_runs(
    spec: Spec, sites: list[ToLinenSite], key_of, values: bool, default_draw, counts
) -> tuple[ToLinenRun, ...]:
    """Every ToLinen call's NNX keys, in each of its Linen lanes (row-major). `key_of(template, lane index)` gives
    (its report row, key data) of a make_rng template's key in a lane; `counts(template)` its Linen count."""
    from itertools import product

    from .nnx import derive_nnx

    out = []
    for site in sites:
        for li, lane in enumerate(product(*(range(n) for n in site.lanes))):
            keys: dict[str, KeyData] = {}
            counted: dict[str, int] = {}
            streams: list[tuple[str, int | None]] = []
            missing = []  # streams whose key never exists (a per-step key of a trace Flax throws away)
            found: dict[str, KeyData | None] = {}
            for s, t in site.templates:
                row, found[s] = key_of(t, li)
                counted[s] = counts(t)
                streams.append((s, row))
                if found[s] is None:
                    missing.append(s)
            present = [k for k in found.values() if k is not None]
            if missing and not present:
                continue  # (no key of the run exists)
            for s, k in found.items():
                keys[s] = k if k is not None else (0,) * len(present[0])  # (its rows are left out below)
            nspec = to_linen_spec(spec, site, keys, counted)
            if "default" in nspec.rngs and "default" not in keys:
                streams.append(("default", None))
            # a run in a trace Flax throws away: its keys exist (the NNX module draws them) but are not used
            report = derive_nnx(nspec, values=values and not site.discarded, default_draw=default_draw)
            if missing:
                report = _without(report, {"key " + nspec.rngs[s].text for s in missing})
            out.append(ToLinenRun(site, tuple(streams), report, tuple(lane)))
    return tuple(out)
