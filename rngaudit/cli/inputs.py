"""What a command's SPEC arguments name, as ruff and yamllint take theirs: files, directories (walked for specs:
files matching `--include`, none matching `--exclude`, YAML without a top-level `rngaudit:` key skipped), and `-`
(a spec on standard input, named by `--stdin-filename`)."""

from __future__ import annotations

import fnmatch
import os
import re
import sys
from collections.abc import Sequence

from ..errors import Location, SpecError
from ..spec.parse import SpecBytes
from .boundary import not_utf8

DEFAULT_INCLUDE = ("*.yaml", "*.yml")
# never walked into (ruff's defaults, less what cannot hold specs): tools' caches, environments, VCS data
SKIPPED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".venv",
        "venv",
        ".tox",
        ".nox",
        "node_modules",
        "__pycache__",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        "site-packages",
    }
)
_SPEC_KEY = re.compile(rb"^rngaudit\s*:", re.MULTILINE)
STDIN = "-"


def stdin_spec(name: str | None = None) -> SpecBytes:
    """`-`: the spec on standard input, shown as `name` (default `<stdin>`); read up to one byte past the spec size
    limit (the parser then says it is too large)."""
    from ..errors import UsageError
    from ..spec.limits import current_limits

    if sys.stdin is None:  # (started with standard input closed: `<&-`)
        raise UsageError("-: standard input is closed; give the spec on it, or name the file")
    try:
        data = sys.stdin.buffer.read(current_limits().max_bytes + 1)
    except OSError as e:
        raise UsageError(f"-: cannot read standard input ({e.strerror or e})") from None
    return SpecBytes(data, name or "<stdin>")


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    """Whether a path (relative to the directory walked, `/`-separated) or one of its parts matches a pattern."""
    parts = rel.split("/")
    return any(fnmatch.fnmatchcase(rel, p) or any(fnmatch.fnmatchcase(part, p) for part in parts) for p in patterns)


def _is_spec(path: str) -> bool:
    """A walked YAML file is an rngaudit spec if it has a top-level `rngaudit:` key (others are not ours)."""
    if not path.lower().endswith((".yaml", ".yml")):
        return True  # (JSON inputs, included on purpose: module paths, params trees or specs)
    try:
        with open(path, "rb") as f:
            return _SPEC_KEY.search(f.read(1024 * 1024)) is not None
    except OSError:
        return True  # (read again, and its error reported, as an input)


def walk(directory: str, include: Sequence[str], exclude: Sequence[str]) -> list[str]:
    """The specs under `directory`, sorted, as paths that start with it."""
    found = []
    for root, dirs, files in os.walk(directory):
        rel_root = os.path.relpath(root, directory).replace(os.sep, "/")
        rel_root = "" if rel_root == "." else rel_root + "/"
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not _excluded(rel_root + d, exclude))
        for name in sorted(files):
            rel = rel_root + name
            path = os.path.join(root, name)
            if (
                any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(rel, p) for p in include)
                and not _excluded(rel, exclude)
                and _is_spec(path)
            ):
                found.append(path)
    return found


def expand(
    inputs: Sequence[str],
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    stdin_filename: str | None = None,
) -> tuple[list[str | SpecBytes], list[SpecError]]:
    """The inputs in order: a file as given, a directory's specs, `-` read once from standard input; and the
    directories that hold no spec, as errors (a typo should not pass as a clean run)."""
    include = tuple(include) if include else DEFAULT_INCLUDE
    out: list[str | SpecBytes] = []
    errors: list[SpecError] = []
    read_stdin = False
    for given in inputs:
        if given == STDIN:
            if read_stdin:
                raise SpecError("`-` (standard input) is given twice; give it once", Location(STDIN, 1, 1))
            read_stdin = True
            out.append(stdin_spec(stdin_filename))
        elif os.path.isdir(given):
            specs = [os.path.normpath(p) for p in walk(given, include, exclude)]
            unnamed = {p: shown for p in specs if (shown := not_utf8(p)) is not None}  # (no report could write them)
            errors.extend(
                SpecError("the file name is not UTF-8; rename it", Location(s, 1, 1)) for s in unnamed.values()
            )
            specs = [p for p in specs if p not in unnamed]
            if not specs and not unnamed:
                errors.append(
                    SpecError(
                        f"no spec under this directory (files matching {', '.join(include)} with a top-level "
                        "`rngaudit:` key); name a spec, or set --include",
                        Location(given, 1, 1),
                    )
                )
            out.extend(specs)
        else:
            out.append(given)
    seen: set[str] = set()
    unique: list[str | SpecBytes] = []
    for source in out:  # (a file given twice, or under two directories given, is audited once)
        if isinstance(source, str):
            real = os.path.realpath(source)
            if real in seen:
                continue
            seen.add(real)
        unique.append(source)
    return unique, errors
