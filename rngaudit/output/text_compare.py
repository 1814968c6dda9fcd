"""`verify` and `diff` reports as text: each call site that differs, why, and the fixes."""

from __future__ import annotations

from ..refactor.compare import Comparison, mode_change, path_text, rules_of


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
            if s.step >= 0:
                # (NNX: when it was drawn, construction or the n-th call, and its nnx.scan step; a key moved to
                # another step: both)
                at = "init" if s.step == 0 else f"step {s.step}"
                if e.old is not None and e.new is not None and e.old.step != e.new.step:
                    crossed = mode_change(cmp, e.old, e.new)
                    if crossed is not None:  # (drawn in the other mode now)
                        at = f"step {e.old.step} {crossed[0]} -> {e.new.step} {crossed[1]}"
                    else:
                        at = f"step {e.old.step} -> {e.new.step}"
                when = [at] + ([f"scan {s.iteration}"] if s.iteration >= 0 else [])
                lane = f" ({', '.join(when)})" + lane
            old = list(e.old.key) if e.old is not None and e.old.key else "-"
            new = list(e.new.key) if e.new is not None and e.new.key else "-"
            was = e.old if e.old_path is not None else None  # (moved, or renamed)
            path = f"{was.path_str} -> {s.path_str}" if was is not None else s.path_str
            count = str(s.count) if e.old_count is None else f"{e.old_count} -> {s.count}"  # (an NNX count shift)
            lines.append(f"{status.upper():8} {path}  {s.stream} count {count}{lane}{label}  {old} -> {new}")
            for w in e.why:
                lines.append(f"         why: {w}")
            if e.fix:
                lines.append(f"         fix: {e.fix}")
    if cmp.things:
        lines.append("things whose key changed (a module followed across renames and insertions, its draws by label):")
        lines.extend(f"  {line}" for line in thing_lines(cmp.things))
    for n in cmp.notes:
        lines.append(f"note: {n}")
    for f in dict.fromkeys(cmp.fixes):
        lines.append(f"fix:  {f}")
    if cmp.kind == "diff":
        lines.append(
            f"{cmp.count('kept')} kept, {cmp.count('changed')} changed, {cmp.count('new')} new, "
            f"{cmp.count('gone')} gone"
            + (f", {cmp.count('moved')} moved (the same keys, elsewhere)" if cmp.count("moved") else "")
            + (f"; {len(cmp.things)} things with another key" if cmp.things else "")
        )
    else:
        lines.append(
            f"{cmp.count('same')} same, {cmp.count('differs')} differ, {cmp.count('missing')} missing, "
            f"{cmp.count('extra')} extra"
        )
    return "\n".join(lines) + "\n"


def thing_lines(things) -> list[str]:
    """One line per module: `Dense_0 -> Dense_1: kernel, bias (params)`, or `Dense_0: w (params)` when it kept
    its path (a draw of it now gets another count)."""
    by: dict = {}
    for t in things:
        by.setdefault((t.old_module, t.new_module), []).append(t)
    out = []
    for (mo, mn), ts in by.items():
        where = path_text(mn) if mo == mn else f"the module that was {path_text(mo)} is now {path_text(mn)}"
        streams: dict = {}
        for t in ts:
            lane = f" lane {list(t.lane)}" if t.lane else ""
            streams.setdefault(t.stream, []).append(t.name + lane)
        said = "; ".join(f"{', '.join(names)} ({s})" for s, names in streams.items())
        counts = ""
        recounted = [t for t in ts if t.old.count != t.new.count]  # (a key changed otherwise keeps its count)
        if mo == mn and recounted and len(ts) <= 3:
            counts = " [" + ", ".join(f"{t.name}: count {t.old.count} -> {t.new.count}" for t in recounted) + "]"
        out.append(f"{where}: {said}{counts}")
    return out
