"""Writing a command's report: to stdout, or atomically to --output only once the run has succeeded (no empty
or partial file, ever), in the format asked for."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable

from ..errors import OutputError
from ..output.formats import Report, formatter


def write_output(text: str, output: str | None, option: str = "--output") -> None:
    """Print the report, or write it to `output` only now that the run has succeeded."""
    write_stream((text,), output, option)


def _target(output: str, option: str) -> str:
    """The file `output` names (a symlink's file is replaced, not the link); not a directory."""
    if os.path.exists(output) and not os.path.isfile(output) and not os.path.isdir(output):
        return output  # (a device, a FIFO, /dev/stdout on a pipe: its link's text names no file)
    target = os.path.realpath(output)
    if os.path.isdir(target):
        raise OutputError(f"{option} {output}: is a directory")
    return target


def _special(target: str) -> bool:
    """A device, a FIFO, a terminal (/dev/null, /dev/stdout, a named pipe): written into, never replaced."""
    return os.path.exists(target) and not os.path.isfile(target)


def _temporary_beside(target: str, output: str, option: str) -> tuple[int, str]:
    """A new temporary file in the target's folder (which replaces the target once written)."""
    try:
        return tempfile.mkstemp(prefix=".rngaudit-", dir=os.path.dirname(target))
    except OSError as e:
        raise OutputError(f"{option} {output}: cannot write there ({e.strerror or e})") from None


def check_not_an_input(output: str | None, inputs: Iterable[str], option: str = "--output") -> None:
    """Refuse to write the report over a file the command reads (a spec replaced by its own report)."""
    if output is None or output == "-" or not os.path.isfile(output):
        return
    for name in inputs:
        try:
            if name == "-":  # (standard input redirected from the file: `derive - -o spec.yaml < spec.yaml`)
                same = os.path.samestat(os.fstat(0), os.stat(output))
                name = "on standard input"
            else:
                same = os.path.samefile(output, name)
        except (OSError, ValueError):
            continue
        if same:
            raise OutputError(f"{option} {output}: that is the input {name}; write the report to another file")


def check_writable(output: str, option: str) -> None:
    """Fail now (before anything is written) if `output` cannot be written."""
    target = _target(output, option)
    if _special(target):
        return
    fd, tmp = _temporary_beside(target, output, option)
    os.close(fd)
    os.unlink(tmp)


def write_stream(chunks: Iterable[str], output: str | None, option: str = "--output") -> None:
    """Write the report's chunks as they are made (flat memory): to stdout, or to a temporary file
    beside `output` that replaces it only once every chunk is written (no partial file, ever)."""
    if output is None or output == "-":
        try:
            for text in chunks:
                sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            # the reader stopped (`... | head`): that is its choice, not an error of ours; stop
            # writing, and keep Python's own flush at exit from failing again
            stdout_gone()
        except OSError as e:  # a full disk, /dev/full, an I/O error
            stdout_gone()
            raise OutputError(f"cannot write to standard output ({e.strerror or e})") from None
        return
    target = _target(output, option)
    if _special(target):
        f = None
        try:
            f = open(target, "w", encoding="utf-8")  # noqa: SIM115 (closed below, a broken pipe's too)
            for text in chunks:
                f.write(text)
            f.close()
        except BrokenPipeError:
            # the reader stopped (`-o /dev/stdout | head`, a FIFO's reader gone): its choice, as on stdout
            if f is not None:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
        except OSError as e:
            raise OutputError(f"{option} {output}: cannot write ({e.strerror or e})") from None
        return
    fd, tmp = _temporary_beside(target, output, option)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for text in chunks:
                f.write(text)
        # mkstemp creates 0600: give the report the permissions of the file it replaces, else those any new file
        # gets here
        try:
            mode = os.stat(target).st_mode & 0o7777
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{option} {output}: cannot write ({e.strerror or e})") from None
        raise


def stdout_gone() -> None:
    """Standard output cannot take more: point it at the null device, so that Python's own flush at exit does not
    fail again (with a traceback)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # (no stdout at all)
        pass


def emit(fmt: str, output: str | None, report: Report) -> None:
    """Render `report` in `fmt` (a Format value) and write it, now that the run has succeeded."""
    to_terminal = output is None and sys.stdout.isatty()
    write_output(formatter(fmt, to_terminal).render(report), output)
