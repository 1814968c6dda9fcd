"""rngaudit.jsonsrc: strict JSON reading, and the line:col of any entry."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rngaudit.errors import InputError
from rngaudit.spec.json_source import load_json, parse_json

SCALARS = st.one_of(st.integers(-(10**6), 10**6), st.text(max_size=4), st.booleans(), st.none())
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=20,
)


def pointers(value, prefix=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield prefix + (k,), v
            yield from pointers(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield prefix + (i,), v
            yield from pointers(v, prefix + (i,))


def offset(text: str, line: int, col: int) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[: line - 1]) + col - 1


@given(VALUES, st.sampled_from([None, 0, 2]), st.booleans())
@settings(max_examples=200, deadline=None)
def test_every_entry_is_located_at_its_key_or_value(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    doc = parse_json(text, "v.json")
    assert doc.value == value
    wanted = dict(pointers(value))
    where = doc.locate(wanted)
    assert set(where) == set(wanted)
    for p, loc in where.items():
        assert loc.file == "v.json"
        at = text[offset(text, loc.line, loc.col) :]
        if isinstance(p[-1], str):  # an object member: the location is its key
            assert at.startswith(json.dumps(p[-1], ensure_ascii=ascii_only))
        else:  # a list element: the location is the value
            assert at.startswith(json.dumps(wanted[p], indent=indent, ensure_ascii=ascii_only)[:1])


def test_locate_finds_a_subset_and_ignores_missing_pointers():
    doc = parse_json('{"a": [10, {"b": 2}], "c": 3}', "x.json")
    where = doc.locate([("a", 1, "b"), ("nope",), ("a", 7)])
    assert {p: (l.line, l.col) for p, l in where.items()} == {("a", 1, "b"): (1, 13)}


@pytest.mark.parametrize(
    "text, message, where",
    [
        ('{"a": [1, 2,]}', "invalid JSON: Expecting value", (1, 13)),
        ('{\n  "a": 1\n  "b": 2\n}', "invalid JSON: Expecting ',' delimiter", (3, 3)),
        ("[1] [2]", "invalid JSON: Extra data", (1, 5)),
        ("", "the file is empty", (1, 1)),
        ('{"a": {"x": 1, "x": 2}}', "duplicate key 'x'", (1, 16)),
        ('{"a": 1,\n "b": [{"a": 1}],\n "a": 2}', "duplicate key 'a'", (3, 2)),
    ],
)
def test_errors_carry_line_and_column(text, message, where):
    with pytest.raises(InputError) as e:
        parse_json(text, "bad.json")
    assert message in e.value.message
    assert (e.value.location.file, e.value.location.line, e.value.location.col) == ("bad.json", *where)


@pytest.mark.parametrize(
    "text, message, where",
    [
        ('{"a": "x', "invalid JSON: Unterminated string", (1, 7)),
        ('{"a": "x\x01"}', "invalid JSON: Invalid control character", (1, 9)),
    ],
)
def test_a_json_message_ends_where_its_position_was_cut(text, message, where):
    """The json module's message reads on into the position ("Unterminated string starting at: line 1 ..."); the
    position is the error's line:col, and the message no longer trails off ("... starting at")."""
    with pytest.raises(InputError) as e:
        parse_json(text, "bad.json")
    assert e.value.message == message
    assert (e.value.location.line, e.value.location.col) == where


def test_file_errors(tmp_path):
    p = tmp_path / "x.json"
    p.write_bytes(b'["a",\n "\xff"]')
    with pytest.raises(InputError) as e:
        load_json(str(p))
    assert "not UTF-8 (byte 0xff)" in e.value.message and (e.value.location.line, e.value.location.col) == (2, 3)
    p.write_bytes(b'\xef\xbb\xbf["a"]')  # a BOM is not part of the text
    assert load_json(str(p)).value == ["a"]
    with pytest.raises(InputError, match="no such file"):
        load_json(str(tmp_path / "missing.json"))
    with pytest.raises(InputError, match="is a directory"):
        load_json(str(tmp_path))
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputError, match="nested too deeply"):
        load_json(str(p))


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from(["a", '"', "\\", "[", "]", "{", "}", ",", ":", " ", "é", "\n"])),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    JSON_VALUES,
    st.sampled_from([None, 0, 2]),
    st.sampled_from([None, (",", ":"), (" , ", " : ")]),
    st.sampled_from(["", " ", ",1]", "\n}"]),
)
def test_skip_ends_where_the_value_does(value, indent, separators, after):
    """jsonsrc skips a flat value (a params tree's module) with a regex instead of decoding it: the end
    it finds is raw_decode's on any JSON value, however written, deeper ones included."""
    import json

    from rngaudit.spec.json_source import _skip

    text = json.dumps(value, indent=indent, separators=separators, ensure_ascii=False) + after
    assert _skip(text, 0) == json.JSONDecoder().raw_decode(text, 0)[1]


@given(
    st.lists(VALUES, min_size=60, max_size=400), st.sets(st.integers(0, 450), max_size=8), st.sampled_from([None, 0, 2])
)
@settings(max_examples=60, deadline=None)
def test_long_lists_are_located_in_jumps(entries, wanted_indices, indent):
    """The walk over a long list (a million module paths) jumps over runs of elements it does not
    want, and over sublists too: every entry, and every entry below it, is found where a walk that
    steps element by element finds it."""
    import rngaudit.spec.json_source as jsonsrc

    value = [entries, {"x": entries}]
    text = json.dumps(value, indent=indent)
    # entries (and what is below them) at the wanted indices of both copies; indices past the end too
    wanted = [
        p
        for p, _ in pointers(value)
        if (p[0] == 0 and p[1:2] and p[1] in wanted_indices) or (p[0] == 1 and p[2:3] and p[2] in wanted_indices)
    ]
    wanted += [(0, i) for i in wanted_indices] + [(1, "x", i) for i in wanted_indices]
    jumped = parse_json(text, "v.json").locate(wanted)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jsonsrc, "JUMP", 10**9)
        stepped = parse_json(text, "v.json").locate(wanted)
    assert jumped == stepped
    assert set(jumped) == set(wanted) & set(dict(pointers(value)))


NAMES = st.text(alphabet=st.sampled_from(["a", "b", '"', "\\", "[", "]", ",", " ", "/", "é"]), max_size=6)


@given(
    st.lists(NAMES | st.lists(NAMES, max_size=3), min_size=64, max_size=200),
    st.sampled_from([None, 0, 2]),
    st.sampled_from([None, (",", ":"), (" , ", " : ")]),
)
@example(['a",[],'] + [","] * 100, None, None)  # without the guard: `"a\"` read as a string, out of step
@settings(max_examples=150, deadline=None)
def test_the_plain_string_jump_agrees_with_the_exact_one(entries, indent, separators):
    """A list of module paths (strings, or lists of names) is jumped over by a regex that takes every
    '"' for a string's end, guarded by the absence of a backslash: from every element it lands where
    the exact element regex does, with quotes, backslashes, brackets and commas inside the names."""
    import rngaudit.spec.json_source as jsonsrc

    text = json.dumps(entries, indent=indent, separators=separators, ensure_ascii=False)
    starts = []
    pos = jsonsrc._WS.match(text, 1).end()
    for _ in entries:
        starts.append(pos)
        pos = jsonsrc._SEP.match(text, jsonsrc._skip(text, pos)).end()
    for pos in starts:
        exact = jsonsrc._JUMP.match(text, pos)
        assert jsonsrc._jump(text, pos) == (None if exact is None else exact.end())
    # and the walk finds every entry where a step-by-step walk does
    wanted = [(k,) for k in range(0, len(entries), 7)]
    jumped = parse_json(text, "p.json").locate(wanted)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jsonsrc, "JUMP", 10**9)
        assert jumped == parse_json(text, "p.json").locate(wanted)
