"""Human-readable `shard-check` output with rich: the devices, the environment, and each check with its verdict."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ..shard.report import (
    ALLOWED,
    FAIL,
    FINDING,
    INFO,
    NOT_APPLICABLE,
    PASS,
    STATUSES,
    Check,
    ShardReport,
    TargetResult,
)

_STYLE = {PASS: "green", FAIL: "bold red", FINDING: "bold red", ALLOWED: "yellow", INFO: "cyan", NOT_APPLICABLE: "dim"}
MAX_DEVICES_SHOWN = 16  # per-device values listed for a shard_map check; --format json lists them all
_INDENT = "    "


def _value(v) -> str:
    return f"{v:.8g}" if isinstance(v, float) else str(v)


def _slice_text(s: dict) -> str:
    shown = ", ".join(_value(v) for v in s["values"][:4])
    more = ", ..." if s["size"] > 4 else ""
    return f"{s['device']}: [{shown}{more}]" if s["size"] > 1 else f"{s['device']}: {shown}"


def _target_head(t: TargetResult) -> Text:
    i = t.info
    head = Text(t.name, style="bold")
    if t.kind == "spec":
        sel = "".join(f"  --path {g}" for g in i["paths"]) + "".join(f"  --stream {s}" for s in i["streams"])
        head.append(
            f"  spec, phase={i['phase']}, impl={i['prng_impl']}, "
            f"threefry_partitionable={str(i['threefry_partitionable']).lower()}; "
            f"{i['checked_keys']} of {i['keys']} keys checked{sel}"
        )
        if i.get("rules"):
            head.append(f"; rules: {i['rules']}")
        if i["not_checked_discarded"]:
            head.append(f" ({i['not_checked_discarded']} exist only in traces Flax discards)")
        if i["draw"]:
            head.append(f"; --draw {i['draw']}")
        return head
    if t.kind == "step":
        procs = i["processes"]
        where = (
            (f"{procs} processes, each on its own data" if i["process_local"] else f"{procs} processes")
            if procs > 1
            else "1 process"
        )
        axes = f"; data axes {', '.join(i['data_axes'])} (from {i['data_axes_from']})" if i["data_axes"] else ""
        head.append(
            f"  training step with --args {i['args']}, run once as written on {where}{axes}; {i['draws']} draw(s) "
            f"observed at {i['draw_sites']} site(s)"
        )
        return head
    key, x = i["key"], i["x"]
    fill = "ones" if x["fill"] == "ones" else f"normal (seed {x['seed']})"
    head.append(
        f"  function; key {key['expr']} = [{' '.join(map(str, key['data']))}] ({key['impl']}); "
        f"x {fill} {tuple(x['shape'])} {x['dtype']}; batch {i['batch_partition']}, "
        f"{i['rows_per_device']} row(s) per device"
    )
    if i["mesh_axes_only"]:
        head.append("; names mesh axes, so it runs only inside shard_map")
    return head


def _check_extra(c: Check) -> list[str]:
    """Lines under a check: each device's values, or the rows that differ."""
    d = c.details
    lines = []
    if "slices" in d:
        slices = d["slices"]
        shown = "  ".join(_slice_text(s) for s in slices[:MAX_DEVICES_SHOWN])
        more = f"  ... ({len(slices) - MAX_DEVICES_SHOWN} more devices)" if len(slices) > MAX_DEVICES_SHOWN else ""
        lines.append(f"devices  {shown}{more}")
    if c.id == "jit_equals_eager" and d.get("mismatched"):
        lines.append("eager    " + ", ".join(_value(v) for v in d["eager"]))
        lines.append("jit      " + ", ".join(_value(v) for v in d["jit"]))
    for g in d.get("same", []):
        members = g["members"]
        shown = ", ".join(members[:MAX_DEVICES_SHOWN]) + (
            f", ... ({len(members) - MAX_DEVICES_SHOWN} more)" if len(members) > MAX_DEVICES_SHOWN else ""
        )
        lines.append(f"same randomness on {shown}")
    if d.get("same_groups", 0) > len(d.get("same", [])):
        lines.append(
            f"... {d['same_groups'] - len(d['same'])} more groups (--format json lists the first {len(d['same'])})"
        )
    for m in d.get("mismatches", []):
        if "base" in m:
            lines.append(f"{m['base']}: host {m['host']} device {m['device']}")
        elif "draw" in m:
            lines.append(
                f"#{m['index']} {m['path_str']} {m['stream']} count {m['count']} {m['draw']} "
                f"{m['partition']}: {m['mismatched']} of {m['elements']} values differ "
                f"(largest {_value(m['max_abs_diff'])})"
            )
        else:
            lane = f" lane {m['lane']}" if m["lane"] else ""
            lines.append(
                f"#{m['index']} {m['path_str']} {m['stream']} count {m['count']}{lane}: "
                f"host {m['host']} device {m['device']}"
            )
    if "mismatches" in d and len(d["mismatches"]) < d["mismatched"]:
        lines.append(
            f"... {d['mismatched'] - len(d['mismatches'])} more (--format json lists the first {len(d['mismatches'])})"
        )
    return lines


def render_shard(report: ShardReport, console: Console) -> None:
    dev, mesh, env = report.devices, report.mesh, report.environment
    per = dev.count // max(dev.processes, 1)
    forced = f", forced with --devices {per}" if dev.forced else ""
    if dev.processes > 1:
        forced += f", in each of {dev.processes} processes joined with jax.distributed"
    head = Text("shard-check", style="bold")
    head.append(
        f" on {dev.count} {dev.platform} device(s) ({dev.kind}{forced}); mesh {mesh.describe()}, "
        f"device ids {mesh.device_ids}"
    )
    console.print(head)
    console.print(
        f"environment  jax {env.jax}, jaxlib {env.jaxlib}, flax {env.flax or '(not imported)'}, Python {env.python}"
    )
    console.print(
        f"             jax_default_prng_impl={env.prng_impl}  "
        f"jax_threefry_partitionable={env.threefry_partitionable}  jax_enable_x64={env.enable_x64}"
    )
    console.print(
        f"             XLA_FLAGS={env.xla_flags if env.xla_flags is not None else '(unset)'}  "
        f"JAX_PLATFORMS={env.jax_platforms if env.jax_platforms is not None else '(unset)'}"
    )
    for t in report.targets:
        console.print()
        console.print(_target_head(t))
        for c in t.checks:
            line = Text(_INDENT)
            line.append(c.status.upper().ljust(8), style=_STYLE[c.status])
            line.append(c.title.ljust(22), style="bold")
            line.append(c.message)
            console.print(line)
            for extra in _check_extra(c):
                console.print(Text(_INDENT + " " * 30 + extra, style="dim" if c.status == PASS else ""))
    counts = {s: report.count(s) for s in STATUSES}
    console.print()
    console.print(
        f"{len(report.checks())} checks: {counts[PASS]} pass, {counts[FAIL]} fail, {counts[FINDING]} "
        f"finding, {counts[ALLOWED]} allowed, {counts[INFO]} info, {counts[NOT_APPLICABLE]} n/a",
        style="bold red" if report.failing else "bold",
    )
