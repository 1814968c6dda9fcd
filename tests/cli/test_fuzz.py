"""Fuzz every command with random documents and random bytes: exit 0, 1 or 2, never a traceback or an
"internal error" (the error boundary's word for a bug of ours).

Runs in-process through the typer app (the same code path as the console script, stdout and stderr
captured apart). RNGAUDIT_FUZZ_EXAMPLES=2000 python3 -m pytest tests/test_fuzz.py runs a long sweep.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import REPO
from typer.testing import CliRunner

from rngaudit.cli import app

EXAMPLES = int(os.environ.get("RNGAUDIT_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

# every command, and how it reads a file without doing slow work: no drawn values, and shard-check
# refused at --devices 0 after it has loaded and checked the spec (so no device process starts)
COMMANDS = [
    ["derive", "--no-values"],
    ["derive", "--no-values", "--strict", "-f", "sarif"],
    ["collisions", "-f", "github"],
    ["collisions", "--no-keys", "--strict", "-f", "json"],
    ["shard-check", "--devices", "0"],
]

WORDS = [
    "rngaudit",
    "model",
    "class",
    "body",
    "setup",
    "rngs",
    "params",
    "dropout",
    "make_rng",
    "param",
    "variable",
    "module",
    "call",
    "name",
    "repeat",
    "stream",
    "label",
    "draw",
    "normal",
    "shape",
    "Dense",
    "Dropout",
    "rate",
    "deterministic",
    "Sequential",
    "layers",
    "vmap",
    "scan",
    "jit",
    "axis_size",
    "length",
    "split_rngs",
    "variable_axes",
    "phase",
    "apply",
    "init",
    "flax",
    "jax",
    "prng_impl",
    "fix_rng_separator",
    "when",
    "collection",
    "eager",
    "features",
    "use_bias",
    "transforms",
    "cond",
    "true_fun",
    "false_fun",
    "while_loop",
    "iterations",
    "M",
    "Block",
    "a",
    "ab",
    "abc",
    "flavour",
    "nnx",
    "linen",
    "keep_rngs",
    "steps",
    "run",
    "stale_call",
    "reseed",
    "fork",
    "shared",
    "Linear",
    "MultiHeadAttention",
    "LayerNorm",
    "rng_collection",
    "dropout_rate",
    "normalize_qk",
    "default",
    "stack",
    "vmap",
    "scan",
    "split",
    "broadcast",
    "name",
    "n",
]
scalars = st.one_of(
    st.sampled_from(WORDS),
    st.integers(-3, 5),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(
        [
            "key(0)",
            "split(key(0), 3)[2]",
            "fold_in(key(1), 7)",
            "[0, 1]",
            "split(key(0))[9]",
            "normal:2,2",
            "threefry2x32",
            "rbg",
            "unsafe_rbg",
            "Dense_0",
            "a/b",
            "",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(WORDS), inner, max_size=4)),
    max_leaves=30,
)
documents = st.fixed_dictionaries(
    {"rngaudit": st.one_of(st.just(1), scalars), "model": values},
    optional={"rngs": values, "phase": values, "flax": values, "jax": values, "mutable": values},
)


TRANSFORM = {
    "vmap": st.one_of(st.integers(0, 3), st.booleans(), scalars),
    "scan": st.one_of(st.integers(0, 3), st.booleans(), scalars),
    "split": st.one_of(st.sampled_from(["dropout", "params", "x"]), values),
    "broadcast": st.one_of(st.sampled_from(["dropout", "params"]), values),
}
nnx_statement = st.one_of(
    st.sampled_from(["Linear", "Dropout", "draw", "call", "module", "MultiHeadAttention", "LayerNorm"]),
    st.dictionaries(st.sampled_from(WORDS), values, min_size=1, max_size=1),
)
nnx_module = st.recursive(
    st.fixed_dictionaries(
        {"class": st.one_of(st.just("M"), scalars)},
        optional={
            "init": st.one_of(st.lists(nnx_statement, max_size=4), values),
            "call": st.one_of(st.lists(nnx_statement, max_size=3), values),
            "keep_rngs": st.one_of(st.booleans(), scalars),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {"class": st.just("M"), "init": st.lists(st.fixed_dictionaries({"module": inner}), max_size=2)},
        optional={
            "call": st.lists(
                st.one_of(
                    st.sampled_from(["call", {"call": "module_0"}, {"call": "m_0"}]),
                    st.fixed_dictionaries(
                        {
                            "call": st.fixed_dictionaries(
                                {"name": st.sampled_from(["module_0", "m_0"])}, optional=TRANSFORM
                            )
                        }
                    ),
                ),
                max_size=2,
            ),
            "stack": st.one_of(st.integers(0, 3), scalars),
        },
    ),
    max_leaves=6,
)
nnx_documents = st.fixed_dictionaries(
    {"rngaudit": st.just(1), "flavour": st.one_of(st.just("nnx"), scalars), "model": nnx_module},
    optional={
        "rngs": st.one_of(st.dictionaries(st.sampled_from(["params", "dropout", "default", "x"]), scalars), values),
        "steps": st.one_of(st.integers(-1, 3), scalars),
        "run": st.one_of(
            st.lists(
                st.one_of(
                    st.sampled_from(["call", "stale_call", "reseed"]),
                    st.fixed_dictionaries({"call": st.fixed_dictionaries({}, optional={"n": scalars, **TRANSFORM})}),
                    values,
                ),
                max_size=3,
            ),
            values,
        ),
        "jax": values,
    },
)


def _dump(doc) -> str:
    def fix(v):  # YAML cannot write every float the same way back; keep the document loadable
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return yaml.safe_dump(fix(doc), default_flow_style=None, allow_unicode=True)


def check_every_command(path: Path) -> None:
    runner = CliRunner()
    for args in COMMANDS:
        r = runner.invoke(app, [*args, str(path)], catch_exceptions=True)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception))
        assert r.exit_code in (0, 1, 2), (args, r.exit_code, r.stderr)
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, (args, r.stderr)
        if r.exit_code == 2:
            assert r.stdout == "" and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (args, r.stderr)


def test_fuzz_random_spec_documents(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz_docs")

    @FUZZ
    @given(documents)
    def check(doc):
        path = folder / "spec.yaml"
        path.write_text(_dump(doc), encoding="utf-8")
        check_every_command(path)

    check()


def test_fuzz_random_nnx_spec_documents(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz_nnx")

    @FUZZ
    @given(nnx_documents)
    def check(doc):
        path = folder / "spec.yaml"
        path.write_text(_dump(doc), encoding="utf-8")
        check_every_command(path)

    check()


def test_fuzz_random_bytes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz_bytes")
    guide = (REPO / "rngaudit" / "examples" / "guide.yaml").read_bytes()

    @FUZZ
    @given(
        st.one_of(
            st.binary(max_size=400),
            st.tuples(st.integers(0, len(guide)), st.binary(min_size=1, max_size=12)).map(
                lambda t: guide[: t[0]] + t[1] + guide[t[0] :]
            ),
        ),
        st.sampled_from(["spec.yaml", "paths.json"]),
    )
    def check(data, name):
        path = folder / name
        path.write_bytes(data)
        check_every_command(path)

    check()


def test_fuzz_random_json_module_paths(tmp_path_factory):
    """collisions reads *.json as module paths or a params tree: random JSON values go there."""
    import json

    folder = tmp_path_factory.mktemp("fuzz_json")
    tree = st.recursive(
        st.one_of(st.integers(), st.text(max_size=6), st.none(), st.lists(st.integers(0, 4))),
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
        max_leaves=20,
    )

    @FUZZ
    @given(tree)
    def check(doc):
        path = folder / "paths.json"
        path.write_text(json.dumps(doc), encoding="utf-8")
        check_every_command(path)

    check()
