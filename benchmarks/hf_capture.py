"""Capture cost on a transformers delta-rule model: `python -m benchmarks.hf_capture [--family F] [--quick]`.

A random model built from its Config class, bf16, on the GPU, one softmax-attention layer in four: OLMo-Hybrid
(default; beta in (0, 2), grouped heads), Qwen3.5 (`--family qwen3_5_text`, grouped heads) or Kimi Linear
(`--family kimi_linear`, per-channel gates: deltalab's Triton KDA forward, `kernels.delta_rule.triton_kda`). Timed per
batch (B x T tokens):
- `plain`: the untouched transformers forward (fla's Triton kernels when fla is importable, else its torch path);
- `hooked`: the same model with deltalab's hooks attached (deltalab's kernel, chunk-boundary states), no nnsight;
- `capture`: hooked under nnsight, caching q, k, v, beta, g and state of every linear layer (what
  `deltalab capture` computes per batch, before the device-to-host copy);
- `capture+host`: the same plus their copy into pinned host memory (asynchronous, as `store.capture`).
Accuracy: hooked vs plain logits (relative error, Frobenius), and the first linear layer's captured inputs
run through kernels.delta_rule.naive in float64 against the hooked kernel output. Kimi Linear's bf16 logits differ far
more than its kernels do because its random MoE routers flip on bf16 differences (the hooked and plain forwards
agree in float32).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _default_model(family: str):
    """The family's transformers default config (OLMo-Hybrid ~7B, Qwen3.5 ~9B parameters), random weights."""
    import transformers as tf

    cls = {"olmo_hybrid": tf.OlmoHybridConfig, "qwen3_5_text": tf.Qwen3_5TextConfig}.get(family)
    if cls is None:
        raise SystemExit(f"error: --default-config takes olmo_hybrid or qwen3_5_text, not {family}")
    cfg = cls(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device(DEVICE):
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _model(family: str, hidden: int, layers: int, k_heads: int, v_heads: int, head_dim: int):
    import transformers as tf

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    common = dict(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 128,
                  num_key_value_heads=hidden // 128, intermediate_size=hidden * 3, layer_types=types,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gdn = dict(linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=head_dim,
               linear_value_head_dim=head_dim)
    if family == "olmo_hybrid":
        cfg = tf.OlmoHybridConfig(**common, **gdn)
    elif family == "qwen3_5_text":
        cfg = tf.Qwen3_5TextConfig(**common, **gdn, head_dim=128)
    elif family == "kimi_linear":
        cfg = tf.KimiLinearConfig(**common, linear_num_heads=v_heads, linear_head_dim=head_dim, num_experts=8,
                                  num_experts_per_token=2, moe_intermediate_size=hidden, num_expert_group=1,
                                  topk_group=1, kv_lora_rank=256, qk_rope_head_dim=64, v_head_dim=128,
                                  qk_nope_head_dim=128)
    else:
        raise SystemExit(f"error: --family {family} is not one of olmo_hybrid, qwen3_5_text, kimi_linear")
    with torch.device(DEVICE):  # random init on the GPU: seconds, not a minute on the host
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, reps: int) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--family", default="olmo_hybrid", help="olmo_hybrid (default), qwen3_5_text or kimi_linear")
    p.add_argument("--default-config", action="store_true",
                   help="the family's transformers default config (real size: OLMo-Hybrid ~7B, Qwen3.5 ~9B)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from nnsight import NNsight

    from deltalab.kernels.delta_rule.naive import naive_delta_product
    from deltalab.models.hf.families import FAMILIES
    from deltalab.models.hf.hooked import HookedHFModel

    shape = dict(hidden=512, layers=4, k_heads=4, v_heads=8, head_dim=64) if args.quick else \
        dict(hidden=2048, layers=8, k_heads=8, v_heads=16, head_dim=128)
    B, T, reps = (2, 512, 3) if args.quick else (4, 2048, 3)
    torch.manual_seed(0)
    hf = _default_model(args.family) if args.default_config else _model(args.family, **shape)
    text = hf.config.get_text_config()
    shape = dict(hidden=text.hidden_size, layers=text.num_hidden_layers, params_b=sum(p.numel() for p in
                 hf.parameters()) / 1e9) if args.default_config else shape
    ids = torch.randint(1, min(32000, text.vocab_size), (B, T), device=DEVICE)
    fla = importlib.util.find_spec("fla") is not None  # transformers then runs fla's Triton kernels
    with torch.no_grad():
        plain_s = _time(lambda: hf(ids, use_cache=False), reps)
        ref = hf(ids, use_cache=False).logits.float()
        model = HookedHFModel(hf, FAMILIES[args.family])
        hooked_s = _time(lambda: model(ids), reps)
        got = model(ids).logits.float()
        nn = NNsight(model)
        lin = model.config.delta_layers
        names = ("q", "k", "v", "beta", "g", "state")
        flat = [getattr(nn.layers[i].attn, f"hook_{n}") for i in lin for n in names]

        def capture(host: bool):
            with nn.trace(ids) as tracer:
                cache = tracer.cache(modules=flat, device=None)
            if host:  # as store.capture does: pinned host buffers, asynchronous copies, one event
                outs = [cache[e.path].output for e in flat]
                pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=DEVICE == "cuda") for t in outs]
                for dst, src in zip(pinned, outs):
                    dst.copy_(src, non_blocking=True)
            return cache

        capture_s = _time(lambda: capture(False), reps)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        host_s = _time(lambda: capture(True), reps)
        peak_gb = torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else float("nan")
        cache = capture(False)
        cached = [cache[e.path].output for e in flat]
        bytes_as_cached = sum(t.numel() * t.element_size() for t in cached) / (B * T)
        bytes_float32 = sum(t.numel() * 4 for t in cached) / (B * T)  # `deltalab capture --dtype float32`
        attn = nn.layers[lin[0]].attn
        saved: dict[str, torch.Tensor] = {}
        with nn.trace(ids[:1, :256]):
            for n in ("q", "k", "v", "beta", "g", "o"):
                saved[n] = getattr(attn, f"hook_{n}").output.save()
        del cache, cached
    head_map = torch.tensor(model.config.key_head_of, device=DEVICE)
    q = saved["q"].double()[:, :, head_map]
    k = saved["k"].double()[:, :, :, head_map]
    o64, _, _ = naive_delta_product(q, k, saved["v"].double(), saved["beta"].double(), saved["g"].double(),
                                    scale=model.config.head_k_dim ** -0.5)
    tokens = B * T
    out = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "family": args.family,
        "shape": shape, "batch": B, "length": T,
        "transformers_kernel": "fla (Triton)" if fla else "torch fallback",
        "plain_ms": plain_s * 1e3, "hooked_ms": hooked_s * 1e3, "capture_ms": capture_s * 1e3,
        "capture_host_ms": host_s * 1e3,
        "plain_tok_s": tokens / plain_s, "capture_host_tok_s": tokens / host_s,
        "capture_over_plain": host_s / plain_s, "capture_share_of_plain_tok_s": plain_s / host_s,
        "gpu_peak_gb_capture": peak_gb, "captured_bytes_per_token": bytes_as_cached,
        "store_bytes_per_token_float32": bytes_float32,
        "logits_rel_err": float((got - ref).norm() / ref.norm()),
        "kernel_vs_float64_rel_err": float((saved["o"].double() - o64).norm() / o64.norm()),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
