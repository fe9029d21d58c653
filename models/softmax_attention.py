"""fla's softmax-attention layer for hybrid checkpoints (`attn` in config.json), with fla's parameter names.

Causal attention with rotary position embeddings (non-interleaved halves, base `rope_theta`), grouped
key/value heads (`num_kv_heads`), an optional sliding window (`window_size` tokens, the query's own
included) and no dropout. fla runs it with flash-attn; deltalab with torch's scaled_dot_product_attention.
The delta-rule hooks (hook_beta, hook_state, ...) do not exist here; q, k (after rotary), v and the per-head
output z pass through hook points so nnsight can read and patch them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.models.cache import LayerCache
from deltalab.models.hooks import HookPoint


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim / 2]: angle t / theta^(2i / head_dim), in float32 as fla (float64 for references)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + d/2}) of x [B, T, H, d] by the position's angle (GPT-NeoX layout); cos, sin
    [T, d/2] (one table for every row) or [B, T, d/2] (each row's own positions, as a decoding cache has them)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(cos.dtype), x[..., half:].to(cos.dtype)
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


class SoftmaxAttention(nn.Module):
    """q/k/v projections -> rotary -> causal (windowed) softmax attention -> o_proj."""

    def __init__(self, hidden_size: int, spec: dict[str, Any], layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = int(spec["num_heads"]), int(spec["num_kv_heads"])
        self.head_dim = hidden_size // self.num_heads
        self.window_size, self.rope_theta = spec["window_size"], float(spec["rope_theta"])
        bias = bool(spec["qkv_bias"])
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_z = HookPoint()

    def causal_mask(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """Boolean [T, T] mask (True = may attend) for a sliding window; None for full causal attention."""
        if self.window_size is None or self.window_size >= seq_len:
            return None
        t = torch.arange(seq_len, device=device)
        lag = t[:, None] - t[None, :]
        return (lag >= 0) & (lag < self.window_size)

    def forward(self, x: torch.Tensor, initial_state: None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; with a decoding cache, see `_cached`."""
        if cache is not None:
            return self._cached(x, cache)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        exact = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = rotary_tables(T, self.head_dim, self.rope_theta, x.device, exact)
        q, k = self.hook_q(apply_rotary(q, cos, sin)), self.hook_k(apply_rotary(k, cos, sin))
        v = self.hook_v(v)
        group = self.num_heads // self.num_kv_heads
        kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)  # query head h reads kv head h // G
        mask = self.causal_mask(T, x.device)
        z = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                           attn_mask=mask, is_causal=mask is None).transpose(1, 2)
        z = self.hook_z(z)
        return self.o_proj(z.reshape(B, T, -1))

    def _cached(self, x: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """x [B, T, D] continuing each row from the keys and values in `cache` (appended to it): rotary at each
        row's own positions, attention to the valid cached keys and the causal part of the new ones."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        start = cache.next_pos if cache.next_pos is not None else torch.zeros(B, dtype=torch.long, device=x.device)
        pos = start[:, None] + torch.arange(T, device=x.device)  # [B, T]
        exact = torch.float64 if x.dtype == torch.float64 else torch.float32
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, device=x.device, dtype=exact)
                                             / self.head_dim)  # as rotary_tables, at each row's own positions
        angles = pos.to(exact)[..., None] * inv_freq  # [B, T, d/2]
        cos, sin = angles.cos(), angles.sin()
        q, k = self.hook_q(apply_rotary(q, cos, sin)), self.hook_k(apply_rotary(k, cos, sin))
        v = self.hook_v(v)
        new_valid = torch.ones(B, T, dtype=torch.bool, device=x.device)
        if cache.keys is not None:
            k_all, v_all = torch.cat([cache.keys, k], 1), torch.cat([cache.values, v], 1)
            valid, key_pos = torch.cat([cache.valid, new_valid], 1), torch.cat([cache.key_pos, pos], 1)
        else:
            k_all, v_all, valid, key_pos = k, v, new_valid, pos
        cache.keys, cache.values, cache.valid, cache.key_pos = k_all, v_all, valid, key_pos
        cache.next_pos = pos[:, -1] + 1
        lag = pos[:, :, None] - key_pos[:, None, :]  # [B, T, S]
        mask = valid[:, None, :] & (lag >= 0)
        if self.window_size is not None:
            mask = mask & (lag < self.window_size)
        group = self.num_heads // self.num_kv_heads
        kk, vv = k_all.repeat_interleave(group, 2), v_all.repeat_interleave(group, 2)
        z = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                           attn_mask=mask[:, None]).transpose(1, 2)
        z = self.hook_z(z)
        return self.o_proj(z.reshape(B, T, -1))
