"""The command line: the typer app and its entry point (the only typer imports)."""

from .root import app, main

__all__ = ["app", "main"]
