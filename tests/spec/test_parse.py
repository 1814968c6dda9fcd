"""Every malformed spec under tests/bad_specs is refused the same way by the real command line:
one line `error: FILE:LINE:COL: message` on stderr, exit 2, nothing on stdout, no traceback,
and with --output no file at all.

Each file's first line says what is expected: `# expect: LINE:COL: message-substring`.
Every file runs in-process through the typer app with `--output`; a representative handful
(every kind of problem, and every generated input) also runs as the real command,
`python -m rngaudit derive FILE`, in subprocesses. RNGAUDIT_TEST_ALL_SUBPROCESS=1 runs every
file as a subprocess too (about 0.35 s of CPU each).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import BAD_SPECS, REPO
from typer.testing import CliRunner

from rngaudit.cli import app

BAD = BAD_SPECS
EXPECT = re.compile(r"^# expect: (\d+):(\d+): (.+?)\s*$")


@dataclass(frozen=True)
class Case:
    name: str
    path: str  # as given on the command line (relative to the repository root)
    line: int
    col: int
    message: str


def _expectation(path: Path) -> tuple[int, int, str]:
    with open(path, "rb") as f:
        first = f.readline()
    if first.startswith(b"\xef\xbb\xbf"):
        first = first[3:]
    m = EXPECT.match(first.decode("utf-8", errors="replace"))
    if not m:
        raise ValueError(f"{path}: the first line must be `# expect: LINE:COL: message`")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def _cases() -> list[Case]:
    out = []
    for p in sorted(BAD.iterdir()):
        if p.suffix not in (".yaml", ".yml"):
            continue
        line, col, msg = _expectation(p)
        out.append(Case(p.stem, str(p.relative_to(REPO)), line, col, msg))
    return out


CASES = _cases()

# Run as real subprocesses by default: one or more of each kind of problem.
SUBPROCESS_HANDFUL = {
    "yaml_unclosed_quote",
    "yaml_control_character",
    "yaml_several_documents",
    "yaml_only_comments",
    "yaml_tab_indent",
    "top_is_a_list",
    "missing_rngaudit",
    "non_utf8",
    "bom",
    "crlf_line_endings",
    "alias_bomb",
    "nesting_10000_deep",
    "recursive_alias",
    "tag_python_object",
    "timestamp_value",
    "merge_key",
    "duplicate_key_top",
    "unknown_key_make_rng",
    "keyexpr_seed_out_of_int64",
    "raw_key_wrong_width",
    "invalid_rng_stream",
    "name_in_use_module",
    "call_unknown_child",
    "dropout_missing_deterministic",
    "repeat_multiplied_out",
    "draw_huge_shape",
}
if os.environ.get("RNGAUDIT_TEST_ALL_SUBPROCESS"):
    SUBPROCESS_CASES = CASES
else:
    SUBPROCESS_CASES = [c for c in CASES if c.name in SUBPROCESS_HANDFUL]


def _generated(tmp: Path) -> list[Case]:
    """Bad inputs that cannot carry an `# expect:` line: made fresh for the run."""
    empty = tmp / "empty.yaml"
    empty.write_bytes(b"")
    directory = tmp / "a_directory.yaml"
    directory.mkdir()
    blank = tmp / "blank_lines.yaml"
    blank.write_text("\n\n   \n")
    utf16 = tmp / "utf16.yaml"
    utf16.write_bytes("rngaudit: 1\nmodel: {class: M}\n".encode("utf-16"))
    return [
        Case("empty_file", str(empty), 1, 1, "the spec is empty; start with `rngaudit: 1`"),
        Case("directory", str(directory), 1, 1, "is a directory, not a spec file"),
        Case("blank_lines", str(blank), 1, 1, "the spec is empty"),
        Case("missing_file", str(tmp / "no_such_spec.yaml"), 1, 1, "no such file"),
        Case("utf16", str(utf16), 1, 1, "the file is not UTF-8 (byte 0xff); save it as UTF-8"),
    ]


def check_refusal(case: Case, rc: int, stdout: str, stderr: str) -> None:
    assert rc == 2, f"{case.name}: exit {rc}, stderr: {stderr!r}"
    assert stdout == "", f"{case.name}: stdout not empty: {stdout[:500]!r}"
    assert "Traceback" not in stderr, f"{case.name}: {stderr}"
    assert stderr.endswith("\n") and stderr.count("\n") == 1, f"{case.name}: not one line: {stderr!r}"
    line = stderr[:-1]
    prefix = f"error: {case.path}:{case.line}:{case.col}: "
    assert line.startswith(prefix), f"{case.name}: expected {prefix!r}..., got {line!r}"
    assert case.message in line[len(prefix) :], f"{case.name}: {case.message!r} not in {line!r}"


def test_enough_bad_specs():
    assert len(CASES) >= 50
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert SUBPROCESS_HANDFUL <= set(names)


# ---------------------------------------------------------------- the real CLI, in subprocesses
@dataclass(frozen=True)
class Ran:
    rc: int
    stdout: str
    stderr: str


def _run_cli(args: list[str]) -> Ran:
    env = dict(os.environ, NO_COLOR="1", PYTHONIOENCODING="utf-8")
    env.pop("RNGAUDIT_DEBUG", None)
    p = subprocess.run(
        [sys.executable, "-m", "rngaudit", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        timeout=120,
    )
    return Ran(p.returncode, p.stdout, p.stderr)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[Case]:
    return _generated(tmp_path_factory.mktemp("generated"))


@pytest.fixture(scope="module")
def subprocess_results(generated) -> dict[str, Ran]:
    """Every case through `python -m rngaudit derive`, a few at a time."""
    cases = SUBPROCESS_CASES + generated
    workers = max(2, min(8, (os.cpu_count() or 2) * 2))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: _run_cli(["derive", c.path]), cases))
    return {c.name: r for c, r in zip(cases, results)}


@pytest.mark.parametrize("case", SUBPROCESS_CASES, ids=[c.name for c in SUBPROCESS_CASES])
def test_bad_spec_subprocess(case: Case, subprocess_results):
    r = subprocess_results[case.name]
    check_refusal(case, r.rc, r.stdout, r.stderr)


@pytest.mark.parametrize("name", ["empty_file", "directory", "blank_lines", "missing_file", "utf16"])
def test_generated_bad_input_subprocess(name, generated, subprocess_results):
    case = next(c for c in generated if c.name == name)
    r = subprocess_results[name]
    check_refusal(case, r.rc, r.stdout, r.stderr)


# ---------------------------------------------------------------- in-process, with --output
def _invoke(args: list[str]):
    runner = CliRunner()
    return runner.invoke(app, args, catch_exceptions=False)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_spec_never_writes_output(case: Case, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the expected messages name the files relative to the repository
    out = tmp_path / "report.json"
    r = _invoke(["derive", case.path, "--format", "json", "--output", str(out)])
    check_refusal(case, r.exit_code, r.stdout, r.stderr)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "a temporary file was left behind"


def test_generated_bad_inputs_never_write_output(generated, tmp_path):
    for case in generated:
        out = tmp_path / "report.txt"
        r = _invoke(["derive", case.path, "--output", str(out)])
        check_refusal(case, r.exit_code, r.stdout, r.stderr)
        assert not out.exists()
        assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- limits
def test_alias_bomb_is_refused():
    from rngaudit.errors import SpecError
    from rngaudit.spec.parse import load_spec

    with pytest.raises(SpecError, match="alias bomb"):
        load_spec(str(BAD / "alias_bomb.yaml"))


def test_deep_nesting_is_refused_precisely():
    from rngaudit.errors import SpecError
    from rngaudit.spec.parse import parse_spec

    # the root mapping is level 1; the first node past level 200 is the 200th `[`, or the key
    # `a` inside the 199th `{`
    for opener, closer, col in (("[", "]", 7 + 199 + 1), ("{a: ", "}", 7 + 198 * 4 + 2)):
        text = "rngaudit: 1\nmodel: " + opener * 10_000 + "1" + closer * 10_000 + "\n"
        with pytest.raises(SpecError, match="nested deeper than 200 levels") as ei:
            parse_spec(text, "deep.yaml")
        assert (ei.value.location.line, ei.value.location.col) == (2, col)


def test_nesting_exactly_at_the_limit_loads():
    from rngaudit.errors import SpecError
    from rngaudit.spec.limits import MAX_DEPTH
    from rngaudit.spec.yaml_source import load_text

    def doc(levels):  # a mapping (level 1) holding `levels - 1` nested lists
        return "x: " + "[" * (levels - 1) + "]" * (levels - 1) + "\n"

    assert load_text(doc(MAX_DEPTH), "ok.yaml").is_map
    with pytest.raises(SpecError, match="nested deeper"):
        load_text(doc(MAX_DEPTH + 1), "deep.yaml")


def test_aliases_count_towards_depth_and_size():
    from rngaudit.errors import SpecError
    from rngaudit.spec.limits import MAX_DEPTH
    from rngaudit.spec.yaml_source import load_text

    half = MAX_DEPTH // 2 + 5
    text = "a: &a " + "[" * half + "]" * half + "\nb: " + "[" * half + "*a" + "]" * half + "\n"
    with pytest.raises(SpecError, match=r"alias \*a makes the spec nest deeper") as ei:
        load_text(text, "alias.yaml")
    assert (ei.value.location.line, ei.value.location.col) == (2, 4 + half)
    # a few aliases of a small anchor are fine, and expand to copies
    node = load_text("a: &a {k: 1}\nb: [*a, *a]\n", "ok.yaml")
    assert node.plain() == {"a": {"k": 1}, "b": [{"k": 1}, {"k": 1}]}


def _spec(body: str) -> str:
    return "rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n" + body


def test_key_budget_allows_exactly_the_limit_and_resolves_calls():
    from rngaudit.errors import SpecError
    from rngaudit.spec.budget import MAX_KEYS, budget
    from rngaudit.spec.parse import parse_spec

    assert MAX_KEYS == 10_000_000
    at_limit = _spec(
        "    - module:\n        class: B\n        repeat: 1000\n"
        "        body: [{make_rng: {stream: params, repeat: 10000}}]\n"
    )
    assert budget(parse_spec(at_limit).model)[0] == 10_000_000
    # `call:` costs what the named child costs, not what the biggest child costs
    calls = _spec(
        "    - module: {class: A, name: a, body: [{make_rng: {stream: params, repeat: 1000}}]}\n"
        "    - module: {class: Big, name: big, body: [{make_rng: {stream: params, repeat: 9800000}}]}\n"
        "    - Dense\n"
        "    - call: {name: a, repeat: 99}\n"
        "    - call: {name: Dense_0, repeat: 1000}\n"
    )
    spec = parse_spec(calls)
    assert budget(spec.model)[0] == 1000 + 9_800_000 + 2 + 99 * 1000 + 1000 * 2
    with pytest.raises(SpecError, match="module M asks for up to 10002002 keys") as ei:
        parse_spec(calls.replace("repeat: 99}", "repeat: 199}"))
    # reported at the model: each statement is fine on its own
    assert (ei.value.location.line, ei.value.location.col) == (4, 3)


@pytest.mark.parametrize(
    "body",
    [
        "    - Dense: {repeat: 3}\n    - call: Dense_2\n    - make_rng: {stream: params, repeat: 4}\n",
        "    - Sequential: {layers: [Dense, {Dense: {use_bias: false}}]}\n    - call: Sequential_0\n",
        (
            "    - module:\n        class: B\n        name: b\n        setup: [{Dense: {name: d}}]\n"
            "        body: [{call: d}, {call: d}, {param: w}]\n    - call: {name: b, repeat: 2}\n"
        ),
        "    - variable: {collection: c, name: v, make_rng: [params, params], eager: true}\n",
    ],
)
def test_key_budget_is_an_upper_bound_of_the_replay(body):
    from rngaudit.engine.replay import replay
    from rngaudit.spec.budget import budget
    from rngaudit.spec.parse import parse_spec

    spec = parse_spec(_spec(body))
    assert len(replay(spec)) <= budget(spec.model)[0]


def test_a_budget_of_10_to_the_18_keys_is_refused():
    from rngaudit.errors import SpecError
    from rngaudit.spec.parse import parse_spec

    inner = "make_rng: params"
    for i in range(6):  # six modules, each repeated 1000 times: 10**18 keys
        inner = f"module: {{class: L{i}, repeat: 1000, body: [{{{inner}}}]}}"
    nested = f"    - {inner}\n"
    with pytest.raises(SpecError, match="module calls|asks for up to"):
        parse_spec(_spec(nested))


# ---------------------------------------------------------------- fuzz: only our errors, ever
_FUZZ_TOKENS = [
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "- ",
    " ",
    "\n",
    "  ",
    "&a ",
    "*a",
    "!!",
    "!x ",
    "'",
    '"',
    "#",
    "? ",
    "|",
    ">",
    "%",
    "@",
    "`",
    "0",
    "-1",
    "true",
    "null",
    "~",
    "key(",
    "split(",
    ")",
    "Dense",
    "Dropout",
    "make_rng",
    "repeat",
    "call",
    "module",
    "class",
    "body",
    "setup",
    "name",
    "Sequential",
    "layers",
    "param",
    "variable",
    "when",
    "apply",
    "\t",
    "\x00",
    "é",
    "1e9",
    "0x10",
    ".inf",
    "<<",
    "2024-01-01",
    "---\n",
    "...",
]
_FUZZ_CORPUS = [(REPO / "rngaudit" / "examples" / "guide.yaml").read_text(encoding="utf-8")] + [
    (BAD / f"{c.name}.yaml").read_text(encoding="utf-8")
    for c in CASES
    if c.name
    in (
        "unknown_key_layer",
        "call_unknown_child",
        "raw_key_wrong_width_rbg",
        "unnamed_sequential_in_setup",
        "param_missing_in_apply",
        "merge_key",
    )
]


def test_mutated_specs_fail_only_with_our_errors():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from rngaudit.engine.derive import derive
    from rngaudit.errors import RngauditError
    from rngaudit.spec.parse import parse_spec

    edit = st.tuples(
        st.sampled_from(["insert", "delete", "copy"]),
        st.integers(0, 10_000),
        st.integers(0, 10_000),
        st.sampled_from(_FUZZ_TOKENS),
    )

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(_FUZZ_CORPUS), st.lists(edit, min_size=1, max_size=4))
    def check(text, edits):
        for op, i, j, tok in edits:
            i %= len(text) + 1
            if op == "insert":
                text = text[:i] + tok + text[i:]
            elif op == "delete":
                text = text[:i] + text[i + 1 + j % 5 :]
            else:
                j %= len(text) + 1
                text = text[:i] + text[j : j + 20] + text[i:]
        try:
            derive(parse_spec(text, "fuzz.yaml"), values=False)
        except RngauditError as e:
            assert e.location is None or e.location.line >= 1 and e.location.col >= 1
            assert "Traceback" not in str(e)

    check()


# ---------------------------------------------------------------- every command refuses them the same way
@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["collisions", "--no-keys", "-f", "sarif"], id="collisions"),
        pytest.param(["shard-check", "--devices", "1"], id="shard-check", marks=pytest.mark.slow),
    ],
)
def test_bad_specs_through_every_command(command, monkeypatch):
    """collisions and shard-check load specs with the same loader: same line, column and message. shard-check
    refuses a malformed spec before it starts a device process; a model Flax would reject is found by the
    device process's replay (a few seconds each, hence slow)."""
    monkeypatch.chdir(REPO)
    wrong = []
    for case in CASES:
        r = _invoke([*command, case.path])
        try:
            check_refusal(case, r.exit_code, r.stdout, r.stderr)
        except AssertionError as e:
            wrong.append(f"{case.name}: {str(e).splitlines()[0]}")
    assert not wrong, "\n".join(wrong)


def test_another_yaml_file_is_said_to_be_no_spec():
    """A YAML file that is not a spec (a CI workflow named rngaudit.yml, a config a directory walk or a hook
    pattern picked) is said to be no spec, not "unknown key 'name' in the spec"; a spec that only forgot its
    version line still gets that error."""
    from rngaudit.errors import SpecError
    from rngaudit.spec.parse import parse_spec

    with pytest.raises(SpecError, match=r"not an rngaudit spec: .*\('name', 'jobs'\); a spec starts") as ei:
        parse_spec("name: ci\njobs: {test: {runs-on: ubuntu-latest}}\n", "rngaudit.yml")
    assert (ei.value.location.line, ei.value.location.col) == (1, 1)
    with pytest.raises(SpecError, match=r"the spec needs `rngaudit: 1`"):
        parse_spec("rngs: {params: 0}\nmodel: {class: M}\n", "m.yaml")


@pytest.mark.parametrize("expr", ["key(٣)", "split(key(０), ３)[１]", "fold_in(key(0), ²)"])
def test_key_expressions_take_ascii_digits_only(expr):
    """Python's int() reads Arabic-Indic and full-width digits; a key expression is decimal, 0x, 0o or 0b only."""
    from rngaudit.errors import SpecError
    from rngaudit.spec.parse import parse_spec

    with pytest.raises(SpecError, match="is not a number"):
        parse_spec(f"rngaudit: 1\nrngs: {{params: '{expr}'}}\nmodel: {{class: M, body: [make_rng]}}\n", "k.yaml")


def test_a_utf16_pair_in_double_quotes_is_its_character():
    """JSON writes a character past U+FFFF as a pair of escapes (`"\\ud83d\\ude00"`); PyYAML leaves the pair's two
    halves, which are joined into the character (a half alone is an error, tests/cli/test_hostile.py)."""
    from rngaudit.spec.parse import parse_spec

    spec = parse_spec(
        '{"rngaudit": 1, "rngs": {"params": 0}, "model": {"class": "M", "body": [{"module": {"class": "B", '
        '"name": "drop\\ud83d\\ude00", "body": ["make_rng"]}}]}}',
        "s.json",
    )
    assert spec.model.body[0].module.name == "drop\U0001f600"
