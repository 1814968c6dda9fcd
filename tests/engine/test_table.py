"""derive's fast path (rngaudit.fast: blocks, columns, vectorised Threefry) against the plain path
(one Derivation per call, per-base fold_in): the same rows, keys, values and errors, on every fixture
and on the random models of the derive property tests (with and without lifted transforms)."""

from __future__ import annotations

import fnmatch
import glob
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.test_replay_property import specs, transform_specs
from rngaudit import FlaxError, SpecError, load_spec, parse_spec
from rngaudit.engine.derive import derive
from rngaudit.output.derive_json import to_json

EXAMPLES = int(os.environ.get("RNGAUDIT_FASTPATH_EXAMPLES", "150"))
from support import COUNT_FORKS, LINEN_EXAMPLES, REPO, run_forking

ROOT = str(REPO)
FIXTURES = sorted(
    glob.glob(os.path.join(ROOT, "fixtures", "**", "*.yaml"), recursive=True) + [str(p) for p in LINEN_EXAMPLES]
)


def outcome(spec, engine: str, **kw):
    try:
        return to_json(derive(spec, engine=engine, **kw))
    except (SpecError, FlaxError) as e:
        return ("error", type(e).__name__, str(e))


def assert_same(spec, **kw):
    plain, fast = outcome(spec, "plain", **kw), outcome(spec, "fast", **kw)
    if isinstance(plain, dict) and isinstance(fast, dict):
        assert len(fast["calls"]) == len(plain["calls"])
        for a, b in zip(plain["calls"], fast["calls"]):
            assert a == b
    assert fast == plain
    return plain


def _loadable(path):
    try:
        return load_spec(path)
    except SpecError:
        return None


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.relpath(p, ROOT))
def test_fixture(path):
    spec = _loadable(path)
    if spec is None:  # a fixture of another command's bad input: nothing to derive
        assert "bad" in path or "error" in path or "invalid" in path, path
        return
    assert_same(spec)


def test_fixtures_are_many():
    assert sum(_loadable(p) is not None for p in FIXTURES) >= 30


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs())
def test_random_models(text):
    assert_same(parse_spec(text, "<hypothesis>"), values=False)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(transform_specs())
def test_random_transformed_models(text):
    assert_same(parse_spec(text, "<hypothesis>"), values=False)


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(specs(), transform_specs()), st.data())
def test_filters_select_the_plain_rows(text, data):
    """--stream / --path / --limit on the fast path pick exactly the plain path's rows that match,
    in order, with the same keys (computed only for them)."""
    spec = parse_spec(text, "<hypothesis>")
    full = outcome(spec, "plain", values=False)
    if not isinstance(full, dict) or not full["calls"]:
        return
    calls = full["calls"]
    streams = data.draw(st.lists(st.sampled_from(sorted({c["stream"] for c in calls} | {"nope"})), max_size=2))
    paths = data.draw(
        st.lists(st.sampled_from(sorted({c["path_str"] for c in calls}) + ["*", "*_0*", "(root)", "x*"]), max_size=2)
    )
    limit = data.draw(st.one_of(st.none(), st.integers(0, len(calls) + 1)))
    want = [
        c
        for c in calls
        if (not streams or c["stream"] in streams or c["stream_requested"] in streams)
        and (not paths or any(fnmatch.fnmatchcase(c["path_str"], g) for g in paths))
    ]
    if limit is not None:
        want = want[:limit]
    got = to_json(derive(spec, values=False, engine="fast", streams=streams, paths=paths, limit=limit))
    assert got["calls"] == want


def test_repeat_crosses_the_one_byte_count_boundary():
    """Counts 255, 256 and 65536 change the length of the count's bytes: one block spans them."""
    spec = parse_spec(
        """
rngaudit: 1
rngs: {params: 0, dropout: 1}
flax: {fix_rng_separator: true}
model: {class: M, body: [{make_rng: {stream: dropout, repeat: 70000}}, {module: {class: B, repeat: 3, body: [make_rng]}}]}
""",
        "t.yaml",
    )
    out = assert_same(spec, values=False)
    assert [c["count"] for c in out["calls"][254:257]] == [255, 256, 257]
    assert len(out["calls"]) == 70003


def jsonl_records(report):
    import json

    from rngaudit.output.derive_json import jsonl_lines

    text = "".join(jsonl_lines(report))
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def _jsonl_matches_json(spec, **kw):
    """Every jsonl line parses; header + calls + summary are the JSON report's fields exactly."""
    try:
        doc = to_json(derive(spec, engine="plain", **kw))
    except (SpecError, FlaxError):
        return
    from rngaudit.output.derive_json import jsonl_lines

    fast = "".join(jsonl_lines(derive(spec, engine="fast", **kw)))
    assert fast == "".join(jsonl_lines(derive(spec, engine="plain", **kw)))  # to the byte
    recs = jsonl_records(derive(spec, engine="fast", **kw))
    head, calls, summary = recs[0], recs[1:-1], recs[-1]
    assert head.pop("record") == "header" and summary.pop("record") == "summary"
    assert all(c.pop("record") == "call" for c in calls)
    assert head == {k: v for k, v in doc.items() if k not in ("calls", "summary")}
    assert calls == doc["calls"]
    assert summary == doc["summary"]


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.relpath(p, ROOT))
def test_jsonl_of_fixture(path):
    spec = _loadable(path)
    if spec is not None:
        _jsonl_matches_json(spec)


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(specs(), transform_specs()))
def test_jsonl_of_random_models(text):
    _jsonl_matches_json(parse_spec(text, "<hypothesis>"), values=False)


def test_jsonl_streams_large_outputs_in_chunks():
    spec = parse_spec(
        "rngaudit: 1\nrngs: {params: 0}\nmodel: {class: M, body: [{make_rng: {repeat: 10000}}]}\n", "t.yaml"
    )
    from rngaudit.output.derive_json import jsonl_lines

    chunks = list(jsonl_lines(derive(spec, values=False)))
    assert len(chunks) >= 4 and max(len(c) for c in chunks) < 4096 * 1000
    assert sum(c.count("\n") for c in chunks) == 10002


@settings(max_examples=max(EXAMPLES // 5, 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(specs(), transform_specs()), st.booleans())
def test_collisions_on_the_fast_path(text, keys):
    """`collisions` reads large specs from derive's fast path (TableSites): its report equals the one
    built from the plain path's Derivations (SpecSites, NumPy columns) on random models."""
    import json

    import rngaudit.collision.sites as collisions
    from rngaudit.collision.audit import audit
    from rngaudit.collision.spec_sites import SpecSites, TableSites
    from rngaudit.output.collisions_json import to_json as collisions_json

    spec = parse_spec(text, "<hypothesis>")
    try:
        plain = SpecSites(spec, keys=keys)
    except (SpecError, FlaxError):
        return
    old = collisions.SMALL_SITES
    collisions.SMALL_SITES = 0  # both on NumPy columns
    try:
        a = json.dumps(collisions_json([audit(SpecSites(spec, keys=keys))]), sort_keys=True)
        b = json.dumps(collisions_json([audit(TableSites(spec, keys=keys))]), sort_keys=True)
    finally:
        collisions.SMALL_SITES = old
    assert a == b
    assert plain.n == json.loads(b)["inputs"][0]["call_sites"]


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.relpath(p, ROOT))
def test_jsonl_is_byte_identical_on_both_engines(path):
    """The fast jsonl writer encodes what a template fixes once: the bytes equal the plain path's."""
    from rngaudit.output.derive_json import jsonl_lines

    spec = _loadable(path)
    if spec is None:
        return
    try:
        plain = "".join(jsonl_lines(derive(spec, engine="plain")))
    except (SpecError, FlaxError):
        return
    assert "".join(jsonl_lines(derive(spec, engine="fast"))) == plain


def test_two_process_hashing_gives_the_same_words(tmp_path):
    """A large replay is hashed by this process and a forked child; in a fresh process (no JAX, no
    threads) the forked words equal one process's, and a fork that fails, or a child that fails,
    falls back to this process."""

    code = (
        """
import os, sys
import numpy as np
import rngaudit.engine.hash_words as hashing
from rngaudit import parse_spec
from rngaudit.engine.table import key_table
spec = parse_spec('''
rngaudit: 1
rngs: {params: 0, dropout: 1}
flax: {fix_rng_separator: true}
model: {class: M, body: [{module: {class: B, repeat: 300, body: [{make_rng: {stream: dropout, repeat: 700}}]}},
                         {make_rng: {repeat: 140000}}]}
''', 't.yaml')
hashing.PARALLEL_HASHES = 1000
assert hashing.can_fork(), "expected to fork here"
"""
        + COUNT_FORKS
        + """two = key_table(spec).word
assert len(forks) == 1, forks
real_write = os.write
def failing_write(fd, data):  # only the child writes (its words, to the pipe): the child fails
    raise OSError(32, "Broken pipe")
os.write = failing_write
child_failed = key_table(spec).word
os.write = real_write
assert len(forks) == 2, forks
def failing_fork():
    raise BlockingIOError(11, "Resource temporarily unavailable")
os.fork = failing_fork
fallback = key_table(spec).word
hashing.PARALLEL_HASHES = 10**12
one = key_table(spec).word
assert len(one) == 300 * 700 + 140000
assert np.array_equal(two, one) and np.array_equal(fallback, one) and np.array_equal(child_failed, one)
assert "jax" not in sys.modules
print("ok")
"""
    )
    run_forking(code)


def test_counts_beyond_the_encoding_cache():
    """Counts past the cached encodings (and a block that crosses into them) hash alike on both paths."""
    import rngaudit.engine.hash_words as hashing

    old = hashing.ENC_CACHE
    hashing.ENC_CACHE = 300
    try:
        spec = parse_spec(
            "rngaudit: 1\nrngs: {params: 0}\nflax: {fix_rng_separator: true}\n"
            "model: {class: M, body: [{make_rng: {repeat: 1000}}, make_rng]}\n",
            "t.yaml",
        )
        out = assert_same(spec, values=False)
    finally:
        hashing.ENC_CACHE = old
    assert out["calls"][-1]["count"] == 1001


def test_hashing_forks_beside_a_progress_bar_only():
    """An interactive run draws a progress bar from its own threads: those hold nothing the forked
    hashing child needs, so the fork still happens (in a fresh process: no JAX); any other thread
    stops it."""

    code = """
import io, os, threading, time
import rngaudit.engine.hash_words as hashing
from rngaudit.output.progress import progress
os.sched_getaffinity = lambda pid: {0, 1}  # (two CPUs, whatever this machine has)
class Tty(io.StringIO):
    def isatty(self):
        return True
assert hashing.can_fork()
with progress(5, "work", stream=Tty(), delay=0.0):
    time.sleep(0.3)  # the bar is drawn: its timer and rich's refresh thread run
    assert threading.active_count() > 1
    assert hashing.can_fork()
stop = threading.Event()
other = threading.Thread(target=stop.wait)
other.start()
assert not hashing.can_fork()
stop.set()
other.join()
print("ok")
"""
    run_forking(code, timeout=120, forks=False)


# ---------------------------------------------------------------- keyed: the first rows only
def _rows_json(report, n):
    """The first n rows of a report as to_json writes them."""
    return to_json(report)["calls"][:n]


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(specs(), transform_specs()), st.data())
def test_keying_the_first_rows_gives_the_whole_reports_rows(text, data):
    """derive(keyed=k) hashes and keys the first k rows now (what the text report lists) and the others when read:
    the first rows' keys, then the whole report, are the unkeyed report's, row for row."""
    spec = parse_spec(text, "<hypothesis>")
    full = outcome(spec, "fast", values=False)
    if not isinstance(full, dict):
        return
    n = len(full["calls"])
    k = data.draw(st.integers(0, n + 1))
    report = derive(spec, values=False, keyed=k)
    head = report.calls.keys_upto(k)
    want = [c["key"] for c in full["calls"][:k]]
    assert [list(key) if c is not None else None for key, c in zip(head.tolist(), want)] == want
    assert to_json(report) == full


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(specs(), transform_specs()), st.data())
def test_the_text_report_of_the_first_rows_is_the_same_keyed_or_not(text, data):
    """derive's text report listing the first k rows reads the same whether only those rows were keyed (what the
    CLI does) or every row was: widths, rows, notes and summary."""
    from rngaudit.output.text_rows import derive_text

    spec = parse_spec(text, "<hypothesis>")
    try:
        whole = derive(spec, values=False)
    except (SpecError, FlaxError):
        return
    k = data.draw(st.integers(1, len(whole.calls) + 1))
    width = data.draw(st.sampled_from([None, 80, 120]))

    def report(r):
        return "".join(derive_text(r, width=width, color=False, max_rows=k))

    assert report(derive(spec, values=False, keyed=k)) == report(whole)


def _big_spec(blocks: int):
    return parse_spec(
        f"""
rngaudit: 1
rngs: {{params: 0, dropout: 1}}
model:
  class: M
  body:
    - module: {{class: Block, repeat: {blocks}, body: [{{make_rng: {{stream: dropout, repeat: 50}}}}, Dense]}}
""",
        "big.yaml",
    )


def test_the_text_report_of_the_first_rows_hashes_only_them(monkeypatch):
    """A report that lists its first rows hashes those rows only (no SHA-1 of the other 5,000), and reads as the
    report of the whole table (same widths, rows and summary)."""
    from rngaudit.engine import table as table_mod
    from rngaudit.output.text_rows import derive_text

    spec = _big_spec(100)
    whole = "".join(derive_text(derive(spec), width=None, color=False, max_rows=40))
    hashed = []

    def counted(data):
        hashed.append(data)
        return table_mod.hash_word.__wrapped__(data)

    def refused(*a, **k):
        raise AssertionError("every row hashed")

    counted.__wrapped__ = table_mod.hash_word  # type: ignore[attr-defined]
    monkeypatch.setattr(table_mod, "hash_word", counted)
    monkeypatch.setattr(table_mod, "hash_templates", refused)
    monkeypatch.setattr(table_mod, "start_words", refused)
    report = derive(spec, keyed=40)
    assert "".join(derive_text(report, width=None, color=False, max_rows=40)) == whole
    assert len(report.calls) == 5200
    assert sorted(hashed) == sorted(set(hashed)) and len(hashed) == 40


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(specs(), st.data())
def test_the_first_rows_text_report_of_both_engines_is_the_same(text, data):
    """The key and word columns are as wide as the rows listed need, on the fast path and the plain one alike."""
    from rngaudit.output.text_rows import derive_text

    spec = parse_spec(text, "<hypothesis>")
    try:
        plain = derive(spec, values=False, engine="plain")
    except (SpecError, FlaxError):
        return
    k = data.draw(st.integers(1, len(plain.calls) + 1))

    def report(r):
        return "".join(derive_text(r, width=None, color=False, max_rows=k))

    assert report(derive(spec, values=False, keyed=k)) == report(plain)


def test_a_failing_draw_of_the_rows_left_fails_each_time_they_are_read(monkeypatch):
    """A draw that fails while the rows left are keyed leaves the calls as they were: reading them again tries
    again (it does not hand out the first rows as if they were all)."""
    from rngaudit.engine import derive as derive_mod

    spec = parse_spec(
        "rngaudit: 1\nrngs: {params: 0}\nmodel: {class: M, body: [{make_rng: {stream: params, repeat: 5, "
        "draw: {normal: [2]}}}]}\n",
        "d.yaml",
    )
    whole = derive(spec)
    report = derive(spec, keyed=2)
    real = derive_mod._draw
    monkeypatch.setattr(derive_mod, "_draw", lambda *a: (_ for _ in ()).throw(SpecError("cannot draw")))
    for _ in range(2):
        with pytest.raises(SpecError):
            report.calls.keys  # noqa: B018 (reading the property keys the rows)
        with pytest.raises(SpecError):
            report.calls[4]
    monkeypatch.setattr(derive_mod, "_draw", real)
    assert len(report.calls.keys) == 5 and (report.calls.keys == whole.calls.keys).all()
    assert all((a.values == b.values).all() for a, b in zip(report.calls, whole.calls, strict=True))


def test_keyed_is_never_negative():
    from rngaudit import UsageError, api

    with pytest.raises(UsageError, match="keyed=-5"):
        api.derive(_big_spec(1), keyed=-5)


def test_reading_a_later_row_keys_the_rest():
    spec = _big_spec(3)
    whole = derive(spec)
    report = derive(spec, keyed=2)
    assert report.calls[100].key == whole.calls[100].key
    assert (report.calls.keys == whole.calls.keys).all()


@pytest.mark.parametrize("model", ("vmap", "nested"))
def test_keying_the_first_rows_draws_their_values_as_the_whole_report(model):
    """Values (rbg lanes drawn from their first lane's key included) of the keyed rows, and of the rows read
    later, are the whole report's."""
    import numpy as np

    from engine.test_rbg_lanes import LINEN_MODELS, linen

    spec = parse_spec(linen("rbg", LINEN_MODELS[model]))
    whole = derive(spec).calls
    for k in range(len(whole) + 1):
        calls = derive(spec, keyed=k).calls
        early = calls.values_upto(k)
        assert sorted(early) == [j for j in range(k) if whole[j].values is not None]
        assert all(np.array_equal(v, whole[j].values) for j, v in early.items())
        assert all(np.array_equal(a.values, b.values) for a, b in zip(calls, whole, strict=True))
