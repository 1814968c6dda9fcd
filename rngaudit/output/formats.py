"""The report formats every command writes, each a class behind one small interface, picked by the Format
enum: `text` for people, `json` (the command's versioned JSON), `github` (workflow annotations) and `sarif`
(SARIF 2.1.0 for code scanning); `derive` also streams `jsonl` (rngaudit.output.derive_json)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from rich.console import Console

    from .findings import Finding


class Format(str, enum.Enum):
    """Report formats every command takes."""

    text = "text"
    json = "json"
    github = "github"
    sarif = "sarif"


class DeriveFormat(str, enum.Enum):
    """derive's formats: every command's, and `jsonl` (one record a line, streamed in flat memory)."""

    text = "text"
    json = "json"
    github = "github"
    sarif = "sarif"
    jsonl = "jsonl"


class Report(NamedTuple):
    """What a format needs of one command's run, each part made only when a format asks for it."""

    command: str
    json_doc: Callable[[], dict[str, Any]]
    render_text: Callable[[Console], None]
    findings: Callable[[], Sequence[Finding]]  # (its rules: output.findings.RULES[command])
    suppressed: Callable[[], Sequence[Finding]] = tuple  # findings left out (SARIF lists them as suppressed)


def dumps(doc: dict[str, Any]) -> str:
    """JSON as every report writes it: sorted keys, indented, UTF-8 text, one trailing newline."""
    from .json_text import dumps  # (not on --help's path)

    return dumps(doc)


class TextFormat:
    def __init__(self, to_terminal: bool | None = None):
        self.to_terminal = to_terminal

    def render(self, report: Report) -> str:
        from .console import console_text

        return console_text(report.render_text, to_terminal=self.to_terminal)


class JsonFormat:
    def render(self, report: Report) -> str:
        return dumps(report.json_doc())


class GithubFormat:
    def render(self, report: Report) -> str:
        from .github import render_github

        return render_github(report.findings())


class SarifFormat:
    def render(self, report: Report) -> str:
        from .findings import RULES
        from .sarif import to_sarif

        findings = [*report.findings(), *report.suppressed()]
        return dumps(to_sarif(report.command, findings, RULES[report.command]))


def formatter(fmt: str, to_terminal: bool | None = None) -> TextFormat | JsonFormat | GithubFormat | SarifFormat:
    """The format named `fmt` (a Format value). `to_terminal` (text only): None, whether stdout is one."""
    kind = getattr(fmt, "value", fmt)
    if kind == Format.text.value:
        return TextFormat(to_terminal)
    if kind == Format.json.value:
        return JsonFormat()
    if kind == Format.github.value:
        return GithubFormat()
    if kind == Format.sarif.value:
        return SarifFormat()
    raise ValueError(f"no renderer for format {kind!r}")
