"""Random nestings of Flax's lifted class transforms (nn.scan, nn.vmap, nn.remat, nn.jit, up to three deep)
around a block with a Dense, a Dropout and a param, built in real Flax, captured in init or apply, and
replayed: the keys `derive` gives for the captured spec equal the keys Flax handed out (issue 16).

The default run draws a fixed set; RNGAUDIT_NESTING_EXAMPLES=1000 for the long sweep."""

from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rngaudit

EXAMPLES = int(os.environ.get("RNGAUDIT_NESTING_EXAMPLES", "8"))
_FILES = itertools.count()

BLOCK = """
import flax.linen as nn
import jax.numpy as jnp


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        x = nn.Dense(4)(x)
        w = self.param("w", nn.initializers.normal(), (4,))
        x = nn.Dropout(0.5, deterministic=False)(x + w)
        return x, None
"""


@st.composite
def nestings(draw):
    levels = draw(st.lists(st.sampled_from(("scan", "vmap", "remat", "jit")), min_size=1, max_size=3))
    wrapped, lanes = "Block", []
    for kind in reversed(levels):  # innermost first
        split = draw(st.fixed_dictionaries({"params": st.booleans(), "dropout": st.booleans()}))
        if kind == "scan":
            n = draw(st.integers(1, 3))
            wrapped = f"nn.scan({wrapped}, length={n}, variable_axes={{'params': 0}}, split_rngs={split})"
        elif kind == "vmap":
            n = draw(st.integers(1, 3))
            lanes.insert(0, n)
            wrapped = (
                f"nn.vmap({wrapped}, in_axes=(0, None), out_axes=0, axis_size={n}, "
                f"variable_axes={{'params': 0}}, split_rngs={split})"
            )
        else:
            wrapped = f"nn.{kind}({wrapped})"
    phase = draw(st.sampled_from(("init", "apply")))
    shape = (*lanes, 2, 4)
    source = (
        BLOCK
        + "\n\nclass Model(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n"
        + f"        return {wrapped}()(x, None)[0]\n\n\n"
        + f"def make():\n    return Model(), (jnp.ones({shape}),)\n"
    )
    return levels, phase, source


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nestings())
def test_random_nestings_of_class_transforms_replay(tmp_path_factory, case):
    levels, phase, source = case
    event("∘".join(levels))
    path = tmp_path_factory.mktemp("nesting") / f"nesting_{next(_FILES)}.py"
    path.write_text(source)
    report = rngaudit.capture(f"{path}:make", rngs="params=0,dropout=1", phase=phase)
    flax_keys = {s.ident: s.key for s in report.capture.sites}
    spec = rngaudit.parse_spec(report.spec, "<captured>")
    derived = {}
    for c in rngaudit.derive(spec, values=False).calls:
        d = c.derivation
        if not d.discarded:
            derived[(tuple(d.path), d.stream, d.count, tuple(d.lane))] = tuple(c.key)
    assert flax_keys and derived == flax_keys
