"""Model options that `deltalab train TASK` and `deltalab train lm` share (one declaration, the same help)."""

from __future__ import annotations

import typer

NUM_V_HEADS = typer.Option(None, "--num-v-heads",
                           help="gated_deltanet, kda: value heads, a multiple of --heads (grouped value attention; "
                                "default --heads).")
LOWER_BOUND = typer.Option(None, "--lower-bound",
                           help="kda: fla's bounded gate, log decay in (lower-bound, 0) per key channel (negative; "
                                "default: unbounded).")
