"""The SSD recurrence token by token, in float64: the oracle the chunked form and the transformers adapter are
checked against, and the exact attention matrix it equals."""

from __future__ import annotations

import torch


def expand_key_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """x [B, T, Hk, d] -> [B, T, H, d]: value head j reads key head j // (H / Hk) (Mamba-2's groups)."""
    Hk = x.shape[2]
    if num_heads % Hk:
        raise ValueError(f"{num_heads} value heads are not a multiple of {Hk} key heads (n_groups)")
    return x.repeat_interleave(num_heads // Hk, dim=2)


def naive_ssd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float = 1.0,
              initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time in float64.

    q, k [B, T, Hk, dk] (Mamba-2: C and B, Hk = n_groups, dk = d_state); v [B, T, H, dv] (dt * x, dv = head_dim);
    g [B, T, H] log decays (dt * A, <= 0); initial_state [B, H, dk, dv] or None.
    Returns o [B, T, H, dv] and the final state [B, H, dk, dv], both float64.
    """
    B, T, H, dv = v.shape
    q, k = expand_key_heads(q.double(), H), expand_key_heads(k.double(), H)
    v, g = v.double(), g.double()
    S = torch.zeros(B, H, q.shape[-1], dv, dtype=torch.float64, device=v.device)
    if initial_state is not None:
        S = initial_state.double().clone()
    out = []
    for t in range(T):
        S = g[:, t, :, None, None].exp() * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1), S


def ssd_attention_matrix(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The exact attention matrix of SSD (its semiseparable matrix), float64.

    q, k [B, T, Hk, dk]; g [B, T, H]. Returns A [B, H, T, T] with
    `A[t, s] = scale * (q_t . k_s) * exp(g_{s+1} + ... + g_t)` for s <= t, 0 above the diagonal, so that
    `o = A @ v` for a zero initial state (each decay summed from the gates it spans, never a difference of totals).
    """
    H, T = g.shape[2], g.shape[1]
    q, k = expand_key_heads(q.double(), H), expand_key_heads(k.double(), H)
    g = g.double().transpose(1, 2)  # [B, H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()
    strict = causal.tril(-1)
    # spans[t, s] = sum over r in (s, t] of g_r: cumulative sum down the rows of g_r placed at (r, s) for r > s
    spans = (g[..., :, None] * strict).cumsum(-2)
    decay = spans.masked_fill(~causal, float("-inf")).exp()
    return scale * torch.einsum("bthk,bshk->bhts", q, k) * decay
