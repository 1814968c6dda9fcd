"""derive at scale, through the CLI: --format jsonl (streamed), --stream/--path/--limit (before any key
is computed), the hidden --engine switch, and their errors. The fast path itself is checked against
the plain one in engine/test_table.py."""

from __future__ import annotations

import json
import os

from support import GUIDE, invoke, run_cli, write

BIG = """
    rngaudit: 1
    rngs: {params: 0, dropout: 1}
    model:
      class: M
      body:
        - module: {class: Block, repeat: 40, body: [{make_rng: {stream: dropout, repeat: 30}}, {param: w}]}
        - vmap: {module: {class: E, body: [{make_rng: dropout}]}, axis_size: 8, split_rngs: all,
                 variable_axes: {params: 0}}
    """


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_jsonl_is_the_json_report_a_record_a_line(tmp_path):
    spec = write(tmp_path, "big.yaml", BIG)
    doc = json.loads(invoke("derive", spec, "--format", "json").stdout)
    recs = lines(invoke("derive", spec, "--format", "jsonl").stdout)
    assert [r["record"] for r in recs] == ["header"] + ["call"] * len(doc["calls"]) + ["summary"]
    assert [{k: v for k, v in r.items() if k != "record"} for r in recs[1:-1]] == doc["calls"]
    assert len(doc["calls"]) == 40 * 31 + 8
    assert recs[-1] == {"record": "summary", **doc["summary"]}


def test_filters_pick_call_sites_before_keys(tmp_path):
    spec = write(tmp_path, "big.yaml", BIG)
    full = json.loads(invoke("derive", spec, "--format", "json").stdout)["calls"]
    got = json.loads(
        invoke("derive", spec, "--format", "json", "--stream", "dropout", "--path", "Block_1*", "--limit", "5").stdout
    )
    want = [c for c in full if c["stream"] == "dropout" and c["path_str"].startswith("Block_1")][:5]
    assert got["calls"] == want and len(want) == 5
    assert got["summary"]["selected_from"] == len(full)
    lanes = json.loads(invoke("derive", spec, "--format", "json", "--path", "Vmap*").stdout)["calls"]
    assert [c["lane"] for c in lanes] == [[i] for i in range(8)]
    assert len({tuple(c["key"]) for c in lanes}) == 8
    none = invoke("derive", spec, "--format", "jsonl", "--stream", "noise")
    assert none.exit_code == 0 and [r["record"] for r in lines(none.stdout)] == ["header", "summary"]


def test_the_plain_engine_gives_the_same_report(tmp_path):
    spec = write(tmp_path, "big.yaml", BIG)
    fast = invoke("derive", spec, "--format", "json").stdout
    plain = invoke("derive", spec, "--format", "json", "--engine", "plain").stdout
    assert fast == plain


def test_jsonl_to_a_file_is_written_whole(tmp_path):
    spec = write(tmp_path, "big.yaml", BIG)
    out = tmp_path / "keys.jsonl"
    r = run_cli("derive", spec, "--format", "jsonl", "-o", str(out))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    assert len(out.read_text().splitlines()) == 40 * 31 + 8 + 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".rngaudit-")]


def test_bad_filter_options_exit_2_and_write_nothing(tmp_path):
    spec = write(tmp_path, "big.yaml", BIG)
    out = tmp_path / "o.jsonl"
    for args, msg in [
        (("--limit", "-1"), "--limit"),
        (("--engine", "turbo"), "--engine"),
        (("--engine", "plain", "--limit", "3"), "need --engine fast"),
    ]:
        r = run_cli("derive", spec, "--format", "jsonl", "-o", str(out), *args)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr and r.stdout == ""
        assert not out.exists()


def test_a_million_keys_are_within_the_budget(tmp_path):
    """The spec budget lets a model of 1,000,000 call sites through (the fast path is seconds);
    only the header and a --limit of them are written here."""
    spec = write(
        tmp_path,
        "m.yaml",
        """
        rngaudit: 1
        rngs: {params: 0}
        model: {class: M, body: [{module: {class: B, repeat: 1000, body: [{make_rng: {repeat: 1000}}]}}]}
        """,
    )
    recs = lines(invoke("derive", spec, "--format", "jsonl", "--limit", "2", "--path", "B_999").stdout)
    assert [r["count"] for r in recs[1:-1]] == [1, 2]
    assert recs[-1]["selected_from"] == 1_000_000


def test_guide_filters_in_text(tmp_path):
    r = run_cli("derive", GUIDE, "--path", "Dense_1", "--no-values")
    assert r.returncode == 0
    assert "Dense_1" in r.stdout and "Dense_0" not in r.stdout
