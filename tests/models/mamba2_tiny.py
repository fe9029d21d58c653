"""Tiny random transformers models of the Mamba-2 (SSD) families, saved with save_pretrained.

Built from the transformers Config classes on the CPU, no download: 4 layers, 4 SSD heads of head_dim 16 in 2
groups (key heads) of d_state 8, transformers' scan chunk 32 (a 70-token input crosses its chunks and
deltalab's 64-token chunk). Hybrids put softmax attention at layer 2 (Falcon-H1: beside the mixer in every layer;
Zamba2: its shared transformer block before the mixer of layers 1 and 3).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

FAMILIES = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2")
VOCAB, HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, CHUNK = 64, 32, 4, 16, 2, 8, 32
SSD_LAYERS = {"mamba2": [0, 1, 2, 3], "bamba": [0, 1, 3], "granitemoehybrid": [0, 1, 3], "nemotron_h": [0, 1, 3],
              "falcon_h1": [0, 1, 2, 3], "zamba2": [0, 1, 2, 3]}
"""The layers holding a Mamba-2 mixer in each tiny model."""

COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, initializer_range=0.3)
ATTN = dict(num_attention_heads=2, num_key_value_heads=1, intermediate_size=48)
MAMBA = dict(mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM, mamba_n_groups=GROUPS, mamba_d_state=STATE, mamba_d_conv=4,
             mamba_expand=2, mamba_chunk_size=CHUNK)
HYBRID = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def config(family: str):
    """The transformers config of the tiny `family` model."""
    import transformers as tf

    if family == "mamba2":
        return tf.Mamba2Config(**COMMON, num_heads=HEADS, head_dim=HEAD_DIM, n_groups=GROUPS, state_size=STATE,
                               expand=2, conv_kernel=4, chunk_size=CHUNK)
    if family == "bamba":
        return tf.BambaConfig(**COMMON, **ATTN, **MAMBA, attn_layer_indices=[2])
    if family == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**COMMON, **ATTN, **MAMBA, layer_types=HYBRID, num_local_experts=2,
                                         num_experts_per_tok=1, shared_intermediate_size=16,
                                         residual_multiplier=0.5, embedding_multiplier=2.0)
    if family == "nemotron_h":
        return tf.NemotronHConfig(**{k: v for k, v in COMMON.items() if k != "num_hidden_layers"}, **ATTN,
                                  layers_block_type=HYBRID, head_dim=16, mamba_num_heads=HEADS,
                                  mamba_head_dim=HEAD_DIM, n_groups=GROUPS, ssm_state_size=STATE, conv_kernel=4,
                                  expand=2, chunk_size=CHUNK)
    if family == "falcon_h1":
        return tf.FalconH1Config(**COMMON, **ATTN, **MAMBA, mamba_d_ssm=HEADS * HEAD_DIM)
    if family == "zamba2":
        return tf.Zamba2Config(**COMMON, **ATTN, mamba_d_state=STATE, mamba_d_conv=4, mamba_expand=2,
                               mamba_ngroups=GROUPS, n_mamba_heads=HEADS, chunk_size=CHUNK,
                               layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"])
    raise ValueError(f"unknown family {family}")


def build(family: str) -> torch.nn.Module:
    """A random model of `family` in eval mode (seeded by the caller); decays drawn to span fast and slow heads."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(config(family)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.uniform_(-1.0, 1.5)  # A = -exp(A_log) in [-4.5, -0.37]
                module.D.normal_()
                module.dt_bias.uniform_(-3.0, 0.5)
    return model


def save_tiny(family: str, folder: Path, seed: int = 0) -> Path:
    """Build, seed and save_pretrained `family` into `folder`; returns the folder."""
    torch.manual_seed(seed)
    build(family).save_pretrained(folder)
    return folder


@contextlib.contextmanager
def original_scan(module: ModuleType, edit: Callable | None = None) -> Iterator[list]:
    """Run the family's own `mamba2_chunk_scan` (deltalab's router removed) and record each call's
    (its arguments by name, what it returned).

    `edit(call_index, arguments)` may change a call's arguments in place: a change made by hand inside the layer.
    """
    calls: list[tuple[dict, object]] = []
    router = module.mamba2_chunk_scan
    original = getattr(router, "deltalab_original", router)
    signature = inspect.signature(original)

    def recorder(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        if edit is not None:
            edit(len(calls), arguments)
        extra = arguments.pop("kwargs", {})
        out = original(**arguments, **extra)
        calls.append((arguments, out))
        return out

    module.mamba2_chunk_scan = recorder
    try:
        yield calls
    finally:
        module.mamba2_chunk_scan = router
