"""README's option tables say what --help says (typer renders --help from these click parameters): every option of every command is in a table, with its long and
short names, its choices, and its default. A table is marked `<!-- options: COMMAND ... -->` on the line above
it; a table with a `commands` column names the commands per row (`all`: the marker's)."""

from __future__ import annotations

import re

import pytest
import typer.main
from support import REPO

from rngaudit.cli import app

README = REPO / "README.md"
COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]
MARKER = re.compile(r"<!-- options: ([\w\- ]+) -->")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def readme_rows() -> list[tuple[str, int, dict[str, str]]]:
    """(command, README line, {column: cell}) for every row of every marked option table."""
    lines = README.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        m = MARKER.fullmatch(line.strip())
        if not m:
            continue
        marked = m.group(1).split()
        header = [h.lower() for h in _cells(lines[i + 1])]
        j = i + 3
        while j < len(lines) and lines[j].startswith("|"):
            row = dict(zip(header, _cells(lines[j])))
            named = row.get("commands", "all")
            commands = marked if named == "all" else [c.strip() for c in named.split(",")]
            rows += [(c, j + 1, row) for c in commands]
            j += 1
    return rows


def _spans(cell: str) -> list[str]:
    return [s.replace("\\|", "|") for s in re.findall(r"`([^`]*)`", cell)]


def _names(cell: str) -> tuple[set[str], set[str]]:
    """The option names a README cell gives, and the choices it lists (`--format text|json`)."""
    names: set[str] = set()
    choices: set[str] = set()
    for span in _spans(cell):
        head, _, rest = span.partition(" ")
        if not head.startswith("-"):
            continue
        names.update(head.split("/"))
        if "|" in rest:
            choices.update(rest.split("|"))
    return names, choices


def _param(command, names: set[str]):
    for p in command.params:
        if names & set(p.opts + p.secondary_opts):
            return p
    return None


def _plain(text: str) -> str:
    return text.replace("`", "").lower()


def _help_default(p) -> str | None:
    """The default --help states: [default: ...] or the help text's "(default X" / "Default: X"."""
    if p.default is not None and not getattr(p, "multiple", False):
        value = getattr(p.default, "value", p.default)
        if getattr(p, "is_flag", False):
            return "on" if value else "off"
        return str(value)
    m = re.search(r"\(default:?\s+([^;),:.]+)|Default:\s+([^;),:.]+)", getattr(p, "help", None) or "")
    return (m.group(1) or m.group(2)).strip() if m else None


ROWS = readme_rows()


def test_the_tables_are_found():
    assert {c for c, _, _ in ROWS} == set(COMMANDS), "every command has its options documented in README"


@pytest.mark.parametrize("command, line, row", ROWS, ids=[f"{c}:{line}" for c, line, _ in ROWS])
def test_a_readme_row_matches_help(command, line, row):
    names, choices = _names(row["option"])
    if not names:
        return  # an argument (SPEC ...)
    p = _param(COMMANDS[command], names)
    assert p is not None, f"README:{line}: {command} has no option {sorted(names)}"
    assert names == set(p.opts + p.secondary_opts), f"README:{line}: {command} names it {p.opts + p.secondary_opts}"
    if choices and hasattr(p.type, "choices"):
        assert choices == set(p.type.choices), f"README:{line}: --help lists {p.type.choices}"
    elif choices:
        assert choices == set((p.metavar or "").split("|")), f"README:{line}: --help shows {p.metavar}"
    default = _help_default(p)
    if default is not None:
        cell = _plain(row["default"])
        flag = p.opts[0] if default == "on" else (p.secondary_opts or ["--no-?"])[0]
        assert _plain(default) in cell or (default in ("on", "off") and flag.lower() in cell), (
            f"README:{line}: {command} {p.opts[0]}: --help says the default is {default!r}, README {row['default']!r}"
        )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_help_is_in_readme(command):
    documented = set()
    for c, _, row in ROWS:
        if c == command:
            documented |= _names(row["option"])[0]
    missing = [
        p.opts[0]
        for p in COMMANDS[command].params
        if p.param_type_name == "option" and not p.hidden and not set(p.opts) & documented
    ]
    assert not missing, f"README has no row for {command} {missing}"
