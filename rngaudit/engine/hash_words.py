"""The hash words of a block replay's templates: SHA-1 once per distinct hash input, in one tight loop over
prepared count encodings, the last templates hashed by a forked child process when a second core is free."""

from __future__ import annotations

import hashlib

import numpy as np

from .hashing import hash_input

_sha1 = hashlib.sha1
ENC_CACHE = 1 << 17  # counts whose bytes are kept (per separator setting); larger ones are made as needed
_ENC: list[bytes] = [b""]  # _ENC[c]: Flax's bytes for the int c (minimal big-endian)
_ENC_SEP: list[bytes] = [b"\x00"]
CHUNK = 1 << 16  # hash inputs per chunk: the digests in flight stay bounded


def encodings(upto: int, sep: bool) -> list[bytes]:
    """The bytes Flax hashes for counts 0..upto (with the separator's 0 byte first), cached up to
    ENC_CACHE; beyond it, use encode_range."""
    enc = _ENC_SEP if sep else _ENC
    upto = min(upto, ENC_CACHE)
    if len(enc) <= upto:
        start = len(enc)
        fresh = [
            c.to_bytes((c.bit_length() + 7) // 8, "big")
            for c in range(start, min(max(upto + 1, 2 * start), ENC_CACHE + 1))
        ]
        enc.extend([b"\x00" + e for e in fresh] if sep else fresh)
    return enc


def encode_range(c0: int, c1: int, sep: bool) -> list[bytes]:
    """The bytes of counts c0..c1-1 (any size): from the cache where it has them."""
    if c1 - 1 <= ENC_CACHE:
        return encodings(c1 - 1, sep)[c0:c1]
    head = b"\x00" if sep else b""
    return [head + c.to_bytes((c.bit_length() + 7) // 8, "big") for c in range(c0, c1)]


PARALLEL_HASHES = 200_000  # replays with at least this many hash inputs are hashed by two processes
PARENT_SHARE = 0.45  # of them, this process hashes this share (it makes the other columns meanwhile)


def can_fork() -> bool:
    """Forking is safe here: a POSIX fork, two CPUs, no JAX (its runtime's threads), and no other thread
    but a progress bar's (rngaudit.progress.THREADS: they hold nothing the child, which only hashes and
    writes to its pipe, needs)."""
    import os
    import sys
    import threading

    if not hasattr(os, "fork") or os.environ.get("RNGAUDIT_HASH_PROCESSES") == "1" or "jax" in sys.modules:
        return False
    progress = sys.modules.get("rngaudit.output.progress")
    ours = progress.THREADS if progress is not None else ()
    me = threading.current_thread()
    if any(t is not me and t not in ours for t in threading.enumerate()):
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except AttributeError:
        return (os.cpu_count() or 1) >= 2


def fork() -> int | None:
    """os.fork() where can_fork() allowed it (Python 3.12+'s warning of a fork beside threads silenced: a progress
    bar's hold nothing the child needs); None if no child could be made."""
    import os
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return os.fork()
    except OSError:  # e.g. EAGAIN under a process limit, ENOMEM
        return None


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` to `fd` (a pipe or a file takes what it can at a time)."""
    import os

    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def hash_templates(templates, sep: bool, total: int) -> np.ndarray:
    """Hash words of `templates`' inputs, in order: one tight SHA-1 loop, words taken in chunks."""
    sha1 = _sha1
    out = np.empty(total, dtype=np.uint32)
    done = 0
    digests: list[bytes] = []

    def flush() -> None:
        # the digests so far -> their first 4 bytes, big-endian
        nonlocal done
        words = np.frombuffer(b"".join(digests), dtype=">u4").reshape(-1, 5)[:, 0]
        out[done : done + len(words)] = words
        done += len(words)
        digests.clear()

    enc = encodings(0, sep)
    for tpl in templates:
        pre = hash_input(tpl.suffix, sep)
        c0, k = tpl.first_count, tpl.n
        if k == 1 and c0 <= ENC_CACHE:
            if c0 >= len(enc):
                enc = encodings(c0, sep)
            digests.append(sha1(pre + enc[c0]).digest())
        else:
            for a in range(c0, c0 + k, CHUNK):
                digests += [sha1(pre + e).digest() for e in encode_range(a, min(a + CHUNK, c0 + k), sep)]
                if len(digests) >= CHUNK:
                    flush()
        if len(digests) >= CHUNK:
            flush()
    if digests:
        flush()
    return out


class WordsChild:
    """uint32 words make() made by a forked child and written to a pipe, read when finish() is called
    (the parent works meanwhile). Start only where can_fork() allows."""

    def __init__(self, pid: int, r: int, n: int, make):
        self.pid, self.n, self.make = pid, n, make
        self.r: int | None = r

    @classmethod
    def start(cls, make, n: int) -> WordsChild | None:
        """Fork a child that writes make() (n uint32 words); None if no child could be made."""
        import os

        try:
            r, w = os.pipe()
        except OSError:
            return None
        pid = fork()
        if pid is None:
            os.close(r)
            os.close(w)
            return None
        if pid == 0:  # the child: hash, write the words, leave without running any cleanup
            code = 1
            try:
                os.close(r)
                write_all(w, np.ascontiguousarray(make(), dtype=np.uint32).tobytes())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        return cls(pid, r, n, make)

    def finish(self) -> np.ndarray:
        """The child's words; made here if the child failed."""
        import os

        assert self.r is not None, "finish() once"
        chunks: list[bytes] = []
        try:
            while True:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:  # the pipe failed
            self.cancel()
            return self.make()
        except BaseException:
            self.cancel()
            raise
        status = self._reap()
        data = b"".join(chunks)
        if status != 0 or len(data) != 4 * self.n:
            return self.make()
        return np.frombuffer(data, dtype=np.uint32)

    def cancel(self) -> None:
        """End the child at once (an interrupt or an error in the parent meanwhile)."""
        import os
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self._reap()

    def _reap(self) -> int:
        import os

        if self.r is not None:
            os.close(self.r)
            self.r = None
        while True:
            try:
                return os.waitpid(self.pid, 0)[1]
            except InterruptedError:
                continue
            except ChildProcessError:
                return 1


def start_words(templates, sep: bool, word_off: np.ndarray) -> tuple[np.ndarray, WordsChild | None]:
    """The hash word of every (template, count) of a block replay: SHA-1 once per distinct input. A large
    replay is hashed by two processes: a forked child hashes the last templates and writes their words to a
    pipe, read by child.finish(); this process hashes the first ones (a little fewer: it makes the table's
    other columns meanwhile). Returns (this process's words, the child or None)."""
    total = int(word_off[-1])
    if total >= PARALLEL_HASHES and can_fork():
        # the first template whose words start past this process's share
        mid = int(np.searchsorted(word_off[1:], int(total * PARENT_SHARE), side="right"))
        split = int(word_off[mid])
        if 0 < split < total:
            child = WordsChild.start(lambda: hash_templates(templates[mid:], sep, total - split), total - split)
            if child is not None:
                try:
                    return hash_templates(templates[:mid], sep, split), child
                except BaseException:
                    child.cancel()
                    raise
    return hash_templates(templates, sep, total), None
