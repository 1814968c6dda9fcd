"""JSON as every report writes it (rngaudit.output.json_text): byte for byte the json module's
`dumps(indent=2, sort_keys=True, ensure_ascii=False)`, for every value the reports hold and those they might."""

from __future__ import annotations

import collections
import enum
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from rngaudit.output.formats import dumps
from rngaudit.output.json_text import indented


def _json(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


_leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=5), inner, max_size=4)
        | st.dictionaries(st.integers(), inner, max_size=3)  # (keys json can sort: one type a dict)
        | st.dictionaries(st.booleans(), inner, max_size=2)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_values)
def test_indented_is_the_json_modules_layout(value):
    assert indented(value) == _json(value)
    assert dumps({"doc": value}) == _json({"doc": value}) + "\n"


class Level(str, enum.Enum):
    error = "error"


class Rank(enum.IntEnum):
    first = 1


def test_subclasses_and_floats_as_json_writes_them():
    value = {
        "ordered": collections.OrderedDict([("b", 1), ("a", [Level.error, Rank.first])]),
        "floats": [1.5, -0.0, 1e300, math.inf, -math.inf],
        "nested": [[], {}, [[1, [2, {"x": None}]]], ("t", True)],
        "unicode": 'é\u2028\x00"\\',
    }
    assert indented(value) == _json(value)
    nan = indented([math.nan])
    assert nan == "[\n  NaN\n]" == _json([math.nan])


def test_a_large_document_is_laid_out_as_json_does():
    # the shape of a diff's entries: many small dicts of scalars and short int lists
    doc = {
        "entries": [{"key": [i, i * 7 % 2**32], "path": f"Block_{i}", "status": "gone", "why": []} for i in range(2000)]
    }
    assert dumps(doc) == _json(doc) + "\n"
