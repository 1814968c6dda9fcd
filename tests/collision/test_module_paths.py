"""rngaudit.modpaths: JSON module paths and params trees audited like specs, checked against real Flax."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax_oracle import capture, key_words
from support import REPO

from rngaudit import produce_hash
from rngaudit.collision.audit import audit
from rngaudit.collision.module_paths import ModuleSites, load_module_sites, parse_path
from rngaudit.errors import InputError
from rngaudit.spec.json_source import parse_json

FIX = REPO / "fixtures" / "collisions"


def sites_of(value, sep: bool = False, file: str = "in.json", indent=None) -> ModuleSites:
    return ModuleSites(parse_json(json.dumps(value, indent=indent), file), sep)


def test_parse_path():
    assert parse_path("a/b/c") == ("a", "b", "c")
    assert parse_path("/Dense_0") == ("Dense_0",)
    assert parse_path("") == () and parse_path("/") == ()
    assert parse_path("a//b") == ("a", "", "b")


def test_path_list_fixture():
    a = audit(load_module_sites(str(FIX / "paths.json")))
    assert (a.input_kind, a.call_sites, a.keys_checked) == ("paths", 10, False)
    (c,) = a.collisions
    assert c.collision_class == 1 and c.inputs[0].word == 947574064
    assert [(s.path, s.count) for s in c.sites] == [
        (("A", "B", "C"), 1),
        (("AB", "C"), 1),
        (("A", "BC"), 1),
        (("ABC",), 1),
    ]
    # each call site is the list entry, at its line:col
    assert [str(s.location) for s in c.sites] == [f"{FIX / 'paths.json'}:{n}:3" for n in (2, 3, 4, 5)]
    assert len(c.renames) == 3 and all(r.location is not None for r in c.renames)
    (lt,) = a.latent
    assert (lt.site.path, lt.max_count) == (("layer",), 3)
    assert [(p.site.path, p.counts) for p in lt.partners] == [(("layer1",), (0x3101, 1))]


def test_repeated_entries_take_the_next_counts_whatever_their_spelling():
    s = sites_of(["x/y", ["x", "y"], "/x/y", "x"])
    assert [s.items(i) for i in range(s.n)] == [("x", "y", 1), ("x", "y", 2), ("x", "y", 3), ("x", 1)]
    assert [int(w) for w in s.word] == [produce_hash(s.items(i)) for i in range(s.n)]


def test_params_tree_counts_and_unwrapping():
    tree = {"params": {"Dense_0": {"kernel": [2, 3], "bias": [3]}, "w": [1], "Block": {}}}
    s = sites_of(tree)
    assert s.input_kind == "params_tree"
    assert [s.items(i) for i in range(s.n)] == [(1,), ("Dense_0", 1), ("Dense_0", 2)]
    # a root that holds params itself is not a `variables` dump: "params" is then a module
    s = sites_of({"params": {"w": [1]}, "b": [2]})
    assert [s.items(i) for i in range(s.n)] == [(1,), ("params", 1)]


def test_params_tree_sites_point_at_their_keys():
    path = FIX / "params_tree.json"
    a = audit(load_module_sites(str(path)))
    first, second = a.collisions
    assert [(s.path, s.count, s.label) for s in first.sites] == [
        (("ab", "cdef"), 1, "kernel"),
        (("abc", "def"), 1, "kernel"),
    ]
    assert [(s.path, s.count, s.label) for s in second.sites] == [
        (("ab", "cdef"), 2, "bias"),
        (("abc", "def"), 2, "bias"),
    ]
    lines = path.read_text().split("\n")
    for c in (first, second):
        for s in c.sites:
            assert lines[s.location.line - 1][s.location.col - 1 :].startswith(json.dumps(s.label))
    (r,) = first.renames
    assert lines[r.location.line - 1][r.location.col - 1 :].startswith(json.dumps(r.old_name))


class Leaf(nn.Module):
    @nn.compact
    def __call__(self):
        self.param("kernel", nn.initializers.normal(), (2, 2))
        self.param("bias", nn.initializers.zeros, (2,))


class Node(nn.Module):
    leaf_name: str

    @nn.compact
    def __call__(self):
        Leaf(name=self.leaf_name)()


class Model(nn.Module):
    @nn.compact
    def __call__(self):
        Node(name="ab", leaf_name="cdef")()
        Node(name="abc", leaf_name="def")()
        return nn.Dense(3)(jnp.ones((1, 2)))


def test_params_tree_dumped_from_real_flax(tmp_path):
    """The guide's sharp edge as a real model: dump its params tree the way users do, audit the dump,
    and check the keys Flax handed the params."""
    with capture() as records:
        variables = Model().init(jax.random.key(0))
    dump = tmp_path / "params.json"
    dump.write_text(json.dumps(jax.tree.map(lambda x: list(x.shape), variables), indent=2))
    a = audit(load_module_sites(str(dump)))
    assert a.call_sites == len(records) == 6
    assert [[(s.path, s.count) for s in c.sites] for c in a.collisions] == [
        [(("ab", "cdef"), 1), (("abc", "def"), 1)],
        [(("ab", "cdef"), 2), (("abc", "def"), 2)],
    ]
    by_label = {(r["path"], r["label"]): r["key"] for r in records}
    # Flax: kernel (count 1) and bias (count 2) of the two leaves get the same keys
    assert by_label[(("ab", "cdef"), "kernel")] == by_label[(("abc", "def"), "kernel")]
    assert by_label[(("ab", "cdef"), "bias")] == by_label[(("abc", "def"), "bias")]
    assert by_label[(("ab", "cdef"), "kernel")] != by_label[(("ab", "cdef"), "bias")]
    # the dump's hash words are the ones Flax folded in
    root = jax.random.key(0)
    keys = {key_words(jax.random.fold_in(root, int(s.hash_word))) for c in a.collisions for s in c.sites}
    assert keys == {by_label[(("ab", "cdef"), "kernel")], by_label[(("ab", "cdef"), "bias")]}


@pytest.mark.parametrize(
    "value, message, where",
    [
        (["a", 3], "entry 1: a module path is a string", (1, 7)),
        (["a", ["b", 1]], "entry 1: a module path is a string", (1, 7)),
        (3, "expected a list of module paths or a params tree (an object), not a number", (1, 1)),
        ("a/b", "not a string", (1, 1)),
    ],
)
def test_bad_inputs_say_where(value, message, where):
    with pytest.raises(InputError) as e:
        sites_of(value)
    assert message in e.value.message
    assert (e.value.location.line, e.value.location.col) == where


def test_word_groups_at_scale_equal_a_dictionary_grouping():
    """200,000 modules with one key each: the numpy grouping finds exactly the pairs of equal 32-bit
    words a plain dictionary finds (about n*n/2**33 of them)."""
    names = [f"n{i:06d}" for i in range(200_000)]  # equal widths: no path is a prefix of another
    a = audit(sites_of(names))
    words: dict = {}
    for name in names:
        words.setdefault(produce_hash((name, 1)), []).append((name,))
    want = {frozenset(v) for v in words.values() if len(v) > 1}
    assert {frozenset(s.path for s in c.sites) for c in a.collisions} == want
    assert all(c.collision_class == 3 for c in a.collisions) and len(want) >= 1
    assert a.latent == ()


@pytest.mark.parametrize("name", ["paths.json", "params_tree.json"])
def test_json_renames_remove_the_findings(tmp_path, name):
    a = audit(load_module_sites(str(FIX / name)))
    renames = sorted((r for f in a.collisions + a.latent for r in f.renames), key=lambda r: -len(r.path))
    assert renames

    def renamed(path: tuple) -> tuple:
        for r in renames:  # deepest first: a parent's rename still matches the original names above
            if path[: len(r.path)] == r.path:
                path = r.path[:-1] + (r.new_name,) + path[len(r.path) :]
        return path

    value = json.loads((FIX / name).read_text())
    if isinstance(value, list):
        value = [list(renamed(parse_path(e) if isinstance(e, str) else tuple(e))) for e in value]
    else:

        def tree(node, path):
            return {
                (renamed(path + (k,))[-1] if isinstance(v, dict) else k): (
                    tree(v, path + (k,)) if isinstance(v, dict) else v
                )
                for k, v in node.items()
            }

        value = {"params": tree(value["params"], ())}
    after = audit(sites_of(value))
    assert after.collisions == () and after.latent == ()


@pytest.mark.parametrize("made, what", [("rngaudit.capture", "a keys file"), ("rngaudit.derive", "rngaudit's own")])
def test_rngaudits_own_json_is_not_read_as_a_params_tree(tmp_path, made, what):
    """A keys file (an object) would be read as a params tree and audited as module names, clean whatever its keys:
    one error line for it, and the other inputs still audited."""
    from support import invoke, write

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"format": made, "format_version": 1, "calls": [], "rngs": {"params": [0, 0]}}))
    spec = write(tmp_path, "s.yaml", "rngaudit: 1\nrngs: {params: 0}\nmodel: {class: M, body: [{make_rng: params}]}\n")
    r = invoke("collisions", keys, spec)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert f"error: {keys}:1:1: this is {what}" in r.stderr and "capture -o SPEC.yaml" in r.stderr
    assert "s.yaml" in r.stdout and "params_tree" not in r.stdout


def test_derive_of_a_keys_file_says_what_it_is(tmp_path):
    """derive of a keys file said "unknown key 'calls' in the spec (did you mean 'call_rngs'?)"."""
    from support import invoke

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"format": "rngaudit.capture", "format_version": 1, "calls": [], "rngs": {}}))
    r = invoke("derive", keys, "-o", tmp_path / "out.txt")
    assert r.exit_code == 2 and r.stderr.startswith(
        f"error: {keys}:1:1: this is a keys file (capture --keys), not a spec"
    )
    assert not (tmp_path / "out.txt").exists()
