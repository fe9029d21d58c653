"""The run lifecycle both trainers share: run folder, resume, optimizer and schedule, log, saves, stopping.

A trainer (`train.state_tracking`, `train.lm`) subclasses `Trainer` and supplies only what differs: its
config, model, the loss of one step, what a log line reports, its evaluation and the files it writes
beside the checkpoint. `execute` does the rest, the same way for both:

- the run folder: a new run refuses a folder that holds one, `--resume` needs one (`open_run`);
- AdamW (weight decay on matrices only) with linear warm-up and a cosine schedule (`lr_lambda`);
- train_log.jsonl: one JSON object per logged step, emptied for a new run, cut back to the last save on
  resume (`truncate_log`);
- trainer_state.pt (model, optimizer, scheduler, step, torch RNG, running log sums, elapsed seconds),
  written atomically and read with torch.load(weights_only=True): resuming continues the same curve;
- stopping early: `stop_after` steps, `time_limit_s` wall-clock seconds of this call, or SIGINT/SIGTERM
  (the first one stops after the current step and saves; a second one aborts); every way saves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from deltalab.models.checkpoint import save_checkpoint
from deltalab.models.config import MODEL_TYPES
from deltalab.models.run_files import TRAIN_CONFIG_FILE

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
CONFIG_FILE = TRAIN_CONFIG_FILE
PRECISIONS = ("fp32", "tf32", "bf16")
GROUPED_TYPES = ("gated_deltanet", "kda")  # model types with grouped value heads (--num-v-heads)


class TrainError(ValueError):
    """A training request that cannot run as given; the message names the fix."""


class RunConfig:
    """What every training config shares (task runs and `train lm`): checks, JSON round trip, n_h default.

    Subclasses are dataclasses with these fields; `eps` is a field of the task config only, the LM
    config uses this class default (torch's AdamW default), so its train_config.json has no `eps`.
    `model_types` (a class attribute, not a field) lists the model types the trainer builds.
    """

    model_type: str
    num_householder: int | None
    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float | None
    seed: int
    precision: str
    log_every: int
    save_every: int
    eval_every: int
    num_v_heads: int | None
    lower_bound: float | None
    eps: float = 1e-8
    model_types: tuple[str, ...] = MODEL_TYPES  # the model types this trainer builds (a class attribute)

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
        if self.model_type not in self.model_types:
            raise error(f"unknown --model-type {self.model_type!r}: choose {', '.join(self.model_types)}")
        if self.num_v_heads is not None and self.model_type not in GROUPED_TYPES:
            raise error(f"--num-v-heads groups value heads in {' and '.join(GROUPED_TYPES)} only: drop it for "
                        f"{self.model_type}")
        if self.lower_bound is not None and self.model_type != "kda":
            raise error(f"--lower-bound bounds kda's per-channel gate only: drop it for {self.model_type}")
        if self.lower_bound is not None and not self.lower_bound < 0:
            raise error(f"--lower-bound must be < 0 (kda's log decay then lies in (lower-bound, 0)), "
                        f"got {self.lower_bound}")
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


def lr_lambda(cfg: RunConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine from lr down to min_lr at the last step (a factor on lr)."""
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(cfg.steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


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


def open_run(out: Path, resume: bool, time_limit_s: float | None = None,
             error: type[TrainError] = TrainError) -> dict | None:
    """Check the run folder (and the time limit) before any work; the saved trainer state when resuming."""
    if time_limit_s is not None and not time_limit_s > 0:
        raise error(f"--time-limit must be > 0 seconds (got {time_limit_s})")
    if not resume:
        if (out / STATE_FILE).exists():
            raise error(f"{out} already holds a training run: pass --resume to continue it or pick another --out")
        return None
    path = out / STATE_FILE
    if not path.is_file():
        raise error(f"{out} has no {STATE_FILE} to resume: drop --resume to start a new run there")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means the state cannot be trusted
        raise error(f"{path} cannot be read safely ({type(err).__name__}): start a new run") from None


@contextmanager
def graceful_stop() -> Iterator[dict[str, bool]]:
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


def rng_state() -> dict:
    """torch's CPU (and, when visible, CUDA) generator states, for trainer_state.pt."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainResult:
    """Where a call stopped: the folder, the step, whether the schedule is done, the last train log line."""

    out: Path
    step: int
    finished: bool
    last: dict


class Run:
    """A run in progress, as the trainer's hooks see it: folder, config, device, model, step, log."""

    def __init__(self, out: Path, cfg: RunConfig, dev: torch.device, elapsed0: float,
                 on_log: Callable[[dict], None] | None) -> None:
        self.out, self.cfg, self.dev = out, cfg, dev
        self.autocast_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
        self.model: torch.nn.Module
        self.step = 0
        self._elapsed0, self._t0 = elapsed0, time.perf_counter()
        self._on_log = on_log
        self._log_file = None

    def elapsed(self) -> float:
        """Training seconds of the whole run (earlier calls included)."""
        return self._elapsed0 + time.perf_counter() - self._t0

    def autocast(self) -> torch.autocast:
        """bf16 autocast for precision bf16, else a disabled one."""
        return torch.autocast(self.dev.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def log(self, entry: dict) -> None:
        """Append one line to train_log.jsonl (flushed) and hand it to `on_log`."""
        assert self._log_file is not None, "Run.log outside execute"
        self._log_file.write(json.dumps(entry) + "\n")
        self._log_file.flush()
        if self._on_log:
            self._on_log(entry)


class Trainer:
    """What one kind of run supplies to `execute`; `cfg` is set by the subclass."""

    cfg: RunConfig
    error: type[TrainError] = TrainError
    desc = "train"  # progress bar label
    sums = 1  # running sums kept between log lines (the first is the loss)

    def prepare(self, run: Run, saved: dict | None) -> None:
        """Before the model is built (e.g. load data, check a resumed run against it)."""

    def build_model(self, fresh: bool) -> torch.nn.Module:
        """The model, on the CPU, right after torch.manual_seed(seed); `fresh` is False when resuming."""
        raise NotImplementedError

    def start(self, run: Run) -> None:
        """After the model is built and the state restored, before the first step (e.g. batch source, files)."""

    def loss(self, run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of optimizer step `step` and `sums` float64 values to add up until the next log line."""
        raise NotImplementedError

    def log_fields(self, sums: list[float]) -> dict:
        """A train log line's metrics from the sums since the last one."""
        return {"loss": sums[0] / sums[1]}

    def postfix(self, entry: dict) -> dict[str, str]:
        """What the progress bar shows of a train log line."""
        return {"loss": f"{entry['loss']:.4f}"}

    def evaluate(self, run: Run, step: int) -> dict | None:
        """A log entry at every eval_every-th and the last step (None: nothing to log)."""
        return None

    def write_files(self, run: Run, step: int) -> None:
        """Files beside each saved checkpoint (e.g. task.json)."""

    def state(self) -> dict:
        """Extra entries of trainer_state.pt (tensors and plain values only)."""
        return {}

    def finish(self, run: Run) -> None:
        """Once the schedule is done, after the last save (e.g. final evaluation, model card)."""


def execute(trainer: Trainer, out: Path, saved: dict | None, *, device: str = "auto", progress: bool = True,
            stop_after: int | None = None, time_limit_s: float | None = None,
            on_log: Callable[[dict], None] | None = None) -> TrainResult:
    """Train `trainer` into `out` from `saved` (open_run's state, None for a new run); see the module doc."""
    cfg = trainer.cfg
    dev = resolve_device(device)
    if cfg.precision == "tf32" and dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run = Run(out, cfg, dev, float(saved.get("elapsed_s", 0.0)) if saved else 0.0, on_log)
    trainer.prepare(run, saved)
    torch.manual_seed(cfg.seed)
    model = run.model = trainer.build_model(saved is None).to(dev)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / LOG_FILE
    window = torch.zeros(trainer.sums, dtype=torch.float64, device=dev)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        if "rng" in saved:
            set_rng_state(saved["rng"])
        if "window" in saved and saved["window"].numel() == trainer.sums:
            window.copy_(saved["window"])
        run.step = int(saved["step"])
        truncate_log(log_path, run.step)
    else:
        log_path.write_text("")
        write_json(out / CONFIG_FILE, cfg.to_dict())
    trainer.start(run)
    step = run.step
    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    saved_at = step if saved is not None else -1
    t0 = run._t0 = time.perf_counter()  # the clock (elapsed_s, time limit) starts at the first step

    def save(at: int) -> None:
        nonlocal saved_at
        saved_at = at
        save_checkpoint(model, out)
        trainer.write_files(run, at)
        state = {"version": 1, "step": at, "config": cfg.to_dict(), "model": model.state_dict(),
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state(),
                 "window": window.cpu(), "elapsed_s": run.elapsed(), **trainer.state()}
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, out / STATE_FILE)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc=trainer.desc, unit="step", dynamic_ncols=True)
    last: dict = {}
    model.train()
    with open(log_path, "a") as log_file:
        run._log_file = log_file
        with graceful_stop() as stop:
            while step < end and not stop["stop"]:
                if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                    break
                loss, sums = trainer.loss(run, step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                sched.step()
                step = run.step = step + 1
                window += sums
                if step % cfg.log_every == 0 or step == cfg.steps:
                    last = {"step": step, "split": "train", **trainer.log_fields(window.tolist()),
                            "lr": sched.get_last_lr()[0], "elapsed_s": round(run.elapsed(), 3)}
                    window.zero_()
                    run.log(last)
                    if bar is not None:
                        bar.set_postfix(**trainer.postfix(last))
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    entry = trainer.evaluate(run, step)
                    if entry is not None:
                        run.log(entry)
                if (cfg.save_every and step % cfg.save_every == 0) or step == end or stop["stop"]:
                    save(step)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        if saved_at != step:
            save(step)
        if step >= cfg.steps:
            trainer.finish(run)
    run._log_file = None
    return TrainResult(out, step, step >= cfg.steps, last)
