"""NNX inside Linen: `ToLinen` statements (`bridge.ToLinen(NnxClass)`) in Linen specs, against real Flax
(FLAX_NNX_RULES.md §14). Every call of a ToLinen module makes one Linen make_rng per stream of its scope's rngs (the
Linen oracle compares those with Scope.make_rng) and builds a new NNX module from their keys (plus a `default` of
key(0) at apply), whose every key is compared with what NNX's RngStreams hand out; random NNX modules inside random
Linen models too. RNGAUDIT_TO_LINEN_EXAMPLES sets how many random models (default 25, a fixed set)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import yaml
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st
from nnx_oracle import check_to_linen
from support import invoke, write

from engine.test_nnx_property import bridged, maybe, module, uses_call_rngs
from rngaudit import FlaxError, SpecError, collisions, derive, diff, parse_spec

EXAMPLES = int(os.environ.get("RNGAUDIT_TO_LINEN_EXAMPLES", "25"))

DROP = """
  class: NDrop
  init: [{Linear: {name: l}}, {Dropout: {name: d, rate: 0.5}}]
  call: [{call: l}, {call: d}]
"""
BLOCK = """
  class: Block
  keep_rngs: true
  init:
    - MultiHeadAttention: {name: attn, dropout_rate: 0.1}
    - LayerNorm: {name: norm}
    - module:
        name: mlp
        class: Mlp
        rngs: fork
        init: [{Linear: {name: up}}, {Dropout: {name: drop, rate: 0.1}}]
        call: [{call: up}, {call: drop}]
  call:
    - call: attn
    - call: mlp
    - draw: noise
"""


def linen(phase: str, rngs: str, nnx_module: str, body_extra: str = "") -> str:
    """A Linen spec whose model calls a named ToLinen twice, a Dense, then an unnamed ToLinen (auto-named
    ToLinen_0), of the NNX module given."""
    inner = textwrap.indent(textwrap.dedent(nnx_module).strip(), " " * 10)
    return (
        f"rngaudit: 1\nphase: {phase}\nrngs: {rngs}\nmodel:\n  class: Outer\n  body:\n"
        f"    - ToLinen:\n        name: t\n        module:\n{inner}\n"
        "    - call: t\n    - Dense: {features: 3}\n"
        f"    - ToLinen:\n        module:\n{inner}\n" + body_extra
    )


@pytest.mark.parametrize(
    "phase, rngs",
    [
        ("init", "{dropout: 1, params: 0, noise: 5}"),  # (the Rngs take the streams in the order init got them)
        ("apply", "{dropout: 2, noise: 3}"),
        ("apply", "{}"),  # ToLinen's default stream of key(0) serves every stream: the constant mask
        ("apply", "{default: 4, dropout: 2}"),  # a `default` the apply gives: no constant added
    ],
)
@pytest.mark.parametrize("nnx_module", [DROP, BLOCK], ids=["linear-dropout", "attention-block"])
def test_nnx_inside_linen_is_bit_exact(phase, rngs, nnx_module):
    got = check_to_linen(parse_spec(linen(phase, rngs, nnx_module)))
    assert got.get("runs") == 3 and got["nnx"] > 0, got


def test_init_without_a_stream_the_nnx_module_needs_is_flaxs_key_error(tmp_path):
    spec = parse_spec(linen("init", "{params: 0}", DROP))
    assert check_to_linen(spec) == {"error": "KeyError"}
    path = write(tmp_path, "spec.yaml", linen("init", "{params: 0}", DROP))
    r = invoke("derive", path)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "No RngStream named 'dropout' found in Rngs" in r.stderr and r.stdout == ""


@pytest.mark.parametrize(
    "body",
    [
        # inside a jitted and a rematerialised Linen module: make_rng under nn.jit forks its keys
        "    - module:\n        class: Wrap\n        transforms: [jit]\n        body: [{ToLinen: {module: %s}}]\n",
        "    - module:\n        class: Wrap\n        transforms: [remat]\n        body: [{ToLinen: {module: %s}}]\n",
        # built in setup (self.enc = bridge.ToLinen(...)) and called twice
        (
            "    - module:\n        class: Wrap\n        setup: [{ToLinen: {name: enc, module: %s}}]\n"
            "        body: [{call: enc}, {call: enc}]\n"
        ),
    ],
    ids=["jit", "remat", "setup"],
)
def test_to_linen_under_linen_transforms_and_in_setup(body):
    inner = json.dumps(yaml.safe_load(DROP))
    got = check_to_linen(parse_spec(linen("apply", "{dropout: 2}", DROP, body % inner)))
    assert got.get("runs", 0) >= 4, got


LANES = [
    # an ensemble of NNX modules: nn.vmap over ToLinen, params and dropout split per lane (or dropout not split:
    # every lane the same make_rng key, so the same NNX keys)
    (
        "    - vmap:\n        axis_size: 3\n        variable_axes: {params: 0}\n        split_rngs: {params: true, dropout: %s}\n"
        "        module: {class: Ens, body: [{ToLinen: {module: %s}}]}\n"
    ),
    # scan over NNX layers: nn.scan of a ToLinen, params split per step
    (
        "    - scan:\n        length: 2\n        variable_axes: {params: 0}\n        split_rngs: {params: true, dropout: %s}\n"
        "        module: {class: Stack, body: [{ToLinen: {module: %s}}]}\n"
    ),
]


@pytest.mark.parametrize("phase", ["init", "apply"])
@pytest.mark.parametrize("split", ["true", "false"])
@pytest.mark.parametrize("body", LANES, ids=["vmap", "scan"])
def test_to_linen_inside_linen_lanes_is_bit_exact(body, split, phase):
    inner = json.dumps(yaml.safe_load(DROP))
    head = f"rngaudit: 1\nphase: {phase}\nrngs: {{params: 0, dropout: 2}}\nmodel:\n  class: Outer\n  body:\n"
    text = head + body % (split, inner)
    got = check_to_linen(parse_spec(text))
    lanes = 3 if "vmap" in body else 2
    # (nn.scan runs its body once more in a trace whose Linen keys it throws away: the NNX module still draws
    # from the keys that exist there, a broadcast dropout's; real Flax's RngStreams hand those out too)
    thrown = 1 if "scan" in body and split == "false" else 0
    assert got.get("runs") == lanes + thrown, got
    runs = [r for r in derive(parse_spec(text)).to_linen if not r.site.discarded]
    assert [r.lane for r in runs] == [(i,) for i in range(lanes)]
    masks = {tuple(c.key) for r in runs for c in r.report.calls if c.derivation.step == 1}
    assert len(masks) == (lanes if split == "true" else 1)  # (unsplit: every lane draws the same mask)


@pytest.mark.parametrize(
    "inner, expected",
    [("{class: Act}", {"linen": 1, "nnx": 0, "runs": 2}), ("{class: Lin, init: [{Linear: {name: l}}]}", None)],
)
def test_skip_rng_builds_the_module_without_rngs(inner, expected):
    """skip_rng=True: no make_rng, the module built from no Rngs (one that draws is NNX's error)."""
    text = (
        "rngaudit: 1\nphase: apply\nrngs: {dropout: 2}\nmodel:\n  class: Outer\n  body:\n"
        f"    - ToLinen: {{skip_rng: true, module: {inner}}}\n    - ToLinen: {{module: {inner}}}\n"
    )
    got = check_to_linen(parse_spec(text))
    if expected is None:
        assert got == {"error": "AttributeError"}
    else:
        assert got == expected
        assert [c.derivation.path for c in derive(parse_spec(text)).calls] == [("ToLinen_1",)]


# an NNX Dropout inside a Linen model, as the bridge guide writes it (a file capture reads, a module the tests run)
DROP_MODEL = """
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx
from flax.nnx import bridge


class NDrop(nnx.Module):
    def __init__(self, rngs):
        self.d = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.d(x)


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return bridge.ToLinen(NDrop)(x)


def make_model():
    return Outer(), (jnp.ones((1, 3)),)
"""


def _module(tmp_path, source: str):
    import importlib.util

    path = write(tmp_path, "drop_model.py", source)
    spec = importlib.util.spec_from_file_location("drop_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_constant_default_is_found_true_and_fixed(tmp_path):
    """bridge_constant_default: applied without `dropout`, real Flax draws the same mask at every apply; with a
    dropout key per apply the masks differ and the finding is gone."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    Outer = _module(tmp_path, DROP_MODEL).Outer
    x = jnp.ones((64,))
    v = Outer().init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    a, b = (np.asarray(Outer().apply(v, x)) for _ in range(2))
    assert (a == b).all() and not a.all()  # the same mask at every apply: the finding is true
    c, d = (np.asarray(Outer().apply(v, x, rngs={"dropout": jax.random.key(k)})) for k in (2, 3))
    assert not (c == d).all()

    model = "  class: NDrop\n  init: [{Dropout: {name: d, rate: 0.5}}]\n  call: [{call: d}]\n"
    bad = write(tmp_path, "bad.yaml", linen("apply", "{}", model))
    report = collisions(bad)
    found = [c for a in report.audits for c in a.collisions]
    assert [c.category for c in found] == ["bridge_constant_default"] * 3 and report.failing
    assert "without a 'dropout' rng" in found[0].why and "rngs={'dropout': key}" in found[0].fix
    r = invoke("collisions", bad, "-f", "github")
    assert r.exit_code == 1 and "collisions/bridge-constant-default" in r.stdout
    good = write(tmp_path, "good.yaml", linen("apply", "{dropout: 2}", model))
    fixed = collisions(good)
    assert not fixed.failing and not [c for a in fixed.audits for c in a.collisions]
    assert invoke("collisions", good).exit_code == 0


def test_derive_reports_the_nnx_keys_in_every_format(tmp_path):
    path = write(tmp_path, "spec.yaml", linen("apply", "{dropout: 2}", DROP))
    text = invoke("derive", path, "--wide")
    assert text.exit_code == 0
    assert "bridge.ToLinen at /t, call 2 (apply): the NNX module NDrop" in text.stdout
    assert "make_rng('dropout') at /t count 2" in text.stdout and "0 (ToLinen's default at apply)" in text.stdout
    doc = json.loads(invoke("derive", path, "-f", "json").stdout)
    runs = doc["to_linen"]
    assert [(r["path"], r["call"], r["phase"]) for r in runs] == [
        (["t"], 1, "apply"),
        (["t"], 2, "apply"),
        (
            ["ToLinen_0"],
            1,
            "apply",
        ),
    ]
    assert runs[0]["rngs"]["dropout"]["call"] == 0 and runs[0]["rngs"]["default"]["call"] is None
    report = derive(path)
    assert [c["key"] for c in runs[2]["calls"]] == [list(c.key) for c in report.to_linen[2].report.calls]
    lines = [json.loads(line) for line in invoke("derive", path, "-f", "jsonl").stdout.splitlines()]
    assert [r for r in lines if r["record"] == "to_linen"] == [{"record": "to_linen", **r} for r in runs]


@pytest.mark.parametrize(
    "text, message",
    [
        ("    - ToLinen: {name: t}\n", "ToLinen needs `module`"),
        ("    - ToLinen: NDrop\n", "`ToLinen` takes a mapping"),
        (
            "    - ToLinen: {module: {class: N, body: [{Dense: {features: 2}}]}}\n",
            "`body:` is a Linen statement, and this spec is `flavour: nnx`",
        ),
        ("    - ToLinen: {module: {class: N, init: [{Dense: {}}]}}\n", "unknown statement 'Dense' in `init` of N"),
        (
            (
                "    - ToLinen: {module: {class: N, init: [{Dropout: {name: d, rate: 0.5}}], "
                "call: [{call: {name: d, rngs: call}}]}}\n"
            ),
            "`rngs: call` gives a Dropout the Rngs the model's call is given",
        ),
        (
            "    - ToLinen: {module: {class: N, init: [{ToNNX: {name: e, module: {Dense: {features: 2}}}}]}}\n",
            "a bridge.ToNNX inside the NNX module of a ToLinen",
        ),
    ],
)
def test_bad_to_linen_statements_are_one_error_line(tmp_path, text, message):
    path = write(tmp_path, "spec.yaml", "rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n" + text)
    with pytest.raises(SpecError) as e:
        derive(path)
    assert message in str(e.value), str(e.value)
    r = invoke("derive", path)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {path}:") and len(r.stderr.splitlines()) == 1
    assert r.stdout == "" and message in r.stderr


def test_an_old_flax_release_is_refused(tmp_path):
    text = "rngaudit: 1\nflax: {version: 0.10.2}\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n"
    path = write(tmp_path, "spec.yaml", text + "    - ToLinen: {module: {class: N}}\n")
    r = invoke("derive", path)
    assert r.exit_code == 2 and "bridge.ToLinen with the NNX rules of flax 0.11 and later" in r.stderr


def test_an_nnx_spec_has_no_to_linen(tmp_path):
    from nnx_oracle import assert_one_error_line

    assert_one_error_line(
        tmp_path,
        "rngs: {params: 0}\nmodel:\n  class: M\n  init: [{ToLinen: {module: {class: N}}}]\n",
        "unknown statement 'ToLinen' in `init` of M",
    )


# ---------------------------------------------------------------- random NNX modules inside random Linen models
@st.composite
def to_linen_specs(draw) -> str:
    inner = draw(module(2, [0]))
    if bridged(inner) or uses_call_rngs(inner):
        reject()  # (a ToNNX inside a ToLinen, and an Rngs given to a call, are refused: not compared)
    # (mostly the streams a model is given: params, often dropout; sometimes none, or others)
    odds = {"params": 0.9, "dropout": 0.7, "noise": 0.2, "default": 0.2, "other": 0.1}
    streams = [s for s, p in odds.items() if maybe(draw, p)]
    phase = draw(st.sampled_from(("init", "apply")))
    body: list = []
    if draw(st.booleans()):
        body.append({"Dense": {"features": 2}})
    to_linen = {"module": inner}
    if draw(st.booleans()):
        to_linen["name"] = "enc"
    wrap = draw(st.sampled_from((None, None, "jit", "remat", "vmap", "scan")))
    if wrap is None:
        body.append({"ToLinen": to_linen})
    elif wrap in ("vmap", "scan"):
        # Linen lanes around the ToLinen: an ensemble (nn.vmap), a stack of layers (nn.scan)
        split = {s: draw(st.booleans()) for s in draw(st.lists(st.sampled_from(("params", "dropout")), unique=True))}
        size = {"axis_size" if wrap == "vmap" else "length": draw(st.integers(1, 3))}
        made = {"class": "Lanes", "body": [{"ToLinen": to_linen}]}
        body.append({wrap: {**size, "variable_axes": {"params": 0}, "split_rngs": split, "module": made}})
    else:
        body.append({"module": {"class": "Wrap", "transforms": [wrap], "body": [{"ToLinen": to_linen}]}})
    if "name" in to_linen and wrap is None and draw(st.booleans()):
        body.append({"call": "enc"})
    if draw(st.booleans()):
        body.append({"make_rng": draw(st.sampled_from(streams or ["params"]))})
    doc = {
        "rngaudit": 1,
        "jax": {"threefry_partitionable": draw(st.booleans())},
        "phase": phase,
        "rngs": {s: draw(st.integers(0, 5)) for s in streams},
        "model": {"class": "Outer", "body": body},
    }
    return yaml.safe_dump(doc, sort_keys=False)


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(to_linen_specs())
def test_random_nnx_modules_inside_linen_match_flax(text):
    spec = parse_spec(text, "<hypothesis>")
    try:
        derive(spec)
    except SpecError as e:
        # an NNX construct ToLinen's module may not hold inside Linen, refused with the reason
        event(f"refused: {str(e)[:60]}")
        reject()
    except FlaxError as e:
        event(f"flax raises {e.flax_error}")  # (compared with Flax's error below)
    result = check_to_linen(spec)
    event("error" if "error" in result else f"runs {result['runs']}")


def test_capture_of_a_linen_model_holding_a_to_linen_is_refused(tmp_path):
    """capture records Linen's keys: a spec without the NNX module's keys would pass for complete, so it refuses."""
    model = write(tmp_path, "model.py", DROP_MODEL)
    out = tmp_path / "spec.yaml"
    r = invoke("capture", f"{model}:make_model", "--rngs", "params=0,dropout=1", "-o", out)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and not out.exists()
    assert "/ToLinen_0 is a bridge.ToLinen" in r.stderr and "`ToLinen:` statement" in r.stderr


def test_diff_compares_the_nnx_keys_inside_each_call(tmp_path):
    """A Linear inserted before `l` in the NNX module's __init__: diff says which NNX keys of which ToLinen call
    moved, with NNX's count-shift explanation, and fails; the same spec on both sides is clean."""
    spec = linen("init", "{params: 0, dropout: 2}", DROP)
    old = write(tmp_path, "old.yaml", spec)
    new = write(tmp_path, "new.yaml", spec.replace("{Linear: {name: l}}", "{Linear: {name: z}}, {Linear: {name: l}}"))
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.stdout
    assert "CHANGED  /t (bridge.ToLinen call 2)/l/kernel  params count 0 -> 2" in r.stdout
    assert "count shift: l.kernel drew 'params' count 0 before and 2 now" in r.stdout
    report = diff(old, new)
    moved = {e.ident[0] for e in report.entries if e.status != "kept"}
    assert moved == {"/t (bridge.ToLinen call 1)", "/t (bridge.ToLinen call 2)", "/ToLinen_0 (bridge.ToLinen call 1)"}
    # the Linen keys (Dense_0, the make_rng of each call) are kept
    assert all(e.status == "kept" for e in report.entries if "bridge.ToLinen" not in e.ident[0])
    same = invoke("diff", old, old)
    assert same.exit_code == 0 and "0 changed, 0 new, 0 gone" in same.stdout


def test_no_keys_audits_no_nnx_module(tmp_path):
    """--no-keys computes no key data: the NNX modules of ToLinen calls (NNX keys) are left out, not guessed."""
    model = "  class: NDrop\n  init: [{Dropout: {name: d, rate: 0.5}}]\n  call: [{call: d}]\n"
    bad = write(tmp_path, "bad.yaml", linen("apply", "{}", model))
    assert [getattr(a, "bridge", "") for a in collisions(bad, keys=False).audits] == [""]
    assert invoke("collisions", bad, "--no-keys").exit_code == 0
