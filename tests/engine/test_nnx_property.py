"""Random NNX models, written as NNX spec YAML, derived by rngaudit and built in real Flax NNX: the same keys.

Each example draws a tree of user modules whose __init__ builds standard layers (every option that changes
what they draw), Dropout and attention (which fork their stream), submodules given the caller's Rngs or
`rngs.fork()`, and `rngs.<stream>()` draws (streams that exist, fall back to `default`, or do not exist); whose
__call__ calls those layers and submodules (some more than once, some under nnx.scan with streams carried or
broadcast, or nnx.vmap with streams split or broadcast, some in nnx.fork_rngs) and draws from a kept Rngs
(draws and calls in train or eval mode only, `when:`), some of it inside nnx.cond, nnx.switch, nnx.fori_loop or nnx.while_loop (nested, a branch or body of any of
these statements); nnx.RNNs (standard cells, keeping their Rngs or not, or user cells holding Dropouts, layers
and submodules, with broadcast streams and initialize_carry draws; the RNN with its own stream, rngs.carry.fork()
or none) called over sequences of 1 to 4 steps, with an initial carry, the model's Rngs or nnx.fork_rngs (never in
lanes: refused); stacked modules (split_rngs around vmap at construction) called by nnx.scan or nnx.vmap over
their axis; then calls the model several times (`steps`), or runs calls, stale jitted steps, nnx.reseed events,
model.train()/model.eval() and calls under nnx.vmap/nnx.scan or nnx.fork_rngs (`run`). Every key NNX hands out (construction and each
step) must be derive's, in order, or both
must raise the same error. RNGAUDIT_NNX_EXAMPLES sets how many (default 40, a fixed set)."""

from __future__ import annotations

import os

import yaml
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st
from nnx_oracle import check_against_nnx

from rngaudit import FlaxError, SpecError, derive, parse_spec
from rngaudit.spec.nnx import NnxMode, NnxReseed, NnxRunDraw, _calls

EXAMPLES = int(os.environ.get("RNGAUDIT_NNX_EXAMPLES", "40"))


def _installed_flax() -> tuple[str, tuple[int, ...]]:
    """The installed Flax (the oracle). An older one than the current rules': every spec says its version, and
    uses nothing that release lacks (Rngs.fork(), keep_rngs, InstanceNorm)."""
    import flax

    from rngaudit.spec.releases import version_tuple

    return flax.__version__, version_tuple(flax.__version__)


FLAX_VERSION, FLAX = _installed_flax()
OLD = FLAX < (0, 12)


def has(what: str) -> bool:
    from rngaudit.spec.nnx import MODELLED_SINCE, SINCE

    return FLAX >= (SINCE[what] if what in SINCE else MODELLED_SINCE[what])


STREAMS = ("params", "dropout", "noise", "default")
ASKED = STREAMS + ("other",)  # a stream no Rngs has: falls back to default, or fails
WIDTH = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}


def maybe(draw, p: float) -> bool:
    return draw(st.floats(0, 1)) < p


@st.composite
def layer(draw, keeps_ok: bool = True):
    """A standard layer; not `keeps_ok`: none that keeps the Rngs it is given (before flax 0.11 Dropout and
    attention with dropout do, and a stacked module may not keep its Rngs)."""
    kind = draw(
        st.sampled_from(
            (
                "Linear",
                "LinearGeneral",
                "Conv",
                "ConvTranspose",
                "Embed",
                "LayerNorm",
                "BatchNorm",
                "GroupNorm",
                *(("InstanceNorm",) if has("InstanceNorm") else ()),
                "RMSNorm",
                *(("LoRALinear", "LoRA") if has("nnx.LoRA") else ()),
                *(("Dropout", "Dropout") if keeps_ok else ()),
                "MultiHeadAttention",
            )
        )
    )
    o: dict = {}
    flag = lambda: draw(st.booleans())
    if kind in ("Linear", "LinearGeneral", "Conv", "ConvTranspose", "LoRALinear"):
        if maybe(draw, 0.4):
            o["use_bias"] = flag()
    elif kind == "LoRA" and maybe(draw, 0.6):
        # nnx.LoRA(..., base_module=<a layer built just before, from the same Rngs>)
        base = draw(st.sampled_from(("Linear", "LinearGeneral", "Conv", "ConvTranspose", "Embed")))
        o["base_module"] = {base: {"use_bias": flag()}} if base != "Embed" and maybe(draw, 0.4) else base
    elif kind in ("LayerNorm", "BatchNorm", "GroupNorm", "InstanceNorm"):
        if maybe(draw, 0.4):
            o["use_scale"] = flag()
        if maybe(draw, 0.4):
            o["use_bias"] = flag()
    elif kind == "RMSNorm":
        if maybe(draw, 0.4):
            o["use_scale"] = flag()
    elif kind == "Dropout":
        o["rate"] = draw(st.sampled_from((0.5, 0.5, 0.1, 0.0, 1.0)))
        if maybe(draw, 0.3):
            o["rng_collection"] = draw(st.sampled_from(ASKED))
        if maybe(draw, 0.15):
            o["deterministic"] = True
        if has("a key given to a Dropout call") and maybe(draw, 0.15):
            o["rngs"] = False  # nnx.Dropout(rate): a key comes with each call
    elif kind == "MultiHeadAttention":
        o["dropout_rate"] = draw(st.sampled_from((0.0, 0.5) if keeps_ok else (0.0,)))
        for k in ("use_bias", "normalize_qk"):
            if maybe(draw, 0.3):
                o[k] = flag()
        if maybe(draw, 0.15) and has("keep_rngs"):
            o["keep_rngs"] = False
        if maybe(draw, 0.2):
            o["deterministic"] = True
    return kind, o


def rng_draw(draw):
    stream = draw(st.sampled_from(ASKED))
    if maybe(draw, 0.25):
        return {"draw": {"stream": stream, "repeat": draw(st.integers(1, 3))}}
    return {"draw": stream}


TAGS = ("params", "dropout", "noise", "default")


def lane_safe(mod: dict) -> bool:
    """Whether a module can run in a vmap lane: no stacked module and no nnx.vmap of a new axis inside (rngaudit
    does not model nested lanes)."""
    for st_ in mod.get("init", []):
        if isinstance(st_, dict) and "RNN" in st_:
            return False  # (an nnx.RNN called in lanes: not modelled, refused)
        child = st_.get("module") if isinstance(st_, dict) else None
        if child is not None and ("stack" in child or not lane_safe(child)):
            return False
    calls = [c["call"] for c in flat(mod.get("call", [])) if isinstance(c, dict) and isinstance(c.get("call"), dict)]
    # (a vmap of a new axis has an integer size; `vmap: true` maps a stack's own axis)
    return not any(type(c.get("vmap")) is int for c in calls)


def uses_call_rngs(mod: dict) -> bool:
    """Whether a module (or one it builds) gives a Dropout the call's Rngs (`rngs: call`): it is called plainly
    (rngaudit does not model the call's Rngs in lanes or control flow)."""
    calls = [c["call"] for c in mod.get("call", []) if isinstance(c, dict) and isinstance(c.get("call"), dict)]
    return any("rngs" in c for c in calls) or any(
        isinstance(s, dict) and "module" in s and uses_call_rngs(s["module"]) for s in mod.get("init", [])
    )


def flat(statements: list):
    """The statements and those in their branches and loop bodies."""
    for s in statements:
        yield s
        if isinstance(s, dict) and "cond" in s:
            yield from flat(s["cond"]["true_fun"])
            yield from flat(s["cond"]["false_fun"])
        elif isinstance(s, dict) and "switch" in s:
            for b in s["switch"]["branches"]:
                yield from flat(b)
        elif isinstance(s, dict) and ("fori_loop" in s or "while_loop" in s):
            yield from flat(s.get("fori_loop", s.get("while_loop"))["body"])


def fork_rngs(draw, tags: tuple[str, ...] = TAGS):
    """A `fork_rngs:` value: every stream, one tag or some."""
    if maybe(draw, 0.4):
        return True
    tags = draw(st.lists(st.sampled_from(tags), unique=True, min_size=1, max_size=2))
    return tags[0] if len(tags) == 1 and maybe(draw, 0.5) else tags


def transform(draw, lanes_ok: bool) -> dict:
    """`scan: N` with some streams broadcast, or (where lanes may start) `vmap: N` with some split."""
    tags = draw(st.lists(st.sampled_from(TAGS), unique=True, max_size=2))
    if lanes_ok and maybe(draw, 0.5):
        return {"vmap": draw(st.integers(1, 3)), **({"split": tags} if tags else {})}
    return {"scan": draw(st.integers(1, 3)), **({"broadcast": tags} if tags else {})}


def linen_body(draw, depth: int = 1) -> list:
    """A Linen module's body for a bridge.ToNNX: standard layers, make_rng of any stream (a missing one falls back
    to params), params, a child module."""
    body: list = []
    for i in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(("Dense", "Dropout", "make_rng", "param") + (("module",) if depth else ())))
        if kind == "Dense":
            body.append({"Dense": {"features": 2, **({"use_bias": False} if maybe(draw, 0.3) else {})}})
        elif kind == "Dropout":
            body.append({"Dropout": {"rate": 0.5, "deterministic": maybe(draw, 0.2)}})
        elif kind == "make_rng":
            body.append({"make_rng": draw(st.sampled_from(ASKED))})
        elif kind == "param":
            body.append({"param": f"w{i}"})
        else:
            body.append({"module": {"class": f"L{i}", "body": linen_body(draw, depth - 1)}})
    return body


CELLS = ("LSTMCell", "OptimizedLSTMCell", "GRUCell", "SimpleCell")
RNN_TAGS = TAGS + ("carry", "recurrent_dropout")  # (carry: what initialize_carry and keep_rngs fork)


def dropout_streams(mod: dict) -> set[str]:
    """The streams the Dropouts and attention layers of a module (and the modules it builds) draw from."""
    out: set[str] = set()
    for s in mod.get("init", []):
        if not isinstance(s, dict):
            continue
        if "Dropout" in s:
            out.add(s["Dropout"].get("rng_collection", "dropout"))
        elif "MultiHeadAttention" in s and s["MultiHeadAttention"].get("dropout_rate"):
            out.add("dropout")
        elif "module" in s:
            out |= dropout_streams(s["module"])
    return out


def rnn(draw, name: str, n: list) -> dict:
    """`RNN:` (nnx.RNN in __init__): a standard cell (keep_rngs or not) or a user cell (Dropouts, layers,
    submodules: never lanes, a bridge or the call's Rngs inside), how the RNN gets its carry stream, the
    broadcast streams (often one a Dropout of the cell uses), a user cell's initialize_carry draws."""
    o: dict = {"name": name}
    if maybe(draw, 0.45):
        kind = draw(st.sampled_from(CELLS))
        if maybe(draw, 0.5):
            o["cell"] = kind
        else:
            o["cell"] = {kind: {"keep_rngs": draw(st.booleans())}}
        used: set[str] = {"carry"} if maybe(draw, 0.5) else set()
    else:
        cell = draw(module(draw(st.integers(0, 1)), n, lanes=True))
        if maybe(draw, 0.5):
            # recurrent dropout (the Randomness guide's): a Dropout of its own stream, called every step
            drop = f"r{len(cell.get('init', []))}"
            col = draw(st.sampled_from(("recurrent_dropout", "recurrent_dropout", "dropout", "noise")))
            cell.setdefault("init", []).append({"Dropout": {"name": drop, "rate": 0.5, "rng_collection": col}})
            cell.setdefault("call", []).insert(draw(st.integers(0, len(cell.get("call", [])))), {"call": drop})
        if has("rngs: fork") and maybe(draw, 0.3):
            cell["rngs"] = draw(st.sampled_from(("shared", "fork")))
        o["cell"] = {"module": cell}
        if maybe(draw, 0.8):
            o["carry_draws"] = draw(st.integers(0, 2))
        used = dropout_streams(cell)
    if maybe(draw, 0.7):
        o["rngs"] = draw(st.sampled_from(("own", "fork", "fork", "none")))
    user = o["cell"].get("module") if isinstance(o["cell"], dict) else None
    if o.get("rngs") == "none" and user is not None and user.get("keep_rngs") and o.get("carry_draws"):
        # not drawn: rngaudit raises NNX's ValueError (no RNGs for the carry), the oracle's user cell falls back
        # to the Rngs it keeps (rngs.carry): which one a spec means is not settled yet
        o["rngs"] = "own"
    if maybe(draw, 0.55):
        pool = sorted(used) if used and maybe(draw, 0.75) else list(RNN_TAGS)
        tags = draw(st.lists(st.sampled_from(pool), unique=True, min_size=1, max_size=2))
        o["broadcast"] = tags[0] if len(tags) == 1 and maybe(draw, 0.5) else tags
    if maybe(draw, 0.2):
        o["carry_init"] = draw(st.sampled_from(("zeros", "random")))
    return {"RNN": o}


def rnn_call(draw, name: str, level: int) -> dict:
    """`call: {name, length}` of an nnx.RNN: an initial carry, the model's (or the call's) Rngs (plain calls
    only: not in control flow), nnx.fork_rngs, repeated."""
    c: dict = {"name": name, "length": draw(st.integers(1, 4))}
    if maybe(draw, 0.25):
        c["initial_carry"] = True
    if level == 0 and maybe(draw, 0.25):
        c["rngs"] = draw(st.sampled_from(("model", "model", "call")))
    elif has("fork_rngs") and maybe(draw, 0.15):
        c["fork_rngs"] = fork_rngs(draw, TAGS + ("carry",))
    if maybe(draw, 0.2):
        c["repeat"] = 2
    return {"call": c}


def bridged(mod: dict) -> bool:
    """Whether a module holds a bridge.ToNNX (itself or a child): it is called plainly (rngaudit does not model a
    ToNNX in lanes, steps or control flow)."""
    return any(
        isinstance(s, dict) and ("ToNNX" in s or ("module" in s and bridged(s["module"]))) for s in mod.get("init", [])
    )


@st.composite
def module(draw, depth: int, n: list, lanes: bool = False, no_keep: bool = False):
    """A user module; `lanes`: it runs in a vmap lane or as a stack's member (no new lanes inside); `no_keep`:
    it shares a stacked module's Rngs (which it may not keep)."""
    n[0] += 1
    mod: dict = {"class": f"M{n[0]}"}
    keep = not no_keep and maybe(draw, 0.3)
    if keep:
        mod["keep_rngs"] = True
    init, names = [], []
    children: dict[str, dict] = {}
    dropouts: set[str] = set()
    moded: set[str] = set()  # Dropout and attention layers: their calls may be given `deterministic=`
    rnns: set[str] = set()
    forks: dict[str, str] = {}  # self.<name> = rngs.<stream>.fork(): name -> stream
    # the items of an nnx.List (`l.8`, `l.9`, `l.10`: graph order walks them by index) or attributes
    prefix, offset = ("l.", draw(st.sampled_from((0, 8)))) if maybe(draw, 0.15) else ("a", 0)
    for i in range(draw(st.integers(1 if depth == 2 else 0, 5))):
        kinds = ("layer", "layer", "layer", "draw") + (("module",) if depth > 0 else ())
        kinds += ("fork",) if has("fork") else ()
        kinds += ("rnn", "rnn") if not lanes and has("nnx.RNN") else ()
        what = draw(st.sampled_from(kinds + (("stack",) if depth > 0 and not lanes else ())))
        if not lanes and has("ToNNX") and maybe(draw, 0.08):
            what = "bridge"
        name = f"{prefix}{i + offset}"
        if what == "rnn":
            init.append(rnn(draw, name, n))
            names.append(name)
            rnns.add(name)
        elif what == "bridge":
            module_ = {"class": f"E{i}", "body": linen_body(draw)}
            init.append({"ToNNX": {"name": name, "module": module_}})
            names.append(name)
            children[name] = {"init": [{"ToNNX": {}}]}  # (for bridged())
        elif what == "layer":
            kind, o = draw(layer(keeps_ok=not (no_keep and FLAX < (0, 11))))
            init.append({kind: {"name": name, **o}})
            names.append(name)
            if kind == "Dropout":
                dropouts.add(name)
            if kind in ("Dropout", "MultiHeadAttention"):
                moded.add(name)
        elif what in ("module", "stack"):
            fork = what == "module" and maybe(draw, 0.4) and has("rngs: fork")
            child = draw(module(depth - 1, n, lanes or what == "stack", (no_keep and not fork) or what == "stack"))
            child["name"] = name
            if fork:
                child["rngs"] = "fork"
            if what == "stack":
                child["stack"] = draw(st.integers(1, 3))
                if has("rngs: broadcast") and maybe(draw, 0.35):
                    # nnx.vmap over rngs.split(N) / rngs.broadcast(N), the mapping form passing the rest through
                    child["rngs"] = draw(st.sampled_from(("split", "split", "broadcast")))
                    if maybe(draw, 0.4):
                        child["only"] = draw(st.lists(st.sampled_from(TAGS), unique=True, min_size=1, max_size=2))
            init.append({"module": child})
            names.append(name)
            children[name] = child
        elif what == "fork":
            stream = draw(st.sampled_from(ASKED))
            if not keep and maybe(draw, 0.3):
                name = "rngs"  # (as nnx.Dropout keeps its fork: self.rngs = rngs.dropout.fork())
            if name in forks:
                continue
            forks[name] = stream
            init.append({"fork": stream} if name == "rngs" else {"fork": {"stream": stream, "name": name}})
        else:
            init.append(rng_draw(draw))

    def one(level: int):
        """A statement of __call__ (or of a branch or loop body `level` deep): a call, a draw or control flow; a
        Dropout's or attention's call sometimes given `deterministic=` (drop(x, deterministic=False))."""
        made = statement(level)
        if made is not None and "call" in made and maybe(draw, 0.2):
            call_ = made["call"] if isinstance(made["call"], dict) else {"name": made["call"]}
            if call_["name"] in moded:
                made = {"call": {**call_, "deterministic": draw(st.booleans())}}
        return made

    def statement(level: int):
        if level < 2 and maybe(draw, 0.12):
            return control(level)
        if forks and maybe(draw, 0.3):
            # self.rng() of a stream kept by `fork:` (a DropPath, an attention port keeping rngs.dropout.fork())
            name = draw(st.sampled_from(sorted(forks)))
            made = {"draw": {"stream": forks[name], "from": name}}
            if maybe(draw, 0.2):
                made["draw"]["when"] = draw(st.sampled_from(("train", "eval")))
            return made
        if names and (not keep or maybe(draw, 0.7)):
            target = draw(st.sampled_from(names))
            if target in rnns:
                return rnn_call(draw, target, level)
            child = children.get(target)
            if child is not None and child.get("keep_rngs") and "stack" not in child and maybe(draw, 0.35):
                # self.<child>.rngs.<stream>() (or a method of the child drawing from its own): `from:`
                return {"draw": {"stream": draw(st.sampled_from(ASKED)), "from": target}}
            if child is not None and (bridged(child) or uses_call_rngs(child)):
                # (a ToNNX, or a module holding one, or giving a Dropout the call's Rngs: called plainly, outside
                # control flow)
                return {"call": target} if level == 0 else None
            if (
                target in moded
                and not lanes
                and level == 0
                and has("a key given to a Dropout call")
                and maybe(draw, 0.35)
            ):
                # drop(x, rngs=rngs) (or attention's att(x, rngs=rngs)): the Rngs the model's call was given (the
                # spec's call_rngs)
                given = draw(st.sampled_from(("call", "model")))
                return {"call": {"name": target, "rngs": given, "repeat": draw(st.integers(1, 2))}}
            if target in dropouts and has("a key given to a Dropout call") and maybe(draw, 0.25):
                # drop(x, rngs=key): a key given at the call, used as it is
                return {"call": {"name": target, "key": draw(st.integers(0, 3)), "repeat": draw(st.integers(1, 2))}}
            if child is not None and "stack" in child:
                made = {"call": {"name": target, draw(st.sampled_from(("scan", "vmap"))): True}}
            elif maybe(draw, 0.25):
                safe = not lanes and (child is None or lane_safe(child))
                made = {"call": {"name": target, **transform(draw, safe)}}
            else:
                made = {"call": target} if maybe(draw, 0.8) else {"call": {"name": target, "repeat": 2}}
            # (a stack forked outside its axis fails in NNX: seldom)
            if has("fork_rngs") and maybe(draw, 0.15) and (child is None or "stack" not in child or maybe(draw, 0.2)):
                call_ = made["call"] if isinstance(made["call"], dict) else {"name": made["call"]}
                made = {"call": {**call_, "fork_rngs": fork_rngs(draw)}}
            if maybe(draw, 0.1):
                # called in one mode only (`if train:`, a `train` argument following model.train()/eval())
                call_ = made["call"] if isinstance(made["call"], dict) else {"name": made["call"]}
                made = {"call": {**call_, "when": draw(st.sampled_from(("train", "eval")))}}
            return made
        if keep:
            made = rng_draw(draw)
            if maybe(draw, 0.2):
                # drawn in one mode only (`if not self.deterministic:`, which model.train()/eval() switch)
                d = made["draw"] if isinstance(made["draw"], dict) else {"stream": made["draw"]}
                made = {"draw": {**d, "when": draw(st.sampled_from(("train", "train", "eval")))}}
            return made
        return None

    def body(level: int) -> list:
        return [s for s in (one(level + 1) for _ in range(draw(st.integers(0, 3)))) if s is not None]

    def control(level: int) -> dict:
        """nnx.cond / nnx.switch (an index sometimes out of range: clamped) / a loop, 0 to 3 iterations."""
        kind = draw(st.sampled_from(("cond", "switch", "fori_loop", "while_loop")))
        if kind == "cond":
            return {"cond": {"pred": draw(st.booleans()), "true_fun": body(level), "false_fun": body(level)}}
        if kind == "switch":
            n = draw(st.integers(1, 3))
            return {"switch": {"index": draw(st.integers(-1, n)), "branches": [body(level) for _ in range(n)]}}
        return {kind: {"iterations": draw(st.integers(0, 3)), "body": body(level)}}

    call = []
    for _ in range(draw(st.integers(1 if depth == 2 else 0, 4))):
        made = one(0)
        if made is not None:
            call.append(made)
    called = {c["call"]["name"] for c in flat(call) if isinstance(c, dict) and isinstance(c.get("call"), dict)}
    for name in sorted(rnns - called):
        if maybe(draw, 0.75):  # (an RNN built and never called draws only at construction)
            call.insert(draw(st.integers(0, len(call))), rnn_call(draw, name, 0))
    if init:
        mod["init"] = init
    if call:
        mod["call"] = call
    return mod


@st.composite
def nnx_specs(draw) -> str:
    impl = draw(st.sampled_from(("threefry2x32",) * 5 + ("rbg", "unsafe_rbg")))
    streams = draw(st.lists(st.sampled_from(STREAMS), unique=True, max_size=4))
    if maybe(draw, 0.6) and "params" not in streams:
        streams.insert(0, "params")
    model = draw(module(2, [0]))
    if bridged(model) and "params" not in streams and "default" not in streams:
        streams.insert(0, "params")  # (a Linen param without a params key is Flax's error, outside the oracle's)
    recurrent = "RNN" in yaml.safe_dump(model)
    if recurrent:
        # an RNN forks `carry` (rngs: fork, a cell's keep_rngs; else default, or NNX's error); recurrent dropout
        streams += [s for s in ("carry", "recurrent_dropout") if maybe(draw, 0.6 if s == "carry" else 0.4)]
    doc = {
        "rngaudit": 1,
        "flavour": "nnx",
        "jax": {"prng_impl": impl, "threefry_partitionable": draw(st.booleans())},
        **({"flax": {"version": FLAX_VERSION}} if OLD else {}),
        "rngs": {s: draw(st.one_of(st.integers(0, 5), st.integers(0, 2**63 - 1))) for s in streams},
        "model": model,
    }
    plain = uses_call_rngs(model) or draw(st.integers(0, 9)) == 7  # (hypothesis draws 0 and floats near 0 often)
    if plain and (maybe(draw, 0.8) or "rngs: call" in yaml.safe_dump(model)):
        # rngs = nnx.Rngs(...), given to every call: model(x, rngs=rngs) (a stream it lacks is NNX's KeyError)
        given = draw(st.lists(st.sampled_from(STREAMS + ("carry",) * recurrent), unique=True, min_size=1, max_size=2))
        doc["call_rngs"] = {s: draw(st.integers(0, 5)) for s in given}
    if maybe(draw, 0.5):
        doc["steps"] = draw(st.integers(0, 3))
    elif plain:
        doc["run"] = draw(st.lists(st.sampled_from(("call", "reseed", "train", "eval")), min_size=1, max_size=4))
        reseeded = ("dropout", "carry") if recurrent else ("dropout",)
        doc["run"] = [
            e
            if e in ("call", "train", "eval")
            else {
                "reseed": {
                    s: draw(st.integers(0, 5))
                    for s in draw(st.lists(st.sampled_from(reseeded), unique=True, min_size=1))
                }
            }
            for e in doc["run"]
        ]
    else:
        doc["run"] = draw(st.lists(run_event(lane_safe(model), bridged(model), recurrent), min_size=1, max_size=5))
    if "run" in doc:
        # nnx.reseed of an attribute of the model (a submodule, a stack, a layer, a kept fork) and/or with
        # policy='match_shape' (a stacked stream split into its lanes)
        attrs = [
            v["name"] for st_ in model.get("init", []) for v in st_.values() if isinstance(v, dict) and "name" in v
        ]
        stacked = "stack" in yaml.safe_dump(model)  # (a stacked stream reseeded needs match_shape, else ValueError)
        for i, e in enumerate(doc["run"]):
            if isinstance(e, dict) and "reseed" in e and maybe(draw, 0.7):
                part = {"module": draw(st.sampled_from(attrs))} if attrs and maybe(draw, 0.7) else {}
                policy = {"policy": "match_shape"} if not OLD and maybe(draw, 0.85 if stacked else 0.4) else {}
                if part or policy:
                    doc["run"][i] = {"reseed": {"streams": e["reseed"], **part, **policy}}
    keepers = [""] if model.get("keep_rngs") else []
    keepers += [
        s["module"]["name"]
        for s in model.get("init", [])
        if isinstance(s, dict) and s.get("module", {}).get("keep_rngs") and "stack" not in s["module"]
    ]
    if keepers and "run" in doc and maybe(draw, 0.4):
        # a training step drawing from the Rngs the model keeps, outside its call (model.rngs.noise()), or one a
        # module of it keeps (model.enc.rngs.noise(): `from:`)
        for _ in range(draw(st.integers(1, 3))):
            first = 1 if doc["run"][:1] == ["lazy_init"] else 0
            at = draw(st.integers(first, len(doc["run"])))
            stream = draw(st.sampled_from(STREAMS))
            keeper = draw(st.sampled_from(keepers))
            if not keeper:
                made = {"draw": stream} if maybe(draw, 0.7) else {"draw": {"stream": stream, "repeat": 2}}
            else:
                made = {"draw": {"stream": stream, "from": keeper, **({"repeat": 2} if maybe(draw, 0.3) else {})}}
            doc["run"].insert(at, made)
    steps = doc.get("steps", 1) if "run" not in doc else doc["run"].count("call")
    if "call_rngs" in doc and steps and maybe(draw, 0.5):
        # an Rngs made for each step, model(x, rngs=nnx.Rngs(dropout=fold_in(key, step))): the same streams, a
        # key a step (small seeds: steps given the same key too)
        # (`null`: a step whose call is given none, an eval call model(x): layers called as with rngs=None)
        doc["call_rngs"] = [
            None
            if maybe(draw, 0.15)
            else {s: draw(st.one_of(st.integers(0, 2), st.just(f"fold_in(key(1), {i})"))) for s in doc["call_rngs"]}
            for i in range(steps)
        ]
    return yaml.safe_dump(doc, sort_keys=False)


@st.composite
def run_event(draw, lanes_ok: bool, bridge: bool = False, recurrent: bool = False):
    kinds = ("call", "call", "stale_call", "reseed", "mode") + (("reseed",) if recurrent else ())
    kind = draw(st.sampled_from(kinds + (() if bridge else ("transformed",))))
    if kind == "reseed":
        asked = ASKED + (("carry", "carry", "recurrent_dropout") if recurrent else ())
        names = draw(st.lists(st.sampled_from(asked), unique=True, min_size=1, max_size=3))
        return {"reseed": {s: draw(st.integers(0, 5)) for s in names}}
    if kind == "mode":
        return draw(st.sampled_from(("train", "eval")))  # model.train() / model.eval()
    if kind == "transformed":
        fork = {"fork_rngs": fork_rngs(draw)} if has("fork_rngs") and maybe(draw, 0.25) else {}
        return {"call": {"n": draw(st.integers(1, 2)), **transform(draw, lanes_ok), **fork}}
    if kind == "call" and has("fork_rngs") and maybe(draw, 0.15):
        return {"call": {"n": draw(st.integers(1, 2)), "fork_rngs": fork_rngs(draw)}}
    return kind if maybe(draw, 0.6) else {kind: draw(st.integers(1, 2))}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nnx_specs())
def test_random_nnx_models_match_nnx(text):
    spec = parse_spec(text, "<hypothesis>")
    try:
        derive(spec)
    except FlaxError:
        pass  # (compared with NNX's error below)
    except SpecError as e:
        # unsafe_rbg keys drawn in nnx.vmap lanes: refused (tests/engine/test_rbg_lanes.py), nothing to compare
        assert "unsafe_rbg keys drawn inside a vmap" in str(e), e
        event("refused: unsafe_rbg in lanes")
        reject()
    result = check_against_nnx(spec)
    event(f"nnx raises {result['error']}" if "error" in result else "keys" if result["keys"] else "no keys")
    for word in (
        "stack:",
        "vmap:",
        "scan:",
        "split:",
        "broadcast:",
        "cond:",
        "switch:",
        "_loop:",
        "fork_rngs:",
        "ToNNX:",
        "key:",
        "rngs: split",
        "rngs: broadcast",
        "rngs: call",
        "rngs: model",
        "call_rngs:",
        "only:",
        "RNN:",
        "length:",
        "initial_carry:",
        "carry_draws:",
        "carry_init:",
    ):
        if word in text:
            event(f"has {word[:-1]}")
    if spec.call_rngs_steps is not None:
        event("an Rngs made for each step")
    if any(isinstance(e, NnxRunDraw) for e in spec.run):
        event("a step's draw from the model's Rngs")
    if "from:" in text:
        event("a draw from a submodule's kept Rngs")
    if spec.call_rngs_steps is not None and None in spec.call_rngs_steps:
        event("a step given no Rngs")
    given_mode = [st.deterministic for st in _calls(spec.model) if st.deterministic is not None]
    if given_mode:
        modes = any(isinstance(e, NnxMode) for e in spec.run)
        event(f"a call given deterministic={given_mode[0]}" + (" (and train/eval)" if modes else ""))
    if any(isinstance(e, NnxReseed) and any(s == "carry" for s, _ in e.streams) for e in spec.run):
        event("reseeds carry")
