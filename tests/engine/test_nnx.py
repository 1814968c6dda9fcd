"""derive of NNX specs (`flavour: nnx`) against real Flax NNX: the constructs of the NNX "Randomness" guide
(../shared/seeds, 003) and of FLAX_NNX_RULES.md, each built in real NNX by tests/nnx_oracle.py and compared key
for key. Where a test names a relation (two keys equal or not), it is between keys real NNX handed out."""

from __future__ import annotations

import json
import textwrap

import pytest
from nnx_oracle import check_against_nnx, nnx_keys
from support import REPO, invoke, write

from rngaudit import FlaxError, SpecError, UsageError, derive, parse_spec
from rngaudit.collision.nnx import NNX_FAILING

NNX_GUIDE = REPO / "rngaudit" / "examples" / "nnx_guide.yaml"

MODEL = """
  class: Model
  init:
    - Linear: {name: linear}
    - Dropout: {name: drop, rate: 0.1}
  call:
    - call: drop
"""


def spec_of(text: str):
    return parse_spec(textwrap.dedent(text))


def agree(text: str) -> dict:
    return check_against_nnx(spec_of(text))


def keys_at(report, site: str) -> list:
    return [c.key for c in report.calls if c.derivation.site == site]


def test_the_guides_model_streams_and_counts():
    """Rngs(params=0, dropout=1); Linear then Dropout in __init__; the Dropout draws on every call."""
    text = f"rngaudit: 1\nflavour: nnx\nrngs: {{params: 0, dropout: 1}}\nsteps: 3\nmodel:{MODEL}"
    assert agree(text) == {"keys": 2 + 1 + 3, "values": 0}
    r = derive(spec_of(text))
    drops = [c.derivation for c in r.calls if c.derivation.site == "drop" and c.derivation.kind == "dropout"]
    assert [d.count for d in drops] == [0, 1, 2]
    assert drops[0].chain == ("key 1", "fold_in 0 (Dropout fork at drop)")


def test_the_bundled_nnx_example_matches_nnx():
    from rngaudit import load_spec

    result = check_against_nnx(load_spec(str(NNX_GUIDE)))
    assert result["keys"] > 10


def test_default_stream_serves_missing_streams_with_one_counter():
    """The guide's Rngs(0, params=1): params() from its own stream, dropout() and rngs() from `default`, whose
    counter they share; the Model built from that Rngs forks its Dropout from `default` too."""
    text = """
        rngaudit: 1
        flavour: nnx
        rngs: {default: 0, params: 1}
        steps: 1
        model:
          class: Root
          init:
            - draw: params
            - draw: dropout
            - draw: default
            - module:
                name: model
                class: Model
                init: [{Linear: {name: linear}}, {Dropout: {name: drop, rate: 0.1}}]
                call: [{call: drop}]
          call: [{call: model}]
        """
    agree(text)
    r = derive(spec_of(text))
    d = [c.derivation for c in r.calls]
    assert [(x.requested, x.tag, x.count) for x in d[:3]] == [
        ("params", "params", 0),
        ("dropout", "default", 0),
        ("default", "default", 1),
    ]
    # the root's dropout(), the Dropout's fork, and its call (its own stream, forked from `default`)
    assert r.fallbacks == 3
    fork = next(x for x in d if x.kind == "fork")
    assert (fork.tag, fork.count) == ("default", 2)


def test_reseed_gives_the_first_calls_mask_again():
    """The guide: y1 != y2, then nnx.reseed(model, dropout=1) and y3 == y1 (the Dropout's stream is back at
    the key it forked at construction, count 0)."""
    text = f"""rngaudit: 1
flavour: nnx
rngs: {{params: 0, dropout: 1}}
run: [call, call, {{reseed: {{dropout: 1}}}}, call]
model:{MODEL}"""
    agree(text)
    y = keys_at(derive(spec_of(text)), "drop")[1:]  # (the first is the fork at construction)
    assert y[0] != y[1] and y[2] == y[0]


def test_reseed_follows_sorted_attribute_order_not_construction_order():
    """FLAX_NNX_RULES §6: zeta is built first, alpha second; reseed visits alpha first, so with the
    construction seed the two Dropouts swap keys."""
    text = """
        rngaudit: 1
        flavour: nnx
        rngs: {dropout: 1}
        run: [call, {reseed: {dropout: 1}}, call]
        model:
          class: Two
          init: [{Dropout: {name: zeta, rate: 0.5}}, {Dropout: {name: alpha, rate: 0.5}}]
          call: [{call: zeta}, {call: alpha}]
        """
    agree(text)
    r = derive(spec_of(text))
    zeta, alpha = keys_at(r, "zeta"), keys_at(r, "alpha")
    assert zeta[2] == alpha[1] and alpha[2] == zeta[1]  # step 2's keys are step 1's, swapped


def test_train_and_eval_modes_switch_every_dropout_and_attention_layer():
    """model.eval() sets `deterministic` on every Dropout and attention layer (a Dropout built deterministic
    included, then model.train() makes it draw): calls in eval mode draw nothing, and the counts carry on."""
    text = """
        rngaudit: 1
        flavour: nnx
        rngs: {params: 0, dropout: 1}
        run: [call, eval, call: 2, train, call, {reseed: {dropout: 1}}, eval, {stale_call: 1}, train, call]
        model:
          class: Net
          init:
            - Dropout: {name: drop, rate: 0.5}
            - Dropout: {name: still, rate: 0.5, deterministic: true}
            - MultiHeadAttention: {name: att, dropout_rate: 0.1}
            - module:
                name: block
                class: Block
                init: [{Dropout: {name: drop, rate: 0.3}}]
                call: [{call: drop}]
          call: [{call: drop}, {call: still}, {call: att}, {call: block}]
        """
    agree(text)
    r = derive(spec_of(text))
    steps = lambda site: [c.derivation.step for c in r.calls if c.derivation.site == site and c.derivation.step]
    # calls 1-6: train, eval, eval, train, a stale step in eval mode, train
    assert steps("drop") == steps("att") == steps("block.drop") == [1, 4, 6]
    assert steps("still") == [4, 6]  # (built deterministic: model.train() makes it draw)


def test_a_calls_own_deterministic_wins_over_train_and_eval():
    """Dropout/attention `__call__(x, deterministic=...)`: first_from(deterministic, self.deterministic) (the
    call's argument before the attribute model.train()/eval() set), under nnx.vmap lanes and fork_rngs too."""
    text = """
        rngaudit: 1
        flavour: nnx
        rngs: {params: 0, dropout: 1}
        run: [call, eval, call, train, call]
        model:
          class: Net
          init:
            - Dropout: {name: mc, rate: 0.5}
            - Dropout: {name: drop, rate: 0.5}
            - MultiHeadAttention: {name: att, dropout_rate: 0.1}
            - Dropout: {name: lanes, rate: 0.5, deterministic: true}
          call:
            - call: {name: mc, deterministic: false}
            - call: drop
            - call: {name: att, deterministic: true}
            - call: {name: drop, deterministic: false, fork_rngs: true}
            - call: {name: lanes, vmap: 2, split: dropout, deterministic: false}
        """
    agree(text)
    r = derive(spec_of(text))
    steps = lambda site: [
        c.derivation.step
        for c in r.calls
        if c.derivation.site == site and c.derivation.step and c.derivation.kind in ("dropout", "attention_dropout")
    ]
    assert steps("mc") == [1, 2, 3] and steps("att") == []
    assert steps("lanes") == [1, 1, 2, 2, 3, 3]  # (two lanes a call, eval included)
    # drop: the plain call in train mode only, the forked call with deterministic=False at every step
    assert sorted(steps("drop")) == [1, 1, 2, 3, 3]


def test_a_stale_jitted_step_draws_the_same_key_every_step():
    """FLAX_NNX_RULES §5: a pure jax.jit step fed the old state (its returned state dropped) repeats the mask."""
    text = f"""rngaudit: 1
flavour: nnx
rngs: {{params: 0, dropout: 1}}
run: [{{stale_call: 3}}, call, call]
model:{MODEL}"""
    agree(text)
    y = keys_at(derive(spec_of(text)), "drop")[1:]
    assert y[0] == y[1] == y[2] == y[3] != y[4]


@pytest.mark.parametrize(
    "layer, params",
    [
        ("Linear", 2),
        ("{Linear: {use_bias: false}}", 1),
        ("Conv", 2),
        ("Embed", 1),
        ("LayerNorm", 2),
        ("{LayerNorm: {use_bias: false}}", 1),
        ("RMSNorm", 1),
        ("BatchNorm", 2),
        ("GroupNorm", 2),
        ("{MultiHeadAttention: {dropout_rate: 0.1}}", 8),
        ("{MultiHeadAttention: {normalize_qk: true}}", 10),
        ("LoRALinear", 4),  # Linear's kernel and bias, then its nnx.LoRA's lora_a and lora_b
        ("{LoRALinear: {use_bias: false}}", 3),
        ("LoRA", 2),
        ("{LoRA: {base_module: Linear}}", 4),  # the base layer (an argument) first
        ("{LoRA: {base_module: {Conv: {use_bias: false}}}}", 3),
    ],
)
def test_layer_key_orders(layer, params):
    """FLAX_NNX_RULES §3: how many params keys each layer draws, in order (and attention's dropout fork)."""
    text = f"""
        rngaudit: 1
        flavour: nnx
        rngs: {{params: 0, dropout: 1}}
        steps: 0
        model: {{class: M, init: [{layer}]}}
        """
    agree(text)
    assert sum(1 for c in derive(spec_of(text)).calls if c.derivation.tag == "params") == params


def test_a_forked_rngs_per_submodule():
    """rngs.fork() draws one key from every stream for the submodule; the parent's counts go on."""
    agree("""
        rngaudit: 1
        flavour: nnx
        rngs: {params: 0, dropout: 1}
        model:
          class: M
          init:
            - Linear: {name: a}
            - module: {name: b, class: B, rngs: fork, init: [Linear, {Dropout: {rate: 0.5}}], call: [{call: dropout_0}]}
            - Linear: {name: c}
          call: [{call: b}]
        """)


# ---------------------------------------------------------------- errors, as NNX raises them
@pytest.mark.parametrize(
    "init, error",
    [
        ("[Linear]", "AttributeError"),  # no params, no default: rngs.params()
        ("[{Dropout: {rate: 0.5}}]", "KeyError"),  # rngs['dropout'] at construction
        ("[{draw: noise}]", "AttributeError"),
        ("[{MultiHeadAttention: {dropout_rate: 0.5}}]", "AttributeError"),
    ],
)
def test_a_stream_that_does_not_exist(init, error):
    text = f"""
        rngaudit: 1
        flavour: nnx
        rngs: {{noise_only: 0}}
        model: {{class: M, init: {init}}}
        """
    assert agree(text) == {"error": error}
    with pytest.raises(FlaxError, match="No RngStream named"):
        derive(spec_of(text))


def test_attention_without_kept_rngs_needs_call_time_rngs():
    assert agree("""
        rngaudit: 1
        flavour: nnx
        rngs: {params: 0, dropout: 1}
        model:
          class: M
          init: [{MultiHeadAttention: {name: attn, dropout_rate: 0.5, keep_rngs: false}}]
          call: [{call: attn}]
        """) == {"error": "ValueError"}


def test_the_oracle_sees_keys_as_nnx_hands_them_out():
    """The oracle itself: Dropout's fork key and first mask key are those FLAX_NNX_RULES §4 printed."""
    spec = spec_of(f"rngaudit: 1\nflavour: nnx\nrngs: {{params: 0, dropout: 1}}\nsteps: 1\nmodel:{MODEL}")
    keys = nnx_keys(spec)
    assert keys[2]["key"] == (507451445, 1853169794)  # fold_in(key(1), 0), the fork
    assert keys[3]["key"] == (3704974950, 1863054868)  # fold_in(fold_in(key(1), 0), 0), call 0


# ---------------------------------------------------------------- bad input: one error line, exit 2
@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {class: M, body: [make_rng]}", "`body:` is a Linen statement"),
        ("model: {class: M, init: [{make_rng: params}]}", "`make_rng:` is a Linen statement"),
        ("phase: apply\nmodel: {class: M}", "`phase:` is a Linen statement"),
        ("model: {class: M, init: [{Dense: {}}]}", "unknown statement 'Dense'"),
        ("model: {class: M, call: [{call: nope}]}", "builds no attribute 'nope'"),
        ("model: {class: M, call: [{draw: params}]}", "add `keep_rngs: true`"),
        ("model: {class: M, init: [{Dropout: {}}]}", "`Dropout` needs `rate`"),
        ("model: {class: M, init: [{Dropout: {rate: 2}}]}", "from 0 to 1"),
        ("run: [walk]\nmodel: {class: M}", "unknown event 'walk'"),
        ("run: [{eval: 2}]\nmodel: {class: M}", "`eval` takes nothing: it is model.eval"),
        ("run: [evaluate]\nmodel: {class: M}", "did you mean 'eval'"),
        ("steps: 2\nrun: [call]\nmodel: {class: M}", "not both"),
        ("model: {class: M, init: [Linear, {Linear: {name: linear_0}}]}", "assigned twice"),
        ("model: {class: M, init: [{LoRA: {base_module: Dropout}}]}", "not 'Dropout'; rngaudit does not model"),
        ("model: {class: M, init: [{LoRA: {base_module: {module: {class: B}}}}]}", "not 'module'; rngaudit"),
        ("model: {class: M, init: [{LoRA: {base_module: Lineer}}]}", "did you mean 'Linear'"),
        ("model: {class: M, init: [{LoRA: {base_module: [Linear]}}]}", "is one standard layer"),
        ("model: {class: M, init: [{LoRA: {base_module: {Linear: {name: b}}}}]}", "drop `name:`"),
        ('flax: {version: "0.11.0"}\nmodel: {class: M, init: [LoRALinear]}', "models nnx.LoRALinear with the rules"),
    ],
)
def test_bad_nnx_specs(tmp_path, text, message):
    path = write(tmp_path, "bad.yaml", f"rngaudit: 1\nflavour: nnx\nrngs: {{params: 0}}\n{text}\n")
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace("`", "`")):
        derive(path)
    out = tmp_path / "out.json"
    r = invoke("derive", path, "-f", "json", "-o", out)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {path}:") and len(r.stderr.splitlines()) == 1
    assert not out.exists()


def test_nnx_statements_in_a_linen_spec(tmp_path):
    path = write(tmp_path, "l.yaml", "rngaudit: 1\nmodel: {class: M, init: [Linear]}\n")
    r = invoke("derive", path)
    assert r.exit_code == 2 and "add `flavour: nnx`" in r.stderr


def test_commands_that_read_linen_specs_say_so(tmp_path):
    r = invoke("shard-check", "--devices", "0", NNX_GUIDE)
    assert r.exit_code == 2 and "reads Linen specs" in r.stderr and "flavour: nnx" in r.stderr
    r = invoke("diff", NNX_GUIDE, NNX_GUIDE)
    assert r.exit_code == 0 and "0 changed, 0 new, 0 gone" in r.stdout
    r = invoke("diff", NNX_GUIDE, REPO / "rngaudit" / "examples" / "guide.yaml")
    assert r.exit_code == 2 and "both Linen, or both NNX" in r.stderr
    with pytest.raises(UsageError, match="--phase applies to Linen specs"):
        derive(NNX_GUIDE, phase="apply")


# ---------------------------------------------------------------- the command
def test_derive_prints_and_writes_nnx_keys(tmp_path):
    r = invoke("derive", NNX_GUIDE)
    assert r.exit_code == 0 and "flavour=nnx" in r.stdout and "Dropout fork at" in r.stdout
    assert "rules: flax>=0.11" in r.stdout
    out = tmp_path / "k.json"
    assert invoke("derive", NNX_GUIDE, "-f", "json", "-o", out).exit_code == 0
    doc = json.loads(out.read_text())
    assert doc["flavour"] == "nnx" and doc["rules"].startswith("flax>=0.11")
    ours = derive(NNX_GUIDE)
    assert [c["key"] for c in doc["calls"]] == [list(c.key) for c in ours.calls]
    lines = invoke("derive", NNX_GUIDE, "-f", "jsonl").stdout.splitlines()
    assert json.loads(lines[0])["record"] == "header" and len(lines) == len(ours.calls) + 2


def test_strict_finds_the_default_fallback(tmp_path):
    path = write(
        tmp_path,
        "d.yaml",
        "rngaudit: 1\nflavour: nnx\nrngs: {default: 0, params: 1}\nmodel: {class: M, init: [{Dropout: {rate: 0.5}}]}\n",
    )
    assert invoke("derive", path).exit_code == 0
    r = invoke("derive", path, "--strict", "-f", "github")
    assert r.exit_code == 1 and "served by 'default'" in r.stdout


def test_collisions_says_a_default_fallback_once_a_stream_with_its_statements(tmp_path):
    """nnx.Rngs(0), Flax's own idiom, gave one INFO block per statement (20 for a 4-block model); the text report
    says each stream once and lists the statements (JSON and annotations keep one finding a statement: a Linear's
    kernel and bias are one)."""
    blocks = "".join(
        f"    - module: {{name: b{i}, class: B, init: [Linear: {{name: l}}, Dropout: {{name: d, rate: 0.5}}]}}\n"
        for i in range(3)
    )
    path = write(
        tmp_path, "d.yaml", f"rngaudit: 1\nflavour: nnx\nrngs: {{default: 0}}\nmodel:\n  class: M\n  init:\n{blocks}"
    )
    r = invoke("collisions", path)
    assert r.exit_code == 0, r.stdout + r.stderr
    heads = [ln for ln in r.stdout.splitlines() if ln.startswith("INFO")]
    assert heads == [
        "INFO  default_fallback: stream params is served by 'default' at 3 statements",
        "INFO  default_fallback: stream dropout is served by 'default' at 3 statements",
    ], r.stdout
    assert r.stdout.count("why ") == 2 and "b2.l.kernel" in r.stdout and r.stdout.endswith("0 failing, 6 information\n")
    doc = json.loads(invoke("collisions", path, "-f", "json").stdout)
    assert len([c for f in doc["inputs"] for c in f["collisions"] if c["category"] == "default_fallback"]) == 6


# ---------------------------------------------------------------- collisions of NNX specs
def _audit(text: str):
    from rngaudit.api import audit_input

    return audit_input(spec_of(text))


LINEAR_DROP = "model: {class: M, init: [Linear, {Dropout: {name: d, rate: 0.5}}], call: [{call: d}]}"


@pytest.mark.parametrize(
    "category, broken, fixed",
    [
        (
            "shared_stream_key",
            f"rngs: {{params: 0, dropout: 0}}\n{LINEAR_DROP}",
            f"rngs: {{params: 0, dropout: 1}}\n{LINEAR_DROP}",
        ),
        (
            "count_rewind",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{stale_call: 2}}]\n{LINEAR_DROP}",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{call: 2}}]\n{LINEAR_DROP}",
        ),
        (
            "reseed_order",
            (
                "rngs: {dropout: 1}\nrun: [call, {reseed: {dropout: 1}}, call]\n"
                "model: {class: Two, init: [{Dropout: {name: zeta, rate: 0.5}}, {Dropout: {name: alpha, rate: 0.5}}],"
                " call: [{call: zeta}, {call: alpha}]}"
            ),
            (
                "rngs: {dropout: 1}\nrun: [call, {reseed: {dropout: 7}}, call]\n"
                "model: {class: Two, init: [{Dropout: {name: zeta, rate: 0.5}}, {Dropout: {name: alpha, rate: 0.5}}],"
                " call: [{call: zeta}, {call: alpha}]}"
            ),
        ),
        (
            "reseed_repeat",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [call, call, {{reseed: {{dropout: 1}}}}, call]\n{LINEAR_DROP}",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [call, call, {{reseed: {{dropout: 9}}}}, call]\n{LINEAR_DROP}",
        ),
        (
            "broadcast_lanes",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{call: {{vmap: 4}}}}]\n{LINEAR_DROP}",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{call: {{vmap: 4, split: dropout}}}}]\n{LINEAR_DROP}",
        ),
        (
            "frozen_scan_broadcast",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{call: {{n: 2, scan: 3, broadcast: dropout}}}}]\n{LINEAR_DROP}",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{call: {{n: 2, scan: 3}}}}]\n{LINEAR_DROP}",
        ),
        (
            "scan_broadcast",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{call: {{scan: 3, broadcast: dropout}}}}]\n{LINEAR_DROP}",
            f"rngs: {{params: 0, dropout: 1}}\nrun: [{{call: {{scan: 3}}}}]\n{LINEAR_DROP}",
        ),
        (
            "default_fallback",
            f"rngs: {{default: 0, params: 1}}\n{LINEAR_DROP}",
            f"rngs: {{default: 0, params: 1, dropout: 2}}\n{LINEAR_DROP}",
        ),
    ],
)
def test_each_nnx_collision_class_is_caught_and_absent_when_fixed(category, broken, fixed):
    head = "rngaudit: 1\nflavour: nnx\n"
    for text, expect in ((broken, True), (fixed, False)):
        agree(head + text)  # the keys are real NNX's
        a = _audit(head + text)
        found = [c for c in a.collisions if c.category == category]
        assert bool(found) == expect, (text, [c.category for c in a.collisions])
        for c in found:
            if c.key is not None:
                assert len({s.key for s in c.sites}) == 1 and c.sites[0].key == c.key
                assert c.why and c.fix
    a = _audit(head + broken)
    assert a.failing == sum(1 for c in a.collisions if c.category in NNX_FAILING)


def test_nnx_collisions_keys_are_the_keys_nnx_hands_out():
    """Every site of every finding holds the key NNX handed out at that draw (the oracle's record)."""
    text = (NNX_GUIDE).read_text()
    spec = parse_spec(text, str(NNX_GUIDE))
    theirs = nnx_keys(spec)
    a = _audit(text)
    assert a.collisions
    for c in a.collisions:
        for s in c.sites:
            assert theirs[s.index]["key"] == s.key and theirs[s.index]["count"] == s.count


def test_collisions_command_on_nnx_specs(tmp_path):
    r = invoke("collisions", NNX_GUIDE)
    assert r.exit_code == 1 and "count_rewind" in r.stdout and "why" in r.stdout
    assert invoke("collisions", NNX_GUIDE, "--exit-zero").exit_code == 0
    doc = json.loads(invoke("collisions", NNX_GUIDE, "-f", "json").stdout)
    (inp,) = doc["inputs"]
    assert inp["flavour"] == "nnx" and {c["category"] for c in inp["collisions"]} == {"reseed_order", "count_rewind"}
    gh = invoke("collisions", NNX_GUIDE, "-f", "github").stdout
    assert "::error" in gh and "count_rewind" in gh
    sarif = json.loads(invoke("collisions", NNX_GUIDE, "-f", "sarif").stdout)
    assert any(r["ruleId"] == "collisions/count-rewind" for r in sarif["runs"][0]["results"])
    clean = write(tmp_path, "c.yaml", f"rngaudit: 1\nflavour: nnx\nrngs: {{params: 0, dropout: 1}}\n{LINEAR_DROP}\n")
    assert invoke("collisions", clean).exit_code == 0
    # --fail-on an information category makes it fail; a Linen and an NNX spec in one run
    assert invoke("collisions", NNX_GUIDE, "--fail-on", "reseed_order").exit_code == 1
    both = invoke("collisions", NNX_GUIDE, REPO / "rngaudit" / "examples" / "guide.yaml")
    assert both.exit_code == 1 and "total:" in both.stdout


@pytest.mark.parametrize("impl", ("threefry2x32", "rbg"))
def test_keyed_draws_the_first_values_now_and_the_rest_when_read(impl, monkeypatch):
    """derive(keyed=k) of an NNX spec draws the values of the first k keys (what the text report lists) and the
    others when first read: each is the whole report's (rbg lanes of an nnx.vmap stack drawn from lane 0 too)."""
    import numpy as np

    text = f"""
rngaudit: 1
flavour: nnx
jax: {{prng_impl: {impl}}}
rngs: {{params: 0, dropout: 1}}
run: [{{call: {{n: 2}}}}]
model:
  class: M
  init:
    - Linear: {{name: a}}
    - module: {{name: ens, class: E, stack: 3, init: [Linear, {{Dropout: {{name: d, rate: 0.5}}}}]}}
    - {{Dropout: {{name: d, rate: 0.5}}}}
  call: [{{call: d}}]
"""
    spec = parse_spec(text, "nnx.yaml")
    whole = derive(spec, draw="normal:2")
    n = len(whole.calls)
    assert len(whole.calls.values) >= 8
    for k in (0, 1, 5, n - 1, n, n + 3):
        report = derive(spec, draw="normal:2", keyed=k)
        early = report.calls.values_upto(k)
        assert sorted(early) == sorted(j for j in whole.calls.values if j < k)
        assert all(np.array_equal(v, whole.calls.values[j]) for j, v in early.items())
        for a, b in zip(report.calls, whole.calls, strict=True):
            assert a.key == b.key and (a.values is None) == (b.values is None)
            assert a.values is None or np.array_equal(a.values, b.values)
    # the first key's values are drawn, no other's
    from rngaudit.engine import draws

    made = []
    real = draws.draw_values_lanes  # (draw_values draws through it)
    monkeypatch.setattr(draws, "draw_values_lanes", lambda *a: made.append(a) or real(*a))
    derive(spec, draw="normal:2", keyed=1).calls.values_upto(1)
    assert len(made) == 1
