"""Write the generated part of the golden corpus: specs drawn (reproducibly) from the property tests'
random-model strategies. Run once, before a redesign; the files, not this script, are the corpus.

    python3 tests/golden/generate_specs.py [--plain 150] [--transformed 150]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from engine.test_replay_property import specs, transform_specs
from hypothesis import HealthCheck, Phase, given, settings


def draw(strategy, n: int) -> list[str]:
    out: list[str] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(text: str) -> None:
        if text not in out:
            out.append(text)

    collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", type=int, default=150)
    ap.add_argument("--transformed", type=int, default=150)
    a = ap.parse_args()
    folder = os.path.join(HERE, "specs")
    os.makedirs(folder, exist_ok=True)
    for prefix, strategy, n in (("plain", specs(), a.plain), ("transformed", transform_specs(), a.transformed)):
        for i, text in enumerate(draw(strategy, n)):
            with open(os.path.join(folder, f"{prefix}_{i:03d}.yaml"), "w", encoding="utf-8") as f:
                f.write(text)


if __name__ == "__main__":
    main()
