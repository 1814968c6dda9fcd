"""The `rngaudit` typer app: its root options, the commands registered on it, and the console-script entry point
(only rngaudit/cli imports typer)."""

# (no `from __future__ import annotations`: see cli/derive.py)
import errno
import io
import sys

import typer
from typer.core import TyperCommand, TyperGroup

from .. import __version__
from ..errors import EXIT_ERROR, EXIT_OK
from . import collisions, derive, refactor, shard_check


class _Group(TyperGroup):
    """rngaudit's command group: a usage error click finds (an unknown option, a bad choice, a missing
    argument) is one `error:` line naming the command's --help, exit 2, as every other usage error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except Exception as e:
            # by class name: typer may vendor click (typer._click) or use click itself
            kinds = {c.__name__ for c in type(e).__mro__}
            if "NoArgsIsHelpError" in kinds:  # `rngaudit` alone: the help, as click shows it
                e.show()
                sys.exit(e.exit_code)
            if "UsageError" in kinds:
                ctx = getattr(e, "ctx", None)
                where = ctx.command_path if ctx is not None else (prog_name or "rngaudit")
                message = e.format_message()
                if len(message) > 1 and message[1].islower():
                    message = message[0].lower() + message[1:]
                sys.stderr.write(f"error: {message.rstrip('.')}; see '{where} --help'\n")
                sys.exit(EXIT_ERROR)
            if "ClickException" in kinds:
                e.show()
                sys.exit(e.exit_code)
            if "Abort" in kinds:
                sys.stderr.write("error: aborted\n")
                sys.exit(EXIT_ERROR)
            raise
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


app = typer.Typer(
    cls=_Group,
    name="rngaudit",
    help="See and check the PRNG keys Flax hands every make_rng call.\n\n"
    "Exit codes: 0 clean, 1 findings, 2 usage or input error, 3 internal error (a bug in rngaudit: please "
    "report it).",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"rngaudit {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """See and check the PRNG keys Flax hands every make_rng call."""


class _Command(TyperCommand):
    """A command whose usage line names a required argument plainly (`SPEC...`), as click and argparse do, not in
    typer's braces (`{SPEC...}`); optional ones keep their brackets."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


# (short help said whole in `rngaudit --help`: click would cut a docstring's first line with "...")
app.command(cls=_Command, short_help="Print the key every make_rng call receives, bit-exact with Flax.")(derive.derive)
app.command(cls=_Command, short_help="Find call sites that receive identical keys, say why and how to fix it.")(
    collisions.collisions
)
app.command("shard-check", cls=_Command, short_help="Check keys, draws and a (key, x) function on many devices.")(
    shard_check.shard_check
)
app.command(cls=_Command, short_help="Record every key a live Flax model hands out, and write its spec.")(
    refactor.capture
)
app.command(cls=_Command, short_help="Check a spec against a live model or a capture, key by key.")(refactor.verify)
app.command(cls=_Command, short_help="Which call sites keep, change, gain or lose their keys, and why.")(refactor.diff)


def main() -> None:
    """Console-script entry point."""
    import gc

    # main() starts the process: what is imported by now lives as long as it does. Frozen, the cyclic GC
    # stops traversing it at every collection the rest of the start triggers (about 10 ms of a 150 ms
    # start; benchmarks/bench_startup.py).
    gc.freeze()
    if sys.stdout is None:  # (started with stdout closed, `>&-`: a report to it is an error, one to -o is not)
        sys.stdout = _Closed()
    from .boundary import not_utf8

    for arg in sys.argv[1:]:
        shown = not_utf8(arg)  # (a file name of bytes that are not UTF-8: no report could show it)
        if shown is not None:
            sys.stderr.write(f"error: '{shown}' is not UTF-8 (a file name?); rename it or give it as UTF-8 text\n")
            sys.exit(EXIT_ERROR)
    try:
        app(prog_name="rngaudit")
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        if not isinstance(code, int):
            code = EXIT_ERROR
        # click reports usage errors with exit 2, which is ours for usage errors too
        try:  # (what is left of --help or --version)
            sys.stdout.flush()
        except OSError as flush_error:
            code = _stdout_failed(flush_error, code)
        sys.exit(code)
    except OSError as e:  # (outside a command's boundary only --help and --version write: to stdout)
        sys.exit(_stdout_failed(e, EXIT_ERROR))


class _Closed(io.TextIOBase):
    """Standard output when the process started without one: writing to it fails as writing to a closed file
    does."""

    def write(self, s: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")

    def isatty(self) -> bool:
        return False


def _stdout_failed(e: OSError, code: int) -> int:
    """Writing --help or --version failed: a reader that stopped (`| head`) keeps `code`; a full disk or a closed
    stdout is said as one line, exit 2."""
    from .writing import stdout_gone

    stdout_gone()
    if isinstance(e, BrokenPipeError):
        return code
    sys.stderr.write(f"error: cannot write to standard output ({e.strerror or e})\n")
    return EXIT_ERROR
