"""One-line CLI errors: the message names the problem and the fix; exit code 2."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` on stderr and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
