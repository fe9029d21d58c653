"""Capture on models spread over several GPUs: the same store as one GPU, and a model larger than one GPU captured
with reductions. The runs behind tests/store/test_device_map.py.

`run_same`: a random bf16 model (tiny, or the family's transformers default config: OLMo-Hybrid ~7B) is saved with
save_pretrained, then captured through `store.capture` on one device, and with `device_map` "auto" and "balanced"
(accelerate; "auto" fills the first GPU before the next, so a model that fits one GPU stays on it, while "balanced"
splits it). Returns each run's devices and tokens/s and, for every stored variable, the largest difference from the
one-device store (relative to that variable's largest magnitude).

`run_big`: the family's config (default size: Qwen3-Next, 79.7B parameters, 159 GB in bf16) is built on the meta
device, placed over every visible GPU by accelerate's infer_auto_device_map, its weights created at random directly
on their GPUs (the model's own initialiser, no host copy, no disk) and dispatched; then captured with reductions
(states not stored). Returns parameters, placement, tokens/s, GPU memory per device and store bytes per token.

On a machine without GPUs both run on the CPU (a smoke run of the tiny configs).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONFIGS = {"olmo_hybrid": "OlmoHybridConfig", "qwen3_next": "Qwen3NextConfig", "qwen3_5_text": "Qwen3_5TextConfig"}
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
GPUS = torch.cuda.device_count()
DEVICE = "cuda" if GPUS else "cpu"


@dataclass
class Options:
    """One run's settings. `family` None: olmo_hybrid for `run_same`, qwen3_next for `run_big`; `tiny`: TINY's
    config (a smoke run, also on the CPU) instead of the family's default size; `layers`: cut the model to its first
    N layers; `max_memory_gib`: a per-GPU budget for `run_big`'s placement (None: 85% of each GPU's free memory), so
    that a small model is split over the GPUs too; `dir`: where the checkpoint and stores go (removed after)."""

    family: str | None = None
    tiny: bool = False
    layers: int | None = None
    batch: int = 2
    length: int = 1024
    batches: int = 2
    hooks: str = "tokens,q,k,v,beta,g,state,o"
    reduce: str = "ranks,spectra"
    rank_every: int = 1024 if GPUS else 1
    max_memory_gib: float | None = None
    dir: str | None = None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def config(family: str, tiny: bool, layers: int | None):
    """The family's transformers config: its default (real) size, or TINY; `layers` cuts the depth."""
    import transformers as tf

    if family not in CONFIGS:
        raise SystemExit(f"error: --family {family}: choose one of {', '.join(CONFIGS)}")
    extra = dict(TINY, **(TINY_MOE if family == "qwen3_next" else {})) if tiny else {}
    cfg = getattr(tf, CONFIGS[family])(pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    if layers is not None:
        cfg.layer_types = list(cfg.layer_types[:layers])
        cfg.num_hidden_layers = layers
    return cfg


def data(n: int, length: int, vocab: int):
    """Random token sequences (labels ignored): the capture's input."""
    from deltalab.models import IGNORE_INDEX
    from deltalab.store.data import Data

    rng = np.random.default_rng(0)
    doc = np.zeros((n, length), bool)
    doc[:, 0] = True
    return Data(spec=f"random:length={length},samples={n},seed=0", tokens=rng.integers(3, vocab, (n, length),
                dtype=np.int32), labels=np.full((n, length), IGNORE_INDEX, np.int32), doc_start=doc)


def placement(model: Any) -> dict[str, int]:
    """Parameters per device (millions), read from the parameters themselves."""
    per: dict[str, int] = {}
    for p in model.parameters():
        per[str(p.device)] = per.get(str(p.device), 0) + p.numel()
    return {k: round(v / 1e6, 3) for k, v in sorted(per.items())}


def memory() -> dict[str, float]:
    return {f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / 2**30, 2) for i in range(GPUS)}


def reset_memory() -> None:
    for i in range(GPUS):
        torch.cuda.reset_peak_memory_stats(i)


def compare(a_path: Path, b_path: Path) -> dict[str, float]:
    """Largest |a - b| of every float variable, relative to max |a| (0 where identical)."""
    from deltalab import store

    a, b = store.open(a_path), store.open(b_path)
    out = {}
    for name in sorted(a.data_vars):
        x, y = np.asarray(a[name].values), np.asarray(b[name].values)
        if x.shape != y.shape:
            raise SystemExit(f"error: {name} has shape {x.shape} on one device and {y.shape} on several")
        if np.issubdtype(x.dtype, np.floating):
            scale = float(np.nanmax(np.abs(x))) or 1.0
            out[name] = float(np.nanmax(np.abs(x.astype(np.float64) - y))) / scale
        else:
            out[name] = float((x != y).mean())
    return out


def run_same(args: Options) -> dict:
    import transformers as tf

    from deltalab.models.checkpoint import load_checkpoint
    from deltalab.store import capture

    args.family = args.family or "olmo_hybrid"
    root = Path(args.dir or tempfile.mkdtemp(prefix="deltalab-devmap-"))
    ckpt = root / "ckpt"
    torch.manual_seed(0)
    cfg = config(args.family, args.tiny, args.layers)
    with torch.device(DEVICE):  # random init on the GPU: seconds, not minutes on the host
        hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in hf.parameters())
    hf.save_pretrained(ckpt, safe_serialization=True)
    del hf
    log(f"{args.family}: {params / 1e9:.2f}B parameters saved to {ckpt}")
    d = data(args.batch * args.batches, args.length, min(cfg.vocab_size, 32000))
    rows, stores = [], {}
    for label, device_map in (("one device", None), ("device_map auto", "auto"), ("device_map balanced", "balanced")):
        out = root / f"{label.replace(' ', '_')}.zarr"
        model = load_checkpoint(ckpt, device=DEVICE, dtype=torch.bfloat16, device_map=device_map)
        reset_memory()
        t = time.perf_counter()
        summary = capture(ckpt, d, out, model=model, hooks=args.hooks, batch_size=args.batch, device=DEVICE,
                          progress=False, command_line=["tests/store/device_map.py", "same"])
        seconds = time.perf_counter() - t
        rows.append(dict(run=label, placement=placement(model), tok_s=d.tokens.size / seconds,
                         capture_s=summary["seconds"], gpu_peak_gib=memory()))
        stores[label] = out
        del model
        torch.cuda.empty_cache() if GPUS else None
        log(json.dumps(rows[-1]))
    diffs = {label: compare(stores["one device"], stores[label]) for label in stores if label != "one device"}
    shutil.rmtree(root, ignore_errors=True)
    return dict(mode="same", family=args.family, params_b=params / 1e9, batch=args.batch, length=args.length,
                rows=rows, max_rel_diff=diffs)


def random_model_on_devices(cfg, max_fraction: float = 0.85, max_memory_gib: float | None = None):
    """The model of `cfg` in bf16 with random weights created on the devices accelerate assigns them (meta
    device first, so the host never holds the weights), dispatched so that inputs follow the layers. Each GPU's
    budget is `max_memory_gib`, or `max_fraction` of its free memory."""
    import transformers as tf
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights

    with init_empty_weights():  # parameters on the meta device, buffers (rotary frequencies) real
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if GPUS:
        budget = {i: int(max_memory_gib * 2**30 if max_memory_gib else torch.cuda.mem_get_info(i)[0] * max_fraction)
                  for i in range(GPUS)}
    else:
        budget = {"cpu": 1 << 40}
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=model._no_split_modules,
                                       dtype=torch.bfloat16)
    if any(str(v) in ("disk", "cpu") for v in device_map.values()) and GPUS:
        raise SystemExit(f"error: the model does not fit the GPUs' free memory ({budget}): use more GPUs or "
                         "--layers to cut its depth")

    def device_of(name: str):
        while name not in device_map:
            if "." not in name:
                return device_map.get("", "cpu")
            name = name.rsplit(".", 1)[0]
        return device_map[name]

    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            dev = device_of(name)
            dev = f"cuda:{dev}" if isinstance(dev, int) else dev
            value = torch.empty(param.shape, dtype=param.dtype, device=dev).normal_(0, cfg.initializer_range)
            module.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))  # then the model's init
        for module in model.modules():  # the model's own initialiser, module by module, on each device
            model._init_weights(module)
    return dispatch_model(model.eval(), device_map=device_map), device_map


def plain_forward(hf: Any, d: Any, batch: int) -> float:
    """Seconds of the untouched model's forward (logits only) over every batch of `d`, after one warm-up batch."""
    first = next(hf.parameters()).device
    tokens = torch.as_tensor(d.tokens, dtype=torch.long)
    with torch.no_grad():
        hf(tokens[:batch].to(first), use_cache=False)
        torch.cuda.synchronize() if GPUS else None
        t = time.perf_counter()
        for a in range(0, len(tokens), batch):
            hf(tokens[a:a + batch].to(first), use_cache=False)
        torch.cuda.synchronize() if GPUS else None
    return time.perf_counter() - t


def run_big(args: Options) -> dict:
    from deltalab.models.hf.families import FAMILIES
    from deltalab.models.hf.hooked import HookedHFModel
    from deltalab.probes.reduce import CaptureReductions
    from deltalab.store import capture

    args.family = args.family or "qwen3_next"
    cfg = config(args.family, args.tiny, args.layers)
    torch.manual_seed(0)
    t = time.perf_counter()
    hf, device_map = random_model_on_devices(cfg, max_memory_gib=args.max_memory_gib)
    params = sum(p.numel() for p in hf.parameters())
    build_s = time.perf_counter() - t
    log(f"{args.family}: {params / 1e9:.2f}B parameters built on {placement(hf)} (M) in {build_s:.0f} s")
    d = data(args.batch * (args.batches + 1), args.length, min(cfg.vocab_size, 32000))
    plain_s = plain_forward(hf, d, args.batch)  # the peer: the model before deltalab's hooks, same batches
    log(f"plain forward: {d.tokens.size / plain_s:,.0f} tokens/s")
    model = HookedHFModel(hf, FAMILIES[args.family])
    root = Path(args.dir or tempfile.mkdtemp(prefix="deltalab-big-"))
    (root / "ckpt").mkdir(parents=True, exist_ok=True)
    names = args.reduce.split(",")
    red = CaptureReductions(names, device=DEVICE, rank_every=args.rank_every)
    warm = data(args.batch, args.length, min(cfg.vocab_size, 32000))
    capture(root / "ckpt", warm, root / "warm.zarr", model=model, hooks=["tokens", "beta"], batch_size=args.batch,
            device=DEVICE, progress=False, reductions=CaptureReductions(names, device=DEVICE,
                                                                        rank_every=args.rank_every))
    reset_memory()
    out = root / "big.zarr"
    summary = capture(root / "ckpt", d, out, model=model, hooks=["tokens", "beta"], batch_size=args.batch,
                      device=DEVICE, progress=False, reductions=red,
                      command_line=["tests/store/device_map.py", "big"])
    seconds = summary["seconds"] - red.seconds["finish"]
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    from deltalab import store

    finite = float(np.isfinite(np.asarray(store.open(out)["beta"].values)).mean())  # the random model is sane
    row = dict(mode="big", family=args.family, params_b=params / 1e9, build_s=build_s, placement=placement(hf),
               batch=args.batch, length=args.length, reduce=names, tok_s=d.tokens.size / seconds,
               plain_tok_s=d.tokens.size / plain_s, x_plain=plain_s / seconds,
               reduce_s=red.seconds["batches"], gpu_peak_gib=memory(), store_bytes_per_token=size / d.tokens.size,
               finite_beta=finite,
               layers_per_device={str(v): sum(1 for k, x in device_map.items() if x == v and ".layers." in f".{k}.")
                                  for v in sorted(set(device_map.values()), key=str)})
    shutil.rmtree(root, ignore_errors=True)
    return row
