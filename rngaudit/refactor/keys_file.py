"""The keys a run hands out, as call sites (`Site`, `Capture`), from a capture, a keys file (format
`rngaudit.capture` version 1) or a spec's derivation."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import __version__
from ..errors import InputError, Location, RngauditError, UnsupportedError

if TYPE_CHECKING:
    from ..spec.json_source import JsonDoc

CAPTURE_FORMAT = "rngaudit.capture"
CAPTURE_FORMAT_VERSION = 1


def _fork_depth(chain: tuple[str, ...]) -> tuple[int, ...]:
    """How many nnx.fork_rngs/nnx.split_rngs a key's chain went through, where any: (n,), else ()."""
    n = sum(1 for link in chain if "(nnx.fork_rngs for " in link or "(nnx.split_rngs for " in link)
    return (n,) if n else ()


@dataclass
class Site:
    """One key a call site received: where (path, stream, count, lane), what asked, and the key data."""

    path: tuple[str, ...]
    requested: str
    stream: str
    count: int
    lane: tuple[int, ...]
    key: tuple[int, ...] | None
    kind: str = "make_rng"
    label: str | None = None
    context: tuple[str, ...] = ()  # the transforms around it, outermost first, e.g. ("scan", "jit")
    location: Location | None = None  # a spec's row: the Location of the statement that draws the key
    step: int = -1  # NNX: 0 construction, n the n-th call (-1: Linen)
    stream_path: str = ""  # NNX: the RngStream that drew it (rngs.params, drop.rngs)
    chain: tuple[str, ...] = ()  # NNX: how that stream's key was made
    iteration: int = -1  # NNX: the nnx.scan step it was drawn in

    @property
    def ident(self) -> tuple:
        if self.step >= 0:
            # (a module built from rngs.fork() that draws itself: the fork's key and its own first draw are at the
            # same path, stream and count; nnx.fork_rngs of the model and then of a module in it fork one stream at
            # one count twice, the second time the first fork: told apart by how many forks its key went through)
            fork = ("fork", *_fork_depth(self.chain)) if self.kind == "fork" else ()
            return (self.path, self.stream, self.count, self.lane, self.step, self.iteration, *fork)
        return (self.path, self.stream, self.count, self.lane)

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"

    def as_json(self) -> dict:
        return {
            "path": list(self.path),
            "path_str": self.path_str,
            "stream_requested": self.requested,
            "stream": self.stream,
            "count": self.count,
            "lane": list(self.lane),
            "key": list(self.key) if self.key is not None else None,
            "kind": self.kind,
            "label": self.label,
            "context": list(self.context),
        } | (
            {
                "step": self.step,
                "iteration": None if self.iteration < 0 else self.iteration,
                "stream_path": self.stream_path,
                "chain": list(self.chain),
            }
            if self.step >= 0
            else {}
        )


@dataclass
class Capture:
    """What a capture observed: the settings, the sites and the modules (path, class, how it was named)."""

    target: str
    phase: str
    rngs: dict  # stream -> seed
    settings: dict  # fix_rng_separator, prng_impl, threefry_partitionable
    sites: list[Site]
    modules: dict = field(default_factory=dict)  # path tuple -> {"class", "naming", "fields"}
    versions: dict = field(default_factory=dict)
    source: JsonDoc | None = None  # a keys file's JsonDoc: where each record is, found on request
    flavour: str = "linen"
    # a spec's: its sites under other releases' rules, rederive(flax_version, jax_version, threefry_partitionable)
    # (None: the newest), or None if that model cannot be derived there; None for a keys file
    rederive: Callable[[str | None, str | None, bool], Capture | None] | None = None
    # a Linen spec's: its sites with explicit names given to the modules at some paths ({path: name}), a string
    # saying why that cannot be (the replay's error: a name in use), or None where a path is no module of the
    # spec's; None for a keys file (no model to re-derive)
    renamed: Callable[[dict], Capture | str | None] | None = None
    # what diff works out once per capture (each module's identity, the sites under each module path ...)
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    # a Linen spec's bridge.ToLinen calls: (its path text, its call number) -> the NNX keys of the module it built
    # (NNX sites; its make_rng keys are among `sites`)
    to_linen: dict = field(default_factory=dict)
    method: str | None = None  # the module method the model ran (capture --method), None for __call__
    # NNX: the steps (calls of the model) made in eval mode, as model.train()/eval() set it (the others in train
    # mode); None when the run sets no mode (its layers draw as built) or the keys file does not say
    eval_steps: tuple[int, ...] | None = None

    def locate(self) -> None:
        """Give each site of a keys file the line:col of its record (one pass over the file)."""
        if self.source is None or all(s.location is not None for s in self.sites):
            return
        where = self.source.locate([("calls", i) for i in range(len(self.sites))])
        for i, s in enumerate(self.sites):
            if s.location is None:
                s.location = where.get(("calls", i))


def _method(value) -> str | None:
    """A keys file's `method` (what capture --method ran; absent for __call__)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"`method` must be a method name, not {value!r}")
    return value


def spec_sites(spec, report=None) -> list[Site]:
    """derive's keys that exist at run time, as sites (of `report`, the spec's derive report without values, when
    it is made already)."""
    from ..engine.derive import derive

    if report is None:
        report = derive(spec, values=False)
    eager = _eager_variables(spec.model)
    out = []
    for c in report.calls:
        d = c.derivation
        if d.discarded:
            continue
        # an eager variable's key is a make_rng passed as an argument, drawn before self.variable is entered:
        # Flax (and a keys file) sees a plain make_rng there, and diff must name it alike from either input
        plain = d.kind == "variable" and d.location in eager
        out.append(
            Site(
                tuple(d.path),
                d.stream_requested,
                d.stream,
                d.count,
                tuple(d.lane),
                tuple(c.key) if c.key is not None else None,
                "make_rng" if plain else d.kind,
                None if plain else d.label,
                _context(d),
                d.location,
            )
        )
    return out


def _eager_variables(model) -> set:
    """The locations of every `variable: {eager: true}` statement of a spec's model."""
    from ..spec.tree import Variable

    out: set = set()
    seen: set = set()
    todo = [model]
    while todo:
        x = todo.pop()
        if isinstance(x, (tuple, list)):
            todo.extend(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, (type, Location)) and id(x) not in seen:
            seen.add(id(x))
            if isinstance(x, Variable):
                if x.eager:
                    out.add(x.loc)
            else:
                todo.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return out


def _context(d) -> tuple[str, ...]:
    base = str(d.base)
    out = []
    if "key of #" in base or any("nn.jit" in n for n in d.notes):
        out.append("jit")
    if "split(" in base:
        out.append("split")
    return tuple(out)


def capture_to_json(cap: Capture, spec_file: str | None = None) -> dict:
    return {
        "format": CAPTURE_FORMAT,
        "format_version": CAPTURE_FORMAT_VERSION,
        "rngaudit_version": __version__,
        "target": cap.target,
        "flavour": cap.flavour,
        "phase": cap.phase,
        **({"method": cap.method} if cap.method is not None else {}),
        "spec": spec_file,
        "versions": dict(cap.versions),
        "flax": {"fix_rng_separator": cap.settings["fix_rng_separator"]},
        "jax": {
            "prng_impl": cap.settings["prng_impl"],
            "threefry_partitionable": cap.settings["threefry_partitionable"],
        },
        "rngs": {s: cap.rngs[s] for s in sorted(cap.rngs)},
        "modules": [
            {"path": list(p), "path_str": "/".join(p) if p else "(root)", **m} for p, m in cap.modules.items()
        ],  # creation order: diff pairs modules by it
        **({"eval_steps": list(cap.eval_steps)} if cap.eval_steps is not None else {}),
        "calls": [dict(s.as_json(), index=i) for i, s in enumerate(cap.sites)],
        "summary": {"calls": len(cap.sites), "modules": len(cap.modules)},
    }


def is_capture_json(doc) -> bool:
    return isinstance(doc, dict) and doc.get("format") == CAPTURE_FORMAT


def capture_from_json(doc: dict, file: str, source=None) -> Capture:
    """A keys file written by `capture --keys`; every field checked (a hand-edited file gets one error at the line
    of the field, where the file was read with its text: `source`)."""

    def bad(what: str, pointer: tuple = ()) -> InputError:
        where = source.locate([pointer]).get(pointer) if source is not None else None
        if where is None:
            return InputError(f"{file}: not a valid {CAPTURE_FORMAT} file: {what}")
        return InputError(f"not a valid {CAPTURE_FORMAT} file: {what}", where)

    if doc.get("format_version") != CAPTURE_FORMAT_VERSION:
        raise bad(
            f"capture format version {doc.get('format_version')!r} is not supported (this rngaudit reads version "
            f"{CAPTURE_FORMAT_VERSION})",
            ("format_version",) if "format_version" in doc else (),
        )
    flavour = doc.get("flavour", "linen")
    if flavour not in ("linen", "nnx"):
        raise bad(f"`flavour` is linen or nnx, not {flavour!r}", ("flavour",))
    _check_top(doc, flavour, bad)
    sites = []
    seen: dict = {}
    for i, c in enumerate(doc["calls"]):
        _check_call(c, flavour, lambda what, field=None, i=i: bad(f"calls[{i}]: {what}", _at(("calls", i), field)))
        sites.append(
            Site(
                tuple(c["path"]),
                c["stream_requested"],
                c["stream"],
                c["count"],
                tuple(c["lane"]),
                tuple(c["key"]) if c.get("key") is not None else None,
                c.get("kind", "make_rng"),
                c.get("label"),
                tuple(c.get("context", ())),
                None,
                c.get("step", -1),
                c.get("stream_path", ""),
                tuple(c.get("chain", ())),
                -1 if c.get("iteration") is None else c["iteration"],
            )
        )
        first = seen.setdefault(sites[-1].ident, i)
        if first != i:
            raise bad(
                f"calls[{i}] repeats the call site of calls[{first}] ({sites[-1].path_str}, stream "
                f"{sites[-1].stream!r}, count {sites[-1].count}); a keys file has each once",
                ("calls", i),
            )
    modules = {}
    for i, m in enumerate(doc.get("modules", ())):
        if not (isinstance(m, dict) and _names(m.get("path")) and isinstance(m.get("class"), str)):
            raise bad("`modules` items are {path: [names], class: NAME, ...}", ("modules", i))
        # (a spec's keys file records no naming or fields: the spec, not a live model, made its modules)
        modules[tuple(m["path"])] = {
            "class": m["class"],
            "naming": str(m.get("naming", "")),
            "fields": str(m.get("fields", "")),
        }
        if isinstance(m.get("layer_options"), dict):  # (keys files from rngaudit 0.x before it lack them)
            modules[tuple(m["path"])]["layer_options"] = m["layer_options"]
    versions = doc.get("versions", {})
    settings = {
        "fix_rng_separator": doc["flax"]["fix_rng_separator"],
        "prng_impl": doc["jax"]["prng_impl"],
        "threefry_partitionable": doc["jax"]["threefry_partitionable"],
        # the releases it ran (a file that does not say, or says no release number: unknown rules)
        "flax_version": _release(versions.get("flax")),
        "jax_version": _release(versions.get("jax")),
    }
    try:
        method = _method(doc.get("method"))
    except ValueError as e:
        raise bad(str(e), ("method",)) from None
    return Capture(
        str(doc.get("target", file)),
        doc.get("phase", "init"),
        dict(doc.get("rngs", {})),
        settings,
        sites,
        modules,
        versions,
        source,
        flavour,
        method=method,
        eval_steps=_eval_steps(doc.get("eval_steps"), bad),
    )


def _at(pointer: tuple, field) -> tuple:
    return pointer if field is None else (*pointer, field)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _names(v) -> bool:
    return isinstance(v, list) and all(isinstance(p, str) for p in v)


PHASES = ("init", "apply", "call")


def _check_top(doc: dict, flavour: str, bad) -> None:
    """The fields of a keys file beside its calls: their types and values."""
    from ..spec.parse import PRNG_IMPLS

    if not isinstance(doc.get("calls"), list):
        raise bad("`calls` is the list of the keys handed out", ("calls",) if "calls" in doc else ())
    for name, fields in (("flax", ("fix_rng_separator",)), ("jax", ("prng_impl", "threefry_partitionable"))):
        if not isinstance(doc.get(name), dict) or any(f not in doc[name] for f in fields):
            raise bad(f"`{name}` is a mapping with {' and '.join(fields)}", (name,) if name in doc else ())
    for top, flag in (("flax", "fix_rng_separator"), ("jax", "threefry_partitionable")):
        if not isinstance(doc[top][flag], bool):
            raise bad(f"`{top}.{flag}` is true or false, not {doc[top][flag]!r}", (top, flag))
    if doc["jax"]["prng_impl"] not in PRNG_IMPLS:
        raise bad(
            f"`jax.prng_impl` is one of {', '.join(PRNG_IMPLS)}, not {doc['jax']['prng_impl']!r}", ("jax", "prng_impl")
        )
    if doc.get("phase", "init") not in PHASES:
        raise bad(f"`phase` is one of {', '.join(PHASES)}, not {doc['phase']!r}", ("phase",))
    for name in ("rngs", "versions"):
        if name in doc and not isinstance(doc[name], dict):
            raise bad(f"`{name}` is a mapping, not {doc[name]!r}", (name,))
    if not isinstance(doc.get("modules", []), list):
        raise bad("`modules` is a list", ("modules",))
    if "target" in doc and not isinstance(doc["target"], str):
        raise bad(f"`target` is the captured TARGET's text, not {doc['target']!r}", ("target",))


def _eval_steps(value, bad) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(_integer(v) and v > 0 for v in value):
        raise bad(f"`eval_steps` must be a list of step numbers (1, 2, ...), not {value!r}", ("eval_steps",))
    return tuple(value)


def _check_call(c, flavour: str, bad) -> None:
    """The types and ranges a record's fields must have (a hand-edited keys file gets a clear error): bad(what,
    field) makes the error, at the field."""
    if not isinstance(c, dict):
        raise bad(f"a call record is a mapping, not {c!r}")
    for name in ("path", "stream", "stream_requested", "count", "lane"):
        if name not in c:
            raise bad(f"`{name}` is missing")
    if not _names(c["path"]):
        raise bad("`path` must be a list of names", "path")
    for name in ("stream", "stream_requested"):
        if not isinstance(c[name], str):  # (Linen's make_rng('') is a stream of an empty name)
            raise bad(f"`{name}` must be a stream name, not {c[name]!r}", name)
    if not _integer(c["count"]) or c["count"] < 0:
        raise bad(f"`count` must be a non-negative integer, not {c['count']!r}", "count")
    if not isinstance(c["lane"], list) or not all(_integer(x) and x >= 0 for x in c["lane"]):
        raise bad(f"`lane` must be a list of lane indices (0, 1, ...), not {c['lane']!r}", "lane")
    nnx = flavour == "nnx"
    if nnx and "step" not in c:
        raise bad("`step` is missing (an NNX record's step: 0 construction, n the n-th call)")
    if "step" in c and (not _integer(c["step"]) or c["step"] < (0 if nnx else -1)):
        low = "0 construction, n the n-th call" if nnx else "-1 for Linen"
        raise bad(f"`step` must be an integer ({low}), not {c['step']!r}", "step")
    key = c.get("key")
    if key is None and ("key" not in c or nnx):
        # (a Linen key that never exists, a discarded trace's, is null; every NNX key exists)
        raise bad("`key` is missing" if "key" not in c else "`key` is null (every NNX key handed out exists)", "key")
    if key is not None and (
        not isinstance(key, list) or len(key) not in (2, 4) or not all(_integer(w) and 0 <= w < 2**32 for w in key)
    ):
        raise bad(f"`key` must be 2 or 4 unsigned 32-bit words, not {key!r}", "key")
    for name in ("kind", "stream_path"):
        if name in c and not isinstance(c[name], str):
            raise bad(f"`{name}` must be text, not {c[name]!r}", name)
    if c.get("label") is not None and not isinstance(c["label"], str):
        raise bad(f"`label` must be text or null, not {c['label']!r}", "label")
    for name in ("context", "chain"):
        if name in c and not _names(c[name]):
            raise bad(f"`{name}` must be a list of text, not {c[name]!r}", name)
    it = c.get("iteration")
    if it is not None and (not _integer(it) or it < 0):
        raise bad(f"`iteration` must be a scan step (0, 1, ...) or null, not {it!r}", "iteration")


def load_source(path: str):
    """A capture keys file (a Capture), or a spec (Linen or NNX), read once."""
    from ..spec.json_source import load_json
    from ..spec.parse import load_spec

    if path.lower().endswith(".json"):
        doc = load_json(path)
        if is_capture_json(doc.value):
            cap = capture_from_json(doc.value, path, doc)
            cap.target = path  # reports name (and annotate) the file given
            if cap.flavour == "linen":
                recorded = doc.value.get("spec")
                cap.renamed = _renamed_by_spec(cap, path, recorded if isinstance(recorded, str) else "")
            return cap
    return load_spec(path)


def _renamed_by_spec(cap: Capture, keys_path: str, spec_file: str) -> Callable[[dict], Capture | str | None]:
    """A keys file's fixes, checked on the spec `capture` wrote with it: `renamed` of that spec, found as recorded
    (from the working directory), beside the keys file under the recorded path or by its name, or as the keys
    file's name with .yaml, and used only when it replays every key of the keys file (else, or where none is
    found: None, unchecked). The spec is read when the first fix is checked."""

    def renamed(names: dict) -> Capture | str | None:
        if "spec" not in cap.memo:  # (None: no spec replays it; diff says its fixes are not checked)
            cap.memo["spec"] = _replaying_spec(cap, keys_path, spec_file)
        spec = cap.memo["spec"]
        return None if spec is None or spec.renamed is None else spec.renamed(names)

    return renamed


def _replaying_spec(cap: Capture, keys_path: str, spec_file: str) -> Capture | None:
    from ..spec.parse import load_spec

    here = os.path.dirname(keys_path)
    want = {s.ident: s.key for s in cap.sites}
    beside = (os.path.join(here, spec_file), os.path.join(here, os.path.basename(spec_file)))
    same_stem = os.path.splitext(keys_path)[0] + ".yaml"  # (`capture --keys k.json > k.yaml` records no spec)
    for path in dict.fromkeys((spec_file, *beside, same_stem) if spec_file else (same_stem,)):
        if not os.path.isfile(path):
            continue
        try:
            spec = spec_capture(path, load_spec(path))
        except RngauditError:
            continue
        if {s.ident: s.key for s in spec.sites} == want:
            return spec
    return None


def load_sites(path: str) -> Capture:
    """A spec (derived) or a capture keys file, as sites."""
    source = load_source(path)
    return source if isinstance(source, Capture) else spec_capture(path, source)


def _release(v) -> str:
    from ..spec.releases import UNKNOWN, known

    return v.strip() if isinstance(v, str) and known(v) is not False else UNKNOWN


def spec_capture(name: str, spec) -> Capture:
    """A spec's derived keys as a Capture named `name`."""
    cap = _spec_capture(name, spec)

    def rederive(flax: str | None, jax: str | None, partitionable: bool) -> Capture | None:
        other = dataclasses.replace(spec, flax_version=flax, jax_version=jax, threefry_partitionable=partitionable)
        try:
            return _spec_capture(name, other)
        except RngauditError:
            return None  # (the model fails under those rules: no key of it is attributed to them)

    cap.rederive = rederive
    if getattr(spec, "flavour", "linen") == "linen":
        modules: dict = {}  # the module made at each path, and how many paths each definition makes

        def renamed(names: dict) -> Capture | str | None:
            from ..engine.replay import Replayer
            from ..spec.tree import renamed_modules

            if not modules:  # (one walk of the spec, made by the first fix checked)
                walk = Replayer(spec)
                walk.walk()
                modules["at"] = walk.modules
                # a statement with repeat: (or a definition called twice) makes several modules
                modules["paths"] = Counter(id(m) for m in walk.modules.values())
            at, paths = modules["at"], modules["paths"]
            if any(path not in at for path in names):
                return None
            if any(paths[id(at[path])] > 1 for path in names):
                return None  # (a name on it would name every instance alike: not the fix, which names one)
            ids = {id(at[path]): new_name for path, new_name in names.items()}
            try:
                return _spec_capture(name, dataclasses.replace(spec, model=renamed_modules(spec.model, ids)))
            except RngauditError as e:
                return e.message

        cap.renamed = renamed
    return cap


def _spec_capture(name: str, spec) -> Capture:
    if getattr(spec, "flavour", "linen") == "nnx":
        from ..engine.nnx import derive_nnx
        from .nnx_capture import nnx_sites

        settings = {
            "fix_rng_separator": False,
            "prng_impl": spec.prng_impl,
            "threefry_partitionable": spec.threefry_partitionable,
            "flax_version": spec.flax_version,
            "jax_version": spec.jax_version,
        }
        rngs = {s: src.text for s, src in spec.rngs.items()}
        sites = nnx_sites(derive_nnx(spec, values=False))
        seen: dict[tuple, Site] = {}
        for s in sites:
            if seen.setdefault(s.ident, s) is not s:
                # (diff and verify pair keys by their site: two at one site would hide each other)
                raise UnsupportedError(
                    f"{spec.file}: step {s.step} draws two keys at {s.path_str} (stream {s.stream!r}, count "
                    f"{s.count}{', a fork' if s.kind == 'fork' else ''}) that diff and verify cannot tell apart; "
                    "please report this spec"
                )
        return Capture(name, "call", rngs, settings, sites, {}, flavour="nnx", eval_steps=spec.eval_steps)
    settings = {
        "fix_rng_separator": spec.fix_rng_separator,
        "prng_impl": spec.prng_impl,
        "threefry_partitionable": spec.threefry_partitionable,
        "flax_version": spec.flax_version,  # the rules' release (None: the newest)
        "jax_version": spec.jax_version,
    }
    rngs = {s: src.text for s, src in spec.rngs.items()}
    from ..engine.derive import derive

    report = derive(spec, values=False)
    cap = Capture(name, spec.phase, rngs, settings, spec_sites(spec, report), _spec_modules(spec))
    cap.method = spec.method
    if report.to_linen:
        from .nnx_capture import nnx_sites

        for run in report.to_linen:
            cap.to_linen[("/" + run.site.path_str, run.site.call, run.lane)] = nnx_sites(run.report)
    return cap


def _spec_modules(spec) -> dict:
    """Each submodule path of a Linen spec -> its class, and a layer statement's options (diff pairs the layers
    of two versions by them, as it pairs a keys file's modules by their fields)."""
    from ..engine.replay import Replayer

    walk = Replayer(spec, blocks=True)
    walk.walk()
    out: dict = {}
    for path, mod in walk.modules.items():
        out[path] = {"class": mod.cls}
        if mod.layer is not None:
            out[path]["layer_options"] = {**dict(mod.layer_options), **dict(mod.layer_hyper)}
    return out
