"""A long report's rows written by two processes: this one makes and writes the first rows' text while a forked
child makes the rest into a temporary file, read back once this one is done (what engine/hash_words.py does for
the hashing, done for the writing). Byte for byte the text one process makes: the child runs the same code on the
same rows, and if it fails in any way this process makes its rows itself."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from ..engine.hash_words import can_fork, fork, write_all

PARALLEL_ROWS = 100_000  # reports with at least this many rows are written by two processes
PARENT_SHARE = 0.5  # of the rows, this process makes this share (it also copies the child's text after)
READ = 1 << 20  # characters of the child's text read back at a time

Chunks = Iterator[tuple[str, int]]


def in_two(make: Callable[[int, int], Chunks], n: int, step: int) -> Chunks:
    """The (text, rows) chunks of `make(0, n)`: `make(a, b)` gives those of rows a..b-1 (a a multiple of `step`).
    With enough rows and a second core, a forked child makes the last rows meanwhile."""
    mid = int(n * PARENT_SHARE) // step * step
    child = _Child.start(make, mid, n) if n >= PARALLEL_ROWS and 0 < mid < n and can_fork() else None
    if child is None:
        yield from make(0, n)
        return
    try:
        yield from make(0, mid)
        yield from child.read() or make(mid, n)
    finally:
        child.close()


class _Child:
    """A forked child writing make(a, b)'s text (UTF-8) to a temporary file."""

    def __init__(self, pid: int, spill, rows: int):
        self.pid: int | None = pid
        self.spill, self.rows = spill, rows

    @classmethod
    def start(cls, make: Callable[[int, int], Chunks], a: int, b: int) -> _Child | None:
        import tempfile

        try:
            spill = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close(), after the child has written it)
        except OSError:
            return None
        pid = fork()
        if pid is None:
            spill.close()
            return None
        if pid == 0:  # the child: make the rows' text, write it, leave without running any cleanup
            code = 1
            try:
                fd = spill.fileno()
                for text, _ in make(a, b):
                    write_all(fd, text.encode("utf-8"))
                code = 0
            finally:
                os._exit(code)
        return cls(pid, spill, b - a)

    def read(self) -> Chunks | None:
        """The child's text as (text, rows) chunks (the rows spread over them by size); None if the child failed."""
        if self._reap() != 0:
            return None
        fd = self.spill.fileno()
        size = os.fstat(fd).st_size
        os.lseek(fd, 0, os.SEEK_SET)
        return self._chunks(fd, size)

    def _chunks(self, fd: int, size: int) -> Chunks:
        done = told = 0
        with open(fd, encoding="utf-8", newline="", closefd=False) as f:
            while text := f.read(READ):
                done += len(text.encode("utf-8")) if not text.isascii() else len(text)
                now = self.rows * done // max(size, 1)
                yield text, now - told
                told = now
        if told < self.rows:
            yield "", self.rows - told

    def close(self) -> None:
        """End the child if it still runs (this process was interrupted or failed meanwhile) and drop its file."""
        import signal

        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
            self._reap()
        self.spill.close()

    def _reap(self) -> int:
        if self.pid is None:
            return 1
        while True:
            try:
                status = os.waitpid(self.pid, 0)[1]
            except InterruptedError:
                continue
            except ChildProcessError:
                status = 1
            # (cleared only now: an interrupt while waiting leaves the pid for close() to kill and reap)
            self.pid = None
            return status
