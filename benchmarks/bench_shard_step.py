"""Time `rngaudit shard-check --fn STEP --args FACTORY` end to end (a fresh command process, as a user or CI runs
it, report included) against the user's own run of the same step: a fresh Python process that forces the same
CPU devices, imports the fixture, builds the mesh, calls the factory and the step once and waits for it.

Two cases: the Flax MLP with nn.Dropout inside shard_map on 8 forced CPU devices (`dropout_step`), and the per-host
step on 2 local processes of 2 devices joined with jax.distributed (`host_step`, the baseline joins 2 processes
the same way).

    python3 benchmarks/bench_shard_step.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = os.path.join(REPO, "fixtures", "shard", "train_steps.py")

_USER_RUN = """
import os, sys, importlib.util
import jax
if len(sys.argv) > 3:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[4], num_processes=int(sys.argv[3]), process_id=int(sys.argv[5]))
spec = importlib.util.spec_from_file_location("train_steps", {steps!r})
mod = importlib.util.module_from_spec(spec); sys.modules["train_steps"] = mod; spec.loader.exec_module(mod)
mesh = jax.make_mesh((len(jax.devices()),), ("data",))
factory = getattr(mod, sys.argv[2])
import inspect
args = factory(mesh=mesh) if "mesh" in inspect.signature(factory).parameters else factory()
jax.block_until_ready(getattr(mod, sys.argv[1])(*args))
"""


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def user_run(step: str, factory: str, devices: int, processes: int) -> float:
    code = _USER_RUN.format(steps=STEPS)
    start = time.perf_counter()
    if processes == 1:
        subprocess.run([sys.executable, "-c", code, step, factory], env=_env(devices), check=True)
    else:
        addr = f"127.0.0.1:{_free_port()}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, step, factory, str(processes), addr, str(i)], env=_env(devices)
            )
            for i in range(processes)
        ]
        for p in procs:
            assert p.wait() == 0
    return time.perf_counter() - start


def rngaudit_run(step: str, factory: str, devices: int, processes: int) -> float:
    args = [sys.executable, "-m", "rngaudit", "shard-check", "--fn", f"{STEPS}:{step}", "--args", f"{STEPS}:{factory}"]
    args += ["--devices", str(devices)] + (["--processes", str(processes)] if processes > 1 else [])
    start = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True)
    took = time.perf_counter() - start
    assert r.returncode in (0, 1), r.stderr
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    runs = ap.parse_args().runs
    cases = [("dropout_step", "dropout_args", 8, 1), ("host_step", "host_same_seed_args", 2, 2)]
    for step, factory, devices, processes in cases:
        base = [user_run(step, factory, devices, processes) for _ in range(runs)]
        ours = [rngaudit_run(step, factory, devices, processes) for _ in range(runs)]
        b, o = statistics.median(base), statistics.median(ours)
        where = f"{devices} devices" + (f" x {processes} processes" if processes > 1 else "")
        print(
            f"{step} on {where}: user's own run {b:.2f} s, shard-check {o:.2f} s (median of {runs}), ratio {o / b:.2f}x"
        )


if __name__ == "__main__":
    main()
