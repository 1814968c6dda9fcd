"""Stacked modules built by nnx.vmap over `rngs.split(N)` / `rngs.broadcast(N)` (spec `stack: N, rngs: split |
broadcast`, `only:` the streams the mapping form splits), FLAX_NNX_RULES.md §7: every key is compared with real
NNX; the pass-through copy (count reset to 0) and the broadcast members are findings whose keys NNX handed out."""

from __future__ import annotations

import pytest
from nnx_oracle import NNX_HEAD as HEAD
from nnx_oracle import assert_one_error_line, check_against_nnx
from nnx_oracle import nnx_spec as spec_of
from nnx_oracle import write_nnx_spec as write_spec
from support import invoke, write

from rngaudit import FlaxError, derive
from rngaudit.collision.nnx import audit_nnx


def ensemble(rngs: str, only: str = "", call: str = "vmap: true", top: bool = True, steps: int = 2) -> str:
    return f"""
    rngs: {{params: 0, dropout: 1, noise: 2}}
    steps: {steps}
    model:
      class: Ensemble
      init:
        {"- Dropout: {name: top, rate: 0.5}" if top else "- Linear: {name: top}"}
        - module:
            name: members
            class: Member
            stack: 3
            rngs: {rngs}
            {f"only: {only}" if only else ""}
            init:
              - Linear: {{name: lin}}
              - Dropout: {{name: drop, rate: 0.5}}
            call:
              - call: drop
      call:
        {"- call: top" if top else ""}
        - call: {{name: members, {call}}}
    """


@pytest.mark.parametrize(
    "rngs, only, call",
    [
        ("split", "", "vmap: true"),
        ("split", "", "scan: true"),
        ("split", "[params, dropout]", "vmap: true"),
        ("split", "params", "vmap: true"),
        ("broadcast", "", "vmap: true"),
        ("broadcast", "dropout", "scan: true"),
    ],
)
def test_ensembles_built_from_split_or_broadcast_rngs_agree_with_real_nnx(rngs, only, call):
    got = check_against_nnx(spec_of(ensemble(rngs, only, call)))
    assert got["keys"] > 0


def test_split_everything_is_the_split_rngs_stack_and_no_finding():
    split = derive(spec_of(ensemble("split")))
    stacked = derive(spec_of(ensemble("shared")))
    # the same keys as nnx.split_rngs around nnx.vmap (which visits streams in sorted order, Rngs.split in the
    # Rngs' order: the same draws)
    assert sorted(tuple(c.key) for c in split.calls) == sorted(tuple(c.key) for c in stacked.calls)
    assert audit_nnx(spec_of(ensemble("split"))).collisions == ()


def test_a_passed_through_stream_rewinds_and_every_member_shares_it():
    text = ensemble("split", "params")
    check_against_nnx(spec_of(text))  # the keys below are NNX's
    found = audit_nnx(spec_of(text)).collisions
    assert [(c.category, len(c.sites)) for c in found] == [("count_rewind", 4)] * 3  # construction, 2 steps
    first = found[0]
    # the top Dropout's fork (count 0 of rngs.dropout) again: the copy restarts at count 0
    assert first.sites[0].site == "top" and first.sites[0].stream_path == "rngs.dropout"
    assert "count reset to 0" in first.why and "members were built from one key" in first.why
    r = invoke("collisions", write_spec(text))
    assert r.exit_code == 1 and "FAIL  count_rewind" in r.stdout


def test_broadcast_members_are_initialised_alike():
    text = ensemble("broadcast", top=False)
    check_against_nnx(spec_of(text))
    found = audit_nnx(spec_of(text)).collisions
    kernels = [c for c in found if c.sites[0].site == "members.lin.kernel"]
    assert len(kernels) == 1 and kernels[0].category == "broadcast_lanes" and len(kernels[0].sites) == 3
    assert "build the members from rngs.split(N)" in kernels[0].fix


def test_a_broadcast_stacked_member_called_outside_its_axis_fails_as_nnx_does():
    text = """
    rngs: {params: 0, dropout: 1}
    model:
      class: M
      init:
        - module: {name: members, class: D, stack: 2, rngs: split, only: params, init: [{Dropout: {name: d, rate: 0.5}}], call: [call: d]}
      call:
        - call: members
    """
    assert check_against_nnx(spec_of(text)) == {"error": "ValueError"}
    with pytest.raises(FlaxError, match="fold_in accepts a single key"):
        derive(spec_of(text))


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {class: M, init: [{module: {class: C, rngs: split}}]}", "`rngs` of a module is shared"),
        ("model: {class: M, init: [{module: {class: C, stack: 2, rngs: nosuch}}]}", "split (nnx.vmap over"),
        ("model: {class: M, init: [{module: {class: C, stack: 2, only: params}}]}", "`only:` names the streams"),
        ("model: {class: M, init: [{module: {class: C, stack: 2, rngs: split, only: 3}}]}", "a stream name"),
        (
            "flax: {version: '0.12.6'}\nmodel: {class: M, init: [{module: {class: C, stack: 2, rngs: broadcast}}]}",
            "flax 0.12.7 and later",
        ),
    ],
)
def test_bad_split_rngs_are_one_error_line(tmp_path, text, message):
    assert_one_error_line(tmp_path, text, message)


def test_only_naming_no_stream_of_the_rngs_maps_nothing_as_in_nnx():
    text = """
    rngs: {params: 0, dropout: 1}
    model:
      class: M
      init:
        - module: {name: members, class: C, stack: 2, rngs: split, only: noise, init: [{Linear: {name: l}}]}
    """
    assert check_against_nnx(spec_of(text)) == {"error": "ValueError"}


def test_only_with_no_stream_is_an_error(tmp_path):
    path = write(
        tmp_path, "bad.yaml", HEAD + "model: {class: M, init: [{module: {class: C, stack: 2, rngs: split, only: []}}]}"
    )
    r = invoke("derive", path)
    assert r.exit_code == 2 and "`only:` names at least one stream" in r.stderr and len(r.stderr.splitlines()) == 1
