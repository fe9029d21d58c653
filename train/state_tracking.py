"""Train a DeltaProduct-family model on a state-tracking task, with checkpoints and exact resume.

Defaults are the DeltaProduct paper's state-tracking setup (appendix C.1): one layer, 12 heads of
dimension 32 (hidden 384), n_h = 2, eigenvalues in [-1, 1], no short conv and no gates; AdamW
(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-6), cosine schedule, batch 1024, length 128.

Data: by default every step draws a fresh batch from the task, seeded by (seed, step), so a run sees
no sample twice (for S4 at length 128 the space is 24^128) and resuming needs no data-loader state.
With ``train_samples`` a fixed set is drawn once and reshuffled per epoch (seeded by (seed, epoch)), as in
the papers' fixed data sets. Either way batch ``s`` depends only on (seed, s).

The run folder holds the checkpoint (config.json + model.safetensors, loadable by load_checkpoint),
task.json, train_config.json, train_log.jsonl (one JSON object per logged step) and trainer_state.pt
(model, optimizer, scheduler, step, RNG; read back with torch.load(weights_only=True)). Resuming
restores all of it and continues the same loss curve.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deltalab.models.checkpoint import build_model
from deltalab.models.config import MODEL_TYPES, ConfigError, ModelConfig
from deltalab.models.lm import IGNORE_INDEX, DeltaProductForCausalLM
from deltalab.models.run_files import TASK_FILE
from deltalab.tasks.state_tracking import Task, get_task
from deltalab.train.evaluate import evaluate
from deltalab.train.run import (
    CONFIG_FILE,
    Run,
    RunConfig,
    Trainer,
    TrainError,
    TrainResult,
    execute,
    open_run,
    write_json,
)


@dataclass
class TrainConfig(RunConfig):
    """Everything that determines a run (saved with it; a resumed run uses the saved copy)."""

    task: str
    # model
    model_type: str = "gated_deltaproduct"
    layers: int = 1
    heads: int = 12
    head_dim: int = 32
    hidden_size: int | None = None  # default heads * head_dim
    num_householder: int | None = None  # default 2 for gated_deltaproduct, 1 otherwise
    allow_neg_eigval: bool = True
    forget_gate: bool = False
    short_conv: bool = False
    output_gate: bool = False
    num_v_heads: int | None = None  # gated_deltanet, kda: grouped value heads (a multiple of heads)
    lower_bound: float | None = None  # kda: fla's bounded gate, g = lower_bound * sigmoid(...) per key channel
    # data
    steps: int = 2000
    batch_size: int = 1024
    train_length: int = 128
    min_length: int | None = None
    train_samples: int | None = None
    # optimisation
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-6
    warmup_steps: int = 0
    min_lr: float = 0.0
    grad_clip: float | None = None
    seed: int = 0
    precision: str = "fp32"
    init_from: str | None = None  # checkpoint whose weights start the run (length curriculum, fine-tuning)
    # bookkeeping
    log_every: int = 10
    save_every: int = 500
    eval_every: int = 500
    eval_samples: int = 256
    eval_lengths: tuple[int, ...] | None = None  # default (train_length, 4 * train_length)

    @property
    def val_lengths(self) -> tuple[int, ...]:
        return self.eval_lengths or (self.train_length, 4 * self.train_length)

    def validate(self, task: Task) -> None:
        """One-line TrainError for settings that cannot work."""
        self.check_shared(TrainError, ("steps", "batch_size", "train_length", "layers", "heads", "head_dim",
                                       "log_every", "eval_samples"))
        if self.train_samples is not None and self.train_samples < self.batch_size:
            raise TrainError(f"--train-samples {self.train_samples} is smaller than --batch-size "
                             f"{self.batch_size}: raise it or drop it to sample fresh data each step")
        if self.hidden_size is not None and self.hidden_size < 1:
            raise TrainError(f"--hidden-size must be >= 1 (got {self.hidden_size})")
        try:
            task.check(self.train_length, self.batch_size, self.min_length)
            for length in self.val_lengths:
                task.check(length, self.eval_samples)
        except ValueError as err:
            raise TrainError(str(err)) from None


def model_config(cfg: TrainConfig, task: Task) -> ModelConfig:
    """The ModelConfig a run builds: vocabulary covers the task's tokens and its label classes.

    kda (Kimi Delta Attention) always has its per-key-channel forget gate and sigmoid output gate (fla's KDA
    has no switch for them), so `forget_gate`/`output_gate` do not apply to it.
    """
    hidden = cfg.hidden_size or cfg.heads * cfg.head_dim
    common = dict(vocab_size=max(task.vocab_size, task.num_classes), hidden_size=hidden,
                  num_hidden_layers=cfg.layers, num_heads=cfg.heads, use_short_conv=cfg.short_conv,
                  allow_neg_eigval=cfg.allow_neg_eigval, use_output_gate=cfg.output_gate)
    if cfg.model_type == "rwkv7":  # fla's RWKV7Config: heads = hidden / head_dim, its own token shift and gates;
        # allow_neg_eigval has no meaning there (a_rwkv in (0, 1) sets the removal) and is ignored
        extra = [f"--{n.replace('_', '-')}" for n in ("short_conv", "forget_gate", "output_gate") if getattr(cfg, n)]
        if extra or hidden != cfg.heads * cfg.head_dim:
            raise ConfigError(f"rwkv7 has its own token shift and gates and hidden = heads * head_dim: drop "
                              f"{' '.join(extra) or '--hidden-size'}")
        return ModelConfig(model_type="rwkv7", vocab_size=common["vocab_size"], hidden_size=hidden,
                           num_hidden_layers=cfg.layers, head_dim=cfg.head_dim)
    if cfg.model_type == "delta_net":
        ratio = cfg.heads * cfg.head_dim / hidden
        return ModelConfig(model_type="delta_net", expand_k=ratio, expand_v=ratio, **common)
    if cfg.model_type == "gated_deltanet":
        return ModelConfig(model_type="gated_deltanet", head_dim=cfg.head_dim, expand_v=1.0,
                           num_v_heads=cfg.num_v_heads, **common)
    if cfg.model_type == "kda":
        return ModelConfig(model_type="kda", head_dim=cfg.head_dim, expand_v=1.0, num_v_heads=cfg.num_v_heads,
                           lower_bound=cfg.lower_bound, **common)
    if cfg.model_type == "gated_deltaproduct":
        return ModelConfig(model_type="gated_deltaproduct", head_dim=cfg.head_dim, expand_v=1.0,
                           num_householder=cfg.householders, use_forget_gate=cfg.forget_gate, **common)
    raise ConfigError(f"--model-type {cfg.model_type!r} cannot be trained here: choose {', '.join(MODEL_TYPES)}")


class BatchStream:
    """Batch `s` as a pure function of (seed, s): fresh samples, or a fixed set reshuffled per epoch."""

    def __init__(self, task: Task, cfg: TrainConfig) -> None:
        self.task, self.cfg = task, cfg
        self.fixed: tuple[np.ndarray, np.ndarray] | None = None
        self._perm: tuple[int, np.ndarray] | None = None
        if cfg.train_samples is not None:
            self.fixed = task.sample(np.random.default_rng([cfg.seed, 1]), cfg.train_length,
                                     cfg.train_samples, cfg.min_length)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if self.fixed is None:
            x, y = self.task.sample(np.random.default_rng([cfg.seed, 0, step]), cfg.train_length,
                                    cfg.batch_size, cfg.min_length)
            return torch.from_numpy(x), torch.from_numpy(y)
        per_epoch = cfg.train_samples // cfg.batch_size
        epoch, offset = divmod(step, per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([cfg.seed, 2, epoch]).permutation(cfg.train_samples))
        idx = self._perm[1][offset * cfg.batch_size: (offset + 1) * cfg.batch_size]
        return torch.from_numpy(self.fixed[0][idx]), torch.from_numpy(self.fixed[1][idx])


def _init_weights_from(model: DeltaProductForCausalLM, path: str) -> None:
    """Start from another checkpoint's weights; its architecture must equal the run's."""
    from deltalab.models.checkpoint import CheckpointError, load_checkpoint

    try:
        source = load_checkpoint(path)
    except CheckpointError as err:
        raise TrainError(f"--init-from: {err}") from None
    if source.config.to_dict() != model.config.to_dict():
        raise TrainError(f"--init-from {path} has another architecture than this run: "
                         "pass the same model flags it was trained with")
    model.load_state_dict(source.state_dict())



class TaskTrainer(Trainer):
    """A state-tracking task run: batches from BatchStream, token and sequence accuracy, task.json."""

    sums = 6  # loss, steps, correct tokens, labelled tokens, correct sequences, sequences

    def __init__(self, cfg: TrainConfig) -> None:
        try:
            self.task = get_task(cfg.task)
        except ValueError as err:
            raise TrainError(str(err)) from None
        cfg.validate(self.task)
        self.cfg, self.desc = cfg, f"train {self.task.name}"

    def build_model(self, fresh: bool) -> DeltaProductForCausalLM:
        try:
            mcfg = model_config(self.cfg, self.task)
        except ConfigError as err:
            raise TrainError(str(err)) from None
        model = build_model(mcfg)
        if self.cfg.init_from and fresh:
            _init_weights_from(model, self.cfg.init_from)
        return model

    def start(self, run: Run) -> None:
        self.stream = BatchStream(self.task, self.cfg)

    def loss(self, run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.stream(step)
        x, y = x.to(run.dev, non_blocking=True), y.to(run.dev, non_blocking=True)
        with run.autocast():
            logits = run.model(x).logits[..., : self.task.num_classes]
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        with torch.no_grad():
            mask = y != IGNORE_INDEX
            correct = (logits.argmax(-1) == y) & mask
            one = torch.ones((), device=run.dev, dtype=torch.float64)
            sums = torch.stack([loss.detach().double(), one, correct.sum().double(), mask.sum().double(),
                                (correct | ~mask).all(1).sum().double(), one * len(y)])
        return loss, sums

    def log_fields(self, sums: list[float]) -> dict:
        return {"loss": sums[0] / sums[1], "token_acc": sums[2] / max(sums[3], 1), "seq_acc": sums[4] / sums[5]}

    def postfix(self, entry: dict) -> dict[str, str]:
        return {"loss": f"{entry['loss']:.4f}", "acc": f"{entry['token_acc']:.3f}"}

    def evaluate(self, run: Run, step: int) -> dict:
        cfg = self.cfg
        res = evaluate(run.model, self.task, list(cfg.val_lengths), cfg.eval_samples, seed=cfg.seed,
                       device=run.dev, autocast_dtype=run.autocast_dtype, curves=False)
        return {"step": step, "split": "val", "accuracy": res["accuracy"]}

    def write_files(self, run: Run, step: int) -> None:
        write_json(run.out / TASK_FILE, {**self.task.spec(), "train_length": self.cfg.train_length, "step": step,
                                         "train_config": CONFIG_FILE})


def train(cfg: TrainConfig, out: str | os.PathLike, *, resume: bool = False, device: str = "auto",
          progress: bool = True, stop_after: int | None = None, time_limit_s: float | None = None,
          on_log: Callable[[dict], None] | None = None) -> TrainResult:
    """Run (or resume) training into folder `out`; returns where it stopped.

    `stop_after` (steps) and `time_limit_s` (wall clock) end this call early as if interrupted, for tests
    and time-boxed jobs; the state is saved, and `resume=True` continues the identical curve.
    """
    out = Path(out)
    saved = open_run(out, resume, time_limit_s)
    if saved is not None:
        cfg = TrainConfig.from_dict(saved["config"])
    return execute(TaskTrainer(cfg), out, saved, device=device, progress=progress, stop_after=stop_after,
                   time_limit_s=time_limit_s, on_log=on_log)
