"""`rngaudit diff`: a refactor suite. Both versions are captured from real Flax; the params real Flax
initialises (compared value by value) decide which param call sites changed, and diff must report
exactly those, with the reason and the fix."""

from __future__ import annotations

import json
import re
import textwrap

import jsonschema
import numpy as np
import pytest
from flax_oracle import flax_params
from support import REPO, invoke, write

HEADER = "import flax.linen as nn\nimport jax\nimport jax.numpy as jnp\n"

BLOCK = textwrap.dedent("""
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(4)(x)
        x = nn.Dropout(0.5, deterministic=False)(x)
        return nn.Dense(4)(x)

    def make():
      return Model(), (jnp.ones((1, 4)),)
""")

BASE = (
    HEADER
    + BLOCK
    + textwrap.dedent("""
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(4)(x)
        x = Block()(x)
        return nn.Dense(4)(x)
""")
)

VARIANTS = {
    "rename": BASE.replace("Block()(x)", "Block(name='encoder')(x)"),
    "insert": BASE.replace(
        "    x = nn.Dense(4)(x)\n    x = Block()(x)",
        "    x = nn.Dense(4, use_bias=False)(x)\n    x = nn.Dense(4)(x)\n    x = Block()(x)",
    ),
    "compact_to_setup": HEADER
    + BLOCK
    + textwrap.dedent("""
        class Model(nn.Module):
          def setup(self):
            self.inp = nn.Dense(4)
            self.block = Block()
            self.out = nn.Dense(4)

          def __call__(self, x):
            return self.out(self.block(self.inp(x)))
        """),
    "jit": BASE.replace("Block()(x)", "nn.jit(Block)()(x)"),
    "remat": BASE.replace("Block()(x)", "nn.remat(Block)()(x)"),
}

ENSEMBLE = (
    HEADER
    + BLOCK
    + textwrap.dedent("""
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        E = nn.vmap(Block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                    in_axes=None, out_axes=0, axis_size=3)
        return E()(x)
""")
)

RNGS = "params=0,dropout=1"


def capture(tmp_path, name, text):
    f = tmp_path / f"{name}.py"
    f.write_text(text)
    keys = tmp_path / f"{name}.json"
    r = invoke("capture", f"{f}:make", "--rngs", RNGS, "--keys", keys, "-o", tmp_path / f"{name}.yaml")
    assert r.exit_code == 0, r.output
    return f, keys


def flax_changed(old: dict, new: dict) -> set:
    changed = {k for k in old.keys() & new.keys() if not np.array_equal(old[k], new[k])}
    return changed | (old.keys() ^ new.keys())


def run_diff(tmp_path, old_keys, new_keys):
    r = invoke("diff", old_keys, new_keys, "--format", "json")
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.output)


def param_sites(doc) -> set:
    return {
        tuple(s["path"]) + (s["label"],)
        for s in doc["sites"]
        if s["status"] in ("changed", "new", "gone") and s["kind"] == "param"
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("base")
    f, keys = capture(tmp, "base", BASE)
    return f, keys, flax_params(f)


EXPECT = {
    "rename": ("renamed path (Block_0 -> encoder)", "name='Block_0'"),
    "insert": ("shifted auto-name index", "give the inserted module at Dense_0 an explicit name="),
    "compact_to_setup": ("renamed path (Block_0 -> block)", "name='Block_0'"),
    "jit": ("nn.jit renames class Block to JitBlock", "a new jit fork"),
    "remat": ("nn.remat renames class Block to CheckpointBlock", "name='Block_0'"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_refactor_diff_matches_flax(tmp_path, base, variant):
    assert VARIANTS[variant] != BASE
    _old_f, old_keys, old_params = base
    new_f, new_keys = capture(tmp_path, variant, VARIANTS[variant])
    code, doc = run_diff(tmp_path, old_keys, new_keys)
    expected = flax_changed(old_params, flax_params(new_f))
    assert expected, "the refactor must change something in Flax"
    assert param_sites(doc) == expected
    assert code == 1 and doc["summary"]["failing"] is True
    why, fix = EXPECT[variant]
    text = json.dumps(doc)
    assert why in text and fix in text, (doc["notes"], doc["fixes"])
    # every reported site is explained
    assert all(s["why"] for s in doc["sites"] if s["status"] != "kept")


def test_insert_moves_only_the_later_layer(tmp_path, base):
    _, old_keys, _ = base
    _, new_keys = capture(tmp_path, "insert", VARIANTS["insert"])
    _, doc = run_diff(tmp_path, old_keys, new_keys)
    moved = {(s["path_str"], s["label"], s["status"]) for s in doc["sites"] if s["status"] != "kept"}
    # the inserted Dense_0 has no bias; the old Dense_0 and Dense_1 keep their paths' keys (one index up)
    assert moved == {("Dense_0", "bias", "gone"), ("Dense_2", "kernel", "new"), ("Dense_2", "bias", "new")}


def test_applying_the_suggested_fix_restores_every_key(tmp_path, base):
    _, old_keys, _ = base
    fixed = VARIANTS["remat"].replace("nn.remat(Block)()(x)", "nn.remat(Block)(name='Block_0')(x)")
    _, new_keys = capture(tmp_path, "remat_fixed", fixed)
    code, doc = run_diff(tmp_path, old_keys, new_keys)
    assert code == 0 and doc["summary"]["changed"] == doc["summary"]["new"] == doc["summary"]["gone"] == 0


SETUP_HEAD = HEADER + textwrap.dedent("""
    class M(nn.Module):
        def setup(self):
            self.body = nn.Dense(4)
            self.head = nn.Dense(2)

        def __call__(self, x):
            return self.head(self.body(x))

    def make():
        return M(), (jnp.ones((1, 3)),)
""")


def _renamed_and_fixed(tmp_path, through: str, source: str, renamed: str, fixed: str) -> dict:
    """diff of SOURCE captured before and RENAMED after (their specs, or their keys files); FIXED, the fix applied,
    has every param of SOURCE in real Flax. Returns the diff's JSON."""
    old_f, old_keys = capture(tmp_path, "old", source)
    _, new_keys = capture(tmp_path, "new", renamed)
    pair = (old_keys, new_keys) if through == "keys" else (old_keys.with_suffix(".yaml"), new_keys.with_suffix(".yaml"))
    code, doc = run_diff(tmp_path, *pair)
    assert code == 1
    fixed_f, _ = capture(tmp_path, "fixed", fixed)
    assert flax_changed(flax_params(old_f), flax_params(fixed_f)) == set()
    return doc


@pytest.mark.parametrize("through", ["spec", "keys"])
def test_renaming_a_setup_attribute_gets_the_name_that_restores_it(tmp_path, through):
    """The commonest refactor, an attribute renamed in setup(): the fix (name='head' where it is assigned) is
    checked with the spec's `call:` following the attribute, as Flax calls it; it was refused ("module M has no
    child 'classifier'"). Applied in real Flax, the fix restores every key."""
    renamed = SETUP_HEAD.replace("self.head", "self.classifier")
    fixed = renamed.replace("nn.Dense(2)", "nn.Dense(2, name='head')")
    doc = _renamed_and_fixed(tmp_path, through, SETUP_HEAD, renamed, fixed)
    assert "name='head'" in json.dumps(doc["fixes"]), doc["fixes"]
    assert "no fix by a name" not in json.dumps(doc)


TWO_BLOCKS = HEADER + textwrap.dedent("""
    class Blk(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Blk()(x) + Blk()(x)

    def make():
        return M(), (jnp.ones((1, 4)),)
""")


@pytest.mark.parametrize("through", ["spec", "keys"])
def test_modules_named_anew_are_paired_in_the_order_they_are_made(tmp_path, through):
    """Blk_0, Blk_1 named fwd, bwd: Blk_0 is fwd (made first), whatever the names' order. A spec's diff paired them
    by name (Blk_0 -> bwd), and its fix, followed, would swap the two blocks' initialisation; applied in real Flax,
    the fix given restores every param of each block."""
    two = "Blk()(x) + Blk()(x)"
    renamed = TWO_BLOCKS.replace(two, "Blk(name='fwd')(x) + Blk(name='bwd')(x)")
    fixed = TWO_BLOCKS.replace(two, "Blk(name='Blk_0')(x) + Blk(name='Blk_1')(x)")
    fixes = json.dumps(_renamed_and_fixed(tmp_path, through, TWO_BLOCKS, renamed, fixed)["fixes"])
    assert "now at fwd an explicit name='Blk_0'" in fixes and "now at bwd an explicit name='Blk_1'" in fixes, fixes


def test_split_rngs_change(tmp_path):
    old_f, old_keys = capture(tmp_path, "ens_old", ENSEMBLE)
    new_f, new_keys = capture(tmp_path, "ens_new", ENSEMBLE.replace("'dropout': True", "'dropout': False"))
    code, doc = run_diff(tmp_path, old_keys, new_keys)
    assert code == 1
    assert param_sites(doc) == flax_changed(flax_params(old_f), flax_params(new_f)) == set()
    changed = [s for s in doc["sites"] if s["status"] != "kept"]
    assert changed and all(s["status"] == "changed" and s["path"][-1] == "Dropout_0" for s in changed)
    assert {s["lane"][0] for s in changed} == {0, 1, 2}
    assert all("a different split: the lanes now share one key" in s["why"][0] for s in changed)
    # the lanes really do share one key now
    assert len({tuple(s["new_key"]) for s in changed}) == 1


def test_identical_versions_exit_0_and_specs_work_too(tmp_path, base):
    _, old_keys, _ = base
    r = invoke("diff", old_keys, old_keys)
    assert r.exit_code == 0 and "0 changed, 0 new, 0 gone" in r.output
    spec = old_keys.with_suffix(".yaml")
    r = invoke("diff", spec, old_keys)
    assert r.exit_code == 0, r.output


def test_verify_takes_a_keys_file_as_spec(tmp_path, base):
    """`verify KEYS.json --against ...`: the SPEC may be a keys file (read once, as a keys file)."""
    _, old_keys, _ = base
    r = invoke("verify", old_keys, "--against", old_keys)
    assert r.exit_code == 0 and "0 differ, 0 missing, 0 extra" in r.output, r.output
    r = invoke("verify", old_keys.with_suffix(".yaml"), "--against", old_keys)
    assert r.exit_code == 0, r.output


def test_diff_of_specs_explains_rename(tmp_path, base):
    _, old_keys, _ = base
    capture(tmp_path, "rename", VARIANTS["rename"])
    r = invoke("diff", old_keys.with_suffix(".yaml"), tmp_path / "rename.yaml")
    assert r.exit_code == 1
    assert "renamed path (Block_0 -> encoder)" in r.output and "name='Block_0'" in r.output


@pytest.mark.parametrize("root_draw", ["param: {name: w}", "make_rng: {stream: params}"])
def test_a_new_top_level_module_beside_a_root_draw(tmp_path, root_draw):
    # issue 18: a new auto-named top-level module, nothing paired as a rename, crashed (IndexError on
    # the root path ()) whenever the root module itself drew keys
    head = "rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n"
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(head + f"    - {root_draw}\n")
    new.write_text(head + f"    - LayerNorm: {{}}\n    - {root_draw}\n")
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.output + r.stderr
    assert "internal error" not in r.stderr
    entries = json.loads(invoke("diff", old, new, "--format", "json").output)["sites"]
    assert [(e["status"], e["path_str"]) for e in entries if e["status"] != "kept"] == [
        ("new", "LayerNorm_0"),
        ("new", "LayerNorm_0"),
    ]


DENSES = {
    "old": ["{features: 2, use_bias: false}", "{features: 3}"],
    "appended": ["{features: 2, use_bias: false}", "{features: 3}", "{features: 5, use_bias: false}"],
    "inserted_first": ["{features: 4}", "{features: 2, use_bias: false}", "{features: 3}"],
    "inserted_alike": ["{features: 2, use_bias: false}", "{features: 2, use_bias: false}", "{features: 3}"],
    "inserted_second": ["{features: 2, use_bias: false}", "{features: 4, use_bias: false}", "{features: 3}"],
}


def test_blocks_that_draw_alike_are_placed_only_as_far_as_the_keys_tell(tmp_path):
    # a spec's own classes carry no options: two Blocks that draw alike cannot be told apart, so an insertion
    # among them names both places
    def spec(blocks):
        body = "".join(f"    - module: {{class: Block, body: [{{param: {p}}}]}}\n" for p in blocks)
        return f"rngaudit: 1\nrngs: {{params: 0}}\nmodel:\n  class: M\n  body:\n{body}"

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(spec(["w", "v"]))
    new.write_text(spec(["w", "w", "v"]))
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.output + r.stderr
    assert "a Block was inserted at Block_0 or Block_1" in r.output, r.output


def _denses(tmp_path, name):
    body = "".join(f"    - Dense: {d}\n" for d in DENSES[name])
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"rngaudit: 1\nrngs: {{params: 0}}\nmodel:\n  class: M\n  body:\n{body}")
    return path


@pytest.mark.parametrize(
    "new, says, never",
    [
        ("appended", "a Dense was added after the existing ones: Dense_2 is new", "shifted"),
        # the layers' hyper-parameters tell which layer each one is: the inserted one is named, and each old layer
        # is followed to its new path
        ("inserted_first", "the module that was Dense_0 is now Dense_1: kernel (params)", " or "),
        ("inserted_first", "why: drawn by the Dense inserted at Dense_0", "did not exist before"),
        ("inserted_second", "give the inserted module at Dense_1 an explicit name=", "Dense_0 is now"),
        # Dense_0 and Dense_1 are alike: either is the new one, and naming the first restores every key
        ("inserted_alike", "give the inserted module at Dense_0 an explicit name=", "no fix by a name"),
    ],
)
def test_an_added_layer_is_explained_only_as_far_as_the_keys_tell(tmp_path, new, says, never):
    # issue 18: an appended layer was called a shifted auto-name index, and an insertion named no position
    r = invoke("diff", _denses(tmp_path, "old"), _denses(tmp_path, new))
    assert r.exit_code == 1, r.output + r.stderr
    assert says in r.output and never not in r.output, r.output


def _vmap_dense(tmp_path, name, rngs="0", split="true", axis_size=3):
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"rngaudit: 1\nrngs: {rngs}\nmodel:\n  vmap:\n    module: {{Dense: {{features: 2}}}}\n"
        f"    axis_size: {axis_size}\n    variable_axes: {{params: 0}}\n    split_rngs: {{params: {split}}}\n"
    )
    return path


@pytest.mark.parametrize(
    "change, cause, not_claimed",
    [
        ({"rngs": "1"}, "the root key of stream 'params' differs (key(0) -> key(1))", "split"),
        ({"rngs": "key(0)"}, None, None),  # the same root key written two ways: nothing changes
        ({"split": "false"}, "the lanes now share one key (split_rngs false for 'params')", "root key"),
        ({"axis_size": 4}, None, None),
    ],
)
def test_a_changed_lane_key_names_the_cause_that_holds(tmp_path, change, cause, not_claimed):
    # issue 18: every changed key in vmap/scan lanes was put down to "a different split" even when the seed
    # changed; a root key written as 0 and as key(0) was reported as a different root key
    r = invoke("diff", _vmap_dense(tmp_path, "old"), _vmap_dense(tmp_path, "new", **change), "-f", "json")
    doc = json.loads(r.output)
    changed = [e for e in doc["sites"] if e["status"] == "changed"]
    if "axis_size" in change:
        # split(key, n)[i] does not depend on n (jax_threefry_partitionable): lanes 0..2 keep their keys
        new = [e for e in doc["sites"] if e["status"] != "kept"]
        assert r.exit_code == 1 and not changed and [e["lane"] for e in new] == [[3], [3]]
        assert all(e["why"] == ["more lanes: a vmap/scan axis size changed (3 lanes before, 4 now)"] for e in new)
        return
    if cause is None:
        assert r.exit_code == 0 and not changed
        return
    assert r.exit_code == 1 and changed
    for e in changed:
        text = " | ".join(e["why"])
        assert cause in text and not_claimed not in text, text


def test_bad_diff_input_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "rngaudit.capture", "format_version": 1, "calls": [{}]}')
    r = invoke("diff", bad, bad)
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "not a valid rngaudit.capture" in r.stderr
    r = invoke("diff", tmp_path / "nope.yaml", bad)
    assert r.exit_code == 2 and "Traceback" not in r.stderr


# ---------------------------------------------------------------- CI formats, --exit-zero, [tool.rngaudit]
SCHEMA = json.loads((REPO / "tests" / "data" / "sarif-schema-2.1.0-rtm.4.json").read_text(encoding="utf-8"))
ANNOTATION = re.compile(r"^::(error|warning|notice) file=([^,]+),line=(\d+),col=(\d+),title=([^:]+)::(.+)$")


def annotations(text: str) -> list[tuple]:
    out = []
    for line in text.splitlines():
        m = ANNOTATION.match(line)
        assert m, f"not a workflow command: {line!r}"
        out.append((m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), m.group(5), m.group(6)))
    return out


def sarif(text: str) -> list[tuple]:
    doc = json.loads(text)
    jsonschema.Draft4Validator(SCHEMA).validate(doc)
    (run,) = doc["runs"]
    rules = [r["id"] for r in run["tool"]["driver"]["rules"]]
    out = []
    for res in run["results"]:
        assert rules[res["ruleIndex"]] == res["ruleId"]
        loc = res["locations"][0]["physicalLocation"]
        out.append((res["ruleId"], loc["region"]["startLine"], loc["region"]["startColumn"]))
    return out


def spec_rows(spec) -> dict:
    """(path_str, stream, count, lane) -> (line, col) of the statement, as derive reports it."""
    r = invoke("derive", spec, "--format", "json", "--no-values")
    return {
        (c["path_str"], c["stream"], c["count"], tuple(c["lane"])): (c["location"]["line"], c["location"]["col"])
        for c in json.loads(r.stdout)["calls"]
    }


def test_diff_of_specs_annotates_the_new_specs_lines(tmp_path, base):
    _, old_keys, _ = base
    capture(tmp_path, "rename", VARIANTS["rename"])
    old_spec, new_spec = old_keys.with_suffix(".yaml"), tmp_path / "rename.yaml"
    rows = spec_rows(new_spec)
    doc = json.loads(invoke("diff", old_spec, new_spec, "-f", "json").stdout)
    failing = [s for s in doc["sites"] if s["status"] != "kept"]
    r = invoke("diff", old_spec, new_spec, "--format", "github")
    assert r.exit_code == 1 and r.stderr == ""
    every = annotations(r.stdout)
    got = [a for a in every if a[4] != "rngaudit diff/thing-changed"]
    things = [a for a in every if a[4] == "rngaudit diff/thing-changed"]
    assert len(got) == len(failing) and len(things) == len(doc["things"]) == 5
    assert all(a[1] == str(new_spec) and (a[2], a[3]) in rows.values() for a in things)  # at the draw's new row
    for a, t in zip(things, doc["things"]):  # a count that moved is shown moving; one that did not, once
        old, new = t["old_count"], t["new_count"]
        assert f"count {old} -> {new}, key" in a[5] if old != new else f"count {new}, key" in a[5]
    for (kind, file, line, col, title, message), s in zip(got, failing):
        assert kind == "error" and file == str(new_spec) and title == f"rngaudit diff/{s['status']}"
        if s["status"] == "new":  # a row of the new spec: exactly its statement
            assert (line, col) == rows[(s["path_str"], s["stream"], s["count"], tuple(s["lane"]))]
        else:  # gone: the new spec has no such row; the nearest module's row, and the message says so
            assert (line, col) in rows.values() and "has no such call site; shown at" in message
        assert line > 1
    places = sarif(invoke("diff", old_spec, new_spec, "--format", "sarif").stdout)
    assert [(ln, c) for _, ln, c in places] == [(ln, c) for _, _, ln, c, _, _ in every]
    assert {rule for rule, _, _ in places} == {"diff/new", "diff/gone", "diff/thing-changed"}
    r = invoke("diff", old_spec, new_spec, "--format", "github", "--exit-zero")
    assert r.exit_code == 0 and annotations(r.stdout) == every


def test_diff_of_keys_files_annotates_each_record(tmp_path, base):
    _, old_keys, _ = base
    _, new_keys = capture(tmp_path, "jit", VARIANTS["jit"])
    r = invoke("diff", old_keys, new_keys, "-f", "github")
    assert r.exit_code == 1
    lines = new_keys.read_text().splitlines()
    records = json.loads(new_keys.read_text())["calls"]
    for _, file, line, col, title, message in annotations(r.stdout):
        assert file == str(new_keys) and lines[line - 1][col - 1] == "{"
        if title == "rngaudit diff/new":  # the record of this very call site
            rec = json.loads("\n".join(lines[line - 1 :]).split("\n    }")[0].rstrip(",") + "}")
            assert rec in records and message.startswith(f"new: {rec['path_str']} {rec['stream']} count {rec['count']}")


def test_verify_ci_formats_and_exit_codes(tmp_path, base):
    _, old_keys, _ = base
    spec = old_keys.with_suffix(".yaml")
    for fmt in ("text", "json", "github", "sarif"):
        r = invoke("verify", spec, "--against", old_keys, "--format", fmt)
        assert r.exit_code == 0, r.output
    assert invoke("verify", spec, "--against", old_keys, "-f", "github").stdout == ""
    assert sarif(invoke("verify", spec, "--against", old_keys, "-f", "sarif").stdout) == []
    _, other = capture(tmp_path, "insert", VARIANTS["insert"])
    rows = spec_rows(spec)
    r = invoke("verify", spec, "--against", other, "-f", "github")
    assert r.exit_code == 1
    got = annotations(r.stdout)
    assert got and {file for _, file, *_ in got} == {str(spec)}
    assert {title for *_, title, _ in got} <= {
        "rngaudit verify/differs",
        "rngaudit verify/missing",
        "rngaudit verify/extra",
    }
    assert all((line, col) in rows.values() for _, _, line, col, _, _ in got)
    places = sarif(invoke("verify", spec, "--against", other, "-f", "sarif").stdout)
    assert [(ln, c) for _, ln, c in places] == [(ln, c) for _, _, ln, c, _, _ in got]
    assert invoke("verify", spec, "--against", other, "--exit-zero").exit_code == 0


@pytest.mark.parametrize("command", ["verify", "diff", "capture"])
def test_bad_input_exits_2_in_every_format(tmp_path, command):
    missing = tmp_path / "missing.yaml"
    args = {
        "verify": [missing, "--against", missing.with_suffix(".json")],
        "diff": [missing, missing],
        "capture": [f"{tmp_path / 'nope.py'}:make"],
    }[command]
    for fmt in ("text", "json", "github", "sarif"):
        r = invoke(command, *args, "--format", fmt, "--exit-zero")
        assert r.exit_code == 2 and r.stdout == "" and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_config_defaults_for_diff_and_verify(tmp_path, base):
    _, old_keys, _ = base
    _, new_keys = capture(tmp_path, "remat", VARIANTS["remat"])
    cfg = tmp_path / "pyproject.toml"
    cfg.write_text('[tool.rngaudit]\nformat = "github"\n\n[tool.rngaudit.diff]\nexit-zero = true\n')
    r = invoke("diff", old_keys, new_keys, "--config", cfg)
    assert r.exit_code == 0 and annotations(r.stdout)
    r = invoke("diff", old_keys, new_keys, "--config", cfg, "--no-exit-zero", "--format", "json")
    assert r.exit_code == 1 and json.loads(r.stdout)["format"] == "rngaudit.diff"
    # capture's product is the spec: a common `format = "github"` still writes it
    f = tmp_path / "base.py"
    f.write_text(BASE)
    cfg.write_text('[tool.rngaudit]\nformat = "github"\n')
    r = invoke("capture", f"{f}:make", "--config", cfg, "-o", tmp_path / "cfg.yaml")
    assert r.exit_code == 0 and (tmp_path / "cfg.yaml").read_text().startswith("# Captured by rngaudit capture")
    cfg.write_text('[tool.rngaudit.verify]\nagainst = "x.json"\n')
    r = invoke("verify", old_keys.with_suffix(".yaml"), "--against", old_keys, "--config", cfg)
    assert r.exit_code == 2 and "against: cannot be set here: it names the keys file one run checks against" in r.stderr
    cfg.write_text("[tool.rngaudit.diff]\nexit-zeros = true\n")
    r = invoke("diff", old_keys, new_keys, "--config", cfg)
    assert r.exit_code == 2 and "unknown key 'exit-zeros'" in r.stderr and "did you mean 'exit-zero'" in r.stderr


def test_root_keys_compare_as_keys_whichever_side_wrote_them():
    # issue 18: a spec against a keys file always added "the root key of stream 'params' differs ('0' -> 0)"
    from rngaudit.refactor.compare import _root_key

    assert _root_key(0) == _root_key("0") == _root_key("key(0)") == _root_key(" key( 0 ) ") == "key(0)"
    assert _root_key("split(key(0))[1]") == "split(key(0), 2)[1]" != _root_key(1)
    assert _root_key(None) == "not given"


def _at(module: str, what: str) -> tuple:
    return (*module.split("/"), what) if module else (what,)


def _things(doc) -> set:
    return {("/".join(t["old_module"]), "/".join(t["new_module"]), t["what"]) for t in doc["things"]}


def test_things_follow_a_layer_across_an_insertion(tmp_path, base):
    """After a Dense is inserted first, the path Dense_0 keeps its kernel key, but the layer that was Dense_0 is
    now Dense_1 and its kernel and bias draw other keys (real Flax's params say so): diff says it by thing."""
    _, old_keys, old_params = base
    new_f, new_keys = capture(tmp_path, "insert", VARIANTS["insert"])
    new_params = flax_params(new_f)
    code, doc = run_diff(tmp_path, old_keys, new_keys)
    assert code == 1
    things = _things(doc)
    assert {("Dense_0", "Dense_1", "kernel"), ("Dense_0", "Dense_1", "bias")} <= things
    assert {("Dense_1", "Dense_2", "kernel"), ("Dense_1", "Dense_2", "bias")} <= things
    for mo, mn, what in things:  # each claim holds in Flax: the layer's kernel values differ (biases are zeros)
        if what == "kernel":
            assert not np.array_equal(old_params[_at(mo, what)], new_params[_at(mn, what)]), (mo, mn, what)
    # the layers that kept their place kept their keys: not listed
    assert not any(mo.startswith("Block_0") for mo, _, _ in things)
    text = invoke("diff", old_keys, new_keys).stdout
    assert "the module that was Dense_0 is now Dense_1: kernel, bias (params)" in text, text
    github = invoke("diff", old_keys, new_keys, "-f", "github").stdout
    assert "title=rngaudit diff/thing-changed::thing changed: kernel (params) of Dense_1" in github


SWAP = HEADER + textwrap.dedent("""
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        FIRST
        SECOND
        return x

    def make():
      return Model(), (jnp.ones((1, 4)),)
""")
PARAM = "w = self.param('w', nn.initializers.normal(), (3,))"
DRAW = "k = self.make_rng('params')"


def test_a_param_swapped_with_a_make_rng_fails_although_every_path_count_kept_its_key(tmp_path):
    old_f, old_keys = capture(tmp_path, "before", SWAP.replace("FIRST", PARAM).replace("SECOND", DRAW))
    new_f, new_keys = capture(tmp_path, "after", SWAP.replace("FIRST", DRAW).replace("SECOND", PARAM))
    assert not np.array_equal(flax_params(old_f)[("w",)], flax_params(new_f)[("w",)])  # Flax: w changed
    for old, new in ((old_keys, new_keys), (old_keys.with_suffix(".yaml"), new_keys.with_suffix(".yaml"))):
        code, doc = run_diff(tmp_path, old, new)
        assert code == 1 and doc["summary"]["changed"] == doc["summary"]["new"] == doc["summary"]["gone"] == 0
        assert ("", "", "w") in _things(doc) and doc["summary"]["things_changed"] == 2, doc["things"]
        w = next(t for t in doc["things"] if t["what"] == "w")
        assert (w["old_count"], w["new_count"]) == (1, 2)
    text = invoke("diff", old_keys, new_keys).stdout
    assert "(root): w, param" in text or "(root): make_rng, w" in text or "(root): w, make_rng" in text, text


CHECK_BASE = """rngaudit: 1
rngs: {params: 0, dropout: 1}
model:
  class: M
  body:
    - BLOCK
    - module: {class: Dense, body: [{param: kernel}]}
"""
BLOCK_BODY = "body: [{module: {class: Dense, body: [{param: kernel}, {param: bias}]}}, {make_rng: dropout}]"


def _check_spec(tmp_path, name: str, block: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(CHECK_BASE.replace("BLOCK", block))
    return str(path)


def _fixes(doc) -> list[str]:
    return doc["fixes"]


def test_each_fix_is_applied_and_re_derived_before_it_is_printed(tmp_path):
    """issue 18: a fix is checked by applying it to NEW and deriving again; what the check found is printed with
    it, and applying the fix by hand gives exactly that."""
    old = _check_spec(tmp_path, "old", f"module: {{class: Block, {BLOCK_BODY}}}")
    new = _check_spec(tmp_path, "new", f"module: {{class: Block, name: encoder, {BLOCK_BODY}}}")
    _, doc = run_diff(tmp_path, old, new)
    says = "[checked: re-derived with name='Block_0' at encoder: all 3 changed keys of Block_0 come back]"
    assert any(says in f for f in doc["fixes"]), doc["fixes"]
    fixed = _check_spec(tmp_path, "fixed", f"module: {{class: Block, name: Block_0, {BLOCK_BODY}}}")
    assert invoke("diff", old, fixed).exit_code == 0


def test_a_jit_wrap_of_a_spec_is_paired_and_its_fix_said_to_keep_the_fork(tmp_path):
    """A module wrapped in nn.jit in a spec: paired as a keys file pairs it (Block_0 -> JitBlock_0, the same
    things), and the checked fix says the path comes back while the fork still moves every key."""
    old = _check_spec(tmp_path, "old", f"module: {{class: Block, {BLOCK_BODY}}}")
    new = _check_spec(tmp_path, "new", f"jit: {{module: {{class: Block, {BLOCK_BODY}}}}}")
    _, doc = run_diff(tmp_path, old, new)
    assert "Block_0 -> JitBlock_0: renamed path: nn.jit renames class Block to JitBlock" in doc["notes"][0]
    assert ("Block_0/Dense_0", "JitBlock_0/Dense_0", "kernel") in _things(doc)
    says = "[checked: re-derived with name='Block_0' at JitBlock_0: the paths come back, but none of the 3 changed"
    assert any(says in f and "a new jit fork" in f for f in doc["fixes"]), doc["fixes"]
    fixed = _check_spec(tmp_path, "fixed", f"jit: {{name: Block_0, module: {{class: Block, {BLOCK_BODY}}}}}")
    r = json.loads(invoke("diff", old, fixed, "-f", "json").stdout)["summary"]
    assert r["gone"] == 0 and r["changed"] > 0  # the paths are back, the keys are not


def test_a_vmap_wrap_fix_says_the_keys_are_per_lane_now(tmp_path):
    """issue 18: for a module wrapped in nn.vmap the name fix restored the path and claimed nothing about keys,
    which are per lane now. The fix says so (from the sites' lanes, keys files too), and the check agrees."""
    old = tmp_path / "old.yaml"
    old.write_text(
        "rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n    - module: {class: Attn, body: [{param: kernel}]}\n"
    )
    new = tmp_path / "new.yaml"
    new.write_text(
        "rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n    - vmap: {module: {class: Attn, body: "
        "[{param: kernel}]}, axis_size: 2, split_rngs: {params: true}, variable_axes: {params: 0}}\n"
    )
    _, doc = run_diff(tmp_path, old, new)
    (fix,) = doc["fixes"]
    assert "name='Attn_0'" in fix and "they are drawn per lane now" in fix
    assert "the path comes back, but the changed key of Attn_0 does not" in fix


def test_an_insertion_fix_is_checked_at_the_place_it_names(tmp_path):
    old, new = _denses(tmp_path, "old"), _denses(tmp_path, "inserted_first")
    _, doc = run_diff(tmp_path, old, new)
    says = "[checked: re-derived with name='dense_inserted' at Dense_0: all 3 changed keys of the model come back]"
    assert any(says in f for f in doc["fixes"]), doc["fixes"]
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(new.read_text().replace("- Dense: {features: 4}", "- Dense: {features: 4, name: dense_inserted}"))
    r = invoke("diff", old, fixed, "-f", "json")
    assert r.exit_code == 1  # the named layer is new, every old key is back
    assert [s["path_str"] for s in json.loads(r.stdout)["sites"] if s["status"] != "kept"] == ["dense_inserted"] * 2


def test_a_fix_that_fails_when_applied_is_not_printed(tmp_path):
    """A fix the re-derived model refuses (Flax's NameInUseError, say) is not printed as a fix: a note says it
    was tried and why it fails."""
    from rngaudit.refactor.compare import diff
    from rngaudit.refactor.keys_file import load_sites

    old = load_sites(_check_spec(tmp_path, "old", f"module: {{class: Block, {BLOCK_BODY}}}"))
    new = load_sites(_check_spec(tmp_path, "new", f"module: {{class: Block, name: encoder, {BLOCK_BODY}}}"))
    assert any("name='Block_0'" in f for f in diff(old, new).fixes)
    new.renamed = lambda names: 'Flax raises NameInUseError: Could not create submodule "Block_0"'
    cmp = diff(old, new)
    assert not cmp.fixes and not any(e.fix for e in cmp.entries)
    assert any("was tried" in n and "NameInUseError" in n for n in cmp.notes), cmp.notes
    assert all(e.why for e in cmp.entries if e.status != "kept")  # still explained


def test_a_layers_labelled_draw_keeps_its_label_between_two_specs(tmp_path):
    # (review) a spec's layer draw is labelled ("attention dropout"), a captured one is not, so things are paired by
    # an unlabelled name ("make_rng"); between two specs, which both label it, the thing keeps the label
    body = textwrap.dedent("""
        rngaudit: 1
        phase: init
        rngs: {{params: {seed}, dropout: 1}}
        model:
          class: Block
          body:
          - MultiHeadDotProductAttention: {{num_heads: 2, dropout_rate: 0.1, deterministic: false}}
    """)
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(body.format(seed=0))
    new.write_text(body.format(seed=0).replace("dropout: 1", "dropout: 2"))
    r = invoke("diff", old, new, "-f", "json")
    assert r.exit_code == 1, r.output
    assert [t["what"] for t in json.loads(r.output)["things"]] == ["attention dropout"]


def test_a_split_change_of_one_lane_is_explained_from_the_specs(tmp_path):
    # found by the refactor fuzzer: with axis_size 1 no lanes share a key before or after, so the keys alone do not
    # show that split_rngs changed; the specs say the key is no longer split from its base
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    spec = (
        "rngaudit: 1\nrngs: {params: 0}\nphase: apply\nmodel:\n  class: Block\n"
        "  transforms: [{vmap: {axis_size: 1, split_rngs: SPLIT, variable_axes: {all: 0}}}]\n  body: [make_rng]\n"
    )
    old.write_text(spec.replace("SPLIT", "all"))
    new.write_text(spec.replace("SPLIT", "{all: false}"))
    r = invoke("diff", old, new)
    assert r.exit_code == 1, r.output + r.stderr
    assert "why: a different split: the key is no longer split from the key above it" in r.output, r.output
    assert "unexplained" not in r.output


GENERAL = HEADER + textwrap.dedent("""
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        FIRST
        x = nn.DenseGeneral((2, 3))(x)
        x = nn.DenseGeneral(4, axis=(-2, -1))(x)
        return nn.DenseGeneral((3, 2))(x)

    def make():
      return Model(), (jnp.ones((1, 4)),)
""")


def test_layers_with_sequence_options_pair_between_a_keys_file_and_a_spec(tmp_path):
    """DenseGeneral layers whose features/axis are sequences ([2, 3] in a spec, (2, 3) in a keys file) are the
    same layers on both sides: after one is inserted first, a keys file diffed against a spec follows each
    layer to its new name (real Flax's kernels say each moved layer draws another key), as two keys files do."""
    old_f, old_keys = capture(tmp_path, "old", GENERAL.replace("FIRST", ""))
    new_f, new_keys = capture(tmp_path, "new", GENERAL.replace("FIRST", "x = nn.DenseGeneral((5, 5))(x).sum(-1)"))
    old_params, new_params = flax_params(old_f), flax_params(new_f)
    want = {(f"DenseGeneral_{i}", f"DenseGeneral_{i + 1}", what) for i in range(3) for what in ("kernel", "bias")}
    for mo, mn, what in want:
        if what == "kernel":
            assert not np.array_equal(old_params[_at(mo, what)], new_params[_at(mn, what)])
    for new in (new_keys, tmp_path / "new.yaml"):
        code, doc = run_diff(tmp_path, old_keys, new)
        assert code == 1
        assert _things(doc) == want, new
        assert any("the inserted module at DenseGeneral_0" in f for f in doc["fixes"]), doc["fixes"]


SETUP_JIT = HEADER + textwrap.dedent("""
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(4)(x)
        return nn.Dropout(0.1, deterministic=False)(x)

    class Model(nn.Module):
      def setup(self):
        self.inp = nn.Dense(4)
        self.block = WRAP(Block)()
        self.out = nn.Dense(2)

      def __call__(self, x):
        return self.out(self.block(self.inp(x)))

    def make():
      return Model(), (jnp.ones((1, 4)),)
""")


def test_a_setup_child_wrapped_in_jit_keeps_its_path_and_its_fork_is_explained(tmp_path):
    """nn.jit around a module made in setup() keeps its path (block), adds the fork Flax draws there and changes
    every key below it (real Flax's kernel says so). Each new fork key is explained as the jit fork, no module is
    said to move, and unwrapping it again says the fork is gone; a key that kept its count shows no count."""
    old_f, old_keys = capture(tmp_path, "plain", SETUP_JIT.replace("WRAP(Block)", "Block"))
    new_f, new_keys = capture(tmp_path, "jitted", SETUP_JIT.replace("WRAP(Block)", "nn.jit(Block)"))
    old_params, new_params = flax_params(old_f), flax_params(new_f)
    assert not np.array_equal(old_params[("block", "Dense_0", "kernel")], new_params[("block", "Dense_0", "kernel")])
    for old, new in ((old_keys, new_keys), (tmp_path / "plain.yaml", tmp_path / "jitted.yaml")):
        code, doc = run_diff(tmp_path, old, new)
        assert code == 1
        assert param_sites(doc) == {("block", "Dense_0", "kernel"), ("block", "Dense_0", "bias")}
        forks = [s for s in doc["sites"] if s["status"] == "new"]
        assert {tuple(s["path"]) for s in forks} == {("block",)} and len(forks) == 2, forks
        for s in forks:
            assert s["why"] == ["a new jit fork: nn.jit now wraps the module at block, and forks every stream there"]
        assert not doc["notes"] and not doc["fixes"], (doc["notes"], doc["fixes"])
        text = invoke("diff", old, new).stdout
        assert "block/Dense_0: kernel, bias (params)\n" in text and "count 1 -> 1" not in text, text
    code, doc = run_diff(tmp_path, new_keys, old_keys)
    gone = [s for s in doc["sites"] if s["status"] == "gone"]
    assert len(gone) == 2
    assert all(s["why"] == ["the jit fork at block is gone: nn.jit no longer wraps the module there"] for s in gone)


def test_a_keys_files_fix_is_checked_on_the_spec_capture_wrote_with_it(tmp_path, base):
    """NEW a keys file: its fix is re-derived on the spec `capture -o` wrote beside it (found by the path the keys
    file records, else beside it by name), as for a spec; with no spec, or one edited since so that it no longer
    replays the keys file, the fix says it is not checked rather than claim anything."""
    _, old_keys, _ = base
    _, new_keys = capture(tmp_path, "insert", VARIANTS["insert"])
    checked = "[checked: re-derived with name='dense_inserted' at Dense_0: all "

    def fixes() -> list[str]:
        code, doc = run_diff(tmp_path, old_keys, new_keys)
        assert code == 1 and doc["fixes"], doc
        return doc["fixes"]

    assert all(checked in f for f in fixes()), fixes()
    doc = json.loads(new_keys.read_text())
    doc["spec"] = "elsewhere/insert.yaml"  # (recorded from another working directory: found beside by name)
    new_keys.write_text(json.dumps(doc))
    assert all(checked in f for f in fixes()), fixes()
    spec = tmp_path / "insert.yaml"
    spec.write_text(spec.read_text().replace("rngs: {params: 0", "rngs: {params: 5"))
    for said in (fixes(), (spec.unlink(), fixes())[1]):
        assert all("[not checked: NEW is a keys file, and no spec that replays it was found" in f for f in said)
        assert not any("[checked" in f for f in said)


def _blocks(n: int, wrap: bool, named: bool = False) -> str:
    body = "[{Dense: {features: 3}}, {Dropout: {rate: 0.1, deterministic: false}}]"
    out = ["rngaudit: 1", "rngs: {params: 0, dropout: 1}", "model:", "  class: Model", "  body:"]
    for i in range(n):
        module = f"{{class: Block, body: {body}}}"
        name = f", name: Block_{i}" if named else ""
        out.append(f"    - remat: {{module: {module}{name}}}" if wrap else f"    - module: {module}")
    return "\n".join(out) + "\n"


def test_many_moved_modules_have_their_fixes_checked_together(tmp_path):
    """Every one of 30 blocks wrapped in nn.remat (CheckpointBlock_i): the 30 fixes are checked in one derivation
    with all the old names given together, and the claim holds: the spec with those names derives every old key."""
    old, new, fixed = (
        write(tmp_path, f"{n}.yaml", t)
        for n, t in (("old", _blocks(30, False)), ("new", _blocks(30, True)), ("fixed", _blocks(30, True, named=True)))
    )
    code, doc = run_diff(tmp_path, old, new)
    assert code == 1 and len(doc["fixes"]) == 30
    together = "[checked: re-derived with the 30 old names these fixes give, together: all 90 changed keys of the model"
    assert all(together in f for f in doc["fixes"]), doc["fixes"][:2]
    assert "name='Block_7'" in doc["fixes"][0] + "".join(doc["fixes"])
    code, doc = run_diff(tmp_path, old, fixed)  # (the fixes applied by hand: nothing changed)
    assert code == 0, doc


_STACKED = """
rngaudit: 1
rngs: {params: 0, dropout: 1}
model:
  class: Model
  body:
    - Dense: {features: 4}
    - TRANSFORM
"""
_BLOCK = "{class: Block, body: [{Dense: {features: 4}}, {Dropout: {rate: 0.1, deterministic: false}}]}"


@pytest.mark.parametrize(
    "transform, unit, tool",
    [
        (
            f"scan: {{module: {_BLOCK}, length: 3, split_rngs: {{params: true, dropout: true}}, variable_axes: {{params: 0}}}}",
            "steps",
            "nn.scan",
        ),
        (
            f"vmap: {{module: {_BLOCK}, axis_size: 3, split_rngs: {{params: true, dropout: true}}, variable_axes: {{params: 0}}, name: ensemble}}",
            "lanes",
            "nn.vmap",
        ),
    ],
    ids=["scan", "vmap-named"],
)
def test_a_scan_or_vmap_unrolled_into_modules_is_explained_both_ways(tmp_path, transform, unit, tool):
    """Scan-over-layers replaced by a Python loop of three Blocks (or an ensemble's nn.vmap by three modules):
    every key changes, and each site says why (it said 'this call site no longer exists')."""
    lanes = write(tmp_path, "lanes.yaml", _STACKED.replace("TRANSFORM", transform))
    flat = write(tmp_path, "flat.yaml", _STACKED.replace("TRANSFORM", f"module: {_BLOCK[:-1]}, repeat: 3}}"))
    where = "ensemble" if "ensemble" in transform else "ScanBlock_0"
    r = invoke("diff", lanes, flat)
    assert r.exit_code == 1 and r.stdout.endswith("2 kept, 0 changed, 9 new, 9 gone\n"), r.stdout
    said = (
        f"why: {where} ({tool} over Block, 3 {unit}) was unrolled into the modules Block_0, Block_1, Block_2, or "
        "removed and they added: they draw alike (bias, dropout mask, kernel)."
    )
    assert r.stdout.count(said) == 18 and "no longer exists" not in r.stdout and "did not exist" not in r.stdout
    r = invoke("diff", flat, lanes)
    assert r.exit_code == 1 and "no longer exists" not in r.stdout and "did not exist" not in r.stdout, r.stdout
    assert f"the modules Block_0, Block_1, Block_2 were rolled into {where} ({tool} over Block, 3 {unit})" in r.stdout


def test_a_fix_on_a_module_a_repeated_statement_makes_says_it_is_not_checked(tmp_path):
    """A fix for a module made by a `repeat:` statement (a captured spec's blocks alike) was printed without
    `[checked: ...]` and without saying why, though README says every fix of a spec is checked."""
    old = _check_spec(tmp_path, "old", f"module: {{class: Block, repeat: 2, {BLOCK_BODY}}}")
    new = _check_spec(tmp_path, "new", f"remat: {{module: {{class: Block, {BLOCK_BODY}}}, repeat: 2}}")
    _, doc = run_diff(tmp_path, old, new)
    fixes = [f for f in doc["fixes"] if "Block_1" in f]
    assert fixes and all("[not checked: in NEW's spec CheckpointBlock_1 is made by a statement" in f for f in fixes)
    assert all("[checked" in f or "[not checked" in f for f in doc["fixes"]), doc["fixes"]


NNX_KEYS_SPEC = """\
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
run: [call, call]
model:
  class: M
  init: [Linear: {name: fc}, Dropout: {name: drop, rate: 0.5}]
  call: [call: drop]
"""


def _keys_doc(spec) -> dict:
    """The keys document of a spec file's keys (what `capture --keys` writes, made from the spec's replay)."""
    from rngaudit.refactor.keys_file import capture_to_json, spec_capture
    from rngaudit.spec.parse import load_spec

    return capture_to_json(spec_capture(str(spec), load_spec(str(spec))), str(spec))


def _nnx_keys_doc(tmp_path) -> dict:
    spec = tmp_path / "s.yaml"
    spec.write_text(NNX_KEYS_SPEC)
    return _keys_doc(spec)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["calls"][1].update(iteration="x"), "calls[1]: `iteration` must be a scan step"),
        (lambda d: d["calls"][1].update(lane=["x"]), "calls[1]: `lane` must be a list of lane indices"),
        (lambda d: d.update(calls=None), "`calls` is the list of the keys handed out"),
        (lambda d: d.update(calls={}), "`calls` is the list of the keys handed out"),
        (lambda d: d["calls"].__setitem__(0, 5), "calls[0]: a call record is a mapping, not 5"),
        (lambda d: d.update(rngs="x"), "`rngs` is a mapping, not 'x'"),
        (lambda d: d.update(versions="0.12"), "`versions` is a mapping, not '0.12'"),
        (lambda d: d["calls"][1].update(key=None), "calls[1]: `key` is null (every NNX key handed out exists)"),
        (lambda d: d["calls"][1].update(step=-1), "calls[1]: `step` must be an integer (0 construction"),
        (lambda d: d["calls"][1].pop("step"), "calls[1]: `step` is missing"),
        (lambda d: d["calls"][1].update(chain="key 1"), "calls[1]: `chain` must be a list of text"),
        (lambda d: d["calls"][1].update(stream=None), "calls[1]: `stream` must be a stream name, not None"),
        (lambda d: d["calls"][1].update(context="vmap"), "calls[1]: `context` must be a list of text"),
        (lambda d: d["jax"].update(prng_impl="bogus"), "`jax.prng_impl` is one of threefry2x32, rbg, unsafe_rbg"),
        (lambda d: d.update(phase="bogus"), "`phase` is one of init, apply, call, not 'bogus'"),
        (lambda d: d.update(eval_steps=[0]), "`eval_steps` must be a list of step numbers"),
        (lambda d: d.update(flavour="jax"), "`flavour` is linen or nnx, not 'jax'"),
    ],
)
def test_a_bad_keys_file_is_one_error_line_at_the_field(tmp_path, edit, message):
    # (these were raw Python exception texts without a place, or read as if valid: exit 0 or 1)
    good = tmp_path / "good.json"
    doc = _nnx_keys_doc(tmp_path)
    good.write_text(json.dumps(doc, indent=2))
    edit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc, indent=2))
    r = invoke("diff", good, bad)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
    assert re.match(rf"error: {re.escape(str(bad))}:\d+:\d+: not a valid rngaudit.capture file: ", r.stderr), r.stderr
    assert message in r.stderr, r.stderr
    assert invoke("diff", good, good).exit_code == 0  # (the file it was edited from is valid)


def test_a_keys_file_holding_an_integer_past_pythons_limit_is_an_error_at_it(tmp_path):
    # (json.loads raised a bare ValueError past 4,300 digits: an internal error)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "rngaudit.capture", "format_version": 1,\n "calls": [' + "9" * 5000 + "]}")
    r = invoke("diff", bad, bad)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {bad}:2:12: an integer of 5000 digits"), r.stderr


def test_verify_of_a_spec_against_keys_of_the_other_flavour_is_a_usage_error(tmp_path):
    # (it compared them: exit 1, every key missing or extra, as diff refuses to)
    linen = tmp_path / "linen.yaml"
    linen.write_text("rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: M\n  body: [Dense: {}]\n")
    nnx = tmp_path / "nnx.yaml"
    nnx.write_text(NNX_KEYS_SPEC)
    for spec, other in ((linen, nnx), (nnx, linen)):
        keys = tmp_path / f"{other.stem}.json"
        keys.write_text(json.dumps(_keys_doc(other)))
        r = invoke("verify", spec, "--against", keys)
        assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
        assert "verify checks a spec against the model it describes" in r.stderr, r.stderr


_MANY = """\
rngaudit: 1
rngs: {params: 0, dropout: 1}
model:
  class: Model
  body:
    - module:
        class: CLASS
        repeat: 60
        body:
          - make_rng: {stream: dropout, repeat: 2}
"""


def test_a_rename_of_many_repeated_modules_names_a_few_of_them_in_each_fix(tmp_path):
    """Renaming the class of a `repeat: 1000` statement listed all 1,000 new paths in the fix of every one of its
    100,000 keys (1.9 GB of text); the fix names four and counts the rest. Each gone key's annotation still points
    at the row of the new spec nearest its old module (looked up by path prefix now, not by a scan per key)."""
    old = write(tmp_path, "old.yaml", _MANY.replace("CLASS", "Block"))
    new = write(tmp_path, "new.yaml", _MANY.replace("CLASS", "Blk"))
    doc = json.loads(invoke("diff", old, new, "-f", "json").stdout)
    fixes = [s["fix"] for s in doc["sites"] if s["status"] == "gone"]
    assert len(fixes) == 120
    assert all("[not checked: in NEW's spec Blk_0, Blk_1, Blk_2, Blk_3 and 56 more is made by" in f for f in fixes)
    r = invoke("diff", old, new, "-f", "github")
    assert r.exit_code == 1
    gone = [a for a in annotations(r.stdout) if a[4] == "rngaudit diff/gone"]
    rows = spec_rows(new)
    assert len(gone) == 120 and all((a[2], a[3]) in rows.values() for a in gone)
    # no module of NEW shares a name with Block_*: every gone key is shown at the first row (the root's nearest)
    assert {a[5].rsplit("[", 1)[1] for a in gone} == {f"{new} has no such call site; shown at Blk_0 dropout count 1]"}


def test_the_nearest_row_is_the_longest_shared_prefix_first_in_order():
    """output.findings._nearest (an index by path prefix) against its definition: the located site sharing the
    longest module-path prefix with the path, the first such in site order; unlocated sites never."""
    import random

    from rngaudit.errors import Location
    from rngaudit.output.findings import _nearest
    from rngaudit.refactor.keys_file import Capture, Site

    def brute(sites, path):
        best, depth = None, -1
        for t in sites:
            if t.location is None:
                continue
            n = 0
            while n < min(len(t.path), len(path)) and t.path[n] == path[n]:
                n += 1
            if n > depth:
                best, depth = t, n
        return best

    rng = random.Random(7)
    names = ["a", "b", "c"]
    for trial in range(200):
        sites = [
            Site(
                tuple(rng.choice(names) for _ in range(rng.randrange(4))),
                "params",
                "params",
                i + 1,
                (),
                (0, i),
                location=None if rng.random() < 0.3 else Location("x.yaml", i + 1, 1),
            )
            for i in range(rng.randrange(6))
        ]
        cap = Capture("x", "init", {}, {}, sites, {})
        for _ in range(5):
            path = tuple(rng.choice(names) for _ in range(rng.randrange(5)))
            assert _nearest(cap, path) is brute(sites, path), (trial, sites, path)


def _keys_file(tmp_path, name: str, text: str):
    """A spec and its keys file (_keys_doc)."""
    spec = write(tmp_path, f"{name}.yaml", text)
    keys = tmp_path / f"{name}.keys.json"
    keys.write_text(json.dumps(_keys_doc(spec)))
    return spec, keys


def _named_then_repeated(insert: bool) -> str:
    head = "rngaudit: 1\nrngs: {params: 0, dropout: 1}\nmodel:\n  class: Model\n  body:\n"
    inserted = "    - module: {class: Block, body: [{make_rng: {stream: dropout, repeat: 2}}]}\n" if insert else ""
    named = "".join(
        f"    - module: {{class: Block, name: m{i}, body: [{{make_rng: {{stream: dropout, repeat: 2}}}}]}}\n"
        for i in range(3)
    )
    return head + inserted + named + "    - module: {class: Block, repeat: 3, body: [{make_rng: {stream: dropout}}]}\n"


def test_a_block_inserted_before_named_siblings_moves_none_of_them(tmp_path):
    """An unnamed Block inserted before m0, m1, m2 (explicitly named Blocks) and auto-named ones: every key of the
    named modules is kept. The keys files' diff paired its modules in creation order by class alone and said
    'the module that was m0 is now Block_0', 'm1 is now m0', ... with a failed fix for each (and re-derived the
    model once per module: 21 s for 1,000 of them). It now says what the specs' diff says."""
    old_spec, old_keys = _keys_file(tmp_path, "old", _named_then_repeated(False))
    new_spec, new_keys = _keys_file(tmp_path, "new", _named_then_repeated(True))
    specs = invoke("diff", old_spec, new_spec)
    keys = invoke("diff", old_keys, new_keys)
    assert specs.exit_code == keys.exit_code == 1
    assert specs.stdout.splitlines()[-1] == keys.stdout.splitlines()[-1] == "9 kept, 0 changed, 2 new, 0 gone"
    assert "the module that was" not in keys.stdout and "NameInUseError" not in keys.stdout, keys.stdout
    doc = json.loads(invoke("diff", old_keys, new_keys, "-f", "json").stdout)
    assert doc["things"] == [] and [s["path_str"] for s in doc["sites"] if s["status"] == "new"] == [
        "Block_0",
        "Block_3",
    ]


def test_where_a_sibling_was_inserted_is_every_place_its_removal_explains():
    """compare._inserted_at (one pass from each end) against its definition: every i whose removal from the new
    siblings leaves the old ones."""
    import random

    from rngaudit.refactor import compare
    from rngaudit.refactor.keys_file import Capture

    rng = random.Random(3)
    for _ in range(3000):
        n = rng.randrange(1, 7)
        new = [rng.randrange(3) for _ in range(n)]
        old = [rng.randrange(3) for _ in range(n - 1)]
        if rng.random() < 0.5:
            i = rng.randrange(n)
            old = new[:i] + new[i + 1 :]
        cls = "Block"
        cap_old = Capture(
            "o",
            "init",
            {},
            {},
            [],
            {("x", f"{cls}_{i}"): {"class": cls, "fields": f"({v})"} for i, v in enumerate(old)},
        )
        cap_new = Capture(
            "n",
            "init",
            {},
            {},
            [],
            {("x", f"{cls}_{i}"): {"class": cls, "fields": f"({v})"} for i, v in enumerate(new)},
        )
        want = [i for i in range(n) if new[:i] + new[i + 1 :] == old]
        assert compare._inserted_at(cap_old, cap_new, ("x",), cls, n) == want, (old, new)


_NAMED = HEADER + textwrap.dedent("""
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        INSERTED
        x = nn.Dense(4, name='proj')(x)
        x = nn.Dense(4, name='head')(x)
        return nn.Dense(4)(x)

    def make():
      return Model(), (jnp.ones((1, 4)),)
""")


def test_a_dense_inserted_before_named_denses_matches_flax(tmp_path):
    """The keys-file case above on a live Flax model: an unnamed Dense inserted before Dense(name='proj') and
    Dense(name='head'). Flax initialises proj and head exactly as before; the diff reports exactly the param
    sites whose values real Flax changed, and never says proj or head moved."""
    old_f, old_keys = capture(tmp_path, "old", _NAMED.replace("    INSERTED\n", ""))
    new_f, new_keys = capture(tmp_path, "new", _NAMED.replace("INSERTED", "x = nn.Dense(4)(x)"))
    code, doc = run_diff(tmp_path, old_keys, new_keys)
    expected = flax_changed(flax_params(old_f), flax_params(new_f))
    assert expected and not any(k[0] in ("proj", "head") for k in expected)
    assert code == 1 and param_sites(doc) == expected
    moved = [t for t in doc["things"] if t["old_module"] != t["new_module"]]
    assert not any(t["old_module"][:1] in (["proj"], ["head"]) for t in moved), doc["things"]
    text = invoke("diff", old_keys, new_keys).stdout
    assert "the module that was proj" not in text and "the module that was head" not in text, text
