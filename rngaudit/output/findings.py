"""Every command's findings as one plain list (rule, level, message, file:line:col) for the CI formats."""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..collision.nnx import NnxAudit
from ..collision.suppress import rule_id
from ..errors import Location

if TYPE_CHECKING:
    from ..collision.results import CollisionsReport
    from ..refactor.compare import Comparison, Entry
    from ..refactor.keys_file import Capture

ERROR, WARNING, NOTE = "error", "warning", "note"  # SARIF levels; `github` maps them to ::error/::warning/::notice


@dataclass(frozen=True)
class Rule:
    """A kind of finding: what it means, and how to fix it (SARIF `reportingDescriptor`)."""

    id: str
    name: str
    summary: str
    help: str


@dataclass(frozen=True)
class Finding:
    """One problem to annotate. `related` are the other places that take part (e.g. the other call sites)."""

    rule: str
    level: str
    message: str
    location: Location | None
    related: tuple[tuple[Location, str], ...] = ()
    suppression: tuple[str, str] | None = None  # SARIF (kind, justification) of a finding left out of the report


# ---------------------------------------------------------------- derive
DERIVE_RULES = (
    Rule(
        "derive/stream-fallback",
        "StreamFallback",
        "make_rng asks for a stream init/apply was not given: Flax falls back to 'params'",
        "The key comes from the 'params' stream and shares its counter, so adding or removing a param "
        "changes it. Pass the stream in `rngs=` (the spec's `rngs:`), or ask for 'params' on purpose.",
    ),
)


def derive_findings(report, strict: bool) -> list[Finding]:
    """`derive` has findings only with --strict: each statement whose keys fall back to another stream
    ('params' in Linen, 'default' in NNX), once."""
    if not strict:
        return []
    nnx = getattr(report.spec, "flavour", "linen") == "nnx"
    rows: dict = {}
    for c in report.calls:
        d = c.derivation
        if d.fallback:
            where = (d.loc, d.requested, d.site) if nnx else (d.location, d.stream_requested, d.path_str)
            rows.setdefault(where, []).append(c.index if nnx else d.index)
    out = []
    for (loc, stream, path), idx in rows.items():
        keys = f"{len(idx)} keys, rows #{idx[0]}-#{idx[-1]}" if len(idx) > 1 else f"row #{idx[0]}"
        msg = (
            f"{path}: stream {stream!r} is served by 'default' ({keys}), sharing its counter: the Rngs has "
            f"no {stream!r}; add `{stream}:` to rngs, or draw from 'default' on purpose"
            if nnx
            else f"{path}: make_rng({stream!r}) falls back to 'params' ({keys}): the stream is not in "
            f"rngs; pass it to init/apply or ask for 'params' on purpose"
        )
        out.append(Finding("derive/stream-fallback", ERROR, msg, loc))
    return out


# ---------------------------------------------------------------- collisions
COLLISION_RULES = (
    Rule(
        "collisions/concatenation",
        "Concatenation",
        "two call sites get the same key: their path names concatenate to the same hashed bytes",
        "Flax hashes the path names and the count with no separator (class 1). Rename one module, or turn on "
        "flax_fix_rng_separator (which changes every key).",
    ),
    Rule(
        "collisions/jit-trace-reuse",
        "JitTraceReuse",
        "one call site draws the same key twice: jax reused an nn.jit trace and the count did not move",
        "Before flax 0.10.2 jax reuses an nn.jit trace whose module fields, counters and variables match an earlier "
        "call, and Python does not run, so counters stay. Upgrade to flax 0.10.2 or later (nn.jit forks a fresh "
        "key on every call), or give each call its own jitted module.",
    ),
    Rule(
        "collisions/count-meets-name",
        "CountMeetsName",
        "two call sites get the same key: a count's bytes spell the end of a name",
        "The count is hashed as big-endian bytes right after the names (class 2). Rename one module, or turn on "
        "flax_fix_rng_separator (which changes every key).",
    ),
    Rule(
        "collisions/hash-word",
        "HashWord",
        "two call sites get the same key: different bytes share a 32-bit SHA-1 word",
        "Flax keeps 32 bits of SHA-1 (class 3). Rename one of the modules.",
    ),
    Rule(
        "collisions/shared-seed",
        "SharedSeed",
        "call sites of different streams or base keys get the same key: the streams were given the same key",
        "The stream name is not hashed (class 4): give each stream its own key, e.g. split one key.",
    ),
    Rule(
        "collisions/unsplit-lanes",
        "UnsplitLanes",
        "the lanes of a vmap/scan share every key of a stream that is not split",
        "split_rngs is false for the stream (class 4, information). Set split_rngs for it if each lane should "
        "draw its own randomness.",
    ),
    Rule(
        "collisions/shared-stream-key",
        "SharedStreamKey",
        "NNX: draws of different streams get the same key: the streams hold the same key",
        "NNX keys are fold_in(stream key, count), the stream name is not hashed: give each stream its own seed.",
    ),
    Rule(
        "collisions/count-rewind",
        "CountRewind",
        "NNX: a stream hands out a key again: its count went back",
        "A jitted step whose returned state is dropped starts from the same RNG counts: keep the state it "
        "returns (nnx.update), or use nnx.jit.",
    ),
    Rule(
        "collisions/broadcast-lanes",
        "BroadcastLanes",
        "NNX: every lane of an nnx.vmap draws the same key: the stream is broadcast, not split",
        "Split the stream per lane with nnx.split_rngs and map it with nnx.StateAxes in the vmap's in_axes.",
    ),
    Rule(
        "collisions/frozen-scan-broadcast",
        "FrozenScanBroadcast",
        "NNX: a stream broadcast into nnx.scan draws the same keys at every call",
        "nnx.scan drops the count update of a broadcast stream, so each call repeats the keys of the call before: "
        "draw the key outside the scan and pass it in.",
    ),
    Rule(
        "collisions/keyless-dropout",
        "KeylessDropout",
        "NNX: a Dropout built without rngs is given the same key at every call",
        "`drop(x, rngs=key)` uses the key as it is, so the same units are dropped every step: split a fresh key per "
        "call (or give the Dropout its own stream).",
    ),
    Rule(
        "collisions/bridge-constant-default",
        "BridgeConstantDefault",
        "bridge.ToLinen applied without a stream its NNX module draws: the constant key(0) serves it",
        "ToLinen adds a `default` stream seeded with 0 at apply, so a Dropout inside draws the same mask at every "
        "apply: pass the stream to apply (rngs={'dropout': key}), a new key each step.",
    ),
    Rule(
        "collisions/reseed-order",
        "ReseedOrder",
        "NNX: after nnx.reseed a stream draws the keys another stream drew",
        "nnx.reseed visits streams in sorted attribute order, not construction order (information).",
    ),
    Rule(
        "collisions/reseed-repeat",
        "ReseedRepeat",
        "NNX: after nnx.reseed a stream draws the keys it drew before",
        "Reseeding with a seed used before repeats keys; intended when reproducing a call (information).",
    ),
    Rule(
        "collisions/scan-broadcast",
        "ScanBroadcast",
        "NNX: the steps of one nnx.scan share a broadcast stream's key",
        "The recurrent-dropout pattern, one mask per sequence (information); carry the stream for a key per step.",
    ),
    Rule(
        "collisions/default-fallback",
        "DefaultFallback",
        "NNX: a stream the Rngs lacks is served by `default`, sharing its counter",
        "Add the stream to the Rngs, or draw from `default` on purpose (information).",
    ),
    Rule(
        "collisions/latent",
        "LatentCollision",
        "module paths whose keys would be equal at higher counts",
        "A shorter path drawing more keys would meet a longer path's keys (information). Rename a module if "
        "the model may draw that many keys.",
    ),
    Rule(
        "collisions/input-error",
        "InputError",
        "an input could not be audited: it cannot be read, is not a valid spec, or models what Flax raises on",
        "The message says what is wrong at file:line:col and how to fix it; the other inputs were audited, and the "
        "run exits 2.",
    ),
)


def _site_text(s) -> str:
    lane = f" lane {list(s.lane)}" if s.lane else ""
    return f"{s.path_str} ({s.stream}, count {s.count}{lane}) at {s.location}"


def _fix_text(separator, renames, rename_note: str) -> str:
    parts = []
    if renames:
        parts.append(
            "; ".join(
                f"rename {r.path_str}{f' at {r.location}' if r.location else ''} to {r.new_name!r}" for r in renames
            )
            + " (verified)"
        )
    elif rename_note:
        parts.append(rename_note)
    if not separator.flag and separator.removes:
        parts.append("fix_rng_separator: true also removes it, but changes every key")
    return ". Fix: " + ". ".join(parts) if parts else ""


def _nnx_collision_findings(a: NnxAudit, failing) -> list[Finding]:
    out = []
    for c in a.collisions:
        level = ERROR if c.category in failing else (WARNING if c.failing else NOTE)
        sites = c.sites
        if c.category == "bridge_constant_default":
            msg = f"{c.category}: {c.why}. Fix: {c.fix}"
        elif c.key is None:
            msg = f"{c.category}: {sites[0].site} (stream {sites[0].requested!r}): {c.why}. Fix: {c.fix}"
        else:
            msg = f"{c.category}: {len(sites)} draws get the same key: {c.why}. Fix: {c.fix}"
        out.append(
            Finding(
                rule_id(c.category),
                level,
                msg,
                sites[0].location,
                tuple((s.location, f"{s.site} {s.stream_path} count {s.count}") for s in sites[1:]),
            )
        )
    return out


def collision_findings(report: CollisionsReport) -> list[Finding]:
    """One finding per input that could not be audited, then one per collision and per latent collision, at its
    first call site; the others are related."""
    out = [Finding("collisions/input-error", ERROR, e.message, e.location) for e in report.errors]
    return out + _audit_findings(report.audits, report.fail_on)


_SUPPRESSION = {
    "inline": ("inSource", "a `# rngaudit: ignore` comment on a call site's line"),
    "config": ("external", "a per-path-ignore of the configuration or command line"),
    "baseline": ("external", "listed in the baseline file"),
}


def suppressed_findings(report: CollisionsReport) -> list[Finding]:
    """The findings ignore comments, per-path ignores and the baseline left out, each with its SARIF suppression
    (code scanning shows them as suppressed, not as open alerts)."""
    import dataclasses

    out: list[Finding] = []
    for s in report.suppressed:
        kind, why = _SUPPRESSION[s.reason]
        out.extend(dataclasses.replace(f, suppression=(kind, why)) for f in _audit_findings((s.audit,), report.fail_on))
    return out


def _audit_findings(audits, failing) -> list[Finding]:
    out: list[Finding] = []
    for a in audits:
        if isinstance(a, NnxAudit):
            out.extend(_nnx_collision_findings(a, failing))
            continue
        for c in a.collisions:
            sites = c.sites
            level = ERROR if c.category in failing else (WARNING if c.failing else NOTE)
            shown = ", ".join(_site_text(s) for s in sites[:4]) + (
                f" and {len(sites) - 4} more" if len(sites) > 4 else ""
            )
            msg = (
                f"class {c.collision_class} ({c.category}): {len(sites)} call sites get the same key: {shown}"
                + _fix_text(c.separator, c.renames, c.rename_note)
            )
            out.append(
                Finding(
                    rule_id(c.category),
                    level,
                    msg,
                    sites[0].location,
                    tuple((s.location, f"{s.path_str} count {s.count}") for s in sites[1:]),
                )
            )
        for lt in a.latent:
            level = ERROR if "latent" in failing else NOTE
            partners = ", ".join(
                f"{p.site.path_str} at count {p.counts[1]} (meets count {p.counts[0]})" for p in lt.partners[:4]
            ) + (f" and {len(lt.partners) - 4} more" if len(lt.partners) > 4 else "")
            msg = (
                f"latent: {_site_text(lt.site)} reaches count {lt.max_count}; at higher counts its keys equal "
                f"those of {partners}" + _fix_text(lt.separator, lt.renames, lt.rename_note)
            )
            out.append(
                Finding(
                    "collisions/latent",
                    level,
                    msg,
                    lt.site.location,
                    tuple((p.site.location, p.site.path_str) for p in lt.partners),
                )
            )
    return out


# ---------------------------------------------------------------- shard-check
SHARD_CHECK_RULES = (
    Rule(
        "shard-check/root_keys",
        "RootKeys",
        "root keys computed on the devices differ from the host's",
        "The spec's rngs expressions evaluated under jax.jit must equal the host derivation on every device.",
    ),
    Rule(
        "shard-check/base_keys",
        "BaseKeys",
        "lane, loop or fork base keys on the devices differ from the host's",
        "vmap/scan splits, while_loop folds and jit forks must equal the host derivation.",
    ),
    Rule(
        "shard-check/keys",
        "Keys",
        "keys re-derived on the devices differ from the host derivation",
        "fold_in(base, hash word) under jax.jit with rows sharded must equal the host's keys bit for bit.",
    ),
    Rule(
        "shard-check/draws",
        "Draws",
        "values drawn under jax.jit with sharded output differ from the eager draw",
        "A draw must give the same values whether its output is sharded or not.",
    ),
    Rule(
        "shard-check/jit_equals_eager",
        "JitEqualsEager",
        "the function under jax.jit differs from its eager run",
        "With the batch sharded, jax.jit must reproduce the eager output (up to XLA's rounding, or within --atol).",
    ),
    Rule(
        "shard-check/shard_map_split_keys",
        "ShardMapSplitKeys",
        "under shard_map with one key per device, devices drew the same values",
        "The output does not depend on the key, or the key is not used per device.",
    ),
    Rule(
        "shard-check/shard_map_replicated_key",
        "SameRandomnessOnEveryDevice",
        "under shard_map with one replicated key, devices drew the same values",
        "The function is called with one replicated key (--replicated-key): pass each device its own key "
        "(split with in_specs over the mesh axis) or fold in jax.lax.axis_index; --allow-replicated if "
        "identical randomness is intended.",
    ),
)


def _fn_location(target) -> Location | None:
    """Where `--fn FILE.py:NAME` (or `module:NAME`) defines NAME, found without importing it."""
    where, _, attr = target.name.rpartition(":")
    path = where if where.endswith(".py") or "/" in where or os.sep in where else _module_file(where)
    if path is None or not os.path.isfile(path):
        return None
    line = 1
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
        scope = tree.body
        for part in attr.split("."):
            node = next(
                (
                    n
                    for n in scope
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
                ),
                None,
            )
            if node is None:
                break
            line = node.lineno
            scope = node.body
    except (OSError, SyntaxError, ValueError):
        pass
    return Location(path, line, 1)


def _module_file(module: str) -> str | None:
    parts = module.split(".")
    for base in [os.getcwd()] + [p for p in sys.path if p]:
        for candidate in (os.path.join(base, *parts) + ".py", os.path.join(base, *parts, "__init__.py")):
            if os.path.isfile(candidate):
                return os.path.relpath(candidate) if base == os.getcwd() else candidate
    return None


def _check_location(target, check) -> Location | None:
    if target.kind == "step":
        loc = check.details.get("location")
        return Location(loc["file"], loc["line"], loc["col"]) if loc else None
    if target.kind == "fn":
        return _fn_location(target)
    for m in check.details.get("mismatches") or ():
        loc = m.get("location") if isinstance(m, dict) else None
        if loc:
            return Location(loc["file"], loc["line"], loc["col"])
    return Location(target.name, 1, 1)


def shard_findings(report) -> list[Finding]:
    """Every check that failed, found the same randomness, or found it and was told it is intended."""
    out = []
    for t in report.targets:
        for c in t.checks:
            if c.status not in ("fail", "finding", "allowed"):
                continue
            level = NOTE if c.status == "allowed" else ERROR
            out.append(
                Finding(f"shard-check/{c.id}", level, f"{t.name}: {c.title}: {c.message}", _check_location(t, c))
            )
    return out


def repository_root(start: str | None = None) -> str | None:
    """The checkout CI annotates: $GITHUB_WORKSPACE when set, else the nearest directory at or above the working
    directory that holds `.git` (a folder, or a file in a worktree or submodule); None outside a repository."""
    workspace = os.environ.get("GITHUB_WORKSPACE")
    if workspace and os.path.isdir(workspace):
        return os.path.realpath(workspace)
    here = os.path.realpath(start or os.getcwd())
    while True:
        if os.path.exists(os.path.join(here, ".git")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def report_paths() -> Callable[[str], str]:
    """report_path, each file's answer kept: a report's thousands of findings name a few files, and each answer
    resolves links and looks for the repository."""
    known: dict[str, str] = {}

    def path(file: str) -> str:
        if file not in known:
            known[file] = report_path(file)
        return known[file]

    return path


def report_path(file: str) -> str:
    """A path as CI tools resolve it: relative to the repository root (GitHub resolves annotations and SARIF
    `%SRCROOT%` there, whichever directory the command ran in), else to the working directory when inside it;
    otherwise as given. Names that are no files (`<stdin>`) stay as they are."""
    if file.startswith("<") or not file:
        return file
    absolute = os.path.realpath(file)
    for base in (repository_root(), os.path.realpath(os.getcwd())):
        if base is None:
            continue
        try:
            rel = os.path.relpath(absolute, base)
        except ValueError:  # another drive on Windows
            continue
        if not rel.startswith(os.pardir + os.sep) and rel != os.pardir:
            return rel.replace(os.sep, "/")
    return file


# ---------------------------------------------------------------- verify and diff
DIFF_RULES = (
    Rule(
        "diff/changed",
        "KeyChanged",
        "a call site receives a different key than before",
        "The site (path, stream, count, lane) still exists but its key moved: a new or removed nn.jit fork "
        "above it, a different split, a different root key or setting. The finding says why and how to fix it.",
    ),
    Rule(
        "diff/new",
        "NewCallSite",
        "a call site that did not exist before",
        "Often one half of a module move (a rename, an inserted auto-named module, a new transform): give the "
        "module its old name to get the old keys back.",
    ),
    Rule(
        "diff/thing-changed",
        "ThingKeyChanged",
        "a param, variable or make_rng of a module (followed across renames and insertions) draws another key",
        "What users mean by 'did my layer's initialisation change': the module that was at the old path, and "
        "its draw by label, now receives a different key, even where every (path, count) kept its key (a param "
        "swapped with a make_rng, a layer inserted before it).",
    ),
    Rule(
        "diff/gone",
        "GoneCallSite",
        "a call site that no longer exists",
        "Often the other half of a module move; the finding names where its keys went.",
    ),
)
VERIFY_RULES = (
    Rule(
        "verify/differs",
        "KeyDiffers",
        "the spec's key differs from the key Flax hands out",
        "The spec no longer describes the model: capture it again, or fix the spec statement.",
    ),
    Rule(
        "verify/missing",
        "MissingInSpec",
        "Flax hands out a key the spec has no call site for",
        "Add the statement to the spec (or capture it again).",
    ),
    Rule(
        "verify/extra",
        "ExtraInSpec",
        "the spec replays a key Flax never hands out",
        "Remove the statement from the spec (or capture it again).",
    ),
)


def _nearest(cap: Capture, path: tuple):
    """The located site whose module path shares the longest prefix with `path` (ties: the first). Looked up by
    prefix in an index made once per capture (a diff of 100,000 moved sites asks for each)."""
    firsts = cap.memo.get("nearest")
    if firsts is None:  # each module path prefix -> the first located site under it
        firsts = cap.memo["nearest"] = {}
        for t in cap.sites:
            if t.location is not None:
                for n in range(len(t.path) + 1):
                    firsts.setdefault(t.path[:n], t)
    for n in range(len(path), -1, -1):
        if (near := firsts.get(path[:n])) is not None:
            return near
    return None


def _where(cmp: Comparison, e: Entry):
    """Where a finding points: the NEW file's row for diff, the spec's row for verify; a site that file does
    not have points at the row of the nearest module there (and says so); a file without rows at 1:1."""
    cap, site = (cmp.new, e.new) if cmp.kind == "diff" else (cmp.old, e.old)
    file = cmp.new_name if cmp.kind == "diff" else cmp.old_name
    if site is not None and site.location is not None:
        return site.location, ""
    near = _nearest(cap, e.site.path) if cap is not None else None
    if near is not None:
        return (
            near.location,
            f" [{file} has no such call site; shown at {near.path_str} {near.stream} count {near.count}]",
        )
    return Location(file, 1, 1), f" [{file} has no line for this call site]"


def compare_findings(cmp: Comparison) -> list[Finding]:
    """Every failing entry as a findings.Finding (for the github and sarif formats), at the spec line of
    the call site's statement, or the keys file's record."""
    from ..refactor.compare import path_text

    out = []
    bad = ("changed", "new", "gone") if cmp.kind == "diff" else ("differs", "missing", "extra")
    if any(e.status in bad for e in cmp.entries):
        for cap in (cmp.old, cmp.new):
            if cap is not None:
                cap.locate()
    for e in cmp.entries:
        if e.status not in bad:
            continue
        s = e.site
        lane = f" lane {list(s.lane)}" if s.lane else ""
        label = f" ({s.label})" if s.label else ""
        msg = f"{e.status}: {s.path_str} {s.stream} count {s.count}{lane}{label}"
        old = list(e.old.key) if e.old is not None and e.old.key is not None else None
        new = list(e.new.key) if e.new is not None and e.new.key is not None else None
        if e.status in ("changed", "differs"):
            msg += f": key {old} -> {new}"
        if e.why:
            msg += f": {'; '.join(e.why)}"
        if e.fix:
            msg += f". Fix: {e.fix}"
        where, note = _where(cmp, e)
        related: tuple[tuple[Location, str], ...] = ()
        if cmp.kind == "diff" and e.old is not None and e.old.location is not None and e.new is None:
            related = ((e.old.location, f"{s.path_str} in {cmp.old_name}"),)
        out.append(Finding(f"{cmp.kind}/{e.status}", ERROR, msg + note, where, related))
    for t in cmp.things:
        moved = "" if t.old_module == t.new_module else f" (the module that was {path_text(t.old_module)})"
        lane = f" lane {list(t.lane)}" if t.lane else ""
        count = f"{t.old.count} -> {t.new.count}" if t.old.count != t.new.count else f"{t.new.count}"
        msg = (
            f"thing changed: {t.name} ({t.stream}{lane}) of {path_text(t.new_module)}{moved} draws another key: count "
            f"{count}, key {list(t.old.key or ())} -> {list(t.new.key or ())}"
        )
        where = t.new.location or Location(cmp.new_name, 1, 1)
        out.append(Finding("diff/thing-changed", ERROR, msg, where))
    return out


RULES = {
    "derive": DERIVE_RULES,
    "collisions": COLLISION_RULES,
    "shard-check": SHARD_CHECK_RULES,
    "verify": VERIFY_RULES,
    "diff": DIFF_RULES,
}  # each command's rules, as SARIF lists them
