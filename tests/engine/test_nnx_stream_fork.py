"""A module of yours keeping a fork of one stream, `self.rng = rngs.dropout.fork()` (`fork:` in `init:`), as
nnx.Dropout keeps its own and DropPath or attention ports write it, drawn from at its calls (`draw: {stream,
from: rng}`), against real Flax NNX: every key derive prints is the key NNX hands out, reseeded, stacked and
under nnx.scan too."""

from __future__ import annotations

import pytest
from nnx_oracle import agree, assert_one_error_line
from nnx_oracle import nnx_spec as spec_of

from rngaudit import derive

MODEL = """
rngs: {params: 0, dropout: 1, noise: 2}
run: [call, {reseed: {dropout: 7}}, call, eval, call]
model:
  class: Model
  init:
    - Linear: {name: fc}
    - module:
        name: drop_path
        class: DropPath
        init: [fork: {stream: dropout, name: rng}]
        call: [draw: {stream: dropout, from: rng, when: train}]
    - Dropout: {name: drop, rate: 0.5}
    - module:
        name: attn
        class: Attention
        init: [Linear: {name: q}, fork: dropout, fork: {stream: noise, name: noise_rng}]
        call: [draw: {stream: dropout, from: rngs}, draw: {stream: noise, from: noise_rng, repeat: 2}]
    - module:
        name: layers
        class: Layer
        stack: 2
        init: [Linear: {name: fc}, fork: {stream: noise, name: rng}]
        call: [draw: {stream: noise, from: rng}]
  call:
    - call: drop_path
    - call: drop
    - call: attn
    - call: {name: layers, scan: true}
    - draw: {stream: dropout, from: attn.rngs}
"""


def rows(text: str) -> list[tuple[int, str, str, str]]:
    return [
        (c.derivation.step, c.derivation.site.split(" ")[0], c.derivation.kind, c.derivation.stream)
        for c in derive(spec_of(text)).calls
    ]


def test_a_kept_fork_draws_as_nnx_hands_out_its_keys():
    assert agree(MODEL)["keys"] > 0  # (every key real NNX hands out is derive's, in order)
    drawn = rows(MODEL)
    # the fork is one key of the module's stream at construction, in order with the layers around it
    init = [(site, kind) for step, site, kind, _ in drawn if step == 0 and kind == "fork"]
    assert init[:2] == [("drop_path.rng", "fork"), ("drop", "fork")], init
    # its draws are from the stream kept at that attribute, and there (as a Dropout's are at the Dropout): not at
    # the module, whose own draws of the tag may meet the same counts
    assert ("drop_path.rng", "draw", "drop_path.rng") in {(s, k, p) for n, s, k, p in drawn if n == 1}
    assert ("attn.noise_rng", "draw", "attn.noise_rng") in {(s, k, p) for n, s, k, p in drawn if n == 1}
    # nnx.reseed reaches it (a stream of the model's graph, tag dropout); in eval mode `when: train` draws nothing
    assert [n for n, s, _, p in drawn if p == "drop_path.rng"] == [1, 2], drawn
    reseeded = [c for c in derive(spec_of(MODEL)).calls if c.derivation.stream == "drop_path.rng"]
    assert reseeded[1].derivation.count == 0 and "key 7" in " ".join(reseeded[1].derivation.chain)
    # a stacked module's fork: a stream a lane (nnx.reseed of it would be NNX's ValueError, as derive says)
    assert {p for n, s, _, p in drawn if n and s == "layers.rng"} == {"layers.rng[0]", "layers.rng[1]"}, drawn


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("fork: {stream: noise, name: noise_rng}", "fork: {stream: noise, name: q}", "attribute 'q' of Attention"),
        ("from: noise_rng, repeat: 2", "from: noise_rng2, repeat: 2", "nor a stream kept by `fork:` of that name"),
        ("{stream: noise, from: noise_rng", "{stream: params, from: noise_rng", "write `stream: noise`"),
        ("- call: drop_path", "- call: attn.rngs", "draw from it with `draw: {stream: dropout, from: attn.rngs}`"),
        ("fork: dropout, fork:", "fork: {stream: dropout, nam: x}, fork:", "unknown key 'nam'"),
        ("fork: dropout, fork:", "fork, fork:", "`fork` names the stream a module forks and keeps"),
    ],
)
def test_bad_fork_is_one_error_line(tmp_path, old, new, message):
    assert MODEL.count(old) == 1
    assert_one_error_line(tmp_path, MODEL.replace(old, new), message)


def test_a_fork_of_a_stream_the_rngs_lacks_is_nnx_error():
    # rngs.other.fork(): NNX's AttributeError (no `default` stream to fall back to), as derive says
    text = MODEL.replace(
        "fork: {stream: dropout, name: rng}]\n        call: [draw: {stream: dropout, from: rng, w",
        "fork: {stream: other, name: rng}]\n        call: [draw: {stream: other, from: rng, w",
    )
    assert text != MODEL
    assert agree(text) == {"error": "AttributeError"}


def test_fork_is_flax_0_11_and_later(tmp_path):
    assert_one_error_line(
        tmp_path,
        "flax: {version: 0.10.7}\n"
        + MODEL.replace("run: [call, {reseed: {dropout: 7}}, call, eval, call]", "steps: 1"),
        "fork is flax 0.11 and later",
    )
