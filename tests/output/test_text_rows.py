"""derive's text report in a real terminal (a pseudo-terminal of 80 and 120 columns) and piped: the key, path,
stream and count are never cropped; a narrow terminal leaves out the secondary columns and says so; --wide and
--columns choose; rows stream as they are made."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from support import GUIDE, REPO, invoke, run_cli, write

from rngaudit import derive, load_spec
from rngaudit.output.text_rows import COLUMNS, cells, choose_columns, render_rows

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def in_terminal(columns: int, *args: object) -> str:
    """`rngaudit ARGS` with stdout a terminal `columns` wide; what it showed, escapes removed."""
    env = dict(os.environ, COLUMNS=str(columns), LINES="40", TERM="xterm")
    env.pop("NO_COLOR", None)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    p = subprocess.Popen(
        [sys.executable, "-m", "rngaudit", *map(str, args)], stdout=follower, stderr=follower, env=env, cwd=REPO
    )
    os.close(follower)
    out = b""
    while True:
        try:
            data = os.read(leader, 1 << 16)
        except OSError:
            break
        if not data:
            break
        out += data
    p.wait(timeout=120)
    os.close(leader)
    return ANSI.sub("", out.decode("utf-8")).replace("\r", "")


def keys_of(spec) -> list[str]:
    return ["[" + " ".join(map(str, c.key)) + "]" for c in derive(spec).calls]


@pytest.mark.parametrize("columns", [80, 120])
def test_every_key_is_whole_in_a_terminal(columns):
    shown = in_terminal(columns, "derive", GUIDE)
    rows = [line for line in shown.splitlines() if re.match(r"^\d+  ", line)]
    assert len(rows) == 6
    for row, key in zip(rows, keys_of(load_spec(GUIDE)), strict=True):
        assert row.rstrip().endswith(key), (row, key)  # the key column, whole
        assert "…" not in row
    header = next(line for line in shown.splitlines() if line.startswith("#  "))
    for col in ("path", "stream", "count", "key"):
        assert col in header
    if columns == 80:
        assert "left out to fit 80 columns: bytes, hash input" in shown
        assert all(len(r) <= 80 for r in rows)
    else:
        assert "left out" not in shown and "hash input" in header


def test_a_very_narrow_terminal_keeps_what_matters_whole(tmp_path):
    spec = write(
        tmp_path,
        "long.yaml",
        """
        rngaudit: 1
        jax: {prng_impl: rbg}
        rngs: {params: 0}
        model:
          class: M
          body:
            - module: {name: a_rather_long_module_name_for_a_narrow_terminal, class: A, body: [make_rng: params]}
        """,
    )
    shown = in_terminal(40, "derive", spec)
    row = next(line for line in shown.splitlines() if line.startswith("0  "))
    assert "a_rather_long_module_name_for_a_narrow_terminal" in row  # longer than the terminal: not cropped
    assert row.rstrip().endswith(keys_of(load_spec(spec))[0])
    assert "left out to fit 40 columns: bytes, hash input, word, label" in shown


def test_wide_and_columns_choose():
    wide = in_terminal(80, "derive", GUIDE, "--wide")
    assert "hash input" in wide and "left out" not in wide
    picked = invoke("derive", GUIDE, "--columns", "path,key")
    assert picked.exit_code == 0
    assert picked.stdout.splitlines()[4].split() == ["#", "path", "key"]
    # a column as its heading spells it names it too
    spelled = invoke("derive", GUIDE, "--columns", "path,hash input,key")
    assert spelled.exit_code == 0 and spelled.stdout.splitlines()[4].split() == ["#", "path", "hash", "input", "key"]
    bad = invoke("derive", GUIDE, "--columns", "path,nope")
    assert bad.exit_code == 2 and "nope: name columns among" in bad.stderr


def test_piped_text_has_every_column_and_no_trailing_spaces():
    r = run_cli("derive", GUIDE)
    lines = r.stdout.splitlines()
    assert lines[4].split() == ["#", "path", "stream", "count", "label", "hash", "input", "bytes", "word", "key"]
    assert all(line == line.rstrip() for line in lines)
    assert "\x1b[" not in r.stdout


def test_wide_characters_and_control_characters_keep_the_columns_aligned(tmp_path):
    spec = write(
        tmp_path,
        "names.yaml",
        """
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: M
          body:
            - module: {name: "漢字", class: A, body: [make_rng: params]}
            - module: {name: "a\\0b", class: B, body: [make_rng: params]}
            - module: {name: plain, class: C, body: [make_rng: params]}
        """,
    )
    text = "".join(render_rows(derive(load_spec(spec))))
    rows = [line for line in text.splitlines() if re.match(r"^\d  ", line)]
    assert "a\\x00b" in rows[1]  # a NUL is shown, not sent to the terminal
    starts = {cells(r[: r.index("params")]) for r in rows}
    assert len(starts) == 1  # the stream column starts at one column on every row


def test_columns_are_left_out_in_order_until_the_row_fits():
    widths = {
        "#": 1,
        "path": 10,
        "lane": 0,
        "stream": 6,
        "count": 5,
        "label": 10,
        "hash-input": 20,
        "bytes": 20,
        "word": 10,
        "key": 23,
    }
    every = [c for c in COLUMNS if c != "lane"]
    assert choose_columns(widths, False, None, False, None) == (every, [])
    full = 1 + sum(2 + widths[c] for c in every)
    assert choose_columns(widths, False, full, False, None) == (every, [])
    shown, out = choose_columns(widths, False, full - 1, False, None)
    assert out == ["bytes"] and "bytes" not in shown
    shown, out = choose_columns(widths, False, 10, False, None)
    assert out == ["bytes", "hash-input", "word", "label"] and shown == ["path", "stream", "count", "key"]
    assert choose_columns(widths, False, 10, True, None) == (every, [])


def test_rows_stream_and_match_the_keys(tmp_path):
    spec = write(
        tmp_path,
        "many.yaml",
        """
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: M
          body:
            - make_rng: {stream: params, repeat: 20000}
        """,
    )
    report = derive(load_spec(spec))
    chunks = list(render_rows(report))
    assert len(chunks) > 5  # written in pieces, not one string
    rows = [line for line in "".join(chunks).splitlines() if re.match(r"^ *\d+  \(root\)", line)]
    assert len(rows) == 20000
    for line, c in zip(rows[::997], list(report.calls)[::997], strict=True):
        assert line.endswith("[" + " ".join(map(str, c.key)) + "]")
        assert line.split()[3] == str(c.derivation.count)


@pytest.mark.parametrize(
    "spec",
    [
        GUIDE,
        REPO / "rngaudit" / "examples" / "nnx_guide.yaml",
        REPO / "tests" / "golden" / "specs" / "transformed_058.yaml",
    ],
    ids=["linen", "nnx", "lanes"],
)
def test_streamed_json_is_the_whole_documents_encoding(spec):
    """--format json is encoded as it is written; byte for byte what encoding the whole document gives."""
    from rngaudit.output.derive_json import json_chunks, to_json
    from rngaudit.output.formats import dumps

    report = derive(load_spec(str(spec)))
    assert "".join(json_chunks(report)) == dumps(to_json(report))
    empty = derive(load_spec(str(spec)), limit=0)
    assert "".join(json_chunks(empty)) == dumps(to_json(empty))


def test_templated_json_is_the_documents_encoding_on_every_golden_spec():
    """The Linen calls of --format json are laid out from each template's encoding with the per-row values filled
    in: byte for byte the indenting encoder's output, on every golden spec (lanes, discarded rows, fallbacks, rbg
    and values included)."""
    from rngaudit.errors import RngauditError
    from rngaudit.output.derive_json import json_chunks, to_json
    from rngaudit.output.formats import dumps

    compared = 0
    for spec in sorted((REPO / "tests" / "golden" / "specs").glob("*.yaml")):
        try:
            report = derive(load_spec(str(spec)))
        except RngauditError:  # (the golden corpus keeps the specs Flax raises on, too)
            continue
        assert "".join(json_chunks(report)) == dumps(to_json(report)), spec.name
        compared += 1
    assert compared > 140


def test_a_name_holding_a_placeholder_is_encoded_whole(tmp_path):
    spec = write(
        tmp_path,
        "odd.yaml",
        """
        rngaudit: 1
        rngs: {params: 0}
        model: {class: M, body: [{module: {class: B, name: "\\0rngaudit:count\\0", body: [make_rng, make_rng]}}]}
        """,
    )
    from rngaudit.output.derive_json import json_chunks, to_json
    from rngaudit.output.formats import dumps

    report = derive(load_spec(spec))
    assert "rngaudit:count" in report.calls[0].derivation.path_str
    assert "".join(json_chunks(report)) == dumps(to_json(report))


NNX_GUIDE = REPO / "rngaudit" / "examples" / "nnx_guide.yaml"


@pytest.mark.parametrize("columns", [80, 120])
def test_every_nnx_key_is_whole_in_a_terminal(columns):
    """An NNX spec's rows are fixed-width too: site, stream, count and key whole at 80 and 120 columns; the chain,
    when it does not fit, is left out and the report says so."""
    shown = in_terminal(columns, "derive", NNX_GUIDE)
    rows = [line for line in shown.splitlines() if re.match(r"^\s*\d+  (init|\d+)  ", line)]
    report = derive(load_spec(NNX_GUIDE))
    assert len(rows) == len(report.calls) > 20
    for row, c in zip(rows, report.calls, strict=True):
        key = "[" + " ".join(map(str, c.key)) + "]"
        assert key in row and c.derivation.site in row, (row, key)
        assert "…" not in row
    if any(len(line) > columns for line in run_cli("derive", NNX_GUIDE).stdout.splitlines()):
        assert "left out to fit" in shown and "chain" in shown
    piped = run_cli("derive", NNX_GUIDE).stdout
    assert piped.splitlines()[4].split() == ["#", "step", "site", "stream", "count", "key", "chain"]
    assert "rngs.fork() for block" in piped  # the chain, piped


def _big(tmp_path, blocks: int) -> str:
    return write(
        tmp_path,
        "big.yaml",
        f"""
        rngaudit: 1
        rngs: {{params: 0, dropout: 1}}
        model:
          class: Model
          body:
            - module: {{class: Block, repeat: {blocks}, body: [{{make_rng: {{stream: dropout, repeat: 10}}}}]}}
            - module: {{class: Head, body: [make_rng]}}
        """,
    )


def test_a_big_report_is_concise_by_default_and_whole_on_request(tmp_path):
    spec = _big(tmp_path, 150)  # 1,501 call sites
    r = invoke("derive", spec)
    lines = r.stdout.splitlines()
    rows = [line for line in lines if re.match(r"^\s*\d+  ", line)]
    assert len(rows) == 1000 and rows[-1].lstrip().startswith("999 ")
    assert (
        "... 501 more call sites not listed (#1000-#1500): --max-rows 0 lists every row, --path/--stream pick some, "
        "--format jsonl streams them all"
    ) in lines
    assert "call sites by stream (1,501): dropout 1,500, params 1" in lines
    assert "call sites by top-level module: Block_0 10, Block_1 10, Block_2 10, " in r.stdout  # (not Block_10)
    assert "and 141 more" in r.stdout
    assert lines[-1] == "1501 keys, 0 falling back to 'params'"
    full = invoke("derive", spec, "--max-rows", "0").stdout
    assert len([line for line in full.splitlines() if re.match(r"^\s*\d+  ", line)]) == 1501
    assert "more call sites" not in full
    # a report within the limit is whole, and the limit counts rows after the filters
    assert "not listed" not in invoke("derive", spec, "--max-rows", "1501").stdout
    few = invoke("derive", spec, "--max-rows", "2", "--path", "Head*").stdout
    assert "not listed" not in few and "1 of 1501 keys" in few
    assert invoke("derive", spec, "--max-rows", "-1").exit_code == 2


def test_a_big_nnx_report_is_concise_too(tmp_path):
    spec = write(
        tmp_path,
        "nnx.yaml",
        """
        rngaudit: 1
        flavour: nnx
        rngs: {params: 0, dropout: 1}
        run: [{call: 30}]
        model: {class: M, init: [Linear, {Dropout: {name: d, rate: 0.5}}], call: [{call: d}]}
        """,
    )
    r = invoke("derive", spec, "--max-rows", "5")
    rows = [line for line in r.stdout.splitlines() if re.match(r"^\s*\d+  (init|\d+)  ", line)]
    calls = derive(load_spec(spec)).calls
    n, params = len(calls), sum(c.derivation.requested == "params" for c in calls)
    assert len(rows) == 5 and n > 30 and params == 2
    assert f"... {n - 5} more draws not listed (#5-#{n - 1})" in r.stdout
    assert f"draws by stream ({n}): dropout {n - params}, params {params}" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].startswith(f"{n} keys")
