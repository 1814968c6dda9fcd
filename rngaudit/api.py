"""The Python API: every command as a function that returns its report, for use in a project's own tests.

    import rngaudit

    report = rngaudit.collisions("model.rngaudit.yaml")
    assert not report.failing, rngaudit.findings(report)

Inputs are a path (`str` or `pathlib.Path`) or an already-loaded Spec (`rngaudit.load_spec`,
`rngaudit.parse_spec`). Problems raise `rngaudit.RngauditError` subclasses with the message the command
prints; the commands themselves (rngaudit.cli) call these functions."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import FlaxError, InputError, Location, RngauditError, UnsupportedError, UsageError

if TYPE_CHECKING:
    from .collision.nnx import NnxAudit
    from .collision.results import Audit, CollisionsReport
    from .engine.derive import DeriveReport
    from .engine.nnx import NnxDeriveReport
    from .refactor.capture import CaptureReport
    from .refactor.compare import Comparison
    from .refactor.keys_file import Capture
    from .shard.report import ShardReport
    from .spec.nnx import NnxSpec
    from .spec.parse import SpecBytes
    from .spec.tree import Draw, Spec


def load(spec: str | os.PathLike[str] | Spec, phase: str | None = None, command: str = "this command") -> Spec:
    """A Linen spec from a path (or as it is), with its phase replaced by `phase` if given."""
    from .spec.parse import linen_only, load_spec
    from .spec.tree import PHASES, Spec

    s = spec if isinstance(spec, Spec) else linen_only(load_spec(os.fspath(spec)), command)
    if phase is not None:
        if phase not in PHASES:
            raise UsageError(f"phase {phase!r}: use init or apply")
        if phase != s.phase:
            s = dataclasses.replace(s, phase=phase, mutable=phase == "init")
    return s


def parse_draw(text: str) -> Draw:
    """`normal:2,2` (KIND:SHAPE, as --draw takes it) -> a Draw."""
    from .spec.draws import parse_draw as parse_draw_node
    from .spec.yaml_source import YNode

    loc = Location("--draw", 1, 1)
    kind, _, shape = text.partition(":")
    try:
        parts = [s.strip() for s in shape.split(",")] if shape.strip() else []
        if len(parts) > 1 and not parts[-1]:  # (`3,`: Python's one-tuple)
            parts.pop()
        if not all(p.isascii() and p for p in parts):  # (`2,,2`, `,`: a dimension missing)
            raise ValueError
        dims = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--draw {text!r}: the shape must be integers, e.g. normal:2,2", loc) from None
    node = YNode({kind: YNode([YNode(d, loc) for d in dims], loc)}, loc, {kind: loc})
    return parse_draw_node(node, "--draw")


def _draw(draw: str | Draw | None) -> tuple[Draw | None, str]:
    if draw is None or not isinstance(draw, str):
        return draw, draw.describe() if draw is not None else ""
    return parse_draw(draw), draw


def _check_draw_budget(spec: Spec, default_draw: Draw, text: str) -> None:
    """A draw for every key: refused up front when that is too many values."""
    import math

    from .spec.budget import MAX_DRAWN_VALUES, budget

    keys, drawn, _ = budget(spec.model)
    total = drawn + keys * math.prod(default_draw.shape)
    if total > MAX_DRAWN_VALUES:
        raise UsageError(
            f"--draw {text!r} draws up to {total} values over up to {keys} keys; rngaudit draws "
            f"at most {MAX_DRAWN_VALUES}: draw a smaller shape, or use --no-values",
            Location("--draw", 1, 1),
        )


# ---------------------------------------------------------------- derive
def derive(
    spec: str | os.PathLike[str] | Spec | NnxSpec | SpecBytes,
    *,
    phase: str | None = None,
    values: bool = True,
    draw: str | Draw | None = None,
    streams: Sequence[str] = (),
    paths: Sequence[str] = (),
    limit: int | None = None,
    engine: str = "fast",
    keyed: int | None = None,
) -> DeriveReport | NnxDeriveReport:
    """Every key the spec's model receives (`report.calls`), and the values of its draws. `draw` (e.g.
    "normal:2,2") is drawn from every key without a `draw:`; `streams`, `paths` (globs) and `limit` select
    call sites before any key is computed; `engine` "plain" is the reference path (no filters). `keyed`:
    hash, key and draw only the first `keyed` call sites now (an NNX spec: draw), every other one when the
    report first reads it (what a report listing its first rows needs). An NNX spec (`flavour: nnx`) gives
    an NnxDeriveReport: every key its streams hand out, construction and steps."""
    from .engine.derive import derive as run_derive
    from .spec.parse import SpecBytes, load_spec
    from .spec.tree import Spec

    if keyed is not None and keyed < 0:
        raise UsageError(f"keyed={keyed}: key at least 0 call sites up front (None: every one)")
    if isinstance(spec, SpecBytes):
        spec = spec.load()
    loaded = load_spec(os.fspath(spec)) if isinstance(spec, (str, os.PathLike)) else spec
    if not isinstance(loaded, Spec):  # (an NnxSpec: its machinery imported only for one)
        return _derive_nnx(loaded, phase, values, draw, streams, paths, limit, keyed)
    s = load(loaded, phase)
    default_draw, text = _draw(draw)
    if default_draw is not None and values:
        _check_draw_budget(s, default_draw, text)
    if engine not in ("fast", "plain"):
        raise UsageError(f"--engine {engine!r}: use fast or plain", Location("--engine", 1, 1))
    if engine == "plain" and (streams or paths or limit is not None):
        raise UsageError("--stream, --path and --limit need --engine fast", Location("--engine", 1, 1))
    return run_derive(
        s,
        values=values,
        default_draw=default_draw,
        engine=engine,
        streams=tuple(streams),
        paths=tuple(paths),
        limit=limit,
        keyed=keyed if engine == "fast" else None,
    )


def _derive_nnx(spec, phase, values, draw, streams, paths, limit, keyed) -> NnxDeriveReport:
    from .engine.nnx import derive_nnx

    if phase is not None:
        raise UsageError(
            f"--phase applies to Linen specs; {spec.file} is an NNX spec (flavour: nnx), which replays construction "
            "and its `steps` calls"
        )
    default_draw, _ = _draw(draw)
    return derive_nnx(
        spec,
        values=values,
        default_draw=default_draw,
        streams=tuple(streams),
        paths=tuple(paths),
        limit=limit,
        keyed=keyed,
    )


def _audit_nnx(spec: NnxSpec, phase: str | None) -> NnxAudit:
    from .collision.nnx import audit_nnx

    if phase is not None:
        raise UsageError(
            f"--phase applies to Linen specs; {spec.file} is an NNX spec (flavour: nnx), which replays construction "
            "and its `steps` calls"
        )
    return audit_nnx(spec)


# ---------------------------------------------------------------- collisions
def audit_input(
    source: str | os.PathLike[str] | Spec | NnxSpec | SpecBytes,
    *,
    phase: str | None = None,
    keys: bool = True,
    fix_rng_separator: bool | None = None,
    latent_max_count: int | None = None,
    bridges: list | None = None,
) -> Audit | NnxAudit:
    """The audit of one input: a spec (YAML, or JSON holding a spec), or a JSON file of module paths or of a
    params tree. An NNX spec gets an NnxAudit (`keys`, `fix_rng_separator` and `latent_max_count` are Linen's).
    `bridges`: a list the NnxAudits of a Linen spec's bridge.ToLinen calls are added to (one per call)."""
    from .collision.audit import audit
    from .collision.latent import DEFAULT_LATENT_MAX_COUNT
    from .collision.spec_sites import spec_sites
    from .spec.layers import has_to_linen
    from .spec.tree import Spec

    bound = DEFAULT_LATENT_MAX_COUNT if latent_max_count is None else latent_max_count
    from .spec.nnx import NnxSpec
    from .spec.parse import SpecBytes

    if isinstance(source, SpecBytes):
        source = source.load()
    if isinstance(source, NnxSpec):
        return _audit_nnx(source, phase)
    path = None if isinstance(source, Spec) else os.fspath(source)
    if path is not None and path.lower().endswith(".json"):  # module paths, a params tree, or a spec
        from .collision.module_paths import ModuleSites, is_spec
        from .spec.json_source import load_json

        doc = load_json(path)
        from .spec.parse import rngaudit_output

        what = rngaudit_output(doc.value.get("format") if isinstance(doc.value, dict) else None)
        if what is not None:
            # (read as a params tree it would be audited as module names, and found clean)
            raise InputError(
                f"{path}:1:1: this is {what}, not a model: collisions audits a spec, a list of module paths or a "
                "params tree; run it on the spec capture wrote (capture -o SPEC.yaml)",
            )
        if not is_spec(doc.value):
            return audit(ModuleSites(doc, bool(fix_rng_separator)), bound)
    if not isinstance(source, Spec):
        from .spec.parse import load_spec

        loaded = load_spec(os.fspath(source))
        if isinstance(loaded, NnxSpec):
            return _audit_nnx(loaded, phase)
        source = loaded
    s = load(source, phase, "collisions")
    if fix_rng_separator is not None:
        s = dataclasses.replace(s, fix_rng_separator=fix_rng_separator)
    found = audit(spec_sites(s, keys=keys), bound)
    if bridges is not None and keys and has_to_linen(s.model):  # (NNX keys are key data: not without `keys`)
        from .collision.nnx import audit_to_linen

        bridges.extend(audit_to_linen(s))
    return found


def collisions(
    *inputs: str | os.PathLike[str] | Spec | NnxSpec | SpecBytes,
    phase: str | None = None,
    keys: bool = True,
    fix_rng_separator: bool | None = None,
    latent_max_count: int | None = None,
    strict: bool = False,
    fail_on: Iterable[str] | None = None,
    advance: Callable[[int], None] | None = None,
    keep_going: bool = False,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    per_path_ignore: Iterable[str] = (),
    inline_ignores: bool = True,
    baseline: str | os.PathLike[str] | None = None,
    per_path_base: str | None = None,
) -> CollisionsReport:
    """Call sites that receive identical keys in each input, why, and the fixes checked. `report.failing`
    says whether a finding of a failing category was found (`fail_on`; `strict`: every category).
    `advance(1)` is called after each input. An input that cannot be read, is not a valid spec, or models
    something Flax raises on raises its error; with `keep_going` it is `report.errors` instead (in input
    order), and the other inputs are audited.

    Findings left out: rules not in `select` (all by default) or in `ignore`; findings at a call site whose spec
    line says `# rngaudit: ignore[RULE]` (`inline_ignores`); `per_path_ignore` entries `GLOB:RULE[,RULE]` (an
    input's path or a call site's module path); and those the `baseline` file lists (`report.suppressed` holds
    the last three, `report.baseline_unmatched` counts baseline entries no finding matched). `per_path_base`: the
    folder `per_path_ignore`'s input paths are also relative to (the pyproject.toml's, for its entries)."""
    from .collision import suppress
    from .collision.results import FINDING_CATEGORIES, CollisionsReport, fail_categories
    from .spec.parse import SpecBytes

    wanted = None if fail_on is None else list(fail_on)
    for c in wanted or ():
        if c not in FINDING_CATEGORIES:
            raise UsageError(f"fail_on {c!r}: use one of {', '.join(FINDING_CATEGORIES)}")
    try:
        policy = suppress.Policy(
            select=None if select is None else suppress.parse_rules(select, "select"),
            ignore=suppress.parse_rules(ignore, "ignore"),
            per_path=tuple(suppress.PathIgnore.parse(p, per_path_base) for p in per_path_ignore),
            inline=inline_ignores,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if baseline is not None:
        policy = dataclasses.replace(policy, baseline=suppress.load_baseline(os.fspath(baseline)))
    texts: dict[str, str] = {}
    warnings: list[str] = []
    audits = []
    errors: list[RngauditError] = []
    for source in inputs:
        if isinstance(source, SpecBytes) and inline_ignores:
            texts[source.name] = source.data.decode("utf-8", "replace")
        try:
            bridges: list = []
            audits.append(
                audit_input(
                    source,
                    phase=phase,
                    keys=keys,
                    fix_rng_separator=fix_rng_separator,
                    latent_max_count=latent_max_count,
                    bridges=bridges,
                )
            )
            audits.extend(bridges)
        except (InputError, FlaxError, UnsupportedError) as e:
            if not keep_going:
                raise
            errors.append(e)
        if advance is not None:
            advance(1)
    if inline_ignores:
        for a in audits:
            text = texts.get(a.source)
            if text is None and a.input_kind != "paths" and a.input_kind != "params_tree":
                text = texts[a.source] = _read_text(a.source) or ""
            warnings.extend(suppress.unknown_inline_rules(text or "", a.source))
    report = CollisionsReport(tuple(audits), fail_categories(strict, wanted), tuple(errors), warnings=tuple(warnings))
    return suppress.apply(report, policy, texts)


def finding_category(name: str) -> str | None:
    """The `collisions` finding category `name` stands for, by any name it is shown under (`hash_word`,
    `hash-word`, the rule id `collisions/hash-word`); None for no category."""
    from .collision.suppress import category_name

    return category_name(name)


def check_per_path_ignore(entry: str) -> None:
    """A ValueError saying what is wrong with a `per_path_ignore` entry (GLOB:RULE[,RULE])."""
    from .collision.suppress import PathIgnore

    PathIgnore.parse(entry)


def _read_text(file: str) -> str | None:
    try:
        with open(file, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


# ---------------------------------------------------------------- shard-check
def shard_check(
    specs: Sequence[str | os.PathLike[str] | Spec] = (),
    *,
    fns: Sequence[str] = (),
    devices: int | None = None,
    platform: str | None = None,
    mesh: str | None = None,
    paths: Sequence[str] = (),
    streams: Sequence[str] = (),
    phase: str | None = None,
    draw: str | Draw | None = None,
    shape: str | None = None,
    input: str | None = None,
    seed: int | None = None,
    key: str | None = None,
    replicated_key: bool = False,
    allow_replicated: bool = False,
    atol: float | None = None,
    timeout: float | None = None,
    args: str | None = None,
    processes: int | None = None,
    data_axes: Sequence[str] = (),
) -> ShardReport:
    """Keys and draws of `specs` re-derived on many devices, and `fns` ("FILE.py:NAME", (key, x) -> y) run
    eagerly, under jax.jit and under shard_map, in a fresh process with the devices asked for. A Spec given
    as an object must have been loaded from its file (the device process loads it again). With `args`
    ("FILE.py:FACTORY"), each of `fns` is a training step run once, as written, on the factory's arguments, and the
    randomness it draws on each device (and each of `processes` local processes) is compared."""
    from .shard.request import SpecTarget, make_request, parse_args_factory, parse_fn_target
    from .shard.runner import run
    from .spec.limits import current_limits
    from .spec.tree import Spec

    if not specs:
        given = [o for o, v in (("--path", paths), ("--stream", streams), ("--phase", phase), ("--draw", draw)) if v]
        if given:
            raise UsageError(f"{given[0]} applies to a SPEC, and no SPEC is given")
    targets = [parse_fn_target(f) for f in fns]
    default_draw, text = _draw(draw)
    spec_targets = []
    for p in specs:
        if isinstance(p, Spec) and not os.path.isfile(p.file):
            raise UsageError(f"shard_check needs spec files (the device process loads them); {p.file!r} is not one")
        s = load(p, phase, "shard-check")
        if default_draw is not None:
            _check_draw_budget(s, default_draw, text)
        file = s.file if isinstance(p, Spec) else os.fspath(p)
        spec_targets.append(SpecTarget(file, phase, tuple(paths), tuple(streams), default_draw))
    request = make_request(
        specs=spec_targets,
        fns=targets,
        devices=devices,
        platform=platform,
        mesh=mesh,
        shape=shape,
        fill=input,
        seed=seed,
        key=key,
        replicated_key=replicated_key,
        allow_replicated=allow_replicated,
        atol=atol,
        timeout=timeout,
        args=parse_args_factory(args) if args is not None else None,
        processes=processes,
        data_axes=tuple(data_axes),
    )
    limits = current_limits()
    return run(dataclasses.replace(request, spec_limits=(limits.max_bytes, limits.max_nodes)))


# ---------------------------------------------------------------- capture, verify, diff
def capture(
    target: str,
    *,
    inputs: Sequence[str] = (),
    rngs: str | dict[str, int] | None = None,
    phase: str = "init",
    method: str | None = None,
    steps: int | None = None,
    step: str | None = None,
) -> CaptureReport:
    """Run a live Flax model (`FILE.py:FACTORY` or `package.module:FACTORY`), record every key it hands out
    (`report.capture`) and a spec that derive replays bit-exactly (`report.spec`, YAML text). An NNX model (an
    nnx.Module class, or a function of an nnx.Rngs) is built and called `steps` times (default 1), by the
    training step `step` (`FILE.py:NAME`, called as `NAME(model, *args)`) when given."""
    from .refactor.capture import CaptureReport, run_capture

    cap, spec_text = run_capture(target, list(inputs), rngs, phase, method, steps, step)
    return CaptureReport(cap, spec_text)


def _sites(source: str | os.PathLike[str] | Spec | NnxSpec | Capture) -> Capture:
    from .refactor.keys_file import Capture, load_sites, spec_capture
    from .spec.nnx import NnxSpec
    from .spec.tree import Spec

    if isinstance(source, Capture):
        return source
    if isinstance(source, (Spec, NnxSpec)):
        return spec_capture(source.file, source)
    return load_sites(os.fspath(source))


def verify(
    spec: str | os.PathLike[str] | Spec | NnxSpec,
    against: str | os.PathLike[str] | Capture,
    *,
    inputs: Sequence[str] = (),
    rngs: str | dict[str, int] | None = None,
    method: str | None = None,
    step: str | None = None,
) -> Comparison:
    """The spec's keys against a live model (`FILE.py:FACTORY`, run in real Flax with `rngs`, by default the
    spec's integer seeds) or against a capture (a keys file, or a Capture): every key that differs, is
    missing or is extra (`report.failing`). An NNX model is called by the training step `step`
    (`FILE.py:NAME`, `step(model, *args)`) where the spec was captured with one."""
    from .refactor.capture import observe, quiet_stdout
    from .refactor.compare import verify as compare
    from .refactor.keys_file import Capture, load_source, spec_capture
    from .spec.nnx import NnxSpec
    from .spec.tree import Spec

    # the SPEC read once: a spec (Linen or NNX) or a keys file
    source = spec if isinstance(spec, (Spec, NnxSpec)) else load_source(os.fspath(spec))
    if (
        isinstance(source, NnxSpec)
        and isinstance(against, (str, os.PathLike))
        and not os.fspath(against).lower().endswith(".json")
    ):
        with quiet_stdout():
            return _verify_nnx(source, os.fspath(against), inputs, rngs, method, step)
    if step is not None:
        raise UsageError(
            "--step applies to an NNX spec checked against an NNX model (TARGET), not to a Linen spec or a keys file"
        )
    name = source.file if isinstance(spec, (Spec, NnxSpec)) else os.fspath(spec)
    ours = source if isinstance(source, Capture) else spec_capture(name, source)
    if not isinstance(against, str) and not isinstance(against, os.PathLike):
        theirs = against
    elif os.fspath(against).lower().endswith(".json"):
        if inputs or rngs or method:
            raise UsageError("--input, --rngs and --method apply to a TARGET, not to a keys file")
        theirs = _sites(against)
    else:
        seeds = rngs
        assert not isinstance(spec, NnxSpec)  # (an NNX spec against a TARGET: _verify_nnx above)
        if seeds is None:
            seeds = _spec_seeds(source if isinstance(source, Spec) else load(spec, command="verify"))
        from .refactor.capture import session
        from .refactor.nnx_capture import is_nnx_target
        from .refactor.target import parse_target

        ref = parse_target(os.fspath(against))
        with quiet_stdout(), session(ref):
            if is_nnx_target(ref):
                raise UsageError(
                    f"{ours.target} is a Linen spec and TARGET {os.fspath(against)} is an NNX model (a function "
                    "of an nnx.Rngs); verify a spec against a model of its flavour"
                )
            # (the method the spec says the model runs, capture --method's, unless --method names another)
            theirs, _, _ = observe(
                os.fspath(against), list(inputs), seeds, ours.phase, method if method is not None else ours.method
            )
    return compare(ours, theirs)


def _spec_seeds(spec: Spec | NnxSpec) -> dict[str, int]:
    """The spec's rngs as integer seeds, for the live model verify runs."""
    try:
        return {k: int(src.text) for k, src in spec.rngs.items()}
    except ValueError:
        raise UsageError(
            f"{spec.file}: its rngs are not all integer seeds; give --rngs STREAM=SEED,... for the TARGET"
        ) from None


def _nnx_spec_seeds(spec: NnxSpec) -> dict[str, int | list[int]]:
    """The spec's rngs for the nnx.Rngs verify builds the model from: integer seeds as written, any other key
    (`split(key(0))[1]`, raw key data) as its key data."""
    from .engine.keys import KeyEngine

    engine = KeyEngine(spec.prng_impl, spec.threefry_partitionable)
    out: dict[str, int | list[int]] = {}
    for stream, src in spec.rngs.items():
        try:
            out[stream] = int(src.text)
        except ValueError:
            out[stream] = list(engine.eval(src.expr))
    return out


def _verify_nnx(spec: NnxSpec, target: str, inputs, rngs, method, step: str | None = None) -> Comparison:
    """An NNX spec against a live NNX model: the model captured (built from the spec's seeds and called as many
    times as the spec's `steps`), then compared key by key."""
    from .refactor.capture import session
    from .refactor.compare import verify as compare
    from .refactor.keys_file import spec_capture
    from .refactor.nnx_capture import is_nnx_target, run_nnx_capture
    from .refactor.target import parse_input, parse_rngs, parse_step, parse_target
    from .spec.nnx import NnxMode, NnxReseed, NnxRunDraw, NnxStep

    if method is not None:
        raise UsageError("--method is Linen's: an NNX model is built and called")
    if any(
        not isinstance(e, (NnxStep, NnxMode, NnxRunDraw, NnxReseed))
        or isinstance(e, NnxStep)
        and (e.stale or e.transform or e.fork is not None)
        and step is None
        for e in spec.run
    ):
        raise UsageError(
            f"{spec.file}: its `run:` calls the model under nnx.vmap/nnx.scan or nnx.fork_rngs, or as a pure "
            "jax.jit step dropping its state (stale_call), and verify against a live NNX model makes plain calls "
            "without --step: give --step STEP, the training step that makes those calls, or compare the spec with "
            "a keys file"
        )
    for kind, what, who in (
        (NnxReseed, "reseeds the model between calls (`reseed:`)", "the training step that calls nnx.reseed"),
        (NnxRunDraw, "draws from the model's Rngs outside its calls (`draw:`)", "the training step that does"),
        (
            NnxMode,
            "puts the model in train/eval mode",
            "the function that does (model.train(), model.eval() or nnx.view)",
        ),
    ):
        event = next((e for e in spec.run if isinstance(e, kind)), None)
        if step is None and event is not None:
            raise UsageError(
                f"its `run:` {what}; give --step STEP, {who}, or compare the spec with a keys file", event.loc
            )
    ref = parse_target(target)
    step_ref = None if step is None else parse_step(step)
    with session(ref, *([step_ref] if step_ref is not None else [])):
        seeds: dict[str, int | list[int]] | None = None  # (None: a factory without parameters seeds it itself)
        if is_nnx_target(ref):
            seeds = (
                dict(rngs)
                if isinstance(rngs, dict)
                else dict(parse_rngs(rngs))
                if rngs is not None
                else _nnx_spec_seeds(spec)
            )
        elif rngs is not None:
            raise UsageError(
                f"--rngs: TARGET {target} takes no nnx.Rngs (a factory that seeds its model itself); --rngs seeds "
                "a factory that takes the Rngs (def make_model(rngs): return Model(rngs=rngs))"
            )
        # (the model run until it has been called as many times as the spec says: a --step may call it more than
        # once a step, and sets its train/eval mode itself)
        theirs, _ = run_nnx_capture(ref, [parse_input(t) for t in inputs], seeds, 0, step_ref, calls=spec.steps)
    theirs.target = target
    return compare(spec_capture(spec.file, spec), theirs)


def diff(
    old: str | os.PathLike[str] | Spec | NnxSpec | Capture,
    new: str | os.PathLike[str] | Spec | NnxSpec | Capture | None = None,
    *,
    from_flax: str | None = None,
    to_flax: str | None = None,
    from_jax: str | None = None,
    to_jax: str | None = None,
) -> Comparison:
    """Which call sites keep, change, gain or lose their keys from `old` to `new` (specs, keys files or
    captures), and why (`report.failing`: any change).

    An upgrade check: `from_flax`/`to_flax` (and `from_jax`/`to_jax`) derive the old and the new spec under
    those releases' rules ('newest' for the newest); `new` defaults to `old`, the same spec on both sides."""
    from .refactor.compare import diff as compare
    from .spec.releases import NEWEST, OLDEST_FLAX, Release, version_text, version_tuple

    releases = {"--from-flax": from_flax, "--to-flax": to_flax, "--from-jax": from_jax, "--to-jax": to_jax}
    for option, v in releases.items():
        if v is None or v == NEWEST:
            continue
        try:
            t = version_tuple(v)
        except ValueError:
            raise UsageError(f"{option} {v!r} is not a release like 0.10.2 (or 'newest')") from None
        if "flax" in option and t < OLDEST_FLAX:
            raise UsageError(f"{option} {v}: rngaudit has Flax's rules from {version_text(OLDEST_FLAX)} on")
    if new is None:
        if not any(releases.values()):
            raise UsageError("diff compares OLD with NEW: give NEW, or --from-flax/--to-flax (--from-jax/--to-jax)")
        new = old
    if not any(releases.values()):
        return compare(_sites(old), _sites(new))
    sides, pinned = [], []
    for side, flax, jax, which in ((old, from_flax, from_jax, "from"), (new, to_flax, to_jax, "to")):
        if not isinstance(side, (str, os.PathLike)) or os.fspath(side).lower().endswith(".json"):
            raise UsageError(
                "--from-flax/--to-flax and --from-jax/--to-jax derive specs under other releases: give spec files "
                f"(YAML), not {'a keys file' if isinstance(side, (str, os.PathLike)) else type(side).__name__}"
            )
        origin = f"--{which}-flax ({'OLD' if which == 'from' else 'NEW'} side)"
        cap, spec = _release_sites(os.fspath(side), Release(flax, jax, origin))
        sides.append(cap)
        pinned.append(spec.threefry_partitionable if spec.partitionable_pinned else None)
    cmp = compare(*sides)
    if from_jax is not None or to_jax is not None:
        for label, flag in zip(("OLD", "NEW"), pinned):
            if flag is not None:
                cmp.notes.append(
                    f"{label} sets jax.threefry_partitionable: {str(flag).lower()} (the model sets the flag), so "
                    "--from-jax/--to-jax do not change it there; where the flag is JAX's default, drop it from the "
                    "spec to check what the release moves"
                )
                if new is old:
                    break
    return cmp


def _release_sites(path: str, release) -> tuple[Capture, Any]:
    """A spec file's sites under `release`'s rules, named with the releases whose rules they follow (and the
    spec)."""
    from .refactor.keys_file import spec_capture
    from .spec.parse import load_spec

    spec = load_spec(path, release)
    cap = spec_capture(path, spec)
    jax = cap.settings["jax_version"]
    cap.target = f"{path} (flax {cap.settings['flax_version'] or 'newest'}{f', jax {jax}' if jax else ''})"
    return cap, spec


def findings(report, *, strict: bool = True) -> list:
    """A report's findings (rngaudit.output.findings.Finding: rule, level, message, location), as the
    `github` and `sarif` formats show them. `derive` has findings only under --strict (`strict=False`: none)."""
    from .collision.results import CollisionsReport
    from .engine.derive import DeriveReport
    from .engine.nnx import NnxDeriveReport
    from .output import findings as f
    from .refactor.compare import Comparison
    from .shard.report import ShardReport

    if isinstance(report, (DeriveReport, NnxDeriveReport)):
        return f.derive_findings(report, strict=strict)
    if isinstance(report, CollisionsReport):
        return f.collision_findings(report)
    if isinstance(report, ShardReport):
        return f.shard_findings(report)
    if isinstance(report, Comparison):
        return f.compare_findings(report)
    raise TypeError(f"not an rngaudit report: {type(report).__name__}")
