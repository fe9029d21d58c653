"""Tiny models of each delta-rule variant for the patching tests (a few thousand parameters, CPU-fast)."""

from __future__ import annotations

import torch

from deltalab.models import DeltaProductForCausalLM, ModelConfig

VOCAB = 13
CONFIGS = {
    "deltaproduct2": dict(model_type="gated_deltaproduct", num_householder=2, use_forget_gate=True,
                          allow_neg_eigval=True),
    "kda": dict(model_type="kda"),
    "grouped_gdn": dict(model_type="gated_deltanet", num_v_heads=4),
}


def tiny_model(name: str, dtype: torch.dtype = torch.float32, layers: int = 2) -> DeltaProductForCausalLM:
    """A randomly initialised two-layer model of variant `name` (seeded: the same weights every call)."""
    torch.manual_seed(1234)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_heads=2, head_dim=8,
                      expand_v=1.0, **CONFIGS[name])
    model = DeltaProductForCausalLM(cfg).eval().to(dtype)
    with torch.no_grad():  # larger weights than fla's init, so that patches move the metrics visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def pair(seq_len: int, flip: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, corrupted) token ids [seq_len] that differ at position `flip` only."""
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, VOCAB, (seq_len,), generator=gen)
    corrupted = clean.clone()
    corrupted[flip] = (clean[flip] + 1 + int(torch.randint(0, VOCAB - 1, (1,), generator=gen))) % VOCAB
    return clean, corrupted
