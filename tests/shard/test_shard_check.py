"""`rngaudit shard-check`: keys, draws and (key, x) functions on 1, 2, 4 and 8 forced CPU devices and a 2-D mesh.

JAX fixes its device count when it starts, so every forced-device run here is the real command in its own
process (which starts its own device process); one run checks several functions or specs at once. The
guide's values are recomputed in this process with the fixture's own code (one device), as the oracle.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import support
from support import REPO
from typer.testing import CliRunner

from rngaudit.cli import app
from rngaudit.errors import UsageError, UserCodeError
from rngaudit.output.console import console_text
from rngaudit.output.shard_json import from_json, to_json
from rngaudit.output.text_shard import render_shard
from rngaudit.shard.arrays import compare
from rngaudit.shard.devices import partition_for
from rngaudit.shard.request import (
    SpecTarget,
    make_request,
    parse_fn_target,
    parse_mesh,
    parse_shape,
    request_from_json,
    request_json,
)
from rngaudit.shard.runner import child_env
from rngaudit.shard.worker import run_here
from rngaudit.usercode import CodeRef

SHARD = REPO / "fixtures" / "shard"
GUIDE_FN = "fixtures/shard/guide_forward.py:forward"
STEPS = "fixtures/shard/step_functions.py"
BAD = "fixtures/shard/bad_functions.py"
GUIDE_SPECS = sorted(str(p.relative_to(REPO)) for p in (REPO / "fixtures" / "guide").glob("*.yaml"))
APPLY_RNG = "split(key(0))[1]"  # the guide's apply_rng: init_rng, apply_rng = jax.random.split(jax.random.key(0))


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return support.run_cli("shard-check", *args, timeout=timeout)


def run_json(*args: str) -> tuple[int, dict]:
    r = run_cli(*args, "--format", "json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    assert r.stderr == ""
    return r.returncode, json.loads(r.stdout)


def target(doc: dict, name: str) -> dict:
    (t,) = [t for t in doc["targets"] if t["name"] == name]
    return t


def checks(t: dict) -> dict:
    return {c["id"]: c for c in t["checks"]}


def slice_values(check: dict) -> list[float]:
    return [s["values"][0] for s in check["details"]["slices"]]


def one_line_error(r: subprocess.CompletedProcess, *parts: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    for p in parts:
        assert p in r.stderr, r.stderr


@pytest.fixture(scope="module")
def guide_oracle():
    """The guide's numbers, computed here on one device with the fixture's own model and variables."""
    import jax
    import jax.numpy as jnp

    spec = importlib.util.spec_from_file_location("guide_forward_oracle", SHARD / "guide_forward.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    apply_rng = mod.apply_rng
    return {
        "unjitted": np.asarray(mod.forward(apply_rng, jnp.ones((8, 1)))).ravel(),
        "per_device": [
            float(np.asarray(mod.forward(k, jnp.ones((1, 1))))[0, 0]) for k in jax.random.split(apply_rng, 8)
        ],
        "one_key": float(np.asarray(mod.forward(apply_rng, jnp.ones((1, 1))))[0, 0]),
    }


# ---------------------------------------------------------------- 8 devices: the guide's example
@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """One run on 8 forced CPU devices: the guide's forward and three flawed or correct step functions."""
    out = tmp_path_factory.mktemp("eight") / "report.json"
    r = run_cli(
        "--devices",
        "8",
        "--key",
        APPLY_RNG,
        "--fn",
        GUIDE_FN,
        "--fn",
        f"{STEPS}:fold_constant",
        "--fn",
        f"{STEPS}:fold_device_index",
        "--fn",
        f"{STEPS}:ignores_key",
        "--format",
        "json",
        "--output",
        str(out),
    )
    return r, out


def test_guide_example_8_devices_is_a_finding_written_to_output(eight):
    r, out = eight
    assert r.returncode == 1, r.stderr
    assert r.stdout == "" and r.stderr == ""
    text = out.read_text()
    doc = json.loads(text)
    assert text == json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    assert doc["format"] == "rngaudit.shard_check" and doc["format_version"] == 1
    assert doc["devices"] == {
        "platform": "cpu",
        "kind": "cpu",
        "count": 8,
        "ids": list(range(8)),
        "forced": True,
        "processes": 1,
    }
    assert doc["mesh"] == {"axis_names": ["data"], "axis_sizes": [8], "device_ids": list(range(8))}
    env = doc["environment"]
    assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=8")
    assert env["jax_default_prng_impl"] == "threefry2x32" and env["jax_threefry_partitionable"] is True
    import flax
    import jax
    import jaxlib

    assert (env["jax"], env["jaxlib"], env["flax"]) == (jax.__version__, jaxlib.__version__, flax.__version__)
    assert doc["summary"]["failing"] is True


def test_guide_jit_equals_unjitted_and_the_guides_own_numbers(eight, guide_oracle):
    doc = json.loads(eight[1].read_text())
    t = target(doc, GUIDE_FN)
    assert t["info"]["key"] == {"expr": APPLY_RNG, "impl": "threefry2x32", "data": [928981903, 3453687069]}
    assert t["info"]["x"]["shape"] == [8, 1] and t["info"]["batch_partition"] == "P('data')"
    jit = checks(t)["jit_equals_eager"]
    assert jit["status"] == "pass", jit["message"]
    assert jit["details"]["output_blocks"] == 8 and jit["details"]["mismatched"] == 0
    assert np.array_equal(np.float32(jit["details"]["jit"]), guide_oracle["unjitted"])
    assert np.array_equal(np.float32(jit["details"]["eager"]), guide_oracle["unjitted"])


def test_guide_shard_map_split_keys_gives_8_distinct_rows(eight, guide_oracle):
    t = target(json.loads(eight[1].read_text()), GUIDE_FN)
    split = checks(t)["shard_map_split_keys"]
    assert split["status"] == "pass"
    assert [s["device"] for s in split["details"]["slices"]] == list(range(8))
    assert [s["rows"] for s in split["details"]["slices"]] == [[i, i + 1] for i in range(8)]
    values = slice_values(split)
    assert len(set(values)) == 8
    assert np.array_equal(np.float32(values), np.float32(guide_oracle["per_device"]))


def test_guide_unsplit_key_is_information_by_default(eight, guide_oracle):
    # issue 19: the guide's forward takes per-device keys; that one replicated key gives every device the
    # same values is what its callers must know, not a fault of the function: no exit 1 for it
    t = target(json.loads(eight[1].read_text()), GUIDE_FN)
    one = checks(t)["shard_map_replicated_key"]
    assert one["status"] == "info"
    assert one["message"].startswith("all 8 devices drew identical values from one replicated key")
    assert "jax.random.split(key, 8)" in one["message"] and "--replicated-key" in one["message"]
    assert one["details"]["identical_groups"] == [list(range(8))]
    assert set(np.float32(slice_values(one))) == {np.float32(guide_oracle["one_key"])}


@pytest.fixture(scope="module")
def eight_replicated():
    """The guide's forward and a key folded with a constant, said to be called with one replicated key."""
    return run_json(
        "--devices", "8", "--key", APPLY_RNG, "--fn", GUIDE_FN, "--fn", f"{STEPS}:fold_constant", "--replicated-key"
    )


def test_guide_unsplit_key_is_the_same_randomness_finding_with_replicated_key(eight_replicated, guide_oracle):
    code, doc = eight_replicated
    assert code == 1
    one = checks(target(doc, GUIDE_FN))["shard_map_replicated_key"]
    assert one["status"] == "finding"
    assert one["message"].startswith("same randomness on every device: all 8 devices drew identical values")
    assert "jax.random.split(key, 8)" in one["message"] and "(--replicated-key)" in one["message"]
    assert one["details"]["identical_groups"] == [list(range(8))] and one["details"]["replicated_key"] is True
    assert set(np.float32(slice_values(one))) == {np.float32(guide_oracle["one_key"])}


def test_key_folded_with_a_constant_is_caught(eight, eight_replicated):
    for doc, status in ((json.loads(eight[1].read_text()), "info"), (eight_replicated[1], "finding")):
        c = checks(target(doc, f"{STEPS}:fold_constant"))
        assert c["jit_equals_eager"]["status"] == "pass"
        assert c["shard_map_split_keys"]["status"] == "pass"
        assert c["shard_map_replicated_key"]["status"] == status
        assert c["shard_map_replicated_key"]["details"]["identical_groups"] == [list(range(8))]


@pytest.mark.parametrize("devices", ["1", "2", "4", "8"])
def test_correct_key_x_functions_pass_with_exit_0(devices):
    # issue 19: the guide's forward and x * 2 + normal(key, x.shape) exited 1 on 8 devices (a harness check they
    # never claimed to pass), and a function whose jit run differs from eager by rounding failed jit_equals_eager
    fns = [GUIDE_FN, f"{STEPS}:affine_noise", f"{STEPS}:rounding"]
    code, doc = run_json("--devices", devices, *[a for f in fns for a in ("--fn", f)])
    assert code == 0, [c["message"] for t in doc["targets"] for c in t["checks"] if c["status"] != "pass"]
    assert doc["summary"]["fail"] == doc["summary"]["finding"] == 0
    assert doc["summary"]["info"] == (len(fns) if devices != "1" else 0)


def test_rounding_is_accepted_by_default_and_reported_bit_for_bit_with_atol_0():
    fn = f"{STEPS}:rounding"
    code, doc = run_json("--devices", "8", "--fn", fn)
    jit = checks(target(doc, fn))["jit_equals_eager"]
    assert code == 0 and jit["status"] == "pass"
    d = jit["details"]
    assert d["tolerance"] == "rounding" and d["mismatched"] == 0 and d["not_bitwise_equal"] > 0, d
    assert f"up to XLA's rounding: {d['not_bitwise_equal']} of {d['elements']} values differ" in jit["message"]
    code, doc = run_json("--devices", "8", "--fn", fn, "--atol", "0")
    jit = checks(target(doc, fn))["jit_equals_eager"]
    assert code == 1 and jit["status"] == "fail" and "These are rounding differences" in jit["message"]
    # a different random value is never rounding: host randomness drawn once at trace time still fails
    code, doc = run_json("--devices", "2", "--fn", f"{STEPS}:host_random")
    assert code == 1 and checks(target(doc, f"{STEPS}:host_random"))["jit_equals_eager"]["status"] == "fail"


def test_key_folded_with_the_device_index_passes(eight):
    t = target(json.loads(eight[1].read_text()), f"{STEPS}:fold_device_index")
    c = checks(t)
    assert t["info"]["mesh_axes_only"] is True
    assert c["jit_equals_eager"]["status"] == "n/a" and "only inside shard_map" in c["jit_equals_eager"]["message"]
    assert c["shard_map_replicated_key"]["status"] == "pass"
    assert len(set(slice_values(c["shard_map_replicated_key"]))) == 8


def test_function_that_ignores_the_key_fails_split_keys(eight):
    c = checks(target(json.loads(eight[1].read_text()), f"{STEPS}:ignores_key"))
    assert c["shard_map_split_keys"]["status"] == "fail"
    assert "does not depend on the key" in c["shard_map_split_keys"]["message"]
    assert c["shard_map_split_keys"]["details"]["identical_groups"] == [list(range(8))]


def test_allow_replicated_exits_0_with_a_text_report():
    r = run_cli("--devices", "8", "--fn", GUIDE_FN, "--allow-replicated")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert "shard-check on 8 cpu device(s) (cpu, forced with --devices 8); mesh data=8" in out
    assert "jax_default_prng_impl=threefry2x32  jax_threefry_partitionable=True" in out
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in out
    assert "PASS    jit equals eager" in out
    assert "ALLOWED shard_map, one key    same randomness on every device" in out
    assert "(intended: --allow-replicated)" in out
    assert out.rstrip().endswith("3 checks: 2 pass, 0 fail, 0 finding, 1 allowed, 0 info, 0 n/a")


# ---------------------------------------------------------------- 1, 2 devices and a 2-D mesh
_PARENT_WITHOUT_JAX = textwrap.dedent("""
    import sys
    from rngaudit.cli import main
    sys.argv = ["rngaudit", "shard-check", *sys.argv[1:]]
    try:
        main()
    except SystemExit as e:
        code = e.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
    sys.stderr.write(f"exit {code} imported {heavy}\\n")
""")


def test_one_device_and_the_command_never_imports_jax(tmp_path):
    out = tmp_path / "one.json"
    r = subprocess.run(
        [sys.executable, "-c", _PARENT_WITHOUT_JAX, "--devices", "1", "--fn", GUIDE_FN, "-f", "json", "-o", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.stderr.strip().splitlines()[-1] == "exit 0 imported []", r.stderr
    doc = json.loads(out.read_text())
    assert doc["devices"]["count"] == 1 and doc["mesh"]["axis_sizes"] == [1]
    c = checks(target(doc, GUIDE_FN))
    assert c["jit_equals_eager"]["status"] == "pass"
    assert c["shard_map_split_keys"]["message"] == "one device: no other device to differ from"
    assert c["shard_map_replicated_key"]["status"] == "pass"


def test_two_devices_correct_per_device_keys_exit_0():
    code, doc = run_json(
        "--devices", "2", "--fn", f"{STEPS}:fold_device_index", "--shape", "4,3", "--input", "normal", "--seed", "7"
    )
    assert code == 0
    t = target(doc, f"{STEPS}:fold_device_index")
    assert t["info"]["x"] == {"shape": [4, 3], "dtype": "float32", "fill": "normal", "seed": 7}
    assert t["info"]["rows_per_device"] == 2
    c = checks(t)
    assert c["shard_map_split_keys"]["status"] == c["shard_map_replicated_key"]["status"] == "pass"
    slices = c["shard_map_replicated_key"]["details"]["slices"]
    assert [s["rows"] for s in slices] == [[0, 2], [2, 4]] and all(s["size"] == 6 for s in slices)


def test_2d_mesh_data_4_model_2():
    both_axes = "fixtures.shard.step_functions:fold_both_axes"  # a module name, imported from the current directory
    code, doc = run_json(
        "--devices",
        "8",
        "--mesh",
        "data=4,model=2",
        "--fn",
        GUIDE_FN,
        "--fn",
        f"{STEPS}:fold_model_axis",
        "--fn",
        both_axes,
        "--replicated-key",
    )
    assert code == 1
    assert doc["mesh"] == {
        "axis_names": ["data", "model"],
        "axis_sizes": [4, 2],
        "device_ids": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }
    guide = checks(target(doc, GUIDE_FN))
    assert target(doc, GUIDE_FN)["info"]["batch_partition"] == "P(('data', 'model'))"
    assert guide["jit_equals_eager"]["status"] == "pass" and guide["jit_equals_eager"]["details"]["output_blocks"] == 8
    assert len(set(slice_values(guide["shard_map_split_keys"]))) == 8
    assert guide["shard_map_replicated_key"]["details"]["identical_groups"] == [list(range(8))]
    assert "axis_index(('data', 'model'))" in guide["shard_map_replicated_key"]["message"]
    # folding in only 'model': the four devices along 'data' with the same model index repeat each other
    model = checks(target(doc, f"{STEPS}:fold_model_axis"))["shard_map_replicated_key"]
    assert model["status"] == "finding"
    assert model["message"].startswith("same randomness on several devices")
    assert model["details"]["identical_groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    both = checks(target(doc, both_axes))
    assert both["shard_map_replicated_key"]["status"] == "pass"
    assert len(set(slice_values(both["shard_map_replicated_key"]))) == 8


# ---------------------------------------------------------------- 4 devices: every guide spec
def test_every_guide_spec_on_4_devices():
    forks = "fixtures/shard/forks.yaml"
    code, doc = run_json("--devices", "4", *GUIDE_SPECS, forks, "--fn", GUIDE_FN, "--allow-replicated")
    assert code == 0
    assert doc["devices"]["count"] == 4
    specs = [t for t in doc["targets"] if t["kind"] == "spec"]
    assert [t["name"] for t in specs] == GUIDE_SPECS + [forks]
    total = {"keys": 0, "base_keys": 0, "draws": 0}
    for t in specs:
        c = checks(t)
        assert c["root_keys"]["status"] == "pass", (t["name"], c["root_keys"])
        assert c["keys"]["status"] == "pass", (t["name"], c["keys"])
        assert c["keys"]["details"]["checked"] == t["info"]["checked_keys"] > 0
        assert c["base_keys"]["status"] in ("pass", "n/a") and c["draws"]["status"] in ("pass", "n/a")
        for k in total:
            total[k] += c[k]["details"].get("checked", 0) if c[k]["status"] == "pass" else 0
    assert total["keys"] >= 100 and total["base_keys"] >= 10 and total["draws"] >= 40, total
    scan = target(doc, "fixtures/guide/scan_split.yaml")
    assert scan["info"]["not_checked_discarded"] > 0  # keys of scan's discarded trace have no base: skipped
    jit_apply = checks(target(doc, "fixtures/guide/jit_apply.yaml"))["draws"]
    assert jit_apply["details"]["partitions"] == ["P('data', None)"]  # normal [8, 1] split over the 4 devices
    assert jit_apply["details"]["split_over_devices"] == 1
    # base keys of every kind: 2 jit forks, 6 while_loop folds (cond folds -i for i in 0..3, the body +i for
    # i in 0..2; i = 0 is one key), and 4 scan steps of each of params and dropout
    bases = checks(target(doc, forks))["base_keys"]
    assert bases["status"] == "pass"
    assert (bases["details"]["folds"], bases["details"]["splits"]) == (8, 8)
    fn = checks(target(doc, GUIDE_FN))
    assert fn["jit_equals_eager"]["status"] == "pass" and fn["shard_map_replicated_key"]["status"] == "allowed"
    assert len(set(slice_values(fn["shard_map_split_keys"]))) == 4


def test_path_stream_and_draw_choose_what_is_checked():
    code, doc = run_json(
        "--devices",
        "2",
        "fixtures/guide/training_loop_init.yaml",
        "--path",
        "SubModule_0*",
        "--stream",
        "params",
        "--draw",
        "uniform:6",
    )
    assert code == 0
    t = doc["targets"][0]
    assert t["info"]["paths"] == ["SubModule_0*"] and t["info"]["streams"] == ["params"]
    assert t["info"]["checked_keys"] == 3 < t["info"]["keys"] == 6
    c = checks(t)
    assert c["keys"]["details"]["checked"] == 3
    assert c["draws"]["details"]["checked"] == 3
    assert "P('data')" in c["draws"]["details"]["partitions"]


# ---------------------------------------------------------------- in this process: the comparisons bite
def test_a_wrong_host_key_and_its_draw_are_reported(monkeypatch):
    """Corrupt one key of the host derivation: the device re-derivation and the sharded draw disagree."""
    import dataclasses

    from rngaudit.engine import derive as report_mod

    real = report_mod.derive

    def corrupted(spec, **kw):
        r = real(spec, **kw)
        c = r.calls[0]
        bad = dataclasses.replace(c, key=(c.key[0] ^ 1,) + tuple(c.key[1:]))
        return dataclasses.replace(r, calls=[bad] + r.calls[1:])

    monkeypatch.setattr(report_mod, "derive", corrupted)
    rep, _ = run_here(make_request(specs=[SpecTarget("fixtures/guide/jit_init.yaml")]))
    c = {x.id: x for x in rep.targets[0].checks}
    assert c["keys"].status == "fail" and c["keys"].details["mismatched"] == 1
    row = c["keys"].details["mismatches"][0]
    assert row["path_str"] == "Dense_0" and row["host"][0] ^ 1 == row["device"][0]
    assert c["draws"].status == "fail" and c["draws"].details["mismatches"][0]["path_str"] == "Dense_0"
    assert rep.failing
    text = console_text(lambda console: render_shard(rep, console), to_terminal=False)
    assert "FAIL    keys                  1 of 2 keys re-derived on the devices differ" in text
    assert f"#0 Dense_0 params count 1: host {row['host']} device {row['device']}" in text
    assert "#0 Dense_0 params count 1 lecun_normal(shape=[1, 1]" in text


def test_jit_that_differs_from_eager_fails_in_this_process():
    rep, _ = run_here(make_request(fns=[parse_fn_target(f"{STEPS}:host_random")]))
    jit = {x.id: x for x in rep.targets[0].checks}["jit_equals_eager"]
    assert jit.status == "fail"
    assert "larger than rounding" in jit.message
    assert from_json(to_json(rep)) == rep
    text = console_text(lambda console: render_shard(rep, console), to_terminal=False)
    assert "FAIL    jit equals eager      under jax.jit with the batch sharded over data=1" in text
    assert "eager    1" in text and "jit      1" in text


# ---------------------------------------------------------------- bad input: exit 2, one line, no hang
@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0", "--fn", GUIDE_FN], "--devices 0: ask for 1 to 1024 CPU devices"),
        (["--devices", "-3", "--fn", GUIDE_FN], "--devices -3: ask for 1 to 1024 CPU devices"),
        (["--devices", "100000", "--fn", GUIDE_FN], "--devices 100000: ask for 1 to 1024 CPU devices"),
        (
            ["--devices", "8", "--mesh", "data=4,model=4", "--fn", GUIDE_FN],
            "--mesh data=4,model=4: the sizes multiply to 16, but --devices asks for 8",
        ),
        (["--mesh", "data:4", "--fn", GUIDE_FN], "write axis sizes as NAME=SIZE"),
        (["--mesh", "data=2,data=2", "--fn", GUIDE_FN], "axis 'data' is named twice"),
        (["--mesh", "data=0", "--fn", GUIDE_FN], "sizes are at least 1"),
        (["--platform", "quantum", "--fn", GUIDE_FN], "--platform 'quantum': use one of cpu, gpu, tpu"),
        (["--platform", "gpu", "--devices", "8", "--fn", GUIDE_FN], "--devices makes CPU devices"),
        (["--fn", "fixtures/shard/missing.py:forward"], "no such file 'fixtures/shard/missing.py'"),
        (["--fn", "forward"], "write FILE.py:FUNCTION or package.module:FUNCTION"),
        (["--fn", "a-b:forward"], "is neither a .py file nor a module name"),
        (["--fn", GUIDE_FN, "--devices", "4", "--shape", "6,1"], "6 rows do not divide over 4 devices"),
        (["--fn", GUIDE_FN, "--shape", "8,x"], "write the shape of x as comma-separated sizes"),
        (["--fn", GUIDE_FN, "--input", "zeros"], "--input 'zeros': use ones or normal"),
        (
            ["--fn", GUIDE_FN, "--key", "splt(key(0))"],
            "--key:1:2: bad key expression 'splt(key(0))': unknown function 'splt'",
        ),
        (["--fn", GUIDE_FN, "--timeout", "0"], "--timeout 0.0: give a positive number of seconds"),
        (["--fn", GUIDE_FN, "--atol", "-1"], "--atol -1.0: give a finite tolerance"),
        ([], "give a SPEC to check its keys and draws, or --fn"),
        (["--path", "Dense_*", "--fn", GUIDE_FN], "--path applies to a SPEC, and no SPEC is given"),
        (["fixtures/guide/jit_init.yaml", "--allow-replicated"], "--allow-replicated applies to --fn"),
        (["fixtures/guide/jit_init.yaml", "--replicated-key"], "--replicated-key applies to --fn"),
        (["--fn", GUIDE_FN, "--replicated-key", "--allow-replicated"], "give one of them"),
        (["fixtures/guide/no_such.yaml"], "fixtures/guide/no_such.yaml"),
        (["fixtures/guide/jit_init.yaml", "--draw", "gamma:2"], "unknown distribution 'gamma'"),
    ],
)
def test_bad_options_exit_2_before_any_device_process(args, message, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", None)  # no child may start for these
    r = CliRunner().invoke(app, ["shard-check", *args], catch_exceptions=False)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, parts",
    [
        (["--fn", "no_such_module_xyz:forward"], ["no module named 'no_such_module_xyz'"]),
        (["--fn", f"{BAD}:nothing_here"], ["has no 'nothing_here'", "it defines one_argument, raises"]),
        (["--fn", f"{BAD}:not_a_function"], ["not_a_function is a int, not a function"]),
        (["--fn", f"{BAD}:one_argument"], ["one_argument(key) cannot be called as one_argument(key, x)"]),
        (["--fn", f"{BAD}:raises"], ["raised ZeroDivisionError when run eagerly on one device"]),
        (
            ["--fn", f"{BAD}:scalar_output"],
            ["returned shape (); shard-check needs outputs whose first axis is the batch, as x's (1)"],
        ),
        (
            ["--fn", "fixtures/shard/syntax_error.py:forward"],
            [("importing fixtures/shard/syntax_error.py raised SyntaxError")],
        ),
        (["--fn", GUIDE_FN, "--mesh", "data=3"], ["--mesh data=3: the sizes multiply to 3, but 1 cpu device(s)"]),
        (["fixtures/guide/jit_init.yaml", "--path", "Nope*"], ["--path 'Nope*' select none of its 2 keys"]),
        (
            ["--fn", f"{STEPS}:fold_model_axis"],
            [
                (
                    "raised NameError under shard_map with split keys over the mesh axes "
                    "data: Found an unbound axis name: model"
                ),
                "give --mesh",
            ],
        ),
    ],
)
def test_bad_functions_and_meshes_found_by_the_device_process_exit_2(args, parts):
    one_line_error(run_cli(*args, "--platform", "cpu"), *parts)


def test_a_missing_platform_exits_2():
    import jax

    def present(p):
        try:
            return bool(jax.devices(p))
        except RuntimeError:
            return False

    missing = [p for p in ("gpu", "tpu") if not present(p)]
    assert missing, "this machine has both GPUs and TPUs"
    one_line_error(
        run_cli("--platform", missing[0], "--fn", GUIDE_FN),
        f"--platform {missing[0]}: no {missing[0]} devices can be had here",
    )


def test_a_run_past_the_timeout_is_stopped():
    # (a run that is not stopped ends the test with subprocess.TimeoutExpired after 60 s)
    r = run_cli("--devices", "2", "--fn", f"{BAD}:sleeps", "--timeout", "4", timeout=60)
    one_line_error(r, "the device run did not finish within 4 s (--timeout 4)")


# ---------------------------------------------------------------- the pieces, in this process
def test_parse_mesh_shape_and_fn_target():
    assert parse_mesh("data=4, model=2") == (("data", 4), ("model", 2))
    assert parse_shape("8,1") == (8, 1)
    assert parse_fn_target(GUIDE_FN) == CodeRef(GUIDE_FN, "fixtures/shard/guide_forward.py", None, "forward")
    assert parse_fn_target("pkg.mod:Model.step") == CodeRef("pkg.mod:Model.step", None, "pkg.mod", "Model.step")
    with pytest.raises(UsageError):
        parse_shape("0,1")
    with pytest.raises(UserCodeError):
        parse_fn_target("nowhere/f.py:g")


def test_partition_for_puts_each_axis_on_the_first_dimension_it_divides():
    axes = [("data", 4), ("model", 2)]
    assert partition_for((8, 1), axes) == (("data", "model"), None)
    assert partition_for((4, 6), axes) == ("data", "model")
    assert partition_for((2, 2), axes) == ("model", None)
    assert partition_for((), axes) == ()


def test_child_env_forces_cpu_devices_and_keeps_other_xla_flags():
    req = make_request(fns=[parse_fn_target(GUIDE_FN)], devices=4)
    env = child_env(
        req, {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cuda"}
    )
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    assert env["JAX_NUM_CPU_DEVICES"] == "4" and env["JAX_PLATFORMS"] == "cpu"
    real = child_env(make_request(fns=[parse_fn_target(GUIDE_FN)]), {"XLA_FLAGS": "--x=1"})
    assert real["XLA_FLAGS"] == "--x=1" and "JAX_PLATFORMS" not in real


def test_request_round_trips_through_json():
    from rngaudit.api import parse_draw as _parse_draw

    req = make_request(
        specs=[SpecTarget("a.yaml", "apply", ("D*",), ("params",), _parse_draw("uniform:3"))],
        fns=[parse_fn_target("pkg.mod:f")],
        mesh="data=2,model=2",
        shape="4,2",
        fill="normal",
        key="fold_in(key(3), 7)",
        atol=1e-6,
        timeout=9,
    )
    assert request_from_json(json.loads(json.dumps(request_json(req)))) == req


def test_compare_is_bit_for_bit_and_counts_ulps():
    a = np.array([1.0, -2.0, 0.0], np.float32)
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(0))
    assert compare(a, b) == {"mismatched": 1, "max_abs_diff": pytest.approx(1.192e-7, rel=1e-3), "max_ulp": 1}
    assert compare(a, b, atol=1e-6)["mismatched"] == 0
    assert compare(np.array([0.0], np.float32), np.array([-0.0], np.float32))["mismatched"] == 1
    assert compare(np.array([True]), np.array([False])) == {"mismatched": 1, "max_abs_diff": None, "max_ulp": None}
