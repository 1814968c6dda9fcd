"""The refactor-safety commands: `capture` (a live Flax model -> a spec and its keys), `verify` (a spec against a
model or a capture) and `diff` (two versions, call site by call site)."""

# (no `from __future__ import annotations`: see cli/derive.py)
import os
import sys
from typing import NamedTuple

import typer

from .options import CONFIG, EXIT_ZERO, FORMAT, MAX_SPEC_MIB, MAX_YAML_NODES, OUTPUT, Format, Phase

_INPUT_HELP = (
    "An argument of init/apply as DTYPE[SHAPE] (ones), positional, or NAME=DTYPE[SHAPE]; repeatable. "
    "Default: the example arguments the factory returns."
)
_RNGS_HELP = "The keys init/apply receives, STREAM=SEED,... (default params=0)."


def _text(text: str):
    """A text renderer that writes already-formatted text unchanged."""
    return lambda console: console.file.write(text)


class CaptureOptions(NamedTuple):
    inputs: list[str] | None
    rngs: str | None
    phase: Phase
    method: str | None
    fmt: Format
    exit_zero: bool
    steps: int | None


def capture(
    ctx: typer.Context,
    target: str = typer.Argument(
        ...,
        metavar="TARGET",
        help="A Flax module factory: FILE.py:FACTORY or package.module:FACTORY. It returns "
        "the module, or (module, args) / (module, args, kwargs).",
    ),
    inputs: list[str] | None = typer.Option(None, "--input", "-i", metavar="[NAME=]DTYPE[SHAPE]", help=_INPUT_HELP),
    rngs: str | None = typer.Option(None, "--rngs", metavar="STREAM=SEED,...", help=_RNGS_HELP),
    phase: Phase = typer.Option(
        Phase.init, "--phase", metavar="init|apply", help="Run init, or init then apply (keys of apply)."
    ),
    method: str | None = typer.Option(
        None, "--method", metavar="NAME", help="The module method to run (default __call__)."
    ),
    steps: int | None = typer.Option(
        None,
        "--steps",
        min=0,
        metavar="N",
        help="NNX models: call the model N times after building it (default 1); every key of each call is recorded.",
    ),
    step: str | None = typer.Option(
        None,
        "--step",
        metavar="FILE.py:NAME",
        help="NNX models: each step calls NAME(model, *args), your training step (one under @nnx.jit too), "
        "instead of model(*args).",
    ),
    keys: str | None = typer.Option(
        None, "--keys", metavar="FILE.json", help="Also write the observed keys (format rngaudit.capture) here."
    ),
    fmt: Format = typer.Option(
        Format.text,
        "--format",
        "-f",
        metavar="text|json|github|sarif",
        help="text: the spec (YAML); json: the observed keys document; github and sarif "
        "write the spec as text does (capture has no findings: it writes a spec that "
        "replays, or exits 2).",
    ),
    output: str | None = typer.Option(
        None, "--output", "-o", metavar="FILE", help="Write the spec (or, with --format json, the keys) here."
    ),
    exit_zero: bool = EXIT_ZERO,
    config: str | None = CONFIG,
) -> None:
    """Run a live Flax model, record every key it hands out, and write a spec derive replays bit-exactly."""
    given = CaptureOptions(inputs, rngs, phase, method, fmt, exit_zero, steps)

    def go() -> None:
        from .. import api
        from ..output.formats import dumps
        from ..refactor.keys_file import capture_to_json
        from .defaults import configured
        from .writing import write_output

        o = configured(ctx, "capture", config, given)
        from ..errors import UsageError
        from .writing import check_writable

        if keys is not None and output is not None and os.path.realpath(keys) == os.path.realpath(output):
            raise UsageError(f"--keys {keys} and --output {output} name one file; give them two")
        for path, option in ((keys, "--keys"), (output, "--output")):
            if path is not None and path != "-":
                check_writable(path, option)
        report = api.capture(
            target,
            inputs=o.inputs or (),
            rngs=o.rngs,
            phase=o.phase.value,
            method=o.method,
            steps=o.steps,
            step=step,
        )
        doc = capture_to_json(report.capture, output if o.fmt is not Format.json else None)
        if keys is not None:
            write_output(dumps(doc), keys, "--keys")
        write_output(dumps(doc) if o.fmt is Format.json else report.spec, output)
        for line in fallback_warnings(report.capture):
            sys.stderr.write(line + "\n")

    from .boundary import run

    run(go)


def fallback_warnings(cap) -> list[str]:
    """One warning per stream a model asked for but was not given, whose keys came from 'params' instead (Flax's
    fallback): a captured `--phase apply` without a dropout seed draws its masks from the params stream."""
    from ..spec.nnx import CALL_RNGS

    fell: dict = {}
    given_at_calls: dict = {}  # NNX: (asked, used) -> whether every such draw was from the Rngs given to the calls
    for s in cap.sites:
        if s.requested != s.stream:
            fell.setdefault((s.requested, s.stream), []).append(s.path_str)
            at_call = s.stream_path.startswith(f"{CALL_RNGS}.")
            given_at_calls[(s.requested, s.stream)] = given_at_calls.get((s.requested, s.stream), True) and at_call
    if cap.flavour == "nnx":
        return [
            f"warning: stream {asked!r} is served by 'default' at {len(paths)} draw(s) (first: {'.'.join(p for p in paths[0].split('/'))}), "
            f"sharing its counter: no {asked!r} in the nnx.Rngs "
            + (
                "given to the model's calls (the factory's, or the step's)"
                if given_at_calls[(asked, used)]
                else "the model is built from (--rngs, or the factory's)"
            )
            for (asked, used), paths in fell.items()
        ]
    given = set(cap.rngs)
    return [
        f"warning: make_rng({asked!r}) fell back to stream {used!r} at {len(paths)} call site(s) (first: "
        f"{paths[0]}): "
        + (
            f"{asked!r} is given, but a transform around it hides it (split_rngs without {asked!r}, or rngs=); "
            f"list {asked!r} in that transform's split_rngs if the model should draw its own {asked!r} randomness"
            if asked in given
            else f"no {asked!r} in --rngs; give it (e.g. --rngs params=0,{asked}=1) if the model should draw its "
            f"own {asked!r} randomness"
        )
        for (asked, used), paths in fell.items()
    ]


class VerifyOptions(NamedTuple):
    inputs: list[str] | None
    rngs: str | None
    method: str | None
    fmt: Format
    exit_zero: bool
    max_spec_mib: int | None
    max_yaml_nodes: int | None


def verify(
    ctx: typer.Context,
    spec: str = typer.Argument(..., metavar="SPEC", help="The model spec (YAML) to check."),
    against: str = typer.Option(
        ...,
        "--against",
        metavar="TARGET|KEYS.json",
        help="A module factory (FILE.py:FACTORY, package.module:FACTORY) to run in real "
        "Flax, or a keys file written by `capture --keys`.",
    ),
    inputs: list[str] | None = typer.Option(None, "--input", "-i", metavar="[NAME=]DTYPE[SHAPE]", help=_INPUT_HELP),
    rngs: str | None = typer.Option(
        None, "--rngs", metavar="STREAM=SEED,...", help="The keys for TARGET (default: the spec's integer seeds)."
    ),
    method: str | None = typer.Option(None, "--method", metavar="NAME", help="The module method TARGET runs."),
    step: str | None = typer.Option(
        None,
        "--step",
        metavar="FILE.py:NAME",
        help="NNX models: the training step the spec was captured with (capture --step); each step calls "
        "NAME(model, *args) instead of model(*args).",
    ),
    fmt: Format = FORMAT,
    output: str | None = OUTPUT,
    exit_zero: bool = EXIT_ZERO,
    max_spec_mib: int | None = MAX_SPEC_MIB,
    max_yaml_nodes: int | None = MAX_YAML_NODES,
    config: str | None = CONFIG,
) -> None:
    """Check a spec against a live model (or a capture): every key that differs, is missing or is extra."""
    given = VerifyOptions(inputs, rngs, method, fmt, exit_zero, max_spec_mib, max_yaml_nodes)

    def go() -> None:
        from .. import api
        from ..output.compare_json import to_json
        from ..output.formats import Report
        from ..output.text_compare import render_text
        from .boundary import finish, spec_limits
        from .defaults import configured
        from .writing import emit

        o = configured(ctx, "verify", config, given)
        with spec_limits(o.max_spec_mib, o.max_yaml_nodes):
            cmp = api.verify(spec, against, inputs=o.inputs or (), rngs=o.rngs, method=o.method, step=step)
        emit(
            o.fmt,
            output,
            Report("verify", lambda: to_json(cmp), _text(render_text(cmp)), lambda: api.findings(cmp)),
        )
        finish(cmp.failing, o.exit_zero)

    from .boundary import run

    run(go)


class DiffOptions(NamedTuple):
    fmt: Format
    exit_zero: bool
    max_spec_mib: int | None
    max_yaml_nodes: int | None


def diff(
    ctx: typer.Context,
    old: str = typer.Argument(..., metavar="OLD", help="The old version: a spec (YAML) or a keys file (JSON)."),
    new: str | None = typer.Argument(
        None,
        metavar="[NEW]",
        help="The new version: a spec (YAML) or a keys file (JSON). Default with --from-flax/--to-flax: OLD.",
    ),
    from_flax: str | None = typer.Option(
        None, "--from-flax", metavar="VERSION", help="Derive OLD under this Flax release's rules (or 'newest')."
    ),
    to_flax: str | None = typer.Option(
        None, "--to-flax", metavar="VERSION", help="Derive NEW under this Flax release's rules (or 'newest')."
    ),
    from_jax: str | None = typer.Option(
        None,
        "--from-jax",
        metavar="VERSION",
        help="Derive OLD with this JAX release's jax_threefry_partitionable default (or 'newest').",
    ),
    to_jax: str | None = typer.Option(
        None,
        "--to-jax",
        metavar="VERSION",
        help="Derive NEW with this JAX release's jax_threefry_partitionable default (or 'newest').",
    ),
    fmt: Format = FORMAT,
    output: str | None = OUTPUT,
    exit_zero: bool = EXIT_ZERO,
    max_spec_mib: int | None = MAX_SPEC_MIB,
    max_yaml_nodes: int | None = MAX_YAML_NODES,
    config: str | None = CONFIG,
) -> None:
    """Which call sites keep their keys, which change, which are new or gone, and why; exit 1 on any change.
    With --from-flax/--to-flax (--from-jax/--to-jax): which keys an upgrade moves, and the rule that moves them."""
    given = DiffOptions(fmt, exit_zero, max_spec_mib, max_yaml_nodes)

    def go() -> None:
        from .. import api
        from ..output.compare_json import to_json
        from ..output.formats import Report
        from ..output.text_compare import render_text
        from .boundary import finish, spec_limits
        from .defaults import configured
        from .writing import emit

        o = configured(ctx, "diff", config, given)
        with spec_limits(o.max_spec_mib, o.max_yaml_nodes):
            cmp = api.diff(old, new, from_flax=from_flax, to_flax=to_flax, from_jax=from_jax, to_jax=to_jax)
        emit(
            o.fmt,
            output,
            Report("diff", lambda: to_json(cmp), _text(render_text(cmp)), lambda: api.findings(cmp)),
        )
        finish(cmp.failing, o.exit_zero)

    from .boundary import run

    run(go)
