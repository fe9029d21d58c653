"""Key/query channel pruning study (state-reduction paper): every method at every compression.

`deltalab prune CHECKPOINT` (= `python -m deltalab.train.prune_study CHECKPOINT`) scores key channels per head
with each method of `train.prune`, cuts the checkpoint to the reduced key head dim and measures:

- held-out perplexity (language models: the held-out files of the corpus in data.json beside the
  checkpoint; state-tracking models: perplexity over the label classes and token accuracy on fresh
  task sequences at the training length);
- rank utilisation of the state, stable rank / min(dk', dv), and the stable rank itself, averaged over
  tokens, heads and layers of a few held-out windows (kernels.ranks.chunk; chunk-boundary states replayed);
- forward throughput of the whole model and of the sequence mixer alone at the reduced key dim.

Calibration data (S-Wanda, gradient, DRRQR, PCA) comes from the training split (LM) or from a task
stream disjoint from the evaluation one. Results: a table (rich), `--json` records on stdout with
`method`, `compression` (a fraction) and `perplexity` among their fields, and `--out FILE` (records plus
the command and settings). `--save-dir DIR` writes every pruned checkpoint as DIR/<method>-<percent>/.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltalab.models.run_files import TASK_FILE, clean_json, deltalab_version, read_task_file, training_length
from deltalab.store.cliparse import OneLineParser
from deltalab.tasks.corpus import DATA_FILE, TOKENIZER_FILE, load_corpus, random_windows
from deltalab.tasks.corpus import eval_windows as held_windows
from deltalab.train.evaluate import perplexity

NAME = "prune"
DEFAULT_COMPRESSIONS = (0.0, 0.3, 0.4, 0.5, 0.75)


class StudyError(ValueError):
    """Bad input to the pruning study; one line that names the fix."""


@dataclass
class StudyData:
    """Calibration and evaluation token windows (int64 [N, L]); num_classes set for task models."""

    calib_x: torch.Tensor
    calib_y: torch.Tensor
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    num_classes: int | None = None
    spec: dict[str, Any] = field(default_factory=dict)


def lm_data(checkpoint: Path, context_length: int | None, calib_windows: int, eval_windows: int,
            seed: int) -> StudyData:
    """Windows of the corpus named in data.json beside the checkpoint (default: this Python's stdlib)."""
    spec: dict[str, Any] = {}
    path = checkpoint / DATA_FILE
    if path.is_file():
        try:
            spec = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise StudyError(f"{path} is not valid JSON: restore it or delete it to use the default corpus") from None
    root = spec.get("root")
    if root and not Path(root).is_dir():
        root = None  # another machine: the stdlib of this interpreter, checked by digest below
    corpus = load_corpus(root, spec.get("eval_fraction", 0.05))
    length = context_length or int(spec.get("context_length", 256))
    cx, cy = random_windows(corpus.train, calib_windows, length, np.random.default_rng([seed, 99]))
    ex, ey = held_windows(corpus.eval, length, eval_windows)
    info = {"kind": "lm", "corpus": corpus.spec["name"], "python": corpus.spec["python"],
            "digest": corpus.spec["digest"], "context_length": length, "calib_windows": calib_windows,
            "eval_windows": int(len(ex)),
            "matches_training_corpus": spec.get("digest") in (None, corpus.spec["digest"])}
    return StudyData(torch.from_numpy(cx), torch.from_numpy(cy), torch.from_numpy(ex), torch.from_numpy(ey), None, info)


def task_data(checkpoint: Path, task_name: str | None, length: int | None, calib_samples: int, eval_samples: int,
              seed: int) -> StudyData:
    """Task sequences at the training length: calibration and evaluation from disjoint seeded streams."""
    from deltalab.tasks.state_tracking import get_task
    from deltalab.train.evaluate import eval_batch

    name = task_name or read_task_file(checkpoint).get("name")
    if not name:
        raise StudyError(f"{checkpoint} has no {TASK_FILE}: pass --task NAME")
    task = get_task(name)
    length = length or training_length(checkpoint) or 128
    task.check(length, max(calib_samples, eval_samples))
    cx, cy = task.sample(np.random.default_rng([seed, 5, length]), length, calib_samples)
    ex, ey = eval_batch(task, length, eval_samples, seed)
    info = {"kind": "task", "task": task.name, "length": length, "calib_samples": calib_samples,
            "eval_samples": eval_samples}
    return StudyData(torch.from_numpy(cx), torch.from_numpy(cy), ex, ey, task.num_classes, info)


# --- measurements ---------------------------------------------------------------------------------

def evaluate(model: torch.nn.Module, data: StudyData, batch_size: int, device: torch.device) -> dict[str, Any]:
    """Perplexity (over the label classes for tasks) and, for tasks, token accuracy."""
    task = data.num_classes is not None
    res = perplexity(model, data.eval_x, data.eval_y, batch_size, device, num_classes=data.num_classes,
                     with_accuracy=task)
    return {"nll": res["nll"], "perplexity": res["perplexity"], "eval_tokens": res["tokens"],
            "accuracy": res["accuracy"] if task else None}


@torch.no_grad()
def state_ranks(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Mean rank utilisation, stable rank and entropy effective rank of every token's state."""
    from deltalab.kernels.ranks.chunk import state_rank_metrics

    grabbed: dict[str, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(model.layers):
        for name in ("hook_k", "hook_v", "hook_beta", "hook_g", "hook_state"):
            hooks.append(getattr(block.attn, name).register_forward_hook(
                lambda mod, args, out, key=f"{i}.{name}": grabbed.__setitem__(key, out.detach())))
    try:
        model(x.to(device))
    finally:
        for h in hooks:
            h.remove()
    util, stable, erank = [], [], []
    for i in range(len(model.layers)):
        m = state_rank_metrics(grabbed[f"{i}.hook_k"].float(), grabbed[f"{i}.hook_v"].float(),
                               grabbed[f"{i}.hook_beta"].float(),
                               grabbed[f"{i}.hook_g"].float() if f"{i}.hook_g" in grabbed else None,
                               grabbed[f"{i}.hook_state"].float())
        util.append(float(m.rank_utilisation.mean()))
        stable.append(float(m.stable_rank.mean()))
        erank.append(float(m.erank.mean()))
    return {"rank_utilisation": float(np.mean(util)), "stable_rank": float(np.mean(stable)),
            "erank": float(np.mean(erank)), "rank_utilisation_per_layer": util}


def _timed(fn, repeats: int, device: torch.device) -> float:
    """Best wall time of `repeats` calls after one warm-up."""
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def model_throughput(model: torch.nn.Module, batch: int, length: int, device: torch.device, repeats: int = 3) -> float:
    """Forward tokens per second of the whole model on random tokens."""
    x = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    return batch * length / _timed(lambda: model(x), repeats, device)


@torch.no_grad()
def mixer_throughput(config, batch: int, length: int, device: torch.device, repeats: int = 3) -> float:
    """Tokens per second of the sequence mixer alone (the chunked delta product) at the config's dk, dv."""
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward
    from deltalab.kernels.delta_rule.naive import l2_normalize

    H, n_h, dk, dv = config.num_heads, config.num_householder, config.head_k_dim, config.head_v_dim
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, k = l2_normalize(rnd(batch, length, H, dk)), l2_normalize(rnd(batch, length, n_h, H, dk))
    v, beta = rnd(batch, length, n_h, H, dv), torch.rand(batch, length, n_h, H, generator=gen).to(device)
    g = -torch.rand(batch, length, H, generator=gen).to(device) if config.use_forget_gate else None
    return batch * length / _timed(lambda: delta_product_forward(q, k, v, beta, g, scale=dk**-0.5), repeats, device)


# --- the study ------------------------------------------------------------------------------------

@dataclass
class StudySettings:
    methods: list[str]
    compressions: list[float]
    batch_size: int = 16
    rank_windows: int = 4
    rrqr_rows: int = 5000
    rrqr_f: float = 1.5
    seed: int = 0
    throughput: bool = True
    throughput_batch: int = 8
    save_dir: str | None = None
    keep_scale: bool = False


def run_study(model, data: StudyData, settings: StudySettings, device: torch.device, model_name: str = "model",
              checkpoint: Path | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Baseline, then every method at every compression: one record each (see the module docstring)."""
    from deltalab.models import save_checkpoint
    from deltalab.train.prune import collect_calibration, gradient_scores, kept_dim, prune

    cfg = model.config
    dk, dv = cfg.head_k_dim, cfg.head_v_dim
    length = data.eval_x.shape[1]
    rank_x = data.eval_x[: settings.rank_windows]
    common = {"model": model_name, "model_type": cfg.model_type, "num_householder": cfg.num_householder,
              "head_dim": dk, "head_v_dim": dv, "seed": settings.seed, "device": str(device),
              "keep_scale": settings.keep_scale}

    def measure(m) -> dict[str, Any]:
        out = evaluate(m, data, settings.batch_size, device)
        out.update(state_ranks(m, rank_x, device))
        return out

    base = measure(model)
    by_dim = {dk: model}  # one model per kept head dim, for the throughput measurements at the end
    records = [{**common, "method": "baseline", "compression": 0.0, "head_dim_kept": dk, **base,
                "perplexity_change": 0.0, "select_s": 0.0}]
    calib = None
    if any(mth not in ("l1", "random") for mth in settings.methods):
        calib = collect_calibration(model, data.calib_x, settings.batch_size, settings.rrqr_rows, settings.seed,
                                    progress=progress)
        if "grad" in settings.methods:
            calib.grad_scores = gradient_scores(model, data.calib_x, data.calib_y, settings.batch_size,
                                                data.num_classes, progress=progress)
    jobs = [(c, mth) for c in settings.compressions for mth in settings.methods]
    it = jobs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(jobs, desc="prune", unit="model")
    for compression, method in it:
        kept_dim(dk, compression)  # validates
        t0 = time.perf_counter()
        pruned, plan = prune(model, method, compression, calib, settings.seed, settings.rrqr_f, settings.keep_scale)
        select_s = time.perf_counter() - t0
        res = measure(pruned)
        by_dim.setdefault(plan.kept, pruned)
        rec = {**common, "method": method, "compression": compression, "head_dim_kept": plan.kept, **res,
               "perplexity_change": res["perplexity"] / base["perplexity"] - 1, "select_s": select_s,
               "calib_tokens": calib.tokens if calib is not None else 0}
        if settings.save_dir:
            folder = Path(settings.save_dir) / f"{method}-{round(compression * 100)}"
            save_checkpoint(pruned, folder)
            _copy_beside(checkpoint, folder)
            rec["checkpoint"] = str(folder)
        records.append(rec)
    speeds = throughputs(by_dim, settings.throughput_batch, length, device) if settings.throughput else {}
    for rec in records:
        rec.update(_speedups(speeds.get(rec["head_dim_kept"], {}), speeds.get(dk, {})))
    return records


def throughputs(models: dict[int, Any], batch: int, length: int, device: torch.device,
                rounds: int = 5) -> dict[int, dict[str, float]]:
    """Whole-model and mixer tokens/s per key head dim, interleaved over rounds (best of each): load drift
    on a shared machine hits every head dim alike."""
    best: dict[int, dict[str, float]] = {d: {"tokens_per_s": 0.0, "mixer_tokens_per_s": 0.0} for d in models}
    for _ in range(rounds):
        for d, m in models.items():
            best[d]["tokens_per_s"] = max(best[d]["tokens_per_s"], model_throughput(m, batch, length, device, 1))
            best[d]["mixer_tokens_per_s"] = max(best[d]["mixer_tokens_per_s"],
                                                mixer_throughput(m.config, batch, length, device, 1))
    return best


def _speedups(s: dict[str, float], base: dict[str, float]) -> dict[str, float | None]:
    if not s or not base:
        return {"tokens_per_s": None, "speedup": None, "mixer_tokens_per_s": None, "mixer_speedup": None}
    return {"tokens_per_s": s["tokens_per_s"], "speedup": s["tokens_per_s"] / base["tokens_per_s"],
            "mixer_tokens_per_s": s["mixer_tokens_per_s"],
            "mixer_speedup": s["mixer_tokens_per_s"] / base["mixer_tokens_per_s"]}


def _copy_beside(source: Path | None, folder: Path) -> None:
    """tokenizer.json, data.json and task.json travel with a pruned checkpoint."""
    if source is None:
        return
    for name in (TOKENIZER_FILE, DATA_FILE, TASK_FILE):
        if (source / name).is_file():
            (folder / name).write_bytes((source / name).read_bytes())


# --- presentation -----------------------------------------------------------------------------------

HEADERS = ["Method", "Compr.", "dk'", "ppl", "Δppl", "acc", "rank util", "stable rank", "tok/s", "speedup",
           "mixer speedup"]


def _rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells, ordered like the paper's Table 9 (highest compression first, baseline last)."""
    has_acc = any(r.get("accuracy") is not None for r in records)
    ordered = sorted((r for r in records if r["method"] != "baseline"), key=lambda r: (-r["compression"], r["method"]))
    ordered += [r for r in records if r["method"] == "baseline"]
    rows = []
    for r in ordered:
        rows.append([r["method"], f"{r['compression']:.0%}", str(r["head_dim_kept"]), f"{r['perplexity']:.4g}",
                     f"{r['perplexity_change']:+.1%}", _f(r.get("accuracy"), ".4f"),
                     _f(r.get("rank_utilisation"), ".3f"), _f(r.get("stable_rank"), ".2f"),
                     _f(r.get("tokens_per_s"), ",.0f"), _f(r.get("speedup"), ".2f"), _f(r.get("mixer_speedup"), ".2f")])
    keep = [i for i, h in enumerate(HEADERS) if h != "acc" or has_acc]
    return [HEADERS[i] for i in keep], [[row[i] for i in keep] for row in rows]


def table(records: list[dict[str, Any]], title: str):
    """A rich Table of the records, one section per compression."""
    from rich.table import Table

    headers, rows = _rows(records)
    t = Table(title=title)
    for col in headers:
        t.add_column(col, justify="left" if col == "Method" else "right")
    last = None
    for row in rows:
        if last is not None and row[1] != last:
            t.add_section()
        last = row[1]
        t.add_row(*row)
    return t


def markdown(records: list[dict[str, Any]]) -> str:
    """The same table as GitHub markdown (for model cards and notes)."""
    headers, rows = _rows(records)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _f(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


# --- command line ---------------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    try:
        vals = [float(v) / (100 if float(v) >= 1 else 1) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: write fractions like 0,0.3,0.5,0.75") from None
    if not vals or any(not 0 <= v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"compressions {text!r} must lie in [0, 1), e.g. 0,0.3,0.5,0.75")
    return vals


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="deltalab prune", description=(__doc__ or "").splitlines()[0])
    p.add_argument("checkpoint", help="checkpoint folder (config.json + model.safetensors)")
    p.add_argument("--methods", default="all", help="comma-separated: l1,random,wanda,grad,drrqr,pca (default all)")
    p.add_argument("--compressions", type=_floats, default=list(DEFAULT_COMPRESSIONS),
                   help="fractions of key channels removed per head, or percents >= 1 (default 0,0.3,0.4,0.5,0.75)")
    p.add_argument("--task", default=None, help="state-tracking task (default: task.json beside the checkpoint; "
                                                "without one the model is treated as a language model)")
    p.add_argument("--length", type=int, default=None, help="task sequence length (default: the training length)")
    p.add_argument("--context-length", type=int, default=None, help="LM window (default: data.json, else 256)")
    p.add_argument("--calib-windows", type=int, default=32, help="calibration sequences (default 32)")
    p.add_argument("--eval-windows", type=int, default=128, help="evaluation sequences (default 128)")
    p.add_argument("--rank-windows", type=int, default=4, help="sequences for the state rank (default 4)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rrqr-rows", type=int, default=5000, help="sampled key and query rows for DRRQR (each)")
    p.add_argument("--rrqr-f", type=float, default=1.5, help="strong RRQR tolerance f >= 1 (default 1.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-throughput", action="store_true", help="skip the throughput measurements")
    p.add_argument("--throughput-batch", type=int, default=8, help="sequences per timed forward (default 8)")
    p.add_argument("--keep-scale", action="store_true",
                   help="keep the original attention scale (folded into norm_eps) instead of fla's dk'**-0.5")
    p.add_argument("--save-dir", default=None, help="write each pruned checkpoint to DIR/<method>-<percent>/")
    p.add_argument("--out", default=None, help="write the records, command and settings to this JSON file")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list on stdout")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (for model cards)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the study from the command line; one-line errors, exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    from deltalab.models import CheckpointError, load_checkpoint
    from deltalab.tasks.corpus import CorpusError
    from deltalab.tasks.state_tracking import TaskError
    from deltalab.train.prune import PruneError, parse_methods
    from deltalab.train.run import resolve_device

    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        for name in ("calib_windows", "eval_windows", "rank_windows", "batch_size", "rrqr_rows", "throughput_batch"):
            if getattr(args, name) < 1:
                raise StudyError(f"--{name.replace('_', '-')} must be >= 1")
        if args.rrqr_f < 1:
            raise StudyError("--rrqr-f must be >= 1")
        device = resolve_device(args.device)
        methods = parse_methods(args.methods)
        ckpt = Path(args.checkpoint)
        model = load_checkpoint(ckpt, device=device)
        cfg = model.config
        if getattr(cfg, "family", None) or cfg.hybrid or cfg.grouped:
            raise StudyError(f"{ckpt}: the pruning study takes fla-format models without softmax-attention layers "
                             "or grouped value heads; pass such a checkpoint")
        torch.manual_seed(args.seed)
        if args.task or (ckpt / TASK_FILE).is_file():
            data = task_data(ckpt, args.task, args.length, args.calib_windows, args.eval_windows, args.seed)
        else:
            data = lm_data(ckpt, args.context_length, args.calib_windows, args.eval_windows, args.seed)
        if int(max(data.eval_x.max(), data.calib_x.max())) >= model.config.vocab_size:
            raise StudyError(f"the data has token ids beyond the model's vocabulary ({model.config.vocab_size}): "
                             "pass the checkpoint's task or corpus")
        settings = StudySettings(methods, args.compressions, args.batch_size, args.rank_windows, args.rrqr_rows,
                                 args.rrqr_f, args.seed, not args.no_throughput, args.throughput_batch,
                                 save_dir=args.save_dir,
                                 keep_scale=args.keep_scale)
        records = run_study(model, data, settings, device, ckpt.resolve().name, ckpt, progress=not args.no_progress)
    except (StudyError, PruneError, CheckpointError, CorpusError, TaskError, ValueError, OSError) as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    records = clean_json(records)
    if args.out:
        doc = {"command": "deltalab prune " + " ".join(shlex.quote(a) for a in argv),
               "checkpoint": str(args.checkpoint), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "deltalab_version": deltalab_version(), "torch": torch.__version__, "device": str(device),
               "data": clean_json(data.spec), "settings": clean_json(vars(settings)), "records": records}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
    if args.json:
        print(json.dumps(records, indent=1))
    elif args.markdown:
        print(markdown(records), end="")
    else:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 150)
        console.print(table(records, f"key/query pruning of {Path(args.checkpoint).resolve().name} "
                                       f"({data.spec.get('kind')}, {records[0]['eval_tokens']:,} eval tokens)"))
        if args.out:
            console.print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
