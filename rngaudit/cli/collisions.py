"""`rngaudit collisions`: find call sites that receive identical keys, say why, and check the fixes."""

# (no `from __future__ import annotations`: see cli/derive.py)
import dataclasses
import sys
from typing import NamedTuple

import typer

from ..errors import EXIT_ERROR
from .options import (
    CONFIG,
    EXIT_ZERO,
    FORMAT,
    MAX_SPEC_MIB,
    MAX_YAML_NODES,
    OUTPUT,
    STDIN_FILENAME,
    Category,
    Format,
    Phase,
    category,
    path_ignore,
)


class CollisionsOptions(NamedTuple):
    """collisions' options that [tool.rngaudit] may set."""

    fmt: Format
    phase: Phase | None
    keys: bool
    separator: bool | None
    latent_max_count: int | None
    strict: bool
    fail_on: list[Category] | None
    exit_zero: bool
    max_spec_mib: int | None
    max_yaml_nodes: int | None
    include: list[str] | None
    exclude: list[str] | None
    statistics: bool
    select: list[Category] | None
    ignore: list[Category] | None
    per_path_ignore: list[str] | None
    inline_ignores: bool
    baseline: str | None


def collisions(
    ctx: typer.Context,
    inputs: list[str] = typer.Argument(
        ...,
        metavar="SPEC...",
        help="Model specs (YAML), JSON files (*.json) of module paths or a params tree, directories (walked for "
        "specs) or - (a spec on standard input).",
    ),
    fmt: Format = FORMAT,
    output: str | None = OUTPUT,
    phase: Phase | None = typer.Option(None, "--phase", metavar="init|apply", help="Override the specs' phase."),
    keys: bool = typer.Option(
        True,
        "--keys/--no-keys",
        help="Compute key data to find keys shared across streams (class 4). "
        "--no-keys checks hash inputs and words only (never imports JAX).",
    ),
    separator: bool | None = typer.Option(
        None,
        "--fix-rng-separator/--no-fix-rng-separator",
        help="The model's flax_fix_rng_separator: overrides a spec's; for JSON inputs the default is off.",
    ),
    latent_max_count: int | None = typer.Option(
        None,
        "--latent-max-count",
        min=0,
        metavar="N",
        help="Report latent pairs whose smaller colliding count is at most N (default 65535; 0: no latent pairs).",
    ),
    strict: bool = typer.Option(False, "--strict/--no-strict", help="Exit 1 on information and latent findings too."),
    fail_on: list[Category] | None = typer.Option(
        None,
        "--fail-on",
        parser=category,
        metavar="CATEGORY",
        help="Exit 1 only on findings of these categories; repeatable (default: concatenation, count_meets_name, "
        "hash_word, shared_seed; --strict: all, with unsplit_lanes and latent).",
    ),
    exit_zero: bool = EXIT_ZERO,
    max_spec_mib: int | None = MAX_SPEC_MIB,
    max_yaml_nodes: int | None = MAX_YAML_NODES,
    include: list[str] | None = typer.Option(
        None,
        "--include",
        metavar="GLOB",
        help="In directories, read the files matching these globs (name or path below the directory; repeatable; "
        "default *.yaml, *.yml). YAML without a top-level rngaudit: key is skipped.",
    ),
    exclude: list[str] | None = typer.Option(
        None,
        "--exclude",
        metavar="GLOB",
        help="In directories, skip files and folders matching these globs (a path below the directory or any "
        "part of it; repeatable).",
    ),
    stdin_filename: str | None = STDIN_FILENAME,
    statistics: bool = typer.Option(
        False,
        "--statistics/--no-statistics",
        help="Text: instead of the report, how many findings of each rule (and its level), most first, as ruff "
        "--statistics.",
    ),
    select: list[Category] | None = typer.Option(
        None,
        "--select",
        parser=category,
        metavar="RULE",
        help="Report only findings of these rules (hash-word, collisions/latent, ...); repeatable (default: all).",
    ),
    ignore: list[Category] | None = typer.Option(
        None, "--ignore", parser=category, metavar="RULE", help="Do not report findings of these rules; repeatable."
    ),
    per_path_ignore: list[str] | None = typer.Option(
        None,
        "--per-path-ignore",
        parser=path_ignore,
        metavar="GLOB:RULES",
        help="Leave out findings of these rules (comma-separated, * for all) in inputs whose path, or at call sites "
        "whose module path, matches GLOB, e.g. 'specs/legacy/*:latent'; repeatable.",
    ),
    inline_ignores: bool = typer.Option(
        True,
        "--inline-ignores/--no-inline-ignores",
        help="Honour `# rngaudit: ignore[RULE,...]` comments on a call site's spec line (--no-inline-ignores: "
        "report every finding, as ruff --ignore-noqa).",
    ),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        metavar="FILE",
        help="Leave out the findings this baseline file lists (known ones): exit 1 only on new findings.",
    ),
    write_baseline: bool = typer.Option(
        False,
        "--write-baseline",
        help="Write every finding of this run to the --baseline FILE (and no report); exit 0 unless an input fails.",
    ),
    config: str | None = CONFIG,
) -> None:
    """Find call sites that receive identical keys, say why, and check the fixes. Every input is reported: one
    that cannot be read is an error diagnostic (exit 2 at the end) and the others still run."""
    given = CollisionsOptions(
        fmt,
        phase,
        keys,
        separator,
        latent_max_count,
        strict,
        fail_on,
        exit_zero,
        max_spec_mib,
        max_yaml_nodes,
        include,
        exclude,
        statistics,
        select,
        ignore,
        per_path_ignore,
        inline_ignores,
        baseline,
    )

    def go() -> None:
        from .. import api
        from ..errors import UsageError
        from ..output.collisions_json import to_json
        from ..output.findings import suppressed_findings
        from ..output.formats import Report
        from ..output.progress import progress
        from .boundary import finish, one_line, spec_limits
        from .defaults import config_dir, configured
        from .inputs import expand
        from .writing import check_not_an_input, check_writable, emit, write_output

        o = configured(ctx, "collisions", config, given)
        if write_baseline and o.baseline is None:
            raise UsageError("--write-baseline writes the file --baseline names: give --baseline FILE")
        if write_baseline and o.baseline is not None:
            check_writable(o.baseline, "--baseline")
        with spec_limits(o.max_spec_mib, o.max_yaml_nodes):
            sources, missing = expand(inputs, o.include, o.exclude or (), stdin_filename)
        read = [s if isinstance(s, str) else "-" for s in sources]  # (a spec read from standard input: -)
        check_not_an_input(output, read)
        if write_baseline and o.baseline is not None:
            check_not_an_input(o.baseline, read, "--baseline")
        with spec_limits(o.max_spec_mib, o.max_yaml_nodes), progress(len(sources), "collisions") as advance:
            report = api.collisions(
                *sources,
                phase=o.phase.value if o.phase else None,
                keys=o.keys,
                fix_rng_separator=o.separator,
                latent_max_count=o.latent_max_count,
                strict=o.strict,
                fail_on=[c.value for c in o.fail_on] if o.fail_on is not None else None,
                advance=advance,
                keep_going=True,
                select=[c.value for c in o.select] if o.select else None,
                ignore=[c.value for c in o.ignore or ()],
                per_path_ignore=o.per_path_ignore or (),
                inline_ignores=o.inline_ignores,
                baseline=None if write_baseline else o.baseline,
                per_path_base=config_dir(ctx, "per_path_ignore"),
            )
        if missing:
            report = dataclasses.replace(report, errors=tuple(missing) + report.errors)
        for e in report.errors:  # (each bad input: one `error:` line, as a single bad input gets)
            sys.stderr.write(f"error: {one_line(str(e))}\n")
        for w in report.warnings:
            sys.stderr.write(f"warning: {one_line(w)}\n")
        if report.errors and (not report.audits or output is not None or write_baseline):
            # nothing audited: no report, as for a single bad input; and --output is written only by a run
            # that succeeds (no partial file): the reports and annotations go to stdout
            raise typer.Exit(EXIT_ERROR)

        if write_baseline:
            assert o.baseline is not None
            from ..output.collisions_json import baseline_json
            from ..output.formats import dumps

            doc = baseline_json(report, o.baseline)
            write_output(dumps(doc), o.baseline, "--baseline")
            n = len(doc["findings"])
            sys.stderr.write(f"wrote {n} finding{'' if n == 1 else 's'} to the baseline {o.baseline}\n")
            return
        if report.baseline_unmatched:
            n = report.baseline_unmatched
            sys.stderr.write(
                f"warning: {o.baseline}: {n} finding{' is' if n == 1 else 's are'} in the baseline and no longer "
                "found (fixed?); --write-baseline drops them\n"
            )

        def render(console) -> None:
            from ..output.text_collisions import render_collisions, render_statistics

            if o.statistics:
                render_statistics(api.findings(report), len(report.audits), console)
            else:
                render_collisions(
                    report.audits, console, report.errors, suppressed=report.suppressed_counts, baseline=o.baseline
                )

        emit(
            o.fmt,
            output,
            Report(
                "collisions",
                lambda: to_json(report.audits, report.errors, report.suppressed_counts, report.baseline_unmatched),
                render,
                lambda: api.findings(report),
                lambda: suppressed_findings(report),
            ),
        )
        if report.errors:
            raise typer.Exit(EXIT_ERROR)
        if report.failing and not o.exit_zero and not any(a.failing for a in report.audits):
            # (the summary counts by each class's default: say what fails the run)
            gate = "--strict" if o.strict else "--fail-on"
            sys.stderr.write(
                f"exit 1: {gate} (the option, or its [tool.rngaudit] setting) fails the run on findings the summary "
                "counts as information or latent\n"
            )
        finish(report.failing, o.exit_zero)

    from .boundary import run

    run(go)
