"""`capture`: run a user's Flax module under the hooks, record every key Flax hands out, and write a spec that
derive replays bit-exactly (checked before it is handed out)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..engine.keys import jax_setting
from ..errors import FlaxUnavailableError, InternalError, RngauditError, UnsupportedError, UsageError, UserCodeError
from ..usercode import CodeRef, forget_neighbours, one_module_per_file, quiet_stdout
from .keys_file import Capture, Site, spec_sites
from .specgen import build_spec
from .target import (
    FactoryError,
    InputSpec,
    NnxModelError,
    build_module,
    parse_input,
    parse_rngs,
    parse_step,
    parse_target,
)


@dataclass(frozen=True)
class CaptureReport:
    """What `capture` observed (every key Flax handed out) and the spec that replays it (YAML text)."""

    capture: Capture
    spec: str


def run_capture(
    target_text: str,
    inputs: Sequence[str] = (),
    rngs: str | dict[str, int] | None = None,
    phase: str = "init",
    method: str | None = None,
    steps: int | None = None,
    step: str | None = None,
) -> tuple[Capture, str]:
    """Capture the keys of TARGET's init (or apply) and a spec that replays them. Returns the capture and
    the spec's YAML text, verified: derive on the spec reproduces every captured key. An NNX TARGET is built
    and called `steps` times (default 1). What the model prints goes to stderr."""
    with quiet_stdout():
        return _run_capture(target_text, inputs, rngs, phase, method, steps, step)


def _run_capture(target_text, inputs, rngs, phase, method, steps, step=None) -> tuple[Capture, str]:
    target = parse_target(target_text)
    refs = [target] if step is None else [target, parse_step(step)]
    with session(*refs):
        return _captured(target, target_text, inputs, rngs, phase, method, steps, step)


_SESSIONS = [0]


@contextlib.contextmanager
def session(*refs: CodeRef) -> Iterator[None]:
    """Capture's hooks (Linen's and NNX's) installed before the user's code is imported, and the user's own
    modules imported afresh under them (usercode.forget_neighbours): a transform the model's files apply at import
    (`nn.scan(nn.remat(Block), ...)` in layers.py, `@nnx.remat def __call__`, a module-level `@nnx.vmap` function)
    is then one capture follows. Nested sessions share the outermost one."""
    flax_hooks = _load_hooks()  # (Flax importable and new enough: the same errors for both flavours)
    if _SESSIONS[0]:
        _SESSIONS[0] += 1
        try:
            yield
        finally:
            _SESSIONS[0] -= 1
        return
    forget_neighbours(*refs)
    _SESSIONS[0] = 1
    try:
        with flax_hooks.installed(), _whole_tracebacks(), _nnx_observation(), one_module_per_file():
            yield
    finally:
        _SESSIONS[0] = 0


def _nnx_observation():
    try:
        import flax.nnx  # noqa: F401

        from .nnx_capture import observing
    except ImportError:
        return contextlib.nullcontext()
    return observing()


def _captured(target, target_text, inputs, rngs, phase, method, steps, step) -> tuple[Capture, str]:
    from .nnx_capture import is_nnx_target, run_nnx_capture

    def nnx(seeds: dict | None) -> tuple[Capture, str]:
        with _whole_tracebacks():
            return run_nnx_capture(
                target,
                [parse_input(t) for t in inputs],
                seeds,
                1 if steps is None else steps,
                None if step is None else parse_step(step),
            )

    if is_nnx_target(target):
        if phase != "init" or method is not None:
            raise UsageError(
                f"TARGET {target_text} is an NNX model: --phase and --method are Linen's (an NNX capture builds "
                "the model and calls it --steps times)"
            )
        return nnx(dict(rngs) if isinstance(rngs, dict) else parse_rngs(rngs))
    try:
        if steps is not None or step is not None:
            option = "--steps" if steps is not None else "--step"
            try:
                build_module(target, [parse_input(t) for t in inputs])
            except (NnxModelError, FactoryError):
                raise  # (an NNX model seeded by its factory; a factory that fails says why, not the option)
            except RngauditError:
                pass  # (any other failure: the option is the error)
            raise UsageError(f"{option} applies to NNX models (TARGET builds an nnx.Module from an nnx.Rngs)")
        cap, rec, root_cls = observe(target_text, inputs, rngs, phase, method)
    except NnxModelError:
        # a factory without parameters that builds an NNX model and seeds it itself (Model(rngs=nnx.Rngs(0))):
        # captured with the seeds it gives
        if phase != "init" or method is not None or rngs:
            option = "--rngs" if rngs else "--phase" if phase != "init" else "--method"
            raise UsageError(
                f"{option}: TARGET {target_text} builds an NNX model and seeds it itself (nnx.Rngs(...) in the "
                "factory); --phase and --method are Linen's, and --rngs seeds a factory that takes the Rngs (def "
                "make_model(rngs): return Model(rngs=rngs))"
            ) from None
        return nnx(None)
    return cap, _checked_spec(rec, root_cls, cap)


def _checked_spec(rec, root_cls: str, cap: Capture) -> str:
    """The spec, with Flax's standard layers as layer statements that keep their hyper-parameters
    (`{Dense: {features: 4}}`), checked by replaying it. A layer whose statement would not reproduce Flax (a
    subclass, an initialiser that draws otherwise) is written as a module instead, and the spec checked again;
    without a layer statement it must reproduce Flax, or capture refuses."""
    excluded: set = set()
    for _ in range(_LAYER_RETRIES):
        text = build_spec(
            rec, root_cls, cap.phase, cap.rngs, cap.settings, cap.target, True, frozenset(excluded), cap.method
        )
        try:
            difference = first_difference(text, cap)
        except InternalError:
            break  # the spec with layer statements does not replay at all: write every module as a module
        if difference is None:
            return text
        path = difference[1]
        wider = {path[:i] for i in range(1, len(path) + 1)} | {p for p in rec.modules if p[: len(path)] == path}
        if wider <= excluded:
            break
        excluded |= wider
    text = build_spec(rec, root_cls, cap.phase, cap.rngs, cap.settings, cap.target, method=cap.method)
    verify_spec_text(text, cap)
    return text


_LAYER_RETRIES = 8  # specs written again with more modules in module form before writing none as layers


def observe(
    target_text: str, inputs=(), rngs: str | dict | None = None, phase: str = "init", method: str | None = None
):
    """Run TARGET's init (or apply) in real Flax under observation: (capture, recorder, root class)."""
    target = parse_target(target_text)
    parsed_inputs = [parse_input(t) for t in inputs]
    seeds = dict(rngs) if isinstance(rngs, dict) else parse_rngs(rngs)
    if phase not in ("init", "apply"):
        raise UsageError(f"--phase {phase!r}: use init or apply")
    # installed before the user's code runs: a class transform made at import time keeps the lifting function
    with session(target):
        return _observe(target, parsed_inputs, seeds, phase, method)


@contextlib.contextmanager
def _whole_tracebacks() -> Iterator[None]:
    """JAX's traceback filtering off while the model runs: it drops JAX's and Flax's frames, so an error Flax
    raises would look raised by the hook that called Flax (see _raised_by_rngaudit)."""
    import jax

    before = getattr(jax.config, "jax_traceback_filtering")  # noqa: B009 - the typed Config does not declare it
    jax.config.update("jax_traceback_filtering", "off")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", before)


SUPPORTED_FLAX = "0.10.2"  # the oldest Flax whose functions the hooks find (flax.core.lift.fold_rngs came in it)


def _load_hooks():
    """The Flax hooks, or one error line: Flax missing, installed but failing to import (e.g. an older Flax
    on a newer JAX), or a release without the functions the hooks replace."""
    try:
        import flax
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "flax":
            raise FlaxUnavailableError(
                "this command runs real Flax, which is not installed: pip install 'rngaudit[flax]'"
            ) from None
        raise FlaxUnavailableError(_broken_flax(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever an installed Flax raises on import is reported in one line
        raise FlaxUnavailableError(_broken_flax(e)) from None
    version = getattr(flax, "__version__", "?")
    try:
        from . import flax_hooks
    except (ImportError, AttributeError) as e:
        raise FlaxUnavailableError(_old_flax(version, f"{type(e).__name__}: {e}")) from None
    missing = flax_hooks.missing()
    if missing:
        raise FlaxUnavailableError(_old_flax(version, "it has no " + ", ".join(missing)))
    return flax_hooks


def _broken_flax(e: BaseException) -> str:
    import importlib.metadata

    try:
        version = importlib.metadata.version("flax")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (
        f"Flax {version} is installed but fails to import ({type(e).__name__}: {message}); an older Flax on a "
        f"newer JAX often does: install a Flax release made for your JAX, e.g. pip install -U 'rngaudit[flax]'"
    )


def _old_flax(version: str, why: str) -> str:
    return (
        f"capture supports Flax {SUPPORTED_FLAX} and later; Flax {version} is installed ({why}): "
        f"pip install 'flax>={SUPPORTED_FLAX}'"
    )


def _observe(target: CodeRef, parsed_inputs: list[InputSpec], seeds: dict, phase: str, method: str | None):
    import jax

    module, args, kwargs = build_module(target, parsed_inputs)
    if method is not None and not callable(getattr(type(module), method, None)):
        raise UserCodeError(f"TARGET {target.text}: {type(module).__name__} has no method {method!r}")
    keys = {s: jax.random.key(seed) for s, seed in seeds.items()}
    cap, rec = observe_module(
        module, args, {**kwargs, **({"method": method} if method else {})}, keys, phase, target.text
    )
    for info in rec.modules.values():
        if info.cls == "ToLinen" and info.origin.startswith("flax.nnx.bridge"):
            # (capture records Linen's keys: the NNX module ToLinen builds at every call would be missing)
            raise UnsupportedError(
                f"capture of {target.text}: /{'/'.join(info.path)} is a bridge.ToLinen (an NNX module inside "
                "Linen), whose NNX keys capture does not record yet; write it as a `ToLinen:` statement in the "
                "spec (README: NNX inside Linen) and check it with `rngaudit derive`"
            )
    return dataclasses.replace(cap, rngs=seeds), rec, type(module).__name__


def observe_module(module, args: tuple, kwargs: dict, keys: dict, phase: str, target: str, variables=None):
    """A Linen module's init (or apply) from `keys` (stream -> JAX key) under the hooks (installed by the
    caller): (capture, recorder). apply runs on `variables`, or on what init makes from `keys` plus params."""
    import flax
    import jax

    from . import flax_hooks

    settings = {
        "fix_rng_separator": bool(flax.config.flax_fix_rng_separator),
        "prng_impl": str(jax_setting("jax_default_prng_impl")),
        "threefry_partitionable": bool(jax_setting("jax_threefry_partitionable")),
        # the releases it ran: a captured spec names them, so its rules are that Flax's
        "flax_version": flax.__version__,
        "jax_version": jax.__version__,
    }

    def run(selection):
        with flax_hooks.recording(selection) as rec:
            rec.recording = True
            if phase == "init":
                module.init(keys, *args, **kwargs)
            else:
                # every collection but params is mutable, as a training step applies a model (mutable=
                # ['batch_stats']): BatchNorm in train mode updates its statistics (no key is drawn for them)
                mutable = [c for c in variables if c != "params"] or False
                rec.mutable = mutable  # (the spec says it: map_variables(init=True) runs twice where one is mutable)
                module.apply(variables, *args, rngs=keys, mutable=mutable, **kwargs)
            jax.effects_barrier()
            rec.recording = False
        return rec

    try:
        if phase == "apply" and variables is None:
            # under the hooks too (recording nothing): Flax keeps the lifted function a method decorator (nn.jit)
            # makes at its first call, and apply must run the hooked one to be observed
            with flax_hooks.recording({}) as pre:
                pre.recording = False
                variables = module.init({"params": jax.random.key(0), **keys}, *args, **kwargs)
                jax.effects_barrier()
        rec = run({})
        records = _every_branch(rec, run, target)
    except RngauditError:
        raise
    except Exception as e:  # the model itself fails (the user's problem) or a hook does (ours)
        msg = str(e).split("\n")[0].split(" (https://flax.readthedocs.io")[0]
        if _raised_by_rngaudit(e) and not _fails_unobserved(module, phase, args, kwargs, keys, variables, type(e)):
            raise InternalError(
                f"capture of {target}: rngaudit failed while recording {type(module).__name__}.{phase} "
                f"({type(e).__name__}: {msg}); the model is not at fault (please report this model)"
            ) from e
        raise UserCodeError(
            f"TARGET {target}: {type(module).__name__}.{phase} raises {type(e).__name__}: {msg}"
        ) from None
    sites = [_site(r) for r in records]
    modules = {p: _module_record(m) for p, m in rec.modules.items()}
    rngs = {s: [int(w) for w in jax.random.key_data(k).ravel()] for s, k in keys.items()}
    cap = Capture(target, phase, rngs, settings, sites, modules, {"flax": flax.__version__, "jax": jax.__version__})
    method = kwargs.get("method")
    cap.method = method if isinstance(method, str) and method != "__call__" else None
    return cap, rec


def _module_record(m) -> dict:
    """A module as a keys file records it; a flax.linen module's plain options too, so that diff pairs it with
    a spec's layer statement."""
    out = {"class": m.cls, "naming": m.naming, "fields": m.fields}
    if m.origin.startswith("flax.linen."):
        out["layer_options"] = dict(m.options)
    return out


def _fails_unobserved(module, phase, args, kwargs, keys, variables, kind: type) -> bool:
    """Whether the model raises `kind` unobserved too (the hooks pass straight through to Flax with no recording
    open): then the error is the model's, though the innermost frame is a hook's (a TypeError for a missing
    argument is raised where the hook calls the user's method)."""
    try:
        if phase == "init" or variables is None:
            module.init(keys if phase == "init" else {"params": _key0(), **keys}, *args, **kwargs)
        else:
            mutable = [c for c in variables if c != "params"] or False
            module.apply(variables, *args, rngs=keys, mutable=mutable, **kwargs)
    except Exception as again:  # noqa: BLE001
        return isinstance(again, kind)
    return False


def _key0():
    import jax

    return jax.random.key(0)


def _raised_by_rngaudit(e: BaseException) -> bool:
    """Whether the exception comes from rngaudit's own code (its innermost frame is in the package), not from
    the model or from Flax: a capture hook failed."""
    import os

    import rngaudit

    home = os.path.dirname(os.path.abspath(rngaudit.__file__)) + os.sep
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(home)


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
                raise UnsupportedError(
                    f"capture of {target}: {'/'.join(ident[0]) or '(root)'} stream {ident[1]} count "
                    f"{ident[2]} got two different keys in runs with different nn.cond/switch branches"
                )

    merge(rec.records())
    traced, ran = rec.branches_traced_and_run()
    todo = traced - ran
    runs = 1
    while todo:
        runs += 1
        if runs > MAX_BRANCH_RUNS:
            raise UnsupportedError(
                f"capture of {target}: more than {MAX_BRANCH_RUNS} runs would be needed to see every "
                "nn.cond/switch branch run; write that part of the spec by hand"
            )
        selection = _selection(todo)
        again = run(selection)
        if again.signature() != rec.signature():
            raise UnsupportedError(
                f"capture of {target}: the model traces differently when another nn.cond/switch "
                "branch runs (Python code after the branch depends on its result), so one spec cannot "
                "describe it; no spec was written"
            )
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
    return Site(
        tuple(r["path"]),
        r["requested"],
        r["stream"],
        r["count"],
        tuple(r["lane"]),
        tuple(r["key"]),
        kind,
        ev.var_name,
        context,
    )


def verify_spec_text(spec_text: str, cap: Capture) -> None:
    """Refuse to hand out a spec whose replay differs from what Flax did."""
    difference = first_difference(spec_text, cap)
    if difference is not None:
        raise InternalError(difference[0])


def first_difference(spec_text: str, cap: Capture) -> tuple[str, tuple] | None:
    """(the message, the module path) of the first key the spec's replay does not reproduce; None when it
    reproduces every key Flax handed out and no other."""
    from ..spec.limits import current_limits, limits
    from ..spec.parse import linen_only, parse_spec

    # rngaudit's own text (plain YAML, no aliases): loaded whatever its size, so a large model is checked too
    size = len(spec_text.encode())
    now = current_limits()
    try:
        with limits(max(now.max_bytes, size + 1), max(now.max_nodes, size)):
            spec = linen_only(parse_spec(spec_text, "<captured spec>"), "capture")
        sites = spec_sites(spec)
    except RngauditError as e:
        raise InternalError(
            f"capture of {cap.target}: the generated spec does not replay ({e}); this is a gap in "
            "capture, please report it with the model"
        ) from None
    ours = {s.ident: s for s in sites}
    theirs = {s.ident: s for s in cap.sites}
    for ident, s in theirs.items():
        o = ours.get(ident)
        if o is None or o.key != s.key:
            what = "has no such call site" if o is None else f"gives key {list(o.key or ())}"
            return (
                (
                    f"capture of {cap.target}: the generated spec does not reproduce Flax at "
                    f"{_describe(s)}: Flax handed out {list(s.key or ())}, the replay {what}; no spec was "
                    "written (please report this model)"
                ),
                tuple(s.path),
            )
    for ident, o in ours.items():
        if ident not in theirs:
            return (
                (
                    f"capture of {cap.target}: the generated spec replays a key Flax never handed out "
                    f"at {_describe(o)}; no spec was written (please report this model)"
                ),
                tuple(o.path),
            )
    return None


def _describe(s: Site) -> str:
    lane = f" lane {list(s.lane)}" if s.lane else ""
    return f"{s.path_str} stream {s.stream} count {s.count}{lane}"
