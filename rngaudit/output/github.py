"""Findings as GitHub Actions workflow commands (`::error file=F,line=L,col=C,title=T::message`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .findings import ERROR, NOTE, WARNING, Finding, report_path, report_paths

_COMMAND = {ERROR: "error", WARNING: "warning", NOTE: "notice"}


def _data(text: str) -> str:
    """Escape a message as the runner reads it back (mirrors @actions/core `escapeData`)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    """Escape a property value (mirrors @actions/core `escapeProperty`)."""
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(f: Finding, paths: Callable[[str], str] = report_path) -> str:
    props = []
    if f.location is not None:
        props += [f"file={_property(paths(f.location.file))}", f"line={f.location.line}", f"col={f.location.col}"]
    props.append(f"title={_property('rngaudit ' + f.rule)}")
    return f"::{_COMMAND[f.level]} {','.join(props)}::{_data(f.message)}"


def render_github(findings: Sequence[Finding]) -> str:
    """One annotation per line; nothing at all for a clean run."""
    paths = report_paths()
    return "".join(annotation(f, paths) + "\n" for f in findings)
