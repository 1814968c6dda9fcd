"""rngaudit without JAX (a plain `pip install rngaudit`, the pre-commit hook's environment): hashing, threefry and
rbg keys, `derive --no-values`, `collisions` and `diff` of specs run; what needs JAX (drawn values, unsafe_rbg
keys, shard-check) says so in one `error:` line with the extra to install, exit 2, never an internal error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import FIXTURES, GUIDE, REPO, write

NNX_GUIDE = REPO / "rngaudit" / "examples" / "nnx_guide.yaml"
# `import jax` (and jaxlib) fail as they do where JAX is not installed
BLOCK = (
    "import sys\n"
    "sys.modules['jax'] = None\n"
    "sys.modules['jaxlib'] = None\n"
    "from rngaudit.cli import main\n"
    "sys.argv = ['rngaudit', *sys.argv[1:]]\n"
    "main()\n"
)
NEEDS = "error: this needs JAX, which is not installed: pip install 'rngaudit[jax]'"


def no_jax(*args: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1")
    env.pop("RNGAUDIT_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", BLOCK, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ["derive", GUIDE, "--no-values"],
        ["derive", NNX_GUIDE, "--no-values"],
        ["collisions", FIXTURES / "collisions" / "sharp_edge.yaml"],
        ["collisions", NNX_GUIDE],
        ["collisions", GUIDE, "-f", "sarif"],
        ["diff", GUIDE, GUIDE],
    ],
    ids=["derive", "derive-nnx", "collisions", "collisions-nnx", "sarif", "diff"],
)
def test_what_only_hashes_runs_without_jax(args):
    r = no_jax(*args)
    assert r.returncode in (0, 1), r.stderr
    assert r.stderr == "" and r.stdout


def test_the_keys_without_jax_are_the_keys_with_it():
    from support import run_cli

    assert (
        no_jax("derive", GUIDE, "--no-values", "-f", "jsonl").stdout
        == run_cli("derive", GUIDE, "--no-values", "-f", "jsonl").stdout
    )


def test_what_needs_jax_says_so_in_one_line(tmp_path):
    unsafe = write(
        tmp_path,
        "unsafe.yaml",
        """
        rngaudit: 1
        jax: {prng_impl: unsafe_rbg}
        rngs: {params: 0}
        model: {class: M, body: [make_rng]}
        """,
    )
    for args in (
        ["derive", GUIDE],  # its draws' values
        ["derive", unsafe, "--no-values"],  # unsafe_rbg keys
        ["collisions", unsafe],
        ["shard-check", GUIDE],
    ):
        r = no_jax(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith(NEEDS) and r.stderr.count("\n") == 1, (args, r.stderr)
        assert r.stdout == ""
    # hash-only collisions of an unsafe_rbg spec need no keys
    assert no_jax("collisions", unsafe, "--no-keys").returncode == 0
