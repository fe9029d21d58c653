"""One-line CLI errors: the message names the problem and the fix; exit code 2."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` on stderr and exit (control characters from store or checkpoint strings in the
    message shown as escapes: store.display.inert)."""
    from deltalab.store.display import inert

    typer.echo(f"error: {inert(message)}", err=True)
    raise typer.Exit(code)
