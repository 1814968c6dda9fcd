"""The quality gates CI runs with the tests: ruff (lint and format) and mypy, configured in pyproject.toml,
report nothing on the repository."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "--no-cache", "."],
        ["ruff", "format", "--check", "--no-cache", "."],
        ["mypy", "--no-incremental"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_tree_passes(command):
    r = subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
