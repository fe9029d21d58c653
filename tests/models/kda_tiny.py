"""Tiny random transformers models of the three Kimi Delta Attention families, saved with save_pretrained.

Built from the Config classes on the CPU, no download: 4 layers (0, 1, 3 Kimi Delta Attention with per-channel
gates, 2 softmax attention), 2 heads of dk = dv = 8, small MoE and MLA settings. GLM5-Next has no CausalLM
class: it is saved as its conditional-generation model, with a one-layer vision tower.
"""

from __future__ import annotations

from pathlib import Path

import torch

KDA_FAMILIES = ("kimi_linear", "bailing_hybrid", "glm5_next")
KDA_LINEAR = (0, 1, 3)
KDA_HEADS, KDA_DIM, KDA_VOCAB = 2, 8, 64
KDA_NAMES = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")

TEXT = dict(
    vocab_size=KDA_VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
    intermediate_size=48, linear_num_heads=KDA_HEADS, linear_head_dim=KDA_DIM, linear_conv_kernel_dim=4,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_expert_group=1, topk_group=1,
    kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)
GLM5_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                   projection_intermediate_size=16, patch_size=4, spatial_merge_size=1, temporal_patch_size=1)


def build_kda(family: str) -> torch.nn.Module:
    """A random model of `family` in eval mode (seeded by the caller)."""
    import transformers as tf

    if family == "kimi_linear":
        return tf.AutoModelForCausalLM.from_config(tf.KimiLinearConfig(**TEXT)).eval()
    if family == "bailing_hybrid":
        return tf.AutoModelForCausalLM.from_config(tf.BailingHybridConfig(**TEXT)).eval()
    if family == "glm5_next":
        config = tf.Glm5NextConfig(text_config={**TEXT, "q_lora_rank": 16, "qk_rope_head_dim": 0},
                                   vision_config=GLM5_VISION)
        return tf.AutoModelForImageTextToText.from_config(config).eval()
    raise ValueError(f"unknown family {family}")


def save_kda(family: str, folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    build_kda(family).save_pretrained(folder)
    return folder


def load_untouched(folder: Path, family: str) -> torch.nn.Module:
    """The saved model through transformers alone."""
    import transformers as tf

    cls = tf.AutoModelForImageTextToText if family == "glm5_next" else tf.AutoModelForCausalLM
    return cls.from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()


def probed_kimi_store(base: Path, spec: str, probes: dict[str, list[str]]) -> Path:
    """A tiny Kimi Linear model saved under `base`, captured over `spec` with every hook into base/s.zarr through
    the CLI, and probed with `probes` (name -> extra arguments); each step must succeed."""
    from typer.testing import CliRunner

    from deltalab.app.cli import app

    folder = save_kda("kimi_linear", base / "kimi")
    out = base / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(folder), "--data", spec, "--out", str(out),
                                   "--hooks", "tokens,labels,loss,q,k,v,beta,g,state,o", "--no-progress"])
    assert res.exit_code == 0, res.output
    for probe, extra in probes.items():
        res = CliRunner().invoke(app, ["probe", probe, "--store", str(out), *extra])
        assert res.exit_code == 0, (probe, res.output)
    return out
