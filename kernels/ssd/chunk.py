"""The SSD recurrence in chunks of CHUNK_SIZE tokens (PyTorch), returning the chunk-start states deltalab's
`hook_state` holds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.ssd.naive import expand_key_heads


def _spans(g: torch.Tensor) -> torch.Tensor:
    """g [..., L] -> [..., L, L]: entry (l, s) = g_{s+1} + ... + g_l for s <= l, -inf above the diagonal."""
    L = g.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=g.device).tril()
    spans = (g[..., :, None] * causal.tril(-1)).cumsum(-2)
    return spans.masked_fill(~causal, float("-inf"))


def chunk_ssd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float = 1.0,
              initial_state: torch.Tensor | None = None,
              chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked SSD: the same contract as `naive_ssd`, plus the states at every chunk start.

    q, k [B, T, Hk, dk]; v [B, T, H, dv]; g [B, T, H]; initial_state [B, H, dk, dv] or None. Computes in float32
    (float64 for float64 inputs). Returns o [B, T, H, dv] (compute dtype), the final state [B, H, dk, dv] and
    states [B, NC + 1, H, dk, dv]: the state before tokens 0, chunk_size, 2 chunk_size, ... then the final one.
    Within a chunk every decay is summed from the gates it spans (no difference of running totals).
    """
    B, T, H, dv = v.shape
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k = expand_key_heads(q.to(dtype), H), expand_key_heads(k.to(dtype), H)
    v, g = v.to(dtype), g.to(dtype)
    dk = q.shape[-1]
    pad = (-T) % chunk_size  # padded tokens write nothing (k = 0) and keep the state (g = 0)
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad))
    NC = (T + pad) // chunk_size
    q, k, v = (x.reshape(B, NC, chunk_size, H, -1).transpose(2, 3) for x in (q, k, v))  # [B, NC, H, L, d]
    g = g.reshape(B, NC, chunk_size, H).transpose(2, 3)  # [B, NC, H, L]
    decay = _spans(g).exp()  # [B, NC, H, L, L]: within-chunk decay from s to l
    into = decay[..., -1, :]  # [B, NC, H, L]: from token s to the chunk's end
    from_start = g.cumsum(-1).exp()  # [B, NC, H, L]: from the chunk start to token l
    intra = scale * (q @ k.transpose(-1, -2)) * decay @ v  # [B, NC, H, L, dv]
    writes = (k * into[..., None]).transpose(-1, -2) @ v  # [B, NC, H, dk, dv]
    S = torch.zeros(B, H, dk, dv, dtype=dtype, device=v.device)
    if initial_state is not None:
        S = initial_state.to(device=v.device, dtype=dtype)
    states = [S]
    for c in range(NC):
        S = from_start[:, c, :, -1, None, None] * S + writes[:, c]
        states.append(S)
    starts = torch.stack(states[:-1], 1)  # [B, NC, H, dk, dv]
    o = intra + scale * from_start[..., None] * (q @ starts)
    o = o.transpose(2, 3).reshape(B, NC * chunk_size, H, dv)[:, :T]
    return o, S, torch.stack(states, 1)
