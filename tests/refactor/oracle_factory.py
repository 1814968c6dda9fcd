"""A capture TARGET for any spec: `oracle_factory.py:make` builds the spec named by $RNGAUDIT_ORACLE_SPEC in real
Flax (the oracle's builder, tests/flax_oracle.py) under the spec's Flax and JAX settings, so `rngaudit capture`
records the keys real Flax hands out for a random model (test_diff_capture_fuzz.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flax_oracle import _Builder, _Capture, flax_settings

from rngaudit import load_spec

SPEC = load_spec(os.environ["RNGAUDIT_ORACLE_SPEC"])
# a capture process of its own: the settings stay for its whole run (held: a collected context manager would
# restore them)
SETTINGS = flax_settings(SPEC)
SETTINGS.__enter__()


def make():
    builder = _Builder(_Capture())
    return builder.construct(SPEC.model, SPEC.model.name), (builder.input_for(SPEC.model),)
