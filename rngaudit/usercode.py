"""The user's code named on the command line, `FILE.py:NAME` or `package.module:NAME` (capture's TARGET,
shard-check's --fn): parsed, imported and resolved. Whatever the user's import raises comes back as a
UserCodeError that names the option, the reference and the first line of the exception."""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import UsageError, UserCodeError


def _dotted(text: str) -> bool:
    """Dotted Python identifiers (`pkg.mod`, `Class.method`), as Python spells them: Unicode letters too."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


_LISTED = 12  # names listed when the attribute is missing


@dataclass(frozen=True)
class CodeRef:
    """`FILE.py:ATTR` (file set) or `package.module:ATTR` (module set); ATTR may be dotted (`Class.method`)."""

    text: str
    file: str | None
    module: str | None
    attr: str


def quiet_stdout():
    """What the user's code prints goes to stderr while it runs: stdout is the report's (a spec, JSON)."""
    import contextlib

    return contextlib.redirect_stdout(sys.stderr)


def first_line(e: BaseException) -> str:
    """The exception's message, first line only (at most 300 characters), or its class's name. A first line that
    only announces what follows ("... given the mesh:") takes the next line too."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:
        line = f"{line} {lines[1]}"
    return line[:300]


def parse_code_ref(text: str, option: str, kind: str, example: str) -> CodeRef:
    """TEXT as a reference; OPTION names it in errors (`TARGET`, `--fn`), KIND is what ATTR is (`FACTORY`),
    EXAMPLE an example ATTR."""
    where, colon, attr = text.rpartition(":")
    usage = f"write FILE.py:{kind} or package.module:{kind}, e.g. model.py:{example}"
    if not colon or not where or not _dotted(attr):
        raise UsageError(f"{option} {text!r}: {usage}")
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not os.path.isfile(where):
            raise UserCodeError(f"{option} {text}: no such file {where!r}")
        return CodeRef(text, where, None, attr)
    if not _dotted(where):
        raise UsageError(f"{option} {text!r}: {where!r} is neither a .py file nor a module name; {usage}")
    return CodeRef(text, None, where, attr)


def _import_file(ref: CodeRef, option: str, reuse: bool = False):
    assert ref.file is not None
    path = os.path.abspath(ref.file)
    if not os.path.isfile(path):
        raise UserCodeError(f"{option} {ref.text}: no such file {ref.file!r}")
    name = "_rngaudit_user_" + re.sub(r"\W", "_", path)  # the whole path: two model.py files stay apart
    stat = os.stat(path)
    loaded = sys.modules.get(name)
    if reuse and _FILES is not None and path in _FILES:
        return _FILES[path]  # (capture's --step in the TARGET's file: the module the factory came from)
    unchanged = loaded is not None and getattr(loaded, "_rngaudit_stat", None) == (stat.st_mtime_ns, stat.st_size)
    if reuse and _FILES is None and unchanged:
        return loaded  # the same file named twice (shard-check's --fn and --args) is one module, imported once
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{option} {ref.text}: cannot import {ref.file!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # flax modules are dataclasses, which look their module up while the file runs
    directory = os.path.dirname(path)
    sys.path.insert(0, directory)  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        if sys.path and sys.path[0] == directory:
            sys.path.pop(0)
    module._rngaudit_stat = (stat.st_mtime_ns, stat.st_size)  # type: ignore[attr-defined]
    if _FILES is not None:
        _FILES[path] = module
    return module


_FILES: dict[str, types.ModuleType] | None = None  # while one_module_per_file runs: each file's latest module


class _SameFile(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import (`from model import MLP`) of a file imported as the user's code (`model.py:make`) gives that
    module, not a second copy of it with classes of its own (`isinstance(model, MLP)` false in a --step file)."""

    def __init__(self) -> None:
        self.aliases: dict[str, types.ModuleType] = {}

    def find_spec(self, fullname, path, target=None):
        if not _FILES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        module = _FILES.get(os.path.abspath(spec.origin)) if isinstance(spec.origin, str) else None
        if module is None or spec.submodule_search_locations is not None:
            return spec  # (found as the import system would: nothing of the user's code named on the command line)
        self.aliases[fullname] = module
        return importlib.util.spec_from_loader(fullname, self, origin=spec.origin)

    def create_module(self, spec):
        module = self.aliases[spec.name]
        self.saved = module.__spec__  # (the import system sets __spec__ on the module it is given)
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.saved  # (the module ran once, as the user's code: nothing to run again)


@contextlib.contextmanager
def one_module_per_file() -> Iterator[None]:
    """While it runs, a file imported as the user's code is one module: loading it again with `reuse` gives the
    module imported last (capture's --step in the TARGET's file), and an import of it by its own name from another
    file (`from model import MLP` in train.py) gives that module too."""
    global _FILES
    if _FILES is not None:
        yield
        return
    _FILES = {}
    finder = _SameFile()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name, module in finder.aliases.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        _FILES = None


_PROTECTED = frozenset(
    {"__main__", "rngaudit", "flax", "jax", "jaxlib", "numpy", "ml_dtypes", "optax", "orbax", "chex"}
)


def forget_neighbours(*refs: CodeRef) -> list[str]:
    """Drop from sys.modules the user's own modules that REFS' code may import: those in a named file's directory
    tree, those its imports would find there (a `layers` imported earlier from another directory), and a named
    package's modules; never an installed package's (under site-packages or Python's prefix) nor rngaudit's,
    Flax's or JAX's. They are then imported afresh, under whatever capture installed first: a transform applied
    when a neighbour module is imported (`ScanBlocks = nn.scan(nn.remat(Block), ...)` in layers.py) is then made
    with capture's hooks. Returns the names dropped."""
    installed = tuple(
        os.path.join(os.path.abspath(p), "") for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *_site_dirs()} if p
    )
    dirs: list[str] = []
    tops: set[str] = set()
    for ref in refs:
        if ref.file is not None:
            d = os.path.dirname(os.path.abspath(ref.file))
            dirs.append(os.path.join(d, ""))
            try:
                entries = os.listdir(d)
            except OSError:
                entries = []
            tops |= {e.removesuffix(".py") for e in entries if e.endswith(".py") or "." not in e}
        elif ref.module is not None:
            tops.add(ref.module.split(".")[0])
    dropped = []
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        if top in _PROTECTED or name.startswith("_rngaudit_user_"):
            continue
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue  # (built-in, frozen, or a namespace package: nothing of the user's runs again)
        path = os.path.abspath(file)
        if path.startswith(installed):
            continue
        if top in tops or path.startswith(tuple(dirs)):
            del sys.modules[name]
            dropped.append(name)
    return dropped


def _site_dirs() -> list[str]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    out = [paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        out += site.getsitepackages()
    except AttributeError:  # (an old virtualenv's site module)
        pass
    user = getattr(site, "getusersitepackages", None)
    if user is not None:
        out.append(user())
    return [p for p in out if p]


def _raised(ref: CodeRef, option: str, where: str, e: BaseException) -> UserCodeError:
    if isinstance(e, SyntaxError):
        at = f"{e.filename}:{e.lineno}" + (f":{e.offset}" if e.offset else "") if e.lineno else e.filename or where
        return UserCodeError(f"{option} {ref.text}: importing {where} raised SyntaxError at {at}: {e.msg}")
    missing = e.name if isinstance(e, ModuleNotFoundError) else None
    if ref.module is not None and missing and (ref.module == missing or ref.module.startswith(missing + ".")):
        return UserCodeError(
            f"{option} {ref.text}: no module named {missing!r} (run from the directory that holds it, or install it)"
        )
    return UserCodeError(f"{option} {ref.text}: importing {where} raised {type(e).__name__}: {first_line(e)}")


def _defined(module) -> list[str]:
    """The public functions and classes MODULE defines itself (not those it imports)."""
    return sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and (inspect.isfunction(v) or inspect.isclass(v))
        and getattr(v, "__module__", None) == module.__name__
    )


def load(ref: CodeRef, option: str, reuse: bool = False):
    """Import REF's file or module and return its attribute. A file is imported afresh on each call (a capture
    must see the classes it defines made under its hooks), or with `reuse` once while it is unchanged."""
    where = ref.file if ref.file is not None else ref.module
    assert where is not None  # (parse_code_ref gives a file or a module)
    try:
        module = _import_file(ref, option, reuse) if ref.file is not None else importlib.import_module(where)
    except UserCodeError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the user's import raises is reported
        raise _raised(ref, option, where, e) from None
    obj = module
    for part in ref.attr.split("."):
        if not hasattr(obj, part):
            names = _defined(module)
            listed = ", ".join(names[:_LISTED]) + (", ..." if len(names) > _LISTED else "")
            defines = f"; it defines {listed}" if names else "; it defines no public function or class"
            raise UserCodeError(f"{option} {ref.text}: {where} has no {ref.attr!r}{defines}")
        obj = getattr(obj, part)
    return obj


def load_callable(ref: CodeRef, option: str, reuse: bool = False):
    """`load`, checked to give something callable (a function, a class, a callable object)."""
    obj = load(ref, option, reuse)
    if not callable(obj):
        raise UserCodeError(f"{option} {ref.text}: {ref.attr} is a {type(obj).__name__}, not a function")
    return obj
