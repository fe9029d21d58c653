"""Train a small byte-level language model on the Python standard library (tasks.corpus).

Variants are fla's: DeltaNet (`delta_net`), Gated DeltaNet (`gated_deltanet`), Gated DeltaProduct
(`gated_deltaproduct`, n_h = 2 by default) and Kimi Delta Attention (`kda`: one log decay per key channel),
all with short convolutions as fla trains them. Batches are
random windows of the training split drawn from a generator seeded by (seed, step), so a run is fixed
by its config and `--resume` continues the identical curve. Held-out perplexity is exp(mean next-byte
NLL) over non-overlapping windows of the held-out files.

The run folder holds the checkpoint (config.json + model.safetensors), tokenizer.json, data.json (the
corpus spec: files, split rule, digest), train_config.json, train_log.jsonl, eval.json (final held-out
perplexity), README.md (a model card with the command) and trainer_state.pt (resume state; weights_only).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from deltalab.models.config import ConfigError, ModelConfig
from deltalab.models.lm import DeltaProductForCausalLM
from deltalab.tasks.corpus import (
    DATA_FILE,
    EOS_ID,
    VOCAB_SIZE,
    CorpusError,
    eval_windows,
    load_corpus,
    random_windows,
    write_tokenizer,
)
from deltalab.train.evaluate import perplexity
from deltalab.train.run import Run, RunConfig, Trainer, TrainError, execute, open_run, write_json

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
    output_gate: bool | None = None  # default: fla's (off for delta_net, on for the gated models; kda always)
    num_v_heads: int | None = None  # gated_deltanet, kda: grouped value heads (a multiple of heads)
    lower_bound: float | None = None  # kda: fla's bounded gate, g = lower_bound * sigmoid(...) per key channel
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
    model_types: ClassVar[tuple[str, ...]] = ("gated_deltaproduct", "delta_net", "gated_deltanet", "kda")

    def validate(self) -> None:
        """One-line LMTrainError for settings that cannot work."""
        if self.model_type == "rwkv7":
            raise LMTrainError(f"--model-type rwkv7: the language-model trainer builds {', '.join(self.model_types)}; "
                               "train rwkv7 on a state-tracking task (`deltalab train`)")
        if self.model_type == "kda" and self.output_gate is False:
            raise LMTrainError("kda always has its sigmoid output gate (fla's KDA has no switch): drop "
                               "--no-output-gate")
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
            return ModelConfig(model_type="gated_deltanet", head_dim=cfg.head_dim, expand_v=cfg.expand_v,
                               num_v_heads=cfg.num_v_heads, **common)
        if cfg.model_type == "kda":
            return ModelConfig(model_type="kda", head_dim=cfg.head_dim, expand_v=cfg.expand_v,
                               num_v_heads=cfg.num_v_heads, lower_bound=cfg.lower_bound, **common)
        if cfg.model_type == "gated_deltaproduct":
            return ModelConfig(model_type="gated_deltaproduct", head_dim=cfg.head_dim, expand_v=cfg.expand_v,
                               num_householder=cfg.householders, use_forget_gate=True, **common)
    except ConfigError as err:
        raise LMTrainError(str(err)) from None
    raise LMTrainError(f"--model-type {cfg.model_type!r}: the language-model trainer builds "
                       f"{', '.join(cfg.model_types)}")


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
        ("heads", f"{mcfg.num_key_heads} key / {mcfg.num_value_heads} value" if mcfg.grouped else mcfg.num_heads),
        ("dk / dv", f"{mcfg.head_k_dim} / {mcfg.head_v_dim}"),
        ("n_h", mcfg.num_householder), ("eigenvalues", "[-1, 1]" if mcfg.allow_neg_eigval else "[0, 1]"),
        ("forget gate", "per key channel" if mcfg.gate == "channel" else mcfg.use_forget_gate),
        ("output gate", mcfg.use_output_gate),
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


class LMTrainer(Trainer):
    """A byte-level LM run: random training windows, held-out perplexity, tokenizer/data/eval files and card."""

    error = LMTrainError
    sums = 2  # loss, steps

    def __init__(self, cfg: LMTrainConfig, command: str | None) -> None:
        cfg.validate()
        self.cfg, self.command, self.desc = cfg, command, f"train lm {cfg.model_type}"
        self.final: dict | None = None

    def prepare(self, run: Run, saved: dict | None) -> None:
        cfg = self.cfg
        try:
            self.corpus = load_corpus(cfg.corpus_root, cfg.eval_fraction)
        except CorpusError as err:
            raise LMTrainError(str(err)) from None
        if saved is not None and saved.get("data_digest") not in (None, self.corpus.spec["digest"]):
            raise LMTrainError(f"the corpus at {self.corpus.spec['root']} differs from the one this run started "
                               "on (digest mismatch): resume on the same machine/Python or start a new run")

    def build_model(self, fresh: bool) -> DeltaProductForCausalLM:
        self.mcfg = model_config(self.cfg)
        return DeltaProductForCausalLM(self.mcfg)

    def start(self, run: Run) -> None:
        write_json(run.out / DATA_FILE, {**self.corpus.spec, "context_length": self.cfg.context_length})
        write_tokenizer(run.out)
        self.held_x, self.held_y = eval_windows(self.corpus.eval, self.cfg.context_length, self.cfg.eval_windows)

    def loss(self, run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, y = random_windows(self.corpus.train, cfg.batch_size, cfg.context_length,
                              np.random.default_rng([cfg.seed, step]))
        x, y = torch.from_numpy(x).to(run.dev), torch.from_numpy(y).to(run.dev)
        with run.autocast():
            loss = run.model(x, labels=y).loss
        one = torch.ones((), dtype=torch.float64, device=run.dev)
        return loss, torch.stack([loss.detach().double(), one])

    def evaluate(self, run: Run, step: int) -> dict | None:
        """A quick check on a quarter of the held-out windows; the last step gets the full one in `finish`."""
        if step == self.cfg.steps:
            return None
        quarter = max(1, len(self.held_x) // 4)
        res = perplexity(run.model, self.held_x[:quarter], self.held_y[:quarter], device=run.dev,
                         autocast_dtype=run.autocast_dtype)
        return {"step": step, "split": "eval", **res}

    def state(self) -> dict:
        return {"data_digest": self.corpus.spec["digest"]}

    def finish(self, run: Run) -> None:
        """Held-out perplexity over every eval window: eval.json, a log line and the model card."""
        cfg, dev = self.cfg, run.dev
        final = perplexity(run.model, self.held_x, self.held_y, device=dev, autocast_dtype=run.autocast_dtype)
        self.final = {**final, "windows": int(len(self.held_x)), "context_length": cfg.context_length,
                      "step": run.step}
        write_json(run.out / EVAL_FILE, self.final)
        run.log({"step": run.step, "split": "eval", **self.final})
        n_params = sum(p.numel() for p in run.model.parameters())
        where = (f"{dev.type} ({platform.processor() or platform.machine()})" if dev.type == "cpu"
                 else torch.cuda.get_device_name(dev))
        card = model_card(run.out.name, cfg, self.mcfg, n_params, self.final, self.corpus.spec, self.command,
                          run.elapsed(), where)
        (run.out / CARD_FILE).write_text(card)


def train_lm(cfg: LMTrainConfig, out: str | os.PathLike, *, resume: bool = False, device: str = "auto",
             progress: bool = True, stop_after: int | None = None, time_limit_s: float | None = None,
             command: str | None = None, on_log: Callable[[dict], None] | None = None) -> LMTrainResult:
    """Run (or resume) training into `out`; returns where it stopped (and the final eval when finished).

    `stop_after` (steps) and `time_limit_s` (wall clock) end this call early as if interrupted; the state
    is saved, and `resume=True` continues the identical curve.
    """
    out = Path(out)
    saved = open_run(out, resume, time_limit_s, LMTrainError)
    if saved is not None:
        cfg = LMTrainConfig.from_dict(saved["config"])
    trainer = LMTrainer(cfg, command)
    res = execute(trainer, out, saved, device=device, progress=progress, stop_after=stop_after,
                  time_limit_s=time_limit_s, on_log=on_log)
    return LMTrainResult(res.out, res.step, res.finished, res.last, trainer.final)


__all__ = ["EOS_ID", "LMTrainConfig", "LMTrainError", "LMTrainResult", "model_config", "train_lm"]
