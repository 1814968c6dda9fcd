"""Which devices and processes of a user's step drew identical randomness, mapped to mesh axes (no JAX here).

Each draw site's runs are grouped by where they ran: a device inside shard_map (its coordinates along the manual
mesh axes), or a process outside it. Equal key data at the same site means equal random bits. Identical
randomness along an axis that splits the data (each position holds other examples) is the finding: every data
shard gets the same dropout mask. Along an axis where the data is replicated (a model axis) it is expected.
Processes whose arguments stay on their own devices each run their own computation on their own data (the
multi-host data-parallel setting), so identical randomness across processes is a finding too; a computation
whose arguments span processes draws one global array, the same key on every process being required."""

from __future__ import annotations

import os

from .report import FINDING, INFO, PASS, Check, TargetResult

DATA_AXIS_NAMES = ("data", "batch", "dp", "fsdp", "replica", "dcn")  # what public models call data-parallel axes
SHOWN_GROUPS = 8  # groups of identical devices kept per draw in the details (and JSON)
PROCESS = "process"


def _site_key(s: dict) -> tuple:
    split = None if s.get("split_axes") is None else tuple(s["split_axes"])
    return (
        s["file"],
        s["line"],
        s["sampler"],
        s["module"],
        tuple(s["shape"]),
        s["bit_width"],
        tuple(s["manual_axes"]),
        split,
    )


def _resolve_axes(given: tuple[str, ...], argument_axes: list[str], seen: list[str]) -> tuple[list[str], str]:
    if given:
        return list(given), "--data-axis"
    if argument_axes:
        return list(argument_axes), "the arguments' shardings"
    named = [a for a in seen if a.lower() in DATA_AXIS_NAMES]
    if named:
        return named, "the axis name"
    if len(seen) == 1:
        return list(seen), "the only mesh axis"
    return [], "unknown"


def _shown_path(file: str) -> str:
    """A path as the user ran from: relative to the working directory when inside it."""
    here = os.path.realpath(os.getcwd())
    try:
        rel = os.path.relpath(os.path.realpath(file), here)
    except ValueError:  # another drive (Windows)
        return file
    return file if rel.startswith(os.pardir) else rel


def _where_text(site: dict) -> str:
    loc = f"{_shown_path(site['file'])}:{site['line']}" if site["file"] else "(no user frame)"
    module = f" ({site['module']})" if site["module"] else ""
    return f"{site['sampler']} {tuple(site['shape'])} at {loc}{module}"


def _member_text(m: tuple, local: bool) -> str:
    process, coords = m
    parts = [f"{'pmap' if a == PMAP_AXIS else a}={i}" for a, i in coords]
    if local:
        parts.insert(0, f"process {process}")
    return ",".join(parts) if parts else f"process {process}"


PMAP_AXIS = "_internal_pmap_axis_name"  # what jax.pmap calls its axis when given no axis_name


def _axis_text(a: str) -> str:
    return "processes" if a == PROCESS else "the pmap axis" if a == PMAP_AXIS else f"'{a}'"


def _axes_text(axes: list[str]) -> str:
    return ", ".join(_axis_text(a) for a in axes)


def _fix(axes: list[str]) -> str:
    fixes = []
    mesh_axes = [a for a in axes if a != PROCESS]
    if PMAP_AXIS in mesh_axes:
        fixes.append(
            "name the pmap axis (jax.pmap(step, axis_name='batch')) and fold each device's position into the key "
            "inside it (key = jax.random.fold_in(key, jax.lax.axis_index('batch'))), or pass keys split per device"
        )
        mesh_axes = [a for a in mesh_axes if a != PMAP_AXIS]
    if mesh_axes:
        fold = "".join(f", jax.lax.axis_index({a!r})" for a in mesh_axes[:1])
        fixes.append(
            f"fold each device's position into the key inside the mapped function (key = "
            f"jax.random.fold_in(key{fold})), or "
            f"pass keys split and sharded over {_axes_text(mesh_axes)}"
        )
    if PROCESS in axes:
        fixes.append(
            "each process seeded the same key: fold in the process (key = jax.random.fold_in(key, "
            "jax.process_index())) before the step"
        )
    return "; ".join(fixes)


def _check(site: dict, runs: list, local: bool, data: list[str], source: str, given: bool) -> Check:
    where = _where_text(site)
    known = bool(data)
    if not given and site["manual_axes"] and site.get("split_axes") is not None:
        # the shard_map (or pmap) the draw ran in says which of its axes split its inputs
        data, source, known = list(site["split_axes"]), "the in_specs of the mapped function", True
    details = {
        "location": {"file": site["file"], "line": site["line"], "col": 1} if site["file"] else None,
        "module": site["module"],
        "sampler": site["sampler"],
        "shape": site["shape"],
        "manual_axes": site["manual_axes"],
        "runs": len(runs),
    }
    title = f"{site['sampler']} draw"
    manual = site["manual_axes"]
    instances: dict = {}
    for process, coords, words in runs:
        instances.setdefault((process if local else 0, coords), []).append(words)
    details["instances"] = len(instances)
    if len(instances) == 1:
        how = (
            "drawn for the whole batch outside shard_map (jax.jit gives each device its own slice of the random values)"
            if not manual
            else "drawn on one device"
        )
        if not manual and not local and runs and len({r[0] for r in runs}) > 1:
            how = "one global draw over every process's devices (the same key on each process is required)"
        return Check("step_randomness", title, PASS, f"{where}: {how}", details)
    groups: dict = {}
    for member, keys in instances.items():
        groups.setdefault(tuple(sorted(keys)), []).append(member)
    same = [sorted(members) for members in groups.values() if len(members) > 1]
    first_key = {m: list(min(instances[m])) for members in same for m in members}
    if not same:
        return Check(
            "step_randomness",
            title,
            PASS,
            f"{where}: each of the {len(instances)} {'devices' if manual else 'processes'} drew its own randomness",
            details,
        )
    shown: list[dict] = []
    finding_axes: list[str] = []
    other_axes: list[str] = []
    for members in sorted(same, key=lambda m: (-len(m), m)):
        axes = [a for a in manual if len({dict(m[1]).get(a) for m in members}) > 1]
        if local and len({m[0] for m in members}) > 1:
            axes.append(PROCESS)
        bad = [a for a in axes if a == PROCESS or a in data]
        for a in bad:
            if a not in finding_axes:
                finding_axes.append(a)
        for a in axes:
            if a not in bad and a not in other_axes:
                other_axes.append(a)
        if len(shown) < SHOWN_GROUPS:
            shown.append(
                {"members": [_member_text(m, local) for m in members], "axes": axes, "key": first_key[members[0]]}
            )
    details["same"] = shown
    details["same_groups"] = len(same)
    details["data_axes"] = data
    n_same = sum(len(m) for m in same)
    unit = "devices" if manual else "processes"
    if finding_axes:
        return Check(
            "step_randomness",
            title,
            FINDING,
            f"{where}: {n_same} of {len(instances)} {unit} drew the same randomness, identical along "
            f"{_axes_text(finding_axes)}, where each holds different data (every data shard gets the same "
            f"{site['sampler']} values); {_fix(finding_axes)}",
            details,
        )
    if not known:
        return Check(
            "step_randomness",
            title,
            INFO,
            f"{where}: {n_same} of {len(instances)} {unit} drew the same randomness, identical along "
            f"{_axes_text(other_axes)}; shard-check cannot tell whether the data differs along "
            f"{'it' if len(other_axes) == 1 else 'them'}: give --data-axis NAME for each axis that splits the batch",
            details,
        )
    return Check(
        "step_randomness",
        title,
        PASS,
        f"{where}: identical only along {_axes_text(other_axes)}, where the data is replicated (expected"
        + (f"; the data is split along {_axes_text(data)}, from {source})" if data else f", from {source})"),
        details,
    )


def analyse(
    results: list[dict], data_axes: tuple[str, ...], mesh_names: tuple[str, ...], processes: int
) -> TargetResult:
    """The step's checks from every process's observation (`results`, one per process, as step_checks returns)."""
    first = results[0]
    spans = any(r["spans_processes"] for r in results)
    local = processes > 1 and not spans
    sites: dict = {}
    runs: dict = {}
    argument_axes: list[str] = []
    for r in results:
        for a in r["argument_axes"]:
            if a not in argument_axes:
                argument_axes.append(a)
        obs = r["observation"]
        own = []
        for s in obs["sites"]:
            k = _site_key(s)
            sites.setdefault(k, s)
            runs.setdefault(k, [])
            own.append(k)
        for site, coords, words in obs["records"]:
            runs[own[site]].append((obs["process"], tuple((a, i) for a, i in coords), tuple(words)))
    seen = list(mesh_names)
    for s in sites.values():
        for a in s["manual_axes"]:
            if a not in seen:
                seen.append(a)
    data, source = _resolve_axes(data_axes, argument_axes, seen)
    # a site traced but never run drew nothing: Flax's shape check of an initialiser (under jax.eval_shape), a
    # branch not taken
    ran = [k for k in sites if runs[k]]
    checks = [_check(sites[k], runs[k], local, data, source, bool(data_axes)) for k in ran]
    if not checks:
        checks.append(
            Check("step_randomness", "no draws", INFO, "the step drew no randomness (no jax.random sampler ran)", {})
        )
    info = {
        "fn": first["fn"],
        "args": first["args"],
        "processes": processes,
        "process_local": local,
        "data_axes": data,
        "data_axes_from": source,
        "draw_sites": len(ran),
        "traced_only": len(sites) - len(ran),
        "draws": sum(len(v) for v in runs.values()),
    }
    return TargetResult("step", first["fn"], info, tuple(checks))
