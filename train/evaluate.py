"""Measuring a model: held-out perplexity (language models, pruned checkpoints), and token and sequence
accuracy on a task per length and per position (length extrapolation), with the length-curve files."""

from __future__ import annotations

import json
import math
import os
from html import escape
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deltalab.kernels.constants import IGNORE_INDEX
from deltalab.tasks.state_tracking import Task

EVAL_STREAM = 3  # SeedSequence branch for evaluation data (training draws from 0, fixed sets from 1, 2)


def eval_batch(task: Task, length: int, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out set for one length, fixed by (task, length, samples, seed); a stream training never uses."""
    task.check(length, samples)
    x, y = task.sample(np.random.default_rng([seed, EVAL_STREAM, length]), length, samples)
    return torch.from_numpy(x), torch.from_numpy(y)


@torch.no_grad()
def perplexity(model: torch.nn.Module, inputs: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
               batch_size: int = 32, device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None,
               num_classes: int | None = None, with_accuracy: bool = False) -> dict[str, float]:
    """exp(mean next-token NLL) over the labelled positions; also nll (nats), bits per token and tokens.

    `num_classes` restricts the logits to a task's label classes; `with_accuracy` adds the token accuracy
    (argmax over those logits). The model is put in eval mode for the call and restored after.
    """
    device = torch.device(device)
    inputs, labels = torch.as_tensor(inputs), torch.as_tensor(labels)
    total, count, correct = 0.0, 0, 0
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(inputs), batch_size):
            x, y = inputs[i: i + batch_size].to(device), labels[i: i + batch_size].to(device)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                logits = model(x).logits
            logits = logits.float() if num_classes is None else logits.float()[..., :num_classes]
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                           reduction="sum"))
            mask = y != IGNORE_INDEX
            count += int(mask.sum())
            if with_accuracy:
                correct += int(((logits.argmax(-1) == y) & mask).sum())
    finally:
        model.train(was_training)
    mean = total / max(count, 1)
    out = {"nll": mean, "perplexity": math.exp(mean), "bits_per_token": mean / math.log(2), "tokens": count}
    if with_accuracy:
        out["accuracy"] = correct / max(count, 1)
    return out


@torch.no_grad()
def predict(model: torch.nn.Module, inputs: torch.Tensor, num_classes: int, batch_size: int = 256,
            device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Argmax over the task's label classes, [N, L] int64 on the CPU."""
    device = torch.device(device)
    out = []
    for i in range(0, len(inputs), batch_size):
        x = inputs[i: i + batch_size].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            logits = model(x).logits
        out.append(logits[..., :num_classes].argmax(-1).cpu())
    return torch.cat(out)


def accuracy(pred: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Token accuracy over labelled positions; sequence accuracy = all labelled positions right."""
    mask = labels != IGNORE_INDEX
    correct = (pred == labels) & mask
    n_tok = int(mask.sum())
    token = float(correct.sum()) / n_tok if n_tok else math.nan
    seq_ok = (correct | ~mask).all(dim=1)
    return {"token": token, "sequence": float(seq_ok.float().mean())}


def position_curves(pred: torch.Tensor, labels: torch.Tensor) -> dict[str, list[float | None]]:
    """Per position t: token accuracy at t, and the share of sequences right on every labelled position <= t.

    The model is causal, so position t of a long sequence behaves like the last token of a length-(t+1)
    sequence: the second curve is sequence accuracy against length, the papers' extrapolation plot.
    """
    mask = labels != IGNORE_INDEX
    correct = (pred == labels) & mask
    counts = mask.sum(0)
    tok = torch.where(counts > 0, correct.sum(0) / counts.clamp(min=1), torch.full_like(counts, -1.0,
                                                                                         dtype=torch.float))
    prefix_ok = torch.cummin((correct | ~mask).int(), dim=1).values.float().mean(0)
    return {
        "token": [None if v < 0 else round(float(v), 6) for v in tok],
        "sequence": [round(float(v), 6) for v in prefix_ok],
    }


def evaluate(model: torch.nn.Module, task: Task, lengths: list[int], samples: int = 512, seed: int = 0,
             batch_size: int = 256, device: torch.device | str = "cpu",
             autocast_dtype: torch.dtype | None = None, curves: bool = True) -> dict:
    """Accuracy at each length; with `curves`, per-position curves at the longest length."""
    was_training = model.training
    model.eval()
    result: dict = {"task": task.name, "samples": samples, "seed": seed, "accuracy": {}}
    try:
        for length in sorted(set(lengths)):
            x, y = eval_batch(task, length, samples, seed)
            pred = predict(model, x, task.num_classes, batch_size, device, autocast_dtype)
            result["accuracy"][str(length)] = {k: round(v, 6) for k, v in accuracy(pred, y).items()}
            if curves and length == max(lengths):
                result["position_accuracy"] = position_curves(pred, y)
    finally:
        model.train(was_training)
    return result


CURVE_JSON = "length_curve.json"
CURVE_SVG = "length_curve.svg"


def save_length_curve(folder: str | Path, result: dict, train_length: int | None = None,
                      checkpoint: str | None = None) -> tuple[Path, Path]:
    """Write length_curve.json (accuracy per length and per position) and a dependency-free SVG plot."""
    folder = Path(folder)
    payload = {"task": result["task"], "checkpoint": checkpoint, "train_length": train_length,
               "samples": result["samples"], "seed": result["seed"], "accuracy": result["accuracy"],
               "position_accuracy": result.get("position_accuracy")}
    json_path, svg_path = folder / CURVE_JSON, folder / CURVE_SVG
    tmp = json_path.with_name(json_path.name + ".tmp")
    tmp.write_text(json.dumps(payload) + "\n")
    os.replace(tmp, json_path)
    svg_path.write_text(curve_svg(payload))
    return json_path, svg_path


def curve_svg(payload: dict, width: int = 640, height: int = 360) -> str:
    """Accuracy against position (token: blue; all-correct prefix = sequence accuracy: orange)."""
    curves = payload.get("position_accuracy") or {}
    left, right, top, bottom = 56, 16, 28, 44
    pw, ph = width - left - right, height - top - bottom
    n = max((len(v) for v in curves.values()), default=1)

    def xy(i: int, v: float) -> str:
        return f"{left + pw * i / max(n - 1, 1):.1f},{top + ph * (1 - v):.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="18">{escape(str(payload.get("task")))}: accuracy vs position</text>',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + ph * (1 - v)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i in sorted({0, n // 4, n // 2, 3 * n // 4, n - 1}):
        x = left + pw * i / max(n - 1, 1)
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{i + 1}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle">position (tokens)</text>')
    train_length = payload.get("train_length")
    if train_length and train_length <= n:
        x = left + pw * (train_length - 1) / max(n - 1, 1)
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="red" '
                     'stroke-dasharray="4,3"/>')
        parts.append(f'<text x="{x + 4:.1f}" y="{top + 12}" fill="red">train length</text>')
    for key, color in (("token", "#1f77b4"), ("sequence", "#ff7f0e")):
        values = curves.get(key) or []
        points = " ".join(xy(i, v) for i, v in enumerate(values) if v is not None)
        if points:
            parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    parts.append(f'<text x="{left + pw}" y="18" text-anchor="end"><tspan fill="#1f77b4">token</tspan> | '
                 '<tspan fill="#ff7f0e">sequence (all correct so far)</tspan></text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
