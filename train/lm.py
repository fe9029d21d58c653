"""Train a small byte-level language model on the Python standard library (tasks.corpus).

Variants are fla's: DeltaNet (`delta_net`), Gated DeltaNet (`gated_deltanet`) and Gated DeltaProduct
(`gated_deltaproduct`, n_h = 2 by default), all with short convolutions as fla trains them. Batches are
random windows of the training split drawn from a generator seeded by (seed, step), so a run is fixed
by its config and `--resume` continues the identical curve. Held-out perplexity is exp(mean next-byte
NLL) over non-overlapping windows of the held-out files.

The run folder holds the checkpoint (config.json + model.safetensors), tokenizer.json, data.json (the
corpus spec: files, split rule, digest), train_config.json, train_log.jsonl, eval.json (final held-out
perplexity), README.md (a model card with the command) and trainer_state.pt (resume state; weights_only).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.checkpoint import save_checkpoint
from models.config import ConfigError, ModelConfig
from models.lm import DeltaProductForCausalLM
from tasks.corpus import (
    DATA_FILE,
    EOS_ID,
    VOCAB_SIZE,
    CorpusError,
    eval_windows,
    load_corpus,
    random_windows,
    write_tokenizer,
)
from train.state_tracking import (
    CONFIG_FILE,
    LOG_FILE,
    STATE_FILE,
    RunConfig,
    TrainError,
    lr_lambda,
    resolve_device,
    truncate_log,
    write_json,
)

EVAL_FILE = "eval.json"
CARD_FILE = "README.md"


class LMTrainError(TrainError):
    """A language-model training request that cannot run as given; the message names the fix."""


@dataclass
class LMTrainConfig(RunConfig):
    """Everything that fixes a run (saved beside it; a resumed run uses the saved copy)."""

    model_type: str = "gated_deltaproduct"
    layers: int = 2
    hidden_size: int = 128
    heads: int = 4
    head_dim: int = 32  # key head dim dk
    expand_v: float = 1.0  # dv = head_dim * expand_v
    num_householder: int | None = None  # default 2 for gated_deltaproduct, else 1
    allow_neg_eigval: bool | None = None  # default: True for gated_deltaproduct, False otherwise
    short_conv: bool = True
    output_gate: bool | None = None  # default: fla's (off for delta_net, on for the gated models)
    context_length: int = 256
    batch_size: int = 16
    steps: int = 1000
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    seed: int = 0
    precision: str = "fp32"
    eval_fraction: float = 0.05
    corpus_root: str | None = None  # default: this interpreter's standard library
    eval_windows: int = 256  # held-out windows for the final perplexity (evenly spaced over the split)
    eval_every: int = 250
    log_every: int = 10
    save_every: int = 250

    def validate(self) -> None:
        """One-line LMTrainError for settings that cannot work."""
        self.check_shared(LMTrainError, ("layers", "hidden_size", "heads", "head_dim", "context_length",
                                         "batch_size", "steps", "eval_windows", "log_every"))
        if not 0 < self.eval_fraction < 1:
            raise LMTrainError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")


def model_config(cfg: LMTrainConfig) -> ModelConfig:
    """The fla-compatible ModelConfig of a run (vocab = 256 bytes + boundary token)."""
    neg = cfg.allow_neg_eigval if cfg.allow_neg_eigval is not None else cfg.model_type == "gated_deltaproduct"
    gate = cfg.output_gate if cfg.output_gate is not None else cfg.model_type != "delta_net"
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.layers,
                  num_heads=cfg.heads, use_short_conv=cfg.short_conv, allow_neg_eigval=neg,
                  use_output_gate=gate, tie_word_embeddings=False)
    try:
        if cfg.model_type == "delta_net":
            key_dim, value_dim = cfg.heads * cfg.head_dim, cfg.heads * cfg.head_dim * cfg.expand_v
            if value_dim != int(value_dim):
                raise LMTrainError(f"heads*head_dim*expand_v = {value_dim} must be an integer")
            return ModelConfig(model_type="delta_net", expand_k=key_dim / cfg.hidden_size,
                               expand_v=value_dim / cfg.hidden_size, **common)
        if cfg.model_type == "gated_deltanet":
            return ModelConfig(model_type="gated_deltanet", head_dim=cfg.head_dim, expand_v=cfg.expand_v, **common)
        return ModelConfig(model_type="gated_deltaproduct", head_dim=cfg.head_dim, expand_v=cfg.expand_v,
                           num_householder=cfg.householders, use_forget_gate=True, **common)
    except ConfigError as err:
        raise LMTrainError(str(err)) from None


@torch.no_grad()
def perplexity(model: torch.nn.Module, inputs: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
               batch_size: int = 32, device: torch.device | str = "cpu",
               autocast_dtype: torch.dtype | None = None) -> dict[str, float]:
    """exp(mean next-token NLL) over all labelled positions; also nll (nats) and bits per token."""
    device = torch.device(device)
    inputs, labels = torch.as_tensor(inputs), torch.as_tensor(labels)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i: i + batch_size].to(device), labels[i: i + batch_size].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            logits = model(x).logits
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        total += float(nll)
        count += int((y != -100).sum())
    model.train(was_training)
    mean = total / max(count, 1)
    return {"nll": mean, "perplexity": math.exp(mean), "bits_per_token": mean / math.log(2), "tokens": count}


@dataclass
class LMTrainResult:
    out: Path
    step: int
    finished: bool
    last: dict
    eval: dict | None


def model_card(name: str, cfg: LMTrainConfig, mcfg: ModelConfig, n_params: int, result: dict, data_spec: dict,
               command: str | None, elapsed_s: float | None, device: str) -> str:
    """README.md of a run: what it is, how it was made, how well it does."""
    rows = "\n".join(f"| {k} | {v} |" for k, v in (
        ("model_type", mcfg.model_type), ("layers", mcfg.num_hidden_layers), ("hidden", mcfg.hidden_size),
        ("heads", mcfg.num_heads), ("dk / dv", f"{mcfg.head_k_dim} / {mcfg.head_v_dim}"),
        ("n_h", mcfg.num_householder), ("eigenvalues", "[-1, 1]" if mcfg.allow_neg_eigval else "[0, 1]"),
        ("forget gate", mcfg.use_forget_gate), ("output gate", mcfg.use_output_gate),
        ("short conv", mcfg.use_short_conv), ("parameters", f"{n_params:,}")))
    train = f"{cfg.steps} steps x {cfg.batch_size} x {cfg.context_length} tokens " \
            f"= {cfg.steps * cfg.batch_size * cfg.context_length:,} tokens"
    return f"""# {name}

A byte-level {mcfg.model_type} language model trained by deltalab on the source of Python's standard
library (the study object of `deltalab prune`; see prune.json beside this card when present).

| field | value |
|---|---|
{rows}

## Data
`*.py` files under the standard library of Python {data_spec.get('python')} ({data_spec.get('root')}),
site-/dist-packages excluded; one document per file (raw bytes), boundary token 256 after each document.
Held-out files: {data_spec.get('split_rule')} (eval_fraction {data_spec.get('eval_fraction')}):
{data_spec['files']['eval']} held-out files ({data_spec['tokens']['eval']:,} tokens),
{data_spec['files']['train']} training files ({data_spec['tokens']['train']:,} tokens).
Corpus digest {data_spec.get('digest')} (another Python version gives another corpus: rebuild and compare).
Tokenizer: bytes 0-255 + `<|endoftext|>` = 256 (vocab 257), tokenizer.json in Hugging Face format.

## Training
{train}; AdamW lr {cfg.lr} (warm-up {cfg.warmup_steps}, cosine to {cfg.min_lr}), betas {list(cfg.betas)},
weight decay {cfg.weight_decay}, grad clip {cfg.grad_clip}, precision {cfg.precision}, seed {cfg.seed},
device {device}{f', {elapsed_s / 60:.1f} min' if elapsed_s else ''}.

```
{command or '(command not recorded)'}
```

## Held-out perplexity
**{result['perplexity']:.4f}** per byte ({result['bits_per_token']:.4f} bits/byte, nll {result['nll']:.4f} nats)
over {result['tokens']:,} held-out tokens ({cfg.eval_windows} windows of {cfg.context_length}).
"""


def train_lm(cfg: LMTrainConfig, out: str | os.PathLike, *, resume: bool = False, device: str = "auto",
             progress: bool = True, stop_after: int | None = None, command: str | None = None,
             on_log: Callable[[dict], None] | None = None) -> LMTrainResult:
    """Run (or resume) training into `out`; returns where it stopped (and the final eval when finished)."""
    out = Path(out)
    saved = None
    if resume:
        path = out / STATE_FILE
        if not path.is_file():
            raise LMTrainError(f"{out} has no {STATE_FILE} to resume: drop --resume to start a new run there")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure means the state cannot be trusted
            raise LMTrainError(f"{path} cannot be read safely ({type(err).__name__}): start a new run") from None
        cfg = LMTrainConfig.from_dict(saved["config"])
    elif (out / STATE_FILE).exists():
        raise LMTrainError(f"{out} already holds a training run: pass --resume to continue it or pick another --out")
    cfg.validate()
    dev = resolve_device(device)
    if cfg.precision == "tf32" and dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    autocast_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    try:
        corpus = load_corpus(cfg.corpus_root, cfg.eval_fraction)
    except CorpusError as err:
        raise LMTrainError(str(err)) from None
    if saved is not None and saved.get("data_digest") not in (None, corpus.spec["digest"]):
        raise LMTrainError(f"the corpus at {corpus.spec['root']} differs from the one this run started on "
                           "(digest mismatch): resume on the same machine/Python or start a new run")
    mcfg = model_config(cfg)
    torch.manual_seed(cfg.seed)
    model = DeltaProductForCausalLM(mcfg).to(dev)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    step = 0
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / LOG_FILE
    elapsed0 = 0.0
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        step, elapsed0 = int(saved["step"]), float(saved.get("elapsed_s", 0.0))
        truncate_log(log_path, step)
    else:
        log_path.write_text("")
        write_json(out / CONFIG_FILE, cfg.to_dict())
    write_json(out / DATA_FILE, {**corpus.spec, "context_length": cfg.context_length})
    write_tokenizer(out)
    held_x, held_y = eval_windows(corpus.eval, cfg.context_length, cfg.eval_windows)
    t0 = time.perf_counter()

    def elapsed() -> float:
        return elapsed0 + time.perf_counter() - t0

    def save(at: int) -> None:
        save_checkpoint(model, out)
        state = {"version": 1, "step": at, "config": cfg.to_dict(), "model": model.state_dict(),
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "elapsed_s": elapsed(),
                 "data_digest": corpus.spec["digest"]}
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, out / STATE_FILE)

    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc=f"train lm {cfg.model_type}", unit="step", dynamic_ncols=True)
    window, last, saved_at = [0.0, 0], {}, step
    model.train()
    with open(log_path, "a") as log:
        while step < end:
            x, y = random_windows(corpus.train, cfg.batch_size, cfg.context_length,
                                  np.random.default_rng([cfg.seed, step]))
            x, y = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
            with torch.autocast(dev.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                loss = model(x, labels=y).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            window[0] += float(loss.detach())
            window[1] += 1
            if step % cfg.log_every == 0 or step == end:
                last = {"step": step, "split": "train", "loss": window[0] / window[1],
                        "lr": sched.get_last_lr()[0], "elapsed_s": round(elapsed(), 2)}
                window = [0.0, 0]
                log.write(json.dumps(last) + "\n")
                log.flush()
                if on_log:
                    on_log(last)
                if bar is not None:
                    bar.set_postfix(loss=f"{last['loss']:.4f}")
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                res = perplexity(model, held_x[: max(1, len(held_x) // 4)], held_y[: max(1, len(held_y) // 4)],
                                 device=dev, autocast_dtype=autocast_dtype)
                entry = {"step": step, "split": "eval", **res}
                log.write(json.dumps(entry) + "\n")
                log.flush()
                if on_log:
                    on_log(entry)
            if cfg.save_every and step % cfg.save_every == 0:
                save(step)
                saved_at = step
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if saved_at != step:
        save(step)
    final = None
    if step >= cfg.steps:
        final = perplexity(model, held_x, held_y, device=dev, autocast_dtype=autocast_dtype)
        final = {**final, "windows": int(len(held_x)), "context_length": cfg.context_length, "step": step}
        write_json(out / EVAL_FILE, final)
        with open(log_path, "a") as log:
            log.write(json.dumps({"step": step, "split": "eval", **final}) + "\n")
        n_params = sum(p.numel() for p in model.parameters())
        card = model_card(out.name, cfg, mcfg, n_params, final, corpus.spec, command, elapsed(),
                          f"{dev.type} ({platform.processor() or platform.machine()})" if dev.type == "cpu"
                          else torch.cuda.get_device_name(dev))
        (out / CARD_FILE).write_text(card)
    return LMTrainResult(out, step, step >= cfg.steps, last, final)


__all__ = ["EOS_ID", "LMTrainConfig", "LMTrainError", "LMTrainResult", "model_config", "perplexity", "train_lm"]
