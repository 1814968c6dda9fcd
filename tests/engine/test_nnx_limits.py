"""A spec whose run is surely past the replay's limits (module calls, keys drawn) is refused before the replay
runs: a loop of a million iterations at each of 100 steps took a minute and GBs to reach the limit. The count it
is refused on is a lower bound of the replay's own (random models), so a spec within the limits runs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from nnx_oracle import nnx_spec as spec_of

from rngaudit import derive, parse_spec
from rngaudit.engine import nnx as engine_nnx
from rngaudit.engine.keys import KeyEngine
from rngaudit.errors import FlaxError, SpecError
from tests.engine.test_nnx_property import nnx_specs

PAST = {
    "loop at every step": """
        rngs: {params: 0, noise: 2}
        steps: 100
        model: {class: M, keep_rngs: true, call: [fori_loop: {iterations: 1000000, body: [draw: noise]}]}
    """,
    "nested loops": """
        rngs: {params: 0, noise: 2}
        model:
          class: M
          keep_rngs: true
          call: [fori_loop: {iterations: 1000000, body: [fori_loop: {iterations: 1000000, body: [draw: noise]}]}]
    """,
    "vmap lanes repeated": """
        rngs: {params: 0, dropout: 1}
        model:
          class: M
          init: [Dropout: {name: d, rate: 0.5}]
          call: [call: {name: d, vmap: 65536, split: dropout, repeat: 1000}]
    """,
    "a submodule's draws at every step": """
        rngs: {params: 0, noise: 2}
        steps: 1000
        model:
          class: M
          init: [module: {name: enc, class: E, keep_rngs: true, call: [draw: {stream: noise, repeat: 100000}]}]
          call: [call: enc]
    """,
}


@pytest.mark.parametrize("name", PAST)
def test_a_run_surely_past_the_limits_is_refused_before_the_replay(monkeypatch, name):
    def never(self):  # (the replay must not start)
        raise AssertionError("the replay ran")

    monkeypatch.setattr(engine_nnx.NnxReplayer, "run", never)
    with pytest.raises(SpecError, match=r"more than \d+ (module calls|keys)"):
        derive(spec_of(PAST[name]))


def test_layer_calls_the_replay_does_not_count_do_not_count():
    # a million calls of a Linear (it draws nothing) and of a deterministic Dropout at each of 100 steps: the
    # replay makes them as blocks, in no time; a bound counting them would refuse a valid spec
    text = """
        rngs: {params: 0, dropout: 1}
        steps: 100
        model:
          class: M
          init: [Linear: {name: fc}, Dropout: {name: d, rate: 0.5, deterministic: true}]
          call: [call: {name: fc, repeat: 1000000}, call: {name: d, repeat: 1000000}]
    """
    assert len(derive(spec_of(text)).calls) == 3


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nnx_specs())
def test_the_count_refused_on_is_at_most_the_replays(text):
    spec = parse_spec(text, "<hypothesis>")
    steps = sum(e.n for e in spec.run if isinstance(e, engine_nnx.NnxStep))
    calls, draws = engine_nnx._least(spec.model, spec.model.call, {})
    r = engine_nnx.NnxReplayer(spec, KeyEngine(spec.prng_impl, spec.threefry_partitionable))
    try:
        r.run()
    except (FlaxError, SpecError):
        return  # (a spec NNX raises on, or one the replay refuses: no count to compare)
    if steps:
        assert steps * (1 + calls) <= r.calls and steps * draws <= r.total, (steps, calls, draws, r.calls, r.total)
