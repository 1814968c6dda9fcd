"""`collisions` audits as versioned, deterministic JSON (format `rngaudit.collisions`, version 1)."""

from __future__ import annotations

from collections.abc import Sequence

from .. import __version__
from ..collision.nnx import NnxAudit
from ..collision.results import (
    Audit,
    CallSite,
    Collision,
    LatentCollision,
    Rename,
    SeparatorCheck,
)
from ..errors import RngauditError

JSON_FORMAT = "rngaudit.collisions"
JSON_FORMAT_VERSION = 1


def site_json(s: CallSite) -> dict:
    return {
        "index": s.index,
        "path": list(s.path),
        "path_str": s.path_str,
        "stream_requested": s.stream_requested,
        "stream": s.stream,
        "count": s.count,
        "lane": list(s.lane),
        "base": s.base,
        "kind": s.kind,
        "label": s.label,
        "hash_items": list(s.hash_items),
        "hash_input_hex": s.hash_input.hex(),
        "hash_word": s.hash_word,
        "key": list(s.key) if s.key is not None else None,
        "location": s.location.as_json(),
    }


def separator_json(c: SeparatorCheck) -> dict:
    return {
        "flag": c.flag,
        "removes": c.removes,
        "detail": c.detail,
        "changes_every_key": True,
        "keys_in_model": c.keys_in_model,
    }


def rename_json(r: Rename) -> dict:
    return {
        "path": list(r.path),
        "path_str": r.path_str,
        "old_name": r.old_name,
        "new_name": r.new_name,
        "module_class": r.module_class,
        "explicit": r.explicit,
        "location": r.location.as_json() if r.location is not None else None,
        "keys_changed": r.keys_changed,
        "note": r.note,
    }


def rule_of(category: str) -> str:
    """The rule id a finding's annotation, SARIF result, --fail-on, --select and ignore comments name it by."""
    from ..collision.suppress import rule_id

    return rule_id(category)


def collision_json(c: Collision) -> dict:
    return {
        "class": c.collision_class,
        "category": c.category,
        "rule": rule_of(c.category),
        "failing": c.failing,
        "inputs": [
            {
                "hash_input_hex": h.data.hex(),
                "hash_word": h.word,
                "key": list(h.key) if h.key is not None else None,
                "sites": [site_json(s) for s in h.sites],
            }
            for h in c.inputs
        ],
        "separator": separator_json(c.separator),
        "renames": [rename_json(r) for r in c.renames],
        "rename_note": c.rename_note,
    }


def latent_json(lt: LatentCollision) -> dict:
    return {
        "rule": rule_of("latent"),
        "site": site_json(lt.site),
        "max_count": lt.max_count,
        "partners": [
            {
                "site": site_json(p.site),
                "max_count": p.max_count,
                "counts": list(p.counts),
                "hash_input_hex": p.data.hex(),
                "separator_counts": list(p.separator_counts) if p.separator_counts else None,
            }
            for p in lt.partners
        ],
        "separator": separator_json(lt.separator),
        "renames": [rename_json(r) for r in lt.renames],
        "rename_note": lt.rename_note,
    }


def audit_json(a: Audit) -> dict:
    return {
        "file": a.source,
        "input": a.input_kind,
        "call_sites": a.call_sites,
        "fix_rng_separator": a.fix_rng_separator,
        "rules": a.rules,
        "prng_impl": a.prng_impl,
        "keys_checked": a.keys_checked,
        "latent_max_count": a.latent_max_count,
        "collisions": [collision_json(c) for c in a.collisions],
        "latent": [latent_json(lt) for lt in a.latent],
        "summary": {"failing": a.failing, "info": a.info, "latent": len(a.latent)},
    }


def nnx_audit_json(a: NnxAudit) -> dict:
    return {
        "file": a.source,
        "input": a.input_kind,
        "flavour": "nnx",
        **({"bridge": a.bridge} if a.bridge else {}),
        "rules": a.rules,
        "call_sites": a.call_sites,
        "prng_impl": a.prng_impl,
        "collisions": [
            {
                "category": c.category,
                "rule": rule_of(c.category),
                "failing": c.failing,
                "key": list(c.key) if c.key is not None else None,
                "why": c.why,
                "fix": c.fix,
                "sites": [
                    {
                        "index": s.index,
                        "step": s.step,
                        "site": s.site,
                        "stream_requested": s.requested,
                        "stream": s.stream,
                        "stream_path": s.stream_path,
                        "count": s.count,
                        "chain": list(s.chain),
                        "key": list(s.key),
                        "lane": None if s.lane < 0 else s.lane,
                        "iteration": None if s.iteration < 0 else s.iteration,
                        "broadcast": s.broadcast or None,
                        "location": s.location.as_json(),
                    }
                    for s in c.sites
                ],
            }
            for c in a.collisions
        ],
        "latent": [],
        "summary": {"failing": a.failing, "info": a.info, "latent": 0},
    }


def to_json(
    audits: Sequence[Audit | NnxAudit],
    errors: Sequence[RngauditError] = (),
    suppressed: dict[str, int] | None = None,
    baseline_unmatched: int = 0,
) -> dict:
    """The report; `errors` (the inputs that could not be audited, each `file`, `line`, `col`, `message`),
    `summary.suppressed` (findings left out, by reason: inline, config, baseline) and
    `summary.baseline_unmatched` only when there are some."""
    summary: dict[str, int] = {
        "inputs": len({a.source for a in audits}),  # (a Linen spec's bridge.ToLinen calls are audited beside it)
        "failing": sum(a.failing for a in audits),
        "info": sum(a.info for a in audits),
        "latent": sum(len(a.latent) for a in audits),
    }
    doc: dict = {
        "format": JSON_FORMAT,
        "format_version": JSON_FORMAT_VERSION,
        "rngaudit_version": __version__,
        "inputs": [nnx_audit_json(a) if isinstance(a, NnxAudit) else audit_json(a) for a in audits],
        "summary": summary,
    }
    if suppressed:
        summary["suppressed"] = dict(suppressed)  # type: ignore[assignment]
    if baseline_unmatched:
        summary["baseline_unmatched"] = baseline_unmatched
    if errors:
        doc["errors"] = [
            {
                **(e.location.as_json() if e.location else {"file": None, "line": None, "col": None}),
                "message": e.message,
            }
            for e in errors
        ]
        summary["errors"] = len(errors)
    return doc


def baseline_json(report, path: str) -> dict:
    """The baseline file `--write-baseline` writes at `path` for a report (format rngaudit.baseline): its findings,
    and those the file as it was lists for inputs the run did not audit."""
    import os
    import sys

    from ..collision.suppress import BASELINE_FORMAT, BASELINE_VERSION, baseline_entries, load_baseline
    from ..errors import InputError

    old = None
    if os.path.isfile(path):
        try:
            old = load_baseline(path)
        except InputError as e:
            if not _replaceable(path):
                raise InputError(
                    f"{e.message}; --write-baseline does not overwrite a file that is not an rngaudit baseline: "
                    "name another file, or remove this one",
                    e.location,
                ) from None
            # a baseline of another version, or one that is broken: written again from this run alone
            sys.stderr.write(f"warning: {path}: the old baseline cannot be read; written again from this run\n")
    return {
        "format": BASELINE_FORMAT,
        "format_version": BASELINE_VERSION,
        "rngaudit_version": __version__,
        "findings": baseline_entries(report, path, old),
    }


def _replaceable(path: str) -> bool:
    """Whether --write-baseline may overwrite a file it cannot read as a baseline: an empty one, or one that says it
    is an rngaudit baseline (another version, broken entries). Anything else may be a file named by mistake."""
    import json
    import os

    from ..collision.suppress import BASELINE_FORMAT

    if os.path.getsize(path) == 0:
        return True
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20).decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == BASELINE_FORMAT
