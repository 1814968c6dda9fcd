"""A YAML spec (format version 1) -> a Spec: the settings, the root keys and the model, every problem at
file:line:col."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import SpecError
from . import keyexpr
from .budget import check_budget

if TYPE_CHECKING:
    from .nnx import NnxSpec
from .fields import Fields, as_str, suggest, type_name
from .releases import (
    NEWEST,
    OLDEST_FLAX,
    FlaxRules,
    Release,
    jax_partitionable_default,
    version_text,
    version_tuple,
)
from .releases import release as read_release
from .statements import BodyParser
from .tree import PHASES, RngSource, Spec
from .yaml_source import YNode, load_bytes, load_file, load_text, not_a_spec

FORMAT_VERSION = 1
JAX_KEYS = ("prng_impl", "threefry_partitionable", "version")
FLAVOURS = ("linen", "nnx")
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
KEY_WIDTH = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}
MAX_UNSAFE_RBG_SPLIT = 65_536


def _rng_source(n: YNode, impl_width: int, impl: str = "threefry2x32") -> RngSource:
    v = n.value
    expr: keyexpr.KeyExpr
    if isinstance(v, bool) or v is None or isinstance(v, float) or n.is_map:
        raise SpecError(
            f"a key must be an integer seed, raw key data [w0, w1] or a key expression string, not {type_name(v)}",
            n.loc,
        )
    if isinstance(v, int):
        if not keyexpr.INT64_MIN <= v <= keyexpr.INT64_MAX:
            raise SpecError("the seed must fit in a signed 64-bit integer (JAX raises OverflowError)", n.loc)
        expr = keyexpr.Seed(v)
        text = str(v)
    elif n.is_seq:
        words: list[int] = []
        for w in n.value:
            if isinstance(w.value, bool) or not isinstance(w.value, int) or not 0 <= w.value < 2**32:
                raise SpecError("raw key data must be unsigned 32-bit integers", w.loc)
            words.append(w.value)
        expr = keyexpr.Raw(tuple(words))
        text = str(expr)
    else:
        expr = keyexpr.parse(v, n.loc, quoted=n.quoted)
        text = v
    if impl == "unsafe_rbg":
        e = expr
        while isinstance(e, (keyexpr.Split, keyexpr.FoldIn)):
            if isinstance(e, keyexpr.Split) and e.n > MAX_UNSAFE_RBG_SPLIT:
                raise SpecError(
                    f"split into {e.n} keys: for unsafe_rbg rngaudit asks JAX for all of them; "
                    f"split into at most {MAX_UNSAFE_RBG_SPLIT}",
                    n.loc,
                )
            e = e.parent
    raw = keyexpr.raw_words(expr)
    if raw is not None and len(raw) != impl_width:
        raise SpecError(
            f"raw key data has {len(raw)} words but the PRNG impl needs {impl_width} "
            "(Flax raises ValueError for a key of another impl); check jax.prng_impl",
            n.loc,
        )
    return RngSource(expr, text, n.loc)


def rngaudit_output(made: object) -> str | None:
    """What a document whose `format` is MADE is, if rngaudit wrote it (a keys file, a report), else None."""
    if not isinstance(made, str) or not made.startswith("rngaudit."):
        return None
    return "a keys file (capture --keys)" if made == "rngaudit.capture" else f"rngaudit's own output ({made})"


def spec_from_node(root: YNode, release: Release | None = None) -> Spec | NnxSpec:
    """The spec a YAML tree holds; `release` replaces its `flax: version` / `jax: version` (an upgrade check:
    the same model under another release's rules; threefry_partitionable then takes that JAX's default)."""
    file = root.loc.file
    made = root.value.get("format") if isinstance(root.value, dict) else None
    what = rngaudit_output(made.value if made is not None else None)
    if what is not None:
        raise SpecError(
            f"this is {what}, not a spec: give the spec capture wrote (capture -o SPEC.yaml); verify and diff take "
            "a keys file too",
            root.loc,
        )
    keys: tuple[str, ...] = ("rngaudit", "flavour", "flax", "jax", "phase", "method", "mutable", "rngs", "model")
    keys += ("steps", "run", "call_rngs")
    if root.is_map and "rngaudit" not in root.value:
        other = [repr(k) for k in root.value if k not in keys]
        if other:  # (another YAML file: a CI workflow, a config, named by a pattern or by hand)
            shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
            raise not_a_spec(f", and keys a spec does not have ({shown})", root.loc)
    top = Fields(root, "the spec", keys, ())
    vn = top.get("rngaudit")
    if vn is None:
        raise SpecError("the spec needs `rngaudit: 1` (the spec format version) at the top", root.loc)
    if isinstance(vn.value, bool) or not isinstance(vn.value, int) or vn.value != FORMAT_VERSION:
        raise SpecError(
            f"unsupported spec format version {vn.value!r}; this rngaudit reads version "
            f"{FORMAT_VERSION}: write `rngaudit: {FORMAT_VERSION}`",
            vn.loc,
        )
    flavour = top.text("flavour", "linen")
    if flavour not in FLAVOURS:
        raise SpecError(
            f"unknown flavour {flavour!r}{suggest(flavour, FLAVOURS)}; use linen (the default) or nnx",
            top.need("flavour").loc,
        )
    if not top.has("model"):
        what = "class, init, call" if flavour == "nnx" else "class, body"
        raise SpecError(f"the spec needs `model:` (the root module: {what})", root.loc)
    if flavour == "linen":
        _no_nnx(top)

    fix = False
    if top.has("flax") and flavour == "nnx":
        fn = top.need("flax")
        if fn.is_map and "fix_rng_separator" in fn.value:
            raise SpecError(
                "`fix_rng_separator` is a Linen setting; an NNX spec's `flax:` has `version` only",
                fn.key_locs["fix_rng_separator"],
            )
    flax_version = jax_version = None
    ff = None
    if top.has("flax") and flavour == "linen":
        ff = Fields(top.need("flax"), "flax", ("fix_rng_separator", "version"))
        fix = ff.flag("fix_rng_separator", False)
        flax_version = read_release(ff)
    if release is not None and release.flax is not None:
        flax_version = None if release.flax == NEWEST else release.flax
    if flavour == "linen" and flax_version is not None and version_tuple(flax_version) < OLDEST_FLAX:
        raise SpecError(
            f"rngaudit has Flax's rules from {version_text(OLDEST_FLAX)} on; flax {flax_version} is older",
            ff.need("version").loc if ff is not None and ff.has("version") else root.loc,
        )
    impl, part, pins = "threefry2x32", True, False
    if top.has("jax"):
        jf = Fields(top.need("jax"), "jax", JAX_KEYS)
        impl = jf.text("prng_impl", impl)
        if impl not in PRNG_IMPLS:
            raise SpecError(
                f"unknown prng_impl {impl!r}{suggest(impl, PRNG_IMPLS)}; use one of {', '.join(PRNG_IMPLS)}",
                jf.need("prng_impl").loc,
            )
        jax_version = read_release(jf, "JAX")
        # (a JAX release sets the flag's default: false before 0.5.0; the flag itself wins)
        default = jax_partitionable_default(None if jax_version is None else version_tuple(jax_version))
        part = jf.flag("threefry_partitionable", default)
        pins = jf.has("threefry_partitionable")
    if release is not None and release.jax is not None:
        jax_version = None if release.jax == NEWEST else release.jax
        if not pins:
            # (a flag the spec sets stays set: the model pins it, and the upgrade does not move it)
            part = jax_partitionable_default(None if jax_version is None else version_tuple(jax_version))
    pn = top.get("phase")
    phase = pn.value if pn is not None else "init"
    if pn is not None and (not isinstance(phase, str) or phase not in PHASES):
        if not isinstance(phase, str):
            raise SpecError(f"`phase` must be init or apply, not {type_name(phase)}", pn.loc)
        raise SpecError(f"`phase` must be init or apply, not {phase!r}{suggest(phase, PHASES)}", pn.loc)
    mutable: tuple[str, ...] | bool = phase == "init"
    mn = top.get("mutable")
    if mn is not None:
        if phase == "init":
            raise SpecError("`mutable` applies to phase: apply only (init makes every collection mutable)", mn.loc)
        if isinstance(mn.value, bool):
            mutable = mn.value
        elif mn.is_seq:
            mutable = tuple(as_str(c, "a collection name") for c in mn.value)
        elif isinstance(mn.value, str):
            mutable = (mn.value,)
        else:
            raise SpecError(
                f"`mutable` must be true, false, a collection name or a list of them, not {type_name(mn.value)}", mn.loc
            )

    rngs: dict[str, RngSource] = {}
    rn = top.get("rngs")
    width = KEY_WIDTH[impl]
    if rn is not None and rn.value is not None:
        if rn.is_map:
            for stream, kn in rn.value.items():
                rngs[stream] = _rng_source(kn, width, impl)
        else:
            # a bare key means {'params': key} in Linen, and nnx.Rngs(key) (the `default` stream) in NNX
            rngs["default" if flavour == "nnx" else "params"] = _rng_source(rn, width, impl)
    if flavour == "nnx":
        from .nnx import nnx_spec  # (an NNX spec's machinery: a Linen spec's run imports none of it)

        spec = nnx_spec(
            top,
            file,
            impl,
            part,
            rngs,
            lambda kn: _rng_source(kn, width, impl),
            None if release is None else release.flax,
            None if release is None or release.flax is None else release.origin,
        )
        return dataclasses.replace(spec, jax_version=jax_version, partitionable_pinned=pins)

    parser = BodyParser(FlaxRules(None if flax_version is None else version_tuple(flax_version)))
    if release is not None and release.flax is not None and release.origin:
        parser.origin = release.origin
    parser.key_source = lambda kn: _rng_source(kn, width, impl)
    model = parser.root(top.need("model"))
    check_budget(model)
    return Spec(
        file,
        fix,
        impl,
        part,
        phase,
        mutable,
        rngs,
        model,
        flax_version=flax_version,
        jax_version=jax_version,
        method=_method(top),
        partitionable_pinned=pins,
    )


def _method(top: Fields) -> str | None:
    """`method: NAME`: the module method the model runs (capture --method writes it; verify runs it)."""
    node = top.get("method")
    if node is None:
        return None
    name = node.value
    if not isinstance(name, str) or not name.isidentifier():
        raise SpecError(
            f"`method` must be the name of the module method the model runs (e.g. encode), not {name!r}", node.loc
        )
    return None if name == "__call__" else name


def _no_nnx(top: Fields) -> None:
    """A Linen spec holds no NNX statement: say which flavour they belong to."""
    for key in ("steps", "run", "call_rngs"):
        if top.has(key):
            raise SpecError(
                f"`{key}` applies to `flavour: nnx` specs (Linen replays one init or apply)", top.need(key).loc
            )
    model = top.need("model")
    if model.is_map:
        for key in ("init", "call", "keep_rngs"):
            if key in model.value:
                raise SpecError(
                    f"`{key}:` is an NNX statement (a module's __init__/__call__); add `flavour: nnx` at the top "
                    "for an NNX model, or write a Linen module (class, setup, body)",
                    model.key_locs[key],
                )


def load_spec(path: str, release: Release | None = None) -> Spec | NnxSpec:
    """Load and validate a spec file (either flavour), under another release's rules if `release` says."""
    return spec_from_node(load_file(path), release)


@dataclass(frozen=True)
class SpecBytes:
    """A spec given as its bytes (standard input's, for `-`), shown as `name` in every location."""

    data: bytes
    name: str

    def load(self) -> Spec | NnxSpec:
        """Parsed and validated as a spec file of that name would be."""
        return spec_from_node(load_bytes(self.data, self.name))


def parse_spec(text: str, file: str = "<spec>") -> Spec | NnxSpec:
    """Parse spec text (for tests and tools that build specs in memory)."""
    return spec_from_node(load_text(text, file))


def linen_only(spec: Spec | NnxSpec, command: str) -> Spec:
    """The spec, for a command that reads Linen specs only; an NNX spec is an input error naming what reads it."""
    if not isinstance(spec, Spec):  # (an NnxSpec)
        raise SpecError(
            f"{command} reads Linen specs, and this one is `flavour: nnx`; NNX specs work with `derive`, "
            "`collisions`, `verify` and `diff`",
            spec.model.loc,
        )
    return spec
