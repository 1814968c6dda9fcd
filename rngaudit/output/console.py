"""What a rich renderer prints, as text: coloured and terminal-wide on a terminal, plain and wide elsewhere."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable

from rich.console import Console


def console_text(render: Callable[[Console], None], *, to_terminal: bool | None = None) -> str:
    """The text `render(console)` prints. `to_terminal` None: whether stdout is a terminal."""
    buf = io.StringIO()
    tty = sys.stdout.isatty() if to_terminal is None else to_terminal
    console = Console(
        file=buf,
        force_terminal=tty,
        no_color=not tty or "NO_COLOR" in os.environ,
        width=None if tty else 400,
        highlight=False,
        soft_wrap=not tty,
    )
    render(console)
    return buf.getvalue()
