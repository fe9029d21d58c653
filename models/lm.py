"""The causal LM, top to bottom: embeddings -> blocks (norm, token mixer, norm, MLP) -> norm -> head.

Modules sit at the top level (`layers.3.attn.hook_beta`), TransformerLens-style; checkpoint I/O
adds fla's `model.` prefix so fla's safetensors load unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.kernels.constants import IGNORE_INDEX
from deltalab.models.attention import DeltaProductAttention
from deltalab.models.cache import LayerCache, RecurrentCache
from deltalab.models.config import ModelConfig
from deltalab.models.generate import Generates
from deltalab.models.hooks import HookPoint
from deltalab.models.layers import GatedMLP, RMSNorm
from deltalab.models.softmax_attention import SoftmaxAttention


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)); `attn` is the delta-rule mixer, or
    softmax attention on the layers a hybrid's `attn` config names."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        spec = config.attn_specs.get(layer_idx)
        self.attn = DeltaProductAttention(config, layer_idx) if spec is None else \
            SoftmaxAttention(config.hidden_size, spec, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.mlp_size)
        self.hook_resid_pre = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        mixed = self.attn(self.attn_norm(x)) if cache is None else self.attn(self.attn_norm(x), cache=cache)
        x = self.hook_resid_mid(x + mixed)
        return self.hook_resid_post(x + self.mlp(self.mlp_norm(x)))


class DeltaProductForCausalLM(Generates, nn.Module):
    """GatedDeltaProduct / DeltaNet / GatedDeltaNet language model; `model(ids).logits`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """fla's defaults: normal(0, 0.02) for linear and embedding weights."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cache: RecurrentCache | None = None) -> CausalLMOutput:
        """Logits of every position, and the mean next-token loss when `labels` are given.

        Args:
            input_ids (torch.Tensor): token ids `[B, T]` (int64).
            labels (torch.Tensor | None): targets `[B, T]`, aligned with the positions (no shift: position t's
                label is the token it should predict); IGNORE_INDEX positions are skipped.
            cache (RecurrentCache | None): a decoding cache (`models.cache`): continue from it and update it in
                place (generation).

        Returns:
            CausalLMOutput: logits `[B, T, vocab_size]` in the model's dtype, and loss (a float32 scalar) or None.
        """
        x = self.embeddings(input_ids)
        for i, block in enumerate(self.layers):
            x = block(x) if cache is None else block(x, cache.layers[i])
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits, loss=loss)

    def summary(self) -> str:
        """One paragraph a researcher reads first."""
        c = self.config
        n_params = sum(p.numel() for p in self.parameters())
        gates = [name for name, on in (("forget", c.use_forget_gate), ("output", c.use_output_gate),
                                       ("short-conv", c.use_short_conv)) if on]
        eig = "[-1,1]" if c.allow_neg_eigval else "[0,1]"
        heads = f"{c.num_key_heads} key / {c.num_value_heads} value heads" if c.grouped else f"{c.num_heads} heads"
        layers = f"{c.num_hidden_layers} layer(s)"
        if c.hybrid:
            layers += f" (delta-rule {','.join(map(str, c.delta_layers))}; softmax {','.join(map(str, c.attn_specs))})"
        return (
            f"{c.model_type} n_h={c.num_householder} {eig}: {layers}, {heads}, "
            f"dk={c.head_k_dim} dv={c.head_v_dim}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
            f"{', '.join(gates) or 'no gates/conv'}; {n_params / 1e6:.2f}M parameters"
        )
