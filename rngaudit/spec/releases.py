"""Flax's and JAX's key rules, release by release: the rule set a spec's `flax: {version}` and
`jax: {version}` select, and the words an upgrade report gives for each rule that moves keys.

Each change was read off the releases' source and measured on both sides of its boundary: Linen in
virtualenvs of flax 0.8.1, 0.8.2, 0.8.5, 0.9.0, 0.10.0, 0.10.1, 0.10.2, 0.11.0 and 0.12.8 (benchmarks/version_matrix.py,
tests/data/linen_old_flax.json), NNX in 0.10.2 and 0.11.0 (tests/data/nnx_old_flax.json), JAX's default on 0.4.38
and 0.5.0. The engine takes the rule set as a value (FlaxRules)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..errors import SpecError
from .fields import Fields, as_str

NEWEST = "newest"  # a release option that asks for the newest rules
OLDEST_FLAX = (0, 8, 0)  # the oldest release whose rules rngaudit has (Linen's LazyRng and counters, 0.8.0 on)


UNKNOWN = "unknown"  # a keys file that does not say which release it ran


@dataclass(frozen=True)
class Release:
    """The releases an upgrade check puts a spec under (None: as the spec says; NEWEST: the newest rules), and the
    option that asks for them (errors name it, not the spec)."""

    flax: str | None = None
    jax: str | None = None
    origin: str = ""


def known(version: str | None) -> tuple[int, ...] | None | Literal[False]:
    """A side's release as a tuple (None: the newest rules), or False when it is unknown."""
    if version is None:
        return None
    try:
        return version_tuple(version)
    except ValueError:
        return False


@dataclass(frozen=True)
class Change:
    """One rule that changed in a release: what it is from `since` on, and what it was before."""

    since: tuple[int, ...]
    rule: str  # a short id
    flavour: str  # linen | nnx | jax
    now: str
    before: str
    aspect: str = ""  # what the rule is about (nn.jit's rules share one): an upgrade names an aspect's rule once

    @property
    def about(self) -> str:
        return self.aspect or self.rule

    @property
    def release(self) -> str:
        return ".".join(map(str, self.since))


FLAX_CHANGES = (
    Change(
        (0, 8, 2),
        "stream_fallback",
        "linen",
        "a make_rng on a stream that was not passed falls back to 'params' (and advances its counter)",
        "a make_rng on a stream that was not passed raises InvalidRngError",
    ),
    Change(
        (0, 8, 2),
        "jit_cache_counters",
        "linen",
        "jax reuses an nn.jit trace only when the module's rng counters match as well (a jitted module traced "
        "again, as in nn.scan's second trace, advances its counts)",
        "jax reuses an nn.jit trace when the module's fields match (a later trace of a jitted module, as in "
        "nn.scan's second trace, keeps the earlier trace's counts)",
    ),
    Change(
        (0, 9, 0),
        "jit_fold",
        "linen",
        "nn.jit folds the path up to the jitted module into the key at the jit boundary (keys inside hash "
        "only the path below it and the count), and the jitted module's setup() runs once on its own scope first",
        "nn.jit is transparent (keys inside hash the whole path, as without nn.jit), and the jitted module's "
        "setup() runs only inside the trace",
        "jit",
    ),
    Change(
        (0, 10, 2),
        "jit_fork",
        "linen",
        "nn.jit forks a fresh key per stream (one make_rng at the jitted module's scope, on every call) and "
        "keys inside derive from it",
        "nn.jit folds the path up to the jitted module into the key at the jit boundary",
        "jit",
    ),
    Change(
        (0, 11, 0),
        "nnx_dropout_fork",
        "nnx",
        "nnx.Dropout and attention fork their own stream at construction",
        "nnx.Dropout and attention draw from the caller's Rngs at each call",
    ),
    Change(
        (0, 11, 0),
        "nnx_reseed",
        "nnx",
        "nnx.reseed folds each stream's place in graph order into the key it is given",
        "nnx.reseed sets each stream to the key it is given",
    ),
)
JAX_CHANGES = (
    Change(
        (0, 5, 0),
        "threefry_partitionable",
        "jax",
        "jax_threefry_partitionable defaults to true (split keys, so every vmap/scan lane, and drawn values change; "
        "fold_in does not)",
        "jax_threefry_partitionable defaults to false",
    ),
)

# The Linen constructs a release must have (the first release with it).
LINEN_SINCE = {
    "nn.InstanceNorm": (0, 8, 1),
    "nn.Einsum": (0, 8, 2),
    "nn.fold_rngs": (0, 10, 2),
    "nn.scan's check_constancy_invariants": (0, 11, 0),
}


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.10.2' -> (0, 10, 2), '0.8' -> (0, 8, 0); a pre-release or local suffix is dropped. ValueError if it is
    no version."""
    # (every repeated part starts with a separator: no backtracking blow-up on a long bad suffix)
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(?:[a-zA-Z]+\d*)?(?:[.+\-][0-9A-Za-z]+)*", text.strip())
    if not m:
        raise ValueError(text)
    return tuple(int(g) if g is not None else 0 for g in m.groups())  # ('0.8' is 0.8.0)


def release(fields: Fields, what: str = "Flax") -> str | None:
    """The `version:` of a spec's `flax:` or `jax:` mapping, checked to be a release number (text)."""
    vn = fields.get("version")
    if vn is None:
        return None
    if isinstance(vn.value, float):
        raise SpecError(f"`version` is text: quote it ('{vn.value}' reads as a number)", vn.loc)
    text = as_str(vn, "`version`").strip()
    try:
        version_tuple(text)
    except ValueError:
        raise SpecError(f"`version` {text!r} is not a {what} release like '0.10.2'", vn.loc) from None
    return text


def version_text(v: tuple[int, ...] | None) -> str:
    return "newest" if v is None else ".".join(map(str, v))


@dataclass(frozen=True)
class FlaxRules:
    """The Linen rules of one Flax release (None: the newest, which every release since 0.10.2 shares)."""

    version: tuple[int, ...] | None = None

    def at_least(self, v: tuple[int, ...]) -> bool:
        return self.version is None or self.version >= v

    @property
    def jit(self) -> str:
        """How nn.jit passes keys in: fork (0.10.2 on), fold (0.9.0 to 0.10.1) or transparent (before 0.9.0)."""
        if self.at_least((0, 10, 2)):
            return "fork"
        return "fold" if self.at_least((0, 9, 0)) else "transparent"

    @property
    def jit_counters_in_cache_key(self) -> bool:
        """Before 0.10.2 jax reuses an nn.jit trace (Python does not run: counters do not move) when the module's
        fingerprint, its keys' static suffixes and its variables are the same; from 0.8.2 the fingerprint holds
        the module's rng counters, in 0.8.0 and 0.8.1 only its fields."""
        return self.at_least((0, 8, 2))

    @property
    def stream_fallback(self) -> bool:
        """Whether a make_rng on a stream not passed falls back to 'params' (0.8.2 on)."""
        return self.at_least((0, 8, 2))

    def lacks(self, construct: str) -> bool:
        return not self.at_least(LINEN_SINCE[construct])

    @property
    def name(self) -> str:
        """The rule set as reports name it: the release, and what sets its Linen rules apart."""
        if self.version is None:
            return "flax>=0.10.2 (Linen: nn.jit forks a key per stream on every call)"
        jit = {
            "fork": "nn.jit forks a key per stream on every call",
            "fold": "nn.jit folds the path into the key at its boundary",
            "transparent": "nn.jit is transparent",
        }[self.jit]
        fallback = "" if self.stream_fallback else "; a stream not passed raises InvalidRngError"
        return f"flax {version_text(self.version)} (Linen: {jit}{fallback})"

    def as_json(self) -> dict:
        return {
            "jit": self.jit,
            "stream_fallback": self.stream_fallback,
        }


def jax_partitionable_default(version: tuple[int, ...] | None) -> bool:
    """jax_threefry_partitionable's default in a JAX release (True from 0.5.0; None: the newest)."""
    return version is None or version >= (0, 5, 0)


def changes_between(
    old: tuple[int, ...] | None, new: tuple[int, ...] | None, changes: tuple[Change, ...] = FLAX_CHANGES
) -> list[Change]:
    """The changes between two releases (either order): those a release after the older one and up to the
    newer one brought in. None: the newest release."""
    lo, hi = (new, old) if _lt(new, old) else (old, new)
    return [c for c in changes if _lt(lo, c.since) and not _lt(hi, c.since)]


def _lt(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    """a < b, None being the newest release."""
    if a is None:
        return False
    return b is None or a < b
