"""Which `collisions` findings a run reports: `--select`/`--ignore` by rule, `# rngaudit: ignore[RULE]` comments on
a spec line, `--per-path-ignore GLOB:RULE` from the command line or [tool.rngaudit], and a baseline file of known
findings (`--baseline`), so a team adopts rngaudit on a model with findings and fails only on new ones.

A finding is known to a baseline by its input (relative to the baseline file), its rule, and a fingerprint of its
call sites (module path, stream, count, lane), not by line numbers: editing a spec does not make old findings new.
Hashing only: no JAX.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ..errors import InputError, Location
from ..spec.comments import ignore_comments, named_rules
from ..spec.limits import read_bounded
from .nnx import NnxAudit, NnxCollision
from .results import FINDING_CATEGORIES, Audit, Collision, CollisionsReport, LatentCollision

BASELINE_FORMAT = "rngaudit.baseline"
BASELINE_VERSION = 1
MAX_BASELINE_BYTES = 64 * 1024 * 1024

INLINE = "inline"  # `# rngaudit: ignore[...]` on a call site's line
CONFIG = "config"  # --per-path-ignore (or per-path-ignore in [tool.rngaudit])
BASELINE = "baseline"  # in the --baseline file
REASONS = (INLINE, CONFIG, BASELINE)


def category_name(text: str) -> str | None:
    """A finding category from any name it is shown under: `hash_word`, `hash-word` or the rule id
    `collisions/hash-word`; None for no category."""
    name = text.strip().removeprefix("collisions/").replace("-", "_")
    return name if name in FINDING_CATEGORIES else None


def rule_id(category: str) -> str:
    return "collisions/" + category.replace("_", "-")


def _did_you_mean(word: str) -> str:
    from ..spec.fields import closest

    names = [rule_id(c).removeprefix("collisions/") for c in FINDING_CATEGORIES]
    close = closest(word.strip().removeprefix("collisions/").replace("_", "-"), names)
    return f"; did you mean {close!r}?" if close else ""


def parse_rules(names: Iterable[str], what: str) -> frozenset[str]:
    """Categories from rule names; an unknown name is a ValueError naming the rules."""
    out = set()
    for n in names:
        c = category_name(n)
        if c is None:
            rules = ", ".join(rule_id(c).removeprefix("collisions/") for c in FINDING_CATEGORIES)
            raise ValueError(f"{what}: {n.strip()!r} is not a rule{_did_you_mean(n)} (rules: {rules})")
        out.add(c)
    return frozenset(out)


@dataclass(frozen=True)
class PathIgnore:
    """`GLOB:RULE[,RULE]`: findings of these rules (None: every rule) in inputs whose path, or at call sites whose
    module path, matches GLOB."""

    glob: str
    categories: frozenset[str] | None
    base: str | None = None  # from [tool.rngaudit]: input paths also match relative to the pyproject.toml's folder
    text: str = field(default="", compare=False)  # as written

    @classmethod
    def parse(cls, text: str, base: str | None = None) -> PathIgnore:
        glob, colon, rules = text.rpartition(":")
        if not colon or not glob.strip():
            raise ValueError(
                f"{text!r}: write GLOB:RULE[,RULE...], e.g. 'specs/legacy/*:latent' or 'encoder/*:hash-word' "
                "(GLOB: an input's path or a call site's module path; RULE '*': every rule)"
            )
        names = [r for r in rules.split(",") if r.strip()]
        if not names:
            raise ValueError(f"{text!r}: name the rules after ':' (or '*' for every rule)")
        cats = None if [r.strip() for r in names] == ["*"] else parse_rules(names, text)
        return cls(glob.strip(), cats, base, text.strip())


@dataclass(frozen=True)
class Baseline:
    """A baseline file: how many findings of each (input, rule, fingerprint) it knows."""

    file: str
    entries: Counter = field(default_factory=Counter)
    records: tuple[dict, ...] = ()  # the file's findings as written (kept for inputs a run does not audit)


@dataclass(frozen=True)
class Policy:
    """What a run leaves out of its report (and its exit code)."""

    select: frozenset[str] | None = None  # only these categories (None: all)
    ignore: frozenset[str] = frozenset()
    per_path: tuple[PathIgnore, ...] = ()
    inline: bool = True
    baseline: Baseline | None = None

    @property
    def empty(self) -> bool:
        return self.select is None and not self.ignore and not self.per_path and not self.inline and not self.baseline


# ---------------------------------------------------------------- the findings of an audit
Item = Collision | LatentCollision | NnxCollision


def _lane(lane) -> str:
    return f" lane {list(lane)}" if lane else ""


def _sites(item: Item) -> list:
    if isinstance(item, LatentCollision):
        return [item.site] + [p.site for p in item.partners]
    return list(item.sites)


def _site_ids(item: Item) -> list[str]:
    """What identifies a finding's call sites across edits of the spec (no lines, no keys)."""
    if isinstance(item, LatentCollision):
        return [f"{item.site.path_str} {item.site.stream}"] + sorted(
            f"{p.site.path_str} {p.site.stream}" for p in item.partners
        )
    if isinstance(item, NnxCollision):
        out = []
        for s in item.sites:
            extra = (f" lane {s.lane}" if s.lane >= 0 else "") + (f" step {s.iteration}" if s.iteration >= 0 else "")
            out.append(f"{s.site} {s.stream_path} count {s.count}{extra}" + (f" call {s.step}" if s.step else ""))
        return sorted(out)
    return sorted(f"{s.path_str} {s.stream} count {s.count}{_lane(s.lane)}" for s in item.sites)


def _category(item: Item) -> str:
    return "latent" if isinstance(item, LatentCollision) else item.category


def _module_paths(item: Item) -> list[str]:
    return [str(getattr(s, "path_str", None) or getattr(s, "site", "")) for s in _sites(item)]


def items(audit: Audit | NnxAudit) -> Iterator[Item]:
    yield from audit.collisions
    yield from audit.latent


def _rebuilt(audit, keep: Callable[[Item], bool]):
    return dataclasses.replace(
        audit,
        collisions=tuple(c for c in audit.collisions if keep(c)),
        latent=tuple(lt for lt in audit.latent if keep(lt)),
    )


# ---------------------------------------------------------------- inline comments
def inline_ignores(text: str) -> dict[int, frozenset[str] | None]:
    """The `# rngaudit: ignore[...]` comments of a spec, by line: the categories each names (None: every one).
    A name that is no rule is left out (see `unknown_inline_rules`)."""
    out: dict[int, frozenset[str] | None] = {}
    for n, m in ignore_comments(text):
        names = named_rules(m)
        out[n] = None if names is None else frozenset(c for name in names if (c := category_name(name)) is not None)
    return out


def unknown_inline_rules(text: str, file: str) -> list[str]:
    """Warnings for rule names in ignore comments that are no rule (they suppress nothing)."""
    out: list[str] = []
    for n, m in ignore_comments(text):
        if not m.group(1):
            continue
        offset = m.start(1)
        for name in m.group(1).split(","):
            start, offset = offset, offset + len(name) + 1
            if name.strip() and category_name(name) is None:
                col = start + 1 + (len(name) - len(name.lstrip()))
                out.append(
                    f"{Location(file, n, col)}: {name.strip()!r} in `# rngaudit: ignore[...]` is not a rule and "
                    f"suppresses nothing{_did_you_mean(name)}"
                )
    return out


# ---------------------------------------------------------------- the baseline file
def _input_name(source: str, base_dir: str) -> str:
    """An input as the baseline names it: relative to the baseline's directory, with '/'."""
    if source.startswith("<") or not source:
        return source
    try:
        rel = os.path.relpath(os.path.realpath(source), os.path.realpath(base_dir))
    except ValueError:  # another drive
        return source.replace(os.sep, "/")
    return rel.replace(os.sep, "/")


def fingerprint(item: Item) -> str:
    return hashlib.sha1("\n".join(_site_ids(item)).encode("utf-8")).hexdigest()[:20]


def _key(input_name: str, item: Item) -> tuple[str, str, str]:
    """A finding as a baseline knows it; `input_name`: its input as _input_name gives it (once per input)."""
    return (input_name, rule_id(_category(item)), fingerprint(item))


def load_baseline(path: str) -> Baseline:
    """A baseline file written by `--write-baseline`; a file that is not one is an InputError at its place."""
    top = Location(path, 1, 1)
    data = read_bounded(
        path,
        MAX_BASELINE_BYTES,
        lambda message: InputError(message, top),
        missing="no such baseline file; write it with --write-baseline",
        directory="is a directory, not a baseline file",
        cannot="cannot read the baseline",
    )
    if len(data) > MAX_BASELINE_BYTES:
        raise InputError(f"the baseline is larger than {MAX_BASELINE_BYTES // (1024 * 1024)} MiB", top)
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputError("the baseline is not UTF-8 JSON", top) from None
    except json.JSONDecodeError as e:
        raise InputError(f"the baseline is not valid JSON: {e.msg}", Location(path, e.lineno, e.colno)) from None
    except (ValueError, RecursionError):  # (an integer past Python's 4,300 digits; nesting past the stack)
        raise InputError(
            "the baseline is not an rngaudit baseline (a number or nesting JSON cannot hold)", top
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != BASELINE_FORMAT:
        raise InputError(
            f'not an rngaudit baseline (no "format": "{BASELINE_FORMAT}"): name the baseline file, or write one '
            "with --write-baseline (it does not overwrite a file that is not a baseline)",
            top,
        )
    if doc.get("format_version") != BASELINE_VERSION:
        raise InputError(
            f"baseline format_version {doc.get('format_version')!r}: this rngaudit reads version {BASELINE_VERSION}; "
            "write it again with --write-baseline",
            top,
        )
    entries: Counter = Counter()
    found = doc.get("findings")
    if not isinstance(found, list):
        raise InputError('the baseline has no "findings" list', top)
    for k, entry in enumerate(found):
        ok = isinstance(entry, dict) and all(isinstance(entry.get(f), str) for f in ("input", "rule", "fingerprint"))
        count = entry.get("count", 1) if isinstance(entry, dict) else None
        if not ok or not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InputError(
                f'findings[{k}]: each finding needs "input", "rule" and "fingerprint" strings and a positive '
                '"count"; write the baseline again with --write-baseline',
                top,
            )
        entries[(entry["input"], entry["rule"], entry["fingerprint"])] += count
    return Baseline(path, entries, tuple(found))


def baseline_entries(report: CollisionsReport, path: str, old: Baseline | None = None) -> list[dict]:
    """The baseline file's findings for a report's findings (those it still reports), for --write-baseline. The
    findings `old` (the file as it was) lists for inputs this run did not audit are kept: a run on the changed specs
    only (pre-commit) updates their findings and leaves the others'."""
    base_dir = os.path.dirname(os.path.abspath(path))
    audited = {_input_name(a.source, base_dir) for a in report.audits}
    audited |= {_input_name(e.location.file, base_dir) for e in report.errors if e.location is not None}
    counts: Counter = Counter()
    shown: dict[tuple[str, str, str], list[str]] = {}
    for a in report.audits:
        name = _input_name(a.source, base_dir)
        for it in items(a):
            k = _key(name, it)
            counts[k] += 1
            shown.setdefault(k, _site_ids(it)[:4])
    for e in old.records if old is not None else ():
        k = (e["input"], e["rule"], e["fingerprint"])
        if e["input"] not in audited:
            counts[k] += e.get("count", 1)
            sites = e.get("sites")
            shown.setdefault(k, [str(x) for x in sites] if isinstance(sites, list) else [])
    return [
        {"input": k[0], "rule": k[1], "fingerprint": k[2], "sites": shown[k], "count": n}
        for k, n in sorted(counts.items())
    ]


# ---------------------------------------------------------------- applying a policy
@dataclass(frozen=True)
class Suppressed:
    """Findings left out of the report for one reason (an audit holding only them), for counts and SARIF."""

    reason: str  # inline | config | baseline
    audit: Audit | NnxAudit


def _reader(texts: dict[str, str]) -> Callable[[str], dict[int, frozenset[str] | None]]:
    cache: dict[str, dict[int, frozenset[str] | None]] = {}

    def comments(file: str) -> dict[int, frozenset[str] | None]:
        if file not in cache:
            text = texts.get(file)
            if text is None and not file.startswith("<"):
                try:
                    with open(file, encoding="utf-8", errors="replace") as f:
                        text = f.read()
                except OSError:
                    text = ""
            cache[file] = inline_ignores(text or "")
        return cache[file]

    return comments


def apply(report: CollisionsReport, policy: Policy, texts: dict[str, str] | None = None) -> CollisionsReport:
    """`report` with the findings `policy` leaves out removed (its exit code follows). `texts`: spec texts by
    file name for inputs that are no files (standard input); files are read for their comments."""
    if policy.empty:
        return report
    comments = _reader(texts or {})
    base_dir = os.path.dirname(os.path.abspath(policy.baseline.file)) if policy.baseline else ""
    left = Counter(policy.baseline.entries) if policy.baseline else Counter()
    audits = []
    dropped: dict[str, list] = {r: [] for r in REASONS}
    names = [_input_name(a.source, base_dir) for a in report.audits]
    audited = dict(zip(names, report.audits))
    for name, a in zip(names, report.audits):
        kept, out = _split(a, name, policy, comments, left)
        audits.append(kept)
        for r, part in out.items():
            dropped[r].append(part)
    return dataclasses.replace(
        report,
        audits=tuple(audits),
        suppressed=tuple(Suppressed(r, a) for r in REASONS for a in dropped[r]),
        warnings=report.warnings + _unmatched_path_ignores(policy.per_path, report),
        # (entries of inputs this run did not audit are not stale: pre-commit passes the changed specs only)
        baseline_unmatched=sum(
            n for k, n in left.items() if k[0] in audited and _possible(policy, audited[k[0]], k[1])
        ),
    )


def _selected(policy: Policy, it: Item) -> bool:
    c = _category(it)
    return (policy.select is None or c in policy.select) and c not in policy.ignore


def _why(policy: Policy, a, name: str, it: Item, comments, left: Counter) -> str | None:
    """Why a finding is left out of the report (None: it is reported). A finding the baseline lists uses up its
    entry whatever leaves it out (a comment added later does not make the entry stale)."""
    listed = False
    if policy.baseline is not None:
        k = _key(name, it)
        if left[k] > 0:
            left[k] -= 1
            listed = True
    if policy.inline:
        for s in _sites(it):
            if s.location is None:
                continue
            cats = comments(s.location.file).get(s.location.line, ())
            if cats is None or _category(it) in cats:
                return INLINE
    if policy.per_path and _path_ignored(policy.per_path, a.source, it):
        return CONFIG
    return BASELINE if listed else None


def _possible(policy: Policy, audit, rule: str) -> bool:
    """Whether this run could have found a finding of `rule` in `audit`: a rule left out by --select/--ignore,
    latent pairs not looked for (--latent-max-count 0) or key classes without keys (--no-keys) cannot make a
    baseline entry stale."""
    c = category_name(rule)
    if c is None or not (policy.select is None or c in policy.select) or c in policy.ignore:
        return False
    if c == "latent":
        return bool(getattr(audit, "latent_max_count", 0))
    if c in ("shared_seed", "unsplit_lanes"):
        return bool(getattr(audit, "keys_checked", True))
    return True


def _with_reason(reasons: dict[int, str], reason: str) -> Callable[[Item], bool]:
    return lambda it: reasons.get(id(it)) == reason


def _split(a, name: str, policy: Policy, comments, left: Counter):
    """An audit's reported findings (an audit of them), and those left out per reason (an audit each); `name`: its
    input as the baseline names it."""
    reasons: dict[int, str] = {}
    for it in items(a):
        if _selected(policy, it) and (why := _why(policy, a, name, it, comments, left)) is not None:
            reasons[id(it)] = why
    kept = _rebuilt(a, lambda it: _selected(policy, it) and id(it) not in reasons)
    out = {r: _rebuilt(a, _with_reason(reasons, r)) for r in REASONS if r in reasons.values()}
    return kept, out


def _unmatched_path_ignores(rules: tuple[PathIgnore, ...], report: CollisionsReport) -> tuple[str, ...]:
    """A warning for each --per-path-ignore of the command line whose GLOB matches no input's path and no module
    path of any finding (a typo must not pass for a clean run). Entries of [tool.rngaudit] are left alone: a run
    of pre-commit audits only the changed specs."""
    given = [p for p in rules if p.base is None]
    if not given:
        return ()
    names = {n for a in report.audits for n in _input_names(a.source)}
    # (and the inputs that could not be audited: the glob may name one)
    names |= {n for e in report.errors if e.location is not None for n in _input_names(e.location.file)}
    paths = {m for a in report.audits for it in items(a) for m in _module_paths(it)}
    return tuple(
        f"--per-path-ignore {p.text or p.glob} left out nothing: {p.glob!r} matches no input's path and no module "
        "path of a finding (GLOB is an input's path, as given or relative to the working directory, or a call site's "
        "module path such as 'encoder/layers_*')"
        for p in given
        if not any(fnmatch.fnmatchcase(n, p.glob) for n in names)
        and not any(fnmatch.fnmatchcase(m, p.glob) for m in paths)
    )


def _input_names(source: str) -> list[str]:
    """The names an input's path matches a per-path-ignore by: as given, with '/', relative to the working
    directory."""
    names = [source, source.replace(os.sep, "/")]
    if not source.startswith("<"):
        names.append(os.path.relpath(os.path.abspath(source)).replace(os.sep, "/"))
    return names


def _path_ignored(rules: tuple[PathIgnore, ...], source: str, it: Item) -> bool:
    c = _category(it)
    names = _input_names(source)
    paths = _module_paths(it)
    for p in rules:
        if p.categories is not None and c not in p.categories:
            continue
        mine = names
        if p.base is not None and not source.startswith("<"):
            mine = names + [os.path.relpath(os.path.abspath(source), os.path.abspath(p.base)).replace(os.sep, "/")]
        if any(fnmatch.fnmatchcase(n, p.glob) for n in mine) or any(fnmatch.fnmatchcase(m, p.glob) for m in paths):
            return True
    return False
