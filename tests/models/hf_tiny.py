"""Tiny random transformers models of the Gated DeltaNet families, saved with save_pretrained.

Built from the transformers Config classes on the CPU, no download: 4 layers (0, 1, 3 Gated
DeltaNet, 2 softmax attention), 2 key heads and 4 value heads (grouped), dk = dv = 8.
Qwen3.5, Qwen3.5-MoE and Qwen4-Exp are saved as their vision-language models, as published.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from deltalab.models.hf.families import GDN_KERNELS


def _has_transformers_model(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"transformers.models.{name}") is not None


FAMILIES = ("olmo_hybrid", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
            *(("lara_mini",) if _has_transformers_model("lara_mini") else ()))
"""The families built here: Lara-Mini where the installed transformers ships it (5.24 and later)."""
LINEAR_LAYERS = (0, 1, 3)
NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM, VOCAB = 2, 4, 8, 64

TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, intermediate_size=48, linear_num_key_heads=NUM_K_HEADS, linear_num_value_heads=NUM_V_HEADS,
    linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=4,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
              spatial_merge_size=1, temporal_patch_size=1)
QWEN4 = dict(hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
             indexer_budget=8, indexer_compress_ratio=4)


def build(family: str) -> torch.nn.Module:
    """A random model of `family` in eval mode (seeded by the caller)."""
    import transformers as tf

    if family == "olmo_hybrid":
        return tf.AutoModelForCausalLM.from_config(tf.OlmoHybridConfig(**TEXT)).eval()
    if family == "qwen3_next":
        return tf.AutoModelForCausalLM.from_config(tf.Qwen3NextConfig(**TEXT, **MOE, decoder_sparse_step=1)).eval()
    if family == "lara_mini":
        return tf.AutoModelForCausalLM.from_config(tf.LaraMiniConfig(**TEXT, **MOE)).eval()
    if family == "qwen3_5":
        config = tf.Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    elif family == "qwen3_5_moe":
        config = tf.Qwen3_5MoeConfig(text_config={**TEXT, **MOE}, vision_config=VISION)
    elif family == "qwen4_exp":
        config = tf.Qwen4ExpConfig(text_config={**TEXT, **MOE, **QWEN4}, vision_config=VISION)
    else:
        raise ValueError(f"unknown family {family}")
    return tf.AutoModelForImageTextToText.from_config(config).eval()


def save_tiny(family: str, folder: Path, seed: int = 0, **save_kwargs) -> Path:
    """Build, seed and save_pretrained `family` into `folder`; returns the folder."""
    torch.manual_seed(seed)
    build(family).save_pretrained(folder, **save_kwargs)
    return folder


@contextlib.contextmanager
def original_kernels(module: ModuleType, edit: Callable | None = None,
                     names: tuple[str, str] = GDN_KERNELS) -> Iterator[list]:
    """Run the family's own kernels (deltalab's router removed) and record each chunk call's
    (o, final state, inputs {query, key, value, g, beta}).

    `edit(call, kwargs)` may change a call's inputs: a change made by hand inside the layer.
    """
    calls: list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
    chunk_name, recurrent_name = names
    routers = {name: getattr(module, name) for name in names}
    chunk = routers[chunk_name].deltalab_original

    def recorder(*args, **kwargs):
        if edit is not None:
            edit(len(calls), kwargs)
        o, state = chunk(*args, **kwargs)
        inputs = dict(zip(("query", "key", "value"), args)) | {n: kwargs[n] for n in ("g", "beta")}
        calls.append((o, state, inputs))
        return o, state

    try:
        setattr(module, chunk_name, recorder)
        setattr(module, recurrent_name, routers[recurrent_name].deltalab_original)
        yield calls
    finally:
        for name, fn in routers.items():
            setattr(module, name, fn)


SPECIALS = {"<pad>": 0, "<|begin_of_text|>": 1, "<|endoftext|>": 2, "<unk>": 3}
"""The tiny models' pad, bos and eos ids (TEXT above) and an unknown-character id."""


def save_char_tokenizer(folder: Path) -> Path:
    """A character-level tokenizer.json within the tiny vocabulary (VOCAB): specials, a-z, digits, punctuation."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'\n"
    vocab = {**SPECIALS, **{c: len(SPECIALS) + i for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(list(SPECIALS))
    path = Path(folder) / "tokenizer.json"
    tok.save(str(path))
    return path
