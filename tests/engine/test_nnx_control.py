"""NNX control flow and nnx.fork_rngs in NNX specs: `cond:`, `switch:`, `fori_loop:` and `while_loop:` in a
module's `call:` (nnx.cond / nnx.switch / nnx.fori_loop / nnx.while_loop over the module and the input), and
`call: {name: X, fork_rngs: ...}` / the run event `call: {fork_rngs: ...}` (`with nnx.fork_rngs(X, split={tags:
None}): X(x)`), against real Flax NNX (FLAX_NNX_RULES.md §8 and §12): every key derive prints is the key NNX
hands out; where a test names a relation between keys, it holds between the keys NNX handed out."""

from __future__ import annotations

import textwrap

import pytest
from nnx_oracle import NNX_HEAD as HEAD
from nnx_oracle import agree, nnx_keys
from nnx_oracle import nnx_spec as spec_of
from support import invoke, write

from rngaudit import FlaxError, SpecError, derive


def rows(text: str) -> list:
    return [c.derivation for c in derive(spec_of(text)).calls]


def keys_of(text: str) -> list[tuple]:
    return [tuple(c.key) for c in derive(spec_of(text)).calls]


# a Dropout, a submodule with its own Dropout, and a kept Rngs: what the branches and loop bodies below run
MODEL = """
rngs: {params: 0, dropout: 1, noise: 5}
steps: 2
model:
  class: Model
  keep_rngs: true
  init:
    - Linear: {name: linear}
    - Dropout: {name: drop, rate: 0.5}
    - module:
        name: block
        class: Block
        init: [{Linear: {name: linear}}, {Dropout: {name: drop, rate: 0.5}}]
        call: [{call: linear}, {call: drop}]
  call:
{call}
"""


def model(call: str, **replace: str) -> str:
    text = MODEL.replace("{call}", textwrap.indent(textwrap.dedent(call).strip("\n"), "    "))
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("pred", [True, False])
def test_cond_draws_only_in_the_branch_taken(pred):
    text = model(
        f"""
        - cond:
            pred: {str(pred).lower()}
            true_fun: [{{call: drop}}, {{call: block}}, {{draw: noise}}]
            false_fun: [{{draw: noise}}, {{draw: {{stream: noise, repeat: 2}}}}]
        - call: drop
        """
    )
    got = agree(text)
    # construction: 2 + 2 params, 2 Dropout forks; each call: the branch's 3 keys (either one) and drop's
    assert got["keys"] == 6 + 2 * (3 + 1)
    calls = [d for d in rows(text) if d.step == 1]
    if pred:
        assert [d.site for d in calls] == ["drop", "block.drop", "(root)", "drop"]
        assert [d.count for d in calls if d.site == "drop"] == [0, 1]
    else:
        # the branch not taken draws nothing: drop's count carries on from 0
        assert [(d.site, d.count) for d in calls] == [("(root)", 0), ("(root)", 1), ("(root)", 2), ("drop", 0)]


def test_an_empty_branch_and_the_count_after_depends_on_the_branch():
    text = model(
        """
        - cond: {pred: false, true_fun: [{call: drop}], false_fun: []}
        - call: drop
        - cond: {pred: true, true_fun: [{call: drop}], false_fun: []}
        - call: drop
        """
    )
    assert agree(text)["keys"] == 6 + 2 * 3
    assert [d.count for d in rows(text) if d.site == "drop" and d.step == 2] == [3, 4, 5]


@pytest.mark.parametrize("index, taken", [(0, 0), (1, 1), (2, 2), (7, 2), (-3, 0)])
def test_switch_runs_the_branch_at_the_index_clamped_as_lax_switch_does(index, taken):
    text = model(
        f"""
        - switch:
            index: {index}
            branches:
              - [{{call: drop}}]
              - [{{call: block}}, {{draw: noise}}]
              - [{{draw: {{stream: noise, repeat: 3}}}}, {{call: drop}}]
        """
    )
    got = agree(text)
    per_call = (1, 2, 4)[taken]
    assert got["keys"] == 6 + 2 * per_call
    assert spec_of(text).model.call[0].taken == taken


@pytest.mark.parametrize("kind", ["fori_loop", "while_loop"])
def test_a_loop_carries_the_count_through_its_iterations(kind):
    text = model(
        f"""
        - {kind}: {{iterations: 3, body: [{{call: drop}}, {{call: block}}, {{draw: noise}}]}}
        - call: drop
        """
    )
    assert agree(text)["keys"] == 6 + 2 * (3 * 3 + 1)
    drop = [d.count for d in rows(text) if d.site == "drop"]
    noise = [d.count for d in rows(text) if d.site == "(root)"]
    # iteration i draws fold_in(key, c0 + i): the same keys as the body written out three times
    assert drop[1:] == list(range(8)) and noise == list(range(6))
    unrolled = model("- call: {name: drop, repeat: 1}\n- call: block\n- draw: noise\n" * 3 + "- call: drop\n")
    assert keys_of(text) == keys_of(unrolled)


@pytest.mark.parametrize("kind", ["fori_loop", "while_loop"])
def test_a_loop_of_no_iteration_draws_nothing(kind):
    text = model(f"- {kind}: {{iterations: 0, body: [{{call: drop}}]}}\n- call: drop\n")
    assert agree(text)["keys"] == 6 + 2
    assert [d.count for d in rows(text) if d.site == "drop"] == [0, 0, 1]


def test_control_flow_nests_and_runs_transforms_inside():
    text = model(
        """
        - fori_loop:
            iterations: 2
            body:
              - cond:
                  pred: true
                  true_fun:
                    - switch: {index: 1, branches: [[{call: drop}], [{call: {name: block, vmap: 2, split: dropout}}]]}
                    - while_loop: {iterations: 2, body: [{call: {name: drop, scan: 2, broadcast: dropout}}]}
                  false_fun: [{draw: noise}]
        """
    )
    got = agree(text)
    # each iteration: block in 2 lanes (1 split draw + 2 lane draws), 2 scans of 2 steps on one broadcast key
    assert got["keys"] == 6 + 2 * 2 * (1 + 2 + 2 * 2)


def test_a_stacked_module_scanned_inside_a_loop():
    text = """
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: Stack
      init:
        - module:
            name: blocks
            class: Block
            stack: 3
            init: [{Linear: {name: linear}}, {Dropout: {name: drop, rate: 0.5}}]
            call: [{call: drop}]
      call:
        - fori_loop: {iterations: 2, body: [{call: {name: blocks, scan: true}}]}
        - cond: {pred: false, true_fun: [], false_fun: [{call: {name: blocks, vmap: true}}]}
    """
    assert agree(text)["keys"] == 2 + 3 * 3 + 2 * 3 * 3


def test_attention_and_a_key_given_to_a_dropout_inside_a_loop():
    text = """
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: M
      init:
        - MultiHeadAttention: {name: attn, dropout_rate: 0.5}
        - Dropout: {name: drop, rate: 0.5}
      call:
        - while_loop: {iterations: 2, body: [{call: attn}, {call: {name: drop, key: 7}}]}
        - cond: {pred: true, true_fun: [{call: {name: drop, key: 3}}], false_fun: [{call: drop}]}
    """
    got = agree(text)
    assert got["keys"] == 8 + 2 + 2 * 2 and got["given"] == 2 * 3


def test_the_branch_not_taken_raises_its_error_as_nnx_traces_it():
    # nnx.cond traces both branches: the missing stream of the branch not taken fails as it does in NNX
    text = model("- cond: {pred: true, true_fun: [{call: drop}], false_fun: [{draw: other}]}\n")
    assert agree(text) == {"error": "AttributeError"}
    with pytest.raises(FlaxError, match="No RngStream named 'other'"):
        derive(spec_of(text))
    # and a loop that runs no iteration still traces its body
    text = model("- fori_loop: {iterations: 0, body: [{draw: other}]}\n")
    assert agree(text) == {"error": "AttributeError"}
    # with two failing branches NNX raises the first one's (true_fun is traced first)
    both = """
    rngs: {dropout: 1}
    model:
      class: M
      keep_rngs: true
      init:
        - module: {name: s, class: S, stack: 2, init: [{Dropout: {name: drop, rate: 0.5}}], call: [{call: drop}]}
      call:
        - cond: {pred: false, true_fun: [{call: s}], false_fun: [{draw: other}]}
    """
    assert agree(both) == {"error": "ValueError"}
    assert agree(
        both.replace("[{call: s}], false_fun: [{draw: other}]", "[{draw: other}], false_fun: [{call: s}]")
    ) == {"error": "AttributeError"}


# ---------------------------------------------------------------- nnx.fork_rngs
def test_fork_rngs_forks_every_stream_of_the_module_and_gives_it_back_one_count_on():
    text = model(
        """
        - call: {name: block, fork_rngs: true}
        - call: block
        - call: {name: drop, fork_rngs: [dropout]}
        - draw: dropout
        """
    )
    got = agree(text)
    assert got["keys"] == 6 + 2 * (2 + 1 + 2 + 1)
    calls = [c for c in derive(spec_of(text)).calls if c.derivation.step == 1]
    fork, inside, after = [c for c in calls if c.derivation.site in ("block", "block.drop")][:3]
    # the fork draws block.drop's stream at its count; inside, count 0 of fold_in(key, c); after, c + 1
    assert [c.derivation.kind for c in (fork, inside, after)] == ["fork", "dropout", "dropout"]
    assert [c.derivation.count for c in (fork, inside, after)] == [0, 0, 1]
    assert inside.derivation.chain[-1] == "fold_in 0 (nnx.fork_rngs for block)"
    assert after.derivation.chain == fork.derivation.chain and len({fork.key, inside.key, after.key}) == 3


def test_fork_rngs_of_some_tags_in_graph_order():
    # the model's graph (sorted attributes): block.drop.rngs, drop.rngs, rngs.dropout, rngs.noise
    text = model(
        "- call: block\n- call: drop\n- draw: noise\n- draw: dropout\n",
        **{"steps: 2": "run: [call, {call: {n: 2, fork_rngs: dropout}}, {call: {fork_rngs: [noise, params]}}]"},
    )
    got = agree(text)
    assert got["keys"] == 6 + 4 + 2 * (3 + 4) + (2 + 4)
    forks = [(d.step, d.stream) for d in rows(text) if d.kind == "fork" and d.step > 0]
    assert forks[:3] == [(2, "block.drop.rngs"), (2, "drop.rngs"), (2, "rngs.dropout")]
    assert forks[-2:] == [(4, "rngs.noise"), (4, "rngs.params")]


def test_fork_rngs_around_lanes_steps_and_inside_them():
    text = model(
        """
        - call: {name: block, vmap: 3, split: dropout, fork_rngs: true}
        - call: {name: drop, scan: 2, fork_rngs: dropout}
        """,
        **{"steps: 2": "run: [call, {call: {scan: 2, broadcast: noise, fork_rngs: noise}}, {call: {fork_rngs: true}}]"},
    )
    assert agree(text)["keys"] > 0
    # inside the lanes of an nnx.vmap: a split stream forks per lane, a broadcast one once for every lane
    lanes = """
    rngs: {params: 0, dropout: 1, noise: 5}
    steps: 2
    model:
      class: Model
      init:
        - module:
            name: block
            class: Block
            init: [{Dropout: {name: drop, rate: 0.5}}, {Dropout: {name: ndrop, rate: 0.5, rng_collection: noise}}]
            call: [{call: {name: drop, fork_rngs: true}}, {call: {name: ndrop, fork_rngs: noise}}, {call: ndrop}]
      call:
        - call: {name: block, vmap: 2, split: dropout}
    """
    assert agree(lanes)["keys"] > 0
    fork_rows = [d for d in rows(lanes) if d.kind == "fork" and d.step == 1 and d.site == "block.ndrop"]
    assert [(d.lane, d.broadcast, d.count) for d in fork_rows] == [(0, "vmap", 0), (1, "vmap", 0)]
    inner = """
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: Stack
      init:
        - module:
            name: blocks
            class: Block
            stack: 3
            init: [{Dropout: {name: drop, rate: 0.5}}]
            call: [{call: {name: drop, fork_rngs: true}}, {call: drop}]
      call:
        - call: {name: blocks, scan: true}
        - call: {name: blocks, vmap: true}
    """
    # construction: split_rngs draws params and dropout, each member forks; each call of a member (a scan and a
    # vmap per step): its own stream forked, a draw inside and one after
    assert agree(inner)["keys"] == 2 + 3 + 2 * 2 * 3 * 3


def test_fork_rngs_inside_control_flow():
    text = model(
        """
        - fori_loop: {iterations: 2, body: [{call: {name: block, fork_rngs: true, repeat: 2}}]}
        - cond: {pred: false, true_fun: [], false_fun: [{call: {name: drop, fork_rngs: dropout}}]}
        - call: drop
        """
    )
    assert agree(text)["keys"] == 6 + 2 * (2 * 2 * 2 + 2 + 1)


def test_fork_rngs_of_a_stacked_module_outside_its_axis_fails_as_in_nnx(tmp_path):
    text = """
    rngs: {dropout: 1}
    model:
      class: M
      init:
        - module: {name: s, class: S, stack: 2, init: [{Dropout: {name: drop, rate: 0.5}}], call: [{call: drop}]}
      call:
        - call: {name: s, scan: true, fork_rngs: true}
    """
    assert agree(text) == {"error": "ValueError"}
    with pytest.raises(FlaxError, match="nnx.fork_rngs forks s.drop.rngs"):
        derive(spec_of(text))
    path = write(tmp_path, "stacked.yaml", HEAD + textwrap.dedent(text))
    r = invoke("derive", path)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "ValueError" in r.stderr


def test_fork_rngs_of_a_dropout_given_a_key_forks_its_stream_and_uses_the_key():
    text = model("- call: {name: drop, key: 7, fork_rngs: true}\n- call: drop\n")
    got = agree(text)
    assert got["keys"] == 6 + 2 * 2 and got["given"] == 2
    # the fork draws drop's stream (count 2), the key given is used as it is, the plain call draws count 3
    step = [(d.kind, d.count, d.given) for d in rows(text) if d.site == "drop" and d.step == 2]
    assert step == [("fork", 2, ""), ("dropout", 0, "7"), ("dropout", 3, "")]


def test_fork_rngs_of_a_bridge_module():
    text = """
    rngs: {params: 0, dropout: 1}
    steps: 2
    model:
      class: Model
      init:
        - ToNNX:
            name: enc
            module: {class: Encoder, body: [{Dense: {features: 3}}, {Dropout: {rate: 0.5, deterministic: false}}]}
      call:
        - call: {name: enc, fork_rngs: dropout}
    """
    got = agree(text)
    # construction: the fork (2 streams) and lazy_init's 2 draws; each call: the fork of the dropout stream, and
    # ToNNX's 2 draws (one from the forked stream); Linen: 3 keys at init, a dropout key per call
    assert got["keys"] == 2 + 2 + 2 * (1 + 2) and got["linen"] == 3 + 2


def test_fork_rngs_rows_in_the_text_report(tmp_path):
    path = write(tmp_path, "f.yaml", HEAD + model("- call: {name: block, fork_rngs: true}\n"))
    out = invoke("derive", path).stdout
    # (the fork's draw is at the layer keeping the stream forked: two streams of a block forked are two sites)
    assert "block.drop (fork)" in out and "(nnx.fork_rngs for block)" in out


def test_the_oracle_records_only_the_branch_taken():
    text = model("- cond: {pred: true, true_fun: [{call: drop}], false_fun: [{draw: {stream: noise, repeat: 5}}]}\n")
    keys = nnx_keys(spec_of(text))
    assert [k["site"] for k in keys if k["step"] == 1] == ["drop"]


# ---------------------------------------------------------------- refused
@pytest.mark.parametrize(
    "call, message",
    [
        ("[{cond: {pred: 1, true_fun: [], false_fun: []}}]", "`pred` of cond is true or false"),
        ("[{cond: {pred: yes_please, true_fun: [], false_fun: []}}]", "not a string"),
        ("[{cond: {pred: true, true_fun: []}}]", "`cond` needs `false_fun`"),
        ("[{cond: {pred: true, true_fun: [], false_fun: [], else: []}}]", "unknown key 'else' in `cond`"),
        ("[{cond: {pred: true, true_fun: {call: d}, false_fun: []}}]", "`true_fun` of cond is a list of statements"),
        ("[{cond: [call: d]}]", "`cond` takes a mapping"),
        ("[{cond: {pred: true, true_fun: [{call: nope}], false_fun: []}}]", "builds no attribute 'nope'"),
        ("[{cond: {pred: true, true_fun: [{Linear: {name: l}}], false_fun: []}}]", "unknown statement 'Linear'"),
        ("[{cond: {pred: true, true_fun: [{draw: noise}], false_fun: []}}]", "does not keep"),
        ("[{switch: {index: 0, branches: []}}]", "one or more branches"),
        ("[{switch: {index: 0, branches: [{call: d}]}}]", "branch 0 of switch is a list of statements"),
        ("[{switch: {index: true, branches: [[]]}}]", "`index` of switch must be an integer"),
        ("[{switch: {branches: [[]]}}]", "`switch` needs `index`"),
        ("[{fori_loop: {iterations: -1, body: []}}]", "`iterations` of fori_loop must be between 0 and"),
        ("[{while_loop: {iterations: 2.5, body: []}}]", "must be an integer"),
        ("[{while_loop: {iterations: 2}}]", "`while_loop` needs `body`"),
        ("[{fori_loop: {iterations: 2, body: [], unroll: 2}}]", "unknown key 'unroll' in `fori_loop`"),
        ("[{fori_loops: {iterations: 2, body: []}}]", "did you mean 'fori_loop'"),
        ("[{call: {name: d, fork_rngs: 3}}]", "`fork_rngs:` (true: every stream"),
        ("[{call: {name: d, fork_rngs: []}}]", "forks no stream"),
        ("[{call: {name: d, fork_rng: true}}]", "did you mean 'fork_rngs'"),
    ],
)
def test_bad_control_flow(tmp_path, call, message):
    text = f"rngs: {{dropout: 1}}\nmodel: {{class: M, init: [{{Dropout: {{name: d, rate: 0.5}}}}], call: {call}}}\n"
    path = write(tmp_path, "bad.yaml", HEAD + text)
    with pytest.raises(SpecError) as e:
        derive(path)
    assert message in str(e.value)
    r = invoke("derive", path)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {path}:") and len(r.stderr.splitlines()) == 1
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("statement", ["cond", "switch", "fori_loop", "while_loop"])
def test_control_flow_in_init_is_refused(tmp_path, statement):
    text = f"rngs: {{params: 0}}\nmodel: {{class: M, init: [{{{statement}: {{iterations: 1, body: []}}}}]}}\n"
    path = write(tmp_path, "bad.yaml", HEAD + text)
    r = invoke("collisions", path)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1
    assert f"unknown statement '{statement}' in `init` of M" in r.stderr
    assert f"rngaudit models nnx.{statement} in __call__ (`call:`), not in __init__" in r.stderr


def test_fork_rngs_before_flax_0_11_is_refused(tmp_path):
    old = 'flax: {version: "0.10.2"}\nrngs: {dropout: 1}\n'
    for text in (
        old + "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{call: {name: d, fork_rngs: true}}]}",
        old + "run: [{call: {fork_rngs: true}}]\nmodel: {class: M}",
    ):
        path = write(tmp_path, "old.yaml", HEAD + text + "\n")
        r = invoke("derive", path)
        assert r.exit_code == 2 and "fork_rngs is flax 0.11 and later; this spec says flax 0.10.2" in r.stderr
    # control flow is older: flax 0.10.2 replays it
    text = old + "model: {class: M, init: [{Dropout: {name: d, rate: 0.5}}], call: [{fori_loop: {iterations: 2, "
    assert len(derive(spec_of(text + "body: [{call: d}]}}]}\n")).calls) == 2


def test_a_bridge_module_inside_control_flow_is_refused(tmp_path):
    text = """
    rngs: {params: 0}
    model:
      class: Model
      init:
        - ToNNX: {name: enc, module: {Dense: {features: 3}}}
        - module: {name: outer, class: Outer, init: [], call: []}
      call:
        - fori_loop: {iterations: 2, body: [{call: enc}]}
    """
    with pytest.raises(SpecError, match="called inside nnx.cond, nnx.switch or a loop yet"):
        spec_of(text)
    nested = """
    rngs: {params: 0}
    model:
      class: Model
      init:
        - module:
            name: inner
            class: Inner
            init: [{ToNNX: {name: enc, module: {Dense: {features: 3}}}}]
            call: [{call: enc}]
      call:
        - cond: {pred: true, true_fun: [{call: inner}], false_fun: []}
    """
    path = write(tmp_path, "b.yaml", HEAD + textwrap.dedent(nested))
    r = invoke("derive", path)
    assert r.exit_code == 2 and "Linen inside NNX control flow" in r.stderr and len(r.stderr.splitlines()) == 1
