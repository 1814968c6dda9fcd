"""Findings as a SARIF 2.1.0 log, the format code-scanning tools (GitHub code scanning) read."""

from __future__ import annotations

import os
import pathlib
import urllib.parse
from collections.abc import Callable, Sequence

from .. import __version__
from ..errors import Location
from .findings import Finding, Rule, report_paths

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _uri(file: str, paths: Callable[[str], str]) -> dict:
    path = paths(file)
    if os.path.isabs(path):
        return {"uri": pathlib.Path(path).as_uri()}
    return {"uri": urllib.parse.quote(path.replace(os.sep, "/")), "uriBaseId": "%SRCROOT%"}


def _physical(loc: Location, paths: Callable[[str], str]) -> dict:
    return {
        "physicalLocation": {
            "artifactLocation": _uri(loc.file, paths),
            "region": {"startLine": max(1, loc.line), "startColumn": max(1, loc.col)},
        }
    }


def _rule_json(r: Rule) -> dict:
    return {
        "id": r.id,
        "name": r.name,
        "shortDescription": {"text": r.summary},
        "fullDescription": {"text": r.help},
        "help": {"text": r.help},
        "defaultConfiguration": {"level": "error"},
    }


def to_sarif(command: str, findings: Sequence[Finding], rules: Sequence[Rule]) -> dict:
    """One run of `rngaudit COMMAND`: its rules and one result per finding (no results for a clean run); a
    suppressed finding (an ignore comment, the baseline) is a result with its `suppressions`."""
    rules = list(rules)
    index = {r.id: i for i, r in enumerate(rules)}
    for f in findings:  # a finding of a kind the table does not describe still gets a descriptor
        if f.rule not in index:
            index[f.rule] = len(rules)
            rules.append(Rule(f.rule, f.rule, f.rule, f.rule))
    results = []
    paths = report_paths()
    for f in findings:
        result = {"ruleId": f.rule, "ruleIndex": index[f.rule], "level": f.level, "message": {"text": f.message}}
        if f.location is not None:
            result["locations"] = [_physical(f.location, paths)]
        if f.related:
            result["relatedLocations"] = [
                dict(_physical(loc, paths), id=i, message={"text": text}) for i, (loc, text) in enumerate(f.related)
            ]
        if f.suppression is not None:
            result["suppressions"] = [{"kind": f.suppression[0], "justification": f.suppression[1]}]
        results.append(result)
    return {
        "$schema": SARIF_SCHEMA,
        "version": SARIF_VERSION,
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "rngaudit",
                        "version": __version__,
                        "semanticVersion": __version__,
                        "rules": [_rule_json(r) for r in rules],
                    }
                },
                "automationDetails": {"id": f"rngaudit/{command}/"},
                "columnKind": "unicodeCodePoints",
                "results": results,
            }
        ],
    }
