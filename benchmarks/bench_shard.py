"""Time `rngaudit shard-check` on the Flax guide's multi-device example (8 forced CPU devices) against the same
computations written out with JAX and run directly in one process.

The command (a fresh process each run, as a user or CI runs it) pays for its own start (typer, rich), the
device process's start (JAX, Flax), the fixture's import (`Model.init`), and every compile and run of its
three checks. The baseline is the guide's code itself — the eager forward, jax.jit with the batch sharded,
shard_map with split keys and with one key, each result fetched — in a fresh process that forced 8 CPU
devices before importing JAX: `cold` is its first run (including the fixture's import and the compiles,
not the JAX import, which is timed apart), `warm` the best of three more with everything compiled.

    python3 benchmarks/bench_shard.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE_FN = "fixtures/shard/guide_forward.py:forward"
DEVICES = 8


def direct() -> dict:
    """The guide's example run with plain JAX in this process (run as the child of the benchmark)."""
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) == DEVICES
    imported = time.perf_counter()

    import importlib.util

    path = os.path.join(REPO, "fixtures", "shard", "guide_forward.py")
    spec = importlib.util.spec_from_file_location("guide_forward", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    forward = mod.forward
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    jit_forward = jax.jit(forward, in_shardings=(replicated, batch), out_shardings=batch)
    split_forward = jax.jit(
        jax.shard_map(
            lambda kb, xb: forward(kb[0], xb), mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")
        )
    )
    one_forward = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
    key, x = mod.apply_rng, jnp.ones((DEVICES, 1))

    def once():
        eager = np.asarray(forward(key, x))
        jitted = np.asarray(jit_forward(jax.device_put(key, replicated), jax.device_put(x, batch)))
        keys = jax.device_put(jax.random.split(key, DEVICES), batch)
        split = np.asarray(split_forward(keys, jax.device_put(x, batch)))
        one = np.asarray(one_forward(jax.device_put(key, replicated), jax.device_put(x, batch)))
        assert np.array_equal(eager, jitted) and len(set(split.ravel())) == DEVICES and len(set(one.ravel())) == 1

    t = time.perf_counter()
    once()
    cold = time.perf_counter() - t + (t - imported)
    warm = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        once()
        warm = min(warm, time.perf_counter() - t)
    return {"import_jax": imported - start, "cold": cold, "warm": warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.direct:
        print(json.dumps(direct()))
        return

    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(DEVICES),
    )
    command = [
        sys.executable,
        "-m",
        "rngaudit",
        "shard-check",
        "--devices",
        str(DEVICES),
        "--key",
        "split(key(0))[1]",
        "--fn",
        GUIDE_FN,
        "--allow-replicated",
        "--format",
        "json",
    ]
    walls, baselines = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        r = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        walls.append(time.perf_counter() - t)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert [c["status"] for c in doc["targets"][0]["checks"]] == ["pass", "pass", "allowed"]
        r = subprocess.run([sys.executable, __file__, "--direct"], cwd=REPO, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        baselines.append(json.loads(r.stdout))

    wall = statistics.median(walls)
    cold = statistics.median(b["cold"] for b in baselines)
    warm = statistics.median(b["warm"] for b in baselines)
    imp = statistics.median(b["import_jax"] for b in baselines)
    print(
        f"rngaudit shard-check, guide example, {DEVICES} forced CPU devices, {os.cpu_count()} cores, "
        f"median of {args.runs} runs"
    )
    print(
        f"  command wall time (fresh process)          {wall:7.2f} s   (runs: {', '.join(f'{w:.2f}' for w in walls)})"
    )
    print(f"  direct in-process, cold (+ compiles)       {cold:7.2f} s   ratio {wall / cold:5.1f}x")
    print(f"  direct in-process, warm (compiled)         {warm * 1e3:7.1f} ms  ratio {wall / warm:5.0f}x")
    print(f"  JAX import with {DEVICES} devices (not in cold)   {imp:7.2f} s")


if __name__ == "__main__":
    main()
