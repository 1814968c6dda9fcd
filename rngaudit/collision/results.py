"""The results of `collisions`: the call sites that share a key, why, and the fixes checked, per input."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import Location, RngauditError

if TYPE_CHECKING:
    from .nnx import NnxAudit

# The collision classes (issue 4). 1-3 are decided by hashing alone; 4 needs key data.
CONCATENATION = 1  # identical hash input from different string items
COUNT_MEETS_NAME = 2  # identical hash input where an integer count meets string bytes
HASH_WORD = 3  # different hash inputs, identical 32-bit SHA-1 word, same base key
SHARED_KEY = 4  # identical keys from different base keys, streams or lanes

CATEGORIES = {
    CONCATENATION: "concatenation",
    COUNT_MEETS_NAME: "count_meets_name",
    HASH_WORD: "hash_word",
}
JIT_TRACE_REUSE = "jit_trace_reuse"  # class 1, failing: one call site's count hashed again (flax < 0.10.2 nn.jit)
SHARED_SEED = "shared_seed"  # class 4, failing: streams (or bases) seeded with the same key
UNSPLIT_LANES = "unsplit_lanes"  # class 4, information: the lanes of one call share a key (split_rngs false)
# The kinds of finding `--fail-on` names; by default the failing ones make the command exit 1.
# (NNX specs have their own: rngaudit.collision.nnx)
FAILING_CATEGORIES = (
    "concatenation",
    "jit_trace_reuse",
    "count_meets_name",
    "hash_word",
    "shared_seed",
    "shared_stream_key",
    "count_rewind",
    "broadcast_lanes",
    "frozen_scan_broadcast",
    "keyless_dropout",
    "bridge_constant_default",
)
FINDING_CATEGORIES = FAILING_CATEGORIES + (
    "unsplit_lanes",
    "latent",
    "reseed_order",
    "reseed_repeat",
    "scan_broadcast",
    "default_fallback",
)


@dataclass(frozen=True)
class CallSite:
    """One key request: where it comes from, what Flax hashes for it, and the key it gets."""

    index: int
    path: tuple[str, ...]
    stream_requested: str
    stream: str
    count: int
    lane: tuple[int, ...]
    base: str
    kind: str
    label: str | None
    hash_items: tuple
    hash_input: bytes
    hash_word: int
    key: tuple[int, ...] | None
    location: Location

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"


_FIELDS: dict[type, tuple[str, ...]] = {}


def frozen_record(cls, *values):
    """cls(*values) for a frozen dataclass of plain fields, without its __setattr__ per field: a large
    report describes tens of thousands of call sites."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    obj = object.__new__(cls)
    obj.__dict__.update(zip(names, values))
    return obj


@dataclass(frozen=True)
class HashInput:
    """The call sites of a finding that hash exactly the same bytes."""

    data: bytes
    word: int
    key: tuple[int, ...] | None  # None when key data was not computed (hash-only run)
    sites: tuple[CallSite, ...]


@dataclass(frozen=True)
class SeparatorCheck:
    """Whether `fix_rng_separator: true` removes a finding, found by recomputing the keys with it."""

    flag: bool  # the model's fix_rng_separator now
    removes: bool | None  # None: the flag is on already, or the keys could not be recomputed
    detail: str
    keys_in_model: int  # every one of them changes when the flag flips


@dataclass(frozen=True)
class Rename:
    """An explicit `name:` for one module, verified to remove the finding without creating a new one."""

    path: tuple[str, ...]  # the module's path now
    new_name: str
    module_class: str | None
    explicit: bool  # the module has an explicit name now (else Flax auto-names it)
    location: Location | None  # where the module is written
    keys_changed: int  # call sites whose key the rename changes (every stream)
    note: str = ""  # what else changes, e.g. later auto-named modules that Flax then names differently

    @property
    def old_name(self) -> str:
        return self.path[-1]

    @property
    def path_str(self) -> str:
        return "/".join(self.path)


@dataclass(frozen=True)
class Collision:
    """Distinct call sites that end with one identical key."""

    collision_class: int
    category: str
    failing: bool
    inputs: tuple[HashInput, ...]  # grouped by key and hashed bytes, in order of first call
    separator: SeparatorCheck
    renames: tuple[Rename, ...]  # () when no rename helps or none could be verified
    rename_note: str

    @property
    def sites(self) -> tuple[CallSite, ...]:
        return tuple(sorted((s for h in self.inputs for s in h.sites), key=lambda s: s.index))

    @property
    def keys(self) -> tuple[tuple[int, ...] | None, ...]:
        """The distinct keys the call sites share (one, except for class 4 across several keys)."""
        return tuple(dict.fromkeys(h.key for h in self.inputs))


@dataclass(frozen=True)
class LatentPartner:
    """A longer path that collides with a latent finding's path once the counts meet."""

    site: CallSite  # its first call site
    max_count: int  # the highest count it reaches now
    counts: tuple[int, int]  # the smallest colliding counts: (short path's, this path's)
    data: bytes  # the bytes both would hash at those counts
    separator_counts: tuple[int, int] | None  # the same with fix_rng_separator flipped; None: never


@dataclass(frozen=True)
class LatentCollision:
    """A module path whose keys would equal those of other paths if it drew more keys."""

    site: CallSite  # the first call site of the short path
    max_count: int
    partners: tuple[LatentPartner, ...]
    separator: SeparatorCheck
    renames: tuple[Rename, ...]
    rename_note: str


@dataclass(frozen=True)
class Audit:
    """Every collision and latent collision of one input (a spec, or a JSON file of module paths)."""

    source: str
    input_kind: str  # spec | paths | params_tree
    call_sites: int
    fix_rng_separator: bool
    prng_impl: str | None
    keys_checked: bool  # class 4 needs key data; False for hash-only runs and JSON inputs
    latent_max_count: int
    collisions: tuple[Collision, ...]
    latent: tuple[LatentCollision, ...]
    rules: str | None = None  # the Flax rule set of a spec (None: a JSON list of paths)

    @property
    def failing(self) -> int:
        return sum(1 for c in self.collisions if c.failing)

    @property
    def info(self) -> int:
        return sum(1 for c in self.collisions if not c.failing)


def fail_categories(strict: bool, fail_on: Sequence[str] | None) -> frozenset[str]:
    """The categories that make `collisions` fail: `fail_on` if given, else the failing classes (all with
    `strict`)."""
    if strict:
        return frozenset(FINDING_CATEGORIES)
    return frozenset(FAILING_CATEGORIES if fail_on is None else fail_on)


@dataclass(frozen=True)
class CollisionsReport:
    """The audits of every input of one `collisions` run, and the categories that make it fail."""

    audits: tuple[Audit | NnxAudit, ...]
    fail_on: frozenset[str] = frozenset(FAILING_CATEGORIES)
    errors: tuple[RngauditError, ...] = ()  # inputs that could not be audited (collisions(keep_going=True))
    suppressed: tuple = ()  # findings left out by ignore comments, per-path ignores, the baseline (suppress.py)
    baseline_unmatched: int = 0  # baseline entries no finding matched (fixed since it was written)
    warnings: tuple[str, ...] = ()  # e.g. an ignore comment naming no rule

    @property
    def suppressed_counts(self) -> dict[str, int]:
        """How many findings each reason (inline, config, baseline) left out; reasons that left out none are
        absent."""
        out: dict[str, int] = {}
        for s in sorted(self.suppressed, key=lambda s: ("inline", "config", "baseline").index(s.reason)):
            out[s.reason] = out.get(s.reason, 0) + len(s.audit.collisions) + len(s.audit.latent)
        return out

    @property
    def failing(self) -> bool:
        """Whether a finding of a category in `fail_on` was found (the command then exits 1)."""
        return any(c.category in self.fail_on for a in self.audits for c in a.collisions) or (
            "latent" in self.fail_on and any(a.latent for a in self.audits)
        )
