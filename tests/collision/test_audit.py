"""rngaudit.collisions: every class of collision is found and explained, and real Flax confirms each one."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import textwrap

import pytest
from flax_oracle import flax_keys
from hypothesis import given, settings
from hypothesis import strategies as st
from support import REPO

from rngaudit import load_spec, parse_spec, produce_hash
from rngaudit.collision.audit import audit, audit_spec
from rngaudit.collision.latent import smallest_counts
from rngaudit.collision.module_paths import ModuleSites
from rngaudit.collision.results import COUNT_MEETS_NAME, SHARED_SEED, UNSPLIT_LANES
from rngaudit.collision.sites import count_bytes
from rngaudit.collision.spec_sites import SpecSites
from rngaudit.engine.hashing import encode_item, hash_input, hash_word
from rngaudit.engine.records import Derivation
from rngaudit.engine.replay import replay
from rngaudit.spec.json_source import parse_json

FIX = REPO / "fixtures" / "collisions"
GUIDE = REPO / "fixtures" / "guide"


def fixture(name: str):
    return load_spec(str(FIX / name))


def keys_by_call(spec) -> dict:
    """The keys real Flax hands out, by (path, stream used, count), for models without transforms."""
    return {(r["path"], r["stream"], r["count"]): tuple(r["key"]) for r in flax_keys(spec) if not r["lane"]}


def calls(finding) -> list:
    return [(s.path, s.stream, s.count) for s in finding.sites]


def apply_renames(text: str, renames) -> str:
    """The spec text with each rename written in: the module's flow mapping gets the new `name:`."""
    lines = text.split("\n")
    for r in sorted(renames, key=lambda r: (r.location.line, r.location.col), reverse=True):
        line = lines[r.location.line - 1]
        head, seg = line[: r.location.col - 1], line[r.location.col - 1 :]
        new = json.dumps(r.new_name)
        if r.explicit:
            seg = re.sub(r'name: (?:"(?:[^"\\]|\\.)*"|[^,}\s]+)', lambda m: f"name: {new}", seg, count=1)
        else:
            assert seg.startswith("{"), seg
            seg = "{name: " + new + ", " + seg[1:]
        lines[r.location.line - 1] = head + seg
    return "\n".join(lines)


# ---------------------------------------------------------------- the guide's sharp edge
def test_guide_sharp_edge_is_reported_and_flax_hands_out_one_key():
    spec = load_spec(str(GUIDE / "sharp_edge.yaml"))
    a = audit_spec(spec)
    assert a.failing == 1 and a.latent == ()
    (c,) = a.collisions
    assert (c.collision_class, c.category, c.failing) == (1, "concatenation", True)
    assert calls(c) == [(("ab", "cdef"), "rng", 1), (("abc", "def"), "rng", 1)]
    assert [str(s.location) for s in c.sites] == [f"{spec.file}:16:23", f"{spec.file}:24:23"]
    (h,) = c.inputs
    assert h.data == b"abcdef\x01" and h.word == produce_hash(("ab", "cdef", 1))
    # real Flax: Node(name='ab', leaf_name='cdef') and Node(name='abc', leaf_name='def') get one key
    flax = keys_by_call(spec)
    assert flax[(("ab", "cdef"), "rng", 1)] == flax[(("abc", "def"), "rng", 1)] == h.key
    # the separator check says the flag removes it; Flax with the flag agrees
    assert c.separator.removes is True and c.separator.keys_in_model == 2
    with_flag = load_spec(str(GUIDE / "sharp_edge_separator.yaml"))
    flax = keys_by_call(with_flag)
    assert flax[(("ab", "cdef"), "rng", 1)] != flax[(("abc", "def"), "rng", 1)]
    assert audit_spec(with_flag).collisions == ()
    # the rename is of one module on one side, with its location in the spec
    (r,) = c.renames
    assert (r.path, r.new_name, r.explicit, r.keys_changed) == (("abc", "def"), "def_1", True, 1)
    assert str(r.location) == f"{spec.file}:22:15"


def test_produce_hash_family_is_one_finding_group():
    family = [("A", "B", "C", 1), ("AB", "C", 1), ("A", "BC", 1), ("ABC", 1)]
    assert {produce_hash(items) for items in family} == {947574064}
    spec = fixture("abc_family.yaml")
    a = audit_spec(spec)
    (c,) = a.collisions
    assert c.collision_class == 1 and len(c.inputs) == 1
    assert sorted(s.hash_items for s in c.sites) == sorted(family)
    assert c.inputs[0].word == 947574064 and c.inputs[0].data == b"ABC\x01"
    flax = keys_by_call(spec)
    assert {tuple(flax[(items[:-1], "params", 1)]) for items in family} == {c.inputs[0].key}
    # three renames, each verified against the others: no two of the four share a key afterwards
    assert len(c.renames) == 3 and len({r.path for r in c.renames}) == 3


# ---------------------------------------------------------------- class 2 and latent pairs
@pytest.fixture(scope="module")
def layer_run():
    """One Flax run: module `layer` makes 12545 make_rng calls, `layer1` one."""
    spec = fixture("count_meets_name.yaml")
    return spec, keys_by_call(spec)


def test_class_2_count_meets_name_confirmed_by_flax(layer_run):
    spec, flax = layer_run
    a = audit_spec(spec)
    assert a.latent == ()
    (c,) = a.collisions
    assert (c.collision_class, c.category) == (COUNT_MEETS_NAME, "count_meets_name")
    assert calls(c) == [(("layer",), "params", 0x3101), (("layer1",), "params", 1)]
    assert c.inputs[0].data == b"layer1\x01"
    assert flax[(("layer",), "params", 12545)] == flax[(("layer1",), "params", 1)] == c.inputs[0].key
    assert flax[(("layer",), "params", 12544)] != flax[(("layer1",), "params", 1)]
    assert c.separator.removes is True


def test_latent_pair_reports_the_smallest_counts_and_flax_confirms_them(layer_run):
    a = audit_spec(fixture("latent.yaml"))
    assert a.collisions == ()
    (lt,) = a.latent
    assert lt.site.path == ("layer",) and lt.max_count == 3
    (p,) = lt.partners
    assert p.site.path == ("layer1",) and p.max_count == 1
    assert p.counts == (12545, 1) and p.data == b"layer1\x01"
    assert p.separator_counts is None and lt.separator.removes is True
    assert str(lt.site.location).endswith("latent.yaml:7:51")
    # make the counts meet (count_meets_name.yaml is latent.yaml with repeat 12545): Flax shares the key
    _, flax = layer_run
    assert flax[(("layer",), "params", p.counts[0])] == flax[(("layer1",), "params", p.counts[1])]
    # the counts below do not meet
    assert all(flax[(("layer",), "params", c)] != flax[(("layer1",), "params", 1)] for c in (1, 2, 3))


# ---------------------------------------------------------------- class 3
def birthday_pair(prefix: str = "m") -> tuple[str, str, int]:
    """The first two names prefix0, prefix1, ... whose (name, 1) share a 32-bit hash word."""
    seen: dict[int, str] = {}
    for i in itertools.count():
        name = f"{prefix}{i}"
        w = produce_hash((name, 1))
        if w in seen:
            return seen[w], name, w
        seen[w] = name


def test_class_3_word_collision_found_by_search_and_confirmed_by_flax():
    first, second, word = birthday_pair()
    assert (first, second, word) == ("m17956", "m114932", 2867556399)  # what hash_word.yaml holds
    assert hash_input((first, 1), False) != hash_input((second, 1), False)
    spec = fixture("hash_word.yaml")
    a = audit_spec(spec)
    (c,) = a.collisions
    assert (c.collision_class, c.category, c.failing) == (3, "hash_word", True)
    assert [h.data for h in c.inputs] == [b"m17956\x01", b"m114932\x01"]
    assert {h.word for h in c.inputs} == {word}
    flax = keys_by_call(spec)
    assert flax[((first,), "params", 1)] == flax[((second,), "params", 1)] == c.inputs[0].key
    assert c.separator.removes is True


# ---------------------------------------------------------------- class 4
def test_class_4_shared_seed_fails_and_the_separator_does_not_help():
    spec = fixture("shared_seed.yaml")
    a = audit_spec(spec)
    (c,) = a.collisions
    assert (c.collision_class, c.category, c.failing) == (4, SHARED_SEED, True)
    assert calls(c) == [((), "noise", 1), (("Block_0",), "noise", 1), (("Block_0",), "dropout", 1), ((), "dropout", 1)]
    assert len(c.keys) == 2 and c.renames == ()
    flax = keys_by_call(spec)
    for path in ((), ("Block_0",)):
        assert flax[(path, "noise", 1)] == flax[(path, "dropout", 1)]
    assert flax[((), "noise", 1)] != flax[(("Dense_0",), "params", 1)]
    # checked, not assumed: with the flag the streams still share keys, in rngaudit and in Flax
    assert c.separator.removes is False
    flax = keys_by_call(dataclasses.replace(spec, fix_rng_separator=True))
    assert flax[((), "noise", 1)] == flax[((), "dropout", 1)]


def test_guide_two_streams_with_one_seed_is_one_finding():
    a = audit_spec(load_spec(str(GUIDE / "two_streams_same_seed.yaml")))
    (c,) = a.collisions
    assert c.category == SHARED_SEED and len(c.keys) == 3 and len(c.sites) == 6
    assert audit_spec(load_spec(str(GUIDE / "two_streams.yaml"))).collisions == ()


Laned = dataclasses.make_dataclass(
    "Laned", [("lane", tuple, dataclasses.field(default=()))], bases=(Derivation,), frozen=True
)


def lanes(rows, n: int, base=None) -> list:
    """Each derivation repeated for n lanes (what vmap with split_rngs false gives: one base, n lanes)."""
    out = []
    for lane in range(n):
        for d in rows:
            fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(Derivation)}
            fields.update(index=len(out), lane=(lane,))
            if base is not None and lane:
                fields.update(base=base, stream=base.stream, stream_requested=base.stream)
            out.append(Laned(**fields))
    return out


def test_unsplit_lanes_are_information_and_a_shared_seed_between_lanes_fails():
    # The lifted-transform replay will give Derivations a `lane` and other bases: collisions reads
    # them through getattr(d, "lane", ()) and groups by d.base, so rows carrying lanes work today.
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
    a = audit(SpecSites(spec, rows=lanes(rows, 3)))
    (c,) = a.collisions
    assert (c.collision_class, c.category, c.failing) == (4, UNSPLIT_LANES, False)
    assert a.failing == 0 and a.info == 1
    assert sorted((s.lane, s.count) for s in c.sites) == [((k,), n) for k in range(3) for n in (1, 2)]
    # lane 1 drawing from another stream seeded with the same key: a shared seed, failing
    from rngaudit.engine.refs import RootKey

    a = audit(SpecSites(spec, rows=lanes(rows, 2, base=RootKey("noise"))))
    (c,) = a.collisions
    assert (c.category, c.failing) == (SHARED_SEED, True)


# ---------------------------------------------------------------- the separator, checked
def test_separator_survivor_collides_with_and_without_the_flag_in_flax():
    spec = fixture("separator_survivor.yaml")
    (c,) = audit_spec(spec).collisions
    assert calls(c) == [(("a\x00", "b"), "params", 1), (("a", "\x00b"), "params", 1)]
    assert c.separator.removes is False
    for flag in (False, True):
        flax = keys_by_call(dataclasses.replace(spec, fix_rng_separator=flag))
        assert flax[(("a\x00", "b"), "params", 1)] == flax[(("a", "\x00b"), "params", 1)]
    (on,) = audit_spec(dataclasses.replace(spec, fix_rng_separator=True)).collisions
    assert on.separator.flag is True and on.separator.removes is None


def test_the_separator_can_create_a_collision_with_a_nul_name():
    text = textwrap.dedent("""
        rngaudit: 1
        flax: {fix_rng_separator: FLAG}
        rngs: {params: 0}
        model:
          class: Model
          body:
            - module: {class: M, name: "a\\0b", body: [make_rng]}
            - module: {class: M, name: a, body: [{module: {class: M, name: b, body: [make_rng]}}]}
        """)
    off, on = (parse_spec(text.replace("FLAG", flag)) for flag in ("false", "true"))
    assert audit_spec(off).collisions == ()
    (c,) = audit_spec(on).collisions
    assert c.inputs[0].data == b"\x00a\x00b\x00\x01"
    flax_off, flax_on = keys_by_call(off), keys_by_call(on)
    assert flax_off[(("a\x00b",), "params", 1)] != flax_off[(("a", "b"), "params", 1)]
    assert flax_on[(("a\x00b",), "params", 1)] == flax_on[(("a", "b"), "params", 1)] == c.inputs[0].key


# ---------------------------------------------------------------- renames, verified
@pytest.mark.parametrize(
    "name",
    [
        "sharp_edge.yaml",
        "abc_family.yaml",
        "hash_word.yaml",
        "separator_survivor.yaml",
        "latent.yaml",
        "shared_seed.yaml",
    ],
)
def test_suggested_renames_remove_the_finding_and_create_none(tmp_path, name):
    text = (FIX / name).read_text(encoding="utf-8")
    a = audit_spec(fixture(name))
    findings = a.collisions + a.latent
    renames = [r for f in findings for r in f.renames]
    if name == "shared_seed.yaml":
        assert renames == [] and "no rename helps" in a.collisions[0].rename_note
        return
    assert renames and all(r.location is not None and r.location.file.endswith(name) for r in renames)
    renamed = tmp_path / name
    renamed.write_text(apply_renames(text, renames), encoding="utf-8")
    spec = load_spec(str(renamed))
    after = audit_spec(spec)
    assert after.collisions == () and after.latent == ()
    if a.collisions:  # and in Flax every call now gets its own key
        keys = [tuple(r["key"]) for r in flax_keys(spec)]
        assert len(set(keys)) == len(keys)


def test_renaming_an_auto_named_module_adds_a_name(tmp_path):
    # eleven auto-named modules D_0 ... D_10: D_1 at count 0x3001 would hash b'D_10\x01' like D_10 at 1
    text = "rngaudit: 1\nrngs: {params: 0}\nmodel:\n  class: Model\n  body:\n" + "".join(
        "    - module: {class: D, body: [make_rng]}\n" for _ in range(11)
    )
    path = tmp_path / "auto.yaml"
    path.write_text(text, encoding="utf-8")
    a = audit_spec(load_spec(str(path)))
    assert a.collisions == ()
    (lt,) = a.latent
    assert lt.site.path == ("D_1",) and [(p.site.path, p.counts) for p in lt.partners] == [(("D_10",), (0x3001, 1))]
    # naming D_1 would shift the auto-names of D_2 ... D_10; naming the last one shifts nothing
    (r,) = lt.renames
    assert (r.path, r.new_name, r.explicit, r.module_class, r.note) == (("D_10",), "D_10_1", False, "D", "")
    assert (r.location.line, r.location.col) == (16, 15) and r.keys_changed == 1
    path.write_text(apply_renames(text, [r]), encoding="utf-8")
    after = audit_spec(load_spec(str(path)))
    assert after.collisions == () and after.latent == ()


SHIFT = textwrap.dedent("""
    rngaudit: 1
    rngs: {params: 0, dropout: 1}
    model:
      class: Model
      setup:
        - Sequential: {name: X, layers: [{Dense: {features: 4, use_bias: false}}]}
      body:
        - call: X
        - module: {class: Xlayers, body: [{make_rng: params}]}
        - module: {class: Xlayers, body: [{make_rng: STREAM}]}
    """)


def test_a_rename_that_shifts_auto_names_is_checked_on_the_renamed_model(tmp_path):
    # X/layers_0 (a layer Flax names) and the auto-named Xlayers_0 both hash b'Xlayers_0\x01'. Naming
    # Xlayers_0 explicitly makes Flax name the next Xlayers module Xlayers_0: harmless when it draws
    # from another stream, the same collision again when it draws params.
    spec = parse_spec(SHIFT.replace("STREAM", "dropout"), "shift.yaml")
    (c,) = audit_spec(spec).collisions
    assert calls(c) == [(("X", "layers_0"), "params", 1), (("Xlayers_0",), "params", 1)]
    (r,) = c.renames
    assert (r.path, r.new_name, r.explicit) == (("Xlayers_0",), "Xlayers_0_1", False)
    assert r.note == "Flax's auto-naming then also renames 1 later module: Xlayers_1 -> Xlayers_0"
    assert r.keys_changed == 2
    renamed = tmp_path / "shift.yaml"
    renamed.write_text(apply_renames(SHIFT.replace("STREAM", "dropout"), [r]), encoding="utf-8")
    spec = load_spec(str(renamed))
    assert audit_spec(spec).collisions == ()
    flax = keys_by_call(spec)
    assert set(flax) == {
        (("X", "layers_0"), "params", 1),
        (("Xlayers_0_1",), "params", 1),
        (("Xlayers_0",), "dropout", 1),
    }
    assert len({tuple(k) for k in flax.values()}) == 3
    # drawing params, the shifted module would collide again: no rename is claimed
    (c,) = audit_spec(parse_spec(SHIFT.replace("STREAM", "params"), "shift.yaml")).collisions
    assert c.renames == () and c.rename_note.startswith("no verified rename was found")


# ---------------------------------------------------------------- the rules, against brute force
@given(st.binary(max_size=6), st.binary(min_size=1, max_size=3), st.booleans())
@settings(max_examples=300, deadline=None)
def test_smallest_counts_collide_and_are_smallest(prefix, rest, sep):
    def c(n):
        return count_bytes(n, sep)

    pair = smallest_counts(rest, sep)
    if pair is not None:
        short, long = pair
        assert prefix + c(short) == prefix + rest + c(long)
        assert long == 1
    # no smaller collision exists: a count's encoding is fixed, so the long count decides the short one
    for long in range(1, 300):
        tail = rest + c(long)
        body = tail[1:] if sep else tail
        valid = (not sep or tail[:1] == b"\x00") and body[:1] not in (b"", b"\x00")
        if valid:
            assert pair is not None and int.from_bytes(body, "big") >= pair[0]
            assert c(int.from_bytes(body, "big")) == tail


NAMES = st.text(alphabet="ab1\x00\x01\x02", max_size=3)


@given(
    st.lists(st.tuples(st.lists(NAMES, max_size=3).map(tuple), st.integers(1, 3)), min_size=1, max_size=6),
    st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_findings_equal_brute_force(modules, sep):
    """Random paths drawing a few keys each: the groups found are exactly the groups of equal hash
    input, and the latent pairs exactly the pairs whose bytes meet for counts up to the bound."""
    bound = 600  # tails \x01 and \x02 spell counts 0x0101 and 0x0201
    modules = list({p: n for p, n in modules}.items())
    entries = [list(p) for p, n in modules for _ in range(n)]
    doc = parse_json(json.dumps(entries), "m.json")
    a = audit(ModuleSites(doc, separator=sep), latent_max_count=bound)
    got = {frozenset((s.path, s.count) for s in c.sites) for c in a.collisions}
    by_bytes: dict = {}
    for p, n in modules:
        for c in range(1, n + 1):
            by_bytes.setdefault(hash_input(p + (c,), sep), set()).add((p, c))
    by_word: dict = {}
    for data, group in by_bytes.items():
        by_word.setdefault(hash_word(data), set()).update(group)
    assert got == {frozenset(g) for g in by_word.values() if len(g) > 1}
    # latent: every pair of paths whose bytes meet for counts <= bound, but not for the counts drawn
    reach = dict(modules)
    meets: dict = {}
    for p, _ in modules:
        for c in range(1, bound + 1):  # every count up to the bound
            meets.setdefault(hash_input(p + (c,), sep), []).append((p, c))
    want = set()
    for group in meets.values():
        for (p, c1), (q, c2) in itertools.permutations(group, 2):
            if p != q:
                want.add((p, q))
    met = {
        (p, q)
        for p, q in want
        if any(
            (p, c1) in g and (q, c2) in g
            for g in meets.values()
            for c1 in range(1, reach[p] + 1)
            for c2 in range(1, reach[q] + 1)
        )
    }
    latent = {frozenset(pq) for pq in want - met - {(q, p) for p, q in met}}
    got_latent = {frozenset((lt.site.path, pt.site.path)) for lt in a.latent for pt in lt.partners}
    assert got_latent == latent


def test_count_bytes_are_flax_encoding():
    assert count_bytes(1, False) == b"\x01" and count_bytes(256, False) == b"\x01\x00"
    assert count_bytes(0x3101, True) == b"\x00" + encode_item(0x3101)


@pytest.mark.parametrize(
    "name", ["sharp_edge.yaml", "abc_family.yaml", "hash_word.yaml", "latent.yaml", "separator_survivor.yaml"]
)
def test_large_specs_check_renames_without_replaying_and_agree(monkeypatch, name):
    """Above REPLAY_LIMIT keys a rename is checked on the hashes alone (exact for explicitly named
    modules); on these fixtures both ways choose the same renames."""
    import rngaudit.collision.spec_sites as collisions

    replayed = audit_spec(fixture(name))
    monkeypatch.setattr(collisions, "REPLAY_LIMIT", 0)
    hashed = audit_spec(fixture(name))
    pick = lambda a: [(r.path, r.new_name, r.keys_changed) for f in a.collisions + a.latent for r in f.renames]
    assert pick(hashed) == pick(replayed) and pick(hashed)


def test_large_specs_do_not_rename_auto_named_modules(monkeypatch):
    import rngaudit.collision.spec_sites as collisions

    monkeypatch.setattr(collisions, "REPLAY_LIMIT", 0)
    (c,) = audit_spec(parse_spec(SHIFT.replace("STREAM", "dropout"), "shift.yaml")).collisions
    assert c.renames == ()


# ---------------------------------------------------------------- lifted transforms
def flax_by_lane(spec) -> dict:
    return {(r["path"], r["stream"], r["count"], tuple(r["lane"])): tuple(r["key"]) for r in flax_keys(spec)}


VMAP = textwrap.dedent("""
    rngaudit: 1
    rngs: {params: 0, dropout: 1}
    model:
      class: Model
      body:
        - vmap:
            module: {class: Body, body: [{make_rng: dropout}, {make_rng: dropout}]}
            axis_size: 3
            split_rngs: {params: true, dropout: SPLIT}
            variable_axes: {params: 0}
    """)


def test_vmap_lanes_without_split_share_keys_as_information():
    spec = parse_spec(VMAP.replace("SPLIT", "false"), "vmap.yaml")
    a = audit_spec(spec)
    (c,) = a.collisions
    assert (c.collision_class, c.category, c.failing) == (4, UNSPLIT_LANES, False)
    assert a.failing == 0 and a.info == 1
    assert sorted((s.lane, s.count) for s in c.sites) == [((k,), n) for k in range(3) for n in (1, 2)]
    assert {s.path for s in c.sites} == {("VmapBody_0",)}
    flax = flax_by_lane(spec)
    for n in (1, 2):
        lanes = {flax[(("VmapBody_0",), "dropout", n, (k,))] for k in range(3)}
        assert lanes == {c.keys[n - 1]}
    # split: every lane its own key, in rngaudit and in Flax
    spec = parse_spec(VMAP.replace("SPLIT", "true"), "vmap.yaml")
    assert audit_spec(spec).collisions == ()
    keys = list(flax_by_lane(spec).values())
    assert len(set(keys)) == len(keys) == 6


JIT = textwrap.dedent("""
    rngaudit: 1
    flax: {fix_rng_separator: FLAG}
    rngs: {params: 0}
    model:
      class: Model
      body:
        - jit:
            module:
              class: J
              body:
                - module: {class: Node, name: ab, body: [{module: {class: Leaf, name: cdef, body: [make_rng]}}]}
                - module: {class: Node, name: abc, body: [{module: {class: Leaf, name: def, body: [make_rng]}}]}
    """)


def test_collision_below_a_jit_fork(tmp_path):
    # inside nn.jit keys fold into the fork key with paths relative to the jitted module
    spec = parse_spec(JIT.replace("FLAG", "false"), "jit.yaml")
    (c,) = audit_spec(spec).collisions
    assert calls(c) == [(("JitJ_0", "ab", "cdef"), "params", 1), (("JitJ_0", "abc", "def"), "params", 1)]
    assert [s.hash_items for s in c.sites] == [("ab", "cdef", 1), ("abc", "def", 1)]
    assert {s.base for s in c.sites} == {"key of #0"}
    flax = flax_by_lane(spec)
    assert flax[(("JitJ_0", "ab", "cdef"), "params", 1, ())] == flax[(("JitJ_0", "abc", "def"), "params", 1, ())]
    # the separator check replays the model with the flag (the fork key changes too); Flax agrees
    assert c.separator.removes is True
    on = parse_spec(JIT.replace("FLAG", "true"), "jit.yaml")
    flax = flax_by_lane(on)
    assert flax[(("JitJ_0", "ab", "cdef"), "params", 1, ())] != flax[(("JitJ_0", "abc", "def"), "params", 1, ())]
    (r,) = c.renames
    assert (r.path, r.new_name) == (("JitJ_0", "abc", "def"), "def_1")
    path = tmp_path / "jit.yaml"
    path.write_text(apply_renames(JIT.replace("FLAG", "false"), [r]), encoding="utf-8")
    assert audit_spec(load_spec(str(path))).collisions == ()


def test_keys_flax_discards_are_not_call_sites():
    spec = parse_spec(
        textwrap.dedent("""
        rngaudit: 1
        rngs: {params: 0, dropout: 1}
        model:
          class: Model
          body:
            - scan:
                module: {class: Step, body: [{make_rng: dropout}]}
                length: 2
                split_rngs: {params: true, dropout: true}
                variable_axes: {params: 0}
        """),
        "scan.yaml",
    )
    rows = replay(spec)
    live = [d for d in rows if not d.discarded]
    assert len(live) < len(rows)
    sites = SpecSites(spec)
    assert sites.n == len(live)
    assert audit(sites).collisions == ()
    assert sorted((r["lane"], r["count"]) for r in flax_keys(spec)) == sorted((d.lane, d.count) for d in live)


def test_latent_pair_the_separator_keeps():
    # ('x',) and ('x', '\x01'): without the flag x's count 0x0101 meets count 1; with it, \0x's count
    # 0x010001 spells \0x\0\x01\0\x01, which ('x', '\x01') hashes at count 1
    doc = parse_json(json.dumps(["x", ["x", "\x01"]]), "p.json")
    (lt,) = audit(ModuleSites(doc)).latent
    (p,) = lt.partners
    assert (lt.site.path, p.site.path, p.counts, p.separator_counts) == (
        ("x",),
        ("x", "\x01"),
        (0x0101, 1),
        (0x010001, 1),
    )
    assert lt.separator.removes is False
    assert hash_input(("x", 0x0101), False) == hash_input(("x", "\x01", 1), False)
    assert hash_input(("x", 0x010001), True) == hash_input(("x", "\x01", 1), True)
    # with the flag on, that pair is beyond the default bound; a larger bound reports it
    assert audit(ModuleSites(doc, separator=True)).latent == ()
    (lt,) = audit(ModuleSites(doc, separator=True), latent_max_count=0x010001).latent
    assert lt.partners[0].counts == (0x010001, 1) and lt.partners[0].separator_counts == (0x0101, 1)
