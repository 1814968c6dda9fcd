"""Every command's output on the golden corpus (tests/golden) is byte for byte what it was when the corpus was
recorded, before the redesign of issue 14: exit code, stdout and stderr of each case. A deliberate change of
output is recorded again with `python3 tests/golden/cases.py --write` (and said in the commit)."""

from __future__ import annotations

import pytest
from golden.cases import differences, generated, load_manifest, run_all


def _check(select) -> None:
    manifest = load_manifest()
    results = list(run_all(select=select))
    assert results, "no golden case ran"
    bad = differences(results, manifest)
    assert not bad, f"{len(bad)} of {len(results)} golden cases differ:\n" + "\n".join(bad[:40])


def test_fixtures_help_and_errors_are_unchanged():
    _check(lambda case: not generated(case))


@pytest.mark.slow
def test_generated_specs_are_unchanged():
    _check(generated)
