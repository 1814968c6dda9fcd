"""`rngaudit derive`: print the key every make_rng call receives, exactly as Flax derives it."""

# No `from __future__ import annotations` in cli/: typer reads every option's annotation on every run, and a
# string annotation costs it an eval (about 5 ms of each start). Annotations must be valid at runtime.
import os
import sys
from contextlib import nullcontext
from typing import NamedTuple

import typer

from .options import CONFIG, EXIT_ZERO, MAX_SPEC_MIB, MAX_YAML_NODES, OUTPUT, STDIN_FILENAME, DeriveFormat, Phase

DEFAULT_MAX_ROWS = 1000  # a longer text report lists these, then counts (jsonl and json carry every row)


class DeriveOptions(NamedTuple):
    """derive's options that [tool.rngaudit] may set."""

    fmt: DeriveFormat
    phase: Phase | None
    draw: str | None
    values: bool
    strict: bool
    exit_zero: bool
    max_spec_mib: int | None
    max_yaml_nodes: int | None
    stream: list[str] | None
    path: list[str] | None
    limit: int | None
    wide: bool
    columns: str | None
    max_rows: int


def derive(
    ctx: typer.Context,
    spec: str = typer.Argument(
        ..., metavar="SPEC", help="The model spec (YAML, format version 1), or - to read it from standard input."
    ),
    fmt: DeriveFormat = typer.Option(
        DeriveFormat.text,
        "--format",
        "-f",
        metavar="text|json|github|sarif|jsonl",
        help="Output format; jsonl streams one record per call site.",
    ),
    output: str | None = OUTPUT,
    phase: Phase | None = typer.Option(None, "--phase", metavar="init|apply", help="Override the spec's phase."),
    draw: str | None = typer.Option(
        None,
        "--draw",
        metavar="KIND:SHAPE",
        help="Draw values from every key without a `draw:`, e.g. normal:2,2 or uniform:3.",
    ),
    values: bool = typer.Option(True, "--values/--no-values", help="Compute the values of `draw`s (needs JAX)."),
    strict: bool = typer.Option(False, "--strict/--no-strict", help="Exit 1 when any stream falls back to 'params'."),
    stream: list[str] | None = typer.Option(
        None,
        "--stream",
        metavar="S",
        help="Only call sites of this stream (requested or used); repeatable. Filters apply before keys are computed.",
    ),
    path: list[str] | None = typer.Option(
        None,
        "--path",
        metavar="GLOB",
        help="Only call sites whose module path ('/'-joined, '(root)' for the root) matches this glob; repeatable.",
    ),
    limit: int | None = typer.Option(
        None, "--limit", min=0, metavar="N", help="Only the first N call sites (after --stream and --path)."
    ),
    engine: str = typer.Option(
        "fast", "--engine", hidden=True, help="fast (columns, vectorised keys) or plain (the reference path)."
    ),
    exit_zero: bool = EXIT_ZERO,
    max_spec_mib: int | None = MAX_SPEC_MIB,
    max_yaml_nodes: int | None = MAX_YAML_NODES,
    stdin_filename: str | None = STDIN_FILENAME,
    wide: bool = typer.Option(
        False,
        "--wide/--no-wide",
        help="Text: every column, however wide the terminal (by default a narrow terminal leaves out bytes, hash "
        "input, word and label, never the key).",
    ),
    columns: str | None = typer.Option(
        None,
        "--columns",
        parser=lambda text: ",".join(_columns(text)),
        metavar="LIST",
        help="Text: the columns to show, comma-separated, from path, lane, stream, count, label, hash-input, bytes, "
        "word, key (# always); NNX: step, site (or path), stream, count, key, chain.",
    ),
    max_rows: int = typer.Option(
        DEFAULT_MAX_ROWS,
        "--max-rows",
        min=0,
        metavar="N",
        help="Text: list the first N call sites, then how many more per stream and module (0: every row).",
    ),
    config: str | None = CONFIG,
) -> None:
    """Print the key every make_rng call receives, exactly as Flax derives it."""
    given = DeriveOptions(
        fmt,
        phase,
        draw,
        values,
        strict,
        exit_zero,
        max_spec_mib,
        max_yaml_nodes,
        stream,
        path,
        limit,
        wide,
        columns,
        max_rows,
    )

    def go() -> None:
        from .. import api
        from ..output.derive_json import jsonl_lines, to_json
        from ..output.formats import Report
        from ..output.progress import progress
        from .boundary import finish, spec_limits, values_on_the_cpu
        from .defaults import configured
        from .inputs import STDIN, stdin_spec
        from .writing import check_not_an_input, emit, write_stream

        values_on_the_cpu()
        check_not_an_input(output, (spec,))

        o = configured(ctx, "derive", config, given)
        with spec_limits(o.max_spec_mib, o.max_yaml_nodes), progress(None, f"replaying {os.path.basename(spec)}"):
            source = stdin_spec(stdin_filename) if spec == STDIN else spec
            report = api.derive(
                source,
                phase=o.phase.value if o.phase else None,
                values=o.values,
                draw=o.draw,
                streams=tuple(o.stream or ()),
                paths=tuple(o.path or ()),
                limit=o.limit,
                engine=engine,
                # (the text report lists its first rows: only theirs are hashed, keyed and drawn)
                keyed=o.max_rows if o.fmt is DeriveFormat.text and o.max_rows else None,
            )
        picked = _columns(o.columns) if o.columns else None
        if picked and o.fmt is DeriveFormat.text:  # (columns are the text report's; other formats carry them all)
            _columns_of_flavour(picked, getattr(report.spec, "flavour", "linen"))
        for warning in report.unmatched:  # (a typo in a filter must not pass for an empty answer)
            sys.stderr.write(f"warning: {warning}\n")
        # (no bar while the rows themselves go to the terminal: they would interleave)
        rows_shown = output in (None, "-") and sys.stdout.isatty()
        if o.fmt is DeriveFormat.jsonl:
            with nullcontext(None) if rows_shown else progress(len(report.calls), "writing") as advance:
                write_stream(jsonl_lines(report, advance), output)
        elif o.fmt is DeriveFormat.json:
            # encoded as it is written (flat memory), byte for byte the whole document's encoding
            from ..output.derive_json import json_chunks

            with nullcontext(None) if rows_shown else progress(len(report.calls), "writing") as advance:
                write_stream(json_chunks(report, advance), output)
        elif o.fmt is DeriveFormat.text:
            # streamed as it is made (flat memory), fitted to the terminal without cropping what matters
            from ..output.text_rows import derive_text, terminal

            width, color = terminal(output)
            n = len(report.calls)
            bar = progress(min(o.max_rows, n) if o.max_rows else n, "writing") if width is None else nullcontext(None)
            with bar as written:
                write_stream(
                    derive_text(
                        report,
                        width=width,
                        color=color,
                        wide=o.wide,
                        columns=picked,
                        max_rows=o.max_rows,
                        advance=written,
                    ),
                    output,
                )
        else:

            def render(console) -> None:  # (the text report, had a format asked for it: the one above)
                from ..output.text_rows import derive_text

                console.out("".join(derive_text(report, width=None, color=False)), end="")

            emit(
                o.fmt,
                output,
                Report("derive", lambda: to_json(report), render, lambda: api.findings(report, strict=o.strict)),
            )
        finish(o.strict and report.fallbacks > 0, o.exit_zero)

    from .boundary import run

    run(go)


def _columns(text: str) -> list[str]:
    """--columns: known names, comma-separated."""
    from ..output.text_nnx import NNX_COLUMNS
    from ..output.text_rows import COLUMNS

    # (a column as its heading spells it, `hash input`, names it too)
    names = [c.strip().replace(" ", "-") for c in text.split(",") if c.strip()]
    known = COLUMNS + tuple(c for c in NNX_COLUMNS if c not in COLUMNS)
    unknown = [c for c in names if c not in known]
    if unknown or not names:
        raise typer.BadParameter(
            f"{', '.join(unknown) or 'nothing'}: name columns among {', '.join(known)}", param_hint="'--columns'"
        )
    return names


def _columns_of_flavour(names: list[str], flavour: str) -> None:
    """--columns names only columns this spec's report has (`path` also names an NNX report's `site`)."""
    from ..errors import UsageError
    from ..output.text_nnx import NNX_COLUMNS
    from ..output.text_rows import COLUMNS

    have = set(NNX_COLUMNS) | {"path"} if flavour == "nnx" else set(COLUMNS)
    other = [c for c in names if c not in have]
    if other:
        raise UsageError(
            f"--columns {','.join(other)}: {'an NNX' if flavour == 'nnx' else 'a Linen'} spec's report has no such "
            f"column; it has {', '.join(c for c in (NNX_COLUMNS if flavour == 'nnx' else COLUMNS))}"
        )
