"""`collisions` of an NNX spec: draws that receive identical keys, grouped, with the reason and the fix.

NNX keys are fold_in(stream key, count) with no path hashing, so two draws share a key when two streams hold the
same key at the same count, or when one stream's count (or key) goes back to a state it had: a jitted step whose
returned state is dropped, or nnx.reseed. Each group is one finding, in the category of its cause:

  shared_stream_key      (failing)      two streams seeded with the same key (Rngs(params=0, dropout=0), ...)
  count_rewind           (failing)      a stale jitted step re-emits the keys of the step before (or an Rngs
                                        made for each step with the same key)
  broadcast_lanes        (failing)      every lane of an nnx.vmap draws one key: the stream is not split
  frozen_scan_broadcast  (failing)      a stream broadcast into nnx.scan draws the same keys at every call
  keyless_dropout        (failing)      a Dropout built without rngs is given the same key at every call
  reseed_order           (information)  nnx.reseed hands a stream the keys another one drew (graph order)
  reseed_repeat          (information)  nnx.reseed hands a stream back the keys it drew (often intended)
  scan_broadcast         (information)  the steps of one nnx.scan share a broadcast stream's key (recurrent
                                        dropout's one mask per sequence)
  default_fallback       (information)  a stream the Rngs lacks is served by `default`, sharing its counter
  unsplit_lanes          (information)  the lanes of a Linen transform inside a bridge.ToNNX share a stream it
                                        does not split (Linen's unsplit_lanes)
  bridge_constant_default (failing)     a bridge.ToLinen applied without a stream its NNX module draws from in its
                                        call: ToLinen's `default` stream, the constant key(0), serves it, so every
                                        apply draws the same key (the same dropout mask)

A Linen spec's bridge.ToLinen modules get one audit per call (audit_to_linen): the NNX module it builds there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..engine.keys import KeyEngine
from ..engine.nnx import RNN_OWN_KEY, NnxKey, replay_nnx, rules_of
from ..errors import Location
from ..spec.nnx import CALL_RNGS, NnxSpec

NNX_FAILING = (
    "shared_stream_key",
    "count_rewind",
    "broadcast_lanes",
    "frozen_scan_broadcast",
    "keyless_dropout",
    "bridge_constant_default",
    "concatenation",  # (Linen's classes, for the keys of a bridge.ToNNX's Linen module)
    "hash_word",
)
NNX_CATEGORIES = NNX_FAILING + ("reseed_order", "reseed_repeat", "scan_broadcast", "default_fallback", "unsplit_lanes")


@dataclass(frozen=True)
class NnxSite:
    """One draw: when (step, 0 for construction) and where, from which stream, its count, chain and key."""

    index: int
    step: int
    site: str
    requested: str
    stream: str  # the tag of the stream that served it
    stream_path: str
    count: int
    chain: tuple[str, ...]
    key: tuple[int, ...]
    location: Location
    stale: bool = False
    lane: int = -1  # the vmap lane or stacked member (-1: none)
    iteration: int = -1  # the nnx.scan step (-1: none)
    broadcast: str = ""  # vmap, scan, vmap+scan: the transforms that broadcast its stream
    scan: int = -1  # which nnx.scan call
    linen_lane: tuple[int, ...] = ()  # a bridge.ToNNX's Linen key: its lane in Linen's transforms
    linen: bool = False  # a bridge.ToNNX's Linen key
    given: str = ""  # a key given to a Dropout's call (no stream drew it)
    linen_input: bytes = b""  # a bridge.ToNNX's Linen key: what Linen hashed (path and count)

    @property
    def path_str(self) -> str:
        return self.site

    @property
    def where(self) -> str:
        """The site with its lane and scan step, as `derive` shows them."""
        parts = (
            ([f"lane {self.lane}"] if self.lane >= 0 else [])
            + ([f"scan {self.iteration}"] if self.iteration >= 0 else [])
            + ([f"lane {', '.join(map(str, self.linen_lane))}"] if self.linen_lane else [])
        )
        return self.site + (f" [{', '.join(parts)}]" if parts else "")


@dataclass(frozen=True)
class NnxCollision:
    category: str
    failing: bool  # whether the category fails by default
    why: str
    fix: str
    sites: tuple[NnxSite, ...]  # in draw order; for default_fallback the statement's first draws
    key: tuple[int, ...] | None  # the shared key (None for default_fallback)
    collision_class: int = 0  # (Linen's class numbers do not apply)


@dataclass(frozen=True)
class NnxAudit:
    source: str
    call_sites: int
    prng_impl: str
    rules: str
    collisions: tuple[NnxCollision, ...]
    input_kind: str = "nnx_spec"
    latent: tuple = ()
    keys_checked: bool = True
    fix_rng_separator: bool = False
    latent_max_count: int = 0
    bridge: str = ""  # the NNX module of a Linen spec's bridge.ToLinen call: where (its path, call and phase)

    @property
    def failing(self) -> int:
        return sum(1 for c in self.collisions if c.failing)

    @property
    def info(self) -> int:
        return sum(1 for c in self.collisions if not c.failing)


def _site(i: int, k: NnxKey, count: int, key) -> NnxSite:
    return NnxSite(
        i,
        k.step,
        k.site,
        k.requested,
        k.tag,
        k.stream,
        count,
        k.chain,
        tuple(int(w) for w in key),
        k.loc,
        k.stale,
        k.lane,
        k.iteration,
        k.broadcast,
        k.scan,
        k.linen_lane,
        bool(k.linen),
        k.given,
        k.linen_input,
    )


def _when(s: NnxSite) -> str:
    return "construction" if s.step == 0 else f"step {s.step}"


_COPIED = "count reset to 0)"  # (the chain of a stream Rngs.split/broadcast copied: see engine/nnx.py stacked)


def _built_alike(chain: tuple[str, ...]) -> bool:
    """Whether a stacked member's stream comes from a key every member got: rngs.broadcast, or a stream
    rngs.split passed through."""
    return any(_COPIED in c or c.startswith("broadcast ") for c in chain)


_LANE = re.compile(r" \[lane \d+\]")


def _unlaned(chain: tuple[str, ...]) -> tuple[str, ...]:
    """A chain without its lane numbers: what the members of one stack have alike."""
    return tuple(_LANE.sub("", c) for c in chain)


def _at(s: NnxSite) -> str:
    """When a draw was made, and at which count (a key given to a call has none)."""
    return _when(s) + ("" if s.given else f" count {s.count}")


def _cause(s: NnxSite, earlier: list[NnxSite], step_rngs: bool = False) -> str:
    """Why draw `s` repeats a key one of `earlier` drew: stale, reseed (the same stream went back),
    reseed_order (nnx.reseed gave it another stream's key), or shared (two streams hold one key). `step_rngs`:
    the spec's `call_rngs` is an Rngs made for each step (its streams `call_rngs.<stream>` at every step)."""
    if s.given and any(e.given for e in earlier):
        return "keyless"
    if (
        step_rngs
        and s.stream_path.startswith(f"{CALL_RNGS}.")
        and any(e.stream_path == s.stream_path and e.step != s.step for e in earlier)
    ):
        return "step_rngs"
    if s.lane >= 0 and not s.stale and _built_alike(s.chain):
        alike = _unlaned(s.chain)
        if any(e.lane >= 0 and e.lane != s.lane and e.step == s.step and _unlaned(e.chain) == alike for e in earlier):
            return "stack_broadcast"
    same = [e for e in earlier if e.stream_path == s.stream_path]
    if same:
        if s.stale or any(e.stale for e in same):
            return "stale"
        one_call = [e for e in same if e.linen and e.step == s.step and e.chain == s.chain]
        if s.linen and one_call:
            # one call of a bridge.ToNNX: Linen hashed two draws into the key that call gave the stream
            if any(
                e.linen_input == s.linen_input and e.linen_lane != s.linen_lane and e.site == s.site for e in one_call
            ):
                return "unsplit_lanes"  # one draw in several lanes of a Linen transform that does not split it
            if any(e.linen_input == s.linen_input for e in one_call):
                return "linen_concatenation"  # two Linen paths hash to the same bytes
            return "linen_hash_word"  # other bytes, the same 32-bit word
        if "vmap" in s.broadcast and any(
            "vmap" in e.broadcast and e.step == s.step and e.lane != s.lane and e.chain == s.chain for e in same
        ):
            return "broadcast_lanes"
        # a stream nnx.scan broadcasts goes back to its count after the scan: a later draw repeats its keys
        frozen = [e for e in same if e.chain == s.chain and "scan" in e.broadcast + s.broadcast]
        if frozen:
            both = "scan" in s.broadcast and any("scan" in e.broadcast and e.scan == s.scan for e in frozen)
            return "scan_broadcast" if both else "frozen"
        return "reseed"
    if any(_COPIED in c for c in s.chain) or any(_COPIED in c for e in earlier for c in e.chain):
        return "pass_through"
    reseeded = any("nnx.reseed" in c for c in s.chain) or any("nnx.reseed" in c for e in earlier for c in e.chain)
    return "reseed_order" if reseeded else "shared"


_BECAUSE = {
    "stale": "a jitted step whose returned state was dropped started from the same RNG counts",
    "step_rngs": "the nnx.Rngs made for that step's call holds the key an earlier step's held (the same key every "
    "step: nnx.Rngs(dropout=key)), and a new Rngs counts from 0 again",
    "reseed": "nnx.reseed set the stream back to a key it had, count 0",
    "reseed_order": "nnx.reseed gave it another stream's key: it visits streams in sorted attribute order, "
    "not in the order they were built",
    "shared": "the two streams hold the same key",
    "stack_broadcast": "the members were built from one key (rngs.broadcast, or a stream rngs.split passed "
    "through), so every member folds the same count into the same key",
    "pass_through": "rngs.split / rngs.broadcast copied a stream it does not split with its count reset to 0 "
    "(Rngs(**streams) copies only the key), so the copy hands out keys the stream already handed out",
    "keyless": "the caller gives the Dropout the same key (drop(x, rngs=key)) and a key is used as it is: no "
    "stream counts on",
    "broadcast_lanes": "nnx.vmap broadcast the stream (not split, or not mapped by StateAxes), so every lane "
    "folds the same count into the same key",
    "frozen": "the stream was broadcast into nnx.scan, which drops its count update, so every call of the scan "
    "draws the keys the call before drew",
    "scan_broadcast": "the stream is broadcast into nnx.scan, so every step of one scan draws the same key "
    "(the recurrent-dropout pattern: one mask per sequence)",
    "linen_concatenation": "Linen hashes the module path and count of the two draws inside the bridge.ToNNX's Linen "
    "module to the same bytes (names that concatenate alike, or a count that meets a name: Linen's classes 1-2)",
    "linen_hash_word": "Linen hashes the two draws inside the bridge.ToNNX's Linen module to other bytes with the "
    "same 32-bit word (Linen's class 3)",
    "unsplit_lanes": "a lifted transform (nn.vmap, nn.scan) of the bridge.ToNNX's Linen module does not split "
    "this stream, so its lanes get the same key",
}
_FIX = {
    "step_rngs": "fold the step into the key the step's Rngs is made from (nnx.Rngs(dropout=jax.random.fold_in(key, "
    "step))), or split a new key for every step",
    "stale": "keep the state a jitted step returns (nnx.update(model, state)), or call the model through nnx.jit, "
    "which updates it in place",
    "reseed": "reseeding with a seed used before repeats keys (intended when reproducing a call, as the guide's "
    "y3 == y1); otherwise fold the step into the seed",
    "reseed_order": "reseed with a seed not used at construction, or name the attributes so that sorted order is "
    "construction order",
    "shared": "give every stream its own seed (e.g. Rngs(params=0, dropout=1)), or fork one stream from another",
    "stack_broadcast": "build the members from rngs.split(N) (name the stream in split's mapping), not "
    "rngs.broadcast(N) or a pass-through copy",
    "pass_through": "split every stream the members draw from (rngs.split(N)), or give them a fork (rngs.fork()"
    ".split({...})) so that no copy restarts at count 0",
    "keyless": "give the call a new key each time (drop(x, rngs=self.rngs.<stream>()), or a key split per step "
    "outside the step), or build the Dropout with rngs=rngs so that it draws its own",
    "broadcast_lanes": "split the stream per lane: nnx.split_rngs(splits=N, only='<stream>') around the vmap, "
    "with nnx.StateAxes({'<stream>': 0, ...: None}) in in_axes",
    "frozen": "for one mask per sequence and a new one per call, draw one key per call outside the scan (key = "
    "rngs.<stream>()) and pass it to the Dropout in every step (drop(h, rngs=key)); for a mask per step, carry "
    "the stream (StateAxes {...: nnx.Carry})",
    "scan_broadcast": "intended for recurrent dropout; carry the stream (StateAxes {...: nnx.Carry}, or leave it out "
    "of nnx.RNN's broadcast_rngs) if each step should draw its own key",
    "linen_concatenation": "rename one of the Linen modules, or set flax_fix_rng_separator (a separator between the "
    "hashed names; it changes every Linen key)",
    "linen_hash_word": "rename one of the Linen modules (a 32-bit word collision is chance: any change of name moves "
    "it)",
    "unsplit_lanes": "intended when the lanes should share it (one mask for the ensemble); otherwise split it in "
    "the Linen transform (split_rngs={'<stream>': True})",
}
# the category of a group: its most serious cause
_CATEGORY = (
    ("shared", "shared_stream_key"),
    ("linen_concatenation", "concatenation"),
    ("linen_hash_word", "hash_word"),
    ("stale", "count_rewind"),
    ("step_rngs", "count_rewind"),
    ("pass_through", "count_rewind"),
    ("keyless", "keyless_dropout"),
    ("stack_broadcast", "broadcast_lanes"),
    ("broadcast_lanes", "broadcast_lanes"),
    ("frozen", "frozen_scan_broadcast"),
    ("reseed_order", "reseed_order"),
    ("reseed", "reseed_repeat"),
    ("scan_broadcast", "scan_broadcast"),
    ("unsplit_lanes", "unsplit_lanes"),
)


def _classify(sites: list[NnxSite], step_rngs: bool = False) -> tuple[str, str, str]:
    first = sites[0]
    causes = [_cause(s, sites[:j], step_rngs) for j, s in enumerate(sites) if j]
    pairs = list(zip(sites[1:], causes))
    # the first draw of each cause, most serious first, then the rest in order (up to 4 are told)
    rank = {cause: r for r, (cause, _) in enumerate(_CATEGORY)}
    firsts = {cause: j for j, cause in reversed(list(enumerate(causes)))}
    shown = sorted(firsts.values(), key=lambda j: rank[causes[j]])
    shown += [j for j in range(len(pairs)) if j not in firsts.values()]
    parts = []
    for s, cause in (pairs[j] for j in sorted(shown[:4])):
        parts.append(f"{s.stream_path} ({s.where}) at {_at(s)}, because {_BECAUSE[cause]}")
    more = f"; and {len(causes) - 4} more" if len(causes) > 4 else ""
    if "shared" in causes and len({s.stream_path for s in sites}) > 1:
        chains = sorted({" -> ".join(s.chain) for s in sites})
        head = f"{' and '.join(sorted({s.stream_path for s in sites}))} hold the same key ({'; '.join(chains)}): "
    else:
        head = ""
    why = (
        f"{head}{first.stream_path} ({first.where}) {'was given' if first.given else 'drew'} this key at "
        f"{_at(first)}; " + "; ".join(parts) + more
    )
    category = next(c for cause, c in _CATEGORY if cause in causes)
    fix = "; ".join(_FIX[c] for c in dict.fromkeys(cause for cause, _ in _CATEGORY if cause in causes))
    fix = fix.replace("<stream>", first.stream)
    own = sorted({s.stream_path.removesuffix(".rngs") for s in sites if s.chain[:1] == (RNN_OWN_KEY,)})
    if "shared" in causes and own:
        fix = (
            f"build {' and '.join(own)} with rngs=rngs and a `carry` stream in the Rngs (nnx.RNN(cell, rngs=rngs) "
            "keeps rngs.carry.fork(); `rngs: fork` in the spec, `carry: <seed>` in rngs): every nnx.RNN built "
            "without rngs keeps its own RngStream(0), the same key; " + fix
        )
    return category, why, fix


def audit_nnx(spec: NnxSpec) -> NnxAudit:
    import numpy as np

    engine = KeyEngine(spec.prng_impl, spec.threefry_partitionable)
    table = replay_nnx(spec, engine)
    n = len(table.block)
    found: list[tuple[int, NnxCollision]] = []
    if n > 1:
        keys = np.ascontiguousarray(table.keys)
        flat = keys.view(np.dtype((np.void, keys.dtype.itemsize * keys.shape[1]))).ravel()
        order = np.argsort(flat, kind="stable")
        unused = np.fromiter((k.unused for k in table.blocks), dtype=bool, count=len(table.blocks))
        if unused.any():
            # keys handed out and never used (an nnx.RNN's zeros carry) share nothing: left out
            order = order[~unused[table.block[order]]]
        same = flat[order][1:] == flat[order][:-1]
        if same.any():
            starts = np.flatnonzero(np.concatenate(([True], ~same)))
            ends = np.append(starts[1:], len(order))
            for a, b in zip(starts.tolist(), ends.tolist()):
                if b - a < 2:
                    continue
                rows = sorted(order[a:b].tolist())
                sites = [_site(i, table.blocks[int(table.block[i])], int(table.count[i]), keys[i]) for i in rows]
                category, why, fix = _classify(sites, spec.call_rngs_steps is not None)
                c = NnxCollision(category, category in NNX_FAILING, why, fix, tuple(sites), sites[0].key)
                found.append((rows[0], c))
    # a stream the Rngs lacks, served by `default`: once per statement
    seen: dict = {}
    for b, k in enumerate(table.blocks):
        if k.fallback and (k.loc, k.requested) not in seen:
            seen[(k.loc, k.requested)] = b
    sizes = np.asarray([k.n for k in table.blocks], dtype=np.int64)
    starts_of = np.cumsum(sizes) - sizes
    for (loc, requested), b in seen.items():
        k = table.blocks[b]
        i = int(starts_of[b])
        site = _site(i, k, k.count, table.keys[i])
        found.append(
            (
                i,
                NnxCollision(
                    "default_fallback",
                    False,
                    f"the Rngs has no {requested!r} stream, so `default` serves it and its counter is shared with "
                    "every other stream `default` serves",
                    f"add `{requested}:` to rngs (nnx.Rngs({requested}=...)), or draw from `default` on purpose",
                    (site,),
                    None,
                ),
            )
        )
    found.sort(key=lambda t: t[0])
    return NnxAudit(spec.file, n, spec.prng_impl, rules_of(spec), tuple(c for _, c in found))


def audit_to_linen(spec) -> list[NnxAudit]:
    """The audits of the NNX modules a Linen spec's bridge.ToLinen modules build, one per call (in order): the
    NNX findings inside each, and `bridge_constant_default` where an apply lacks a stream the module's call draws
    (ToLinen's `default` stream, the constant key(0), serves it: the same key at every apply)."""
    from ..engine.derive import derive

    report = derive(spec, values=False)
    out = []
    for run in report.to_linen:
        if run.site.discarded:
            continue  # (keys of a trace Flax throws away: nothing draws with them)
        a = audit_nnx(run.report.spec)
        found = list(a.collisions)
        if run.constant_default:
            # (`default` serving a stream is the bridge's finding here, not a choice of the NNX module's Rngs)
            found = [c for c in found if c.category != "default_fallback"]
            constant = _constant_default(run)
            if constant is not None:
                found.insert(0, constant)
        where = run.where
        out.append(
            NnxAudit(
                a.source,
                a.call_sites,
                a.prng_impl,
                a.rules,
                tuple(found),
                bridge=f"{where}: NNX module {run.report.spec.model.cls}",
            )
        )
    return out


def _constant_default(run) -> NnxCollision | None:
    """The draws of a ToLinen's NNX call served by the `default` stream ToLinen adds at apply (key(0)): the same
    keys at every apply."""
    report = run.report
    table = report.calls.table
    root = "key " + report.spec.rngs["default"].text
    sites = [
        _site(i, table.blocks[int(table.block[i])], int(table.count[i]), table.keys[i])
        for i in range(len(table.block))
        if table.blocks[int(table.block[i])].step > 0 and table.blocks[int(table.block[i])].chain[:1] == (root,)
    ]
    if not sites:
        return None
    missing = sorted({s.requested for s in sites} - {"default"})
    have = ", ".join(s for s, row in run.streams if row is not None) or "none"
    named = " and ".join(repr(s) for s in missing) or "'default'"
    draws = ", ".join(dict.fromkeys(s.site for s in sites))
    why = (
        f"bridge.ToLinen at /{run.site.path_str} is applied without a {named} rng (apply's rngs: {have}), so the "
        f"NNX module it builds at every apply draws {draws} from the `default` stream ToLinen adds, seeded with "
        "the constant 0 (flax/nnx/bridge/wrappers.py linen_rngs_dict): the same key, so the same mask, at every "
        "apply and every step"
    )
    given = ", ".join(f"{s!r}: key" for s in missing) or "'default': key"
    fix = f"pass the stream at apply, a new key each step: model.apply(variables, x, rngs={{{given}}})"
    return NnxCollision("bridge_constant_default", True, why, fix, tuple(sites), None)
