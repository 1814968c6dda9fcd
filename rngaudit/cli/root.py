"""The command line: options, exit codes, file output and the one error boundary (the only typer import)."""
# No `from __future__ import annotations` here: typer reads every option's annotation on every run, and a
# string annotation costs it an eval (about 5 ms of each start). Annotations must be valid at runtime.
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

from .. import __version__
from ..errors import Location, RngauditError, SpecError

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
    """Report formats every command takes: `text` for people, `json` (the command's versioned JSON),
    `github` (workflow annotations at each finding's spec line) and `sarif` (SARIF 2.1.0 for code scanning)."""

    text = "text"
    json = "json"
    github = "github"
    sarif = "sarif"


class Category(str, enum.Enum):
    """Kinds of `collisions` findings, as `--fail-on` names them."""

    concatenation = "concatenation"
    count_meets_name = "count_meets_name"
    hash_word = "hash_word"
    shared_seed = "shared_seed"
    unsplit_lanes = "unsplit_lanes"
    latent = "latent"


class DeriveFormat(str, enum.Enum):
    """derive's formats: every command's, and `jsonl` (one record a line, streamed in flat memory)."""

    text = "text"
    json = "json"
    github = "github"
    sarif = "sarif"
    jsonl = "jsonl"


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
    _write_stream((text,), output)


def _write_stream(chunks, output: Optional[str]) -> None:
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
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return
    target = os.path.realpath(output)  # a symlink's file is replaced, not the link
    if os.path.isdir(target):
        raise SpecError(f"--output {output}: is a directory")
    if os.path.exists(target) and not os.path.isfile(target):
        # a device, a FIFO, a terminal (/dev/null, /dev/stdout, a named pipe): write into it, never
        # replace it
        try:
            with open(target, "w", encoding="utf-8") as f:
                for text in chunks:
                    f.write(text)
        except OSError as e:
            raise SpecError(f"--output {output}: cannot write ({e.strerror or e})") from None
        return
    directory = os.path.dirname(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".rngaudit-", dir=directory)
    except OSError as e:
        raise SpecError(f"--output {output}: cannot write there ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for text in chunks:
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
    from ..spec.draws import parse_draw
    from ..spec.yaml_source import YNode

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

    from ..spec.budget import MAX_DRAWN_VALUES, budget

    keys, drawn, _ = budget(spec.model)
    total = drawn + keys * math.prod(default_draw.shape)
    if total > MAX_DRAWN_VALUES:
        raise SpecError(f"--draw {text!r} draws up to {total} values over up to {keys} keys; rngaudit draws "
                        f"at most {MAX_DRAWN_VALUES}: draw a smaller shape, or use --no-values",
                        Location("--draw", 1, 1))


def _run(fn, spec_limits: tuple[Optional[int], Optional[int]] = (None, None)) -> None:
    """The error boundary: our errors print one line and exit 2; nothing leaks a traceback.
    `spec_limits` is (--max-spec-mib, --max-yaml-nodes): specs load under those limits (None: default)."""
    from ..spec.yaml_source import limits

    mib, nodes = spec_limits
    try:
        with limits(None if mib is None else mib * 1024 * 1024, nodes):
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


# ---------------------------------------------------------------- shared by every command
# How a command uses the CI machinery (formats, --exit-zero, [tool.rngaudit] defaults):
#   1. take `ctx: typer.Context`, `fmt: Format = typer.Option(Format.text, "--format", "-f", ...)`, `output`,
#      `exit_zero: bool = _EXIT_ZERO` and `config: Optional[str] = _CONFIG` options (and, if it reads specs,
#      `max_spec_mib = _MAX_SPEC_MIB`, `max_yaml_nodes = _MAX_YAML_NODES`, passed on as
#      `_run(go, spec_limits=(max_spec_mib, max_yaml_nodes))`);
#   2. first thing in the command body, `a, b, ... = _configured(ctx, "NAME", config, a=a, b=b, ...)` with every
#      option pyproject.toml may set (keys are the long option names: `--latent-max-count` is
#      `latent-max-count`); flags given on the command line win;
#   3. inside `go()`, `_emit(fmt, output, "NAME", json_doc=..., render=..., findings=..., rules=...)`, where
#      `findings()` lists the run's findings as `findings.Finding`s (with spec locations), then
#      `_finish(failing, exit_zero)`.
_EXIT_ZERO = typer.Option(False, "--exit-zero/--no-exit-zero",
                          help="Report findings but exit 0 (errors still exit 2).")
_CONFIG = typer.Option(None, "--config", metavar="FILE",
                       help="Read [tool.rngaudit] defaults from FILE instead of the pyproject.toml found from the "
                       "current directory.")
_MAX_SPEC_MIB = typer.Option(None, "--max-spec-mib", min=1, metavar="MIB",
                             help="Accept spec files up to this many MiB (default 16).")
_MAX_YAML_NODES = typer.Option(None, "--max-yaml-nodes", min=1, metavar="N",
                               help="Accept specs of up to N YAML nodes, aliases expanded (default 1000000).")
_NOT_CONFIGURABLE = {"output", "config"}  # per-run choices, never defaults


def _config_key(param) -> str | None:
    if getattr(param, "param_type_name", None) != "option" or param.name in _NOT_CONFIGURABLE:
        return None
    return next((o[2:] for o in param.opts if o.startswith("--")), None)


def _config_keys(command) -> dict:
    return {k: p for p in command.params if (k := _config_key(p)) is not None}


def _did_you_mean(word: str, choices) -> str:
    import difflib

    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_config(cfg, commands: dict) -> None:
    """Every key of [tool.rngaudit] must be an option of some command (of its section's command)."""
    from ..errors import ConfigError

    keys = {name: _config_keys(c) for name, c in commands.items()}
    every = set().union(*keys.values())
    for section, settings in cfg.sections.items():
        if section not in commands:
            raise ConfigError(f"[tool.rngaudit.{section}]: no command is called {section!r}"
                              f"{_did_you_mean(section, commands)} (sections are named after commands: "
                              f"{', '.join(sorted(commands))})", cfg.section_locations[section])
        for key, s in settings.items():
            if key not in keys[section]:
                raise ConfigError(f"[{s.table}]: unknown key {key!r}{_did_you_mean(key, keys[section])} "
                                  f"(`rngaudit {section} --help` lists the options)", s.location)
    for key, s in cfg.common.items():
        if key not in every:
            raise ConfigError(f"[{s.table}]: unknown key {key!r}{_did_you_mean(key, every | set(commands))}",
                              s.location)


_TOML_TYPE = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string"}
_TOML_TYPES = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _config_value(ctx: typer.Context, param, hint, s):
    """The TOML value as the command line would have given it, type-checked against the option."""
    from ..errors import ConfigError

    kind = param.type.name  # boolean, int (integer), int range, float, float range, choice, str (text)
    if param.is_flag or kind == "boolean":
        want = bool
    elif kind.startswith("int"):
        want = int
    elif kind.startswith("float"):
        want = float
    else:
        want = str

    def typed(v) -> bool:
        if want is float:
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        return isinstance(v, want) and (want is bool or not isinstance(v, bool))

    value = s.value
    if param.multiple:
        if not isinstance(value, list) or not all(typed(v) for v in value):
            raise ConfigError(f"[{s.table}] {s.key}: must be a list of {_TOML_TYPES[want]}, e.g. "
                              f"{s.key} = [...]", s.location)
    elif not typed(value):
        raise ConfigError(f"[{s.table}] {s.key}: must be {_TOML_TYPE[want]}, not {type(value).__name__} "
                          f"{value!r}", s.location)
    try:
        value = param.type_cast_value(ctx, value)
    except typer.BadParameter as e:
        raise ConfigError(f"[{s.table}] {s.key}: {e.message}", s.location) from None
    # typer converts choices to the Enum of the parameter's annotation, and repeated options to lists
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) else []
    base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    item = typing.get_args(base)[0] if typing.get_origin(base) is list else None
    if item is not None:
        return [item(v) if isinstance(item, type) and issubclass(item, enum.Enum) else v for v in value]
    if isinstance(base, type) and issubclass(base, enum.Enum) and value is not None:
        return base(value)
    return value


def _configured(ctx: typer.Context, command: str, config: Optional[str], **values):
    """`values` (the command's options, by parameter name) with [tool.rngaudit] defaults filled in where the
    command line did not give the option; returned in the order given. A bad configuration exits 2."""
    import inspect
    import typing

    from . import config as configuration

    try:
        cfg = configuration.discover(config)
        commands = dict(getattr(ctx.find_root().command, "commands", None) or {ctx.info_name: ctx.command})
        _check_config(cfg, commands)
        by_key = _config_keys(ctx.command)
        hints = typing.get_type_hints(inspect.unwrap(ctx.command.callback))
        for key, s in cfg.for_command(command).items():
            param = by_key.get(key)
            if param is None:  # a common key for another command's option
                continue
            if param.name not in values:
                from ..errors import ConfigError

                raise ConfigError(f"[{s.table}] {key}: `rngaudit {command}` takes --{key} only on the command "
                                  "line", s.location)
            if ctx.get_parameter_source(param.name).name in ("DEFAULT", "DEFAULT_MAP"):
                values[param.name] = _config_value(ctx, param, hints.get(param.name), s)
    except RngauditError as e:
        _fail(e)
    out = tuple(values.values())
    return out if len(out) != 1 else out[0]


def _emit(fmt, output: Optional[str], command: str, *, json_doc, render, findings, rules) -> None:
    """Render the report in `fmt` (a Format, or any enum with those values) and write it, now that the run
    succeeded. `json_doc()` is the command's JSON, `render(console)` prints text, `findings()` lists the
    findings for `github` and `sarif`."""
    kind = getattr(fmt, "value", fmt)
    if kind == "json":
        text = json.dumps(json_doc(), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    elif kind == "github":
        from ..output.github import render_github

        text = render_github(findings())
    elif kind == "sarif":
        from ..output.sarif import to_sarif

        text = json.dumps(to_sarif(command, findings(), rules), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    elif kind == "text":
        text = _console_text(render, output=output)
    else:
        raise ValueError(f"no renderer for format {kind!r}")
    _write_output(text, output)


def _finish(failing: bool, exit_zero: bool) -> None:
    """Exit 1 on findings, unless --exit-zero (the report is written already)."""
    if failing and not exit_zero:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def derive(
    ctx: typer.Context,
    spec: str = typer.Argument(..., metavar="SPEC", help="The model spec (YAML, format version 1)."),
    fmt: DeriveFormat = typer.Option(DeriveFormat.text, "--format", "-f",
                                     help="Output format; jsonl streams one record per call site."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the report here (only if the run succeeds)."),
    phase: Optional[Phase] = typer.Option(None, "--phase", help="Override the spec's phase."),
    draw: Optional[str] = typer.Option(None, "--draw", metavar="KIND:SHAPE",
                                       help="Draw values from every key without a `draw:`, "
                                       "e.g. normal:2,2 or uniform:3."),
    values: bool = typer.Option(True, "--values/--no-values",
                                help="Compute the values of `draw`s (needs JAX)."),
    strict: bool = typer.Option(False, "--strict/--no-strict",
                                help="Exit 1 when any key has a note (e.g. a fallback to 'params')."),
    stream: Optional[list[str]] = typer.Option(None, "--stream", metavar="S",
                                               help="Only call sites of this stream (requested or used); "
                                               "repeatable. Filters apply before keys are computed."),
    path: Optional[list[str]] = typer.Option(None, "--path", metavar="GLOB",
                                             help="Only call sites whose module path ('/'-joined, '(root)' "
                                             "for the root) matches this glob; repeatable."),
    limit: Optional[int] = typer.Option(None, "--limit", min=0, metavar="N",
                                        help="Only the first N call sites (after --stream and --path)."),
    engine: str = typer.Option("fast", "--engine", hidden=True,
                               help="fast (columns, vectorised keys) or plain (the reference path)."),
    exit_zero: bool = _EXIT_ZERO,
    max_spec_mib: Optional[int] = _MAX_SPEC_MIB,
    max_yaml_nodes: Optional[int] = _MAX_YAML_NODES,
    config: Optional[str] = _CONFIG,
) -> None:
    """Print the key every make_rng call receives, exactly as Flax derives it."""
    fmt, phase, draw, values, strict, exit_zero, max_spec_mib, max_yaml_nodes = _configured(
        ctx, "derive", config, fmt=fmt, phase=phase, draw=draw, values=values, strict=strict, exit_zero=exit_zero,
        max_spec_mib=max_spec_mib, max_yaml_nodes=max_yaml_nodes)

    def go():
        from ..engine.derive import derive as run_derive
        from ..output.derive_json import to_json
        from ..output.findings import DERIVE_RULES, derive_findings
        from ..spec.parse import load_spec

        s = load_spec(spec)
        if phase is not None and phase.value != s.phase:
            s = dataclasses.replace(s, phase=phase.value, mutable=phase.value == "init")
        default_draw = _parse_draw(draw) if draw else None
        if default_draw is not None and values:
            _check_draw_budget(s, default_draw, draw)
        if engine not in ("fast", "plain"):
            raise SpecError(f"--engine {engine!r}: use fast or plain", Location("--engine", 1, 1))
        if engine == "plain" and (stream or path or limit is not None):
            raise SpecError("--stream, --path and --limit need --engine fast", Location("--engine", 1, 1))
        from ..output.progress import progress

        with progress(None, f"replaying {os.path.basename(spec)}"):
            report = run_derive(s, values=values, default_draw=default_draw, engine=engine,
                                streams=tuple(stream or ()), paths=tuple(path or ()), limit=limit)

        if getattr(fmt, "value", fmt) == "jsonl":
            from ..output.derive_json import jsonl_lines

            with progress(len(report.calls), "writing") as advance:
                _write_stream(jsonl_lines(report, advance), output)
            _finish(strict and report.fallbacks > 0, exit_zero)
            return

        def render(console):
            from ..output.text_derive import render_derive

            render_derive(report, console)

        _emit(fmt, output, "derive", json_doc=lambda: to_json(report), render=render,
              findings=lambda: derive_findings(report, strict), rules=DERIVE_RULES)
        _finish(strict and report.fallbacks > 0, exit_zero)

    _run(go, spec_limits=(max_spec_mib, max_yaml_nodes))


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
    ctx: typer.Context,
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
    strict: bool = typer.Option(False, "--strict/--no-strict",
                                help="Exit 1 on information and latent findings too."),
    fail_on: Optional[list[Category]] = typer.Option(
        None, "--fail-on", metavar="CATEGORY",
        help="Exit 1 only on findings of these categories; repeatable (default: concatenation, count_meets_name, "
        "hash_word, shared_seed; --strict: all, with unsplit_lanes and latent)."),
    exit_zero: bool = _EXIT_ZERO,
    max_spec_mib: Optional[int] = _MAX_SPEC_MIB,
    max_yaml_nodes: Optional[int] = _MAX_YAML_NODES,
    config: Optional[str] = _CONFIG,
) -> None:
    """Find call sites that receive identical keys, say why, and check the fixes."""
    fmt, phase, keys, separator, latent_max_count, strict, fail_on, exit_zero, max_spec_mib, max_yaml_nodes = (
        _configured(
        ctx, "collisions", config, fmt=fmt, phase=phase, keys=keys, separator=separator,
        latent_max_count=latent_max_count, strict=strict, fail_on=fail_on, exit_zero=exit_zero,
        max_spec_mib=max_spec_mib, max_yaml_nodes=max_yaml_nodes))

    def go():
        from ..collision.audit import audit
        from ..collision.latent import DEFAULT_LATENT_MAX_COUNT
        from ..collision.module_paths import ModuleSites, is_spec
        from ..collision.spec_sites import spec_sites
        from ..output.collisions_json import to_json
        from ..output.findings import (
            COLLISION_RULES,
            collision_findings,
            collisions_failing,
            fail_categories,
        )
        from ..output.progress import progress
        from ..spec.json_source import load_json
        from ..spec.parse import load_spec

        bound = DEFAULT_LATENT_MAX_COUNT if latent_max_count is None else latent_max_count
        audits = []
        with progress(len(inputs), "collisions") as advance:
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
                    sites = spec_sites(s, keys=keys)
                audits.append(audit(sites, bound))
                advance(1)
        failing = fail_categories(strict, [c.value for c in fail_on] if fail_on is not None else None)

        def render(console):
            from ..output.text_collisions import render_collisions

            render_collisions(audits, console)

        _emit(fmt, output, "collisions", json_doc=lambda: to_json(audits), render=render,
              findings=lambda: collision_findings(audits, failing), rules=COLLISION_RULES)
        _finish(collisions_failing(audits, failing), exit_zero)

    _run(go, spec_limits=(max_spec_mib, max_yaml_nodes))


@app.command("shard-check")
def shard_check(
    ctx: typer.Context,
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
    allow_replicated: bool = typer.Option(False, "--allow-replicated/--no-allow-replicated",
                                          help="Identical randomness on every device from one key is intended: "
                                          "report it, but do not exit 1."),
    atol: Optional[float] = typer.Option(None, "--atol",
                                         help="Accept jit/eager differences up to this (default 0: bit for bit)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", metavar="SECONDS",
                                            help="Give up on the device process after this long (default 300)."),
    fmt: Format = typer.Option(Format.text, "--format", "-f", help="Output format."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the report here (only if the run succeeds)."),
    exit_zero: bool = _EXIT_ZERO,
    max_spec_mib: Optional[int] = _MAX_SPEC_MIB,
    max_yaml_nodes: Optional[int] = _MAX_YAML_NODES,
    config: Optional[str] = _CONFIG,
) -> None:
    """Check keys, draws and a (key, x) function on many devices: sharded runs must equal one-device runs."""
    (fn, devices, platform, mesh, path, stream, phase, draw, shape, input_kind, seed, key, allow_replicated, atol,
     timeout, fmt, exit_zero, max_spec_mib, max_yaml_nodes) = _configured(
        ctx, "shard-check", config, fn=fn, devices=devices, platform=platform, mesh=mesh, path=path, stream=stream,
        phase=phase, draw=draw, shape=shape, input_kind=input_kind, seed=seed, key=key,
        allow_replicated=allow_replicated, atol=atol, timeout=timeout, fmt=fmt, exit_zero=exit_zero,
        max_spec_mib=max_spec_mib, max_yaml_nodes=max_yaml_nodes)

    def go():
        from ..output.findings import SHARD_CHECK_RULES, shard_findings
        from ..output.progress import progress
        from ..shard.report import to_json
        from ..shard.request import SpecTarget, make_request, parse_fn_target
        from ..shard.runner import run as run_shard
        from ..spec.parse import load_spec
        from ..spec.yaml_source import current_limits

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
        request = dataclasses.replace(request, spec_limits=(current_limits().max_bytes, current_limits().max_nodes))
        with progress(None, "shard-check: running on the devices"):
            report = run_shard(request)

        def render(console):
            from ..output.text_shard import render_shard

            render_shard(report, console)

        _emit(fmt, output, "shard-check", json_doc=lambda: to_json(report), render=render,
              findings=lambda: shard_findings(report), rules=SHARD_CHECK_RULES)
        _finish(report.failing, exit_zero)

    _run(go, spec_limits=(max_spec_mib, max_yaml_nodes))


from . import refactor  # noqa: E402,F401 - registers capture, verify and diff


def main() -> None:
    """Console-script entry point."""
    import gc

    # main() starts the process: what is imported by now lives as long as it does. Frozen, the cyclic GC
    # stops traversing it at every collection the rest of the start triggers (about 10 ms of a 150 ms
    # start; benchmarks/bench_startup.py).
    gc.freeze()
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
