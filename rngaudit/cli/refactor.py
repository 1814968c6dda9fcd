"""The refactor-safety commands (capture, verify, diff), registered on the app of cli.py."""
from __future__ import annotations

import json
from typing import Optional

import typer

from ..errors import UsageError
from .root import (
    _CONFIG,
    _EXIT_ZERO,
    _MAX_SPEC_MIB,
    _MAX_YAML_NODES,
    Format,
    Phase,
    _configured,
    _emit,
    _finish,
    _run,
    _write_output,
    app,
)

_INPUT_HELP = ("An argument of init/apply as DTYPE[SHAPE] (ones), positional, or NAME=DTYPE[SHAPE]; repeatable. "
               "Default: the example arguments the factory returns.")
_RNGS_HELP = "The keys init/apply receives, STREAM=SEED,... (default params=0)."


def _dumps(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _text(text: str):
    """A renderer for _emit that writes already-formatted text unchanged."""
    return lambda console: console.file.write(text)


@app.command()
def capture(
    ctx: typer.Context,
    target: str = typer.Argument(..., metavar="TARGET",
                                 help="A Flax module factory: FILE.py:FACTORY or package.module:FACTORY. It returns "
                                 "the module, or (module, args) / (module, args, kwargs)."),
    inputs: Optional[list[str]] = typer.Option(None, "--input", "-i", metavar="[NAME=]DTYPE[SHAPE]", help=_INPUT_HELP),
    rngs: Optional[str] = typer.Option(None, "--rngs", metavar="STREAM=SEED,...", help=_RNGS_HELP),
    phase: Phase = typer.Option(Phase.init, "--phase", help="Run init, or init then apply (keys of apply)."),
    method: Optional[str] = typer.Option(None, "--method", help="The module method to run (default __call__)."),
    keys: Optional[str] = typer.Option(None, "--keys", metavar="FILE.json",
                                       help="Also write the observed keys (format rngaudit.capture) here."),
    fmt: Format = typer.Option(Format.text, "--format", "-f",
                               help="text: the spec (YAML); json: the observed keys document; github and sarif "
                               "write the spec as text does (capture has no findings: it writes a spec that "
                               "replays, or exits 2)."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the spec (or, with --format json, the keys) here."),
    exit_zero: bool = _EXIT_ZERO,
    config: Optional[str] = _CONFIG,
) -> None:
    """Run a live Flax model, record every key it hands out, and write a spec derive replays bit-exactly."""
    inputs, rngs, phase, method, fmt, exit_zero = _configured(
        ctx, "capture", config, inputs=inputs, rngs=rngs, phase=phase, method=method, fmt=fmt, exit_zero=exit_zero)

    def go():
        from ..refactor.capture import run_capture
        from ..refactor.keys_file import capture_to_json

        cap, spec_text = run_capture(target, list(inputs or ()), rngs, phase.value, method)
        doc = capture_to_json(cap, output if fmt is not Format.json else None)
        if keys is not None:
            _write_output(_dumps(doc), keys)
        _write_output(_dumps(doc) if fmt is Format.json else spec_text, output)

    _run(go)


@app.command()
def verify(
    ctx: typer.Context,
    spec: str = typer.Argument(..., metavar="SPEC", help="The model spec (YAML) to check."),
    against: str = typer.Option(..., "--against", metavar="TARGET|KEYS.json",
                                help="A module factory (FILE.py:FACTORY, package.module:FACTORY) to run in real "
                                "Flax, or a keys file written by `capture --keys`."),
    inputs: Optional[list[str]] = typer.Option(None, "--input", "-i", metavar="[NAME=]DTYPE[SHAPE]", help=_INPUT_HELP),
    rngs: Optional[str] = typer.Option(None, "--rngs", metavar="STREAM=SEED,...",
                                       help="The keys for TARGET (default: the spec's integer seeds)."),
    method: Optional[str] = typer.Option(None, "--method", help="The module method TARGET runs."),
    fmt: Format = typer.Option(Format.text, "--format", "-f", help="Output format."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the report here (only if the run succeeds)."),
    exit_zero: bool = _EXIT_ZERO,
    max_spec_mib: Optional[int] = _MAX_SPEC_MIB,
    max_yaml_nodes: Optional[int] = _MAX_YAML_NODES,
    config: Optional[str] = _CONFIG,
) -> None:
    """Check a spec against a live model (or a capture): every key that differs, is missing or is extra."""
    inputs, rngs, method, fmt, exit_zero, max_spec_mib, max_yaml_nodes = _configured(
        ctx, "verify", config, inputs=inputs, rngs=rngs, method=method, fmt=fmt, exit_zero=exit_zero,
        max_spec_mib=max_spec_mib, max_yaml_nodes=max_yaml_nodes)

    def go():
        from ..output.compare_json import to_json
        from ..output.findings import VERIFY_RULES, compare_findings
        from ..output.text_compare import render_text
        from ..refactor.capture import observe
        from ..refactor.compare import verify as run_verify
        from ..refactor.keys_file import load_sites
        from ..spec.parse import load_spec

        ours = load_sites(spec)
        if against.lower().endswith(".json"):
            if inputs or rngs or method:
                raise UsageError("--input, --rngs and --method apply to a TARGET, not to a keys file")
            theirs = load_sites(against)
        else:
            seeds = rngs
            if seeds is None:
                s = load_spec(spec)
                try:
                    seeds = {k: int(src.text) for k, src in s.rngs.items()}
                except ValueError:
                    raise UsageError(f"{spec}: its rngs are not all integer seeds; give --rngs STREAM=SEED,... for "
                                    "the TARGET") from None
            theirs, _, _ = observe(against, list(inputs or ()), seeds, ours.phase, method)
        cmp = run_verify(ours, theirs)
        _emit(fmt, output, "verify", json_doc=lambda: to_json(cmp), render=_text(render_text(cmp)),
              findings=lambda: compare_findings(cmp), rules=VERIFY_RULES)
        _finish(cmp.failing, exit_zero)

    _run(go, spec_limits=(max_spec_mib, max_yaml_nodes))


@app.command()
def diff(
    ctx: typer.Context,
    old: str = typer.Argument(..., metavar="OLD", help="The old version: a spec (YAML) or a keys file (JSON)."),
    new: str = typer.Argument(..., metavar="NEW", help="The new version: a spec (YAML) or a keys file (JSON)."),
    fmt: Format = typer.Option(Format.text, "--format", "-f", help="Output format."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the report here (only if the run succeeds)."),
    exit_zero: bool = _EXIT_ZERO,
    max_spec_mib: Optional[int] = _MAX_SPEC_MIB,
    max_yaml_nodes: Optional[int] = _MAX_YAML_NODES,
    config: Optional[str] = _CONFIG,
) -> None:
    """Which call sites keep their keys, which change, which are new or gone, and why; exit 1 on any change."""
    fmt, exit_zero, max_spec_mib, max_yaml_nodes = _configured(
        ctx, "diff", config, fmt=fmt, exit_zero=exit_zero, max_spec_mib=max_spec_mib, max_yaml_nodes=max_yaml_nodes)

    def go():
        from ..output.compare_json import to_json
        from ..output.findings import DIFF_RULES, compare_findings
        from ..output.text_compare import render_text
        from ..refactor.compare import diff as run_diff
        from ..refactor.keys_file import load_sites

        cmp = run_diff(load_sites(old), load_sites(new))
        _emit(fmt, output, "diff", json_doc=lambda: to_json(cmp), render=_text(render_text(cmp)),
              findings=lambda: compare_findings(cmp), rules=DIFF_RULES)
        _finish(cmp.failing, exit_zero)

    _run(go, spec_limits=(max_spec_mib, max_yaml_nodes))
