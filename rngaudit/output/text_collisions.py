"""Human-readable `collisions` output with rich: each finding, why it happens, and the checked fixes."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from ..collision.nnx import NnxAudit
from ..collision.results import (
    COUNT_MEETS_NAME,
    SHARED_KEY,
    SHARED_SEED,
    Audit,
    CallSite,
    Collision,
    LatentCollision,
    Rename,
    SeparatorCheck,
)

MAX_SHOWN = 12  # call sites (or key groups) listed per finding; --format json lists them all

_WHY = {
    1: "Flax hashes the path names and the count concatenated, with no separator: different names spell the same bytes",
    2: "the count is hashed as big-endian bytes right after the names: a count spells the end of a name",
    3: "different bytes, but Flax keeps only 32 bits of SHA-1 and both give the same word "
    "(with n call sites on one key, expect about n*n/2**33 such pairs)",
}
_WHY_CATEGORY = {
    "jit_trace_reuse": "one call site hashes the same count again: before flax 0.10.2, jax reused an nn.jit trace (the "
    "same module fields, counters and variables), so its counters did not move and a later call repeats its keys; "
    "flax 0.10.2 and later fork a fresh key on every call (derive's notes say which trace was reused)",
}
_WHY_SHARED = {
    SHARED_SEED: "the streams (or base keys) hold the same key data, and the stream name is not hashed: "
    "equal paths and counts get equal keys",
    "unsplit_lanes": "the lanes of a transform that does not split this stream for these draws share every key",
}
_INDENT = "   "
_LABEL = 11


def _line(label: str, text: str | Text, style: str = "") -> Text:
    out = Text(_INDENT + label.ljust(_LABEL), style="bold")
    out.append_text(text if isinstance(text, Text) else Text(text, style=style))
    return out


def _shown(text: str) -> str:
    """Names as a person can read them: control and other unprintable characters escaped."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _path(path: tuple[str, ...]) -> str:
    return "/".join(_shown(p) for p in path) if path else "(root)"


def _yaml_name(name: str) -> str:
    """How to write a name in a spec: bare when YAML reads it back unchanged, else double-quoted."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        return name
    return json.dumps(name)


def _items(items) -> str:
    return "(" + ", ".join(repr(x) for x in items) + ("," if len(items) == 1 else "") + ")"


def _bytes(data: bytes) -> str:
    return f"{data.hex() or '(empty)'} {data!r}"


def _key(key) -> str:
    return "[" + " ".join(str(w) for w in key) + "]"


def _table(*columns: str):
    """A borderless table with these columns. rich.table is imported here: a clean report needs none."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_edge=False, show_header=False, padding=(0, 2, 0, 0))
    for col in columns:
        table.add_column(col, no_wrap=True)
    return table


def _plain(console: Console) -> bool:
    """Whether the console writes to a file without colour or wrapping: plain text can go as is."""
    return not console.is_terminal and console.no_color and console.soft_wrap


def _print(console: Console, text: Text) -> None:
    """console.print(text); a plain console (_plain) gets the text written at once (rich's rendering of
    a line costs more than the key work of a thousand call sites)."""
    plain = text.plain
    if _plain(console) and plain.isprintable():
        console.file.write(plain + "\n")
    else:
        console.print(text)


def _print_rows(rows: list[list[str]], console: Console, bold: int = 1, optional: Sequence[int] = ()) -> None:
    """Rows of cells in aligned columns, two spaces apart, column `bold` in bold: what a borderless rich
    Table (_table) prints, without the cost of measuring (a report of a large model has thousands of
    these). No cell is ever cropped: on a terminal too narrow for the rows, the `optional` columns are left
    out (in that order) until they fit, and rows still wider run past its edge (the terminal wraps them);
    a file or pipe gets every column. Rows that fit with a cell rich would treat specially (a wide or
    combining character) are left to rich.table."""
    if not rows:
        return
    ncols = len(rows[0])
    widths = [max(cell_len(r[c]) for r in rows) for c in range(ncols)]
    widths[-1] = max(widths[-1], 1)  # (as rich.table: an empty last column is one space wide)
    plain = _plain(console)
    keep = list(range(ncols))

    def wide(cols: list[int]) -> int:
        return sum(widths[c] for c in cols) + 2 * (len(cols) - 1)

    for c in () if plain else optional:
        if wide(keep) <= console.width:
            break
        keep.remove(c)
    if keep[-1] != ncols - 1:
        widths[keep[-1]] = max(widths[keep[-1]], 1)
    fits = wide(keep) <= console.width
    special = not all(cell.isprintable() and cell_len(cell) >= len(cell) for r in rows for cell in r)
    if special and fits:
        table = _table(*(str(c) for c in keep))
        for r in rows:
            table.add_row(*(Text(r[c], style="bold" if c == bold else "") for c in keep))
        console.print(table)
        return
    for r in rows:
        cells = [r[c] + " " * (widths[c] - cell_len(r[c])) for c in keep]
        if plain:
            console.file.write("  ".join(cells).rstrip(" ") + "\n")
            continue
        line = Text()
        for k, cell in enumerate(cells):
            if k:
                line.append("  ")
            line.append(cell, style="bold" if keep[k] == bold else "")
        console.print(line, soft_wrap=not fits)


def _print_keyed(console: Console, head: Text, key) -> None:
    """`head` then the key (if any) on one line; on a terminal too narrow for it, the key on a line of its own (a
    wrapped line would split the key between its words)."""
    if key is None:
        _print(console, head)
        return
    if _plain(console) or cell_len(head.plain) + 1 + len(_key(key)) <= console.width:
        head.append(f" {_key(key)}")
        _print(console, head)
        return
    _print(console, head)
    _print(console, _line("key", _key(key)))


def _site_table(rows: list[tuple[CallSite, str]], console: Console) -> None:
    lines = []
    for s, extra in rows:
        stream = s.stream if s.stream == s.stream_requested else f"{s.stream_requested}->{s.stream}"
        lane = f" lane {list(s.lane)}" if s.lane else ""
        lines.append(
            [
                _INDENT,
                _path(s.path),
                _shown(stream) + lane,
                f"count {s.count}",
                _shown(s.label or s.kind),
                _shown(str(s.location)),
                _items(s.hash_items),
                extra,
            ]
        )
    _print_rows(lines, console, optional=(6, 4))  # (narrow: the hash items, then the kind, left out)


def _more(n: int, what: str, console: Console) -> None:
    if n > 0:
        _print(console, Text(f"{_INDENT}... and {n} more {what} (--format json lists them all)"))


def _separator(check: SeparatorCheck, console: Console) -> None:
    if check.flag:
        _print(console, _line("separator", "fix_rng_separator is on already, and this still happens"))
        return
    if check.removes is None:
        _print(console, _line("separator", f"not checked: {check.detail}"))
    elif check.removes:
        _print(console, _line("separator", f"fix_rng_separator: true removes it (checked: {check.detail})"))
    else:
        _print(
            console,
            _line("separator", f"fix_rng_separator: true does NOT remove it (checked: {check.detail})", "yellow"),
        )
    _print(
        console,
        _line(
            "",
            f"warning: flipping fix_rng_separator changes every key in the model (all "
            f"{check.keys_in_model} here), not only these",
        ),
    )


def _rename(r: Rename, input_kind: str) -> str:
    where = f" at {r.location}" if r.location is not None else ""
    cls = f" ({_shown(r.module_class)})" if r.module_class else ""
    changes = f"changes {r.keys_changed} key{'s' if r.keys_changed != 1 else ''}"
    path = _path(r.path)
    if input_kind != "spec":
        return f"rename module {path}{where} to {r.new_name!r} (name={r.new_name!r} in the model); {changes}"
    new = _yaml_name(r.new_name)
    if r.explicit:
        return f"rename module {path}{cls}{where}: `name: {_yaml_name(r.old_name)}` -> `name: {new}`; {changes}"
    return f"give module {path}{cls}{where} `name: {new}` (Flax auto-names it {_shown(r.old_name)}); {changes}"


def _renames(renames: Sequence[Rename], note: str, input_kind: str, console: Console) -> None:
    if not renames:
        _print(console, _line("rename", note))
        return
    for k, r in enumerate(renames):
        _print(console, _line("rename" if k == 0 else "", _rename(r, input_kind)))
        if r.note:
            _print(console, _line("", f"  ({r.note})"))
    _print(console, _line("", note))


def render_collision(c: Collision, input_kind: str, console: Console) -> None:
    head = Text()
    head.append("FAIL  " if c.failing else "INFO  ", style="bold red" if c.failing else "bold cyan")
    head.append(f"class {c.collision_class} ({c.category}): ", style="bold")
    sites = c.sites
    keys = c.keys
    if c.collision_class == SHARED_KEY:
        streams = sorted({_shown(s.stream) for s in sites})
        bases = sorted({_shown(s.base) for s in sites})
        head.append(
            f"{len(keys)} key{'s' if len(keys) != 1 else ''} shared by {len(sites)} call sites across "
            f"{', '.join(bases)}" + (f" (streams {', '.join(streams)})" if len(streams) > 1 else "")
        )
        _print(console, head)
        rows: list[tuple[CallSite, str]] = []
        shown = c.inputs[:MAX_SHOWN]
        for h in shown:
            rows.extend((s, f"key {_key(h.key)}" if h.key is not None else "") for s in h.sites)
        _site_table(rows, console)
        _more(len(c.inputs) - len(shown), "shared keys", console)
    else:
        head.append(f"{len(sites)} call sites get the same key")
        _print_keyed(console, head, keys[0])
        _site_table([(s, "") for s in sites[:MAX_SHOWN]], console)
        _more(len(sites) - MAX_SHOWN, "call sites", console)
        if len(c.inputs) == 1:
            h = c.inputs[0]
            _print(console, _line("shared", f"hash input {_bytes(h.data)} -> word {h.word}"))
        else:
            for k, h in enumerate(c.inputs):
                names = ", ".join(f"{_path(s.path)} count {s.count}" for s in h.sites)
                _print(console, _line("inputs" if k == 0 else "", f"{_bytes(h.data)} -> word {h.word} ({names})"))
    why = (
        _WHY_SHARED[c.category]
        if c.collision_class == SHARED_KEY
        else _WHY_CATEGORY.get(c.category, _WHY[c.collision_class])
    )
    if c.collision_class == COUNT_MEETS_NAME:
        why += " (" + ", ".join(f"{_path(s.path)} count {s.count} = 0x{s.count:x}" for s in sites[:MAX_SHOWN]) + ")"
    _print(console, _line("why", why))
    _separator(c.separator, console)
    _renames(c.renames, c.rename_note, input_kind, console)


def render_latent(lt: LatentCollision, input_kind: str, console: Console) -> None:
    s = lt.site
    n = len(lt.partners)
    head = Text()
    head.append("LATENT ", style="bold yellow")
    head.append(
        f"{_path(s.path)} (stream {_shown(s.stream)}, {s.location}) reaches count {lt.max_count}; at higher counts "
        f"its keys equal those of {n} other path{'s' if n != 1 else ''}:"
    )
    _print(console, head)
    lines = []
    for p in lt.partners[:MAX_SHOWN]:
        short, long = p.counts
        lines.append(
            [
                _INDENT,
                _path(p.site.path),
                f"count {long} (reaches {p.max_count}) = {_path(s.path)} count {short} (0x{short:x})",
                _shown(str(p.site.location)),
                f"both hash {p.data!r}",
            ]
        )
    _print_rows(lines, console, optional=(4,))
    _more(n - MAX_SHOWN, "paths", console)
    _print(console, _line("why", _WHY[COUNT_MEETS_NAME]))
    _separator(lt.separator, console)
    _renames(lt.renames, lt.rename_note, input_kind, console)


def render_audit(a: Audit, console: Console) -> None:
    head = Text()
    head.append(_shown(a.source), style="bold")
    impl = f", {a.prng_impl}" if a.prng_impl else ""
    keys = "" if a.keys_checked else ", hash words only: class 4 not checked"
    head.append(
        f"  ({a.input_kind}, {a.call_sites} call sites, fix_rng_separator={str(a.fix_rng_separator).lower()}"
        f"{impl}{keys})"
    )
    _print(console, head)
    if a.rules is not None:
        _print(console, Text(f"  rules: {a.rules}"))
    for c in a.collisions:
        render_collision(c, a.input_kind, console)
    for lt in a.latent:
        render_latent(lt, a.input_kind, console)
    latent = f"latent counts up to {a.latent_max_count}" if a.latent_max_count else "latent not checked"
    _print(console, Text(f"{a.failing} failing, {a.info} information, {len(a.latent)} latent ({latent})"))


def render_nnx_audit(a: NnxAudit, console: Console) -> None:
    head = Text()
    head.append(_shown(a.source), style="bold")
    if a.bridge:
        head.append(f"  ({_shown(a.bridge)}, {a.call_sites} draws, {a.prng_impl}, rules {a.rules})")
    else:
        head.append(f"  (nnx spec, {a.call_sites} draws, {a.prng_impl}, rules {a.rules})")
    _print(console, head)
    fallbacks: dict[tuple, list] = {}  # (stream, why) -> its default_fallback findings, one a statement
    for c in a.collisions:
        if c.key is None and c.category == "default_fallback":
            fallbacks.setdefault((c.sites[0].requested, c.why), []).append(c)
    for c in a.collisions:
        line = Text()
        line.append("FAIL  " if c.failing else "INFO  ", style="bold red" if c.failing else "bold cyan")
        line.append(f"{c.category}: ", style="bold")
        if c.category == "bridge_constant_default":
            n = len(c.sites)
            line.append(
                f"{n} draw{'s' if n != 1 else ''} of the call get{'' if n != 1 else 's'} keys of the constant key(0), "
                "at every apply"
            )
            _print(console, line)
            rows = [
                [
                    _INDENT,
                    _shown(s.where),
                    _shown(s.stream_path),
                    f"count {s.count}",
                    _key(s.key),
                    _shown(str(s.location)),
                ]
                for s in c.sites[:MAX_SHOWN]
            ]
            _print_rows(rows, console)
            _more(len(c.sites) - MAX_SHOWN, "draws", console)
        elif c.key is None:
            # (default_fallback, one finding a statement: said once a stream, its statements listed)
            group = fallbacks.get((c.sites[0].requested, c.why), [])
            if not group or group[0] is not c:
                continue
            s = c.sites[0]
            if len(group) == 1:
                line.append(f"{s.site}: stream {_shown(s.requested)} is served by 'default' ({s.location})")
                _print(console, line)
            else:
                line.append(f"stream {_shown(s.requested)} is served by 'default' at {len(group)} statements")
                _print(console, line)
                rows = [[_INDENT, _shown(g.sites[0].site), _shown(str(g.sites[0].location))] for g in group[:MAX_SHOWN]]
                _print_rows(rows, console)
                _more(len(group) - MAX_SHOWN, "statements", console)
        else:
            line.append(f"{len(c.sites)} draws get the key")
            _print_keyed(console, line, c.key)
            rows = [
                [
                    _INDENT,
                    "init" if s.step == 0 else f"step {s.step}",
                    _shown(s.where),
                    _shown(s.stream_path),
                    f"count {s.count}",
                    _shown(str(s.location)),
                ]
                for s in c.sites[:MAX_SHOWN]
            ]
            _print_rows(rows, console)
            _more(len(c.sites) - MAX_SHOWN, "draws", console)
        _print(console, _line("why", c.why))
        _print(console, _line("fix", c.fix))
    _print(console, Text(f"{a.failing} failing, {a.info} information"))


def render_collisions(
    audits: Sequence[Audit | NnxAudit],
    console: Console,
    errors: Sequence = (),
    suppressed: dict[str, int] | None = None,
    baseline: str | None = None,
) -> None:
    """Every audit, a total over several, how many findings were left out (`suppressed`, by reason) and
    (`errors`: inputs that could not be audited, each said on stderr already) how many were not audited."""
    # (a bridge.ToLinen call without findings is left out: its NNX keys are derive's)
    audits = [a for a in audits if not (isinstance(a, NnxAudit) and a.bridge and not a.collisions)]
    for k, a in enumerate(audits):
        if k:
            _print(console, Text())
        if isinstance(a, NnxAudit):
            render_nnx_audit(a, console)
        else:
            render_audit(a, console)
    inputs = len({a.source for a in audits})  # (a Linen spec's bridge.ToLinen calls are audited beside it)
    if len(audits) > 1:
        _print(console, Text())
        _print(
            console,
            Text(
                f"total: {sum(a.failing for a in audits)} failing, {sum(a.info for a in audits)} "
                f"information, {sum(len(a.latent) for a in audits)} latent in {inputs} input"
                + ("s" if inputs != 1 else "")
            ),
        )
    if suppressed:
        how = {
            "inline": "by ignore comments",
            "config": "by per-path ignores",
            "baseline": f"by the baseline {baseline}" if baseline else "by the baseline",
        }
        n = sum(suppressed.values())
        reasons = ", ".join(f"{k} {how[r]}" for r, k in suppressed.items())
        _print(console, Text(f"{n} finding{'' if n == 1 else 's'} left out ({reasons})"))
    if errors:
        _print(console, Text())
        where = ", ".join(e.location.file if e.location else "?" for e in errors[:3])
        more = f" and {len(errors) - 3} more" if len(errors) > 3 else ""
        _print(
            console,
            Text(
                f"{len(errors)} input{'s' if len(errors) > 1 else ''} not audited ({where}{more}): "
                "the error lines say why",
                style="bold red",
            ),
        )


def render_statistics(findings: Sequence, inputs: int, console: Console) -> None:
    """`--statistics`: a line per rule and level, `count  rule  level`, the most frequent first (as ruff)."""
    from collections import Counter

    counts = Counter((f.rule, f.level) for f in findings)
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    width = max((len(str(n)) for _, n in rows), default=1)
    rule_width = max((len(rule) for (rule, _), _ in rows), default=0)
    for (rule, level), n in rows:
        _print(console, Text(f"{str(n).rjust(width)}  {rule.ljust(rule_width)}  {level}"))
    total = sum(counts.values())
    _print(console, Text(f"{total} finding{'' if total == 1 else 's'} in {inputs} input{'' if inputs == 1 else 's'}"))
