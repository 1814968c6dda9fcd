"""The cyclic collector is paused over the large allocating steps (replay, call sites, audit, JSON read),
and its state is always restored."""

from __future__ import annotations

import gc
import json

import pytest

from rngaudit import parse_spec
from rngaudit.collision.audit import audit
from rngaudit.collision.module_paths import load_module_sites
from rngaudit.collision.spec_sites import spec_sites
from rngaudit.engine.table import key_table
from rngaudit.gcpause import paused

SPEC = """
rngaudit: 1
rngs: {params: 0, dropout: 1}
model:
  class: Model
  body:
    - module:
        class: Block
        repeat: 100
        body:
          - make_rng: {stream: dropout, repeat: 30}
          - make_rng: {stream: params, repeat: 30}
"""


@pytest.fixture
def collections():
    """Every collection the collector starts, with the threshold at 1 so that any allocation while it is on
    triggers one."""
    seen: list[int] = []

    def count(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    old = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(1, 1, 1)
    try:
        yield seen
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(count)


def test_the_pause_restores_the_collector_on_return_and_on_error():
    @paused
    def inner():
        return gc.isenabled()

    @paused
    def fails():
        raise ValueError("boom")

    assert gc.isenabled()
    assert inner() is False
    assert gc.isenabled()
    with pytest.raises(ValueError):
        fails()
    assert gc.isenabled()

    @paused
    def outer():
        inner()
        return gc.isenabled()  # the inner pause does not turn it back on

    assert outer() is False and gc.isenabled()
    gc.disable()
    try:
        inner()
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def _collections_during(seen: list[int], fn, *args) -> tuple[object, int]:
    """fn(*args) and how many collections started while it ran (the call's own argument tuple may start one
    or two before the pause begins)."""
    seen.clear()
    out = fn(*args)
    return out, len(seen)


def test_replay_call_sites_and_audit_run_without_a_collection(collections):
    spec = parse_spec(SPEC, "s.yaml")
    sites, n_sites = _collections_during(collections, spec_sites, spec)
    a, n_audit = _collections_during(collections, audit, sites)
    table, n_table = _collections_during(collections, key_table, spec)
    assert sites.n == 6000 and table.n == 6000 and a.call_sites == 6000 and a.latent
    assert max(n_sites, n_audit, n_table) <= 2
    # the same work with the collector on starts one at nearly every allocation
    _, unpaused = _collections_during(collections, audit.__wrapped__, spec_sites.__wrapped__(spec))
    assert unpaused > 1000


def test_a_json_input_is_read_without_a_collection(collections, tmp_path):
    path = tmp_path / "paths.json"
    path.write_text(json.dumps([f"Block_{i}/Dense_{j}" for i in range(500) for j in range(10)]))
    sites, n_read = _collections_during(collections, load_module_sites, str(path))
    a, n_audit = _collections_during(collections, audit, sites)
    assert a.call_sites == 5000
    assert n_read <= 2 and n_audit <= 2
