"""The one error boundary of every command: rngaudit's errors print one `error:` line and exit with their
exit code (2: bad usage or input; 3: a bug in rngaudit), a bug of ours is said as one, and nothing leaks a
traceback (RNGAUDIT_DEBUG=1 shows it)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import typer

from ..errors import EXIT_ERROR, EXIT_FINDINGS, EXIT_INTERNAL, NEEDS_JAX, RngauditError


def one_line(text: str) -> str:
    """Error output is one line, whatever names or values a message quotes."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def values_on_the_cpu() -> None:
    """Start JAX on its CPU backend alone (for a command whose only JAX work is drawing a spec's values, which
    are drawn on the CPU whatever the backend: rngaudit.engine.draws._cpu), so that a GPU machine does not pay
    for bringing up its accelerator. JAX_PLATFORMS set by the user, or JAX already started, is left alone."""
    import os
    import sys

    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def spec_limits(max_spec_mib: int | None, max_yaml_nodes: int | None) -> AbstractContextManager:
    """Specs load under --max-spec-mib and --max-yaml-nodes inside the block (None: the default)."""
    from ..spec.limits import limits

    return limits(None if max_spec_mib is None else max_spec_mib * 1024 * 1024, max_yaml_nodes)


def not_utf8(text: str) -> str | None:
    """`text` as it can be shown (`s\\xff.yaml`) if it holds bytes that are not UTF-8 (a file name, read with
    surrogateescape: no report can write it), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return None


class _OsExit(SystemExit):
    """os._exit called by the user's code in this process (see _os_exit_refused)."""


@contextmanager
def _os_exit_refused() -> Iterator[None]:
    """os._exit raises _OsExit in this process inside the block: the user's model, factory or step calling
    os._exit(0) ended the command with exit 0 and nothing checked (a CI gate passed). A forked child (the
    two-process hashing and writing) still leaves by the real one."""
    real, me = os._exit, os.getpid()

    def refused(code: int) -> None:
        if os.getpid() != me:
            real(code)
        raise _OsExit(code)

    os._exit = refused  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


def run(fn: Callable[[], None]) -> None:
    """Run a command's body: its errors end the command here, each as one line."""
    try:
        with _os_exit_refused():
            fn()
    except typer.Exit:
        raise
    except RngauditError as e:
        sys.stderr.write(f"error: {one_line(str(e))}\n")
        raise typer.Exit(e.exit_code) from None
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("jax", "jaxlib"):
            raise _internal(e) from None
        sys.stderr.write(f"error: {NEEDS_JAX}\n")
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise typer.Exit(EXIT_ERROR) from None
    except RecursionError:
        sys.stderr.write("error: the spec nests too deeply to replay\n")
        raise typer.Exit(EXIT_ERROR) from None
    except UnicodeEncodeError as e:
        bad = not_utf8(str(e.object))
        if bad is None:
            raise _internal(e) from None
        sys.stderr.write(f"error: '{one_line(bad)}' is not UTF-8 (a file name?); rename it\n")
        raise typer.Exit(EXIT_ERROR) from None
    except MemoryError:
        sys.stderr.write("error: out of memory; the spec asks for too many keys or values\n")
        raise typer.Exit(EXIT_ERROR) from None
    except Exception as e:  # noqa: BLE001 - a bug of ours: say so, briefly, with its own exit code
        raise _internal(e) from None
    except SystemExit as e:
        if type(e) not in (SystemExit, _OsExit):  # (rngaudit's own: a SIGTERM's way out of shard-check)
            raise
        # rngaudit never exits inside a command: the user's model, factory or step did, and nothing was checked
        # (exit 0 here would pass a CI gate)
        how = "os._exit" if type(e) is _OsExit else "sys.exit"
        sys.stderr.write(
            f"error: the user's code rngaudit ran (the model, its factory or the step) called {how}({e.code!r}): "
            "nothing was checked; return instead of exiting\n"
        )
        raise typer.Exit(EXIT_ERROR) from None
    except BaseException as e:  # noqa: BLE001 (GeneratorExit and other bare BaseExceptions: the user's code raised it)
        sys.stderr.write(f"error: the user's code rngaudit ran raised {type(e).__name__}: {one_line(str(e))}\n")
        raise typer.Exit(EXIT_ERROR) from None


def _internal(e: BaseException) -> typer.Exit:
    """A bug of ours: said as one, briefly, with its own exit code."""
    if os.environ.get("RNGAUDIT_DEBUG"):
        traceback.print_exception(e)
    sys.stderr.write(
        f"error: internal error ({type(e).__name__}: {one_line(str(e))}); "
        "please report it with the spec (RNGAUDIT_DEBUG=1 shows details)\n"
    )
    return typer.Exit(EXIT_INTERNAL)


def finish(failing: bool, exit_zero: bool) -> None:
    """Exit 1 on findings, unless --exit-zero (the report is written already)."""
    if failing and not exit_zero:
        raise typer.Exit(EXIT_FINDINGS)
