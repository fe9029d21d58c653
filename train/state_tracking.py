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

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.checkpoint import save_checkpoint
from models.config import MODEL_TYPES, ConfigError, ModelConfig
from models.lm import DeltaProductForCausalLM
from tasks.state_tracking import IGNORE_INDEX, Task, get_task
from train.evaluate import evaluate

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
TASK_FILE = "task.json"
CONFIG_FILE = "train_config.json"
PRECISIONS = ("fp32", "tf32", "bf16")


class TrainError(ValueError):
    """A training request that cannot run as given; the message names the fix."""


class RunConfig:
    """What every training config shares (task runs and `train lm`): JSON round trip and n_h default."""

    model_type: str
    num_householder: int | None
    lr: float
    min_lr: float
    precision: str
    save_every: int
    eval_every: int
    warmup_steps: int

    def check_shared(self, error: type[TrainError], positive: tuple[str, ...]) -> None:
        """The checks every trainer makes (counts, schedule, learning rates, model type, Householders,
        precision); the first failure raises `error` with a one-line message naming the flag."""
        for name in positive:
            if getattr(self, name) < 1:
                raise error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        for name in ("save_every", "eval_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise error(f"--{name.replace('_', '-')} must be >= 0")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise error(f"need lr > 0 and 0 <= min-lr <= lr (got lr={self.lr}, min-lr={self.min_lr})")
        if self.model_type not in MODEL_TYPES:
            raise error(f"unknown --model-type {self.model_type!r}: choose {', '.join(MODEL_TYPES)}")
        if self.model_type != "gated_deltaproduct" and self.householders != 1:
            raise error(f"{self.model_type} has one Householder step per token: drop --num-householder "
                        "or use --model-type gated_deltaproduct")
        if self.householders < 1:
            raise error("--num-householder must be >= 1")
        if self.precision not in PRECISIONS:
            raise error(f"unknown --precision {self.precision!r}: choose {', '.join(PRECISIONS)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> RunConfig:
        """From a saved train_config.json: unknown keys dropped, JSON lists back to tuples."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
        return cls(**kwargs)

    @property
    def householders(self) -> int:
        """n_h: as given, else 2 for gated_deltaproduct and 1 for the DeltaNets."""
        if self.num_householder is not None:
            return self.num_householder
        return 2 if self.model_type == "gated_deltaproduct" else 1


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
    """The ModelConfig a run builds: vocabulary covers the task's tokens and its label classes."""
    hidden = cfg.hidden_size or cfg.heads * cfg.head_dim
    common = dict(vocab_size=max(task.vocab_size, task.num_classes), hidden_size=hidden,
                  num_hidden_layers=cfg.layers, num_heads=cfg.heads, use_short_conv=cfg.short_conv,
                  allow_neg_eigval=cfg.allow_neg_eigval, use_output_gate=cfg.output_gate)
    if cfg.model_type == "delta_net":
        ratio = cfg.heads * cfg.head_dim / hidden
        return ModelConfig(model_type="delta_net", expand_k=ratio, expand_v=ratio, **common)
    if cfg.model_type == "gated_deltanet":
        return ModelConfig(model_type="gated_deltanet", head_dim=cfg.head_dim, expand_v=1.0, **common)
    return ModelConfig(model_type="gated_deltaproduct", head_dim=cfg.head_dim, expand_v=1.0,
                       num_householder=cfg.householders, use_forget_gate=cfg.forget_gate, **common)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine from lr down to min_lr at the last step (a factor on lr)."""
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(cfg.steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


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


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when visible, else cpu; a missing GPU is a one-line error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise TrainError(f"unknown --device {device!r}: use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda but no CUDA GPU is visible: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise TrainError(f"unsupported --device {device!r}: use auto, cpu or cuda[:N]")
    return dev


@dataclass
class TrainResult:
    out: Path
    step: int
    finished: bool
    last: dict


@contextmanager
def _graceful_stop():
    """First SIGINT/SIGTERM asks the loop to stop after the current step (and save); a second one aborts."""
    flag = {"stop": False}
    handlers = {}

    def handler(signum, frame):  # noqa: ARG001
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: no signal handling
        pass
    try:
        yield flag
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_json(path: Path, obj: dict) -> None:
    """Write JSON atomically (temp file + rename), so a kill never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def truncate_log(path: Path, step: int) -> None:
    """Drop log lines past `step` (written after the last checkpoint of an interrupted run)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip()
            and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))


def load_trainer_state(out: Path) -> dict:
    path = out / STATE_FILE
    if not path.is_file():
        raise TrainError(f"{out} has no {STATE_FILE} to resume: drop --resume to start a new run there")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means the state cannot be trusted
        raise TrainError(f"{path} cannot be read safely ({type(err).__name__}): start a new run") from None


def _init_weights_from(model: DeltaProductForCausalLM, path: str) -> None:
    """Start from another checkpoint's weights; its architecture must equal the run's."""
    from models.checkpoint import CheckpointError, load_checkpoint

    try:
        source = load_checkpoint(path)
    except CheckpointError as err:
        raise TrainError(f"--init-from: {err}") from None
    if source.config.to_dict() != model.config.to_dict():
        raise TrainError(f"--init-from {path} has another architecture than this run: "
                         "pass the same model flags it was trained with")
    model.load_state_dict(source.state_dict())


def train(cfg: TrainConfig, out: str | os.PathLike, *, resume: bool = False, device: str = "auto",
          progress: bool = True, stop_after: int | None = None, time_limit_s: float | None = None,
          on_log: Callable[[dict], None] | None = None) -> TrainResult:
    """Run (or resume) training into folder `out`; returns where it stopped.

    `stop_after` (steps) and `time_limit_s` (wall clock) end this call early as if interrupted, for tests
    and time-boxed jobs; the state is saved, and `resume=True` continues the identical curve.
    """
    out = Path(out)
    saved = None
    if resume:
        saved = load_trainer_state(out)
        cfg = TrainConfig.from_dict(saved["config"])
    elif (out / STATE_FILE).exists():
        raise TrainError(f"{out} already holds a training run: pass --resume to continue it "
                         "or pick another --out")
    try:
        task = get_task(cfg.task)
    except ValueError as err:
        raise TrainError(str(err)) from None
    cfg.validate(task)
    dev = resolve_device(device)
    if cfg.precision == "tf32" and dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast_dtype = torch.bfloat16 if cfg.precision == "bf16" else None

    try:
        mcfg = model_config(cfg, task)
    except ConfigError as err:
        raise TrainError(str(err)) from None
    torch.manual_seed(cfg.seed)
    model = DeltaProductForCausalLM(mcfg).to(dev)
    if cfg.init_from and saved is None:
        _init_weights_from(model, cfg.init_from)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    step = 0
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / LOG_FILE
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        _set_rng_state(saved["rng"])
        step = int(saved["step"])
        truncate_log(log_path, step)
    else:
        log_path.write_text("")
        write_json(out / CONFIG_FILE, cfg.to_dict())

    stream = BatchStream(task, cfg)
    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    last: dict = {}
    # running sums since the last log line: loss, steps, correct tokens, tokens, correct sequences, sequences
    window = torch.zeros(6, dtype=torch.float64, device=dev)
    if saved is not None and "window" in saved:
        window.copy_(saved["window"])
    t0 = time.perf_counter()

    saved_at = step if saved is not None else -1

    def save(at: int) -> None:
        nonlocal saved_at
        saved_at = at
        save_checkpoint(model, out)
        write_json(out / TASK_FILE, {**task.spec(), "train_length": cfg.train_length, "step": at,
                                      "train_config": CONFIG_FILE})
        state = {"version": 1, "step": at, "config": cfg.to_dict(), "model": model.state_dict(),
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": _rng_state(),
                 "window": window.cpu()}
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, out / STATE_FILE)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc=f"train {task.name}", unit="step", dynamic_ncols=True)
    model.train()
    with _graceful_stop() as stop, open(log_path, "a") as log:
        while step < end and not stop["stop"]:
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                break
            x, y = stream(step)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                logits = model(x).logits[..., : task.num_classes]
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            with torch.no_grad():
                mask = y != IGNORE_INDEX
                correct = (logits.argmax(-1) == y) & mask
                one = torch.ones((), device=dev, dtype=torch.float64)
                window += torch.stack([loss.detach().double(), one, correct.sum().double(), mask.sum().double(),
                                       (correct | ~mask).all(1).sum().double(), one * len(y)])
            if step % cfg.log_every == 0 or step == cfg.steps:
                w = window.tolist()
                last = {"step": step, "split": "train", "loss": w[0] / w[1], "token_acc": w[2] / max(w[3], 1),
                        "seq_acc": w[4] / w[5], "lr": sched.get_last_lr()[0],
                        "elapsed_s": round(time.perf_counter() - t0, 3)}
                window.zero_()
                log.write(json.dumps(last) + "\n")
                log.flush()
                if on_log:
                    on_log(last)
                if bar is not None:
                    bar.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['token_acc']:.3f}")
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                res = evaluate(model, task, list(cfg.val_lengths), cfg.eval_samples, seed=cfg.seed,
                               device=dev, autocast_dtype=autocast_dtype, curves=False)
                entry = {"step": step, "split": "val", "accuracy": res["accuracy"]}
                log.write(json.dumps(entry) + "\n")
                log.flush()
                if on_log:
                    on_log(entry)
            if (cfg.save_every and step % cfg.save_every == 0) or step == end or stop["stop"]:
                save(step)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if saved_at != step:
        save(step)
    return TrainResult(out, step, step >= cfg.steps, last)
