"""The Linen call records of `--format json` and `jsonl`, laid out from the columns a chunk of rows at a time
(rngaudit.output.table_records): byte for byte what encoding each record whole gives, across chunk boundaries,
with rows that are encoded whole (drawn values, a name holding a placeholder) in the middle of a chunk."""

from __future__ import annotations

import json
import re

import pytest
from engine.test_nnx_property import nnx_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import REPO

from rngaudit import load_spec, parse_spec
from rngaudit.api import derive as derive_any
from rngaudit.engine.derive import derive
from rngaudit.errors import RngauditError
from rngaudit.output import table_records
from rngaudit.output.derive_json import json_chunks, jsonl_lines, to_json
from rngaudit.output.formats import dumps

GOLDEN = sorted((REPO / "tests" / "golden" / "specs").glob("*.yaml"))


def _plain_jsonl(spec, **kw) -> str:
    return "".join(jsonl_lines(derive(spec, engine="plain", **kw)))


@pytest.mark.parametrize("chunk", [1, 3, 1 << 10])
def test_records_across_chunk_boundaries_on_every_golden_spec(monkeypatch, chunk):
    """Every golden spec (lanes, discarded rows, fallbacks, rbg keys, drawn values), in chunks of 1, 3 and 1,024
    rows: json is the whole document's encoding and jsonl the plain path's bytes."""
    monkeypatch.setattr(table_records, "CHUNK", chunk)
    compared = 0
    for path in GOLDEN:
        try:
            report = derive(load_spec(str(path)))
        except RngauditError:  # (the golden corpus keeps the specs Flax raises on, too)
            continue
        assert "".join(json_chunks(report)) == dumps(to_json(report)), path.name
        assert "".join(jsonl_lines(report)) == _plain_jsonl(load_spec(str(path))), path.name
        compared += 1
    assert compared > 140


SPEC = """
rngaudit: 1
rngs: {params: 0, dropout: 1}
model:
  class: M
  body:
    - make_rng: {stream: dropout, repeat: 4}
    - module: {class: B, name: "\\0rngaudit:count\\0", body: [make_rng, make_rng]}
    - make_rng: {stream: params, draw: {normal: [2]}}
    - vmap:
        module: {class: E, body: [{make_rng: {stream: dropout, repeat: 2}}]}
        axis_size: 3
        split_rngs: {dropout: true}
    - make_rng: {stream: nosuch}
"""


@pytest.mark.parametrize("chunk", [1, 2, 5, 1 << 10])
def test_whole_rows_in_the_middle_of_a_chunk(monkeypatch, chunk):
    """A name holding a placeholder's text and a row with drawn values are encoded whole where they stand; lanes,
    a fallback stream and the rows around them are laid out from the columns."""
    monkeypatch.setattr(table_records, "CHUNK", chunk)
    spec = parse_spec(SPEC, "odd.yaml")
    report = derive(spec)
    paths = [c.derivation.path_str for c in report.calls]
    assert any("rngaudit:count" in p for p in paths) and any(c.values is not None for c in report.calls)
    assert "".join(json_chunks(report)) == dumps(to_json(report))
    assert "".join(jsonl_lines(report)) == _plain_jsonl(spec)
    lines = "".join(jsonl_lines(report)).splitlines()
    assert len(lines) == len(report.calls) + 2 and all(json.loads(line) for line in lines)


def _lines_by_cells(report, cols, widths, limit):
    """The rows as text_rows lays out each row's cells (the reference for the column writer)."""
    from rngaudit.output.text_rows import _line, _Rows

    out = []
    for k, (cells, _, _) in enumerate(_Rows(report).cells()):
        if k == limit:
            break
        out.append(_line(cells, cols, widths) + "\n")
    return "".join(out)


@pytest.mark.parametrize("chunk", [1, 3, 1 << 10])
def test_text_rows_from_the_columns_on_every_golden_spec(monkeypatch, chunk):
    """derive's uncoloured text rows laid out from the columns equal each row's cells padded one at a time, on
    every golden spec: every column, the columns a 60- and a 100-column terminal keep, a --columns pick, and the
    first rows only."""
    from rngaudit.output import text_columns
    from rngaudit.output.text_columns import table_lines
    from rngaudit.output.text_rows import _Rows, choose_columns

    monkeypatch.setattr(text_columns, "CHUNK", chunk)
    compared = 0
    for path in GOLDEN:
        try:
            report = derive(load_spec(str(path)))
        except RngauditError:
            continue
        rows = _Rows(report)
        widths = rows.widths()
        lanes = rows.lanes()
        n = len(report.calls)
        for width, picked, limit in ((None, None, n), (60, None, n), (100, None, 7), (None, ["count", "key"], n)):
            cols, _ = choose_columns(widths, lanes, width, False, picked)
            assert cols[-1] == "key"
            got = "".join(text for text, _ in table_lines(report.calls, cols, widths, limit))
            assert got == _lines_by_cells(report, cols, widths, limit), (path.name, width, picked)
        compared += 1
    assert compared > 140


@pytest.mark.parametrize("color", [False, True])
@pytest.mark.parametrize("max_rows", [0, 5])
def test_text_rows_advance_the_progress_bar_by_the_rows_written(monkeypatch, color, max_rows):
    """`advance` (the writing bar's) counts every listed row once, on the column writer (uncoloured) and on the
    row-at-a-time one (coloured)."""
    from rngaudit.output import text_columns
    from rngaudit.output.text_rows import render_rows

    monkeypatch.setattr(text_columns, "CHUNK", 4)
    report = derive(parse_spec(SPEC, "odd.yaml"))
    seen: list[int] = []
    text = "".join(render_rows(report, color=color, max_rows=max_rows, advance=seen.append))
    listed = min(max_rows, len(report.calls)) if max_rows else len(report.calls)
    assert sum(seen) == listed and all(seen)
    assert ("more call sites not listed" in text) == (listed < len(report.calls))


ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("chunk", [2, 1 << 10])
def test_nnx_text_rows_from_the_columns_equal_the_rows_one_at_a_time(monkeypatch, chunk):
    """An NNX report's uncoloured rows, laid out from the replay's columns, equal the rows made one at a time
    (the coloured report, its escapes removed), with every column, a narrow terminal's, a --columns pick that
    ends in the key, and the first rows only; its JSON equals the whole document's encoding."""
    monkeypatch.setattr(table_records, "CHUNK", chunk)
    _same_nnx_rows(derive_any(load_spec(str(REPO / "rngaudit" / "examples" / "nnx_guide.yaml"))))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(nnx_specs(), st.sampled_from([2, 1 << 10]))
def test_nnx_text_rows_of_random_models(text, chunk):
    """The same on random NNX models (forks, vmap lanes, scan steps, broadcasts, RNNs, the bridge, values)."""
    try:
        report = derive_any(parse_spec(text, "<hypothesis>"))
    except RngauditError:
        return
    old, table_records.CHUNK = table_records.CHUNK, chunk
    try:
        _same_nnx_rows(report)
    finally:
        table_records.CHUNK = old


def _same_nnx_rows(report) -> None:
    from rngaudit.output.text_nnx import render_nnx_rows

    # (and --format json, laid out from the columns too: the whole document's encoding, record by record)
    assert "".join(json_chunks(report)) == dumps(to_json(report))

    for kw in ({}, {"width": 70}, {"columns": ["stream", "key"]}, {"max_rows": 3}, {"wide": True}):
        plain = "".join(render_nnx_rows(report, **kw))
        colored = "".join(render_nnx_rows(report, color=True, **kw))
        assert plain == ANSI.sub("", colored), kw
