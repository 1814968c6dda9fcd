"""`shard-check` reports as versioned, deterministic JSON (format `rngaudit.shard_check`, version 1), and back:
the device process hands its report to the command in this form."""

from __future__ import annotations

from .. import __version__
from ..shard.report import (
    ALLOWED,
    FAIL,
    FINDING,
    INFO,
    NOT_APPLICABLE,
    PASS,
    Check,
    DeviceSet,
    Environment,
    MeshLayout,
    ShardReport,
    TargetResult,
)

JSON_FORMAT = "rngaudit.shard_check"
JSON_FORMAT_VERSION = 1


def check_json(c: Check) -> dict:
    return {"id": c.id, "title": c.title, "status": c.status, "message": c.message, "details": c.details}


def to_json(r: ShardReport) -> dict:
    e, d, m = r.environment, r.devices, r.mesh
    return {
        "format": JSON_FORMAT,
        "format_version": JSON_FORMAT_VERSION,
        "rngaudit_version": __version__,
        "environment": {
            "jax": e.jax,
            "jaxlib": e.jaxlib,
            "flax": e.flax,
            "python": e.python,
            "jax_default_prng_impl": e.prng_impl,
            "jax_threefry_partitionable": e.threefry_partitionable,
            "jax_enable_x64": e.enable_x64,
            "XLA_FLAGS": e.xla_flags,
            "JAX_PLATFORMS": e.jax_platforms,
        },
        "devices": {
            "platform": d.platform,
            "kind": d.kind,
            "count": d.count,
            "ids": list(d.ids),
            "forced": d.forced,
            "processes": d.processes,
        },
        "mesh": {"axis_names": list(m.names), "axis_sizes": list(m.sizes), "device_ids": m.device_ids},
        "targets": [
            {"kind": t.kind, "name": t.name, "info": t.info, "checks": [check_json(c) for c in t.checks]}
            for t in r.targets
        ],
        "summary": {
            "checks": len(r.checks()),
            "pass": r.count(PASS),
            "fail": r.count(FAIL),
            "finding": r.count(FINDING),
            "allowed": r.count(ALLOWED),
            "info": r.count(INFO),
            "not_applicable": r.count(NOT_APPLICABLE),
            "failing": r.failing,
        },
    }


def from_json(doc: dict) -> ShardReport:
    """The inverse of `to_json`: how the command reads what the device process reports."""
    e, d, m = doc["environment"], doc["devices"], doc["mesh"]
    env = Environment(
        e["jax"],
        e["jaxlib"],
        e["flax"],
        e["python"],
        e["jax_default_prng_impl"],
        e["jax_threefry_partitionable"],
        e["jax_enable_x64"],
        e["XLA_FLAGS"],
        e["JAX_PLATFORMS"],
    )
    devices = DeviceSet(d["platform"], d["kind"], tuple(d["ids"]), d["forced"], d.get("processes", 1))
    mesh = MeshLayout(tuple(m["axis_names"]), tuple(m["axis_sizes"]), m["device_ids"])
    targets = tuple(
        TargetResult(
            t["kind"],
            t["name"],
            t["info"],
            tuple(Check(c["id"], c["title"], c["status"], c["message"], c["details"]) for c in t["checks"]),
        )
        for t in doc["targets"]
    )
    return ShardReport(env, devices, mesh, targets)
