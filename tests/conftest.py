"""What every test shares: reproducible Hypothesis profiles, and the switch for the tests marked `slow`.

`python3 -m pytest` runs the default suite, a few minutes on 2 cores. The tests marked `slow` (long sweeps
against real Flax, the golden corpus of generated specs) are deselected unless `--slow` is given, as the
README's test command and CI do; `-m slow` runs only them.

Hypothesis runs reproducibly by default: `derandomize` draws the same examples on every run of one
Hypothesis version, so a CI run fails only when the code (or Hypothesis) changed, never because it happened
upon an example. Long sweeps explore: RNGAUDIT_HYPOTHESIS_RANDOM=1 draws new examples each run (and keeps the
ones that failed in .hypothesis/ to try first next time)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("reproducible", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("explore" if os.environ.get("RNGAUDIT_HYPOTHESIS_RANDOM") == "1" else "reproducible")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (CI runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow") or config.getoption("markexpr"):
        return  # every test, or what -m selects
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
