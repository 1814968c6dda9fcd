"""`verify` and `diff` reports as versioned, deterministic JSON (formats `rngaudit.verify` and `rngaudit.diff`,
version 1)."""

from __future__ import annotations

from .. import __version__
from ..refactor.compare import Comparison, Entry, mode_change, rules_of

DIFF_FORMAT, VERIFY_FORMAT, FORMAT_VERSION = "rngaudit.diff", "rngaudit.verify", 1


def to_json(cmp: Comparison) -> dict:
    def entry(e: Entry) -> dict:
        s = e.site
        return {
            "status": e.status,
            "path": list(s.path),
            "path_str": s.path_str,
            "stream": s.stream,
            "count": s.count,
            "lane": list(s.lane),
            "label": s.label,
            "kind": s.kind,
            "old_key": list(e.old.key) if e.old is not None and e.old.key is not None else None,
            "new_key": list(e.new.key) if e.new is not None and e.new.key is not None else None,
            "why": list(e.why),
            "fix": e.fix,
            # (an NNX site: the step it is drawn at, 0 construction, n the n-th call; its scan step; its stream)
            **(
                {
                    "step": s.step,
                    "iteration": None if s.iteration < 0 else s.iteration,
                    "stream_path": s.stream_path,
                }
                if s.step >= 0
                else {}
            ),
            # (a moved key, or a renamed module's changed one: the old site under its old name)
            **({"old_path": list(e.old_path)} if e.old_path is not None else {}),
            # (an NNX draw whose count shifted: its count before)
            **({"old_count": e.old_count} if e.old_count is not None else {}),
            # (an NNX key drawn at another step of the run: the step it was drawn at before)
            **(
                {"old_step": e.old.step} if e.old is not None and e.new is not None and e.old.step != e.new.step else {}
            ),
            # (an NNX key drawn in the other mode now: the modes of its steps, before and now)
            **dict(zip(("old_mode", "mode"), mode_change(cmp, e.old, e.new) or ())),
        }

    statuses = (
        ("kept", "changed", "new", "gone", "moved") if cmp.kind == "diff" else ("same", "differs", "missing", "extra")
    )
    return {
        "format": DIFF_FORMAT if cmp.kind == "diff" else VERIFY_FORMAT,
        "format_version": FORMAT_VERSION,
        "rngaudit_version": __version__,
        "old": cmp.old_name,
        "new": cmp.new_name,
        "rules": {
            side: rules_of(cap) if cap is not None else None for side, cap in (("old", cmp.old), ("new", cmp.new))
        },
        "sites": [entry(e) for e in cmp.entries],
        **(
            {
                "things": [
                    {
                        "old_module": list(t.old_module),
                        "new_module": list(t.new_module),
                        "what": t.what,
                        "nth": t.nth,
                        "stream": t.stream,
                        "lane": list(t.lane),
                        "old_count": t.old.count,
                        "new_count": t.new.count,
                        "old_key": list(t.old.key) if t.old.key is not None else None,
                        "new_key": list(t.new.key) if t.new.key is not None else None,
                    }
                    for t in cmp.things
                ]
            }
            if cmp.kind == "diff"
            else {}
        ),
        "notes": list(cmp.notes),
        "fixes": list(cmp.fixes),
        "summary": dict({s: cmp.count(s) for s in statuses}, failing=cmp.failing)
        | ({"things_changed": len(cmp.things)} if cmp.kind == "diff" else {}),
    }
