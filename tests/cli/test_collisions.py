"""`rngaudit collisions`: text and JSON reports, exit codes, file output, errors, and a JAX-free start."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import support
from hypothesis import given, settings
from hypothesis import strategies as st
from support import REPO, run_cli
from typer.testing import CliRunner

import rngaudit
from rngaudit.cli import app

FIX = REPO / "fixtures" / "collisions"
GUIDE = REPO / "fixtures" / "guide"


def fx(name: str) -> str:
    return str(FIX / name)


def invoke(*args: str):
    return support.invoke("collisions", *args)


# ---------------------------------------------------------------- exit codes
@pytest.mark.parametrize(
    "name, code",
    [
        ("clean.yaml", 0),
        ("sharp_edge.yaml", 1),
        ("abc_family.yaml", 1),
        ("hash_word.yaml", 1),
        ("shared_seed.yaml", 1),
        ("separator_survivor.yaml", 1),
        ("latent.yaml", 0),
        ("paths.json", 1),
        ("params_tree.json", 1),
    ],
)
def test_exit_codes(name, code):
    r = invoke(fx(name))
    assert r.exit_code == code, r.stdout + r.stderr
    assert r.stderr == ""


def test_strict_fails_on_latent_and_information():
    assert invoke(fx("latent.yaml")).exit_code == 0
    r = invoke(fx("latent.yaml"), "--strict")
    assert r.exit_code == 1
    # the summary says "0 failing" (each class's default): stderr says what fails the run
    assert "0 failing" in r.stdout
    assert r.stderr == (
        "exit 1: --strict (the option, or its [tool.rngaudit] setting) fails the run on findings the summary counts "
        "as information or latent\n"
    )
    assert invoke(fx("latent.yaml"), "--strict", "--exit-zero").stderr == ""
    assert invoke(fx("latent.yaml"), "--latent-max-count", "0", "--strict").exit_code == 0
    assert invoke(fx("clean.yaml"), "--strict").exit_code == 0


def test_any_failing_input_fails_the_run():
    r = invoke(fx("clean.yaml"), fx("sharp_edge.yaml"))
    assert r.exit_code == 1
    assert "total: 1 failing, 0 information, 0 latent in 2 inputs" in r.stdout


# ---------------------------------------------------------------- the text report
def test_text_report_says_what_why_and_the_checked_fixes():
    r = invoke(fx("sharp_edge.yaml"))
    out = r.stdout
    assert "FAIL  class 1 (concatenation): 2 call sites get the same key [2583384977 2116611972]" in out
    assert f"{fx('sharp_edge.yaml')}:8:89" in out and f"{fx('sharp_edge.yaml')}:9:89" in out
    assert "hash input 61626364656601 b'abcdef\\x01' -> word 2040429404" in out
    assert "fix_rng_separator: true removes it (checked:" in out
    assert "flipping fix_rng_separator changes every key in the model (all 2 here)" in out
    assert f"rename module abc/def (Leaf) at {fx('sharp_edge.yaml')}:9:56: `name: def` -> `name: def_1`" in out
    assert "1 failing, 0 information, 0 latent" in out
    assert "\x1b[" not in out


def test_text_report_of_each_class():
    out = invoke(fx("count_meets_name.yaml")).stdout
    assert "class 2 (count_meets_name)" in out and "layer count 12545 = 0x3101" in out
    out = invoke(fx("hash_word.yaml")).stdout
    assert "class 3 (hash_word)" in out and out.count("-> word 2867556399") == 2
    out = invoke(fx("shared_seed.yaml")).stdout
    assert "class 4 (shared_seed): 2 keys shared by 4 call sites" in out
    assert "does NOT remove it" in out and "no rename helps" in out
    out = invoke(fx("latent.yaml")).stdout
    assert "LATENT layer (stream params" in out and "reaches count 3" in out
    assert "count 1 (reaches 1) = layer count 12545 (0x3101)" in out
    out = invoke(fx("separator_survivor.yaml")).stdout
    assert "a\\x00/b" in out and "\x00" not in out  # names are shown escaped


# ---------------------------------------------------------------- JSON
def as_json(*args: str) -> tuple[str, dict]:
    r = invoke(*args, "--format", "json")
    assert r.exit_code in (0, 1) and r.stderr == ""
    return r.stdout, json.loads(r.stdout)


def test_json_format():
    text, doc = as_json(fx("sharp_edge.yaml"), fx("paths.json"))
    assert doc["format"] == "rngaudit.collisions" and doc["format_version"] == 1
    assert doc["rngaudit_version"] == rngaudit.__version__
    assert doc["summary"] == {"inputs": 2, "failing": 2, "info": 0, "latent": 1}
    spec, paths = doc["inputs"]
    assert (spec["input"], spec["call_sites"], spec["keys_checked"], spec["prng_impl"]) == (
        "spec",
        2,
        True,
        "threefry2x32",
    )
    (c,) = spec["collisions"]
    assert (c["class"], c["category"], c["failing"]) == (1, "concatenation", True)
    (h,) = c["inputs"]
    assert h["hash_input_hex"] == "61626364656601" and h["hash_word"] == 2040429404
    assert h["key"] == [2583384977, 2116611972]
    site = h["sites"][1]
    assert site["path"] == ["abc", "def"] and site["hash_items"] == ["abc", "def", 1]
    assert site["location"] == {"file": fx("sharp_edge.yaml"), "line": 9, "col": 89}
    assert c["separator"] == {
        "flag": False,
        "removes": True,
        "changes_every_key": True,
        "keys_in_model": 2,
        "detail": "with it every call site of this finding gets its own key",
    }
    (r,) = c["renames"]
    assert (r["path"], r["old_name"], r["new_name"], r["keys_changed"]) == (["abc", "def"], "def", "def_1", 1)
    assert (paths["input"], paths["keys_checked"], paths["prng_impl"]) == ("paths", False, None)
    assert paths["collisions"][0]["inputs"][0]["key"] is None
    (lt,) = paths["latent"]
    assert lt["site"]["path"] == ["layer"] and lt["partners"][0]["counts"] == [12545, 1]
    assert lt["partners"][0]["hash_input_hex"] == b"layer1\x01".hex()
    # sorted and deterministic
    assert text == json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    assert text == as_json(fx("sharp_edge.yaml"), fx("paths.json"))[0]


def test_json_is_identical_across_processes(tmp_path):
    outs = []
    for k in range(2):
        out = tmp_path / f"{k}.json"
        r = run_cli("collisions", fx("abc_family.yaml"), fx("latent.yaml"), "-f", "json", "-o", str(out))
        assert r.returncode == 1 and r.stdout == "" and r.stderr == ""
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- options
def test_options():
    _, doc = as_json(fx("shared_seed.yaml"), "--no-keys")
    assert doc["inputs"][0]["keys_checked"] is False and doc["inputs"][0]["collisions"] == []
    assert invoke(fx("sharp_edge.yaml"), "--fix-rng-separator").exit_code == 0
    _, doc = as_json(fx("separator_survivor.yaml"), "--fix-rng-separator")
    assert doc["inputs"][0]["collisions"][0]["separator"]["flag"] is True
    _, doc = as_json(fx("latent.yaml"), "--latent-max-count", "12544")
    assert doc["inputs"][0]["latent"] == []
    _, doc = as_json(fx("latent.yaml"), "--latent-max-count", "12545")
    assert len(doc["inputs"][0]["latent"]) == 1
    # --phase init makes the guide's sharp edge (an apply spec) no different: make_rng keys either way
    assert invoke(fx("sharp_edge.yaml"), "--phase", "init").exit_code == 1


def test_output_is_written_only_after_success(tmp_path):
    out = tmp_path / "report.json"
    r = invoke(fx("sharp_edge.yaml"), "-f", "json", "-o", str(out))
    assert r.exit_code == 1 and r.stdout == ""
    assert json.loads(out.read_text())["summary"]["failing"] == 1
    out.write_text("previous\n")
    r = invoke(fx("sharp_edge.yaml"), fx("bad.json"), "-o", str(out))
    assert r.exit_code == 2 and r.stdout == ""
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


# ---------------------------------------------------------------- bad input: exit 2, one line
@pytest.mark.parametrize(
    "name, text, message",
    [
        ("bad.json", None, "bad.json:3:47: invalid JSON: Expecting property name enclosed in double quotes"),
        ("entry.json", '[\n  "a/b",\n  {"path": "c"}\n]\n', "entry.json:3:3: entry 1: a module path is a string"),
        ("dup.json", '{"a": {"w": [1]},\n "a": {}}\n', "dup.json:2:2: duplicate key 'a'"),
        ("spec.yaml", "rngaudit: 1\nmodel: {class: M, bdy: []}\n", "spec.yaml:2:19: unknown key 'bdy'"),
        ("missing.yaml", None, "missing.yaml:1:1: no such file"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, name, text, message):
    path = fx(name) if text is None and name == "bad.json" else str(tmp_path / name)
    if text is not None:
        Path(path).write_text(text)
    r = invoke(path)
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert message in r.stderr, r.stderr
    r = run_cli("collisions", path)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_usage_errors_exit_2():
    assert CliRunner().invoke(app, ["collisions"]).exit_code == 2
    assert invoke(fx("clean.yaml"), "--latent-max-count", "-1").exit_code == 2
    assert invoke(fx("clean.yaml"), "--format", "yaml").exit_code == 2


# ---------------------------------------------------------------- a fast, JAX-free start
_NO_JAX = textwrap.dedent("""
    import sys
    from rngaudit.cli import main
    sys.argv = ["rngaudit", "collisions", *sys.argv[1:]]
    try:
        main()
    except SystemExit as e:
        print("exit:", e.code)
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
    print("imported:", heavy)
    print("numpy:", "numpy" in sys.modules)
""")


UNSAFE_RBG = """rngaudit: 1
jax: {prng_impl: unsafe_rbg}
rngs: {params: 0}
model: {class: M, body: [{module: {class: N, name: ab, body: [{module: {class: L, name: cdef, body: [make_rng]}}]}},
                         {module: {class: N, name: abc, body: [{module: {class: L, name: def, body: [make_rng]}}]}}]}
"""


def run_no_jax(tmp_path, args: list[str]) -> str:
    if args[0] == "UNSAFE_RBG":
        (tmp_path / "u.yaml").write_text(UNSAFE_RBG)
        args = [str(tmp_path / "u.yaml"), *args[1:]]
    r = subprocess.run([sys.executable, "-c", _NO_JAX, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "imported: []" in r.stdout, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize(
    "args",
    [
        [fx("sharp_edge.yaml")],
        [fx("shared_seed.yaml"), fx("latent.yaml"), "--format", "json"],
        [fx("paths.json"), fx("params_tree.json")],
        [str(GUIDE / "jit_init.yaml"), str(GUIDE / "vmap_model_other_unsplit.yaml"), str(GUIDE / "sharp_edge.yaml")],
        ["UNSAFE_RBG", "--no-keys"],  # unsafe_rbg keys need JAX; hash-only does not
    ],
)
def test_collisions_never_imports_jax_nor_numpy_for_small_inputs(tmp_path, args):
    """Small inputs (fewer than collisions.SMALL_SITES call sites) run on Python lists and ints: the
    command starts without NumPy, let alone JAX."""
    out = run_no_jax(tmp_path, args)
    assert "exit: 1" in out and "numpy: False" in out, out


def test_the_guide_example_starts_without_numpy(tmp_path):
    out = run_no_jax(tmp_path, [str(REPO / "rngaudit" / "examples" / "guide.yaml")])
    assert "exit: 0" in out and "numpy: False" in out, out


def test_large_inputs_use_numpy_and_still_no_jax(tmp_path):
    from rngaudit.collision.sites import SMALL_SITES

    paths = tmp_path / "many.json"
    paths.write_text(json.dumps([f"Block_{i}/Dense_0" for i in range(SMALL_SITES)] + ["ab/cdef", "abc/def"]))
    out = run_no_jax(tmp_path, [str(paths)])
    assert "exit: 1" in out and "numpy: True" in out, out


def test_python_dash_m():
    r = run_cli("collisions", fx("clean.yaml"))
    assert r.returncode == 0 and "0 failing, 0 information, 0 latent" in r.stdout and r.stderr == ""


def test_a_spec_written_as_json_is_a_spec(tmp_path):
    import yaml

    spec = tmp_path / "sharp_edge.json"
    spec.write_text(json.dumps(yaml.safe_load((FIX / "sharp_edge.yaml").read_text()), indent=1))
    _, doc = as_json(str(spec))
    assert doc["inputs"][0]["input"] == "spec" and doc["inputs"][0]["collisions"][0]["class"] == 1


# ---------------------------------------------------------------- the text tables
CELLS = st.text(
    # (no control codes: every cell is shown escaped, `\x07`, by the renderers)
    alphabet=st.sampled_from(["a", "Z", "_", "/", " ", "é", "日", "本", "🙂", "(", "'", "\u0301"]),
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 6).flatmap(lambda n: st.lists(st.lists(CELLS, min_size=n, max_size=n), min_size=1, max_size=5)),
    st.sampled_from([(False, 400), (True, 400), (True, 30), (False, 12)]),
)
def test_rows_print_as_the_rich_table_does(rows, console_kind):
    """render_collisions prints its tables without rich.table's measuring (thousands of tables in the
    report of a large model): rows that fit are the characters of the rich Table it replaces, on a plain file
    console (without its trailing spaces) and on a coloured terminal, wide characters and control codes
    included. Rows wider than the console are never cropped (rich.table would shrink them with "…"): every
    cell is printed whole, in order, and the terminal wraps the line."""
    import io
    import re

    from rich.cells import cell_len
    from rich.console import Console
    from rich.text import Text

    from rngaudit.output.text_collisions import _print_rows, _table

    tty, width = console_kind

    def console(buf):
        return Console(file=buf, force_terminal=tty, no_color=not tty, width=width, highlight=False, soft_wrap=not tty)

    ours, theirs = io.StringIO(), io.StringIO()
    _print_rows([list(r) for r in rows], console(ours))
    widths = [max(max(cell_len(r[c]) for r in rows), 1 if c == len(rows[0]) - 1 else 0) for c in range(len(rows[0]))]
    if sum(widths) + 2 * (len(widths) - 1) <= width or not tty:
        table = _table(*(str(c) for c in range(len(rows[0]))))
        for r in rows:
            table.add_row(*(Text(cell, style="bold" if c == 1 else "") for c, cell in enumerate(r)))
        wide = Console(file=theirs, force_terminal=tty, no_color=not tty, width=max(width, 400), highlight=False)
        (console(theirs) if tty else wide).print(table)
        expected, got = theirs.getvalue(), ours.getvalue()
        if not tty:  # (a file gets no trailing spaces)
            expected = "\n".join(line.rstrip(" ") for line in expected.split("\n"))
            got = "\n".join(line.rstrip(" ") for line in got.split("\n"))
        assert got == expected
        return

    def bare(text: str) -> str:  # (without colour codes)
        return re.sub(r"\x1b\[[0-9;]*m", "", text)

    shown = bare(ours.getvalue()).split("\n")
    assert len(shown) == len(rows) + 1 and shown[-1] == ""
    for line, r in zip(shown, rows):
        at = 0
        for cell in map(bare, r):
            found = line.find(cell, at)
            assert found >= 0, (cell, line)
            at = found + len(cell)


def test_a_narrow_terminal_leaves_out_optional_columns_and_crops_nothing():
    """On a terminal too narrow for a collision's call sites, the hash items and then the kind are left out; the
    path, stream, count, location and a shared key stay whole (they were cropped to `ab/cd…  count…`), and the
    finding's key goes on a line of its own rather than being split by a wrap."""
    import io
    import re

    from rich.console import Console

    from rngaudit.output.text_collisions import render_collisions

    report = rngaudit.collisions(fx("sharp_edge.yaml"))
    for width, kept_items in ((200, True), (75, False), (50, False)):
        buf = io.StringIO()
        render_collisions(report.audits, Console(file=buf, force_terminal=True, no_color=True, width=width))
        text = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
        for whole in ("ab/cdef", "abc/def", "count 1", "sharp_edge.yaml:8:", "[2583384977 2116611972]"):
            assert whole in text, (width, whole, text)
        assert "…" not in text
        assert ("('abc', 'def', 1)" in text) is kept_items
        if width < 100:
            assert "\n   key        [2583384977 2116611972]\n" in text
    # piped or written to a file: every column, whatever the width
    out = invoke(fx("sharp_edge.yaml")).stdout
    assert "('abc', 'def', 1)" in out and "same key [2583384977 2116611972]" in out


def test_fail_on_takes_every_rule_by_the_name_annotations_and_sarif_show():
    """One name per rule: `--fail-on` takes a category as named in JSON (`hash_word`), dashed (`hash-word`) or as
    the rule id of its github annotation and SARIF result (`collisions/hash-word`)."""
    from rngaudit.cli.options import Category, category
    from rngaudit.collision.results import FINDING_CATEGORIES
    from rngaudit.collision.suppress import rule_id
    from rngaudit.output.findings import COLLISION_RULES

    # every finding's rule is a category's (an input error is no finding to fail on)
    rules = {c: rule_id(c) for c in FINDING_CATEGORIES}
    assert {r.id for r in COLLISION_RULES} - {"collisions/input-error"} == set(rules.values())
    assert {c.value for c in Category} == set(FINDING_CATEGORIES)
    for cat, rule in rules.items():
        assert category(rule) == category(rule.split("/")[1]) == category(cat) == cat
        assert Category(category(rule)).value == cat
    hit = "fixtures/collisions/hash_word.yaml"
    for name in ("hash_word", "hash-word", "collisions/hash-word"):
        assert support.invoke("collisions", hit, "--fail-on", name).exit_code == 1, name
    assert support.invoke("collisions", hit, "--fail-on", "collisions/concatenation").exit_code == 0
    bad = support.invoke("collisions", hit, "--fail-on", "collisions/nope")
    assert bad.exit_code == 2 and "'collisions/nope' is not a category" in bad.stderr
    # JSON names each finding by its rule too, as the annotation does
    doc = json.loads(support.invoke("collisions", hit, "-f", "json").stdout)
    assert doc["inputs"][0]["collisions"][0]["rule"] == "collisions/hash-word"
