"""`verify` and `diff` reports as text: each call site that differs, why, and the fixes."""

from __future__ import annotations

from ..refactor.compare import Comparison, rules_of


def render_text(cmp: Comparison) -> str:
    lines = []
    if cmp.kind == "diff":
        lines.append(f"diff {cmp.old_name} -> {cmp.new_name}")
        order: tuple[str, ...] = ("changed", "gone", "new", "moved")
    else:
        lines.append(f"verify {cmp.old_name} against {cmp.new_name}")
        order = ("differs", "missing", "extra")
    if cmp.old is not None and cmp.new is not None:
        ro, rn = rules_of(cmp.old), rules_of(cmp.new)
        lines.append(f"rules: {ro}" if ro == rn else f"rules: {ro} -> {rn}")
    for status in order:
        for e in cmp.entries:
            if e.status != status:
                continue
            s = e.site
            lane = f" lane {list(s.lane)}" if s.lane else ""
            label = f" {s.label}" if s.label else ""
            old = list(e.old.key) if e.old is not None and e.old.key else "-"
            new = list(e.new.key) if e.new is not None and e.new.key else "-"
            path = s.path_str if status != "moved" or e.old is None else f"{e.old.path_str} -> {s.path_str}"
            lines.append(f"{status.upper():8} {path}  {s.stream} count {s.count}{lane}{label}  {old} -> {new}")
            for w in e.why:
                lines.append(f"         why: {w}")
            if e.fix:
                lines.append(f"         fix: {e.fix}")
    for n in cmp.notes:
        lines.append(f"note: {n}")
    for f in dict.fromkeys(cmp.fixes):
        lines.append(f"fix:  {f}")
    if cmp.kind == "diff":
        lines.append(
            f"{cmp.count('kept')} kept, {cmp.count('changed')} changed, {cmp.count('new')} new, "
            f"{cmp.count('gone')} gone"
            + (f", {cmp.count('moved')} moved (the same keys under other names)" if cmp.count("moved") else "")
        )
    else:
        lines.append(
            f"{cmp.count('same')} same, {cmp.count('differs')} differ, {cmp.count('missing')} missing, "
            f"{cmp.count('extra')} extra"
        )
    return "\n".join(lines) + "\n"
