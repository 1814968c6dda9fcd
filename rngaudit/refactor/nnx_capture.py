"""`capture` of a Flax NNX model: build it from an `nnx.Rngs` and call it, record every key its streams hand out
(construction and each step), read off what each module's `__init__` built and drew and what its `__call__`
did, write that as an NNX spec, and hand the spec out only if `derive` replays every key bit-exactly.

What is observed (all restored when the capture ends):
- `RngStream.__call__`: every key, its tag and count, and the module being built or called;
- the construction of every `nnx.Module` (the Pytree metaclass's construct step): its class, the Rngs it was
  given, what it drew and built, in order;
- `Rngs.fork`: a forked Rngs handed to a submodule (`rngs: fork`);
- the `__call__` of every module class built: which attributes each call calls and what it draws.

What an NNX spec cannot say yet (lanes inside the model call, a layer given another Rngs, a module that
behaves differently from call to call) is refused with an error that names it."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import RngauditError, UnsupportedError, UserCodeError
from ..spec.nnx import LAYER_OPTIONS
from ..usercode import CodeRef, first_line, load
from .keys_file import Capture, Site
from .target import InputSpec

MAX_STEPS = 10_000


@dataclass
class Built:
    """A module's construction: its object, the Rngs it was given, and what its __init__ did, in order."""

    cls: type
    rngs: object | None
    events: list = field(default_factory=list)  # ("draw", tag) | ("fork", rngs) | ("child", Built)
    obj: object | None = None


@dataclass
class Called:
    obj: object
    events: list = field(default_factory=list)  # ("call", obj) | ("draw", tag)
    drew: bool = False


class NnxRecorder:
    def __init__(self):
        self.building: list[Built] = []
        self.calling: list[Called] = []
        self.roots: list[Built] = []
        self.forks = 0  # inside Rngs.fork
        self.step = 0
        self.records: list[dict] = []
        self.traced = False
        self.calls: dict[int, list] = {}  # id(module) -> what its first call did
        self.differs: str | None = None
        self.classes: set[type] = set()

    def draw(self, stream, count, key) -> None:
        import jax
        import numpy as np

        tag = stream.tag
        self.records.append(
            {
                "step": self.step,
                "tag": tag,
                "count": int(count),
                "key": tuple(int(w) for w in np.asarray(jax.random.key_data(key)).ravel()),
            }
        )
        if self.forks:
            return
        if self.calling:
            frame = self.calling[-1]
            frame.drew = True
            frame.events.append(("draw", tag))
            for f in self.calling:
                f.drew = True
        elif self.building:
            self.building[-1].events.append(("draw", tag))


@contextlib.contextmanager
def observing() -> Iterator[NnxRecorder]:
    """Every NNX hook installed for the duration (and removed, whatever happens)."""
    import jax
    from flax import nnx
    from flax.nnx import pytreelib

    rec = NnxRecorder()
    meta = pytreelib.PytreeMeta
    construct = meta._pytree_meta_construct
    stream_call = nnx.RngStream.__call__
    fork = nnx.Rngs.fork
    patched: dict[type, object] = {}

    def construct_hook(cls, self, *args, **kwargs):
        if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
            return construct(cls, self, *args, **kwargs)
        given = next((a for a in (*args, *kwargs.values()) if isinstance(a, nnx.Rngs)), None)
        built = Built(cls, given)
        parent = rec.building[-1] if rec.building else None
        rec.building.append(built)
        try:
            construct(cls, self, *args, **kwargs)
        finally:
            rec.building.pop()
        built.obj = self
        if parent is not None:
            parent.events.append(("child", built))
        else:
            rec.roots.append(built)
        for klass in cls.__mro__:
            if "__call__" in vars(klass) and klass not in patched and klass is not nnx.Module:
                patched[klass] = vars(klass)["__call__"]
                _patch(klass, "__call__", _call_hook(rec, vars(klass)["__call__"]))
        return None

    def stream_hook(stream):
        count = stream.count[...]
        key = stream_call(stream)
        if isinstance(count, jax.core.Tracer) or isinstance(jax.random.key_data(key), jax.core.Tracer):
            rec.traced = True
            return key
        rec.draw(stream, count, key)
        return key

    def fork_hook(self, *args, **kwargs):
        rec.forks += 1
        try:
            out = fork(self, *args, **kwargs)
        finally:
            rec.forks -= 1
        if rec.building and not rec.calling:
            rec.building[-1].events.append(("fork", out, self))
        return out

    _patch(meta, "_pytree_meta_construct", construct_hook)
    _patch(nnx.RngStream, "__call__", stream_hook)
    _patch(nnx.Rngs, "fork", fork_hook)
    try:
        yield rec
    finally:
        _patch(meta, "_pytree_meta_construct", construct)
        _patch(nnx.RngStream, "__call__", stream_call)
        _patch(nnx.Rngs, "fork", fork)
        for klass, original in patched.items():
            _patch(klass, "__call__", original)


def _patch(owner: object, name: str, value: object) -> None:
    setattr(owner, name, value)


def _call_hook(rec: NnxRecorder, original):
    def __call__(self, *args, **kwargs):
        if rec.calling and rec.calling[-1].obj is self:  # super().__call__ of the same module
            return original(self, *args, **kwargs)
        frame = Called(self)
        if rec.calling:
            rec.calling[-1].events.append(("call", frame))
        rec.calling.append(frame)
        try:
            return original(self, *args, **kwargs)
        finally:
            rec.calling.pop()
            if not rec.calling:
                _remember(rec, frame)

    return __call__


def _remember(rec: NnxRecorder, frame: Called) -> None:
    """Keep what each module's call did (the first time), and note a module that does something else later."""

    def flat(f: Called) -> list:
        out = []
        for kind, what in f.events:
            if kind == "draw":
                out.append(("draw", what))
            elif what.drew or not _is_layer(what.obj):
                out.append(("call", id(what.obj)))
        return out

    def walk(f: Called) -> None:
        seen = rec.calls.setdefault(id(f.obj), flat(f))
        if seen != flat(f) and rec.differs is None:
            rec.differs = type(f.obj).__name__
        for kind, what in f.events:
            if kind == "call":
                walk(what)

    walk(frame)


def _is_layer(obj) -> bool:
    return type(obj).__module__.startswith("flax.nnx") and type(obj).__name__ in LAYER_OPTIONS


# ---------------------------------------------------------------- the spec
def _layer_options(obj) -> dict:
    kind = type(obj).__name__
    out: dict = {}
    for opt, default in LAYER_OPTIONS[kind].items():
        value: object
        if opt == "keep_rngs":
            value = getattr(obj, "rngs", None) is not None or not getattr(obj, "dropout_rate", 0)
        elif opt == "rng_collection":
            value = getattr(obj, "rng_collection", "dropout")
        else:
            value = getattr(obj, opt, default)
        if opt in ("rate", "dropout_rate"):
            value = float(value)  # type: ignore[arg-type]
        elif isinstance(default, bool):
            value = bool(value)
        if value != default or default is None:
            out[opt] = value
    return out


def _containers() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from flax import nnx

    return tuple(t for t in (getattr(nnx, "List", None),) if t), tuple(t for t in (getattr(nnx, "Dict", None),) if t)


def _attribute_names(obj) -> dict[int, str]:
    """id(value) -> attribute path of every module and Rngs an object holds (lists and dicts inside too)."""
    names: dict[int, str] = {}
    lists, dicts = _containers()
    lists, dicts = (list, tuple, *lists), (dict, *dicts)

    def visit(value: Any, path: str, depth: int) -> None:
        if id(value) not in names and not isinstance(value, (str, bytes, int, float, bool)) and value is not None:
            names.setdefault(id(value), path)
        if depth > 3:
            return
        held: Any = value
        if isinstance(value, lists):
            for i, v in enumerate(held):
                visit(v, f"{path}.{i}", depth + 1)
        elif isinstance(value, dicts):
            for k, v in held.items():
                visit(v, f"{path}.{k}", depth + 1)

    for name, value in vars(obj).items():
        if not name.startswith("_"):
            visit(value, name, 0)
    return names


class _SpecBuilder:
    def __init__(self, rec: NnxRecorder, target: str):
        self.rec = rec
        self.target = target

    def unsupported(self, what: str) -> UnsupportedError:
        return UnsupportedError(
            f"capture of {self.target}: {what}; an NNX spec cannot say this yet, so no spec was written"
        )

    def module(self, b: Built) -> dict:
        obj = b.obj
        cls = type(obj).__name__
        names = _attribute_names(obj)
        out: dict = {"class": cls}
        kept = [n for n, v in vars(obj).items() if b.rngs is not None and v is b.rngs]
        if kept:
            out["keep_rngs"] = True
        init: list = []
        built: dict[int, str] = {}
        forks: list = []
        for kind, what, *rest in b.events:
            if kind == "draw":
                init.append({"draw": what})
            elif kind == "fork":
                if rest[0] is not b.rngs:
                    raise self.unsupported(f"{cls}.__init__ forks an Rngs it was not given")
                forks.append(what)
            else:
                child: Built = what
                if isinstance(child.obj, _containers()[0] + _containers()[1]) and not child.events:
                    continue  # nnx.List / nnx.Dict holding modules built here: they are named through it
                name = names.get(id(child.obj))
                if name is None:
                    raise self.unsupported(
                        f"{cls}.__init__ builds a {type(child.obj).__name__} it does not keep as an attribute "
                        "(or keeps it inside another module)"
                    )
                built[id(child.obj)] = name
                if _is_layer(child.obj):
                    if child.rngs is None:
                        if any(child.events):
                            raise self.unsupported(f"{cls}.{name} draws without an Rngs")
                        if self.rec.calls.get(id(child.obj)):
                            raise self.unsupported(f"{cls}.{name} draws at call time from an Rngs passed to the call")
                        continue  # built without rngs and never drawing: nothing to say
                    if child.rngs is not b.rngs:
                        raise self.unsupported(
                            f"{cls}.{name} ({type(child.obj).__name__}) is given another Rngs than {cls}'s"
                        )
                    init.append({type(child.obj).__name__: {"name": name, **_layer_options(child.obj)}})
                    continue
                mode = "shared"
                if child.rngs is not b.rngs:
                    if child.rngs is None or not any(f is child.rngs for f in forks):
                        raise self.unsupported(
                            f"{cls}.{name} ({type(child.obj).__name__}) is given an Rngs that is neither "
                            f"{cls}'s nor its rngs.fork()"
                        )
                    mode = "fork"
                    forks = [f for f in forks if f is not child.rngs]
                sub = self.module(child)
                init.append({"module": {"name": name, **({"rngs": "fork"} if mode == "fork" else {}), **sub}})
        if forks:
            raise self.unsupported(f"{cls}.__init__ forks its Rngs without giving the fork to a submodule")
        if init:
            out["init"] = _runs(init)
        call = []
        for kind, what in self.rec.calls.get(id(obj), []):
            if kind == "draw":
                if not kept:
                    raise self.unsupported(f"{cls}.__call__ draws from an Rngs it does not keep")
                call.append({"draw": what})
            else:
                name = built.get(what)
                if name is None:
                    raise self.unsupported(f"{cls}.__call__ calls a module that {cls}.__init__ did not build")
                call.append({"call": name})
        if call:
            out["call"] = _runs(call)
        return out


def _runs(statements: list) -> list:
    """Consecutive equal statements as one with `repeat`."""
    out: list = []
    for s in statements:
        if out and _base(out[-1]) == s and ("draw" in s or "call" in s):
            last = out[-1]
            ((k, v),) = last.items()
            n = v.get("repeat", 1) if isinstance(v, dict) else 1
            name = "stream" if k == "draw" else "name"
            base = v[name] if isinstance(v, dict) else v
            out[-1] = {k: {name: base, "repeat": n + 1}}
        else:
            out.append(s)
    return out


def _base(s: dict) -> dict:
    ((k, v),) = s.items()
    if isinstance(v, dict) and "repeat" in v:
        return {k: v["stream" if k == "draw" else "name"]}
    return s


# ---------------------------------------------------------------- running the target
def _factory(target: CodeRef):
    from flax import nnx

    obj = load(target, "TARGET")
    if isinstance(obj, type) and issubclass(obj, nnx.Module):
        return obj
    if callable(obj):
        return obj
    raise UserCodeError(
        f"TARGET {target.text}: {target.attr} is a {type(obj).__name__}, not an nnx.Module class or a function "
        "that builds one from an nnx.Rngs"
    )


def is_nnx_target(target: CodeRef) -> bool:
    """Whether TARGET names an NNX model: an nnx.Module class, or a function with a parameter (it takes the
    nnx.Rngs)."""
    try:
        from flax import nnx
    except ImportError:
        return False
    obj = load(target, "TARGET")
    if isinstance(obj, type):
        return issubclass(obj, nnx.Module)
    if not callable(obj):
        return False
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    ) or any(p.name == "rngs" for p in params)


def run_nnx_capture(target: CodeRef, inputs: list[InputSpec], seeds: dict[str, int], steps: int) -> tuple[Capture, str]:
    """Capture TARGET (an NNX model) built from nnx.Rngs(**seeds) and called `steps` times; returns the capture
    and the NNX spec's YAML text, checked: derive replays every key."""
    import flax
    import jax
    import jax.numpy as jnp
    import yaml
    from flax import nnx

    from ..engine.keys import jax_setting

    if not 0 <= steps <= MAX_STEPS:
        raise UserCodeError(f"--steps {steps}: give 0 to {MAX_STEPS} calls")
    factory = _factory(target)
    settings = {
        "fix_rng_separator": False,
        "prng_impl": str(jax_setting("jax_default_prng_impl")),
        "threefry_partitionable": bool(jax_setting("jax_threefry_partitionable")),
    }
    with observing() as rec:
        try:
            rngs = nnx.Rngs(**seeds)
            made = factory(rngs=rngs) if _takes_rngs_keyword(factory) else factory(rngs)
        except RngauditError:
            raise
        except Exception as e:  # noqa: BLE001 (the model's own error)
            raise UserCodeError(
                f"TARGET {target.text}: building the model raises {type(e).__name__}: {first_line(e)}"
            ) from None
        model, args, kwargs = _unpack(made, target)
        if inputs:
            args = tuple(jnp.ones(i.shape, i.dtype) for i in inputs if i.name is None)
            kwargs = {i.name: jnp.ones(i.shape, i.dtype) for i in inputs if i.name is not None}
        root = next((b for b in rec.roots if b.obj is model), None)
        if root is None:
            raise UnsupportedError(
                f"capture of {target.text}: the model was not built by the factory's call (capture needs to see "
                "its construction: build it inside the factory, from the nnx.Rngs it is given)"
            )
        if root.rngs is not rngs:
            raise UnsupportedError(
                f"capture of {target.text}: the model is built from another Rngs than the one the factory is given; "
                "build it from that one (Model(rngs=rngs)), so --rngs seeds it"
            )
        for step in range(1, steps + 1):
            rec.step = step
            try:
                model(*args, **kwargs)
                jax.effects_barrier()
            except RngauditError:
                raise
            except Exception as e:  # noqa: BLE001
                raise UserCodeError(
                    f"TARGET {target.text}: calling the model (step {step}) raises {type(e).__name__}: {first_line(e)}"
                ) from None
    if rec.traced:
        raise UnsupportedError(
            f"capture of {target.text}: the model draws keys inside a transform (nnx.jit, nnx.vmap, nnx.scan, ...) "
            "in its construction or call; capture reads NNX models that draw eagerly for now (write the spec by "
            "hand: README, Flax NNX specs, shows stacks, vmap and scan)"
        )
    if rec.differs is not None:
        raise UnsupportedError(
            f"capture of {target.text}: {rec.differs}.__call__ draws differently from one call to the next (a "
            "call-time `deterministic` or `rngs` argument?); an NNX spec has one call per module"
        )
    doc = {
        "rngaudit": 1,
        "flavour": "nnx",
        "jax": {"prng_impl": settings["prng_impl"], "threefry_partitionable": settings["threefry_partitionable"]},
        "rngs": dict(seeds),
        "steps": steps,
        "model": _SpecBuilder(rec, target.text).module(root),
    }
    header = f"# captured from {target.text} by rngaudit (flax {flax.__version__}, jax {jax.__version__})\n"
    spec_text = header + yaml.safe_dump(doc, sort_keys=False)
    sites = check_replay(spec_text, rec.records, target.text)
    versions = {"flax": flax.__version__, "jax": jax.__version__}
    cap = Capture(target.text, "call", dict(seeds), settings, sites, {}, versions, flavour="nnx")
    return cap, spec_text


def _takes_rngs_keyword(factory) -> bool:
    try:
        return "rngs" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _unpack(made, target: CodeRef):
    from flax import nnx

    args: tuple = ()
    kwargs: dict = {}
    if isinstance(made, tuple) and made and isinstance(made[0], nnx.Module) and len(made) in (2, 3):
        model, args = made[0], made[1]
        kwargs = made[2] if len(made) == 3 else {}
        if not isinstance(args, (tuple, list)):
            args = (args,)
        if not isinstance(kwargs, dict):
            raise UserCodeError(
                f"TARGET {target.text}: the third value the factory returns must be a dict of keyword arguments"
            )
    else:
        model = made
    if not isinstance(model, nnx.Module):
        raise UserCodeError(
            f"TARGET {target.text}: {target.attr}(rngs) returned a {type(model).__name__}, not an nnx.Module "
            "(return the model, or (model, args))"
        )
    return model, tuple(args), dict(kwargs)


def check_replay(spec_text: str, records: list[dict], target: str) -> list[Site]:
    """derive of the spec against what NNX handed out, key by key in order; the sites (from the replay, which
    names each key's site) if every one agrees, else an error and nothing written."""
    from ..engine.nnx import derive_nnx
    from ..errors import InternalError
    from ..spec.parse import parse_spec

    try:
        spec = parse_spec(spec_text, "<captured spec>")
        report = derive_nnx(spec, values=False)  # type: ignore[arg-type]
    except RngauditError as e:
        raise InternalError(
            f"capture of {target}: the generated NNX spec does not replay ({e}); please report this model"
        ) from None
    calls = list(report.calls)
    sites = nnx_sites(report)
    for i, (c, r) in enumerate(zip(calls, records)):
        d = c.derivation
        if (d.step, d.tag, d.count, tuple(c.key)) != (r["step"], r["tag"], r["count"], r["key"]):
            raise UnsupportedError(
                f"capture of {target}: the NNX spec does not reproduce key {i} ({'construction' if r['step'] == 0 else 'step ' + str(r['step'])}, "
                f"stream {r['tag']!r} count {r['count']}): NNX handed out {list(r['key'])}, the replay gives "
                f"{list(c.key)} at {d.site}; the model does something capture cannot express yet, so no spec was written"
            )
    if len(calls) != len(records):
        raise UnsupportedError(
            f"capture of {target}: NNX handed out {len(records)} keys and the captured spec replays {len(calls)}; "
            "no spec was written"
        )
    return sites


def nnx_sites(report) -> list[Site]:
    """An NNX derive report's keys as call sites (path: the site's parts; step, stream path and chain kept)."""
    return [
        Site(
            tuple(c.derivation.site.split(".")),
            c.derivation.requested,
            c.derivation.tag,
            c.derivation.count,
            (c.derivation.lane,) if c.derivation.lane >= 0 else (),
            tuple(c.key),
            c.derivation.kind,
            c.derivation.label,
            (),
            None,
            c.derivation.step,
            c.derivation.stream,
            c.derivation.chain,
        )
        for c in report.calls
    ]
