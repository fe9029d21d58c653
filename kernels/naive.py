"""Plain token-by-token gated delta product: the oracle every fast path is checked against.

Shapes follow docs/architecture.md (fla's [K, V] state layout):
  q [B, T, H, K], k [B, T, n_h, H, K], v [B, T, n_h, H, V], beta [B, T, n_h, H], g [B, T, H] or None.
Computes in the dtype of the inputs (pass float64 for a reference).
"""

from __future__ import annotations

import torch

from kernels.constants import CHUNK_SIZE


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's in-kernel L2 norm: x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def num_boundaries(seq_len: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Chunk-start states plus the final state: ceil(T / C) + 1."""
    return -(-seq_len // chunk_size) + 1


def naive_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    normalize_qk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (o [B,T,H,V], final state [B,H,K,V], chunk-boundary states [B,NC,H,K,V]).

    H_{t,j} = a_{t,j} (I - b k k^T) H_{t,j-1} + b k v^T, a_{t,1} = exp(g_t); o_t = scale H_t^T q_t.
    Boundary c holds the state before token c*C; the last entry is the final state.
    """
    B, T, H, K = q.shape
    n_h, V = k.shape[2], v.shape[-1]
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = K**-0.5 if scale is None else scale
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(q.dtype).clone()
    outputs, boundaries = [], []
    for t in range(T):
        if t % chunk_size == 0:
            boundaries.append(state)
        if g is not None:
            state = state * g[:, t].exp()[..., None, None].to(q.dtype)
        for j in range(n_h):
            k_tj, v_tj, b_tj = k[:, t, j], v[:, t, j], beta[:, t, j]
            residual = v_tj - torch.einsum("bhkv,bhk->bhv", state, k_tj)
            state = state + b_tj[..., None, None] * k_tj[..., :, None] * residual[..., None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    boundaries.append(state)
    return torch.stack(outputs, 1), state, torch.stack(boundaries, 1)
