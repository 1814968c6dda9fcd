"""Compare the keys of two runs call site by call site (verify, diff), and say why a key moved."""

from __future__ import annotations

import re
from collections import Counter, deque
from dataclasses import dataclass, field

from ..spec.layers import DRAW_KINDS, DRAW_LABELS, layer_identity
from ..spec.releases import FLAX_CHANGES, JAX_CHANGES, Change, changes_between, known
from .keys_file import Capture, Site

_PREFIXES = {
    "Jit": "nn.jit",
    "Checkpoint": "nn.remat",
    "Vmap": "nn.vmap",
    "Scan": "nn.scan",
    "Fold_rngs": "nn.fold_rngs",
}


@dataclass
class Entry:
    """One call site in the comparison: status kept | changed | new | gone | moved (diff: an NNX key drawn under
    another name, old and new sites both given), or same | differs | missing | extra (verify)."""

    status: str
    ident: tuple
    old: Site | None
    new: Site | None
    why: list[str] = field(default_factory=list)
    fix: str | None = None

    @property
    def site(self) -> Site:
        site = self.new if self.new is not None else self.old
        assert site is not None  # (an entry has a site on one side at least)
        return site

    @property
    def old_path(self) -> tuple | None:
        """The old site's path where it differs from the new one's (a key moved, or a renamed module's changed)."""
        if self.old is None or self.new is None or self.old.path == self.new.path:
            return None
        return self.old.path

    @property
    def old_count(self) -> int | None:
        """The old site's count where it differs from the new one's (an NNX draw whose count shifted)."""
        if self.old is None or self.new is None or self.old.count == self.new.count:
            return None
        return self.old.count


@dataclass(frozen=True)
class Thing:
    """What draws a key, as a user names it: a module (followed across renames and insertions where both sides
    record the modules' classes and hyper-parameters) and, in it, the param, variable or make_rng by its label,
    stream and lane (the n-th of its kind). A thing on both sides whose key differs is reported by `diff` (a
    param swapped with a make_rng keeps every (path, count) key and still changes the param's)."""

    old_module: tuple[str, ...]
    new_module: tuple[str, ...]
    what: str  # the label (kernel, bias, dropout), or the kind when the draw has none (make_rng)
    nth: int  # 0 for the first of its module, stream, label and lane; 1 for the next ...
    stream: str
    lane: tuple[int, ...]
    old: Site
    new: Site

    @property
    def name(self) -> str:
        return self.what if not self.nth else f"{self.what} #{self.nth + 1}"


@dataclass
class Comparison:
    kind: str  # diff | verify
    old_name: str
    new_name: str
    entries: list[Entry]
    notes: list[str] = field(default_factory=list)  # model-level explanations (renames, insertions)
    fixes: list[str] = field(default_factory=list)
    old: Capture | None = None
    new: Capture | None = None
    things: list[Thing] = field(default_factory=list)  # diff: things on both sides whose key changed

    def count(self, status: str) -> int:
        return sum(1 for e in self.entries if e.status == status)

    @property
    def failing(self) -> bool:
        bad = ("changed", "new", "gone") if self.kind == "diff" else ("differs", "missing", "extra")
        return any(e.status in bad for e in self.entries) or bool(self.things)


def rules_of(cap: Capture) -> str:
    """The releases whose rules a side follows: a spec's `flax.version`/`jax.version` (newest when it names
    none), or the releases a capture ran."""
    flax, jax = cap.settings.get("flax_version"), cap.settings.get("jax_version")
    return f"flax {flax or 'newest'}" + (f", jax {jax}" if jax else "")


def _live(sites: list[Site]) -> dict:
    return {s.ident: s for s in sites}


# ---------------------------------------------------------------- verify
def verify(spec_sites: Capture, observed: Capture) -> Comparison:
    """The spec's replay (old side) against what Flax handed out (new side)."""
    if spec_sites.flavour != observed.flavour:
        from ..errors import UsageError

        raise UsageError(
            f"{spec_sites.target} is {spec_sites.flavour} and {observed.target} is {observed.flavour}: verify checks a "
            "spec against the model it describes (an NNX spec against an NNX model or keys file, a Linen one against "
            "Linen)"
        )
    ours, theirs = _live(spec_sites.sites), _live(observed.sites)
    # (a key the spec replays at a site Flax does not draw at: where Flax hands it out, if anywhere)
    handed = {tuple(t.key): t for t in theirs.values() if t.key}
    entries = []
    for ident in _ordered(ours, theirs):
        o, t = ours.get(ident), theirs.get(ident)
        if o is None:
            entries.append(
                Entry("missing", ident, None, t, ["Flax hands out this key; the spec has no such call site"])
            )
        elif t is None:
            other = handed.get(tuple(o.key)) if o.key else None
            why = (
                "the spec replays this key; Flax never hands it out"
                if other is None
                else f"the spec replays this key here; Flax hands it out at {other.path_str} (a rename or a move?)"
            )
            entries.append(Entry("extra", ident, o, None, [why]))
        elif o.key != t.key:
            entries.append(Entry("differs", ident, o, t, ["the spec's key differs from the key Flax hands out"]))
        else:
            entries.append(Entry("same", ident, o, t))
    cmp = Comparison("verify", spec_sites.target, observed.target, entries, old=spec_sites, new=observed)
    _explain_settings(cmp, spec_sites, observed)
    return cmp


_SETTINGS = {  # the settings besides the model that decide keys (diff and verify name them in this order)
    "fix_rng_separator": "Flax's flax_fix_rng_separator (the bytes hashed for a module path)",
    "prng_impl": "jax_default_prng_impl (the PRNG implementation)",
    "threefry_partitionable": "jax_threefry_partitionable (how split and fold_in lay out Threefry's counters)",
}


def _explain_settings(cmp: Comparison, spec: Capture, live: Capture) -> None:
    """A setting that differs between the spec and the live run changes keys without any change of the model:
    say so once, and on every differing key, instead of listing keys as if the model had moved them."""
    differ = [
        k for k in _SETTINGS if k in spec.settings and k in live.settings and spec.settings[k] != live.settings[k]
    ]
    sv, lv = spec.settings.get("flax_version"), live.settings.get("flax_version")
    rules = [(c, t) for c, t in _crossed(sv, lv, FLAX_CHANGES) if c.flavour == spec.flavour] if lv else []
    if rules:
        cmp.notes.append(
            f"the spec has flax {sv or 'newest'}'s rules and the run had flax {lv}: "
            + "; ".join(t for _, t in rules)
            + f"; set `flax: {{version: '{lv}'}}` in the spec to replay this Flax"
        )
        moves = _RuleSites(spec, live)
        for e in cmp.entries:
            if e.status != "same" and any(moves.affects(c, e) for c, _ in rules):
                e.why.append(f"the spec's Flax rules (flax {sv or 'newest'}) are not the run's (flax {lv})")
    if not differ:
        return
    for k in differ:
        cmp.notes.append(
            f"the spec has {k}: {spec.settings[k]!r}, the run had {live.settings[k]!r}: {_SETTINGS[k]} "
            "differs, so keys differ although the model may not; run with the spec's setting, or capture the "
            "spec again under this one"
        )
    why = (
        "a setting differs between the spec and the run ("
        + ", ".join(f"{k}: {spec.settings[k]!r} -> {live.settings[k]!r}" for k in differ)
        + ")"
    )
    for e in cmp.entries:
        if e.status == "differs":
            e.why.append(why)


def _ordered(a: dict, b: dict) -> list:
    seen = list(b)
    extra = [k for k in a if k not in b]
    return seen + extra


# ---------------------------------------------------------------- diff
def diff(old: Capture, new: Capture) -> Comparison:
    a, b = _live(old.sites), _live(new.sites)
    entries = []
    for ident in _ordered(a, b):
        o, n = a.get(ident), b.get(ident)
        if o is None:
            entries.append(Entry("new", ident, None, n))
        elif n is None:
            entries.append(Entry("gone", ident, o, None))
        elif o.key != n.key:
            entries.append(Entry("changed", ident, o, n))
        else:
            entries.append(Entry("kept", ident, o, n))
    cmp = Comparison("diff", old.target, new.target, entries, old=old, new=new)
    _explain_releases(cmp, old, new)
    if "nnx" in (old.flavour, new.flavour):
        if old.flavour != new.flavour:
            from ..errors import UsageError

            raise UsageError(
                f"{old.target} is {old.flavour} and {new.target} is {new.flavour}: diff compares two versions of "
                "one model (both Linen, or both NNX)"
            )
        _explain_nnx(cmp, old, new)
        return cmp
    lanes = _lane_keys(old.sites), _lane_keys(new.sites)
    moves = module_moves(old, new)
    cmp.things = changed_things(old, new, moves)
    _explain_changed(cmp, old, new, lanes)
    _explain_moves(cmp, old, new, lanes, dict(moves))
    _diff_to_linen(cmp, old, new)
    return cmp


def _diff_to_linen(cmp: Comparison, old: Capture, new: Capture) -> None:
    """The NNX keys of each bridge.ToLinen call (matched by its path and call number), compared as NNX keys are
    (their explanations: count shifts, ...): entries whose path starts with `/t (bridge.ToLinen call 1)`."""
    import dataclasses

    for where in dict.fromkeys(list(old.to_linen) + list(new.to_linen)):
        lane = f", lane {list(where[2])}" if where[2] else ""
        label = f"{where[0]} (bridge.ToLinen call {where[1]}{lane})"
        sides = [
            Capture(f"{cap.target} {label}", "call", {}, cap.settings, cap.to_linen.get(where, []), flavour="nnx")
            for cap in (old, new)
        ]
        inner = diff(*sides)

        def moved(s: Site | None, label: str = label) -> Site | None:
            return None if s is None else dataclasses.replace(s, path=(label,) + s.path)

        for e in inner.entries:
            cmp.entries.append(Entry(e.status, (label,) + e.ident, moved(e.old), moved(e.new), e.why, e.fix))
        cmp.notes.extend(f"{label}: {n}" for n in inner.notes)
        cmp.fixes.extend(inner.fixes)


# ---------------------------------------------------------------- things: what draws the key, as users name it
_NOT_THINGS = {"jit_fork"}  # keys Flax makes for itself, not for a thing of the model


def _thing_ids(sites: list[Site]) -> dict:
    """(module path, what, stream, lane, n) -> site: each draw of a Linen model named as the user would."""
    out: dict = {}
    seen: dict = {}
    for s in sorted(sites, key=lambda t: (t.path, t.requested, t.lane, t.count)):
        if s.kind in _NOT_THINGS or s.key is None:
            continue
        what = _what(s)
        base = (s.path, what, s.requested, s.lane)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out[base + (n,)] = s
    return out


def module_pairs(old: Capture, new: Capture, moves: dict | None = None) -> dict:
    """Old module path -> new module path (None: no longer the same thing) where a module is not the same thing
    at the same path: the moves (module_moves), and a module whose class or hyper-parameters changed in place."""
    pairs = dict(module_moves(old, new) if moves is None else moves)
    if not (old.modules and new.modules):
        return pairs
    ids_old, ids_new = _identities(old, new)
    targets = set(pairs.values())
    for path in old.modules:
        if path in pairs or any(path[:i] in pairs for i in range(1, len(path))):
            continue
        if path in new.modules and path not in targets:
            a, b = ids_old[path], ids_new[path]
            if a is not None and b is not None and a != b:
                pairs[path] = None  # the module at this path is another thing now
    return pairs


def _identities(old: Capture, new: Capture) -> tuple[dict, dict]:
    """What each module is (its class without transform prefixes, its hyper-parameters), told alike on both
    sides: {path: identity} of OLD and of NEW. Flax's own text of every field where both sides are keys files,
    else the options of Flax's standard layers (a spec's layer statements; a keys file records them for
    flax.linen's layers). None where a side cannot tell (a spec's own classes): such a module is paired by the
    keys it draws instead."""
    mode = "fields" if _has_fields(old) and _has_fields(new) else "layer"
    return _identities_of(old, mode), _identities_of(new, mode)


def _has_fields(cap: Capture) -> bool:
    if "has_fields" not in cap.memo:
        cap.memo["has_fields"] = all("fields" in m for m in cap.modules.values())
    return cap.memo["has_fields"]


def _identities_of(cap: Capture, mode: str) -> dict:
    if ("identity", mode) not in cap.memo:
        out: dict = {}
        for path, m in cap.modules.items():
            if mode == "fields":
                text = m["fields"]
                out[path] = (_base_class(m["class"]), text[text.find("(") :] if "(" in text else text)
            else:
                opts = m.get("layer_options")
                out[path] = None if not isinstance(opts, dict) else layer_identity(_base_class(m["class"]), opts)
        cap.memo[("identity", mode)] = out
    return cap.memo[("identity", mode)]


def _moved(path: tuple, pairs: dict) -> tuple | None:
    """Where the module at old `path` is in the new version (None: no longer the same thing)."""
    for i in range(len(path), 0, -1):
        if path[:i] in pairs:
            to = pairs[path[:i]]
            return None if to is None else to + path[i:]
    return path


def changed_things(old: Capture, new: Capture, moves: dict | None = None) -> list[Thing]:
    """Every thing on both sides whose key changed, in the new version's order."""
    pairs = module_pairs(old, new, moves)
    a, b = _thing_ids(old.sites), _thing_ids(new.sites)
    out = []
    for (path, what, stream, lane, n), so in a.items():
        to = _moved(path, pairs)
        if to is None:
            continue
        sn = b.get((to, what, stream, lane, n))
        if sn is not None and sn.key != so.key:
            # named by the label both sides give it (a spec's "attention dropout"), else as both inputs know it
            shown = so.label if so.label and so.label == sn.label else what
            out.append(Thing(path, to, shown, n, stream, lane, so, sn))
    order = {id(s): i for i, s in enumerate(new.sites)}
    return sorted(out, key=lambda t: order.get(id(t.new), 0))


def _explain_releases(cmp: Comparison, old: Capture, new: Capture) -> None:
    """Two sides under different Flax (or JAX) releases' rules: each rule that differs between them, said once, and
    on each key it moves. A key is put down to a rule only where it moves when nothing but the releases change (a
    spec side derived again under the other side's releases) and the rule is about it (nn.jit's rules: a key
    under nn.jit or a jit fork; NNX's: a Dropout's draws and fork, a reseeded stream's draws; JAX's
    threefry_partitionable default: a key from a split)."""
    flax = _crossed(old.settings.get("flax_version"), new.settings.get("flax_version"), FLAX_CHANGES)
    flax = [(c, t) for c, t in flax if c.flavour == old.flavour == new.flavour]
    jax = _crossed(old.settings.get("jax_version"), new.settings.get("jax_version"), JAX_CHANGES)
    rules = flax + jax
    if not rules:
        return
    moved = _moved_by_releases(old, new)
    where = _RuleSites(old, new)
    used: set[str] = set()
    for e in cmp.entries:
        if moved is not None and e.status in ("changed", "new", "gone", "moved") and e.ident in moved:
            for c, text in rules:
                if where.affects(c, e):
                    e.why.append(text)
                    used.add(c.about)
    for c, text in rules:
        lib = "jax" if c.flavour == "jax" else "flax"
        a, b = old.settings.get(f"{lib}_version"), new.settings.get(f"{lib}_version")
        head = f"{lib} {a or 'newest'} -> {b or 'newest'}: {text}"
        if moved is None:
            cmp.notes.append(head + " (keys files on both sides: the keys it moves are not told apart)")
        else:
            cmp.notes.append(head if c.about in used else head + "; it moves no key of this model")


def _crossed(a: str | None, b: str | None, changes: tuple[Change, ...]) -> list[tuple[Change, str]]:
    """The rules that differ between releases `a` and `b` (None: the newest; unknown: none told), one per aspect,
    with the words for it: on an upgrade the rule `b` has, on a downgrade the rule `b` goes back to."""
    va, vb = known(a), known(b)
    if va is False or vb is False or va == vb:
        return []
    lib = "jax" if changes is JAX_CHANGES else "flax"
    aspects: dict[str, list[Change]] = {}
    for c in changes_between(va, vb, changes):
        aspects.setdefault(c.about, []).append(c)
    up = va is not None and (vb is None or va < vb)
    out = []
    for group in aspects.values():
        first, last = group[0], group[-1]
        if up:
            out.append((first, f"from {lib} {last.release}, {last.now} (before {first.release}: {first.before})"))
        else:
            out.append((first, f"before {lib} {first.release}, {first.before} (from {last.release}: {last.now})"))
    return out


def _moved_by_releases(old: Capture, new: Capture) -> set | None:
    """The sites whose keys the releases alone move: a spec side derived again under the other side's releases
    (and threefry_partitionable) differs from itself there and matches the other side (so a key a model edit
    moved is not put down to the releases); None if neither side is a spec that derives."""
    for side, other in ((new, old), (old, new)):
        if side.rederive is None:
            continue
        again = side.rederive(
            other.settings.get("flax_version"),
            other.settings.get("jax_version"),
            bool(other.settings.get("threefry_partitionable", side.settings["threefry_partitionable"])),
        )
        if again is None:
            continue
        mine, there, theirs = _keys(side), _keys(again), _keys(other)
        return {k for k in mine.keys() | there.keys() if mine.get(k) != there.get(k) and there.get(k) == theirs.get(k)}
    return None


def _keys(cap: Capture) -> dict:
    return {s.ident: s.key for s in cap.sites}


class _RuleSites:
    """Which sites a changed rule is about: a key under nn.jit (or a jit fork) for nn.jit's rules, a Dropout's or
    attention's draws and fork, or a reseeded stream's draws, for NNX's, a key from a split (a vmap lane, a scan
    step, a root key given as split(...)) for JAX's threefry_partitionable default."""

    def __init__(self, old: Capture, new: Capture):
        self.drops = {s.path for cap in (old, new) for s in cap.sites if s.kind in ("dropout", "attention_dropout")}
        self.split_roots = {s for cap in (old, new) for s, text in cap.rngs.items() if "split(" in str(text)}

    def affects(self, c: Change, e: Entry) -> bool:
        sites = [s for s in (e.old, e.new) if s is not None]
        if c.rule.startswith("jit_"):
            return any("jit" in s.context or s.kind == "jit_fork" for s in sites)
        if c.rule == "nnx_dropout_fork":
            return any(s.kind in ("dropout", "attention_dropout", "fork") and s.path in self.drops for s in sites)
        if c.rule == "nnx_reseed":
            return any(any("nnx.reseed" in step for step in s.chain) for s in sites)
        if c.rule == "threefry_partitionable":
            return any("split" in s.context or s.lane or s.stream in self.split_roots for s in sites)
        return False  # (stream_fallback: the older release raises instead, so no key moves)


def _explain_nnx(cmp: Comparison, old: Capture, new: Capture) -> None:
    """Why an NNX site's key changed. An NNX key is fold_in(stream key, count): names are not hashed, so a site
    keeps its key unless its stream's key or its count changes, and a count changes when the stream handed out
    more or fewer keys before it (a layer inserted or removed earlier in construction order)."""
    index: _SameKeys | None = None
    shifts: _CountShifts | None = None
    pairs: dict[int, Entry] = {}  # id(a new or gone entry) -> the entry on the other side with its key
    _merge_step_moves(cmp)
    renames = _renamed_modules(cmp)
    for e in cmp.entries:
        if e.status == "changed":
            o, n = e.old, e.new
            assert o is not None and n is not None
            if o.chain != n.chain:
                e.why.append(_chain_change(o, n))
            e.why += [
                f"{k} differs ({old.settings.get(k)!r} -> {new.settings.get(k)!r})"
                for k in _SETTINGS
                if old.settings.get(k) != new.settings.get(k)
            ]
            if not e.why:
                e.why.append("the key of the stream it draws from changed")
        elif e.status in ("new", "gone"):
            if shifts is None:
                shifts = _CountShifts(old, new, renames)
            shift = shifts.explain(e)
            if shift:
                e.why.append(shift)
                continue
            if index is None:
                index = _SameKeys(cmp, renames)
            found = index.partner(e)
            if found:
                e.why.append(found[0])
                pairs.setdefault(id(e), found[1])
    _merge_moves(cmp, pairs)
    _merge_renames(cmp, renames)
    _explain_bridged(cmp, old, new)
    _merge_count_shifts(cmp)
    # (a key the other version draws at another site: where, which "nothing drew this key here" would hide)
    elsewhere: dict[str, dict[tuple, list[Site]]] = {"new": {}, "gone": {}}
    for e in cmp.entries:
        if e.status in ("new", "gone"):
            s = e.new if e.status == "new" else e.old
            if s is not None and s.key is not None:
                elsewhere[e.status].setdefault(s.key, []).append(s)
        elif e.status == "changed":
            # (a changed site's old key is drawn there no more, its new key was not drawn there before: either may
            # be the key a new or gone site draws)
            for side, t in (("gone", e.old), ("new", e.new)):
                if t is not None and t.key is not None:
                    elsewhere[side].setdefault(t.key, []).append(t)
    paths = {side: _module_paths(cap) for side, cap in (("old", old), ("new", new))}
    for e in cmp.entries:
        if e.status in ("new", "gone") and not e.why:
            # (an NNX site is a layer's draw at a step: a layer that is there still draws nothing where it is
            # deterministic, as in eval mode)
            both = e.site.path in paths["old" if e.status == "new" else "new"]
            held = {side: e.site.path in _containers(cap) for side, cap in (("old", old), ("new", new))}
            if both and held["old"] != held["new"] and e.site.path[-1:][0].isdigit():
                # (an item of a list or an nnx.Sequential that is a module in one version and a layer in the other:
                # another thing now; a named attribute whose draws moved to or from one under it is the same one)
                e.why.append(
                    f"{e.site.path_str} names another layer or module now: it "
                    + (
                        "held draws under it before and draws itself now"
                        if held["old"]
                        else "draws itself before and holds draws under it now"
                    )
                    + " (items of a list or an nnx.Sequential inserted, removed or reordered before it?)"
                )
            elif both:
                # (the layer is there in both: what it draws, or from what, changed)
                e.why.append(
                    f"{e.site.path_str} is there in both versions and "
                    + (
                        "did not draw this key before (it draws more now, or from another stream or fork, or was "
                        "deterministic or a Dropout of rate 0 at this call)"
                        if e.status == "new"
                        else "does not draw this key now (it draws less, or from another stream or fork, or is "
                        "deterministic or a Dropout of rate 0 at this call)"
                    )
                )
            else:
                e.why.append(
                    "nothing drew this key here before (the layer is new, was not called, or was deterministic at "
                    "this call: in eval mode, given deterministic=True, or a Dropout of rate 0)"
                    if e.status == "new"
                    else "nothing draws this key here now (the layer is gone, not called, or deterministic at this "
                    "call: in eval mode, given deterministic=True, or a Dropout of rate 0)"
                )
            s = e.new if e.status == "new" else e.old
            other = "gone" if e.status == "new" else "new"
            there = elsewhere[other].get(s.key, []) if s is not None and s.key is not None else []
            if there:
                t = there[0]
                cap = old if e.status == "new" else new
                mode = step_mode(cap, t.step)
                when = ("construction" if t.step == 0 else f"step {t.step}") + (f", {mode} mode" if mode else "")
                e.why.append(
                    f"the old version drew this key at {t.path_str} ({when})"
                    if e.status == "new"
                    else f"this key is drawn at {t.path_str} now ({when})"
                )


def _containers(cap: Capture) -> set[tuple]:
    """A capture's paths that hold draws under them (modules, and layers whose parameters are drawn), once."""
    if "containers" not in cap.memo:
        cap.memo["containers"] = {t.path[:i] for t in cap.sites for i in range(1, len(t.path))}
    return cap.memo["containers"]


def _module_paths(cap: Capture) -> set[tuple]:
    """A capture's paths: every prefix of a site's path (its modules, layers and their draws), worked out once."""
    if "paths" not in cap.memo:
        cap.memo["paths"] = {t.path[:i] for t in cap.sites for i in range(1, len(t.path) + 1)}
    return cap.memo["paths"]


def _bridged(cap: Capture) -> dict[tuple, list[tuple[Site, Site]]]:
    """The Linen draws inside each bridge.ToNNX of an NNX capture, by (bridge path, step): each NNX site beside
    the Linen site it is (its path below the bridge, a parameter's name as its label, Linen's identity). A second
    call of a bridge in one step (`enc#2`) is left out."""
    import dataclasses

    roots = {t.path[:-1] for t in cap.sites if t.kind == "bridge" and len(t.path) > 1}
    out: dict[tuple, list[tuple[Site, Site]]] = {}
    for t in cap.sites:
        if not roots or t.kind in ("fork", "bridge") or not t.stream_path:
            continue
        root = next((r for r in roots if t.stream_path.startswith(".".join(r) + ".to_nnx__rngs.")), None)
        if root is None or t.path[: len(root)] != root or len(t.path) == len(root):
            continue
        inner = t.path[len(root) :]
        if t.kind == "param" and t.label and len(inner) > 1 and inner[-1] == t.label:
            inner = inner[:-1]
        linen = dataclasses.replace(t, path=inner, step=-1, stream_path="", chain=(), iteration=-1)
        out.setdefault((root, t.step), []).append((t, linen))
    return out


def _explain_bridged(cmp: Comparison, old: Capture, new: Capture) -> None:
    """A draw of a Linen module inside a bridge.ToNNX is a Linen key: its path is hashed, so an unnamed layer
    inserted takes the auto-name (and the keys) of the one after it, which NNX's count reasoning does not see. Each
    bridge's Linen draws, step by step, are compared as a Linen diff compares them (a bridge at the same path on
    both sides), and a draw of theirs new, gone or changed gets that diff's why."""
    a, b = _bridged(old), _bridged(new)
    if not a and not b:
        return
    whys: dict[int, list[str]] = {}  # id(an NNX site) -> the Linen diff's why of its draw
    for where in [w for w in a if w in b]:  # (a bridge renamed, added or removed: NNX's reasoning says so)
        sides = []
        for cap, pairs in ((old, a[where]), (new, b[where])):
            linen = [t for _, t in pairs]
            if len({t.ident for t in linen}) != len(linen):
                break  # (one path drawn twice at one count: not one Linen run)
            sides.append(Capture(cap.target, "init" if where[1] == 0 else "apply", {}, cap.settings, linen))
        else:
            inner = diff(*sides)
            back = {id(t): s for pairs in (a[where], b[where]) for s, t in pairs}
            for e in inner.entries:
                if e.status != "kept" and e.why:
                    for t in (e.old, e.new):
                        if t is not None and id(t) in back:
                            whys[id(back[id(t)])] = e.why
    for e in cmp.entries:
        if e.status not in ("new", "gone", "changed"):
            continue
        found = next((whys[id(t)] for t in (e.old, e.new) if t is not None and id(t) in whys), None)
        if found:
            e.why = [f"a Linen key inside bridge.ToNNX (its module path is hashed): {w}" for w in found]


def _renamed_modules(cmp: Comparison) -> dict[tuple, tuple[tuple, tuple]]:
    """Modules gone and new that draw alike (the same parameter names, streams and kinds below them, step by step),
    each the only one of its shape on its side: one module renamed (old path -> (new path, shape)), at the highest
    level whose name differs (rnn -> encoder, not rnn.cell.ii -> encoder.cell.ii). Its keys may have changed too
    (built at another point of `__init__`: its counts moved). Then, of those left, a module gone and one new beside
    it (the same parent) that draw mostly alike, each the other's only best match: renamed with layers added or
    removed inside (blocks -> layers with a gate added), or one of several alike renamed alike (layers.0.mlp ->
    layers.0.ffw, layers.1.mlp -> layers.1.ffw); `shape` is then what both draw."""
    assert cmp.old is not None and cmp.new is not None
    paths = {
        side: {t.path[:i] for t in cap.sites for i in range(1, len(t.path) + 1)}
        for side, cap in (("old", cmp.old), ("new", cmp.new))
    }
    groups: dict[str, dict[tuple, list[Site]]] = {"gone": {}, "new": {}}
    for e in cmp.entries:
        if e.status in ("new", "gone"):
            module = _module_of(e.site)
            other = paths["new" if e.status == "gone" else "old"]
            root = next((module[:i] for i in range(1, len(module) + 1) if module[:i] not in other), None)
            if root is not None:
                groups[e.status].setdefault(root, []).append(e.site)
    by_shape: dict[tuple, dict[str, list[tuple]]] = {}
    shapes: dict[str, dict[tuple, Counter]] = {"gone": {}, "new": {}}
    for status, modules in groups.items():
        for module, sites in modules.items():
            shape = tuple(sorted((t.path[len(module) :], t.stream, t.kind, t.step, t.lane) for t in sites))
            by_shape.setdefault(shape, {"gone": [], "new": []})[status].append(module)
            shapes[status][module] = Counter(shape)
    found = {
        sides["gone"][0]: (sides["new"][0], shape)
        for shape, sides in by_shape.items()
        if len(sides["gone"]) == 1 and len(sides["new"]) == 1  # (more of one shape: which is which is not known)
    }
    taken = {q for q, _ in found.values()}
    gone = {m: c for m, c in shapes["gone"].items() if m not in found}
    new = {m: c for m, c in shapes["new"].items() if m not in taken}

    def best(m: tuple, c: Counter, others: dict[tuple, Counter]) -> tuple | None:
        """The module beside m on the other side that draws most of what m draws (at least half of the smaller
        one's draws), if only one does."""
        scores = {o: sum((c & oc).values()) for o, oc in others.items() if o[:-1] == m[:-1] and len(o) == len(m)}
        top = max(scores.values(), default=0)
        winners = [o for o, v in scores.items() if v == top]
        if len(winners) != 1 or 2 * top < min(sum(c.values()), sum(others[winners[0]].values())):
            return None
        return winners[0]

    for m, c in gone.items():
        q = best(m, c, new)
        if q is not None and best(q, new[q], gone) == m:
            found[m] = (q, tuple(sorted((c & new[q]).elements())))
    return found


def _renamed_prefix(path: tuple, names: dict) -> tuple[int, tuple] | None:
    """The shortest prefix of `path` that `names` maps (a renamed module, by either name): its length and the
    other name, or None."""
    for i in range(1, len(path) + 1):
        other = names.get(path[:i])
        if other is not None:
            return i, other
    return None


def _module_of(s: Site) -> tuple:
    """The module a draw belongs to: its path less the parameter name (a one-part path is the module's own)."""
    return s.path[:-1] if len(s.path) > 1 else s.path


def _merge_renames(cmp: Comparison, renames: dict[tuple, tuple[tuple, tuple]]) -> None:
    """Each draw of a renamed module whose key changed, gone under its old name and new under the new one and
    not explained otherwise: one `changed` entry from the old name to the new, with why (its count moved)."""
    sides: dict[tuple, list[Entry]] = {}
    names = {"gone": {p: q for p, (q, _) in renames.items()}, "new": {q: p for p, (q, _) in renames.items()}}
    for e in cmp.entries:
        if e.status in ("new", "gone") and not e.why:
            module = _module_of(e.site)
            hit = _renamed_prefix(module, names[e.status])
            if hit is not None:
                sides.setdefault((e.status, module[: hit[0]]), []).append(e)
    merged: dict[int, Entry] = {}
    dropped: set[int] = set()
    for p, (q, shape) in renames.items():
        # (each draw beside its counterpart: the same name below the module, stream, kind, step and lane)
        order = lambda e, m: (e.site.step, e.site.lane, e.site.path[len(m) :], e.site.stream, e.site.kind, e.site.count)
        olds = sorted(sides.get(("gone", p), []), key=lambda e: order(e, p))
        news = sorted(sides.get(("new", q), []), key=lambda e: order(e, q))
        # (a draw added or removed inside the renamed module has no counterpart: it stays new or gone)
        same = lambda e, m: (e.site.step, e.site.lane, e.site.path[len(m) :], e.site.stream, e.site.kind)
        counterparts: dict[tuple, list[Entry]] = {}
        for n in news:
            counterparts.setdefault(same(n, q), []).append(n)
        for o in olds:
            left = counterparts.get(same(o, p))
            if not left:
                continue
            n = left.pop(0)
            a, b = o.site, n.site
            was, now = ".".join(p), ".".join(q)
            why = [
                (
                    f"{now} draws what {was} drew ({', '.join(_shown(shape))}) and {was} is gone: {was} renamed {now} "
                    f"(or {was} removed and {now} added)"
                )
            ]
            if a.count != b.count:
                delta = b.count - a.count
                why.append(
                    f"count shift: it drew {b.stream!r} count {a.count} before and {b.count} now, {abs(delta)} "
                    f"{'more' if delta > 0 else 'fewer'} keys of {b.stream_path} handed out before it (it is built "
                    "at another point of __init__, or layers before it were added or removed). An NNX key depends "
                    "on how many keys its stream handed out before it, not on names: build each submodule from "
                    "rngs.fork(), so that its keys do not depend on what is built before it"
                )
            elif a.chain != b.chain:
                why.append(_chain_change(a, b))
            if a.key == b.key:
                # (a draw of it whose count did not move, a fork of a stream nothing else draws: its key kept)
                why = [f"the same key, drawn at {'.'.join(b.path)} now and at {'.'.join(a.path)} before ({why[0]})"]
            merged[id(n)] = Entry("moved" if a.key == b.key else "changed", n.ident, a, b, why)
            dropped.add(id(o))
    if merged:
        cmp.entries = [merged.get(id(e), e) for e in cmp.entries if id(e) not in dropped]


def _merge_count_shifts(cmp: Comparison) -> None:
    """A draw whose count shifted (the same layer's draw, gone at one count and new at another, each explained by
    the count shift): one `changed` entry, count before -> now, instead of a GONE and a NEW saying the same. The
    n-th call of a layer in a step is paired with the n-th."""

    def draw(s: Site) -> tuple:
        return (s.path, s.stream, s.stream_path, s.kind, s.label, s.step, s.lane, s.iteration)

    sides: dict[str, dict[tuple, list[Entry]]] = {"gone": {}, "new": {}}
    for e in cmp.entries:
        if e.status in sides and e.why and e.why[0].startswith("count shift:"):
            sides[e.status].setdefault(draw(e.site), []).append(e)
    merged: dict[int, Entry] = {}
    used: set[int] = set()
    for k, news in sides["new"].items():
        gones = sides["gone"].get(k, [])
        if len(gones) != len(news):
            continue  # (which call is which is not known)
        for g, n in zip(sorted(gones, key=lambda e: e.site.count), sorted(news, key=lambda e: e.site.count)):
            assert g.old is not None and n.new is not None
            status = "moved" if g.old.key == n.new.key else "changed"
            merged[id(n)] = Entry(status, n.ident, g.old, n.new, list(n.why))
            used.add(id(g))
    if merged:
        cmp.entries = [merged.get(id(e), e) for e in cmp.entries if id(e) not in used]


def _chain_change(a: Site, b: Site) -> str:
    return (
        f"the stream {b.stream_path} it draws from was made differently: {' -> '.join(a.chain)}  became  "
        f"{' -> '.join(b.chain)}"
    )


def _shown(shape: tuple) -> list[str]:
    names = list(dict.fromkeys(".".join(tail) or "(its own)" for tail, *_ in shape))
    return names[:4] + ([f"{len(names) - 4} more"] if len(names) > 4 else [])


def _merge_step_moves(cmp: Comparison) -> None:
    """A gone site and a new one that are the same draw (path, stream, count, lane, scan step, kind) with the same
    key at another step of the run: one `moved` entry, which a gate does not fail on. The calls before it changed,
    not its key: a training step's draw moved past a call of the model (its rows belong to the next call), or calls
    that draw nothing of that stream (in eval mode) were added or removed before it. Drawn in the other mode now
    (a train step's key drawn at an eval step): one `changed` entry, which fails, saying so."""

    def draw(s: Site) -> tuple:
        return (s.path, s.stream, s.stream_path, s.count, s.lane, s.iteration, s.kind, s.key)

    same_modes = (  # (the two runs set the same modes at the same steps: a draw in the other mode moved itself)
        cmp.old is not None and cmp.new is not None and cmp.old.eval_steps == cmp.new.eval_steps
    )
    gone: dict[tuple, list[Entry]] = {}
    for e in cmp.entries:
        if e.status == "gone" and e.old is not None and e.old.step > 0 and e.old.key is not None:
            gone.setdefault(draw(e.old), []).append(e)
    if not gone:
        return
    used: set[int] = set()
    merged: dict[int, Entry] = {}
    for e in cmp.entries:
        if e.status != "new" or e.new is None or e.new.step <= 0:
            continue
        left = gone.get(draw(e.new))
        if left:
            g = left.pop(0)
            assert g.old is not None
            used.add(id(g))
            crossed = mode_change(cmp, g.old, e.new)
            if crossed is not None:
                was, now = crossed
                # (the key is handed to the other mode's calls: what training draws changed, which a gate fails on)
                cause = (
                    "the test that decides whether it is drawn changed (an `if not deterministic:` that became "
                    f"`if deterministic:`, a `when: {was}` that became `when: {now}`)"
                    if same_modes
                    else "the run's model.train()/model.eval() calls changed, or the test that decides whether it "
                    "is drawn did"
                )
                why = (
                    f"the same key from the same site and count, drawn in {now} mode now (step {e.new.step}) and in "
                    f"{was} mode before (step {g.old.step}): {cause}, so the {was} calls no longer get it"
                )
                merged[id(e)] = Entry("changed", e.ident, g.old, e.new, [why])
                continue
            why = (
                f"the same key from the same site and count, drawn at step {e.new.step} now and at step "
                f"{g.old.step} before: what the steps before it draw changed, not this key (a draw of the "
                "training step moved past a call of the model, draws of this stream added to or removed from a step "
                "before it, or calls that draw nothing of this stream, in eval mode, added or removed before it)"
            )
            merged[id(e)] = Entry("moved", e.ident, g.old, e.new, [why])
    if merged:
        cmp.entries = [merged.get(id(e), e) for e in cmp.entries if id(e) not in used]


def step_mode(cap: Capture | None, step: int) -> str | None:
    """The mode (train or eval) a step of an NNX capture ran in, as its run's model.train()/eval() set it; None
    for construction, a run that sets no mode (its layers draw as built) or a keys file that does not say."""
    if cap is None or cap.eval_steps is None or step <= 0:
        return None
    return "eval" if step in cap.eval_steps else "train"  # (before the first event: train, as `when:` draws are)


def mode_change(cmp: Comparison, old: Site | None, new: Site | None) -> tuple[str, str] | None:
    """The modes (before, now) of a draw made at another step in the other mode now (a train step's key drawn at
    an eval step), or None."""
    if old is None or new is None or old.step == new.step:
        return None
    was, now = step_mode(cmp.old, old.step), step_mode(cmp.new, new.step)
    return (was, now) if was is not None and now is not None and was != now else None


def _merge_moves(cmp: Comparison, pairs: dict) -> None:
    """A gone site and a new one that draw the same key (and nothing else of either name is left): one `moved`
    entry, which a gate does not fail on (NNX keys do not depend on names: the layer's keys are what they were)."""
    by_id = {id(e): e for e in cmp.entries}
    used: set[int] = set()
    merged: dict[int, Entry] = {}
    for eid, partner in pairs.items():
        e = by_id[eid]
        if eid in used or id(partner) in used or pairs.get(id(partner)) is not e:
            continue
        gone, new = (e, partner) if e.status == "gone" else (partner, e)
        used |= {eid, id(partner)}
        merged[id(new)] = Entry("moved", new.ident, gone.old, new.new, list(new.why))
    if merged:
        cmp.entries = [merged.get(id(e), e) for e in cmp.entries if id(e) not in used or id(e) in merged]


class _SameKeys:
    """A diff's new and gone NNX sites by what a move keeps (key, stream, count, kind, label, parameter name), and
    the paths of each side: the pairs of a site gone and one new that are the same draw under another name."""

    def __init__(self, cmp: Comparison, renames: dict | None = None):
        assert cmp.old is not None and cmp.new is not None
        # a module renamed whole (_renamed_modules), old name -> new and back
        self.renames = {p: q for p, (q, _) in (renames or {}).items()}
        self.back = {q: p for p, q in self.renames.items()}
        self.old_paths = {t.path for t in cmp.old.sites}
        self.new_paths = {t.path for t in cmp.new.sites}
        # (every layer and module of each side: a draw that is no parameter says nothing of the layer drawing it)
        self.old_modules, self.new_modules = _module_paths(cmp.old), _module_paths(cmp.new)
        self.by_draw: dict[tuple, list[Entry]] = {}
        self.sites: dict[str, list[Site]] = {"new": [], "gone": []}
        self.whole: dict[tuple, bool] = {}  # (old path part, new path part) -> renamed whole
        for f in cmp.entries:
            if f.status in ("new", "gone"):
                self.by_draw.setdefault((f.status,) + _draw(f.site), []).append(f)
                self.sites[f.status].append(f.site)

    def renamed_whole(self, a: Site, b: Site) -> bool:
        """Whether a (gone) and b (new) are one draw of a module renamed whole: the part of their paths that
        differs, P before and Q now, has every draw of P gone and at Q alike, and nothing else at Q (a layer
        inserted before a renamed one takes some of its counts, and its keys, under other parameter names: not a
        rename)."""
        k = 0
        while k < min(len(a.path), len(b.path)) - 1 and a.path[-1 - k] == b.path[-1 - k]:
            k += 1
        p, q = a.path[: len(a.path) - k], b.path[: len(b.path) - k]
        j = 0
        while j < min(len(p), len(q)) - 1 and p[j] == q[j]:
            j += 1
        if len(p) == len(q) and len(p) - j > 1 and any(x == y for x, y in zip(p[j:], q[j:])):
            # two names changed at two levels with one kept between them (rnn.cell.ig -> encoder.cell.ii): not one
            # rename or move, but a layer inserted before a renamed module shifting its counts onto a sibling's
            return False
        if (p, q) in self.whole:  # (every draw of a module asks about the same pair: the sites are walked once)
            return self.whole[p, q]

        def under(sites: list[Site], prefix: tuple) -> Counter:
            n = len(prefix)
            return Counter((t.path[n:], _draw(t)[:-1]) for t in sites if t.path[:n] == prefix)

        self.whole[p, q] = under(self.sites["gone"], p) == under(self.sites["new"], q)
        return self.whole[p, q]

    def partner(self, e: Entry) -> tuple[str, Entry] | None:
        """The entry on the other side with e's draw, neither path on the other side at all (a layer inserted
        before another takes over its count instead; not this), and why. The stream's path may differ: a renamed
        module's own streams (a Dropout's fork, a ToNNX's Rngs) are named after it."""
        s = e.site
        for f in self.by_draw.get(("gone" if e.status == "new" else "new",) + _draw(s), ()):
            t = f.site
            a, b = (t, s) if e.status == "new" else (s, t)
            if a.path in self.new_paths or b.path in self.old_paths or not self.renamed_whole(a, b):
                continue
            if s.kind != "param" and (a.path in self.new_modules or b.path in self.old_modules):
                # (a rename or a move leaves the old name and takes a new one; a name there in both versions is
                # another layer's in one of them: items of a list or an nnx.Sequential inserted or reordered, a
                # Dropout taking the fork another one had. A parameter's name says which layer it is, a Dropout's
                # draw does not)
                continue
            if not self.follows_renames(a, b):
                continue
            why = (
                f"the same key, drawn at {'.'.join(b.path)} now and at {'.'.join(a.path)} before (a rename or a "
                "move: NNX keys do not depend on names)"
            )
            return why, f
        return None

    def follows_renames(self, a: Site, b: Site) -> bool:
        """Whether gone a and new b keep the names a module renamed whole keeps below it (dec -> dec_v2 maps
        dec.l0 to dec_v2.l0: the same key at dec_v2.l1 is its counts moving, not l0 renamed l1)."""
        hit = _renamed_prefix(a.path, self.renames)
        if hit is not None:
            return b.path == hit[1] + a.path[hit[0] :]
        hit = _renamed_prefix(b.path, self.back)
        return hit is None or a.path == hit[1] + b.path[hit[0] :]


def _draw(s: Site) -> tuple:
    """What a move keeps of a site: its key, stream, count, kind, label, and what a parameter's last path part
    says of the layer (`kernel`; a Linear replaced by a LayerNorm drawing the same counts does not keep it). Any
    other site's path ends with the name of the layer or module that draws (a Dropout's `drop`): renamed."""
    return (s.key, s.stream, s.count, s.kind, s.label, s.path[-1] if len(s.path) > 1 and s.kind == "param" else "")


class _CountShifts:
    """A diff's NNX count shifts: the same site drawing the same stream at another count, and which draws were
    added (or removed) before it. Each side's sites are indexed once (a layer inserted early shifts most sites)."""

    def __init__(self, old: Capture, new: Capture, renames: dict | None = None):
        # the modules renamed (_renamed_modules), both ways: their draws were moved, not added or removed
        self.renamed = {"old": {p: q for p, (q, _) in (renames or {}).items()}}
        self.renamed["new"] = {q: p for p, q in self.renamed["old"].items()}
        self.first: dict[str, dict[tuple, Site]] = {}  # side -> (path, stream, step, lane, kind) -> first site
        # side -> (path, stream, step, lane, kind) -> its sites by count (a layer called twice a step: its calls)
        self.calls: dict[str, dict[tuple, list[Site]]] = {}
        self.only: dict[str, dict[tuple, list[Site]]] = {}  # side -> (stream_path, step) -> sites the other lacks
        known = {
            name: {(t.path, t.stream_path, t.step, t.lane) for t in cap.sites}
            for name, cap in (("old", old), ("new", new))
        }
        self.paths = {name: _module_paths(cap) for name, cap in (("old", old), ("new", new))}
        for name, cap, other in (("old", old, "new"), ("new", new, "old")):
            first: dict[tuple, Site] = {}
            only: dict[tuple, list[Site]] = {}
            calls: dict[tuple, list[Site]] = {}
            for t in cap.sites:
                first.setdefault((t.path, t.stream, t.step, t.lane, t.kind), t)
                calls.setdefault((t.path, t.stream, t.step, t.lane, t.kind), []).append(t)
                if (t.path, t.stream_path, t.step, t.lane) not in known[other]:
                    only.setdefault((t.stream_path, t.step), []).append(t)
            self.first[name], self.only[name] = first, only
            for v in calls.values():
                v.sort(key=lambda t: t.count)
            self.calls[name] = calls

    def explain(self, e: Entry) -> str | None:
        s = e.site
        key = (s.path, s.stream, s.step, s.lane, s.kind)
        theirs = self.calls["old" if e.status == "new" else "new"].get(key)
        if not theirs:
            return None
        # (the same call of the layer on the other side: a Dropout called twice a step is two sites, the n-th
        # call's count compared with the n-th's)
        ours = self.calls["new" if e.status == "new" else "old"].get(key, [s])
        if any(t.stream_path == s.stream_path for t in theirs):
            # (a site drawing the tag from two streams, its own fork and its caller's: the same stream's draws)
            theirs = [t for t in theirs if t.stream_path == s.stream_path]
            ours = [t for t in ours if t.stream_path == s.stream_path]
        match = theirs[min(next((i for i, t in enumerate(ours) if t is s), 0), len(theirs) - 1)]
        before, after = (match, s) if e.status == "new" else (s, match)
        if before.stream_path != after.stream_path:
            # (not one stream's count: the site draws from another stream now, a fork of its own or its caller's)
            return (
                f"{'.'.join(s.path)} draws {s.stream!r} from another stream now: {after.stream_path} (count "
                f"{after.count}) now, {before.stream_path} (count {before.count}) before"
            )
        if before.count == after.count:
            return None
        reseeded = [any("nnx.reseed" in step for step in t.chain) for t in (before, after)]
        if reseeded[0] != reseeded[1]:
            # (not draws added or removed before it: a reseed reaches the stream before it in one version only,
            # setting its key anew and its count back to 0)
            return (
                f"count shift: {'.'.join(s.path)} drew {s.stream!r} count {before.count} before and {after.count} "
                f"now: {_chain_change(before, after)} (nnx.reseed reaches the stream before this draw in the "
                f"{'old' if reseeded[0] else 'new'} version only)"
            )
        delta = after.count - before.count
        # the draws of that stream that exist on one side only, before the site: what moved it
        site = after if delta > 0 else before
        side = "new" if delta > 0 else "old"
        # (the stream's counts carry on from call to call: the draws of the calls before this one count too)
        only = [t for n in range(site.step + 1) for t in self.only[side].get((site.stream_path, n), [])]
        moved, renamed = [], 0
        for t in only:
            if t.count >= site.count:
                continue
            there = self.counterpart(t, side)
            if there is None:
                moved.append(t)  # (added, or removed)
            elif there.count > (before if delta > 0 else after).count:
                moved.append(t)  # (a renamed module's draw that was after the site and is before it now, or back)
                renamed += 1
        where = ""
        stale = [t for t in (before, after) if "stale_call" in t.context]
        lower = before if delta > 0 else after
        if not (moved and len(moved) == abs(delta)) and len(stale) == 1 and stale[0] is lower and s.step > 1:
            # (one side's step drops the state its jitted function returns: its counts rolled back after the calls
            # before this one, which added or removed no draw of the stream to explain it)
            now = lower is after
            return (
                f"count shift: {'.'.join(s.path)} drew {s.stream!r} count {before.count} before and {after.count} "
                f"now: the {'new' if now else 'old'} run's step drops the state its jitted function returns "
                "(stale_call: the RNG counts roll back after each call, so the next call draws the same keys again)"
                + ("; write it back (nnx.update(model, state)) for the counts to carry on" if now else "")
            )
        if moved and len(moved) == abs(delta):
            paths = list(dict.fromkeys(self.what(t, side) for t in moved))
            shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            verb = (
                ("added before it", "before it now and after it before, under another name (the rename above)")
                if delta > 0
                else ("removed before it", "after it now and before it before, under another name (the rename above)")
            )
            how = verb[0] if not renamed else verb[1] if renamed == len(moved) else f"{verb[0]}, or {verb[1]}"
            where = f": {how}: {shown}"
        advice = (
            "An NNX key depends on how many keys its stream handed out before it, not on names: build each module of "
            "yours from rngs.fork() (Block(rngs=rngs.fork()), each model of several), so that layers added inside one "
            "leave the others' keys as they were"
            if s.step <= 0
            else "A stream's count carries on from call to call: a call that draws more or fewer keys (a layer added or "
            "removed, or deterministic in eval mode) moves every later key of the stream"
        )
        return (
            f"count shift: {'.'.join(s.path)} drew {s.stream!r} count {before.count} before and {after.count} now, "
            f"{abs(delta)} {'more' if delta > 0 else 'fewer'} keys of {site.stream_path} handed out before it"
            f"{where}. {advice}" + (f". And {_chain_change(before, after)}" if before.chain != after.chain else "")
            # (its key was made another way too: both versions reseed it, at other steps or with other seeds; a fork
            # made at another count)
        )

    def what(self, t: Site, side: str) -> str:
        """A draw added (side new) or removed (side old) before a site, as the count shift names it: a fork by the
        layer that made it, and whether that layer is there on the other side (an attention whose dropout_rate
        became 0 is there still, and forks `dropout` no more)."""
        name = ".".join(t.path)
        if t.kind != "fork":
            return name
        there = t.path in self.paths["old" if side == "new" else "new"]
        state = (
            "(it was there before, and did not fork it)"
            if side == "new"
            else "(it is there still, and forks it no more)"
        )
        return f"the {t.stream!r} fork of {name}" + (f" {state}" if there else "")

    def counterpart(self, t: Site, side: str) -> Site | None:
        """A draw of a renamed module on `side`: the same draw under its name on the other side."""
        hit = _renamed_prefix(_module_of(t), self.renamed[side])
        if hit is None:
            return None
        other = "old" if side == "new" else "new"
        return self.first[other].get((hit[1] + t.path[hit[0] :], t.stream, t.step, t.lane, t.kind))


def _forks(cap: Capture) -> set:
    if "forks" not in cap.memo:
        cap.memo["forks"] = {s.path for s in cap.sites if s.kind in ("jit_fork", "fold_rngs_fork")}
    return cap.memo["forks"]


def _explain_changed(cmp: Comparison, old: Capture, new: Capture, lanes: tuple[dict, dict]) -> None:
    old_forks, new_forks = _forks(old), _forks(new)
    lanes_old, lanes_new = lanes
    for e in cmp.entries:
        if e.status != "changed":
            continue
        s = e.site
        prefixes = [s.path[:i] for i in range(len(s.path) + 1)]
        added = [
            p for p in prefixes if p in new_forks and p not in old_forks and not (p == s.path and s.kind == "jit_fork")
        ]
        removed = [p for p in prefixes if p in old_forks and p not in new_forks]
        for p in added:
            e.why.append(
                f"a new jit fork: nn.jit/nn.fold_rngs at {_p(p)} now forks every stream, and keys below it "
                "derive from the fork"
            )
        for p in removed:
            e.why.append(f"the jit fork at {_p(p)} is gone: keys below it derive from the stream's key again")
        ro, rn = _root_key(old.rngs.get(s.stream)), _root_key(new.rngs.get(s.stream))
        root = [f"the root key of stream {s.stream!r} differs ({ro} -> {rn})"] if ro != rn else []
        root += [
            f"{k} differs ({old.settings.get(k)!r} -> {new.settings.get(k)!r})"
            for k in _SETTINGS
            if old.settings.get(k) != new.settings.get(k)
        ]
        if s.lane and _same_counts(old, new, s):
            split = _split_change(
                lanes_old.get((s.path, s.stream, s.count)), lanes_new.get((s.path, s.stream, s.count))
            )
            if (
                split is None
                and e.old is not None
                and e.new is not None
                and not (added or removed or "jit" in e.old.context or "jit" in e.new.context)
                and _both_specs(old, new)
            ):
                # one lane (axis size 1) shows no sharing: a spec says whether the key is split from its base (a
                # jit fork between them hides the split from the base: no claim then)
                was, now = "split" in e.old.context, "split" in e.new.context
                if was != now:
                    split = (
                        "a different split: the key is "
                        + ("now split from" if now else "no longer split from")
                        + " the key above it (split_rngs of {stream!r} changed in a transform above)"
                    )
            if split:
                e.why.append(split.format(stream=s.stream))
        e.why += root
        if not e.why:
            e.why.append(
                "unexplained: none of the causes rngaudit knows (a jit fork, a split, a root key, a setting, a "
                "release's rule) holds here; the key this site folds into (its base) differs"
            )


def _both_specs(old: Capture, new: Capture) -> bool:
    """Both sides derived from specs (their sites say how each key was made; a keys file's do not)."""
    return old.rederive is not None and new.rederive is not None


def _root_key(value) -> str:
    """A stream's root key as one text whichever side wrote it: a keys file's seed (0), a spec's seed
    ('0') or key expression ('key(0)', 'split(key(0), 3)[1]')."""
    from ..errors import Location, SpecError
    from ..spec.keyexpr import parse

    if value is None:
        return "not given"
    text = str(value).strip()
    if re.fullmatch(r"-?\d+", text):
        return f"key({int(text)})"
    try:
        return str(parse(text, Location("rngs", 1, 1)))
    except SpecError:
        return text


def _lane_keys(sites: list[Site]) -> dict:
    """(path, stream, count) -> {lane: key} of the sites drawn in vmap/scan lanes."""
    groups: dict = {}
    for s in sites:
        if s.lane:
            groups.setdefault((s.path, s.stream, s.count), {})[s.lane] = s.key
    return groups


def _split_change(old: dict | None, new: dict | None) -> str | None:
    """How the lanes of one call site are split now, if that changed: which lanes share a key."""
    if not old or not new:
        return None
    if set(old) != set(new):
        return f"the lanes changed ({len(old)} before, {len(new)} now): a vmap/scan axis size changed"

    def shares(keys: dict) -> dict:
        first: dict = {}
        return {lane: first.setdefault(k, lane) for lane, k in sorted(keys.items())}

    so, sn = shares(old), shares(new)
    if so == sn:
        return None
    if len(set(sn.values())) == 1:
        return "a different split: the lanes now share one key (split_rngs false for {stream!r})"
    if len(set(so.values())) == 1:
        return "a different split: the lanes now get split keys (split_rngs true for {stream!r})"
    return "a different split: other lanes share keys now (split_rngs of {stream!r} changed in a transform above)"


def _modules_of(cap: Capture) -> set:
    """Every module path of a capture: its recorded modules, and every path a site is drawn at or below."""
    if "modules" not in cap.memo:
        cap.memo["modules"] = set(cap.modules) | set(_sites_under(cap))
    return set(cap.memo["modules"])


# a spec's standard layers label their make_rng draws (spec/layers.py); a captured draw has no such label
_LAYER_KINDS = DRAW_KINDS | {"make_rng"}


def _label(s: Site) -> str:
    """A site's label as both inputs know it: a spec's descriptive label of a layer's make_rng is dropped."""
    if s.kind in _LAYER_KINDS and s.label in DRAW_LABELS:
        return ""
    return s.label or ""


def _what(s: Site) -> str:
    """What a draw is called in both inputs: its label, else its kind (a spec's Dropout draw is a make_rng)."""
    return _label(s) or ("make_rng" if s.kind in _LAYER_KINDS else s.kind)


def _signature(cap: Capture, mod: tuple) -> tuple:
    """The keys the module at `mod` draws, relative to its path (empty: it draws none)."""
    memo = cap.memo.setdefault("signature", {})
    if mod not in memo:
        n = len(mod)
        memo[mod] = tuple(
            sorted(
                (s.path[n:], s.stream, s.count, s.lane, _label(s))
                for s in _sites_under(cap).get(mod, ())
                if s.kind not in ("jit_fork", "fold_rngs_fork")
            )
        )
    return memo[mod]


def _sites_under(cap: Capture) -> dict:
    """Module path -> the sites at it or below it (one pass over the sites)."""
    if "under" not in cap.memo:
        under: dict = {}
        for s in cap.sites:
            for i in range(len(s.path) + 1):
                under.setdefault(s.path[:i], []).append(s)
        cap.memo["under"] = under
    return cap.memo["under"]


def _auto(name: str):
    m = re.fullmatch(r"(.+)_(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else None


def _rename_kind(old_name: str, new_name: str) -> str:
    a, b = _auto(old_name), _auto(new_name)
    if a and b and a[0] == b[0]:
        return f"shifted auto-name index ({old_name} -> {new_name})"
    if a and b and a[1] == b[1]:
        for prefix, what in _PREFIXES.items():
            if b[0] == prefix + a[0]:
                return f"renamed path: {what} renames class {a[0]} to {b[0]} ({old_name} -> {new_name})"
            if a[0] == prefix + b[0]:
                return f"renamed path: {what} was removed, so {a[0]} is {b[0]} again ({old_name} -> {new_name})"
    return f"renamed path ({old_name} -> {new_name})"


def module_moves(old: Capture, new: Capture) -> dict:
    """Old module path -> new path of the modules that moved: paired by class and hyper-parameters in creation
    order where both sides record them (keys files), then modules on one side only paired by the keys they draw
    relative to their path (same parent)."""
    mods_old, mods_new = _modules_of(old), _modules_of(new)
    paired = _pair_by_fields(old, new) if old.modules and new.modules else {}
    # in creation order (Blk_0, Blk_1 renamed fwd, bwd: Blk_0 is fwd), not by name
    only_old = sorted((m for m in mods_old - mods_new if m), key=_creation_order(old))
    only_new = sorted((m for m in mods_new - mods_old if m), key=_creation_order(new))
    used: set = set(paired.values())
    by_keys: dict = {}  # (parent, the keys a module draws) -> the new-only modules there, in order
    by_parent: dict = {}  # (parent, name without transform prefixes) -> the new-only modules there, in order
    for mn in reversed(only_new):
        by_keys.setdefault((mn[:-1], _signature(new, mn)), []).append(mn)
    for mn in only_new:
        by_parent.setdefault((mn[:-1], _base_class(mn[-1])), []).append(mn)
    for mo in only_old:
        if mo in paired or any(mo[:i] in paired for i in range(1, len(mo))):
            continue
        sig = _signature(old, mo)
        if not sig:
            continue  # (a module that draws nothing is like every other such module: nothing to follow)
        alike = by_keys.get((mo[:-1], sig), [])
        while alike and alike[-1] in used:  # (kept reversed: the first in order is last)
            alike.pop()
        if alike:
            paired[mo] = alike.pop()
            used.add(paired[mo])
    # a module that moved onto a path a module drawing other keys (or none) had: an explicit name on a keyless sibling
    # before it frees its auto-name (Dense_1 -> Dense_0), and the keys find it there
    for mo in only_old:
        if mo in paired or any(mo[:i] in paired for i in range(1, len(mo))):
            continue
        sig = _signature(old, mo)
        if not sig:
            continue
        cand = next(
            (
                mn
                for mn in _children(new).get(mo[:-1], ())
                if mn in mods_old and mn not in used and _signature(new, mn) == sig and _signature(old, mn) != sig
            ),
            None,
        )
        if cand is not None:
            paired[mo] = cand
            used.add(cand)
    # a module wrapped in a lifted transform: auto-named after the transform's class (Block_0 -> JitBlock_0), its
    # keys moved by the fork the transform adds, so the keys alone do not pair it
    for mo in only_old:
        if mo in paired or any(mo[:i] in paired for i in range(1, len(mo))) or not _signature(old, mo):
            continue
        cands = [mn for mn in by_parent.get((mo[:-1], mo[-1]), ()) if mn not in used and mn[-1] != mo[-1]]
        if len(cands) == 1:
            paired[mo] = cands[0]
            used.add(cands[0])
    return paired


def _creation_order(cap: Capture):
    """A sort key: module paths in the order the model made them (a keys file's modules are recorded in that
    order; a spec's by its first key), then by path."""
    first: dict = {}
    for i, path in enumerate(cap.modules):
        first.setdefault(tuple(path), i)
    base = len(first)
    for i, site in enumerate(cap.sites):
        for n in range(1, len(site.path) + 1):
            first.setdefault(site.path[:n], base + i)
    end = base + len(cap.sites)
    return lambda path: (first.get(path, end), path)


def _explain_moves(cmp: Comparison, old: Capture, new: Capture, lanes: tuple[dict, dict], paired: dict) -> None:
    """Explain the module moves (renames, auto-name shifts, new jit forks on them) and fix them."""
    mods_old, mods_new = _modules_of(old), _modules_of(new)
    new_forks = _forks(new)
    insertions: set = set()
    by_module: dict = {}  # module path -> the gone and new entries drawn at it or below it
    for e in cmp.entries:
        if e.status in ("gone", "new"):
            for i in range(len(e.site.path) + 1):
                by_module.setdefault(e.site.path[:i], []).append(e)
    targets = set(paired.values())
    under_old, under_new = _sites_under(old), _sites_under(new)
    shifted_by = {}  # an old module shifted by an insertion -> the inserted module (its fix names that one)
    for mo, mn in paired.items():
        inserted = _unmatched_sibling(new, mn, targets, old)
        if inserted is not None and _rename_kind(mo[-1], mn[-1]).startswith("shifted auto-name index"):
            shifted_by[mo] = inserted
    # many modules moved (each block of a model wrapped, renamed): their old names are given back all at once and
    # NEW derived once, not once per module
    restores = {mn: mo[-1] for mo, mn in paired.items() if mo not in shifted_by}
    together = None
    if len(restores) > _CHECKED_ALONE:
        together = _checked(cmp, old, new, restores, (), f"the {len(restores)} old names these fixes give, together")
        if together[1] is not None:
            together = None  # (refused together: each is checked alone, and says why it fails)
    for mo, mn in paired.items():
        why = _rename_kind(mo[-1], mn[-1])
        fix = (
            f"give the module now at {_p(mn)} an explicit name={mo[-1]!r} (in setup(), an explicit name= is "
            f"kept too): it restores the old path {_p(mo)}"
        )
        inserted = shifted_by.get(mo)
        if inserted is not None:
            fix = (
                f"give the inserted module at {_p(inserted)} an explicit name= (explicit names do not advance "
                f"the auto-name counter): the {_base_class(new.modules[inserted]['class'])} modules after it get "
                "their old names and keys back"
            )
        forked = mn in new_forks and mo not in _forks(old)
        if forked:
            fix += "; its keys still change, because nn.jit forks the streams there (a new jit fork)"
        laned = any(t.lane for t in under_new.get(mn, ())) and not any(t.lane for t in under_old.get(mo, ()))
        if laned:
            fix += "; its keys still change: they are drawn per lane now (an nn.vmap/nn.scan around it)"
        if inserted is not None:
            insertions.add(inserted)
            checked, refused = _checked(cmp, old, new, {inserted: _free_name(new, inserted)}, mo[:-1])
        elif together is not None:
            checked, refused = together
        else:
            checked, refused = _checked(cmp, old, new, {mn: mo[-1]}, mo)
        cmp.notes.append(f"{_p(mo)} -> {_p(mn)}: {why}")
        fixed: str | None = fix + checked
        if refused is not None:  # a fix that fails when applied is no fix: said as a note instead
            tried = fix.split(" (")[0].split(":")[0]
            cmp.notes.append(f"no fix by a name here: {tried} was tried, and {refused}")
            fixed = None
        else:
            cmp.fixes.append(fix + checked)
        for e in {id(e): e for e in by_module.get(mo, []) + by_module.get(mn, [])}.values():
            s = e.site
            if e.status == "gone" and s.path[: len(mo)] == mo:
                e.why.append(f"{why}; its keys moved to {_p(mn + s.path[len(mo) :])}")
                e.fix = fixed
            elif e.status == "new" and s.path[: len(mn)] == mn:
                if s.kind == "jit_fork" and s.path == mn:
                    e.why.append(f"a new jit fork at {_p(mn)} ({why})")
                else:
                    e.why.append(f"{why}; was {_p(mo + s.path[len(mn) :])}")
                e.fix = fixed
    inserted_at = sorted(insertions)
    for e in cmp.entries:
        at = next((p for p in inserted_at if e.site.path[: len(p)] == p), None)
        if e.status == "new" and not e.why and at is not None:
            e.why.append(f"drawn by the {_base_class(new.modules[at]['class'])} inserted at {_p(at)}")
    _explain_insertions(cmp, old, new, mods_old, mods_new, targets)
    _explain_unrolled(cmp, old, new)
    for e in cmp.entries:
        if e.status in ("new", "gone") and not e.why:
            e.why.append(
                _fork_change(e, old, new)
                or _count_shift(e, old, new)
                or _lane_count_change(e, lanes, old, new)
                or ("a call site that did not exist before" if e.status == "new" else "this call site no longer exists")
            )


_LANE_TRANSFORMS = {"Scan": ("nn.scan", "step"), "Vmap": ("nn.vmap", "lane")}


def _lane_module(cap: Capture, path: tuple) -> tuple[tuple, str, str] | None:
    """The nn.scan/nn.vmap module a draw at `path` is made in (the outermost one): its path, the transform and the
    class it maps (ScanBlock_0 -> ("ScanBlock_0",), "Scan", "Block")."""
    for i in range(1, len(path)):
        cls = cap.modules.get(path[:i], {}).get("class") or path[i - 1].rsplit("_", 1)[0]
        for prefix in _LANE_TRANSFORMS:
            if cls.startswith(prefix) and len(cls) > len(prefix) and cls[len(prefix)].isupper():
                return path[:i], prefix, cls[len(prefix) :]
    return None


def _explain_unrolled(cmp: Comparison, old: Capture, new: Capture) -> None:
    """An nn.scan (or nn.vmap) module gone whose N steps (lanes) drew what N modules new beside it draw (each the
    same draws below it, and of the class it mapped), or the other way round: the transform unrolled into modules
    (or modules rolled into it). Every key changes: a step's key is split from the transform's, a module's is
    hashed from its own path. Said on each of those sites, with the modules' names."""
    for lanes_cap, flat_cap, lanes_status, flat_status in ((old, new, "gone", "new"), (new, old, "new", "gone")):
        groups: dict[tuple, dict] = {}
        for e in cmp.entries:
            s = e.site
            if e.status != lanes_status or len(s.lane) != 1:
                continue
            found = _lane_module(lanes_cap, s.path)
            if found is None:
                continue
            m, prefix, inner = found
            g = groups.setdefault(m, {"prefix": prefix, "inner": inner, "lanes": {}, "entries": []})
            g["lanes"].setdefault(s.lane[0], set()).add((s.path[len(m) :], s.stream, s.kind, s.label))
            g["entries"].append(e)
        for m, g in groups.items():
            shapes = list(g["lanes"].values())
            n = len(shapes)
            if sorted(g["lanes"]) != list(range(n)) or any(sh != shapes[0] for sh in shapes):
                continue  # (lanes that draw differently: not one module mapped)
            parent = m[:-1]
            there = {t.path[: len(m)] for t in lanes_cap.sites}  # (the modules at m's depth on the lanes' side)
            modules: dict[tuple, list[Entry]] = {}
            for e in cmp.entries:
                s = e.site
                if e.status != flat_status or s.lane or len(s.path) <= len(m) or s.path[: len(parent)] != parent:
                    continue
                mod = s.path[: len(m)]
                cls = flat_cap.modules.get(mod, {}).get("class") or mod[-1].rsplit("_", 1)[0]
                if cls == g["inner"] and mod not in there:
                    modules.setdefault(mod, []).append(e)
            if len(modules) != n or any(
                {(e.site.path[len(m) :], e.site.stream, e.site.kind, e.site.label) for e in es} != shapes[0]
                for es in modules.values()
            ):
                continue
            tool, unit = _LANE_TRANSFORMS[g["prefix"]]
            names = ", ".join(_p(mod) for mod in list(modules)[:4]) + (f" and {n - 4} more" if n > 4 else "")
            rolled = lanes_status == "new"
            how = (
                f"the modules {names} were rolled into {_p(m)} ({tool} over {g['inner']}, {n} {unit}s), or removed "
                "and it added"
                if rolled
                else f"{_p(m)} ({tool} over {g['inner']}, {n} {unit}s) was unrolled into the modules {names}, or "
                "removed and they added"
            )
            why = (
                f"{how}: they draw alike ({', '.join(sorted({str(label or kind) for _, _, kind, label in shapes[0]}))}). "
                f"A {unit}'s key is split from {_p(m)}'s key, a module's is hashed from its own path: no key is "
                f"kept (re-initialise, or keep the {'modules' if rolled else tool} for checkpoints made with "
                f"{'them' if rolled else 'it'})"
            )
            # (on the sites nothing else explains: a module of them paired with the transform, Block_0 wrapped in
            # nn.scan, keeps that explanation)
            for e in [e for e in g["entries"] + [e for es in modules.values() for e in es] if not e.why]:
                e.why.append(why)


def _free_name(cap: Capture, path: tuple) -> str:
    """An explicit name for the module at `path` that no sibling has (the fix names it; any free name works)."""
    if "names" not in cap.memo:  # parent path -> its children's names
        names: dict = {}
        for p in _modules_of(cap):
            if p:
                names.setdefault(p[:-1], set()).add(p[-1])
        cap.memo["names"] = names
    taken = cap.memo["names"].get(path[:-1], set())
    base = f"{path[-1].rsplit('_', 1)[0].lower()}_inserted"
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


_CHECKED_ALONE = 24  # more moved modules than this: their fixes are checked together, in one derivation


def _checked(
    cmp: Comparison, old: Capture, new: Capture, names: dict, scope: tuple, what: str | None = None
) -> tuple[str, str | None]:
    """A fix applied: NEW re-derived with the explicit `names` ({module path: name}) and compared with OLD. Returns
    what to add to the fix (empty where NEW cannot be re-derived: a keys file, a path that is no single module of
    its spec), and why the fix fails when the re-derived model does (None: it does not). `what`: how the names are
    said (default: each one)."""
    if new.renamed is None:
        return "", None
    # (one fix shared by many moved modules, the name of one inserted module, is checked once per diff)
    done = new.memo.setdefault(("checked", id(cmp)), (cmp, {}))[1]
    asked = (tuple(sorted(names.items())), scope)
    if asked not in done:
        done[asked] = _check(cmp, old, new, names, scope, what)
    return done[asked]


def _check(
    cmp: Comparison, old: Capture, new: Capture, names: dict, scope: tuple, what: str | None
) -> tuple[str, str | None]:
    fixed = None if new.renamed is None else new.renamed(names)
    if fixed is None:
        if new.source is not None and new.memo.get("spec") is None:  # a keys file with no spec that replays it
            return (
                " [not checked: NEW is a keys file, and no spec that replays it was found (the one `capture -o` "
                "wrote, as its `spec` field names it or beside it); diff that spec to check the fix]"
            ), None
        if new.renamed is not None:
            # (NEW's spec makes those modules with a statement shared by other paths, or makes none there)
            # (the modules of a fix checked together can be thousands: a few are named, as elsewhere)
            moved = [_p(p) for p in names]
            where = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
            return (
                f" [not checked: in NEW's spec {where} is made by a statement that makes other modules too (a "
                "`repeat:`, or a module definition used at several paths), which a name would rename alike]"
            ), None
        return "", None
    what = what or ", ".join(f"name={n!r} at {_p(p)}" for p, n in names.items())
    if isinstance(fixed, str):
        return "", f"with {what} the model fails: {fixed}"
    kept = {e.ident for e in cmp.entries if e.status == "kept"}
    now = {s.ident: s.key for s in fixed.sites}

    # an old key of the scope changed when its site (path, count) lost it, or its thing (the layer's kernel ...)
    # draws another now; it comes back when both hold again after the fix
    def thing(t: Thing) -> tuple:
        return (t.old_module, t.what, t.stream, t.lane, t.nth)

    things_now = {thing(t): t for t in cmp.things if t.old_module[: len(scope)] == scope}
    things_fixed = {thing(t) for t in changed_things(old, fixed)}
    by_site = {id(t.old): k for k, t in things_now.items()}
    lost = [
        site
        for site in old.sites
        if site.path[: len(scope)] == scope and (site.ident not in kept or id(site) in by_site)
    ]
    back = sum(
        1
        for site in lost
        if (site.ident in kept or now.get(site.ident) == site.key)
        and (id(site) not in by_site or by_site[id(site)] not in things_fixed)
    )
    broken = sum(1 for site in old.sites if site.ident in kept and now.get(site.ident) != site.key)
    where = _p(scope) if scope else "the model"
    if not lost:
        said = f"re-derived with {what}"
    elif back == len(lost):
        said = f"re-derived with {what}: " + (
            f"the changed key of {where} comes back" if back == 1 else f"all {back} changed keys of {where} come back"
        )
    elif back:
        said = f"re-derived with {what}: {back} of the {len(lost)} changed keys of {where} come back"
    elif len(lost) == 1:
        said = f"re-derived with {what}: the path comes back, but the changed key of {where} does not"
    else:
        said = f"re-derived with {what}: the paths come back, but none of the {len(lost)} changed keys of {where} do"
    if broken:
        said += f", and {broken} key{'s' if broken > 1 else ''} kept now would change"
    return f" [checked: {said}]", None


def _unmatched_sibling(new: Capture, mn: tuple, matched: set, old: Capture):
    """A new module beside `mn`, of its class, that matches nothing in the old version (inserted)."""
    cls = new.modules.get(mn, {}).get("class")
    # (one of several alike siblings is the inserted one when there is one more of them than before)
    memo = new.memo.setdefault(("more", id(old)), (old, {}))[1]
    parent = mn[:-1]
    if parent not in memo:
        ids_old, ids_new = _identities(old, new)
        before, now = (_alike(cap, ids, parent) for cap, ids in ((old, ids_old), (new, ids_new)))
        memo[parent] = [
            p for p in _children(new).get(parent, ()) if (who := ids_new[p]) is not None and now[who] > before[who]
        ]
    return next((p for p in memo[parent] if p != mn and p not in matched and new.modules[p].get("class") == cls), None)


def _alike(cap: Capture, ids: dict, parent: tuple) -> Counter:
    """How many children of `parent` have each identity."""
    memo = cap.memo.setdefault(("alike", id(ids)), {})
    if parent not in memo:
        memo[parent] = Counter(ids[p] for p in _children(cap).get(parent, ()))
    return memo[parent]


def _children(cap: Capture) -> dict:
    """Module path -> the paths of its recorded child modules, in creation order."""
    if "children" not in cap.memo:
        kids: dict = {}
        for p in cap.modules:
            if p:
                kids.setdefault(p[:-1], []).append(p)
        cap.memo["children"] = kids
    return cap.memo["children"]


def _base_class(cls: str) -> str:
    """A class name without the prefixes Flax's lifted transforms add (JitBlock -> Block; Jitter stays: a prefix
    followed by a lower-case letter is part of the name, while Flax prefixes any name, `_Block` or `9` too)."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if cls.startswith(prefix) and len(cls) > len(prefix) and not cls[len(prefix)].islower():
                cls, changed = cls[len(prefix) :], True
    return cls


def _pair_by_fields(old: Capture, new: Capture) -> dict:
    """Children of one parent matched in creation order by class (transform prefixes aside) and
    hyper-parameters; pairs whose names differ are renames."""

    ids_old, ids_new = _identities(old, new)

    def children(cap, ids):
        out: dict = {}
        for path in cap.modules:
            if path and (who := ids[path]) is not None:
                out.setdefault(path[:-1], []).append((path, who))
        return out

    co, cn = children(old, ids_old), children(new, ids_new)
    pairs: dict = {}
    for parent, olds in co.items():
        if parent not in new.modules and parent:
            continue
        # a child with a name no insertion shifts (not Cls_N, layers_N: `m0`, `encoder`) that is the same thing
        # at the same path on both sides stays itself: the queue below would pair it with an inserted sibling
        # made before it (every module of a class, named or not, is alike there)
        same = {path for path, key in olds if _auto(path[-1]) is None and ids_new.get(path, ()) == key}
        news: dict = {}  # identity -> the new children that have it, in creation order
        for p, k in cn.get(parent, ()):
            if p not in same:
                news.setdefault(k, deque()).append(p)
        for path, key in olds:
            if path in same:
                continue
            if news.get(key):
                match = news[key].popleft()
                if match != path:
                    pairs[path] = match
    # a child of a renamed module is renamed with it
    return {mo: mn for mo, mn in pairs.items() if not any(mo[:i] in pairs for i in range(1, len(mo)))}


def _explain_insertions(cmp, old: Capture, new: Capture, mods_old, mods_new, renamed_to: set) -> None:
    """A new auto-named module Cls_k whose class already had k instances: an insertion shifted the names."""
    if renamed_to:
        return
    for mn in sorted(mods_new - mods_old):
        if not mn or mn[:-1] in mods_new - mods_old:
            continue
        auto = _auto(mn[-1])
        if not auto:
            continue
        cls, k = auto
        siblings_old = sorted(
            i for m in mods_old if m and m[:-1] == mn[:-1] and (a := _auto(m[-1])) and a[0] == cls for i in [a[1]]
        )
        if not siblings_old or siblings_old != list(range(len(siblings_old))) or k != len(siblings_old):
            continue
        places = _inserted_at(old, new, mn[:-1], cls, k + 1)
        if not places:
            continue  # the siblings changed otherwise too: no insertion to claim
        names = [_p(mn[:-1] + (f"{cls}_{i}",)) for i in places]
        fix = None
        if places == [k]:
            why = f"a {cls} was added after the existing ones: {_p(mn)} is new"
        elif k in places:
            why = (
                f"a {cls} was added: appended as {_p(mn)}, or inserted at {' or '.join(names[:-1])} (the {cls} "
                "layers draw alike, so the keys cannot tell which)"
            )
        else:
            where = " or ".join(names)
            why = (
                f"shifted auto-name index: a {cls} was inserted at {where}, so every later {cls} moved up one "
                f"index and {_p(mn)} is new; the keys at the shifted paths now go to other layers"
            )
            fix = (
                f"give the inserted {cls} (now {where}) an explicit name= (explicit names do not advance the "
                f"auto-name counter): the later {cls} modules get their old names and keys back"
            )
            results = [
                _checked(cmp, old, new, {at: _free_name(new, at)}, mn[:-1])
                for at in (mn[:-1] + (f"{cls}_{i}",) for i in places)
            ]
            if results and all(refused is not None for _, refused in results):
                fix = None
            else:
                fix += "".join(text for text, refused in results if refused is None)
            cmp.notes.append(why)
            if fix is not None:
                cmp.fixes.append(fix)
        for e in cmp.entries:
            # an addition explains only what nothing else did; an insertion (with its fix) explains every site
            if e.status == "new" and e.site.path[: len(mn)] == mn and (fix is not None or not e.why):
                e.why.append(why)
                if fix is not None:
                    e.fix = fix


def _inserted_at(old: Capture, new: Capture, parent: tuple, cls: str, n_new: int) -> list[int]:
    """Where a Cls_i may have been inserted: every i whose removal from the new siblings leaves the old ones,
    compared by their hyper-parameters where both sides record them (captures), else by the keys they draw
    relative to their path. Empty when no single insertion explains the siblings."""
    paths_old = [parent + (f"{cls}_{i}",) for i in range(n_new - 1)]
    paths_new = [parent + (f"{cls}_{i}",) for i in range(n_new)]
    ids_old, ids_new = _identities(old, new)
    fo = [ids_old.get(p) for p in paths_old]
    fn = [ids_new.get(p) for p in paths_new]
    if None in fo or None in fn:
        fo = [_signature(old, p) for p in paths_old]
        fn = [_signature(new, p) for p in paths_new]
    # removing fn[i] leaves fo exactly when fn[:i] == fo[:i] and fn[i + 1:] == fo[i:]: i at most the common prefix's
    # length, and at least where the common suffix starts (one pass each, not a list built per i)
    prefix = 0
    while prefix < len(fo) and fn[prefix] == fo[prefix]:
        prefix += 1
    suffix = 0
    while suffix < len(fo) and fn[-1 - suffix] == fo[-1 - suffix]:
        suffix += 1
    return list(range(max(0, n_new - 1 - suffix), min(prefix, n_new - 1) + 1))


_FORKERS = {"jit_fork": "nn.jit", "fold_rngs_fork": "nn.fold_rngs"}


def _fork_change(e: Entry, old: Capture, new: Capture) -> str | None:
    """The key Flax draws to fork the streams where nn.jit (nn.fold_rngs) wraps a module: new where the wrap is
    new, gone where it was taken off."""
    s = e.site
    if s.kind not in _FORKERS:
        return None
    if e.status == "new" and s.path not in _forks(old):
        return f"a new jit fork: {_FORKERS[s.kind]} now wraps the module at {_p(s.path)}, and forks every stream there"
    if e.status == "gone" and s.path not in _forks(new):
        return f"the jit fork at {_p(s.path)} is gone: {_FORKERS[s.kind]} no longer wraps the module there"
    return None


def _counts(cap: Capture) -> dict:
    """(path, stream) -> the counts drawn there, every lane together."""
    if "counts" not in cap.memo:
        out: dict = {}
        for s in cap.sites:
            out.setdefault((s.path, s.stream), set()).add(s.count)
        cap.memo["counts"] = out
    return cap.memo["counts"]


def _same_counts(old: Capture, new: Capture, s: Site) -> bool:
    """Whether s's module draws the same counts of s's stream on both sides. A vmap/scan axis or a split changes
    which lanes a count has and keeps the counts; a draw added or removed before shifts them, and a count's lanes
    are then another draw's: no claim about lanes holds."""
    k = (s.path, s.stream)
    return _counts(old).get(k) == _counts(new).get(k)


def _lane_count_change(e: Entry, lanes: tuple[dict, dict], old: Capture, new: Capture) -> str | None:
    s = e.site
    if not s.lane or not _same_counts(old, new, s):
        return None
    n_old, n_new = (len(side.get((s.path, s.stream, s.count), ())) for side in lanes)
    if not n_old or not n_new or n_old == n_new:
        return None
    what = "more" if n_new > n_old else "fewer"
    return f"{what} lanes: a vmap/scan axis size changed ({n_old} lanes before, {n_new} now)"


def _count_shift(e: Entry, old: Capture, new: Capture) -> str | None:
    s = e.site
    if not s.label:
        return None
    other = old if e.status == "new" else new
    for t in other.sites:
        if t.path == s.path and t.stream == s.stream and t.label == s.label and t.lane == s.lane and t.count != s.count:
            a, b = (t.count, s.count) if e.status == "new" else (s.count, t.count)
            return f"shifted count: {s.label!r} at {s.path_str} drew count {a} before and count {b} now"
    return None


def path_text(path: tuple) -> str:
    """A module path as reports write it: '/'-joined, `(root)` for the root."""
    return "/".join(path) if path else "(root)"


_p = path_text
