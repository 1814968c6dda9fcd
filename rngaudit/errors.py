"""Where a problem is, and the one exception family every command catches: one class per cause."""

from __future__ import annotations

from dataclasses import dataclass

# Exit codes, the public API of every command (README, "Exit codes").
EXIT_OK = 0  # clean
EXIT_FINDINGS = 1  # findings (unless --exit-zero)
EXIT_ERROR = 2  # bad usage or bad input: the run could not go on, and the message says why
EXIT_INTERNAL = 3  # a bug in rngaudit: please report it


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
    """Base error: the run cannot go on. Commands print `error: [FILE:LINE:COL: ]MESSAGE` on stderr and exit
    with `exit_code`."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, location: Location | None = None):
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        if self.location is None:
            return self.message
        return f"{self.location}: {self.message}"


class InputError(RngauditError):
    """An input file cannot be read or is malformed: a JSON file of module paths or of a params tree, a keys file
    written by `capture --keys` (specs raise SpecError)."""


class SpecError(InputError):
    """The spec is malformed: bad YAML, an unknown key, a wrong type, a bad key expression, or more than the
    limits allow."""


class FlaxError(RngauditError):
    """The spec is well formed, but real Flax would raise while running this model."""

    def __init__(self, flax_error: str, message: str, location: Location | None = None):
        super().__init__(f"Flax raises {flax_error}: {message}", location)
        self.flax_error = flax_error


class UsageError(RngauditError):
    """A command-line argument or option is invalid, or does not apply to what else was given."""


class OutputError(UsageError):
    """The report (or keys file) cannot be written where --output (or --keys) says."""


class ConfigError(RngauditError):
    """`[tool.rngaudit]` in pyproject.toml is malformed: bad TOML, an unknown key, a value of the wrong type."""


class UserCodeError(RngauditError):
    """The user's code (capture's TARGET, shard-check's --fn) cannot be imported, called or run."""


class DeviceError(RngauditError):
    """The devices asked for cannot be had, or the run on them could not finish (shard-check)."""


class FlaxUnavailableError(RngauditError):
    """The command runs real Flax, which is not installed."""


NEEDS_JAX = (
    "this needs JAX, which is not installed: pip install 'rngaudit[jax]' (drawn values, unsafe_rbg keys, "
    "shard-check and capture use it; threefry and rbg keys, `derive --no-values` and `collisions` of such specs "
    "do not)"
)


class JaxUnavailableError(RngauditError):
    """The command needs JAX (the `jax` extra), which is not installed."""

    def __init__(self, message: str = NEEDS_JAX, location: Location | None = None):
        super().__init__(message, location)


class UnsupportedError(RngauditError):
    """The input is valid but uses something rngaudit cannot handle yet (a gap in rngaudit, not a mistake of the
    user), e.g. a transform capture cannot describe as a spec."""


class InternalError(RngauditError):
    """rngaudit contradicts itself, e.g. a captured spec whose replay differs from what Flax did: a bug in
    rngaudit, to report with the input."""

    exit_code = EXIT_INTERNAL
