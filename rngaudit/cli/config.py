"""`[tool.rngaudit]` in pyproject.toml: option defaults, each remembering the file:line:col it was written at.

    [tool.rngaudit]              # defaults for every command that has the option
    format = "github"
    exit-zero = false

    [tool.rngaudit.collisions]   # defaults for one command; they win over the ones above
    fix-rng-separator = true
    fail-on = ["concatenation", "count_meets_name", "hash_word"]

Keys are the commands' long option names without `--`. This module reads and locates them; which keys
exist and what values they take is decided by the commands themselves (cli.py).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, Location
from ..spec.limits import read_bounded

FILE_NAME = "pyproject.toml"
TABLE = ("tool", "rngaudit")
MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Setting:
    """One `key = value` of [tool.rngaudit] (`section` None) or of [tool.rngaudit.COMMAND]."""

    section: str | None
    key: str
    value: Any
    location: Location

    @property
    def table(self) -> str:
        return ".".join(TABLE + ((self.section,) if self.section else ()))


@dataclass(frozen=True)
class Config:
    """Everything [tool.rngaudit] of one file sets; empty when there is no file or no table."""

    file: str | None = None
    common: dict[str, Setting] = field(default_factory=dict)
    sections: dict[str, dict[str, Setting]] = field(default_factory=dict)
    section_locations: dict[str, Location] = field(default_factory=dict)

    def for_command(self, command: str) -> dict[str, Setting]:
        """The settings that apply to `command`: its own section's win over the common ones."""
        return {**self.common, **self.sections.get(command, {})}


def find_pyproject(start: str | None = None) -> str | None:
    """The pyproject.toml of the project the command runs in: the nearest one in the working directory or
    above it, not above the repository root (a directory holding `.git`)."""
    here = os.path.abspath(start or os.getcwd())
    while True:
        candidate = os.path.join(here, FILE_NAME)
        if os.path.isfile(candidate):
            return candidate
        parent = os.path.dirname(here)
        if parent == here or os.path.exists(os.path.join(here, ".git")):
            return None
        here = parent


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith(os.pardir) else path


_BARE = r"[A-Za-z0-9_-]+"
_PART = rf'(?:{_BARE}|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
_HEADER = re.compile(rf"^(\s*)\[\[?\s*({_DOTTED})\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(rf"^(\s*)({_DOTTED})\s*=")


def _parts(dotted: str) -> tuple[str, ...]:
    return tuple(
        p.strip()[1:-1] if p.strip()[:1] in "\"'" else p.strip()
        for p in re.findall(rf"\s*({_PART})\s*(?:\.|$)", dotted)
    )


def key_positions(text: str, file: str) -> dict[tuple[str, ...], Location]:
    """Where each table header and `key =` line is, by its full dotted path (a light scan: values come from
    tomllib; this only finds lines for messages, so a key it cannot place is reported at its table)."""
    out: dict[tuple[str, ...], Location] = {}
    table: tuple[str, ...] = ()
    in_string = None
    for n, line in enumerate(text.splitlines(), 1):
        if in_string:
            if line.count(in_string) % 2:
                in_string = None
            continue
        m = _HEADER.match(line)
        if m:
            table = _parts(m.group(2))
            out.setdefault(table, Location(file, n, len(m.group(1)) + 1))
            continue
        m = _KEY.match(line)
        if m:
            out.setdefault(table + _parts(m.group(2)), Location(file, n, len(m.group(1)) + 1))
            rest = line[m.end() :]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2:
                    in_string = quote
    return out


def _where(positions: dict, path: tuple[str, ...], file: str) -> Location:
    while path:
        if path in positions:
            return positions[path]
        path = path[:-1]
    return Location(file, 1, 1)


def load(path: str) -> Config:
    """Read [tool.rngaudit] of `path`; a file that cannot be read or parsed is a ConfigError with its place."""
    shown = _shown(path)
    top = Location(shown, 1, 1)
    data = read_bounded(
        path, MAX_BYTES, lambda message: ConfigError(message, top), directory="is a directory, not a pyproject.toml"
    )
    if len(data) > MAX_BYTES:
        raise ConfigError(f"the file is larger than {MAX_BYTES // (1024 * 1024)} MiB", top)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start]
        line = before.count(b"\n") + 1
        col = len(before[before.rfind(b"\n") + 1 :].decode("utf-8", "replace")) + 1
        raise ConfigError(f"the file is not UTF-8 (byte 0x{data[e.start]:02x})", Location(shown, line, col)) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", msg)
        loc = Location(shown, int(m.group(1)), int(m.group(2))) if m else top
        if m:
            msg = msg[: m.start()]
        elif msg.endswith("(at end of document)"):
            lines = text.splitlines() or [""]
            loc = Location(shown, len(lines), len(lines[-1]) + 1)
            msg = msg[: -len("(at end of document)")].rstrip()
        raise ConfigError(f"invalid TOML: {msg}", loc) from None
    table = doc.get("tool", {}).get("rngaudit") if isinstance(doc.get("tool"), dict) else None
    if table is None:
        return Config(shown)
    positions = key_positions(text, shown)
    if not isinstance(table, dict):
        raise ConfigError(
            '[tool.rngaudit] must be a table of option defaults, e.g. `[tool.rngaudit]` then `format = "github"`',
            _where(positions, TABLE, shown),
        )
    common: dict[str, Setting] = {}
    sections: dict[str, dict[str, Setting]] = {}
    section_locations: dict[str, Location] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            section_locations[key] = _where(positions, TABLE + (key,), shown)
            sections[key] = {
                k: Setting(key, k, v, _where(positions, TABLE + (key, k), shown)) for k, v in value.items()
            }
        else:
            common[key] = Setting(None, key, value, _where(positions, TABLE + (key,), shown))
    return Config(shown, common, sections, section_locations)


def discover(explicit: str | None = None) -> Config:
    """The configuration a command runs with: `--config FILE` if given, else the pyproject.toml found from the
    working directory, else none."""
    if explicit is not None:
        if not explicit:
            from ..errors import UsageError

            raise UsageError("--config '': name a pyproject.toml (or leave --config out to find one)")
        return load(explicit)
    found = find_pyproject()
    return load(found) if found is not None else Config()
