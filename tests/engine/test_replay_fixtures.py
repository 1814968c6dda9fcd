"""Every bundled spec and fixture gives exactly the keys (and drawn values) real Flax hands out."""

from __future__ import annotations

import pytest
from flax_oracle import check_against_flax
from support import LINEN_EXAMPLES, REPO

from rngaudit import load_spec

ROOT = REPO
SPECS = sorted((ROOT / "fixtures").rglob("*.yaml")) + LINEN_EXAMPLES


@pytest.mark.parametrize("path", SPECS, ids=lambda p: str(p.relative_to(ROOT)))
def test_fixture_matches_real_flax(path):
    check_against_flax(load_spec(str(path)))
