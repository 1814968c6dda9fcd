"""How much YAML a spec may hold (bytes, nodes after alias expansion, nesting), and the limits in force while
specs load. Stdlib only: the command line states the defaults in --help without loading the spec machinery."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

# Pure-Python YAML parses about 25,000 nodes (or 3 MB of plain text) a second and holds ~1 KB per node, so
# these defaults refuse junk within a few seconds and a few hundred MB; a real spec is far smaller (a
# model's size is in `repeat:`, not in the text). --max-spec-mib and --max-yaml-nodes raise them.
MAX_BYTES = 4 * 1024 * 1024
MAX_NODES = 100_000  # YAML nodes after alias expansion
MAX_DEPTH = 200  # nesting levels, aliases included (fixed: deeper nesting would exhaust the stack)


class Limits(NamedTuple):
    """How much YAML a spec may hold; the commands' --max-spec-mib and --max-yaml-nodes raise them for a
    legitimately large spec."""

    max_bytes: int = MAX_BYTES
    max_nodes: int = MAX_NODES


_LIMITS: ContextVar[Limits] = ContextVar("rngaudit_yaml_limits", default=Limits())  # noqa: B039 - a tuple


def current_limits() -> Limits:
    return _LIMITS.get()


@contextmanager
def limits(max_bytes: int | None = None, max_nodes: int | None = None) -> Iterator[Limits]:
    """Load specs under other limits inside the block (None keeps the default)."""
    chosen = Limits(MAX_BYTES if max_bytes is None else max_bytes, MAX_NODES if max_nodes is None else max_nodes)
    token = _LIMITS.set(chosen)
    try:
        yield chosen
    finally:
        _LIMITS.reset(token)


def read_bounded(
    path: str,
    max_bytes: int,
    fail: Callable[[str], Exception],
    *,
    missing: str = "no such file",
    directory: str | None = None,
    cannot: str = "cannot read",
) -> bytes:
    """The bytes of the file at `path`, at most `max_bytes` + 1 of them (more than `max_bytes`: the caller says the
    file is too large), read in chunks (f.read(max_bytes + 1) would allocate all of it up front). A file that
    cannot be read raises `fail(message)`: `missing`, `directory` (None: said as any other OS error), or
    `cannot: <the OS's reason>`. Every loader of a bounded input file (spec, JSON, pyproject.toml, baseline) reads
    through here."""
    try:
        with open(path, "rb") as f:
            chunks, size = [], 0
            while size <= max_bytes and (chunk := f.read(min(1 << 22, max_bytes + 1 - size))):
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
    except FileNotFoundError:
        raise fail(missing) from None
    except IsADirectoryError as e:
        raise fail(directory if directory is not None else f"{cannot}: {e.strerror or e}") from None
    except OSError as e:
        raise fail(f"{cannot}: {e.strerror or e}") from None
