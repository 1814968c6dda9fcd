"""`rngaudit derive`: formats, options, exit codes and file output, in-process and as a real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support import REPO, invoke, run_cli, write

import rngaudit
from rngaudit.engine.hashing import produce_hash

GUIDE = str(REPO / "rngaudit" / "examples" / "guide.yaml")

# The guide's init keys: (path, label, stream, count, hash items) in call order.
GUIDE_CALLS = [
    (["Dense_0"], "kernel", "params", 1, ["Dense_0", 1]),
    ([], "model_param", "params", 1, [1]),
    ([], "model_variable1", "params", 2, [2]),
    ([], "model_variable2", "other", 1, [1]),
    (["Dense_1"], "kernel", "params", 1, ["Dense_1", 1]),
    (["Dense_1"], "bias", "params", 2, ["Dense_1", 2]),
]


@pytest.fixture
def fallback_spec(tmp_path) -> str:
    """A make_rng('dropout') with only `params` passed: Flax falls back to params (a note)."""
    return write(
        tmp_path,
        "fallback.yaml",
        """
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: M
          body:
            - make_rng: dropout
            - make_rng: params
        """,
    )


@pytest.fixture
def clean_spec(tmp_path) -> str:
    return write(
        tmp_path,
        "clean.yaml",
        """
        rngaudit: 1
        rngs: {params: 0, dropout: 1}
        model:
          class: M
          body:
            - make_rng: dropout
            - make_rng: params
        """,
    )


# ---------------------------------------------------------------- derive on the guide
def test_guide_text():
    r = invoke("derive", GUIDE)
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "phase=init" in out and "impl=threefry2x32" in out
    assert "rngs['params'] = 0 -> [0, 0]" in out
    assert "rngs['other'] = 1 -> [0, 1]" in out
    for path, label, *_ in GUIDE_CALLS:
        assert label in out
    assert "6 keys, 0 falling back to 'params'" in out
    assert "\x1b[" not in out  # no colour when not a terminal
    assert r.stderr == ""


def guide_json() -> dict:
    r = invoke("derive", GUIDE, "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert r.stderr == ""
    return r.stdout


def test_guide_json_shape_and_keys():
    text = guide_json()
    doc = json.loads(text)
    assert doc["format"] == "rngaudit.derive"
    assert doc["format_version"] == 1
    assert doc["rngaudit_version"] == rngaudit.__version__
    assert doc["phase"] == "init"
    assert doc["jax"] == {"prng_impl": "threefry2x32", "threefry_partitionable": True, "version": None}
    assert doc["flax"] == {"fix_rng_separator": False, "version": None, "jit": "fork", "stream_fallback": True}
    assert doc["rules"] == "flax>=0.10.2 (Linen: nn.jit forks a key per stream on every call)"
    assert doc["rngs"]["params"]["key"] == [0, 0] and doc["rngs"]["other"]["key"] == [0, 1]
    calls = doc["calls"]
    assert [(c["path"], c["label"], c["stream"], c["count"], c["hash_items"]) for c in calls] == GUIDE_CALLS
    assert doc["summary"] == {"calls": 6, "fallbacks": 0, "discarded": 0}
    for c in calls:
        assert isinstance(c["key"], list) and len(c["key"]) == 2
        assert all(isinstance(w, int) and 0 <= w < 2**32 for w in c["key"])
        assert c["hash_word"] == produce_hash(c["hash_items"])
        assert c["values"]["shape"] in ([2, 2], [2])
    # keys are what jax.random gives for fold_in(rngs[stream], hash word)
    jax = pytest.importorskip("jax")
    import numpy as np

    for c in calls:
        root = jax.random.key(0 if c["stream"] == "params" else 1)
        want = np.asarray(jax.random.key_data(jax.random.fold_in(root, np.uint32(c["hash_word"])))).tolist()
        assert c["key"] == want


def test_guide_json_is_sorted_and_deterministic():
    first, second = guide_json(), guide_json()
    assert first == second
    doc = json.loads(first)
    assert first == json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def test_guide_json_deterministic_across_processes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        r = run_cli("derive", GUIDE, "-f", "json", "--no-values", "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert r.stdout == "" and r.stderr == ""
    assert a.read_bytes() == b.read_bytes()
    assert json.loads(a.read_text())["calls"][0]["key"] == [3043437727, 3662875008]


# ---------------------------------------------------------------- options
def test_no_values():
    doc = json.loads(invoke("derive", GUIDE, "-f", "json", "--no-values").stdout)
    assert all("values" not in c for c in doc["calls"])
    assert [c["key"] for c in doc["calls"]] == [c["key"] for c in json.loads(guide_json())["calls"]]
    text = invoke("derive", GUIDE, "--no-values").stdout
    assert "normal(shape=" not in text


def test_draw_default(clean_spec):
    r = invoke("derive", clean_spec, "-f", "json", "--draw", "normal:2")
    assert r.exit_code == 0, r.stderr
    calls = json.loads(r.stdout)["calls"]
    assert len(calls) == 2
    for c in calls:
        assert c["values"]["kind"] == "normal"
        assert c["values"]["shape"] == [2]
        assert len(c["values"]["data"]) == 2
    jax = pytest.importorskip("jax")
    import numpy as np

    k = jax.random.wrap_key_data(np.asarray(calls[0]["key"], np.uint32))
    assert np.allclose(np.asarray(jax.random.normal(k, (2,))), calls[0]["values"]["data"], rtol=0, atol=0)
    # without --draw there are no values, and --no-values wins over --draw
    assert all("values" not in c for c in json.loads(invoke("derive", clean_spec, "-f", "json").stdout)["calls"])
    r = invoke("derive", clean_spec, "-f", "json", "--draw", "normal:2", "--no-values")
    assert all("values" not in c for c in json.loads(r.stdout)["calls"])


def test_draw_spec_draws_win_over_default():
    doc = json.loads(invoke("derive", GUIDE, "-f", "json", "--draw", "uniform:3").stdout)
    assert {c["values"]["kind"] for c in doc["calls"]} == {"normal"}


@pytest.mark.parametrize(
    "bad, message",
    [
        ("bogus:2", "--draw:1:1: unknown distribution 'bogus'"),
        ("normal:2,x", "--draw 'normal:2,x': the shape must be integers"),
        ("normal:-1", "a shape dimension must be between 0"),
        ("randint:2", "randint draw needs `minval`"),
    ],
)
def test_bad_draw_is_a_usage_error(clean_spec, bad, message, tmp_path):
    out = tmp_path / "out.json"
    r = invoke("derive", clean_spec, "--draw", bad, "-o", str(out))
    assert r.exit_code == 2
    assert r.stdout == ""
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert message in r.stderr
    assert not out.exists()


def test_draw_over_every_key_is_bounded(tmp_path):
    out = tmp_path / "out.json"
    r = invoke("derive", GUIDE, "--draw", "normal:3000,3000", "-o", str(out))
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.startswith("error: --draw:1:1: --draw 'normal:3000,3000' draws up to ")
    assert "use --no-values" in r.stderr and not out.exists()
    # without values nothing is drawn, so the same option is fine
    assert invoke("derive", GUIDE, "--draw", "normal:3000,3000", "--no-values").exit_code == 0


def test_phase_override(tmp_path):
    # in apply, the guide's params and variables exist already: no key is drawn
    r = invoke("derive", GUIDE, "-f", "json", "--phase", "apply")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["phase"] == "apply" and doc["calls"] == []
    spec = write(
        tmp_path,
        "apply.yaml",
        """
        rngaudit: 1
        phase: apply
        rngs: {params: 0, dropout: 1}
        model:
          class: M
          body:
            - param: w
            - Dropout: {rate: 0.5, deterministic: false}
        """,
    )
    apply = json.loads(invoke("derive", spec, "-f", "json").stdout)
    assert [(c["stream"], c["kind"]) for c in apply["calls"]] == [("dropout", "dropout")]
    init = json.loads(invoke("derive", spec, "-f", "json", "--phase", "init").stdout)
    assert init["phase"] == "init"
    assert [(c["stream"], c["label"]) for c in init["calls"]] == [("params", "w"), ("dropout", "dropout mask")]
    r = invoke("derive", spec, "--phase", "train")
    assert r.exit_code == 2


def test_strict_exit_1_with_a_fallback_note(fallback_spec, tmp_path):
    r = invoke("derive", fallback_spec)
    assert r.exit_code == 0
    assert "falls back to 'params'" in r.stdout
    r = invoke("derive", fallback_spec, "--strict")
    assert r.exit_code == 1
    assert "1 falling back to 'params'" in r.stdout  # the report is still printed
    doc = json.loads(invoke("derive", fallback_spec, "-f", "json").stdout)
    assert doc["summary"]["fallbacks"] == 1
    assert doc["calls"][0]["fallback"] is True and doc["calls"][0]["stream_requested"] == "dropout"
    # with --output the report is written, and the exit code still says "findings"
    out = tmp_path / "strict.json"
    r = invoke("derive", fallback_spec, "--strict", "-f", "json", "-o", str(out))
    assert r.exit_code == 1 and r.stdout == ""
    assert json.loads(out.read_text())["summary"]["fallbacks"] == 1


def test_strict_exit_0_without_notes(clean_spec):
    assert invoke("derive", clean_spec, "--strict").exit_code == 0
    assert invoke("derive", GUIDE, "--strict", "--no-values").exit_code == 0


# ---------------------------------------------------------------- --output
def test_output_written_only_on_success(tmp_path):
    out = tmp_path / "report.json"
    r = invoke("derive", GUIDE, "-f", "json", "-o", str(out))
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""
    assert out.read_text(encoding="utf-8") == guide_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary left
    text_out = tmp_path / "report.txt"
    assert invoke("derive", GUIDE, "-o", str(text_out)).exit_code == 0
    assert "6 keys, 0 falling back to 'params'" in text_out.read_text(encoding="utf-8")
    # `-o -` is stdout
    r = invoke("derive", GUIDE, "-f", "json", "-o", "-")
    assert r.stdout == guide_json()


def test_output_untouched_when_the_run_fails(tmp_path):
    bad = write(tmp_path, "bad.yaml", "rngaudit: 1\nmodel: {class: M, bdy: []}\n")
    out = tmp_path / "report.json"
    r = invoke("derive", bad, "-o", str(out))
    assert r.exit_code == 2 and not out.exists()
    out.write_text("previous report\n")
    r = invoke("derive", bad, "-o", str(out))
    assert r.exit_code == 2
    assert out.read_text() == "previous report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "report.json"]


def test_output_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    import rngaudit.cli.writing as cli

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.os, "replace", broken_replace)
    out = tmp_path / "report.json"
    r = invoke("derive", GUIDE, "-f", "json", "-o", str(out))
    assert r.exit_code == 2
    assert r.stdout == ""
    assert r.stderr == f"error: --output {out}: cannot write (No space left on device)\n"
    assert list(tmp_path.iterdir()) == []


def test_output_into_a_missing_directory_or_onto_a_directory(tmp_path):
    r = invoke("derive", GUIDE, "-o", str(tmp_path / "nope" / "report.txt"))
    assert r.exit_code == 2 and "cannot write there" in r.stderr and r.stderr.count("\n") == 1
    r = invoke("derive", GUIDE, "-o", str(tmp_path))
    assert r.exit_code == 2 and "is a directory" in r.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the command itself
def test_version():
    r = invoke("--version")
    assert r.exit_code == 0
    assert r.stdout.strip() == f"rngaudit {rngaudit.__version__}"


def test_python_dash_m(tmp_path):
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"rngaudit {rngaudit.__version__}"
    r = run_cli("derive", GUIDE, "--no-values")
    assert r.returncode == 0, r.stderr
    assert "6 keys, 0 falling back to 'params'" in r.stdout
    assert r.stderr == ""


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["derive", GUIDE, "--bogus"],
            "error: no such option: --bogus (Possible options: --columns); see 'rngaudit derive --help'",
        ),
        (["derive"], "error: missing argument 'SPEC'; see 'rngaudit derive --help'"),
        (
            ["derive", GUIDE, "--format", "yaml"],
            (
                "error: invalid value for '--format' / '-f': 'yaml' is not one of 'text', 'json', 'github', "
                "'sarif', 'jsonl'; see 'rngaudit derive --help'"
            ),
        ),
        (["nosuchcommand"], "error: no such command 'nosuchcommand'; see 'rngaudit --help'"),
        (
            ["shard-check", "--devices", "many"],
            "error: invalid value for '--devices': 'many' is not a valid int; see 'rngaudit shard-check --help'",
        ),
    ],
)
def test_usage_errors_are_one_error_line_and_exit_2(args, line):
    # issue 17: click's four-line usage block is one `error:` line naming the command's --help, as every
    # other usage error; in process and as a real process
    r = invoke(*args)
    assert (r.exit_code, r.stdout, r.stderr) == (2, "", line + "\n")
    r = run_cli(*args)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", line + "\n")


def test_no_command_still_shows_the_help():
    r = run_cli()
    assert r.returncode == 2 and "Usage: rngaudit [OPTIONS] COMMAND [ARGS]..." in r.stdout + r.stderr


def test_internal_errors_are_one_line_and_exit_3(monkeypatch):
    """A bug of rngaudit's is told apart from bad input: its own exit code, and a request to report it."""
    import rngaudit.engine.derive as report

    def boom(*a, **k):
        raise RuntimeError("unexpected\nstate")

    monkeypatch.setattr(report, "derive", boom)
    r = invoke("derive", GUIDE)
    assert r.exit_code == 3 and r.stdout == ""
    assert r.stderr.startswith("error: internal error (RuntimeError: unexpected\\nstate)")
    assert "please report it" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


_NO_JAX = textwrap.dedent("""
    import sys
    from rngaudit.cli import main
    sys.argv = ["rngaudit", "derive", sys.argv[1], "--no-values", "--format", sys.argv[2],
                "--output", sys.argv[3]]
    try:
        main()
    except SystemExit as e:
        assert e.code == 0, e.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
    print("imported:", heavy)
    assert not heavy, heavy
""")


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_no_values_does_not_import_jax(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    r = subprocess.run(
        [sys.executable, "-c", _NO_JAX, GUIDE, fmt, str(out)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "imported: []" in r.stdout
    assert out.exists() and out.stat().st_size > 0


def test_filters_that_match_nothing_warn_and_the_summary_says_n_of_m():
    r = invoke("derive", GUIDE, "--stream", "nosuch", "--path", "zz*")
    assert r.exit_code == 0
    assert r.stderr.splitlines() == [
        "warning: --stream nosuch matches no call site (the streams asked for: other, params)",
        "warning: --path zz* matches no module path ('/'-joined, '(root)' for the root)",
    ]
    assert r.stdout.rstrip().endswith("0 of 6 keys, 0 falling back to 'params'")
    one = invoke("derive", GUIDE, "--stream", "other")
    assert one.stderr == "" and one.stdout.rstrip().endswith("1 of 6 keys, 0 falling back to 'params'")
    nnx = invoke("derive", REPO / "rngaudit" / "examples" / "nnx_guide.yaml", "--stream", "nosuch")
    assert "warning: --stream nosuch matches no call site" in nnx.stderr
    assert nnx.stdout.rstrip().endswith("0 of 26 keys, 0 served by 'default' for another stream")


@pytest.mark.parametrize(
    "env,jax_first,platforms",
    [
        ({}, False, "cpu"),  # values are drawn on the CPU: no accelerator is brought up for them
        ({"JAX_PLATFORMS": "cpu,tpu"}, False, "cpu,tpu"),  # the user's choice stands
        ({}, True, None),  # JAX already started (the Python API inside a user's program): left alone
    ],
)
def test_derive_starts_jax_on_the_cpu_alone_unless_told_otherwise(env, jax_first, platforms):
    code = (
        ("import jax\n" if jax_first else "")
        + "from rngaudit.cli.boundary import values_on_the_cpu\nvalues_on_the_cpu()\n"
        + "import jax, json\nprint(json.dumps(jax.config.jax_platforms))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    assert json.loads(r.stdout) == platforms
