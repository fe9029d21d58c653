"""`deltalab train` and `deltalab eval`: fit a model on a state-tracking task, measure extrapolation."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deltalab.app.errors import fail
from deltalab.app.train_options import LOWER_BOUND, NUM_V_HEADS

TASK_HELP = "S4, A5, Z60, D8, S3xZ2, S5swaps, S5m3, parity, modarith, modarith_brackets ..."


def train(
    task: str = typer.Argument(..., help=TASK_HELP),
    out: Path = typer.Option(..., "--out", "-o", help="Run folder: checkpoint, logs and trainer state."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run saved in --out (its saved "
                                                        "settings win over the flags below)."),
    model_type: str = typer.Option("gated_deltaproduct", "--model-type",
                                   help="gated_deltaproduct, delta_net, gated_deltanet, kda (Kimi Delta "
                                        "Attention: per-key-channel gate and sigmoid output gate always on) "
                                        "or rwkv7."),
    layers: int = typer.Option(1, "--layers"),
    heads: int = typer.Option(12, "--heads"),
    head_dim: int = typer.Option(32, "--head-dim", help="Key (and value) head dimension."),
    hidden_size: int | None = typer.Option(None, "--hidden-size", help="Default: heads x head-dim."),
    num_householder: int | None = typer.Option(None, "--num-householder",
                                               help="n_h; default 2 for gated_deltaproduct, else 1."),
    allow_neg_eigval: bool = typer.Option(True, "--allow-neg-eigval/--no-allow-neg-eigval",
                                          help="beta in [0, 2] (eigenvalues in [-1, 1])."),
    forget_gate: bool = typer.Option(False, "--forget-gate/--no-forget-gate"),
    short_conv: bool = typer.Option(False, "--short-conv/--no-short-conv"),
    output_gate: bool = typer.Option(False, "--output-gate/--no-output-gate"),
    num_v_heads: int | None = NUM_V_HEADS,
    lower_bound: float | None = LOWER_BOUND,
    steps: int = typer.Option(2000, "--steps", help="Optimizer steps (the cosine schedule spans them)."),
    batch_size: int = typer.Option(1024, "--batch-size"),
    train_length: int = typer.Option(128, "--train-length"),
    min_length: int | None = typer.Option(None, "--min-length",
                                          help="modarith tasks: sample lengths in [min, train-length]."),
    train_samples: int | None = typer.Option(None, "--train-samples",
                                             help="Fixed training set of this size, reshuffled each epoch "
                                                  "(default: fresh samples every step)."),
    lr: float = typer.Option(1e-3, "--lr"),
    weight_decay: float = typer.Option(1e-6, "--weight-decay"),
    warmup_steps: int = typer.Option(0, "--warmup-steps"),
    min_lr: float = typer.Option(0.0, "--min-lr", help="Cosine floor."),
    grad_clip: float | None = typer.Option(None, "--grad-clip", help="Max gradient norm (off by default)."),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    precision: str = typer.Option("fp32", "--precision", help="fp32, tf32 or bf16 (autocast)."),
    init_from: str | None = typer.Option(None, "--init-from",
                                         help="Start from this checkpoint's weights (e.g. a length curriculum)."),
    log_every: int = typer.Option(10, "--log-every"),
    save_every: int = typer.Option(500, "--save-every",
                                   help="Checkpoint period in steps (0: only at the end)."),
    eval_every: int = typer.Option(500, "--eval-every", help="Validation period in steps (0: never)."),
    eval_samples: int = typer.Option(256, "--eval-samples"),
    eval_lengths: str | None = typer.Option(None, "--eval-lengths",
                                            help="Comma-separated validation lengths (default: L and 4L)."),
    time_limit: float | None = typer.Option(None, "--time-limit",
                                            help="Stop (and save) after this many seconds; --resume "
                                                 "continues the same curve."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json", help="Print the final log entry as JSON."),
) -> None:
    """Train a DeltaProduct-family model on TASK (defaults: the DeltaProduct paper's state-tracking setup)."""
    from deltalab.train.run import TrainError
    from deltalab.train.state_tracking import TrainConfig
    from deltalab.train.state_tracking import train as run_training

    try:
        lengths = _parse_lengths(eval_lengths) if eval_lengths else None
        cfg = TrainConfig(
            task=task, model_type=model_type, layers=layers, heads=heads, head_dim=head_dim,
            hidden_size=hidden_size, num_householder=num_householder, allow_neg_eigval=allow_neg_eigval,
            forget_gate=forget_gate, short_conv=short_conv, output_gate=output_gate, num_v_heads=num_v_heads,
            lower_bound=lower_bound, steps=steps,
            batch_size=batch_size, train_length=train_length, min_length=min_length,
            train_samples=train_samples, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps,
            min_lr=min_lr, grad_clip=grad_clip, seed=seed, precision=precision, init_from=init_from,
            log_every=log_every,
            save_every=save_every, eval_every=eval_every, eval_samples=eval_samples, eval_lengths=lengths)
        result = run_training(cfg, out, resume=resume, device=device, progress=progress,
                              time_limit_s=time_limit)
    except (TrainError, ValueError) as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps({"out": str(result.out), "step": result.step, "finished": result.finished,
                               "last": result.last}))
    else:
        state = "finished" if result.finished else "stopped (continue with --resume)"
        loss = result.last.get("loss")
        tail = f", loss {loss:.4f}, token acc {result.last['token_acc']:.4f}" if loss is not None else ""
        typer.echo(f"{state} at step {result.step}{tail}; checkpoint in {result.out}")


def _parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"lengths {text!r} must be comma-separated integers such as 64,128,256") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths {text!r} must be positive integers such as 64,128,256")
    return lengths


def evaluate(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + model.safetensors)."),
    task: str | None = typer.Option(None, "--task", "-t", help="Task name (default: task.json beside the "
                                                               "checkpoint)."),
    lengths: str = typer.Option("64,128,256,512", "--lengths", help="Comma-separated sequence lengths."),
    samples: int = typer.Option(512, "--samples", "-n", help="Sequences per length."),
    seed: int = typer.Option(0, "--seed", help="Seed of the held-out sequences."),
    batch_size: int = typer.Option(256, "--batch-size"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    precision: str = typer.Option("fp32", "--precision", help="fp32 or bf16."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for length_curve.json/.svg (created if "
                                                               "needed; default: write no files)."),
    as_json: bool = typer.Option(False, "--json", help="Print results as JSON."),
) -> None:
    """Token and sequence accuracy per length; with --out, the length-extrapolation curve as JSON and SVG.

    The checkpoint folder is only read: evaluating a bundled model must not modify the installed package.
    """
    import torch

    from deltalab.models import CheckpointError, load_checkpoint
    from deltalab.models.run_files import TASK_FILE, read_task_file, training_length
    from deltalab.tasks.state_tracking import TaskError, get_task
    from deltalab.train.evaluate import evaluate as run_eval
    from deltalab.train.evaluate import save_length_curve
    from deltalab.train.run import TrainError, resolve_device

    try:
        wanted = _parse_lengths(lengths)
        if samples < 1 or batch_size < 1:
            raise ValueError("--samples and --batch-size must be >= 1")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"unknown --precision {precision!r}: choose fp32 or bf16")
        dev = resolve_device(device)
        model = load_checkpoint(checkpoint, device=dev)
        name = task or read_task_file(checkpoint).get("name")
        train_length = training_length(checkpoint)
        if not name:
            raise ValueError(f"{checkpoint} has no {TASK_FILE}: pass --task (e.g. --task S4)")
        t = get_task(name)
        if model.config.vocab_size < max(t.vocab_size, t.num_classes):
            raise ValueError(f"{t.name} needs {max(t.vocab_size, t.num_classes)} tokens but the model has "
                             f"{model.config.vocab_size}: pick the task the checkpoint was trained on")
        for length in wanted:
            t.check(length, samples)
        if out is not None:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"cannot create --out {out} ({err.strerror or err}): pick another folder") from None
        result = run_eval(model, t, list(wanted), samples, seed, batch_size, dev,
                          torch.bfloat16 if precision == "bf16" else None)
    except (CheckpointError, TaskError, TrainError, ValueError) as err:
        fail(str(err))
    curve = None
    if out is not None:
        try:
            curve = save_length_curve(out, result, train_length, str(checkpoint))[0]
        except OSError as err:
            fail(f"cannot write the length curve to {out} ({err.strerror or err}): pick another --out")
    if as_json:
        typer.echo(json.dumps({"accuracy": result["accuracy"], "task": result["task"],
                               "checkpoint": str(checkpoint), "samples": samples, "seed": seed,
                               "train_length": train_length,
                               "length_curve": str(curve) if curve else None}))
        return
    typer.echo(f"{result['task']} on {checkpoint}: {samples} sequences per length, seed {seed}")
    typer.echo(f"{'length':>8} {'token':>8} {'sequence':>9}")
    for length, acc in result["accuracy"].items():
        mark = "  (train length)" if str(train_length) == length else ""
        typer.echo(f"{length:>8} {acc['token']:8.4f} {acc['sequence']:9.4f}{mark}")
    if curve:
        typer.echo(f"length curve: {curve} (+ .svg)")

