"""Which devices and processes of a user's step drew identical randomness, mapped to mesh axes (no JAX here).

Each draw site's runs are grouped by where they ran: a device inside shard_map (its coordinates along the manual
mesh axes), or a process outside it. Equal key data at the same site means equal random bits. Identical
randomness along an axis that splits the data (each position holds other examples) is the finding: every data
shard gets the same dropout mask. Along an axis where the data is replicated (a model axis) it is expected.
Processes whose arguments stay on their own devices each run their own computation on their own data (the
multi-host data-parallel setting), so identical randomness across processes is a finding too; a computation
whose arguments span processes draws one global array, the same key on every process being required."""

from __future__ import annotations

import linecache
import os

from ..errors import UsageError
from ..spec.comments import ignore_comment, named_rules
from .report import ALLOWED, FINDING, INFO, PASS, Check, TargetResult

DATA_AXIS_NAMES = ("data", "batch", "dp", "fsdp", "replica", "dcn")  # what public models call data-parallel axes
SHOWN_GROUPS = 8  # groups of identical devices kept per draw in the details (and JSON)
PROCESS = "process"


def _site_key(s: dict) -> tuple:
    split = None if s.get("split_axes") is None else tuple(s["split_axes"])
    chain = tuple(tuple(c) for c in s.get("chain", ()))
    return (s["file"], s["line"], chain, s["sampler"], s["module"], tuple(s["shape"]), s.get("dtype"),
            tuple(s["manual_axes"]), split)  # fmt: skip


def _site_axes(site: dict, argument_axes: list[str]) -> tuple[list[str], str]:
    """The axes that split the data where a draw inside shard_map (or pmap) ran, and how that was told: the axis
    names first (a `model` axis is never data, whatever its weights' in_specs say), then the mapped function's
    in_specs, then the arguments' shardings, then a lone axis."""
    manual = site["manual_axes"]
    named = [a for a in manual if a.lower() in DATA_AXIS_NAMES or a == PMAP_AXIS]
    if named:
        return named, "the axis name"
    if site.get("split_axes") is not None:
        return list(site["split_axes"]), "the in_specs of the mapped function"
    sharded = [a for a in manual if a in argument_axes]
    if sharded:
        return sharded, "the arguments' shardings"
    if len(manual) == 1:
        return list(manual), "the only mapped axis"
    return [], "unknown"


_RULES = ("shard-check/step_randomness", "step_randomness")


def _ignored_at(site: dict) -> str | None:
    """`file:line` of a `# rngaudit: ignore` (or `ignore[shard-check/step_randomness]`) comment on a line of the
    draw's call chain: identical randomness there is intended."""
    for file, line in site.get("chain") or ([site["file"], site["line"]] if site["file"] else []):
        m = ignore_comment(linecache.getline(file, line))
        if m is None:
            continue
        rules = named_rules(m)
        if rules is None or any(r in _RULES for r in rules):
            return f"{_shown_path(file)}:{line}"
    return None


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
    via = f" called from {_shown_path(site['via'][0])}:{site['via'][1]}" if site.get("via") else ""
    return f"{site['sampler']} {tuple(site['shape'])} at {loc}{via}{module}"


def _disambiguate(sites: list[dict]) -> list[dict]:
    """Sites shown at the same line (one helper called from several places) name the first caller that differs."""
    by_line: dict = {}
    for s in sites:
        by_line.setdefault((s["file"], s["line"], s["module"], s["sampler"], tuple(s["shape"])), []).append(s)
    out = {id(s): s for s in sites}
    for group in by_line.values():
        if len(group) < 2:
            continue
        chains = [[tuple(c) for c in s.get("chain", ())] for s in group]
        for s, chain in zip(group, chains):
            for depth, frame in enumerate(chain):
                if any(len(o) <= depth or o[depth] != frame for o in chains if o is not chain):
                    if depth > 0:
                        out[id(s)] = dict(s, via=list(frame))
                    break
    return [out[id(s)] for s in sites]


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


def _check(site: dict, runs: list, local: bool, given: tuple[str, ...], argument_axes: list[str]) -> Check:
    where = _where_text(site)
    if given:
        data, source = list(given), "--data-axis"
    else:
        data, source = _site_axes(site, argument_axes) if site["manual_axes"] else ([], "unknown")
    known = source != "unknown"
    details = {
        "location": {"file": site["file"], "line": site["line"], "col": 1} if site["file"] else None,
        "module": site["module"],
        "sampler": site["sampler"],
        "shape": site["shape"],
        "manual_axes": site["manual_axes"],
        "runs": len(runs),
        "data_axes": data,
        "data_axes_from": source,
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
    n_same = sum(len(m) for m in same)
    unit = "devices" if manual else "processes"
    if len(same) == 1 and n_same == len(instances):
        how = f"all {n_same} {unit} drew the same randomness"
    else:
        how = (
            f"{n_same} of {len(instances)} {unit} drew the same randomness as another "
            f"({len(same)} group{'s' if len(same) > 1 else ''} of identical {unit})"
        )
    if finding_axes:
        ignored = _ignored_at(site)
        if ignored is not None:
            return Check(
                "step_randomness",
                title,
                ALLOWED,
                f"{where}: {how}, identical along {_axes_text(finding_axes)}: intended (ignore comment at {ignored})",
                details,
            )
        return Check(
            "step_randomness",
            title,
            FINDING,
            f"{where}: {how}, identical along {_axes_text(finding_axes)}, where each holds different data (every "
            f"data shard gets the same {site['sampler']} values); {_fix(finding_axes)}",
            details,
        )
    if not known:
        return Check(
            "step_randomness",
            title,
            INFO,
            f"{where}: {how}, identical along "
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
    seen: list[str] = []
    for s in sites.values():
        for a in s["manual_axes"]:
            if a not in seen:
                seen.append(a)
    known_axes = seen + [a for a in list(mesh_names) + argument_axes if a not in seen]
    unknown = [a for a in data_axes if a not in known_axes]
    if unknown:
        raise UsageError(
            f"--data-axis {unknown[0]}: the step has no mesh axis {unknown[0]!r}; its axes are "
            f"{', '.join(repr(a) for a in known_axes) or 'none'}"
        )
    # a site traced but never run drew nothing: Flax's shape check of an initialiser (under jax.eval_shape), a
    # branch not taken
    ran = [k for k in sites if runs[k]]
    shown = _disambiguate([sites[k] for k in ran])
    checks = [_check(site, runs[k], local, data_axes, argument_axes) for site, k in zip(shown, ran)]
    if not checks:
        checks.append(
            Check("step_randomness", "no draws", INFO, "the step drew no randomness (no jax.random sampler ran)", {})
        )
    used: list[str] = []
    sources: list[str] = []
    for c in checks:
        for a in c.details.get("data_axes", ()):
            if a not in used:
                used.append(a)
        src = c.details.get("data_axes_from")
        if src and src != "unknown" and src not in sources:
            sources.append(src)
    data = list(data_axes) or used
    source = "--data-axis" if data_axes else "; ".join(sources) or "unknown"
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
