"""Where the hooked-vs-plain logits gap of a random Kimi Linear model comes from: `python scripts/kimi_gap.py`.

`benchmarks.hf_capture --family kimi_linear` (bf16, random weights) found deltalab's hooked logits 0.25 (relative,
Frobenius) from the plain transformers forward while the two KDA kernels agree to bf16 rounding. This script
builds a smaller random Kimi Linear model from `KimiLinearConfig` (CPU: seconds; CUDA when available), wraps it
in `models.hf.hooked.HookedHFModel` as the benchmark and `models.load_checkpoint` do, and prints per variant:

- `plain~hooked`: logits of the plain transformers forward vs deltalab's hooked forward, same weights and dtype;
- `flips`: share of (token, MoE layer) pairs whose router top-k expert set differs between the two runs;
- `forced`: hooked logits again with every router made to pick the plain run's experts (its own weights for
  them): the gap that remains without routing flips;
- `plain~fp32`, `hooked~fp32`: the plain and the hooked bf16 forward vs the plain float32 forward of the same
  weights (bf16's own error; the float32 rows leave them empty);
- per-layer: the first linear layer's attention output (kernel-level agreement) and each decoder layer's output.

Variants: `moe` (as configured: layer 0 dense, the rest 8-expert top-2 MoE, as the benchmark), `dense` (every
layer a dense MLP, `mlp_layer_types`) and `all-experts` (MoE with num_experts_per_token = num_experts: the top-k
set can not flip), each in bfloat16 and float32. Without fla, transformers' plain forward runs its own torch KDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def config(variant: str, hidden: int, layers: int, heads: int, head_dim: int, experts: int, topk: int, vocab: int):
    """The benchmark's Kimi Linear shape (benchmarks.hf_capture._model) at a smaller size."""
    import transformers as tf

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    mlp = None if variant != "dense" else ["dense"] * layers  # None: the default, layer 0 dense, the rest MoE
    return tf.KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128), intermediate_size=hidden * 3, layer_types=types,
        mlp_layer_types=mlp, pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_num_heads=heads,
        linear_head_dim=head_dim, num_experts=experts, num_experts_per_token=experts if variant == "all-experts" else
        topk, moe_intermediate_size=hidden, num_expert_group=1, topk_group=1, kv_lora_rank=min(256, hidden // 2),
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)


def build(cfg, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Random weights drawn in float32 (the same for every dtype), then held in `dtype` as from_config(dtype=)
    holds them (the router's weight and bias stay float32: `_keep_in_fp32_modules_strict`)."""
    import transformers as tf

    torch.manual_seed(seed)
    with torch.device(DEVICE):
        ref = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.load_state_dict(ref.state_dict())
    return model.eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


class Recorder:
    """Decoder-layer outputs, first attention outputs and router top-k sets of one forward; optionally forces
    every router to pick given experts (weights recomputed from its own scores for those experts)."""

    def __init__(self, hf: torch.nn.Module, force: dict[int, torch.Tensor] | None = None) -> None:
        self.layers: dict[int, torch.Tensor] = {}
        self.mixers: dict[int, torch.Tensor] = {}
        self.topk: dict[int, torch.Tensor] = {}
        self.force = force
        self.handles = []
        for i, layer in enumerate(hf.model.layers):
            self.handles.append(layer.register_forward_hook(self._keep(self.layers, i)))
            self.handles.append(layer.self_attn.register_forward_hook(self._keep(self.mixers, i)))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.handles.append(gate.register_forward_hook(self._router(i, gate)))

    @staticmethod
    def _keep(where: dict, i: int):
        def hook(_mod, _args, out):
            where[i] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        return hook

    def _router(self, i: int, gate):
        def hook(_mod, _args, out):
            logits, weights, idx = out
            if self.force is not None:
                idx = self.force[i]
                weights = logits.sigmoid().gather(1, idx)
                if gate.norm_topk_prob:
                    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
                weights = weights * gate.routed_scaling_factor
                out = (logits, weights, idx)
            self.topk[i] = idx.sort(-1).values.detach().clone()
            return out
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run(model, ids, force=None):
    hf = model.hf if hasattr(model, "hf") else model
    rec = Recorder(hf, force)
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits.float()
    finally:
        rec.remove()
    return logits, rec


def compare(variant: str, dtype: torch.dtype, args, ids, fp32_plain: torch.Tensor | None):
    from models.hf.families import FAMILIES
    from models.hf.hooked import HookedHFModel

    cfg = config(variant, args.hidden, args.layers, args.heads, args.head_dim, args.experts, args.topk, args.vocab)
    hf = build(cfg, dtype)
    plain, p = run(hf, ids)
    hooked_model = HookedHFModel(hf, FAMILIES["kimi_linear"])
    hooked, h = run(hooked_model, ids)
    moe = sorted(p.topk)
    flips = [(p.topk[i] != h.topk[i]).any(-1) for i in moe]
    forced, f = run(hooked_model, ids, force=p.topk) if moe else (hooked, h)
    hooked_model.detach_hooks()
    first_linear = cfg.layer_types.index("linear_attention")
    row = dict(
        variant=variant, dtype=str(dtype).removeprefix("torch."), gap=rel(hooked, plain),
        flips=float(torch.cat(flips).float().mean()) if moe else float("nan"),
        flip_tokens=int(sum(int(x.sum()) for x in flips)), pairs=int(sum(x.numel() for x in flips)),
        forced=rel(forced, plain), bf16_fp32=rel(plain, fp32_plain) if fp32_plain is not None else float("nan"),
        hooked_fp32=rel(hooked, fp32_plain) if fp32_plain is not None else float("nan"),
        kernel=rel(h.mixers[first_linear], p.mixers[first_linear]),
        per_layer=[rel(h.layers[i], p.layers[i]) for i in sorted(p.layers)],
        per_layer_forced=[rel(f.layers[i], p.layers[i]) for i in sorted(p.layers)],
        flips_per_layer={i: float(x.float().mean()) for i, x in zip(moe, flips)},
    )
    return row, plain


def main(argv: list[str] | None = None) -> list[dict]:
    """Print the table; returns its rows (bf16 then float32 per variant)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--variants", default="moe,dense,all-experts")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the kernel fallback notices: the header names the plain path's kernel
    try:
        return _table(args)
    finally:
        hf_logging.set_verbosity(verbosity)


def _table(args) -> list[dict]:
    import importlib.util

    fla = importlib.util.find_spec("fla") is not None
    torch.manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.batch, args.length), device=DEVICE)
    print(f"device {DEVICE}, plain KDA kernel: {'fla (Triton)' if fla else 'transformers torch'}; hidden "
          f"{args.hidden} x {args.layers} layers, {args.heads} KDA heads of {args.head_dim}, {args.experts} experts "
          f"top-{args.topk}, B={args.batch} T={args.length}; relative Frobenius differences vs the plain forward")
    print(f"{'variant':<12} {'dtype':<9} {'plain~hooked':>12} {'flips':>14} {'forced':>9} {'plain~fp32':>10} "
          f"{'hooked~fp32':>11} {'attn L0':>8}  per decoder layer: hooked; forced")
    rows = []
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        row32, plain32 = compare(variant, torch.float32, args, ids, None)
        row16, _ = compare(variant, torch.bfloat16, args, ids, plain32)
        rows += [row16, row32]
        for row in (row16, row32):
            flips = (f"{row['flips']:.2%} ({row['flip_tokens']})" if row["pairs"] else "-")
            layers = " ".join(f"{x:.1e}" for x in row["per_layer"])
            forced = " ".join(f"{x:.1e}" for x in row["per_layer_forced"])
            print(f"{row['variant']:<12} {row['dtype']:<9} {row['gap']:>12.2e} {flips:>14} {row['forced']:>9.2e} "
                  f"{row['bf16_fp32']:>10.2e} {row['hooked_fp32']:>11.2e} {row['kernel']:>8.1e}  {layers}; {forced}")
        per = ", ".join(f"L{i} {x:.2%}" for i, x in row16["flips_per_layer"].items()) or "no MoE layer"
        print(f"{'':<12} bf16 flips per MoE layer: {per} ({time.perf_counter() - t0:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
