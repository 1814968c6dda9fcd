"""Flax's byte encoding of a module path and call count, and the SHA-1 word folded into the key. Stdlib only."""

from __future__ import annotations

import hashlib


def encode_item(x: str | int) -> bytes:
    """Bytes Flax feeds SHA-1 for one item: UTF-8 for str, minimal big-endian for int (0 -> b'')."""
    # mirrors flax/core/scope.py _fold_in_static
    if isinstance(x, str):
        return x.encode("utf-8")
    if isinstance(x, int) and not isinstance(x, bool):
        if x < 0:
            raise ValueError(f"Flax cannot hash a negative int: {x}")
        return x.to_bytes((x.bit_length() + 7) // 8, byteorder="big")
    raise ValueError(f"Expected int or string, got: {x!r}")


def hash_input(items, separator: bool) -> bytes:
    """The exact bytes hashed for `items`; with the separator fix, b'\\x00' precedes every item."""
    if separator:
        return b"".join(b"\x00" + encode_item(x) for x in items)
    return b"".join(encode_item(x) for x in items)


def hash_word(data: bytes) -> int:
    """The first 4 bytes of SHA-1(data), big-endian: the uint32 that fold_in receives."""
    return int.from_bytes(hashlib.sha1(data).digest()[:4], "big")


def produce_hash(items, separator: bool = False) -> int:
    """The guide's `produce_hash`, with Flax's optional separator."""
    return hash_word(hash_input(items, separator))
