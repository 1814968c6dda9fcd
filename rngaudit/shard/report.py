"""`shard-check` results as data: the checks of each spec or function, and the devices and environment."""

from __future__ import annotations

from dataclasses import dataclass, field

PASS, FAIL, FINDING, ALLOWED, INFO, NOT_APPLICABLE = "pass", "fail", "finding", "allowed", "info", "n/a"
STATUSES = (PASS, FAIL, FINDING, ALLOWED, INFO, NOT_APPLICABLE)
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
    processes: int = 1  # --processes: the devices of that many local processes, in process order

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
