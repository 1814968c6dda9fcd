"""Flax's byte encoding of (path..., count) and the SHA-1 word it folds into the key."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rngaudit.engine.hashing import encode_item, hash_input, hash_word, produce_hash


def guide_produce_hash(data) -> int:
    """`produce_hash` exactly as the Flax guide "Randomness and PRNGs in Flax" writes it."""
    m = hashlib.sha1()
    for x in data:
        if isinstance(x, str):
            m.update(x.encode("utf-8"))
        elif isinstance(x, int):
            m.update(x.to_bytes((x.bit_length() + 7) // 8, byteorder="big"))
        else:
            raise ValueError(f"Expected int or string, got: {x}")
    d = m.digest()
    return int.from_bytes(d[:4], byteorder="big")


# ---------------------------------------------------------------- the guide's numbers
def test_guide_value():
    assert produce_hash(("A", "B", "C", 1)) == 947574064


@pytest.mark.parametrize("data", [("AB", "C", 1), ("A", "BC", 1), ("ABC", 1)])
def test_guide_siblings_collide_without_separator(data):
    # the guide's point: strings are concatenated, so these all hash like ('A', 'B', 'C', 1)
    assert produce_hash(data) == 947574064
    assert hash_input(data, separator=False) == b"ABC\x01"


def test_separator_tells_the_siblings_apart():
    family = [("A", "B", "C", 1), ("AB", "C", 1), ("A", "BC", 1), ("ABC", 1)]
    words = {produce_hash(d, separator=True) for d in family}
    assert len(words) == 4
    assert 947574064 not in words


def test_separator_form():
    assert hash_input(("A", "B", "C", 1), separator=True) == b"\x00A\x00B\x00C\x00\x01"
    assert hash_input(("ABC", 1), separator=True) == b"\x00ABC\x00\x01"
    # count 0 encodes to nothing, but the separator is still there
    assert hash_input(("A", 0), separator=True) == b"\x00A\x00"
    assert hash_input((), separator=True) == b""
    assert produce_hash(("A", "B", "C", 1), separator=True) == hash_word(b"\x00A\x00B\x00C\x00\x01")


# ---------------------------------------------------------------- encodings
@pytest.mark.parametrize(
    "count, encoded",
    [
        (0, b""),
        (1, b"\x01"),
        (127, b"\x7f"),
        (128, b"\x80"),
        (255, b"\xff"),
        (256, b"\x01\x00"),
        (257, b"\x01\x01"),
        (65535, b"\xff\xff"),
        (65536, b"\x01\x00\x00"),
        (2**32, b"\x01\x00\x00\x00\x00"),
    ],
)
def test_count_encoding(count, encoded):
    assert encode_item(count) == encoded
    assert hash_input(("Dense_0", count), separator=False) == b"Dense_0" + encoded


def test_counts_255_and_256_hash_differently_and_as_the_guide_does():
    for n in (255, 256):
        assert produce_hash(("Dense_0", n)) == guide_produce_hash(("Dense_0", n))
    assert produce_hash(("Dense_0", 255)) != produce_hash(("Dense_0", 256))
    # one byte vs two: 256 is b'\x01\x00', so ('x', 256) is the bytes of ('x\x01', 0) + b'\x00'
    assert hash_input(("x", 256), False) == b"x\x01\x00"


def test_strings_are_utf8():
    assert encode_item("é") == b"\xc3\xa9"
    assert encode_item("層") == "層".encode()
    assert encode_item("") == b""


def test_hash_word_is_first_four_bytes_big_endian():
    data = b"Dense_0\x01"
    digest = hashlib.sha1(data).digest()
    assert hash_word(data) == int.from_bytes(digest[:4], "big")
    assert 0 <= hash_word(b"") < 2**32


@pytest.mark.parametrize("bad", [-1, -256])
def test_negative_ints_raise(bad):
    with pytest.raises(ValueError, match="negative"):
        encode_item(bad)
    with pytest.raises(ValueError):
        produce_hash(("A", bad))


@pytest.mark.parametrize("bad", [1.0, None, b"A", ("A",), True, False, object()])
def test_non_str_non_int_raise(bad):
    with pytest.raises(ValueError, match="Expected int or string"):
        encode_item(bad)
    with pytest.raises(ValueError):
        produce_hash(("A", bad, 1))


# ---------------------------------------------------------------- properties
_items = st.lists(st.one_of(st.text(max_size=12), st.integers(0, 2**70)), max_size=8)


@given(_items)
def test_matches_the_guide_function(items):
    assert produce_hash(items) == guide_produce_hash(items)
    assert produce_hash(tuple(items)) == produce_hash(items)


@given(_items)
def test_separator_is_a_zero_byte_before_each_item(items):
    assert hash_input(items, True) == b"".join(b"\x00" + encode_item(x) for x in items)
    assert len(hash_input(items, True)) == len(hash_input(items, False)) + len(items)


@settings(max_examples=25, deadline=None)
@given(_items.filter(bool), st.booleans(), st.integers(0, 2**32 - 1))
def test_matches_flax_fold_in_static(items, separator, seed):
    """rngaudit's hash word, folded in with jax, is exactly what flax.core.scope does."""
    jax = pytest.importorskip("jax")
    flax = pytest.importorskip("flax")
    from flax.core.scope import _fold_in_static

    key = jax.random.key(seed)
    saved = flax.config.flax_fix_rng_separator
    flax.config.update("flax_fix_rng_separator", separator)
    try:
        want = jax.random.key_data(_fold_in_static(key, items))
    finally:
        flax.config.update("flax_fix_rng_separator", saved)
    got = jax.random.key_data(jax.random.fold_in(key, jax.numpy.uint32(produce_hash(items, separator))))
    assert want.tolist() == got.tolist()
