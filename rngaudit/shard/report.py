"""`shard-check` results as data, and their versioned, deterministic JSON form (`rngaudit.shard_check` v1)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import __version__

JSON_FORMAT = "rngaudit.shard_check"
JSON_FORMAT_VERSION = 1

PASS, FAIL, FINDING, ALLOWED, NOT_APPLICABLE = "pass", "fail", "finding", "allowed", "n/a"
STATUSES = (PASS, FAIL, FINDING, ALLOWED, NOT_APPLICABLE)
FAILING = (FAIL, FINDING)  # statuses that make the command exit 1


@dataclass(frozen=True)
class Check:
    """One comparison made on the devices. `details` is plain JSON data whose fields depend on `id`."""

    id: str
    title: str
    status: str
    message: str
    details: dict = field(default_factory=dict)

    @property
    def failing(self) -> bool:
        return self.status in FAILING


@dataclass(frozen=True)
class TargetResult:
    """The checks of one spec or one user function. `info` says what was run and how (plain JSON data)."""

    kind: str  # spec | fn
    name: str
    info: dict
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Environment:
    """What decides the values JAX computes, as the device process saw it after the checks ran."""

    jax: str
    jaxlib: str
    flax: str | None
    python: str
    prng_impl: str
    threefry_partitionable: bool
    enable_x64: bool
    xla_flags: str | None
    jax_platforms: str | None


@dataclass(frozen=True)
class DeviceSet:
    """The devices the checks ran on, in mesh order."""

    platform: str
    kind: str
    ids: tuple[int, ...]
    forced: bool  # CPU devices made with --devices

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class MeshLayout:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    device_ids: list  # nested lists of device ids, shaped like the mesh

    def describe(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))


@dataclass(frozen=True)
class ShardReport:
    environment: Environment
    devices: DeviceSet
    mesh: MeshLayout
    targets: tuple[TargetResult, ...]

    def checks(self) -> list[Check]:
        return [c for t in self.targets for c in t.checks]

    def count(self, status: str) -> int:
        return sum(1 for c in self.checks() if c.status == status)

    @property
    def failing(self) -> bool:
        return any(c.failing for c in self.checks())


def check_json(c: Check) -> dict:
    return {"id": c.id, "title": c.title, "status": c.status, "message": c.message, "details": c.details}


def to_json(r: ShardReport) -> dict:
    e, d, m = r.environment, r.devices, r.mesh
    return {
        "format": JSON_FORMAT,
        "format_version": JSON_FORMAT_VERSION,
        "rngaudit_version": __version__,
        "environment": {
            "jax": e.jax, "jaxlib": e.jaxlib, "flax": e.flax, "python": e.python,
            "jax_default_prng_impl": e.prng_impl, "jax_threefry_partitionable": e.threefry_partitionable,
            "jax_enable_x64": e.enable_x64, "XLA_FLAGS": e.xla_flags, "JAX_PLATFORMS": e.jax_platforms,
        },
        "devices": {"platform": d.platform, "kind": d.kind, "count": d.count, "ids": list(d.ids),
                    "forced": d.forced},
        "mesh": {"axis_names": list(m.names), "axis_sizes": list(m.sizes), "device_ids": m.device_ids},
        "targets": [{"kind": t.kind, "name": t.name, "info": t.info, "checks": [check_json(c) for c in t.checks]}
                    for t in r.targets],
        "summary": {"checks": len(r.checks()), "pass": r.count(PASS), "fail": r.count(FAIL),
                    "finding": r.count(FINDING), "allowed": r.count(ALLOWED),
                    "not_applicable": r.count(NOT_APPLICABLE), "failing": r.failing},
    }


def from_json(doc: dict) -> ShardReport:
    """The inverse of `to_json`: how the command reads what the device process reports."""
    e, d, m = doc["environment"], doc["devices"], doc["mesh"]
    env = Environment(e["jax"], e["jaxlib"], e["flax"], e["python"], e["jax_default_prng_impl"],
                      e["jax_threefry_partitionable"], e["jax_enable_x64"], e["XLA_FLAGS"], e["JAX_PLATFORMS"])
    devices = DeviceSet(d["platform"], d["kind"], tuple(d["ids"]), d["forced"])
    mesh = MeshLayout(tuple(m["axis_names"]), tuple(m["axis_sizes"]), m["device_ids"])
    targets = tuple(
        TargetResult(t["kind"], t["name"], t["info"],
                     tuple(Check(c["id"], c["title"], c["status"], c["message"], c["details"]) for c in t["checks"]))
        for t in doc["targets"])
    return ShardReport(env, devices, mesh, targets)
