"""The device process of `shard-check`: runs the checks on the devices it started with, and reports JSON.

    python -m rngaudit.shard.worker REQUEST.json RESULT.json [PROCESS COORDINATOR]

The command starts it with the environment that decides the devices (XLA_FLAGS, JAX_NUM_CPU_DEVICES,
JAX_PLATFORMS), since JAX reads those only when it starts. RESULT.json holds `{"report": ..., "steps": [...]}` (the
`rngaudit.shard_check` JSON, and what each --args step drew) or `{"error": {"kind": ..., "message": ...}}`; stdout is left to the user's code.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

from .report import DeviceSet, MeshLayout, ShardReport
from .request import ShardRequest


def _result(request_path: str, process: tuple[int, str] | None = None) -> dict:
    from ..errors import RngauditError
    from ..output.shard_json import to_json
    from .request import request_from_json

    try:
        with open(request_path, encoding="utf-8") as f:
            request = request_from_json(json.load(f))
        if process is not None:
            _join(request, *process)
        report, steps = run_here(request)
        return {"report": to_json(report), "steps": steps, "process": process[0] if process else 0}
    except RngauditError as e:
        return {"error": {"kind": type(e).__name__, "message": str(e)}}
    except MemoryError:
        return {"error": {"kind": "DeviceError", "message": "the device process ran out of memory"}}
    except Exception as e:  # noqa: BLE001 - a bug of ours: say so in one line, with details on request
        if os.environ.get("RNGAUDIT_DEBUG"):
            traceback.print_exc()
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {
            "error": {
                "kind": "internal",
                "message": f"internal error in the device process "
                f"({type(e).__name__}: {text}); please report it (RNGAUDIT_DEBUG=1 shows details)",
            }
        }


def _join(r: ShardRequest, process_id: int, coordinator: str) -> None:
    """Join the other local processes through jax.distributed (CPU collectives over gloo, on localhost)."""
    import jax

    from ..errors import DeviceError
    from ..usercode import first_line

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # noqa: BLE001,S110 - an older JAX without the option: collectives stay as they are
        pass
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes=r.processes,
            process_id=process_id,
            initialization_timeout=max(1, int(r.timeout)),
        )
    except Exception as e:  # noqa: BLE001 - a process that cannot join is a device error, in one line
        raise DeviceError(
            f"process {process_id} could not join the {r.processes} processes through jax.distributed at "
            f"{coordinator} ({first_line(e)})"
        ) from None


def run_here(r: ShardRequest) -> tuple[ShardReport, list[dict]]:
    """Run every check of `r` in this process, on its devices (what the device process does): the report of the
    spec and (key, x) checks, and what each --args step drew (compared by the command, across processes)."""
    from ..spec.limits import limits
    from .devices import environment, make_mesh, pick_devices
    from .fn_checks import check_fn
    from .spec_checks import check_spec
    from .step_checks import observe_step

    devices = pick_devices(r)
    mesh = make_mesh(devices, r.mesh)
    steps: list[dict] = []
    with limits(*(r.spec_limits or (None, None))):
        targets = [check_spec(t, mesh) for t in r.specs]
        if r.args is not None:
            steps = [observe_step(t, r.args, mesh) for t in r.fns]
        else:
            targets += [check_fn(t, r, mesh) for t in r.fns]
    flat = list(mesh.devices.flat)
    return ShardReport(
        environment(),
        DeviceSet(
            flat[0].platform, flat[0].device_kind, tuple(int(d.id) for d in flat), r.devices is not None, r.processes
        ),
        MeshLayout(
            tuple(mesh.axis_names),
            tuple(int(s) for s in mesh.devices.shape),
            np.vectorize(lambda d: int(d.id), otypes=[np.int64])(mesh.devices).tolist(),
        ),
        tuple(targets),
    ), steps


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4):
        sys.stderr.write("usage: python -m rngaudit.shard.worker REQUEST.json RESULT.json [PROCESS COORDINATOR]\n")
        return 2
    request_path, result_path = argv[:2]
    result = _result(request_path, (int(argv[2]), argv[3]) if len(argv) == 4 else None)
    tmp = result_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, sort_keys=True)
    os.replace(tmp, result_path)  # the command reads a whole result or none
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
