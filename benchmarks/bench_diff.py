"""End to end, as a user runs it: `rngaudit diff old.yaml new.yaml` on large refactors, in a fresh process each
(interpreter start, both specs read and derived, modules paired, every explanation and fix checked by re-deriving
NEW, the report written to a file), against `rngaudit derive new.yaml` of the same new spec run the same way (the
baseline: what reading and deriving one side costs). Prints wall time, the ratio to derive and each run's peak
memory (its own maximum resident set).

The model: `--blocks` Block modules, each a Dense (features 4, 5, 6 in turn) and a Dropout. The refactors:

  insert-first   a Block inserted before the others: every later Block shifts its auto-name index (one move per
                 block, one fix shared by all, re-derived once)
  append         a Block added after the others: nothing moves
  rename-half    the first half of the blocks given explicit names (one rename per block, each fix re-derived)
  wrap-remat     every Block wrapped in nn.remat (class CheckpointBlock: every path moves)

    python3 benchmarks/bench_diff.py [--blocks 2000] [--runs 3] [--skip rename-half,...]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_output import run  # (best wall time and peak RSS of `python -m rngaudit ARGS`, fresh processes)

HEAD = "rngaudit: 1\nrngs: {params: 0, dropout: 1}\nmodel:\n  class: Model\n  body:\n"


def block(i: int, *, name: str | None = None, remat: bool = False, features: int | None = None) -> str:
    body = f"[{{Dense: {{features: {features or 4 + i % 3}}}}}, {{Dropout: {{rate: 0.1, deterministic: false}}}}]"
    module = f"{{class: Block, {f'name: {name}, ' if name else ''}body: {body}}}"
    return f"    - remat: {{module: {module}}}\n" if remat else f"    - module: {module}\n"


def spec(blocks: int, refactor: str | None) -> str:
    body = []
    if refactor == "insert-first":
        body.append(block(0, features=7))
    for i in range(blocks):
        named = refactor == "rename-half" and i < blocks // 2
        body.append(block(i, name=f"layer{i}" if named else None, remat=refactor == "wrap-remat"))
    if refactor == "append":
        body.append(block(0, features=7))
    return HEAD + "".join(body)


REFACTORS = ("insert-first", "append", "rename-half", "wrap-remat")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", default="", help="refactors to leave out, comma-separated")
    a = ap.parse_args()
    skip = {s for s in a.skip.split(",") if s}
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "old.yaml")
        with open(old, "w") as f:
            f.write(spec(a.blocks, None))
        print(f"{a.blocks} blocks, each a Dense and a Dropout (best of {a.runs}, fresh process each)")
        print(f"{'refactor':<14} {'derive NEW':>11} {'diff':>9} {'ratio':>7} {'peak RSS':>9}")
        for refactor in REFACTORS:
            if refactor in skip:
                continue
            new = os.path.join(tmp, f"{refactor}.yaml")
            with open(new, "w") as f:
                f.write(spec(a.blocks, refactor))
            base, _ = run(["derive", new, "-o", os.path.join(tmp, "derive.txt")], a.runs)
            took, peak = run(["diff", old, new, "-o", os.path.join(tmp, "diff.txt")], a.runs)
            print(f"{refactor:<14} {base:>10.2f}s {took:>8.2f}s {took / base:>6.2f}x {peak:>7.0f}MB")


if __name__ == "__main__":
    main()
