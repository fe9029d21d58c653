"""`deltalab probe prune CHECKPOINT ...`: the key/query channel-pruning study (probes.prune).

It works on a checkpoint, not on a capture store, so it has its own parser; the arguments pass through
unchanged, and `deltalab probe prune ...` is the same program as `python -m probes.prune ...`.
"""

from __future__ import annotations

import typer

HELP = ("Prune key/query channels per head (L1, random, S-Wanda, gradient, DRRQR, PCA) at several compressions: "
        "held-out perplexity, state rank utilisation, throughput; writes smaller fla checkpoints.")
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def prune(ctx: typer.Context) -> None:
    """Hand the arguments to probes.prune.main (lazy import keeps `deltalab --help` fast)."""
    from probes.prune import main

    code = main(list(ctx.args))
    if code:
        raise typer.Exit(code)


def register(probe_app: typer.Typer) -> None:
    """Add `prune` to the `deltalab probe` group."""
    probe_app.command("prune", help=HELP, context_settings=_PASS_THROUGH, add_help_option=False)(prune)
