"""A progress bar on stderr for long runs: shown only on a terminal, only after a second, gone when done.

    with progress(len(items), "auditing") as advance:
        for item in items:
            work(item)
            advance(1)

`total=None` shows a spinner with the elapsed time (work of unknown length, e.g. waiting on a process).
Nothing is drawn when stderr is not a terminal (CI logs, pipes, tests), and stdout is never touched,
so the report stays clean. `advance` is cheap: it adds to a counter, and rich redraws from its own
thread a few times a second.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SHOW_AFTER_SECONDS = 1.0  # short runs never flash a bar
# the threads a bar runs (its timer, rich's refresh thread): they touch only rich and the bar's lock,
# so a process that forks a worker that touches neither may fork beside them (rngaudit.fast)
THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _noop(n: int = 1) -> None:
    return None


def enabled(stream=None) -> bool:
    """A bar is drawn only on an interactive terminal (and never with TERM=dumb)."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return bool(tty) and os.environ.get("TERM") != "dumb"


@contextmanager
def progress(
    total: int | None, description: str, *, stream=None, delay: float = SHOW_AFTER_SECONDS
) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n=1)`; draw a transient bar on `stream` (stderr) once the run lasts `delay` seconds."""
    stream = sys.stderr if stream is None else stream
    if not enabled(stream):
        yield _noop
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(file=stream, no_color="NO_COLOR" in os.environ, highlight=False)
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    # stdout is the report's: rich would otherwise swap sys.stdout for a proxy drawing it above the bar on stderr
    # (a report redirected to a file would end up on the terminal instead, and take minutes to get there)
    bar = Progress(*columns, console=console, transient=True, refresh_per_second=8, redirect_stdout=False)
    task = bar.add_task(description, total=total)
    lock = threading.Lock()
    state = {"started": False, "stopped": False}

    def start() -> None:
        with lock:
            if not state["stopped"]:
                before = set(threading.enumerate())
                bar.start()
                THREADS.update(
                    t for t in threading.enumerate() if t not in before and type(t).__module__.startswith("rich.")
                )
                state["started"] = True

    timer = threading.Timer(delay, start)
    timer.daemon = True
    timer.start()
    THREADS.add(timer)

    def advance(n: int = 1) -> None:
        bar.advance(task, n)

    try:
        yield advance
    finally:
        timer.cancel()
        with lock:
            state["stopped"] = True
            if state["started"]:
                bar.stop()
