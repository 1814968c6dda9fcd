"""`shard-check --fn STEP --args FACTORY` (issue 19): the user's training step run as written, its randomness
observed on each device and process, identical randomness along a data axis (or across processes) a finding.

Every run is the real command in its own process (it starts its device processes). The oracle for what a device
drew is JAX itself: the keys a fixture's step hands its samplers are recomputed here (jax.random.fold_in, split)
and compared with the key data shard-check reports."""

from __future__ import annotations

import json
import subprocess

import pytest
import support

from rngaudit.errors import UsageError
from rngaudit.shard.request import make_request, parse_args_factory, parse_fn_target, request_from_json, request_json
from rngaudit.shard.step_analysis import analyse

STEPS = "fixtures/shard/train_steps.py"


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return support.run_cli("shard-check", *args, timeout=timeout)


def run_json(*args: str) -> tuple[int, dict]:
    r = run(*args, "--format", "json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout)


def step(fn: str, args: str, *extra: str) -> tuple[int, dict]:
    code, doc = run_json("--fn", f"{STEPS}:{fn}", "--args", f"{STEPS}:{args}", *extra)
    (target,) = doc["targets"]
    assert target["kind"] == "step"
    return code, target


def statuses(target: dict) -> list[tuple[str, str]]:
    return [(c["details"].get("module") or c["details"]["sampler"], c["status"]) for c in target["checks"]]


@pytest.mark.parametrize("devices", ["1", "2", "4", "8"])
def test_right_steps_pass_on_any_device_count(devices):
    # a Flax MLP with nn.Dropout under jax.jit with a batch sharding, and the guide's shard_map with split keys
    for fn, args in (("mlp_step", "mlp_args"), ("guide_step", "guide_args"), ("folded_step", "whole_key_args")):
        code, target = step(fn, args, "--devices", devices)
        assert code == 0, target
        assert all(c["status"] == "pass" for c in target["checks"]), target
        assert target["info"]["draws"] >= 1
        # inside shard_map the data axis is the axis named 'data'; jit's global draw needs none
        assert target["info"]["data_axes"] == ([] if fn == "mlp_step" else ["data"])


def test_mlp_dropout_under_jit_is_one_draw_named_by_its_module():
    code, target = step("mlp_step", "mlp_args", "--devices", "4")
    assert code == 0
    (check,) = target["checks"]
    assert check["details"]["module"] == "Dropout_0" and check["details"]["sampler"] == "bernoulli"
    assert check["details"]["location"]["file"].endswith("train_steps.py")
    assert "drawn for the whole batch outside shard_map" in check["message"]


def test_a_whole_key_in_shard_map_is_a_finding_on_every_device():
    code, target = step("whole_key_step", "whole_key_args", "--devices", "4")
    assert code == 1
    (check,) = target["checks"]
    assert check["status"] == "finding"
    assert check["details"]["same"] == [
        {"members": [f"data={i}" for i in range(4)], "axes": ["data"], "key": [0, 0]}  # key_data(key(0))
    ]
    assert "jax.lax.axis_index('data')" in check["message"]


def test_flax_dropout_inside_shard_map_names_the_module():
    code, target = step("dropout_step", "dropout_args", "--devices", "4")
    assert code == 1
    (check,) = [c for c in target["checks"] if c["status"] != "pass"]
    assert check["details"]["module"] == "Dropout_0" and check["status"] == "finding"
    # Flax's shape check of each Dense initialiser (jax.eval_shape) traces draws that never run: not reported
    assert target["info"]["traced_only"] == 2 and len(target["checks"]) == 1
    code, target = step("dropout_folded_step", "dropout_args", "--devices", "4")
    assert code == 0 and statuses(target) == [("Dropout_0", "pass")]


def test_two_d_mesh_identical_along_model_is_expected_along_data_a_finding():
    code, target = step("mesh2d_step", "mesh2d_args", "--devices", "4", "--mesh", "data=2,model=2")
    assert code == 0
    (check,) = target["checks"]
    assert check["status"] == "pass" and "only along 'model'" in check["message"]
    assert "the data is split along 'data', from the axis name" in check["message"]
    groups = check["details"]["same"]
    assert sorted(tuple(g["members"]) for g in groups) == [
        ("data=0,model=0", "data=0,model=1"),
        ("data=1,model=0", "data=1,model=1"),
    ]
    code, target = step("mesh2d_unfolded_step", "mesh2d_args", "--devices", "4", "--mesh", "data=2,model=2")
    assert code == 1
    (check,) = target["checks"]
    assert check["status"] == "finding" and check["details"]["same"][0]["axes"] == ["data", "model"]


def test_pmap_with_a_replicated_key_is_a_finding_named_or_not():
    # jax.pmap (a shard_map inside JAX) with flax.jax_utils.replicate-style keys: the classic per-device bug
    code, target = step("pmap_step", "pmap_args", "--devices", "4")
    assert code == 1
    (check,) = target["checks"]
    assert check["status"] == "finding" and check["details"]["same"][0]["members"] == [f"batch={i}" for i in range(4)]
    code, target = step("pmap_unnamed_step", "pmap_args", "--devices", "2")
    assert code == 1
    (check,) = target["checks"]
    assert "the pmap axis" in check["message"] and "axis_name='batch'" in check["message"]
    assert check["details"]["same"][0]["members"] == ["pmap=0", "pmap=1"]
    code, target = step("pmap_folded_step", "pmap_args", "--devices", "4")
    assert code == 0 and statuses(target) == [("Dropout_0", "pass")]


def test_every_draw_is_its_own_site_whatever_its_shape_or_helper():
    # (review) the hook once sat under jax.random's own jit: a second draw of one shape reused the first's trace
    code, target = step("two_draws_step", "whole_key_args", "--devices", "4")
    assert code == 1 and [c["status"] for c in target["checks"]] == ["pass", "finding"]
    lines = [c["details"]["location"]["line"] for c in target["checks"]]
    assert lines[1] == lines[0] + 1
    # one helper called twice: two sites, told apart by their caller
    code, target = step("helper_step", "whole_key_args", "--devices", "4")
    assert code == 1 and [c["status"] for c in target["checks"]] == ["pass", "finding"]
    assert all(" called from " in c["message"] for c in target["checks"])


def test_a_step_traced_before_the_check_is_still_observed():
    # the factory ran the step once (a warm-up); and the same step given twice as --fn
    code, target = step("whole_key_step", "warm_args", "--devices", "4")
    assert code == 1 and target["checks"][0]["status"] == "finding"
    code, doc = run_json(
        "--fn", f"{STEPS}:dropout_step", "--fn", f"{STEPS}:dropout_step", "--args", f"{STEPS}:dropout_args",
        "--devices", "2",
    )  # fmt: skip
    assert code == 1 and [t["checks"][0]["status"] for t in doc["targets"]] == ["finding", "finding"]


def test_tensor_parallel_dropout_the_same_on_model_shards_is_not_a_finding():
    # (review) the weights' in_specs split 'model'; that does not make 'model' a data axis
    code, target = step("tp_step", "tp_args", "--devices", "4", "--mesh", "data=2,model=2")
    assert code == 0, target
    (check,) = target["checks"]
    assert check["status"] == "pass" and check["details"]["data_axes"] == ["data"]


def test_an_ignore_comment_marks_identical_randomness_as_intended():
    code, target = step("intended_step", "whole_key_args", "--devices", "4")
    assert code == 0
    (check,) = target["checks"]
    assert check["status"] == "allowed" and "intended (ignore comment at" in check["message"]


def test_the_file_of_fn_and_args_is_imported_once():
    code, target = step("state_step", "state_args", "--devices", "2")
    assert code == 0 and statuses(target) == [("normal", "pass")]


def test_a_process_that_dies_without_a_word_is_named_at_once():
    r = run("--fn", f"{STEPS}:crash_step", "--args", f"{STEPS}:crash_args", "--devices", "1", "--processes", "2",
            "--timeout", "120", timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip() == "error: process 1 exited with code 3 before reporting"


def test_a_data_axis_the_step_does_not_have_is_an_error():
    r = run("--fn", f"{STEPS}:whole_key_step", "--args", f"{STEPS}:whole_key_args", "--devices", "2",
            "--data-axis", "dta")  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "error: --data-axis dta: the step has no mesh axis 'dta'; its axes are 'data'"


def test_data_axis_option_decides_which_axis_is_data():
    # the same 2-D run, told that 'model' splits the data too: identical along it is then a finding
    code, target = step(
        "mesh2d_step", "mesh2d_args", "--devices", "4", "--mesh", "data=2,model=2", "--data-axis", "model"
    )
    assert code == 1 and target["info"]["data_axes"] == ["model"] and target["info"]["data_axes_from"] == "--data-axis"


def test_the_keys_reported_are_the_keys_jax_hands_the_devices():
    # oracle: recompute with JAX here what each group of devices' sampler got
    import jax

    code, doc = run_json(
        "--fn", f"{STEPS}:whole_key_step", "--args", f"{STEPS}:whole_key_args", "--devices", "2", "--exit-zero"
    )
    assert code == 0  # --exit-zero: findings reported, exit 0
    (check,) = doc["targets"][0]["checks"]
    assert check["status"] == "finding" and check["details"]["runs"] == 2
    assert check["details"]["same"][0]["key"] == jax.random.key_data(jax.random.key(0)).tolist()
    _, target = step("mesh2d_step", "mesh2d_args", "--devices", "4", "--mesh", "data=2,model=2")
    for group in target["checks"][0]["details"]["same"]:
        data = int(group["members"][0].split(",")[0].split("=")[1])
        assert group["key"] == jax.random.key_data(jax.random.fold_in(jax.random.key(0), data)).tolist()


def test_two_processes_same_seed_is_a_finding_folded_passes():
    code, target = step("host_step", "host_same_seed_args", "--devices", "2", "--processes", "2")
    assert code == 1 and target["info"]["process_local"] is True
    (check,) = target["checks"]
    assert check["status"] == "finding" and "jax.process_index()" in check["message"]
    (group,) = check["details"]["same"]
    assert group["members"] == ["process 0", "process 1"] and group["axes"] == ["process"]
    code, target = step("host_step", "host_folded_args", "--devices", "2", "--processes", "2")
    assert code == 0 and statuses(target) == [("Dropout_0", "pass")]


def test_two_processes_global_batch():
    # one global batch over both processes' devices: the whole key in shard_map repeats on all 4 devices; folded
    # per device it does not; jit over the global batch is one draw whatever the key on each process
    code, target = step("whole_key_step", "global_args", "--devices", "2", "--processes", "2")
    assert code == 1 and target["info"]["process_local"] is False
    assert target["checks"][0]["details"]["same"][0]["members"] == [f"data={i}" for i in range(4)]
    code, target = step("folded_step", "global_args", "--devices", "2", "--processes", "2")
    assert code == 0
    code, target = step("host_step", "global_mlp_args", "--devices", "2", "--processes", "2")
    assert code == 0 and statuses(target) == [("Dropout_0", "pass")]


def test_text_report_names_processes_and_groups():
    r = run("--fn", f"{STEPS}:host_step", "--args", f"{STEPS}:host_same_seed_args", "--devices", "2",
            "--processes", "2")  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "forced with --devices 2, in each of 2 processes joined with jax.distributed" in r.stdout
    assert "same randomness on process 0, process 1" in r.stdout
    assert "FINDING bernoulli draw" in r.stdout


def test_a_process_that_never_finishes_is_a_timeout_not_a_hang():
    r = run("--fn", f"{STEPS}:slow_step", "--args", f"{STEPS}:slow_args", "--devices", "1", "--processes", "2",
            "--timeout", "20", timeout=90)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: the 2 processes did not finish within 20 s") and "process(es) 1" in r.stderr


def test_a_process_that_fails_is_named():
    r = run("--fn", f"{STEPS}:failing_step", "--args", f"{STEPS}:failing_args", "--devices", "1",
            "--processes", "2", timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert "process 1" in r.stderr and "the data loader of process 1 found no files" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fn", f"{STEPS}:mlp_step", "--args", f"{STEPS}:nope"], "has no 'nope'"),
        (["--fn", f"{STEPS}:mlp_step", "--args", f"{STEPS}:LEARNING_RATE"], "not a function"),
        (["--fn", f"{STEPS}:mlp_step", "--args", f"{STEPS}:whole_key_args"], "the step raised"),
        (["--fn", f"{STEPS}:mlp_step", "--args", f"{STEPS}:slow_args"], "cannot be called with the 1 argument"),
        (["--fn", f"{STEPS}:mlp_step", "--args", f"{STEPS}:mlp_args", "--shape", "4,1"], "--shape applies to a"),
        (["--fn", f"{STEPS}:mlp_step", "--data-axis", "data"], "--data-axis applies to a --fn step"),
        (["--fn", f"{STEPS}:mlp_step", "--processes", "2"], "give its arguments with --args"),
        (["--fn", f"{STEPS}:mlp_step", "--args", f"{STEPS}:mlp_args", "--processes", "0"], "run 1 to 16"),
        (["--fn", f"{STEPS}:mlp_step", "--args", f"{STEPS}:mlp_args", "--data-axis", "a-b"], "name of a mesh axis"),
        (["--fn", f"{STEPS}:mlp_step", "--args", "train.py"], "write FILE.py:FACTORY"),
        (
            [
                "--fn",
                f"{STEPS}:mlp_step",
                "--args",
                f"{STEPS}:mlp_args",
                "--processes",
                "2",
                "--devices",
                "2",
                "--mesh",
                "data=2",
            ],
            "in each of 2 processes (4 in all)",
        ),
    ],
)
def test_bad_step_input_is_one_error_line(args, message):
    r = run(*args, "--devices", "2") if "--devices" not in args else run(*args)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_request_round_trips_with_a_step():
    r = make_request(
        fns=[parse_fn_target(f"{STEPS}:host_step")],
        args=parse_args_factory(f"{STEPS}:host_folded_args"),
        processes=2,
        devices=2,
        data_axes=("data", "data"),
    )
    assert r.data_axes == ("data",) and r.processes == 2
    assert request_from_json(json.loads(json.dumps(request_json(r)))) == r
    with pytest.raises(UsageError):
        make_request(fns=[parse_fn_target(f"{STEPS}:host_step")], processes=2, devices=2)


def _obs(process, sites, records, axes=(), spans=False):
    return {
        "fn": "t.py:step",
        "args": "t.py:args",
        "observation": {"process": process, "sites": sites, "records": records},
        "argument_axes": list(axes),
        "spans_processes": spans,
    }


SITE = {"file": None, "line": None, "function": "f", "sampler": "normal", "module": None, "shape": [2],
        "bit_width": 32, "manual_axes": ["x"]}  # fmt: skip


def test_analysis_without_a_known_data_axis_is_information_not_a_finding():
    # two axes whose role cannot be told (no --data-axis, no in_specs seen, no sharded argument, not named like
    # a data axis): identical randomness is information, and a typo in --data-axis is an error
    site = dict(SITE, manual_axes=["x", "y"])
    records = [[0, [["x", i], ["y", 0]], [0, 7]] for i in range(2)]
    t = analyse([_obs(0, [site], records)], (), ("x", "y"), 1)
    (check,) = t.checks
    assert check.status == "info" and "--data-axis" in check.message
    t = analyse([_obs(0, [site], records)], ("x",), ("x", "y"), 1)
    assert t.checks[0].status == "finding"
    with pytest.raises(UsageError, match="--data-axis z: the step has no mesh axis 'z'"):
        analyse([_obs(0, [site], records)], ("z",), ("x", "y"), 1)


def test_analysis_of_repeated_draws_compares_the_whole_sequence_per_device():
    # a scan drawing twice per device: devices equal in one draw but not the other drew different randomness
    records = [[0, [["x", 0]], [1, 1]], [0, [["x", 0]], [2, 2]], [0, [["x", 1]], [1, 1]], [0, [["x", 1]], [3, 3]]]
    t = analyse([_obs(0, [SITE], records)], ("x",), ("x",), 1)
    assert t.checks[0].status == "pass"


def test_github_annotation_points_at_the_draw_line():
    lines = (support.REPO / STEPS).read_text().splitlines()
    start = lines.index("def whole_key_step(key, x, mesh):")
    line = next(i for i in range(start, len(lines)) if "jax.random.normal(key, x.shape)" in lines[i]) + 1
    r = run("--fn", f"{STEPS}:whole_key_step", "--args", f"{STEPS}:whole_key_args", "--devices", "2", "-f", "github")
    assert r.returncode == 1, r.stderr
    (annotation,) = r.stdout.splitlines()
    assert annotation.startswith(f"::error file={STEPS},line={line},col=1,title=rngaudit shard-check/step_randomness::")
