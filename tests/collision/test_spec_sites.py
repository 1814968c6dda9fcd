"""rngaudit.collisions keeps an input's columns in Python lists with keys on Python ints (small inputs: no
NumPy to import) or in NumPy arrays (large inputs). Both paths must give the same report, to the byte, on
every fixture, on the inputs of tests/test_collisions.py, and on random inputs."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from support import LINEN_EXAMPLES, REPO

import rngaudit.collision.sites as collision_sites
import rngaudit.collision.spec_sites as collision_spec_sites
from collision.test_audit import JIT, SHIFT, VMAP, lanes
from rngaudit import RngauditError, load_spec, parse_spec
from rngaudit.collision.audit import audit
from rngaudit.collision.latent import DEFAULT_LATENT_MAX_COUNT
from rngaudit.collision.module_paths import ModuleSites
from rngaudit.collision.results import CONCATENATION, HASH_WORD
from rngaudit.collision.spec_sites import SpecSites, TableSites, spec_sites
from rngaudit.engine.refs import RootKey
from rngaudit.engine.replay import replay
from rngaudit.output.collisions_json import to_json
from rngaudit.spec.json_source import load_json, parse_json

SPECS = sorted(
    [
        *REPO.glob("fixtures/collisions/*.yaml"),
        *REPO.glob("fixtures/guide/*.yaml"),
        *REPO.glob("fixtures/shard/*.yaml"),
        *LINEN_EXAMPLES,
    ]
)
JSONS = [REPO / "fixtures" / "collisions" / name for name in ("paths.json", "params_tree.json")]
LISTS, ARRAYS = 10**12, 0  # SMALL_SITES that puts every input on one path


def report(make, small_sites: int, monkeypatch, latent_max_count: int = DEFAULT_LATENT_MAX_COUNT) -> str:
    monkeypatch.setattr(collision_sites, "SMALL_SITES", small_sites)
    sites = make()
    assert sites.vectorised is (small_sites == ARRAYS)
    return json.dumps(to_json([audit(sites, latent_max_count)]), sort_keys=True, indent=1)


def assert_same(make, monkeypatch, **kw) -> str:
    lists = report(make, LISTS, monkeypatch, **kw)
    assert lists == report(make, ARRAYS, monkeypatch, **kw)
    return lists


def spec_variants(spec):
    """The spec; hash-only; with the separator flag flipped; renames checked on hashes (no replay)."""
    yield "as is", spec, {}
    yield "no keys", spec, {"keys": False}
    yield "separator flipped", dataclasses.replace(spec, fix_rng_separator=not spec.fix_rng_separator), {}
    yield "hashed renames", spec, {"replay_limit": 0}


def check_spec(spec, monkeypatch, rows=None) -> None:
    """Lists, arrays, and arrays from derive's fast path (TableSites): one report."""
    for _, s, opts in spec_variants(spec):
        monkeypatch.setattr(collision_spec_sites, "REPLAY_LIMIT", opts.get("replay_limit", 20_000))
        text = assert_same(
            lambda: SpecSites(s, keys=opts.get("keys", True), rows=rows if s is spec else None), monkeypatch
        )
        if rows is None:
            assert report(lambda: TableSites(s, keys=opts.get("keys", True)), ARRAYS, monkeypatch) == text


@pytest.mark.parametrize("path", SPECS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fixture_specs(path, monkeypatch):
    check_spec(load_spec(str(path)), monkeypatch)


@pytest.mark.parametrize("separator", [False, True])
@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_fixture_json(path, separator, monkeypatch):
    text = assert_same(lambda: ModuleSites(load_json(str(path)), separator), monkeypatch)
    assert_same(lambda: ModuleSites(load_json(str(path)), separator), monkeypatch, latent_max_count=0)
    if not separator:  # the fixtures' findings
        assert '"collisions": []' not in text


@pytest.mark.parametrize(
    "text",
    [
        SHIFT.replace("STREAM", "dropout"),
        SHIFT.replace("STREAM", "params"),
        VMAP.replace("SPLIT", "false"),
        VMAP.replace("SPLIT", "true"),
        JIT.replace("FLAG", "false"),
        JIT.replace("FLAG", "true"),
    ],
    ids=["shift-dropout", "shift-params", "vmap-unsplit", "vmap-split", "jit", "jit-separator"],
)
def test_collisions_test_specs(text, monkeypatch):
    check_spec(parse_spec(text, "t.yaml"), monkeypatch)


@pytest.mark.parametrize("flag", ["false", "true"])
def test_nul_name_spec(flag, monkeypatch):
    check_spec(
        parse_spec(
            textwrap.dedent(f"""
        rngaudit: 1
        flax: {{fix_rng_separator: {flag}}}
        rngs: {{params: 0}}
        model:
          class: Model
          body:
            - module: {{class: M, name: "a\\0b", body: [make_rng]}}
            - module: {{class: M, name: a, body: [{{module: {{class: M, name: b, body: [make_rng]}}}}]}}
        """),
            "nul.yaml",
        ),
        monkeypatch,
    )


def test_lanes_rows(monkeypatch):
    spec = parse_spec(
        textwrap.dedent("""
        rngaudit: 1
        rngs: {dropout: 1, noise: 1}
        model:
          class: Model
          body:
            - module: {class: Body, body: [{make_rng: dropout}, {make_rng: dropout}]}
        """)
    )
    rows = replay(spec)
    for laned, category in ((lanes(rows, 3), "unsplit_lanes"), (lanes(rows, 2, base=RootKey("noise")), "shared_seed")):
        assert f'"{category}"' in assert_same(lambda: SpecSites(spec, rows=laned), monkeypatch)
        assert_same(lambda: SpecSites(spec, keys=False, rows=laned), monkeypatch)


def test_unsafe_rbg_keys_from_jax_in_lists(monkeypatch):
    pytest.importorskip("jax")
    spec = parse_spec(
        textwrap.dedent("""
        rngaudit: 1
        jax: {prng_impl: unsafe_rbg}
        rngs: {params: 0}
        model: {class: M, body: [{module: {class: N, name: ab, body: [{module: {class: L, name: cdef, body: [make_rng]}}]}},
                                 {module: {class: N, name: abc, body: [{module: {class: L, name: def, body: [make_rng]}}]}}]}
        """),
        "u.yaml",
    )
    assert '"class": 1' in assert_same(lambda: SpecSites(spec), monkeypatch)
    check_spec(spec, monkeypatch)  # and TableSites, whose unsafe_rbg keys are computed row by row


SHARED_SEED = """
rngaudit: 1
rngs: {params: 0, dropout: 0}
model:
  class: Model
  body:
    - module: {class: A, body: [{make_rng: {stream: params, repeat: 3}}, {make_rng: {stream: dropout, repeat: 3}}]}
"""


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize(
    "text, shared",
    [
        (VMAP.replace("SPLIT", "false"), True),
        (VMAP.replace("SPLIT", "true"), False),
        (JIT.replace("FLAG", "false"), True),
        (JIT.replace("FLAG", "true"), False),
        (SHIFT.replace("STREAM", "dropout"), True),
        (SHARED_SEED, True),
    ],
    ids=["vmap-unsplit", "vmap-split", "jit", "jit-separator", "shift", "shared-seed"],
)
def test_table_idents_group_sites_as_their_keys_do(text, shared, impl):
    """TableSites compares threefry2x32/rbg keys as (base key value, hash word), computing keys for
    reported sites only: its idents must group the sites exactly as the keys themselves do, and the
    keys it reports must be the keys."""
    spec = dataclasses.replace(parse_spec(text, "t.yaml"), prng_impl=impl)
    full, table = SpecSites(spec), TableSites(spec)
    keys = [tuple(int(w) for w in k) for k in full.keys]
    idents = table.idents().tolist()
    assert len(keys) == len(idents) == table.n
    assert (len(set(keys)) < len(keys)) is shared
    for i in range(table.n):
        for j in range(table.n):
            assert (keys[i] == keys[j]) == (idents[i] == idents[j]), (i, j)
    described, _ = table.describe(range(table.n), [])
    assert [described[i].key for i in range(table.n)] == keys


NAMES = st.text(alphabet="ab1\x00\x01\x02", max_size=3)


@given(
    st.lists(st.tuples(st.lists(NAMES, max_size=3).map(tuple), st.integers(1, 3)), min_size=1, max_size=8),
    st.booleans(),
    st.sampled_from([0, 600, DEFAULT_LATENT_MAX_COUNT]),
)
@settings(max_examples=150, deadline=None)
def test_random_module_paths(modules, separator, bound):
    """Random paths drawing a few keys each (collisions, latent pairs and renames of every kind)."""
    entries = [list(p) for p, n in modules for _ in range(n)]
    doc = json.dumps(entries)
    with pytest.MonkeyPatch.context() as mp:
        assert_same(lambda: ModuleSites(parse_json(doc, "m.json"), separator), mp, latent_max_count=bound)


@given(
    st.lists(
        st.sampled_from(["ab", "cdef", "abc", "def", "A", "B", "AB", "layer", "layer1", "x", "x\x01"]),
        min_size=1,
        max_size=5,
    ),
    st.integers(1, 3),
    st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_random_specs(names, repeat, separator):
    """Random nestings of modules whose names concatenate alike, each making `repeat` make_rng calls."""

    def module(k: int) -> str:
        body = f"[{{make_rng: {{stream: params, repeat: {repeat}}}}}]"
        if k + 1 < len(names):
            body = f"[{{make_rng: {{stream: params, repeat: {repeat}}}}}, {module(k + 1)}]"
        return f"{{module: {{class: M, name: {json.dumps(names[k])}, body: {body}}}}}"

    text = (
        f"rngaudit: 1\nflax: {{fix_rng_separator: {str(separator).lower()}}}\nrngs: {{params: 0}}\n"
        f"model: {{class: Model, body: [{module(0)}, {module(len(names) // 2)}]}}\n"
    )
    spec = parse_spec(text, "r.yaml")
    try:
        replay(spec)
    except RngauditError:  # e.g. Flax's NameInUseError for two modules of one name
        reject()
    with pytest.MonkeyPatch.context() as mp:
        check_spec(spec, mp)


def test_a_rename_that_would_meet_other_keys_by_chance_is_not_tried():
    """Renaming a module of 250,000 keys on one base key gives them fresh words: by the birthday bound
    about 250,000**2 / 2**32 (14) of them meet another key, so no rename of it can be verified, and
    every try would re-derive all its keys (40 tries per finding made this spec take minutes). Such a
    module is not tried; the note says why, and smaller modules' renames are still found."""
    spec = parse_spec(
        textwrap.dedent("""
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: Model
          body:
            - module: {class: F, name: filler, body: [{make_rng: {repeat: 250000}}]}
            - module: {class: N, name: ab, body: [{module: {class: L, name: cdef, body: [make_rng]}}]}
            - module: {class: N, name: abc, body: [{module: {class: L, name: def, body: [make_rng]}}]}
        """),
        "big.yaml",
    )
    a = audit(spec_sites(spec))
    big = [c for c in a.collisions if any(s.path == ("filler",) for s in c.sites)]
    assert big, "expected class-3 collisions among the filler's 250,000 keys"
    for c in big:
        assert c.collision_class == HASH_WORD
        assert c.renames == () and "is not tried" in c.rename_note
    small = [c for c in a.collisions if c.collision_class == CONCATENATION]
    assert small and all(c.renames for c in small)


def test_rename_checks_stop_at_their_budget(monkeypatch):
    """Each rename check of a replayable spec runs the whole model again: a model of hundreds of sibling layers (a
    latent finding per layer) took 37 s and 1.9 GB for 1,500 of them. Past REPLAY_BUDGET call sites replayed, the
    later findings say their renames were not checked; the earlier ones keep theirs, and every finding is listed."""
    import rngaudit
    from rngaudit.collision import renames

    text = "rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: M\n  body:\n" + "    - Dense: {features: 2}\n" * 40
    spec = rngaudit.parse_spec(text, "many.yaml")
    full = rngaudit.collisions(spec).audits[0].latent
    assert len(full) >= 3 and not any(lt.rename_note.startswith("not checked") for lt in full)
    monkeypatch.setattr(renames, "REPLAY_BUDGET", 200)  # (80 call sites a replay: spent after the first finding)
    cut = rngaudit.collisions(spec).audits[0].latent
    assert [lt.site.path for lt in cut] == [lt.site.path for lt in full]
    assert cut[0].renames == full[0].renames and cut[0].rename_note == full[0].rename_note
    unchecked = [lt for lt in cut if lt.rename_note.startswith("not checked: the rename checks of earlier findings")]
    assert unchecked and all(lt.renames == () for lt in unchecked) and len(unchecked) < len(cut)
    for a, b in zip(cut, full):
        assert a in unchecked or (a.renames, a.rename_note) == (b.renames, b.rename_note)
