"""`deltalab info CHECKPOINT`: the one-paragraph summary of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deltalab.app.errors import fail


def info(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + model.safetensors)."),
    as_json: bool = typer.Option(False, "--json", help="Print the config as JSON."),
) -> None:
    """Print a checkpoint's architecture and parameter count."""
    from deltalab.models import CheckpointError, load_checkpoint
    from deltalab.models.hf.loader import describe

    try:
        hf = describe(checkpoint)  # transformers folders: config and safetensors headers, no weights loaded
        model = load_checkpoint(checkpoint) if hf is None else None
    except CheckpointError as err:
        fail(str(err))
    if hf is not None:
        config, n_params, text = hf
        typer.echo(json.dumps({"config": config.to_dict(), "parameters": n_params}, indent=2) if as_json else text)
        return
    if as_json:
        n_params = sum(p.numel() for p in model.parameters())
        typer.echo(json.dumps({"config": model.config.to_dict(), "parameters": n_params}, indent=2))
    else:
        typer.echo(model.summary())
