"""The golden corpus: every command, in every format, on every fixture and on the generated specs, run
in-process through the CLI with the working directory at a copy of the corpus (so reports name files
by relative paths). Each case records its exit code and the SHA-256 of its stdout and stderr.

    python3 tests/golden/cases.py --write        # (re)record tests/golden/manifest.json
    python3 tests/golden/cases.py --dump DIR     # write every case's full output under DIR, to compare
    python3 tests/golden/cases.py --check [-k TEXT]   # compare with the manifest, list what differs

tests/test_golden.py replays the cases and compares them with the manifest.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MANIFEST = os.path.join(HERE, "manifest.json")

DERIVE = (("text",), ("json",), ("jsonl",), ("github", "--strict"), ("sarif", "--strict"))
COLLISIONS = (("text",), ("json",), ("github",), ("sarif",), ("json", "--no-keys"))
REPORTS = ("text", "json", "github", "sarif")
DIFF_PAIRS = (
    ("make_rng_key0", "make_rng_key1"),
    ("two_streams", "two_streams_same_seed"),
    ("jit_init", "jit_apply"),
    ("scan_split", "scan_unsplit"),
    ("vmap_params_split", "vmap_params_axis0_unsplit"),
    ("vmap_model_split_other", "vmap_model_other_unsplit"),
    ("sharp_edge", "sharp_edge_separator"),
    ("training_loop_init", "training_loop_step"),
    ("submodules", "two_submodules"),
    ("shard_map_device0", "shard_map_device1"),
)
VARIANTS = ("rename", "insert", "compact_to_setup", "jit", "remat", "ensemble")
CAPTURES = (
    ("base", "make"),
    ("guide", "model"),
    ("guide", "submodules"),
    ("guide", "batch_dense"),
    ("transformer", "make"),
    ("ensemble_mlp", "make"),
) + tuple((v, "make") for v in VARIANTS)
RNGS = "params=0,dropout=1"


def _rel(path: str) -> str:
    return os.path.relpath(path, REPO).replace(os.sep, "/")


def corpus_files() -> list[str]:
    """Every file the cases read, relative to the repository root."""
    files = [os.path.join(REPO, "rngaudit", "examples", "guide.yaml")]
    for pattern in (
        "fixtures/**/*.yaml",
        "fixtures/**/*.json",
        "fixtures/**/*.py",
        "tests/bad_specs/*.yaml",
        "tests/golden/specs/*.yaml",
        "tests/golden/models/*.py",
    ):
        files += glob.glob(os.path.join(REPO, pattern), recursive=True)
    return sorted(_rel(f) for f in files)


def cases() -> list[tuple[str, list[str]]]:
    """(case id, command-line arguments), in the order they run (captures write keys files later cases read)."""
    files = corpus_files()
    specs = [f for f in files if f.endswith(".yaml") and not f.startswith("tests/bad_specs/")]
    out: list[tuple[str, list[str]]] = []
    for s in specs:
        for fmt, *extra in DERIVE:
            out.append((f"derive {s} {fmt} {' '.join(extra)}".rstrip(), ["derive", s, "-f", fmt, *extra]))
        for fmt, *extra in COLLISIONS:
            out.append((f"collisions {s} {fmt} {' '.join(extra)}".rstrip(), ["collisions", s, "-f", fmt, *extra]))
    for s in (f for f in files if f.startswith("tests/bad_specs/")):
        out.append((f"derive {s}", ["derive", s]))
        out.append((f"collisions {s} github", ["collisions", s, "-f", "github"]))
    for j in (f for f in files if f.startswith("fixtures/collisions/") and f.endswith(".json")):
        for fmt in REPORTS:
            out.append((f"collisions {j} {fmt}", ["collisions", j, "-f", fmt]))
        out.append((f"collisions {j} json separator", ["collisions", j, "-f", "json", "--fix-rng-separator"]))
    every = sorted(f for f in files if f.startswith("fixtures/collisions/"))
    for fmt in REPORTS:
        out.append((f"collisions fixtures/collisions/* {fmt}", ["collisions", *every, "-f", fmt]))
    pairs = [(f"fixtures/guide/{a}.yaml", f"fixtures/guide/{b}.yaml") for a, b in DIFF_PAIRS]
    generated = sorted(f for f in specs if f.startswith("tests/golden/specs/"))
    pairs += [(generated[i], generated[i + 1]) for i in range(0, len(generated) - 1, 6)]
    for a, b in pairs:
        for fmt in REPORTS:
            out.append((f"diff {a} {b} {fmt}", ["diff", a, b, "-f", fmt]))
    for model, factory in CAPTURES:
        name = f"out/{model}_{factory}"
        target = f"tests/golden/models/{model}.py:{factory}"
        out.append(
            (f"capture {target}", ["capture", target, "--rngs", RNGS, "--keys", f"{name}.json", "-o", f"{name}.yaml"])
        )
        out.append((f"capture {target} json", ["capture", target, "--rngs", RNGS, "-f", "json"]))
        out.append((f"verify {name}", ["verify", f"{name}.yaml", "--against", f"{name}.json", "-f", "json"]))
    for variant in VARIANTS:
        for fmt in REPORTS:
            out.append(
                (f"diff base {variant} {fmt}", ["diff", "out/base_make.json", f"out/{variant}_make.json", "-f", fmt])
            )
    out.append(("diff spec keys", ["diff", "out/base_make.yaml", "out/rename_make.json", "-f", "json"]))
    out.append(
        (
            "verify against target",
            ["verify", "out/guide_model.yaml", "--against", "tests/golden/models/guide.py:model", "--rngs", RNGS],
        )
    )
    out.append(("verify mismatch", ["verify", "out/base_make.yaml", "--against", "out/insert_make.json"]))
    for fmt in ("text", "json"):
        out.append(
            (f"shard-check spec {fmt}", ["shard-check", "fixtures/shard/forks.yaml", "--devices", "2", "-f", fmt])
        )
        out.append(
            (
                f"shard-check fn {fmt}",
                ["shard-check", "--fn", "fixtures/shard/guide_forward.py:forward", "--devices", "4", "-f", fmt],
            )
        )
    for command in ("", "derive", "collisions", "shard-check", "capture", "verify", "diff"):
        out.append((f"help {command}".rstrip(), [command, "--help"] if command else ["--help"]))
    out += [
        ("usage no spec", ["derive"]),
        ("usage bad format", ["derive", "rngaudit/examples/guide.yaml", "--format", "nope"]),
        ("usage fail-on", ["collisions", "--fail-on", "hash-words", "rngaudit/examples/guide.yaml"]),
        ("usage no such file", ["derive", "nosuch.yaml"]),
        ("usage stream filter", ["derive", "rngaudit/examples/guide.yaml", "--stream", "nosuch"]),
        ("usage limit", ["derive", "rngaudit/examples/guide.yaml", "--limit", "2", "--path", "Dense*", "-f", "json"]),
        ("usage output dir", ["derive", "rngaudit/examples/guide.yaml", "-o", "fixtures"]),
        ("usage draw", ["derive", "rngaudit/examples/guide.yaml", "--draw", "normal:2,x"]),
        ("usage shard no input", ["shard-check"]),
        ("usage shard mesh", ["shard-check", "--fn", "fixtures/shard/guide_forward.py:forward", "--mesh", "d=0"]),
        ("usage capture target", ["capture", "nosuch"]),
        (
            "usage verify json opts",
            ["verify", "rngaudit/examples/guide.yaml", "--against", "x.json", "--rngs", "params=0"],
        ),
        ("version", ["--version"]),
    ]
    return out


@contextmanager
def corpus_dir():
    """A temporary copy of the corpus, the working directory while the cases run."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="rngaudit-golden-") as tmp:
        for f in corpus_files():
            os.makedirs(os.path.join(tmp, os.path.dirname(f)), exist_ok=True)
            shutil.copyfile(os.path.join(REPO, f), os.path.join(tmp, f))
        os.makedirs(os.path.join(tmp, "out"))
        os.chdir(tmp)
        try:
            yield tmp
        finally:
            os.chdir(old)


def generated(case: str) -> bool:
    """Whether a case reads a generated spec (the long part of the corpus)."""
    return "tests/golden/specs/" in case


def run_all(dump: str | None = None, select=lambda case: True):
    """Yield (case id, args, result) for every selected case, each run through the CLI in this process
    (cases that only read files written by earlier cases must be selected with them)."""
    from typer.testing import CliRunner

    from rngaudit.cli import app

    env = {"NO_COLOR": "1", "COLUMNS": "400", "RNGAUDIT_DEBUG": None, "TERM": "dumb"}
    with corpus_dir():
        for case, args in cases():
            if not select(case):
                continue
            r = CliRunner().invoke(app, args, env=env)
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                raise RuntimeError(f"{case}: {r.exception!r}") from r.exception
            stdout, stderr = r.stdout_bytes, r.stderr_bytes
            if dump:
                base = os.path.join(dump, hashlib.sha1(case.encode()).hexdigest()[:16])
                os.makedirs(dump, exist_ok=True)
                with open(base + ".txt", "wb") as f:
                    f.write(f"{case}\nexit {r.exit_code}\n--- stdout\n".encode() + stdout + b"\n--- stderr\n" + stderr)
            yield (
                case,
                args,
                {
                    "exit": r.exit_code,
                    "stdout": hashlib.sha256(stdout).hexdigest(),
                    "stderr": hashlib.sha256(stderr).hexdigest(),
                },
            )


def load_manifest() -> dict:
    with open(MANIFEST, encoding="utf-8") as f:
        return json.load(f)


def differences(results, manifest: dict) -> list[str]:
    """One line per case whose exit code, stdout or stderr differs from the manifest."""
    out = []
    for case, args, result in results:
        want = manifest.get(case)
        if want is None:
            out.append(f"{case}: not in the manifest")
            continue
        what = [k for k in ("exit", "stdout", "stderr") if want[k] != result[k]]
        if what:
            exit_note = f" (exit {want['exit']} -> {result['exit']})" if "exit" in what else ""
            out.append(f"{case}: {', '.join(what)} differ{exit_note}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("-k", default="", help="only cases whose id contains this")
    ap.add_argument("--dump")
    a = ap.parse_args()
    sys.path.insert(0, REPO)
    results = list(run_all(a.dump, lambda case: a.k in case or case.split()[0] in ("capture", "verify")))
    if a.check:
        bad = differences(results, load_manifest())
        print("\n".join(bad))
        print(f"{len(results)} cases, {len(bad)} differ")
        sys.exit(1 if bad else 0)
    manifest = {case: dict(result, args=args) for case, args, result in results}
    if a.write:
        with open(MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True, ensure_ascii=False)
            f.write("\n")
    print(f"{len(manifest)} cases")


if __name__ == "__main__":
    main()
