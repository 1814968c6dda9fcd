"""rngaudit: replay, check and diff the PRNG keys Flax hands every make_rng call."""
from __future__ import annotations

__version__ = "0.1.0"

# The public API loads on first use (PEP 562): `rngaudit --help`, and commands that need no spec, start
# without the spec parser, the replay and what they import.
_API = {
    "FlaxError": "errors", "Location": "errors", "RngauditError": "errors", "SpecError": "errors",
    "hash_input": "engine.hashing", "hash_word": "engine.hashing", "produce_hash": "engine.hashing",
    "Derivation": "engine.records", "replay": "engine.replay",
    "load_spec": "spec.parse", "parse_spec": "spec.parse",
}


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


def derive(spec, values: bool = True):
    """Replay `spec` (a Spec, or a path to a spec file) and return a DeriveReport with keys."""
    from .engine.derive import derive as _derive
    from .spec.parse import load_spec

    if isinstance(spec, str):
        spec = load_spec(spec)
    return _derive(spec, values=values)


__all__ = [
    "Derivation", "FlaxError", "Location", "RngauditError", "SpecError", "__version__", "derive",
    "hash_input", "hash_word", "load_spec", "parse_spec", "produce_hash", "replay",
]
