"""The command line: options, exit codes, file output and the one error boundary (the only typer import)."""
from __future__ import annotations

import dataclasses
import enum
import io
import json
import os
import sys
import tempfile
import traceback
from typing import Optional

import typer

from . import __version__
from .errors import Location, RngauditError, SpecError

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2

app = typer.Typer(
    name="rngaudit",
    help="See and check the PRNG keys Flax hands every make_rng call.\n\n"
    "Exit codes: 0 clean, 1 findings, 2 usage or input error.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class Format(str, enum.Enum):
    text = "text"
    json = "json"


class Phase(str, enum.Enum):
    init = "init"
    apply = "apply"


def _version(value: bool) -> None:
    if value:
        print(f"rngaudit {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """See and check the PRNG keys Flax hands every make_rng call."""


def _one_line(text: str) -> str:
    """Error output is one line, whatever names or values a message quotes."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _fail(err: RngauditError) -> None:
    sys.stderr.write(f"error: {_one_line(str(err))}\n")
    raise typer.Exit(EXIT_ERROR)


def _write_output(text: str, output: Optional[str]) -> None:
    """Print the report, or write it to `output` only now that the run has succeeded."""
    if output is None or output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = os.path.abspath(output)
    if os.path.isdir(target):
        raise SpecError(f"--output {output}: is a directory")
    directory = os.path.dirname(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".rngaudit-", dir=directory)
    except OSError as e:
        raise SpecError(f"--output {output}: cannot write there ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        # mkstemp creates 0600; give the report the permissions any new file gets here
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise SpecError(f"--output {output}: cannot write ({e.strerror or e})") from None
        raise


def _parse_draw(text: str):
    """`--draw normal:2,2` -> a Draw."""
    from .spec import parse_draw
    from .yamlsrc import YNode

    loc = Location("--draw", 1, 1)
    kind, _, shape = text.partition(":")
    try:
        dims = [int(s) for s in shape.split(",") if s.strip()] if shape.strip() else []
    except ValueError:
        raise SpecError(f"--draw {text!r}: the shape must be integers, e.g. normal:2,2", loc) from None
    node = YNode({kind: YNode([YNode(d, loc) for d in dims], loc)}, loc, {kind: loc})
    return parse_draw(node, "--draw")


def _check_draw_budget(spec, default_draw, text: str) -> None:
    """--draw applies to every key: refuse it up front when that is too many values."""
    import math

    from .spec import MAX_DRAWN_VALUES, budget

    keys, drawn, _ = budget(spec.model)
    total = drawn + keys * math.prod(default_draw.shape)
    if total > MAX_DRAWN_VALUES:
        raise SpecError(f"--draw {text!r} draws up to {total} values over up to {keys} keys; rngaudit draws "
                        f"at most {MAX_DRAWN_VALUES}: draw a smaller shape, or use --no-values",
                        Location("--draw", 1, 1))


def _run(fn) -> None:
    """The error boundary: our errors print one line and exit 2; nothing leaks a traceback."""
    try:
        fn()
    except typer.Exit:
        raise
    except RngauditError as e:
        _fail(e)
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise typer.Exit(EXIT_ERROR)
    except RecursionError:
        sys.stderr.write("error: the spec nests too deeply to replay\n")
        raise typer.Exit(EXIT_ERROR)
    except MemoryError:
        sys.stderr.write("error: out of memory; the spec asks for too many keys or values\n")
        raise typer.Exit(EXIT_ERROR)
    except Exception as e:  # a bug of ours: say so, briefly, and still exit 2
        if os.environ.get("RNGAUDIT_DEBUG"):
            traceback.print_exc()
        sys.stderr.write(f"error: internal error ({type(e).__name__}: {_one_line(str(e))}); "
                         "please report it with the spec (RNGAUDIT_DEBUG=1 shows details)\n")
        raise typer.Exit(EXIT_ERROR)


@app.command()
def derive(
    spec: str = typer.Argument(..., metavar="SPEC", help="The model spec (YAML, format version 1)."),
    fmt: Format = typer.Option(Format.text, "--format", "-f", help="Output format."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the report here (only if the run succeeds)."),
    phase: Optional[Phase] = typer.Option(None, "--phase", help="Override the spec's phase."),
    draw: Optional[str] = typer.Option(None, "--draw", metavar="KIND:SHAPE",
                                       help="Draw values from every key without a `draw:`, "
                                       "e.g. normal:2,2 or uniform:3."),
    values: bool = typer.Option(True, "--values/--no-values",
                                help="Compute the values of `draw`s (needs JAX)."),
    strict: bool = typer.Option(False, "--strict",
                                help="Exit 1 when any key has a note (e.g. a fallback to 'params')."),
) -> None:
    """Print the key every make_rng call receives, exactly as Flax derives it."""

    def go():
        from .report import derive as run_derive
        from .report import to_json
        from .spec import load_spec

        s = load_spec(spec)
        if phase is not None and phase.value != s.phase:
            s = dataclasses.replace(s, phase=phase.value, mutable=phase.value == "init")
        default_draw = _parse_draw(draw) if draw else None
        if default_draw is not None and values:
            _check_draw_budget(s, default_draw, draw)
        report = run_derive(s, values=values, default_draw=default_draw)
        if fmt is Format.json:
            text = json.dumps(to_json(report), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
        else:
            from rich.console import Console

            from .render import render_derive

            buf = io.StringIO()
            tty = output is None and sys.stdout.isatty()
            console = Console(file=buf, force_terminal=tty, no_color=not tty or "NO_COLOR" in os.environ,
                              width=None if tty else 400, highlight=False, soft_wrap=not tty)
            render_derive(report, console)
            text = buf.getvalue()
        _write_output(text, output)
        if strict and report.fallbacks:
            raise typer.Exit(EXIT_FINDINGS)

    _run(go)


def _console_text(render, *args, output: Optional[str]) -> str:
    """What a rich renderer prints, as text: coloured only on a terminal."""
    from rich.console import Console

    buf = io.StringIO()
    tty = output is None and sys.stdout.isatty()
    console = Console(file=buf, force_terminal=tty, no_color=not tty or "NO_COLOR" in os.environ,
                      width=None if tty else 400, highlight=False, soft_wrap=not tty)
    render(*args, console)
    return buf.getvalue()


@app.command()
def collisions(
    inputs: list[str] = typer.Argument(..., metavar="SPEC...",
                                       help="Model specs (YAML), or JSON files (*.json) of module paths or a "
                                       "params tree."),
    fmt: Format = typer.Option(Format.text, "--format", "-f", help="Output format."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the report here (only if the run succeeds)."),
    phase: Optional[Phase] = typer.Option(None, "--phase", help="Override the specs' phase."),
    keys: bool = typer.Option(True, "--keys/--no-keys",
                              help="Compute key data to find keys shared across streams (class 4). "
                              "--no-keys checks hash inputs and words only (never imports JAX)."),
    separator: Optional[bool] = typer.Option(None, "--fix-rng-separator/--no-fix-rng-separator",
                                             help="The model's flax_fix_rng_separator: overrides a spec's; "
                                             "for JSON inputs the default is off."),
    latent_max_count: Optional[int] = typer.Option(None, "--latent-max-count", min=0, metavar="N",
                                                   help="Report latent pairs whose smaller colliding count is "
                                                   "at most N (default 65535; 0: no latent pairs)."),
    strict: bool = typer.Option(False, "--strict",
                                help="Exit 1 on information and latent findings too."),
) -> None:
    """Find call sites that receive identical keys, say why, and check the fixes."""

    def go():
        from .collisions import DEFAULT_LATENT_MAX_COUNT, SpecSites, audit
        from .collisions_report import to_json
        from .jsonsrc import load_json
        from .modpaths import ModuleSites, is_spec
        from .spec import load_spec

        bound = DEFAULT_LATENT_MAX_COUNT if latent_max_count is None else latent_max_count
        audits = []
        for path in inputs:
            doc = load_json(path) if path.lower().endswith(".json") else None
            if doc is not None and not is_spec(doc.value):
                sites = ModuleSites(doc, bool(separator))
            else:
                s = load_spec(path)
                if phase is not None and phase.value != s.phase:
                    s = dataclasses.replace(s, phase=phase.value, mutable=phase.value == "init")
                if separator is not None:
                    s = dataclasses.replace(s, fix_rng_separator=separator)
                sites = SpecSites(s, keys=keys)
            audits.append(audit(sites, bound))
        if fmt is Format.json:
            text = json.dumps(to_json(audits), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
        else:
            from .render_collisions import render_collisions

            text = _console_text(render_collisions, audits, output=output)
        _write_output(text, output)
        failing = sum(a.failing for a in audits)
        info = sum(a.info + len(a.latent) for a in audits)
        if failing or (strict and info):
            raise typer.Exit(EXIT_FINDINGS)

    _run(go)


@app.command("shard-check")
def shard_check(
    specs: Optional[list[str]] = typer.Argument(None, metavar="SPEC",
                                                help="Model specs (YAML) whose keys and draws are re-derived on the "
                                                "devices and compared with the host derivation."),
    fn: Optional[list[str]] = typer.Option(None, "--fn", metavar="FILE.py:FUNC",
                                           help="A function (key, x) -> y (FILE.py:NAME or package.module:NAME) "
                                           "run eagerly, under jax.jit and under shard_map; repeatable."),
    devices: Optional[int] = typer.Option(None, "--devices", metavar="N",
                                          help="Force N CPU devices (in a fresh process). Default: the real "
                                          "devices of --platform."),
    platform: Optional[str] = typer.Option(None, "--platform", metavar="cpu|gpu|tpu",
                                           help="Use this platform's devices (default: JAX's default backend)."),
    mesh: Optional[str] = typer.Option(None, "--mesh", metavar="AXIS=N,...",
                                       help="Mesh shape, e.g. data=4,model=2 (default: data=<device count>)."),
    path: Optional[list[str]] = typer.Option(None, "--path", metavar="GLOB",
                                             help="Check only keys whose module path matches (e.g. 'Dense_*'); "
                                             "repeatable."),
    stream: Optional[list[str]] = typer.Option(None, "--stream", metavar="S",
                                               help="Check only keys of this stream; repeatable."),
    phase: Optional[Phase] = typer.Option(None, "--phase", help="Override the specs' phase."),
    draw: Optional[str] = typer.Option(None, "--draw", metavar="KIND:SHAPE",
                                       help="Draw values from every key without a `draw:`, e.g. normal:8,1."),
    shape: Optional[str] = typer.Option(None, "--shape", metavar="N,...",
                                        help="Shape of x for --fn; the first axis is the batch (default: "
                                        "<device count>,1)."),
    input_kind: Optional[str] = typer.Option(None, "--input", metavar="ones|normal",
                                             help="x for --fn: ones (default) or a normal sample seeded by --seed."),
    seed: Optional[int] = typer.Option(None, "--seed",
                                       help="Seed of the key for --fn, jax.random.key(SEED), and of x with --input "
                                       "normal (default 0)."),
    key: Optional[str] = typer.Option(None, "--key", metavar="EXPR",
                                      help="The key for --fn as a key expression instead, e.g. 'split(key(0))[1]'."),
    allow_replicated: bool = typer.Option(False, "--allow-replicated",
                                          help="Identical randomness on every device from one key is intended: "
                                          "report it, but do not exit 1."),
    atol: Optional[float] = typer.Option(None, "--atol",
                                         help="Accept jit/eager differences up to this (default 0: bit for bit)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", metavar="SECONDS",
                                            help="Give up on the device process after this long (default 300)."),
    fmt: Format = typer.Option(Format.text, "--format", "-f", help="Output format."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the report here (only if the run succeeds)."),
) -> None:
    """Check keys, draws and a (key, x) function on many devices: sharded runs must equal one-device runs."""

    def go():
        from .shard import SpecTarget, make_request, parse_fn_target
        from .shard import run as run_shard
        from .shard_report import to_json
        from .spec import load_spec

        if not specs:
            given = [o for o, v in (("--path", path), ("--stream", stream), ("--phase", phase), ("--draw", draw)) if v]
            if given:
                raise SpecError(f"{given[0]} applies to a SPEC, and no SPEC is given")
        fns = [parse_fn_target(f) for f in fn or ()]
        default_draw = _parse_draw(draw) if draw else None
        targets = []
        for p in specs or ():
            s = load_spec(p)
            if phase is not None and phase.value != s.phase:
                s = dataclasses.replace(s, phase=phase.value, mutable=phase.value == "init")
            if default_draw is not None:
                _check_draw_budget(s, default_draw, draw)
            targets.append(SpecTarget(p, phase.value if phase else None, tuple(path or ()), tuple(stream or ()),
                                      default_draw))
        request = make_request(specs=targets, fns=fns, devices=devices, platform=platform, mesh=mesh, shape=shape,
                               fill=input_kind, seed=seed, key=key, allow_replicated=allow_replicated, atol=atol,
                               timeout=timeout)
        report = run_shard(request)
        if fmt is Format.json:
            text = json.dumps(to_json(report), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
        else:
            from .render_shard import render_shard

            text = _console_text(render_shard, report, output=output)
        _write_output(text, output)
        if report.failing:
            raise typer.Exit(EXIT_FINDINGS)

    _run(go)


def main() -> None:
    """Console-script entry point."""
    try:
        app(prog_name="rngaudit")
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        if not isinstance(code, int):
            code = EXIT_ERROR
        # click reports usage errors with exit 2, which is ours for usage errors too
        sys.exit(code)
