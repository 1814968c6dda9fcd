"""Where a problem is in a spec, and the one exception family commands catch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Location:
    """A 1-based position in a spec file."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def as_json(self) -> dict:
        return {"file": self.file, "line": self.line, "col": self.col}


class RngauditError(Exception):
    """Base error: the run cannot go on. Commands print it and exit 2."""

    def __init__(self, message: str, location: Location | None = None):
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        if self.location is None:
            return self.message
        return f"{self.location}: {self.message}"


class SpecError(RngauditError):
    """The spec is malformed: bad YAML, unknown key, wrong type, bad key expression."""


class FlaxError(RngauditError):
    """The spec is well formed, but real Flax would raise while running this model."""

    def __init__(self, flax_error: str, message: str, location: Location | None = None):
        super().__init__(f"Flax raises {flax_error}: {message}", location)
        self.flax_error = flax_error


class DeviceError(RngauditError):
    """The devices asked for cannot be had, or the run on them could not finish (shard-check)."""


class UserCodeError(RngauditError):
    """The user function of `shard-check --fn` cannot be imported, called as fn(key, x), or run."""


class ConfigError(RngauditError):
    """`[tool.rngaudit]` in pyproject.toml is malformed: bad TOML, an unknown key, a value of the wrong type."""
