"""rngaudit: replay, check and diff the PRNG keys Flax hands every make_rng call.

The Python API (rngaudit.api) is every command as a function returning its report:

    import rngaudit

    report = rngaudit.derive("model.yaml")              # DeriveReport: report.calls, each with .key
    report = rngaudit.collisions("a.yaml", "b.json")    # CollisionsReport: report.failing, report.audits
    report = rngaudit.shard_check(["model.yaml"], devices=8)
    report = rngaudit.capture("model.py:make")          # CaptureReport: report.spec, report.capture
    report = rngaudit.verify("model.yaml", against="keys.json")
    report = rngaudit.diff("old.yaml", "new.yaml")      # Comparison: report.failing, report.entries
    rngaudit.findings(report)                           # what --format github/sarif would annotate
"""

from __future__ import annotations

__version__ = "0.1.0"

# The public API loads on first use (PEP 562): `rngaudit --help`, and commands that need no spec, start
# without the spec parser, the replay and what they import.
_API = {
    "derive": "api",
    "collisions": "api",
    "shard_check": "api",
    "capture": "api",
    "verify": "api",
    "diff": "api",
    "findings": "api",
    "Location": "errors",
    "RngauditError": "errors",
    "InputError": "errors",
    "SpecError": "errors",
    "FlaxError": "errors",
    "UsageError": "errors",
    "OutputError": "errors",
    "ConfigError": "errors",
    "UserCodeError": "errors",
    "DeviceError": "errors",
    "FlaxUnavailableError": "errors",
    "JaxUnavailableError": "errors",
    "UnsupportedError": "errors",
    "InternalError": "errors",
    "DeriveReport": "engine.derive",
    "CollisionsReport": "collision.results",
    "ShardReport": "shard.report",
    "CaptureReport": "refactor.capture",
    "Comparison": "refactor.compare",
    "hash_input": "engine.hashing",
    "hash_word": "engine.hashing",
    "produce_hash": "engine.hashing",
    "Derivation": "engine.records",
    "replay": "engine.replay",
    "Spec": "spec.tree",
    "NnxSpec": "spec.nnx",
    "NnxDeriveReport": "engine.nnx",
    "NnxAudit": "collision.nnx",
    "load_spec": "spec.parse",
    "parse_spec": "spec.parse",
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


__all__ = [
    "CaptureReport",
    "CollisionsReport",
    "Comparison",
    "ConfigError",
    "Derivation",
    "DeriveReport",
    "DeviceError",
    "FlaxError",
    "FlaxUnavailableError",
    "InputError",
    "InternalError",
    "JaxUnavailableError",
    "Location",
    "NnxAudit",
    "NnxDeriveReport",
    "NnxSpec",
    "OutputError",
    "RngauditError",
    "ShardReport",
    "Spec",
    "SpecError",
    "UnsupportedError",
    "UsageError",
    "UserCodeError",
    "__version__",
    "capture",
    "collisions",
    "derive",
    "diff",
    "findings",
    "hash_input",
    "hash_word",
    "load_spec",
    "parse_spec",
    "produce_hash",
    "replay",
    "shard_check",
    "verify",
]
