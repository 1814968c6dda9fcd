"""`rngaudit shard-check`: keys, draws and a (key, x) function on many devices; sharded runs must equal
one-device runs, and devices must not draw the same randomness by accident."""

# (no `from __future__ import annotations`: see cli/derive.py)
from typing import NamedTuple

import typer

from .options import CONFIG, EXIT_ZERO, FORMAT, MAX_SPEC_MIB, MAX_YAML_NODES, OUTPUT, Format, Phase


class ShardCheckOptions(NamedTuple):
    """shard-check's options that [tool.rngaudit] may set."""

    fn: list[str] | None
    devices: int | None
    platform: str | None
    mesh: str | None
    path: list[str] | None
    stream: list[str] | None
    phase: Phase | None
    draw: str | None
    shape: str | None
    input_kind: str | None
    seed: int | None
    key: str | None
    replicated_key: bool
    allow_replicated: bool
    atol: float | None
    timeout: float | None
    args: str | None
    processes: int | None
    data_axis: list[str] | None
    fmt: Format
    exit_zero: bool
    max_spec_mib: int | None
    max_yaml_nodes: int | None


def shard_check(
    ctx: typer.Context,
    specs: list[str] | None = typer.Argument(
        None,
        metavar="SPEC",
        help="Model specs (YAML) whose keys and draws are re-derived on the "
        "devices and compared with the host derivation.",
    ),
    fn: list[str] | None = typer.Option(
        None,
        "--fn",
        metavar="FILE.py:FUNC",
        help="A function (key, x) -> y (FILE.py:NAME or package.module:NAME) "
        "run eagerly, under jax.jit and under shard_map; repeatable.",
    ),
    devices: int | None = typer.Option(
        None,
        "--devices",
        metavar="N",
        help="Force N CPU devices (in a fresh process). Default: the real devices of --platform.",
    ),
    platform: str | None = typer.Option(
        None, "--platform", metavar="cpu|gpu|tpu", help="Use this platform's devices (default: JAX's default backend)."
    ),
    mesh: str | None = typer.Option(
        None, "--mesh", metavar="AXIS=N,...", help="Mesh shape, e.g. data=4,model=2 (default: data=<device count>)."
    ),
    path: list[str] | None = typer.Option(
        None, "--path", metavar="GLOB", help="Check only keys whose module path matches (e.g. 'Dense_*'); repeatable."
    ),
    stream: list[str] | None = typer.Option(
        None, "--stream", metavar="S", help="Check only keys of this stream; repeatable."
    ),
    phase: Phase | None = typer.Option(None, "--phase", metavar="init|apply", help="Override the specs' phase."),
    draw: str | None = typer.Option(
        None, "--draw", metavar="KIND:SHAPE", help="Draw values from every key without a `draw:`, e.g. normal:8,1."
    ),
    shape: str | None = typer.Option(
        None,
        "--shape",
        metavar="N,...",
        help="Shape of x for --fn; the first axis is the batch (default: <device count>,1).",
    ),
    input_kind: str | None = typer.Option(
        None, "--input", metavar="ones|normal", help="x for --fn: ones (default) or a normal sample seeded by --seed."
    ),
    seed: int | None = typer.Option(
        None,
        "--seed",
        metavar="N",
        help="Seed of the key for --fn, jax.random.key(SEED), and of x with --input normal (default 0).",
    ),
    key: str | None = typer.Option(
        None, "--key", metavar="EXPR", help="The key for --fn as a key expression instead, e.g. 'split(key(0))[1]'."
    ),
    replicated_key: bool = typer.Option(
        False,
        "--replicated-key/--no-replicated-key",
        help="The function is called with one replicated key (inside shard_map): devices drawing the same "
        "randomness from it is a finding. Default: information only.",
    ),
    allow_replicated: bool = typer.Option(
        False,
        "--allow-replicated/--no-allow-replicated",
        help="Identical randomness on every device from one key is intended: report it as allowed.",
    ),
    atol: float | None = typer.Option(
        None,
        "--atol",
        metavar="TOL",
        help="Accept jit/eager differences up to this (0: bit for bit). Default: XLA's rounding, never different random values.",
    ),
    timeout: float | None = typer.Option(
        None, "--timeout", metavar="SECONDS", help="Give up on the device process after this long (default 300)."
    ),
    args: str | None = typer.Option(
        None,
        "--args",
        metavar="FILE.py:FACTORY",
        help="A factory of the --fn step's arguments (given the mesh if it takes `mesh`): the step runs once as "
        "written, and the randomness each device and process draws is compared.",
    ),
    processes: int | None = typer.Option(
        None,
        "--processes",
        metavar="P",
        help="Run the --args step in P local processes joined with jax.distributed (each with --devices CPU "
        "devices) and find randomness repeated across them (default 1).",
    ),
    data_axis: list[str] | None = typer.Option(
        None,
        "--data-axis",
        metavar="NAME",
        help="A mesh axis that splits the data (identical randomness along it is a finding); repeatable. "
        "Default: axes named like data, else the mapped function's in_specs, else the arguments' shardings.",
    ),
    fmt: Format = FORMAT,
    output: str | None = OUTPUT,
    exit_zero: bool = EXIT_ZERO,
    max_spec_mib: int | None = MAX_SPEC_MIB,
    max_yaml_nodes: int | None = MAX_YAML_NODES,
    config: str | None = CONFIG,
) -> None:
    """Check keys, draws and a (key, x) function on many devices: sharded runs must equal one-device runs."""
    given = ShardCheckOptions(
        fn,
        devices,
        platform,
        mesh,
        path,
        stream,
        phase,
        draw,
        shape,
        input_kind,
        seed,
        key,
        replicated_key,
        allow_replicated,
        atol,
        timeout,
        args,
        processes,
        data_axis,
        fmt,
        exit_zero,
        max_spec_mib,
        max_yaml_nodes,
    )

    def go() -> None:
        from .. import api
        from ..output.formats import Report
        from ..output.progress import progress
        from ..output.shard_json import to_json
        from .boundary import finish, spec_limits
        from .defaults import configured
        from .writing import emit

        o = configured(ctx, "shard-check", config, given)
        with spec_limits(o.max_spec_mib, o.max_yaml_nodes), progress(None, "shard-check: running on the devices"):
            report = api.shard_check(
                specs or (),
                fns=o.fn or (),
                devices=o.devices,
                platform=o.platform,
                mesh=o.mesh,
                paths=o.path or (),
                streams=o.stream or (),
                phase=o.phase.value if o.phase else None,
                draw=o.draw,
                shape=o.shape,
                input=o.input_kind,
                seed=o.seed,
                key=o.key,
                replicated_key=o.replicated_key,
                allow_replicated=o.allow_replicated,
                atol=o.atol,
                timeout=o.timeout,
                args=o.args,
                processes=o.processes,
                data_axes=o.data_axis or (),
            )

        def render(console) -> None:
            from ..output.text_shard import render_shard

            render_shard(report, console)

        emit(
            o.fmt,
            output,
            Report("shard-check", lambda: to_json(report), render, lambda: api.findings(report)),
        )
        finish(report.failing, o.exit_zero)

    from .boundary import run

    run(go)
