"""rngaudit: replay, check and diff the PRNG keys Flax hands every make_rng call."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import FlaxError, Location, RngauditError, SpecError  # noqa: E402
from .hashing import hash_input, hash_word, produce_hash  # noqa: E402
from .replay import Derivation, replay  # noqa: E402
from .spec import load_spec, parse_spec  # noqa: E402


def derive(spec, values: bool = True):
    """Replay `spec` (a Spec, or a path to a spec file) and return a DeriveReport with keys."""
    from .report import derive as _derive

    if isinstance(spec, str):
        spec = load_spec(spec)
    return _derive(spec, values=values)


__all__ = [
    "Derivation", "FlaxError", "Location", "RngauditError", "SpecError", "__version__", "derive",
    "hash_input", "hash_word", "load_spec", "parse_spec", "produce_hash", "replay",
]
