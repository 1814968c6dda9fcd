"""The options and choices the commands share: formats, phases, finding categories, --exit-zero, --config and
the spec limits (whose --help states the defaults the loader uses)."""

from __future__ import annotations

import enum

import typer

from ..output.formats import DeriveFormat, Format
from ..spec.limits import MAX_BYTES, MAX_NODES

__all__ = [
    "CONFIG",
    "EXIT_ZERO",
    "FORMAT",
    "MAX_SPEC_MIB",
    "MAX_YAML_NODES",
    "OUTPUT",
    "STDIN_FILENAME",
    "Category",
    "DeriveFormat",
    "Format",
    "Phase",
]


class Phase(str, enum.Enum):
    init = "init"
    apply = "apply"


class Category(str, enum.Enum):
    """Kinds of `collisions` findings, as `--fail-on` names them (rngaudit.collision.results.FINDING_CATEGORIES)."""

    concatenation = "concatenation"
    jit_trace_reuse = "jit_trace_reuse"
    count_meets_name = "count_meets_name"
    hash_word = "hash_word"
    shared_seed = "shared_seed"
    unsplit_lanes = "unsplit_lanes"
    latent = "latent"
    shared_stream_key = "shared_stream_key"
    count_rewind = "count_rewind"
    broadcast_lanes = "broadcast_lanes"
    frozen_scan_broadcast = "frozen_scan_broadcast"
    keyless_dropout = "keyless_dropout"
    bridge_constant_default = "bridge_constant_default"
    scan_broadcast = "scan_broadcast"
    reseed_order = "reseed_order"
    reseed_repeat = "reseed_repeat"
    default_fallback = "default_fallback"


def category(value: str) -> str:
    """--fail-on's (--select's, --ignore's) value: a category's name, dashed, or its rule id as annotations and
    SARIF show it (`hash_word`, `hash-word`, `collisions/hash-word`), as the category's name (typer makes it a
    Category)."""
    from ..api import finding_category

    name = finding_category(str(value.value if isinstance(value, Category) else value))
    if name is None:
        raise typer.BadParameter(
            f"{value!r} is not a category: use one of {', '.join(c.value for c in Category)} (or its rule id, "
            "e.g. collisions/hash-word)"
        )
    return name


EXIT_ZERO = typer.Option(False, "--exit-zero/--no-exit-zero", help="Report findings but exit 0 (errors still exit 2).")
CONFIG = typer.Option(
    None,
    "--config",
    metavar="FILE",
    help="Read [tool.rngaudit] defaults from FILE instead of the pyproject.toml found from the current directory.",
)
MAX_SPEC_MIB = typer.Option(
    None,
    "--max-spec-mib",
    min=1,
    metavar="MIB",
    help=f"Accept spec files up to this many MiB (default {MAX_BYTES // (1024 * 1024)}).",
)
MAX_YAML_NODES = typer.Option(
    None,
    "--max-yaml-nodes",
    min=1,
    metavar="N",
    help=f"Accept specs of up to N YAML nodes, aliases expanded (default {MAX_NODES}).",
)
FORMAT = typer.Option(Format.text, "--format", "-f", metavar="text|json|github|sarif", help="Output format.")
STDIN_FILENAME = typer.Option(
    None, "--stdin-filename", metavar="NAME", help="The name a spec read from - (standard input) is reported as."
)
OUTPUT = typer.Option(None, "--output", "-o", metavar="FILE", help="Write the report here (only if the run succeeds).")


def path_ignore(value: str) -> str:
    """--per-path-ignore's value, GLOB:RULE[,RULE] (checked here, parsed by rngaudit.collision.suppress)."""
    from ..api import check_per_path_ignore

    try:
        check_per_path_ignore(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value
