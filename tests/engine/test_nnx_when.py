"""NNX draws and calls made in one mode of the model only: `when: train` / `when: eval` on a `draw:` or `call:` of a
module's `call:` (a module of yours with a `deterministic` attribute that model.train()/eval() set, built False,
drawing `if not self.deterministic:`), against real Flax NNX: every key derive prints is the key NNX hands out."""

from __future__ import annotations

import pytest
from nnx_oracle import agree, assert_one_error_line
from nnx_oracle import nnx_spec as spec_of

from rngaudit import derive

# a router drawing noise in train mode and a key of its own in eval mode, a noise layer called in train mode only,
# a stack of such blocks under nnx.scan, and nnx.cond around one; calls in both modes
MODEL = """
rngs: {params: 0, dropout: 1, noise: 2}
run: [call, eval, {call: 2}, train, call, eval, call]
model:
  class: Model
  init:
    - Dropout: {name: drop, rate: 0.5}
    - module:
        name: router
        class: Router
        keep_rngs: true
        init:
          - Linear: {name: gate}
          - module: {name: noise, class: Noise, keep_rngs: true, call: [{draw: noise}]}
        call:
          - call: {name: noise, when: train}
          - draw: {stream: params, when: eval}
          - draw: {stream: dropout, when: train, repeat: 2}
    - module:
        name: layers
        class: Layer
        stack: 3
        init:
          - Linear: {name: fc}
          - module:
              name: n
              class: N
              rngs: fork
              keep_rngs: true
              call: [{draw: {stream: dropout, when: train}}, {draw: {stream: noise, when: eval}}]
        call: [call: n]
  call:
    - call: drop
    - call: router
    - call: {name: layers, scan: true}
    - cond: {pred: true, true_fun: [call: router], false_fun: []}
"""


def sites(text: str) -> list[tuple[int, str, str]]:
    rows = [c.derivation for c in derive(spec_of(text)).calls]
    return [(r.step, r.site.split(" ")[0], r.tag) for r in rows if r.step]


def test_draws_and_calls_follow_the_models_mode():
    assert agree(MODEL)["keys"] > 0  # (every key real NNX hands out is derive's)
    drawn = sites(MODEL)
    train = {(p, s) for n, p, s in drawn if n in (1, 4)}
    evaluation = {(p, s) for n, p, s in drawn if n in (2, 3, 5)}
    assert ("router.noise", "noise") in train and ("router.noise", "noise") not in evaluation
    assert ("router", "params") in evaluation and ("router", "params") not in train
    assert ("router", "dropout") in train and ("router", "dropout") not in evaluation
    assert not {n for n, p, _ in drawn if p == "drop"} & {2, 3, 5}  # (the Dropout, as ever, draws in train mode)


def test_without_mode_events_a_module_draws_in_train_mode():
    text = MODEL.replace("run: [call, eval, {call: 2}, train, call, eval, call]", "steps: 2")
    assert agree(text)["keys"] > 0
    assert ("router", "params") not in {(p, s) for _, p, s in sites(text)}


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("{stream: params, when: eval}", "{stream: params, when: trian}", "`when` is train or eval"),
        ("{stream: params, when: eval}", "{stream: params, when: trian}", "did you mean 'train'"),
        ("{name: noise, when: train}", "{name: noise, when: 1}", "`when` of `call` must be a string"),
        ("- Linear: {name: fc}", "- draw: {stream: noise, when: train}", "`when` is for a draw in `call:`"),
    ],
)
def test_bad_when_is_one_error_line(tmp_path, old, new, message):
    assert MODEL.count(old) == 1
    assert_one_error_line(tmp_path, MODEL.replace(old, new), message)
