"""`deltalab train lm`: a byte-level language model on the Python standard library.

`deltalab train TASK` is one typer command with a positional TASK, so `lm` cannot be a sub-command of
it in plain typer. `TrainCommand` (the class `train` is registered with) hands `train lm ...` to the
`lm` command built here before TASK is parsed; every other `train TASK ...` call is unchanged.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click
import typer
from typer.core import TyperCommand

from deltalab.app.errors import fail
from deltalab.app.train_options import LOWER_BOUND, NUM_V_HEADS

lm_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@lm_app.command("lm")
def train_lm(
    out: Path = typer.Option(..., "--out", "-o", help="Run folder: checkpoint, tokenizer.json, logs, model card."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out (its saved settings win)."),
    model_type: str = typer.Option("gated_deltaproduct", "--model-type",
                                   help="delta_net, gated_deltanet, gated_deltaproduct or kda (Kimi Delta "
                                        "Attention)."),
    layers: int = typer.Option(2, "--layers"),
    hidden_size: int = typer.Option(128, "--hidden-size"),
    heads: int = typer.Option(4, "--heads"),
    head_dim: int = typer.Option(32, "--head-dim", help="Key head dimension dk."),
    expand_v: float = typer.Option(1.0, "--expand-v", help="dv = head-dim x expand-v."),
    num_householder: int | None = typer.Option(None, "--num-householder",
                                               help="n_h; default 2 for gated_deltaproduct, else 1."),
    allow_neg_eigval: bool | None = typer.Option(None, "--allow-neg-eigval/--no-allow-neg-eigval",
                                                 help="beta in [0, 2]; default on for gated_deltaproduct."),
    short_conv: bool = typer.Option(True, "--short-conv/--no-short-conv"),
    output_gate: bool | None = typer.Option(None, "--output-gate/--no-output-gate",
                                            help="Default: off for delta_net, on for the gated models "
                                                 "(kda: always on)."),
    num_v_heads: int | None = NUM_V_HEADS,
    lower_bound: float | None = LOWER_BOUND,
    context_length: int = typer.Option(256, "--context-length", "-T"),
    batch_size: int = typer.Option(16, "--batch-size"),
    steps: int = typer.Option(1000, "--steps"),
    lr: float = typer.Option(2e-3, "--lr"),
    min_lr: float = typer.Option(2e-4, "--min-lr", help="Cosine floor."),
    warmup_steps: int = typer.Option(50, "--warmup-steps"),
    weight_decay: float = typer.Option(0.1, "--weight-decay"),
    grad_clip: float | None = typer.Option(1.0, "--grad-clip", help="Max gradient norm (0: off)."),
    seed: int = typer.Option(0, "--seed"),
    precision: str = typer.Option("fp32", "--precision", help="fp32, tf32 or bf16 (autocast)."),
    eval_fraction: float = typer.Option(0.05, "--eval-fraction", help="Share of files held out (by path hash)."),
    corpus_root: Path | None = typer.Option(None, "--corpus-root",
                                            help="Folder of *.py files (default: this Python's stdlib)."),
    eval_windows: int = typer.Option(256, "--eval-windows", help="Held-out windows for the final perplexity."),
    eval_every: int = typer.Option(250, "--eval-every", help="Quick held-out check period (0: never)."),
    save_every: int = typer.Option(250, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    time_limit: float | None = typer.Option(None, "--time-limit",
                                            help="Stop (and save) after this many seconds; --resume "
                                                 "continues the same curve."),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json", help="Print the final evaluation as JSON."),
) -> None:
    """Train DeltaNet / Gated DeltaNet / Gated DeltaProduct / KDA on the Python standard library, byte-level."""
    import torch

    from deltalab.train.lm import LMTrainConfig, LMTrainError
    from deltalab.train.lm import train_lm as run

    if threads:
        torch.set_num_threads(threads)
    cfg = LMTrainConfig(
        model_type=model_type, layers=layers, hidden_size=hidden_size, heads=heads, head_dim=head_dim,
        expand_v=expand_v, num_householder=num_householder, allow_neg_eigval=allow_neg_eigval,
        short_conv=short_conv, output_gate=output_gate, num_v_heads=num_v_heads, lower_bound=lower_bound,
        context_length=context_length, batch_size=batch_size,
        steps=steps, lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, weight_decay=weight_decay,
        grad_clip=grad_clip or None, seed=seed, precision=precision, eval_fraction=eval_fraction,
        corpus_root=str(corpus_root) if corpus_root else None, eval_windows=eval_windows, eval_every=eval_every,
        save_every=save_every, log_every=log_every)
    command = "deltalab " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if len(sys.argv) > 1 else None
    try:
        result = run(cfg, out, resume=resume, device=device, progress=progress, time_limit_s=time_limit,
                     command=command)
    except (LMTrainError, ValueError) as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps({"out": str(result.out), "step": result.step, "finished": result.finished,
                               "last": result.last, "eval": result.eval}))
    elif result.eval is not None:
        typer.echo(f"finished at step {result.step}: held-out perplexity {result.eval['perplexity']:.4f} "
                   f"({result.eval['bits_per_token']:.4f} bits/byte); checkpoint and card in {result.out}")
    else:
        typer.echo(f"stopped at step {result.step} (continue with --resume); checkpoint in {result.out}")


LM_COMMAND: click.Command = typer.main.get_command(lm_app)


class TrainCommand(TyperCommand):
    """`deltalab train TASK ...`, except that `deltalab train lm ...` runs the language-model command."""

    def __init__(self, *args, **kwargs) -> None:
        if not kwargs.get("epilog"):
            kwargs["epilog"] = "Language model on the Python standard library: deltalab train lm --help"
        super().__init__(*args, **kwargs)

    def make_context(self, info_name, args, parent=None, **extra):  # type: ignore[override]
        if args and args[0] == "lm":
            return LM_COMMAND.make_context(f"{info_name} lm", list(args[1:]), parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)
