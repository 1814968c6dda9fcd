"""`capture`: run a user's Flax module, record every key Flax hands out, and write a spec derive replays."""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field

from .. import __version__
from ..errors import RngauditError, SpecError, UserCodeError

CAPTURE_FORMAT = "rngaudit.capture"
CAPTURE_FORMAT_VERSION = 1

_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64", "i32": "int32",
           "i64": "int64", "u32": "uint32", "i8": "int8", "u8": "uint8", "bool": "bool",
           "float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int32": "int32"}
_IDENT = r"[A-Za-z_]\w*"


@dataclass(frozen=True)
class InputSpec:
    """One argument of init/apply: `f32[4,8]` (ones of that shape), positional or `name=`."""

    name: str | None
    dtype: str
    shape: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Target:
    text: str
    file: str | None
    module: str | None
    attr: str


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
    location: object = None  # a spec's row: the Location of the statement that draws the key

    @property
    def ident(self) -> tuple:
        return (self.path, self.stream, self.count, self.lane)

    @property
    def path_str(self) -> str:
        return "/".join(self.path) if self.path else "(root)"

    def as_json(self) -> dict:
        return {"path": list(self.path), "path_str": self.path_str, "stream_requested": self.requested,
                "stream": self.stream, "count": self.count, "lane": list(self.lane),
                "key": list(self.key) if self.key is not None else None, "kind": self.kind, "label": self.label,
                "context": list(self.context)}


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
    source: object = None  # a keys file's JsonDoc: where each record is, found on request

    def locate(self) -> None:
        """Give each site of a keys file the line:col of its record (one pass over the file)."""
        if self.source is None or all(s.location is not None for s in self.sites):
            return
        where = self.source.locate([("calls", i) for i in range(len(self.sites))])
        for i, s in enumerate(self.sites):
            if s.location is None:
                s.location = where.get(("calls", i))


# ---------------------------------------------------------------- parsing the command line
def parse_target(text: str) -> Target:
    """`path/to/file.py:make_model` or `package.module:make_model`."""
    where, colon, attr = text.rpartition(":")
    usage = "write FILE.py:FACTORY or package.module:FACTORY, e.g. model.py:make_model"
    if not colon or not where or not re.fullmatch(rf"{_IDENT}(\.{_IDENT})*", attr):
        raise SpecError(f"TARGET {text!r}: {usage}")
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not os.path.isfile(where):
            raise UserCodeError(f"TARGET {text}: no such file {where!r}")
        return Target(text, where, None, attr)
    if not re.fullmatch(rf"{_IDENT}(\.{_IDENT})*", where):
        raise SpecError(f"TARGET {text!r}: {where!r} is neither a .py file nor a module name; {usage}")
    return Target(text, None, where, attr)


def parse_input(text: str) -> InputSpec:
    """`f32[4,8]`, `x=f32[4,8]`, `i32[2]`, `f32[]`."""
    m = re.fullmatch(rf"\s*(?:({_IDENT})\s*=\s*)?(\w+)\[([\d,\s]*)\]\s*", text)
    if not m or m.group(2) not in _DTYPES:
        raise SpecError(f"--input {text!r}: write DTYPE[SHAPE], optionally NAME=DTYPE[SHAPE], e.g. f32[4,8] or "
                        f"x=i32[2,16] (dtypes: f32, f16, bf16, i32, i64, bool)")
    dims = tuple(int(d) for d in m.group(3).split(",") if d.strip())
    return InputSpec(m.group(1), _DTYPES[m.group(2)], dims, text)


def parse_rngs(text: str | None) -> dict[str, int]:
    """`params=0,dropout=1` -> {stream: seed}; default {params: 0}."""
    if text is None:
        return {"params": 0}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, seed = part.partition("=")
        name, seed = name.strip(), seed.strip()
        if not eq or not name or not re.fullmatch(r"-?\d+", seed):
            raise SpecError(f"--rngs {text!r}: write STREAM=SEED,..., e.g. params=0,dropout=1")
        if name in out:
            raise SpecError(f"--rngs {text!r}: stream {name!r} is given twice")
        out[name] = int(seed)
        if not -(2**63) <= out[name] < 2**63:
            raise SpecError(f"--rngs {text!r}: seeds are signed 64-bit integers")
    return out


# ---------------------------------------------------------------- loading the user's model
def _load_factory(target: Target):
    try:
        if target.file is not None:
            path = os.path.abspath(target.file)
            name = "_rngaudit_target_" + re.sub(r"\W", "_", path)
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise UserCodeError(f"TARGET {target.text}: cannot import {target.file!r}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            directory = os.path.dirname(path)
            sys.path.insert(0, directory)
            try:
                spec.loader.exec_module(mod)
            finally:
                if sys.path and sys.path[0] == directory:
                    sys.path.pop(0)
        else:
            mod = importlib.import_module(target.module)
    except RngauditError:
        raise
    except SyntaxError as e:
        raise UserCodeError(f"TARGET {target.text}: cannot import it: SyntaxError at {e.filename}:{e.lineno}: "
                            f"{e.msg}") from None
    except BaseException as e:  # noqa: BLE001 - whatever the user's import raises is reported, not leaked
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserCodeError(f"TARGET {target.text}: cannot import it: {type(e).__name__}: {e}") from None
    obj = mod
    for part in target.attr.split("."):
        if not hasattr(obj, part):
            found = sorted(n for n in dir(mod) if not n.startswith("_"))[:12]
            raise UserCodeError(f"TARGET {target.text}: {target.module or target.file} has no {target.attr!r} "
                                f"(it defines: {', '.join(found) or 'nothing'})")
        obj = getattr(obj, part)
    return obj


def _build(target: Target, inputs: list[InputSpec]):
    """The module and its example arguments: the factory may return a Module, or (module, args) or
    (module, args, kwargs); --input overrides the example arguments."""
    import flax.linen as nn
    import jax.numpy as jnp

    factory = _load_factory(target)
    if isinstance(factory, nn.Module):
        made = factory
    elif isinstance(factory, type) and issubclass(factory, nn.Module):
        try:
            made = factory()
        except Exception as e:  # noqa: BLE001
            raise UserCodeError(f"TARGET {target.text}: {factory.__name__}() without arguments raises "
                                f"{type(e).__name__}: {e}; point TARGET at a function that builds it") from None
    elif callable(factory):
        try:
            made = factory()
        except Exception as e:  # noqa: BLE001
            raise UserCodeError(f"TARGET {target.text}: calling {target.attr}() raises {type(e).__name__}: {e}") from None
    else:
        raise UserCodeError(f"TARGET {target.text}: {target.attr} is a {type(factory).__name__}, not a Flax "
                            "module or a function returning one")
    args, kwargs = (), {}
    if isinstance(made, tuple) and made and isinstance(made[0], nn.Module) and len(made) in (2, 3):
        module, args = made[0], made[1]
        kwargs = made[2] if len(made) == 3 else {}
        if not isinstance(args, (tuple, list)):
            args = (args,)
        if not isinstance(kwargs, dict):
            raise UserCodeError(f"TARGET {target.text}: the third value the factory returns must be a dict of "
                                "keyword arguments")
    else:
        module = made
    if not isinstance(module, nn.Module):
        raise UserCodeError(f"TARGET {target.text}: {target.attr}() returned a {type(module).__name__}, not a "
                            "flax.linen Module (return the module, or (module, args))")
    if inputs:
        args = tuple(jnp.ones(i.shape, i.dtype) for i in inputs if i.name is None)
        kwargs = {i.name: jnp.ones(i.shape, i.dtype) for i in inputs if i.name is not None}
    return module, tuple(args), dict(kwargs)


# ---------------------------------------------------------------- running it under observation
def run_capture(target_text: str, inputs: list[str] = (), rngs: str | None = None, phase: str = "init",
                method: str | None = None) -> tuple[Capture, str]:
    """Capture the keys of TARGET's init (or apply) and a spec that replays them. Returns the capture and
    the spec's YAML text, verified: derive on the spec reproduces every captured key."""
    from .specgen import build_spec

    cap, rec, root_cls = observe(target_text, inputs, rngs, phase, method)
    spec_text = build_spec(rec, root_cls, cap.phase, cap.rngs, cap.settings, cap.target)
    verify_spec_text(spec_text, cap)
    return cap, spec_text


def observe(target_text: str, inputs=(), rngs: str | dict | None = None, phase: str = "init",
            method: str | None = None):
    """Run TARGET's init (or apply) in real Flax under observation: (capture, recorder, root class)."""
    target = parse_target(target_text)
    parsed_inputs = [parse_input(t) for t in inputs]
    seeds = dict(rngs) if isinstance(rngs, dict) else parse_rngs(rngs)
    if phase not in ("init", "apply"):
        raise SpecError(f"--phase {phase!r}: use init or apply")
    try:
        import flax
    except ImportError:
        raise SpecError("this command runs real Flax, which is not installed: pip install 'rngaudit[flax]'") from None
    import jax

    from . import flax_hooks as flaxcapture

    # before the user's code runs: a class transform made at import time keeps the lifting function
    flaxcapture.install()
    module, args, kwargs = _build(target, parsed_inputs)
    if method is not None and not callable(getattr(type(module), method, None)):
        raise UserCodeError(f"TARGET {target.text}: {type(module).__name__} has no method {method!r}")
    settings = {"fix_rng_separator": bool(flax.config.flax_fix_rng_separator),
                "prng_impl": str(jax.config.jax_default_prng_impl),
                "threefry_partitionable": bool(jax.config.jax_threefry_partitionable)}
    keys = {s: jax.random.key(seed) for s, seed in seeds.items()}
    call_kw = {"method": method} if method else {}
    variables = None

    def run(selection):
        with flaxcapture.recording(selection) as rec:
            rec.recording = True
            if phase == "init":
                module.init(keys, *args, **kwargs, **call_kw)
            else:
                module.apply(variables, *args, rngs=keys, **kwargs, **call_kw)
            jax.effects_barrier()
            rec.recording = False
        return rec

    try:
        if phase == "apply":
            variables = module.init({"params": jax.random.key(0), **keys}, *args, **kwargs, **call_kw)
            jax.effects_barrier()
        rec = run({})
        records = _every_branch(rec, run, target.text)
    except RngauditError:
        raise
    except Exception as e:  # noqa: BLE001 - the model itself fails: the user's problem, reported in one line
        msg = str(e).split("\n")[0].split(" (https://flax.readthedocs.io")[0]
        raise UserCodeError(f"TARGET {target.text}: {type(module).__name__}.{phase} raises "
                            f"{type(e).__name__}: {msg}") from None
    sites = [_site(r) for r in records]
    modules = {p: {"class": m.cls, "naming": m.naming, "fields": m.fields} for p, m in rec.modules.items()}
    cap = Capture(target.text, phase, seeds, settings, sites, modules,
                  {"flax": flax.__version__, "jax": jax.__version__})
    return cap, rec, type(module).__name__


MAX_BRANCH_RUNS = 32  # nn.cond/switch: at most this many runs to see every branch run


def _selection(paths) -> dict:
    """One branch per nn.cond/switch call that runs as many of the branch `paths` as it can."""
    chosen: dict = {}
    for path in sorted(paths, key=len, reverse=True):
        if all(chosen.get(stmt, b) == b for stmt, b in path):
            chosen.update(path)
    return chosen


def _every_branch(rec, run, target: str) -> list[dict]:
    """The keys of every nn.cond/switch branch. Flax traces every branch (their counts are taken whichever
    runs) but runs one, so only its keys exist at run time: the model runs again with the other branches
    forced until every branch in which a key was traced has run, and the keys are merged. The traces, and
    so every count, do not depend on the choice; a model whose trace does depend on it is refused."""
    merged: dict = {}

    def merge(records):
        for r in records:
            ident = (tuple(r["path"]), r["stream"], r["count"], tuple(r["lane"]))
            seen = merged.setdefault(ident, r)
            if seen["key"] != r["key"]:
                raise SpecError(f"capture of {target}: {'/'.join(ident[0]) or '(root)'} stream {ident[1]} count "
                                f"{ident[2]} got two different keys in runs with different nn.cond/switch branches")

    merge(rec.records())
    traced, ran = rec.branches_traced_and_run()
    todo = traced - ran
    runs = 1
    while todo:
        runs += 1
        if runs > MAX_BRANCH_RUNS:
            raise SpecError(f"capture of {target}: more than {MAX_BRANCH_RUNS} runs would be needed to see every "
                            "nn.cond/switch branch run; write that part of the spec by hand")
        selection = _selection(todo)
        again = run(selection)
        if again.signature() != rec.signature():
            raise SpecError(f"capture of {target}: the model traces differently when another nn.cond/switch "
                            "branch runs (Python code after the branch depends on its result), so one spec cannot "
                            "describe it; no spec was written")
        merge(again.records())
        for loop, counts in again.loop_iterations.items():
            rec.loop_iterations.setdefault(loop, set()).update(counts)
        _, ran = again.branches_traced_and_run()
        # a branch path this selection ran, or had to run, is done (it may hold no key that runs)
        todo = {p for p in todo - ran if not all(selection.get(stmt) == b for stmt, b in p)}
    return sorted(merged.values(), key=lambda r: r["order"])


def _site(r: dict) -> Site:
    ev = r["event"]
    if ev.fork:
        kind = "jit_fork"
    elif ev.init_col == "params":
        kind = "param"
    elif ev.init_col is not None:
        kind = "variable"
    else:
        kind = "make_rng"
    context = tuple(f.context for f in ev.frames)
    return Site(tuple(r["path"]), r["requested"], r["stream"], r["count"], tuple(r["lane"]), tuple(r["key"]),
                kind, ev.var_name, context)


def verify_spec_text(spec_text: str, cap: Capture) -> None:
    """Refuse to hand out a spec whose replay differs from what Flax did."""
    from ..spec.parse import parse_spec

    try:
        spec = parse_spec(spec_text, "<captured spec>")
        sites = spec_sites(spec)
    except RngauditError as e:
        raise SpecError(f"capture of {cap.target}: the generated spec does not replay ({e}); this is a gap in "
                        "capture, please report it with the model") from None
    ours = {s.ident: s for s in sites}
    theirs = {s.ident: s for s in cap.sites}
    for ident, s in theirs.items():
        o = ours.get(ident)
        if o is None or o.key != s.key:
            what = "has no such call site" if o is None else f"gives key {list(o.key or ())}"
            raise SpecError(f"capture of {cap.target}: the generated spec does not reproduce Flax at "
                            f"{_describe(s)}: Flax handed out {list(s.key)}, the replay {what}; no spec was "
                            "written (please report this model)")
    for ident, o in ours.items():
        if ident not in theirs:
            raise SpecError(f"capture of {cap.target}: the generated spec replays a key Flax never handed out "
                            f"at {_describe(o)}; no spec was written (please report this model)")


def _describe(s: Site) -> str:
    lane = f" lane {list(s.lane)}" if s.lane else ""
    return f"{s.path_str} stream {s.stream} count {s.count}{lane}"


# ---------------------------------------------------------------- sites from a spec, and capture files
def spec_sites(spec) -> list[Site]:
    """derive's keys that exist at run time, as sites."""
    from ..engine.derive import derive

    report = derive(spec, values=False)
    out = []
    for c in report.calls:
        d = c.derivation
        if d.discarded:
            continue
        out.append(Site(tuple(d.path), d.stream_requested, d.stream, d.count, tuple(d.lane),
                        tuple(c.key) if c.key is not None else None, d.kind, d.label, _context(d), d.location))
    return out


def _context(d) -> tuple[str, ...]:
    base = str(d.base)
    out = []
    if "key of #" in base:
        out.append("jit")
    if "split(" in base:
        out.append("split")
    return tuple(out)


def capture_to_json(cap: Capture, spec_file: str | None = None) -> dict:
    return {
        "format": CAPTURE_FORMAT, "format_version": CAPTURE_FORMAT_VERSION, "rngaudit_version": __version__,
        "target": cap.target, "phase": cap.phase, "spec": spec_file,
        "versions": dict(cap.versions),
        "flax": {"fix_rng_separator": cap.settings["fix_rng_separator"]},
        "jax": {"prng_impl": cap.settings["prng_impl"],
                "threefry_partitionable": cap.settings["threefry_partitionable"]},
        "rngs": {s: cap.rngs[s] for s in sorted(cap.rngs)},
        "modules": [{"path": list(p), "path_str": "/".join(p) if p else "(root)", **m}
                    for p, m in cap.modules.items()],  # creation order: diff pairs modules by it
        "calls": [dict(s.as_json(), index=i) for i, s in enumerate(cap.sites)],
        "summary": {"calls": len(cap.sites), "modules": len(cap.modules)},
    }


def is_capture_json(doc) -> bool:
    return isinstance(doc, dict) and doc.get("format") == CAPTURE_FORMAT


def capture_from_json(doc: dict, file: str, source=None) -> Capture:
    """A keys file written by `capture --keys`; every field checked."""
    if doc.get("format_version") != CAPTURE_FORMAT_VERSION:
        raise SpecError(f"{file}: capture format version {doc.get('format_version')!r} is not supported "
                        f"(this rngaudit reads version {CAPTURE_FORMAT_VERSION})")
    try:
        sites = []
        for c in doc["calls"]:
            sites.append(Site(tuple(str(p) for p in c["path"]), str(c["stream_requested"]), str(c["stream"]),
                              int(c["count"]), tuple(int(i) for i in c["lane"]),
                              tuple(int(w) for w in c["key"]) if c.get("key") is not None else None,
                              str(c.get("kind", "make_rng")), c.get("label"), tuple(c.get("context", ()))))
        modules = {tuple(m["path"]): {"class": m["class"], "naming": m["naming"], "fields": m.get("fields", "")}
                   for m in doc.get("modules", ())}
        settings = {"fix_rng_separator": bool(doc["flax"]["fix_rng_separator"]),
                    "prng_impl": str(doc["jax"]["prng_impl"]),
                    "threefry_partitionable": bool(doc["jax"]["threefry_partitionable"])}
        return Capture(str(doc.get("target", file)), str(doc.get("phase", "init")), dict(doc.get("rngs", {})),
                       settings, sites, modules, dict(doc.get("versions", {})), source)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SpecError(f"{file}: not a valid {CAPTURE_FORMAT} file ({type(e).__name__}: {e}); write it with "
                        "`rngaudit capture TARGET --keys FILE`") from None


def load_sites(path: str) -> Capture:
    """A spec (derived) or a capture keys file, as sites."""
    from ..spec.json_source import load_json
    from ..spec.parse import load_spec

    if path.lower().endswith(".json"):
        doc = load_json(path)
        if is_capture_json(doc.value):
            cap = capture_from_json(doc.value, path, doc)
            cap.target = path  # reports name (and annotate) the file given
            return cap
    spec = load_spec(path)
    settings = {"fix_rng_separator": spec.fix_rng_separator, "prng_impl": spec.prng_impl,
                "threefry_partitionable": spec.threefry_partitionable}
    rngs = {s: src.text for s, src in spec.rngs.items()}
    return Capture(path, spec.phase, rngs, settings, spec_sites(spec), {})
