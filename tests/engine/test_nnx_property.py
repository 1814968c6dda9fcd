"""Random NNX models, written as NNX spec YAML, derived by rngaudit and built in real Flax NNX: the same keys.

Each example draws a tree of user modules whose __init__ builds standard layers (every option that changes
what they draw), Dropout and attention (which fork their stream), submodules given the caller's Rngs or
`rngs.fork()`, and `rngs.<stream>()` draws (streams that exist, fall back to `default`, or do not exist); whose
__call__ calls those layers and submodules (some more than once) and draws from a kept Rngs; then calls the
model several times (`steps`), or runs calls, stale jitted steps and nnx.reseed events (`run`). Every key NNX hands out (construction and each step) must be derive's, in order, or both
must raise the same error. RNGAUDIT_NNX_EXAMPLES sets how many (default 40, a fixed set)."""

from __future__ import annotations

import os

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from nnx_oracle import check_against_nnx

from rngaudit import parse_spec

EXAMPLES = int(os.environ.get("RNGAUDIT_NNX_EXAMPLES", "40"))
STREAMS = ("params", "dropout", "noise", "default")
ASKED = STREAMS + ("other",)  # a stream no Rngs has: falls back to default, or fails
WIDTH = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}


def maybe(draw, p: float) -> bool:
    return draw(st.floats(0, 1)) < p


@st.composite
def layer(draw):
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
                "InstanceNorm",
                "RMSNorm",
                "Dropout",
                "Dropout",
                "MultiHeadAttention",
            )
        )
    )
    o: dict = {}
    flag = lambda: draw(st.booleans())
    if kind in ("Linear", "LinearGeneral", "Conv", "ConvTranspose"):
        if maybe(draw, 0.4):
            o["use_bias"] = flag()
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
    elif kind == "MultiHeadAttention":
        o["dropout_rate"] = draw(st.sampled_from((0.0, 0.5)))
        for k in ("use_bias", "normalize_qk"):
            if maybe(draw, 0.3):
                o[k] = flag()
        if maybe(draw, 0.15):
            o["keep_rngs"] = False
        if maybe(draw, 0.2):
            o["deterministic"] = True
    return kind, o


def rng_draw(draw):
    stream = draw(st.sampled_from(ASKED))
    if maybe(draw, 0.25):
        return {"draw": {"stream": stream, "repeat": draw(st.integers(1, 3))}}
    return {"draw": stream}


@st.composite
def module(draw, depth: int, n: list):
    n[0] += 1
    mod: dict = {"class": f"M{n[0]}"}
    keep = maybe(draw, 0.3)
    if keep:
        mod["keep_rngs"] = True
    init, names = [], []
    for i in range(draw(st.integers(1 if depth == 2 else 0, 5))):
        what = draw(st.sampled_from(("layer", "layer", "layer", "draw") + (("module",) if depth > 0 else ())))
        name = f"a{i}"
        if what == "layer":
            kind, o = draw(layer())
            init.append({kind: {"name": name, **o}})
            names.append(name)
        elif what == "module":
            child = draw(module(depth - 1, n))
            child["name"] = name
            if maybe(draw, 0.4):
                child["rngs"] = "fork"
            init.append({"module": child})
            names.append(name)
        else:
            init.append(rng_draw(draw))
    call = []
    for _ in range(draw(st.integers(1 if depth == 2 else 0, 4))):
        if names and (not keep or maybe(draw, 0.7)):
            target = draw(st.sampled_from(names))
            call.append({"call": target} if maybe(draw, 0.8) else {"call": {"name": target, "repeat": 2}})
        elif keep:
            call.append(rng_draw(draw))
    if init:
        mod["init"] = init
    if call:
        mod["call"] = call
    return mod


@st.composite
def nnx_specs(draw) -> str:
    impl = draw(st.sampled_from(("threefry2x32",) * 5 + ("rbg",)))
    streams = draw(st.lists(st.sampled_from(STREAMS), unique=True, max_size=4))
    if maybe(draw, 0.6) and "params" not in streams:
        streams.insert(0, "params")
    doc = {
        "rngaudit": 1,
        "flavour": "nnx",
        "jax": {"prng_impl": impl, "threefry_partitionable": draw(st.booleans())},
        "rngs": {s: draw(st.one_of(st.integers(0, 5), st.integers(0, 2**63 - 1))) for s in streams},
        "model": draw(module(2, [0])),
    }
    if maybe(draw, 0.5):
        doc["steps"] = draw(st.integers(0, 3))
    else:
        doc["run"] = draw(st.lists(run_event(), min_size=1, max_size=5))
    return yaml.safe_dump(doc, sort_keys=False)


@st.composite
def run_event(draw):
    kind = draw(st.sampled_from(("call", "call", "stale_call", "reseed")))
    if kind == "reseed":
        names = draw(st.lists(st.sampled_from(ASKED), unique=True, min_size=1, max_size=3))
        return {"reseed": {s: draw(st.integers(0, 5)) for s in names}}
    return kind if maybe(draw, 0.6) else {kind: draw(st.integers(1, 2))}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nnx_specs())
def test_random_nnx_models_match_nnx(text):
    result = check_against_nnx(parse_spec(text, "<hypothesis>"))
    event(f"nnx raises {result['error']}" if "error" in result else "keys" if result["keys"] else "no keys")
