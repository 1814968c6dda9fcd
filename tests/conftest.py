"""Hypothesis runs reproducibly by default: `derandomize` draws the same examples on every run of one
Hypothesis version, so a CI run fails only when the code (or Hypothesis) changed, never because it
happened upon an example. Long sweeps explore: RNGAUDIT_HYPOTHESIS_RANDOM=1 draws new examples each
run (and keeps the ones that failed in .hypothesis/ to try first next time)."""
from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("reproducible", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("explore" if os.environ.get("RNGAUDIT_HYPOTHESIS_RANDOM") == "1" else "reproducible")
