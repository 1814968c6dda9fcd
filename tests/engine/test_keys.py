"""rngaudit's PRNG primitives are bit-identical to jax.random.

rngaudit.threefry recomputes Threefry-2x32 in NumPy; rngaudit.keys.KeyEngine seeds, folds in and
splits raw key data for threefry2x32 and rbg without JAX (unsafe_rbg through JAX); rngaudit.keyexpr
parses the key expressions a spec writes. Every result here is checked against jax.random itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
jnp = jax.numpy

from rngaudit.engine import threefry
from rngaudit.engine.keys import KeyEngine
from rngaudit.errors import Location, SpecError
from rngaudit.spec import keyexpr
from rngaudit.spec.keyexpr import FoldIn, Raw, Seed, Split
from rngaudit.spec.parse import parse_spec

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
WIDTH = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

u32 = st.integers(0, 2**32 - 1)
int64 = st.integers(INT64_MIN, INT64_MAX)
JAX_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def key_words(impl: str):
    return st.tuples(*[u32] * WIDTH[impl])


def wrap(words, impl: str):
    return jax.random.wrap_key_data(jnp.asarray(np.asarray(words, np.uint32)), impl=impl)


def data_of(key) -> tuple[int, ...]:
    return tuple(int(w) for w in np.asarray(jax.random.key_data(key)).reshape(-1))


def rows_of(keys) -> list[tuple[int, ...]]:
    d = np.asarray(jax.random.key_data(keys))
    return [tuple(int(w) for w in row) for row in d]


# ---------------------------------------------------------------- the Threefry block itself
@JAX_SETTINGS
@given(st.tuples(u32, u32), st.lists(u32, min_size=2, max_size=32).filter(lambda c: len(c) % 2 == 0))
def test_threefry_block_matches_jax(key, counts):
    from jax.extend.random import threefry_2x32

    want = np.asarray(threefry_2x32(jnp.asarray(key, jnp.uint32), jnp.asarray(counts, jnp.uint32)))
    half = len(counts) // 2
    y0, y1 = threefry.threefry2x32(key[0], key[1], np.asarray(counts[:half]), np.asarray(counts[half:]))
    assert np.concatenate([y0, y1]).tolist() == want.tolist()


# ---------------------------------------------------------------- fold_in
@JAX_SETTINGS
@given(st.tuples(u32, u32), st.lists(u32, min_size=1, max_size=16))
@example((0, 0), [0, 1, 2**31, 2**32 - 1])
@example((2**32 - 1, 2**32 - 1), [0])
def test_threefry_fold_in_matches_jax(key, words):
    k = wrap(key, "threefry2x32")
    got = threefry.fold_in(key, np.asarray(words, np.uint32))
    assert got.shape == (len(words), 2)
    for w, row in zip(words, got):
        assert tuple(int(x) for x in row) == data_of(jax.random.fold_in(k, np.uint32(w)))
    # a scalar word gives one key
    assert tuple(int(x) for x in threefry.fold_in(key, words[0])) == tuple(int(x) for x in got[0])


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@JAX_SETTINGS
@given(data=st.data())
def test_engine_fold_in_matches_jax(impl, data):
    key = data.draw(key_words(impl))
    words = data.draw(st.lists(u32, min_size=1, max_size=12))
    engine = KeyEngine(impl, True)
    got = engine.fold_in_many(key, np.asarray(words, np.uint32))
    k = wrap(key, impl)
    assert [tuple(int(x) for x in r) for r in got] == [data_of(jax.random.fold_in(k, np.uint32(w))) for w in words]
    assert engine.eval(FoldIn(Raw(key), words[0])) == data_of(jax.random.fold_in(k, np.uint32(words[0])))


@settings(max_examples=6, deadline=None)
@given(key_words("unsafe_rbg"), st.lists(u32, min_size=1, max_size=6))
@example((0, 7, 0, 7), [0, 1, 5, 2**32 - 1, 12345])
def test_unsafe_rbg_fold_in_matches_jax(key, words):
    """unsafe_rbg goes through JAX; every row must be fold_in(key, w) on its own, as in Flax
    (a vmapped rng_bit_generator is seeded from the first key only, which once broke this)."""
    engine = KeyEngine("unsafe_rbg", True)
    k = wrap(key, "unsafe_rbg")
    want = [data_of(jax.random.fold_in(k, np.uint32(w))) for w in words]
    assert [engine.eval(FoldIn(Raw(key), w)) for w in words] == want
    got = engine.fold_in_many(key, np.asarray(words, np.uint32))
    assert [tuple(int(x) for x in r) for r in got] == want


# ---------------------------------------------------------------- split
@pytest.mark.parametrize("partitionable", [True, False], ids=["partitionable", "original"])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_matches_jax(impl, partitionable, data):
    key = data.draw(key_words(impl))
    n = data.draw(st.one_of(st.integers(1, 8), st.integers(1, 64)))
    engine = KeyEngine(impl, partitionable)
    with jax.threefry_partitionable(partitionable):
        want = rows_of(jax.random.split(wrap(key, impl), n))
    assert [engine.split(key, n, i) for i in range(n)] == want


def test_threefry_split_one_large_index():
    # split_one computes one row without materialising the others; check the far end
    key = (123, 456)
    n = 100_000
    with jax.threefry_partitionable(True):
        want = rows_of(jax.random.split(wrap(key, "threefry2x32"), n))
    for i in (0, 1, 65_535, 65_536, n - 1):
        assert threefry.split_one(key, n, i, True) == want[i]
    with jax.threefry_partitionable(False):
        want = rows_of(jax.random.split(wrap(key, "threefry2x32"), n))
    for i in (0, n // 2 - 1, n // 2, n - 1):
        assert threefry.split_one(key, n, i, False) == want[i]


@pytest.mark.parametrize("partitionable", [True, False], ids=["partitionable", "original"])
@settings(max_examples=8, deadline=None)
@given(key=key_words("unsafe_rbg"), n=st.integers(1, 6))
def test_unsafe_rbg_split_matches_jax(partitionable, key, n):
    engine = KeyEngine("unsafe_rbg", partitionable)
    with jax.threefry_partitionable(partitionable):
        want = rows_of(jax.random.split(wrap(key, "unsafe_rbg"), n))
    assert [engine.split(key, n, i) for i in range(n)] == want


# ---------------------------------------------------------------- seeding
SEED_EDGES = [
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**32 - 1,
    2**32,
    2**32 + 5,
    2**62,
    INT64_MAX,
    INT64_MIN,
    INT64_MIN + 1,
]


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=40, deadline=None)
@given(seed=int64)
def test_seed_matches_jax_key(impl, seed):
    assert KeyEngine(impl, True).seed(seed) == data_of(jax.random.key(seed, impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_seed_edges_match_jax_key(impl):
    engine = KeyEngine(impl, True)
    for seed in SEED_EDGES:
        assert engine.seed(seed) == data_of(jax.random.key(seed, impl=impl)), seed
    # PRNGKey (the legacy uint32 form) holds the same data for the default impl
    if impl == "threefry2x32":
        for seed in SEED_EDGES:
            assert engine.seed(seed) == tuple(int(w) for w in np.asarray(jax.random.PRNGKey(seed)))


@settings(max_examples=30, deadline=None)
@given(seed=st.one_of(st.integers(INT64_MAX + 1, 2**80), st.integers(-(2**80), INT64_MIN - 1)))
@example(seed=INT64_MAX + 1)
@example(seed=INT64_MIN - 1)
def test_out_of_range_seeds_are_refused_like_jax(seed):
    with pytest.raises(OverflowError):
        jax.random.key(seed)
    loc = Location("s.yaml", 3, 11)
    with pytest.raises(SpecError, match="signed 64-bit") as ei:
        keyexpr.parse(f"key({seed})", loc, quoted=False)
    assert (ei.value.location.line, ei.value.location.col) == (3, 11 + len("key("))
    with pytest.raises(SpecError, match="signed 64-bit") as ei:
        parse_spec(f"rngaudit: 1\nrngs: {{params: {seed}}}\nmodel: {{class: M}}\n", "s.yaml")
    assert (ei.value.location.line, ei.value.location.col) == (2, 16)


@pytest.mark.parametrize("seed", [INT64_MIN, INT64_MAX])
def test_int64_bounds_are_accepted(seed):
    spec = parse_spec(f"rngaudit: 1\nrngs: {{params: {seed}, other: 'key({seed})'}}\nmodel: {{class: M}}\n")
    assert spec.rngs["params"].expr == Seed(seed) == spec.rngs["other"].expr


# ---------------------------------------------------------------- key expressions
def _trees(impl: str):
    width = WIDTH[impl]
    leaves = st.one_of(
        int64.map(Seed),
        st.tuples(*[u32] * width).map(Raw),
    )

    def extend(children):
        split = st.integers(1, 6).flatmap(
            lambda n: st.tuples(children, st.just(n), st.integers(0, n - 1)).map(lambda t: Split(*t))
        )
        fold = st.tuples(children, u32).map(lambda t: FoldIn(*t))
        return st.one_of(split, fold)

    return st.recursive(leaves, extend, max_leaves=4)


def jax_eval(expr, impl: str):
    if isinstance(expr, Seed):
        return jax.random.key(expr.seed, impl=impl)
    if isinstance(expr, Raw):
        return wrap(expr.words, impl)
    if isinstance(expr, Split):
        return jax.random.split(jax_eval(expr.parent, impl), expr.n)[expr.index]
    if isinstance(expr, FoldIn):
        return jax.random.fold_in(jax_eval(expr.parent, impl), np.uint32(expr.data))
    raise TypeError(expr)


def render(expr, draw) -> str:
    """Write `expr` the way a person might: with or without jax.random., PRNGKey, hex, spaces."""
    sp = draw(st.sampled_from(["", " ", "  "]))

    def num(v: int) -> str:
        style = draw(st.sampled_from(["dec", "hex", "bin"] if v >= 0 else ["dec"]))
        return {"dec": str(v), "hex": hex(v), "bin": bin(v)}[style]

    def fn(name: str) -> str:
        prefix = draw(st.sampled_from(["", "jax.random.", "random.", "jr."]))
        if name == "key":
            name = draw(st.sampled_from(["key", "PRNGKey"]))
        return prefix + name

    if isinstance(expr, Seed):
        return f"{fn('key')}({sp}{num(expr.seed)}{sp})"
    if isinstance(expr, Raw):
        return "[" + f",{sp}".join(num(w) for w in expr.words) + "]"
    if isinstance(expr, Split):
        idx = expr.index if draw(st.booleans()) else expr.index - expr.n  # negative indexing
        count = "" if expr.n == 2 and draw(st.booleans()) else f",{sp}{num(expr.n)}"
        return f"{fn('split')}({render(expr.parent, draw)}{count}){sp}[{idx}]"
    return f"{fn('fold_in')}({render(expr.parent, draw)},{sp}{num(expr.data)})"


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_key_expressions_evaluate_like_jax(impl, data):
    expr = data.draw(_trees(impl))
    text = render(expr, data.draw)
    parsed = keyexpr.parse(text, Location("s.yaml", 1, 1))
    assert parsed == expr, text
    assert keyexpr.parse(str(expr), Location("s.yaml", 1, 1)) == expr
    with jax.threefry_partitionable(True):
        want = data_of(jax_eval(expr, impl))
    assert KeyEngine(impl, True).eval(parsed) == want, text


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_key_expressions_original_split_mode(data):
    expr = data.draw(_trees("threefry2x32"))
    with jax.threefry_partitionable(False):
        want = data_of(jax_eval(expr, "threefry2x32"))
    assert KeyEngine("threefry2x32", False).eval(expr) == want


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="keysplitfold_in()[],0123456789 -x", max_size=40))
def test_garbage_never_crashes_the_parser(text):
    try:
        keyexpr.parse(text, Location("s.yaml", 1, 1))
    except SpecError as e:
        assert e.location is not None and e.location.line == 1
        assert "\n" not in str(e)


@pytest.mark.parametrize(
    "text, col, message",
    [
        ("splt(key(0))[0]", 1, "unknown function 'splt' (did you mean 'split'?)"),
        ("split(key(0), 3)", 17, "split gives 3 keys; pick one with [i]"),
        ("split(key(0), 3)[3]", 18, "index out of range"),
        ("split(key(0), 3)[-4]", 18, "index out of range"),
        ("split(key(0), 0)[0]", 15, "split count must be in [1, 2147483647]"),
        ("fold_in(key(0), 4294967296)", 17, "fold_in data must be in [0, 2**32)"),
        ("fold_in(key(0), -1)", 17, "fold_in data must be in [0, 2**32)"),
        ("key(0) junk", 8, "unexpected 'junk' after the expression"),
        ("key(007)", 5, "'007' has a leading zero"),
        ("key(1_000)", 5, "'1_000' is not a number"),
        ("key(0", 6, "expected ')', found the end"),
        ("[1, 4294967296]", 5, "raw key data must be unsigned 32-bit integers"),
        ("key(1.5)", 6, "unexpected character '.'"),
        ("", 1, "empty expression"),
        ("fold_in(" * 101 + "key(0)" + ", 1)" * 101, 801, "nests deeper than 100 calls"),
    ],
)
def test_bad_expressions_point_at_the_problem(text, col, message):
    with pytest.raises(SpecError) as ei:
        keyexpr.parse(text, Location("s.yaml", 4, 1), quoted=False)
    assert message in ei.value.message
    assert (ei.value.location.line, ei.value.location.col) == (4, col)


def test_quoted_expressions_point_inside_the_quotes():
    with pytest.raises(SpecError) as ei:
        parse_spec('rngaudit: 1\nrngs: {params: "split(key(0), 3)[7]"}\nmodel: {class: M}\n', "q.yaml")
    # the string starts at column 16; its '7' is 17 characters in
    assert (ei.value.location.line, ei.value.location.col) == (2, 17 + 17)


def test_long_raw_key_data_parses():

    text = "[" + ", ".join(["1"] * 100_000) + "]"
    expr = keyexpr.parse(text, Location("s.yaml", 1, 1))
    assert len(expr.words) == 100_000


@pytest.mark.parametrize("impl", IMPLS)
def test_raw_key_width_is_checked_per_impl(impl):
    other = 4 if WIDTH[impl] == 2 else 2
    words = ", ".join(["1"] * other)
    with pytest.raises(SpecError, match=f"raw key data has {other} words but the PRNG impl needs {WIDTH[impl]}"):
        parse_spec(f"rngaudit: 1\njax: {{prng_impl: {impl}}}\nrngs: {{params: [{words}]}}\nmodel: {{class: M}}\n")
    words = ", ".join(["1"] * WIDTH[impl])
    spec = parse_spec(
        f"rngaudit: 1\njax: {{prng_impl: {impl}}}\nrngs: {{params: 'fold_in([{words}], 3)'}}\nmodel: {{class: M}}\n"
    )
    assert spec.rngs["params"].expr == FoldIn(Raw((1,) * WIDTH[impl]), 3)


@settings(max_examples=20, deadline=None)
@given(seed=int64, n=st.integers(1, 6), data=st.data())
def test_spec_roots_match_jax(seed, n, data):
    """A spec's `rngs:` (integer seed, expression, raw data) give the keys jax would."""
    from rngaudit.engine.keys import root_keys

    i = data.draw(st.integers(0, n - 1))
    w = data.draw(u32)
    impl = data.draw(st.sampled_from(["threefry2x32", "rbg"]))
    part = data.draw(st.booleans())
    spec = parse_spec(
        f"rngaudit: 1\njax: {{prng_impl: {impl}, threefry_partitionable: {str(part).lower()}}}\n"
        f"rngs:\n  params: {seed}\n  dropout: 'fold_in(split(key({seed}), {n})[{i}], {w})'\n"
        "model: {class: M}\n"
    )
    roots = root_keys(spec)
    with jax.threefry_partitionable(part):
        k = jax.random.key(seed, impl=impl)
        assert roots["params"] == data_of(k)
        assert roots["dropout"] == data_of(jax.random.fold_in(jax.random.split(k, n)[i], np.uint32(w)))
