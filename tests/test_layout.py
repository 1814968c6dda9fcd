"""The package's layers, checked on its import statements: each package imports only the layers below it, and
each third-party library is imported only where its job is (typer in cli/, rich in output/, Flax in refactor/).
A new import that crosses a layer fails here, with the file and line."""

from __future__ import annotations

import ast

import pytest
from support import REPO

PACKAGE = REPO / "rngaudit"

# What each part of rngaudit may import from the others (a part: a subpackage or a top-level module).
BASE = {"errors", "gcpause"}
MAY_IMPORT = {
    "errors": set(),
    "gcpause": set(),
    "usercode": {"errors"},
    "spec": BASE,
    "engine": BASE | {"spec"},
    "collision": BASE | {"spec", "engine"},
    "refactor": BASE | {"spec", "engine", "usercode", "__init__"},
    # the device process reports in the public JSON format (output/shard_json.py), nothing else of output/
    "shard": BASE | {"spec", "engine", "usercode", "output.shard_json"},
    "output": BASE | {"spec", "engine", "collision", "refactor", "shard", "__init__"},
    "api": BASE | {"spec", "engine", "collision", "refactor", "shard", "output"},
    "cli": BASE | {"spec", "refactor", "output", "api", "__init__"},
    "__init__": BASE | {"api", "collision", "engine", "refactor", "shard", "spec"},
    "__main__": {"cli"},
}
# Where each third-party library may be imported.
LIBRARY_HOMES = {
    "typer": {"cli"},
    "click": {"cli"},
    "rich": {"output"},
    "flax": {"refactor"},
    "yaml": {"spec", "refactor"},
    "jax": {"engine", "refactor", "shard"},
    "jaxlib": {"shard"},
}


def _part(parts: tuple[str, ...]) -> str:
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


PARTS = {_part(p.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("*.py")}


def _named(target: list[str]) -> list[str]:
    """`from rngaudit import __version__` imports from the package's __init__, not from a part."""
    return target if target and target[0] in PARTS else ["__init__"]


def _imports():
    """(file, line, importing part, imported rngaudit module parts or None, top-level library or None)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).parts
        package = list(rel[:-1])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    target = base + (node.module.split(".") if node.module else [])
                    names = [target] if node.module else [base + [a.name] for a in node.names]
                    for t in names:
                        yield path, node.lineno, _part(rel), _named(t), None
                elif node.module.split(".")[0] == "rngaudit":
                    rest = node.module.split(".")[1:]
                    names = [rest] if rest else [[a.name] for a in node.names]
                    for t in names:
                        yield path, node.lineno, _part(rel), _named(t), None
                else:
                    yield path, node.lineno, _part(rel), None, node.module.split(".")[0]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    top, *rest = a.name.split(".")
                    if top == "rngaudit":
                        yield path, node.lineno, _part(rel), _named(rest), None
                    else:
                        yield path, node.lineno, _part(rel), None, top


def _allowed(importer: str, target: list[str]) -> bool:
    name = target[0].removesuffix(".py")
    if name == importer or (importer in MAY_IMPORT and name in MAY_IMPORT[importer]):
        return True
    dotted = ".".join(target[:2])
    return dotted in MAY_IMPORT.get(importer, set())


def test_every_part_has_a_rule():
    assert PARTS == set(MAY_IMPORT), "give each new subpackage or module its place in MAY_IMPORT"


def test_each_part_imports_only_the_layers_below_it():
    crossings = [
        f"{path.relative_to(REPO)}:{line}: {importer} imports rngaudit.{'.'.join(target)}"
        for path, line, importer, target, _ in _imports()
        if target is not None and not _allowed(importer, target)
    ]
    assert not crossings, "\n".join(crossings)


@pytest.mark.parametrize("library", sorted(LIBRARY_HOMES))
def test_libraries_are_imported_only_where_their_job_is(library):
    strays = [
        f"{path.relative_to(REPO)}:{line}: {importer} imports {library}"
        for path, line, importer, _, top in _imports()
        if top == library and importer not in LIBRARY_HOMES[library]
    ]
    assert not strays, "\n".join(strays)


def test_the_rule_catches_a_crossing():
    assert not _allowed("engine", ["collision", "audit"])
    assert not _allowed("shard", ["output", "text_shard"])
    assert _allowed("shard", ["output", "shard_json"])
    assert not _allowed("spec", ["engine", "keys"])


def _readme_tree() -> set[str]:
    """The files README's Architecture tree names, as paths below rngaudit/."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("## Architecture", 1)[1].split("```", 2)[1]
    named: set[str] = set()
    folder = ""
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        words = line.split()
        if words[0].endswith("/"):
            folder = "" if depth <= 1 else folder
            if depth == 1:
                folder = words[0]
            continue
        files = []
        for w in words:
            if not w.rstrip(",").endswith(".py"):
                break
            files.append(w.rstrip(","))
        named.update((folder if depth >= 2 else "") + f for f in files)
    return named


def test_the_readme_tree_names_every_module():
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    modules.add("__init__.py")
    named = _readme_tree()
    assert not modules - named, f"README's Architecture tree lacks {sorted(modules - named)}"
    assert not named - modules, f"README's Architecture tree names files that are gone: {sorted(named - modules)}"
