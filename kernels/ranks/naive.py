"""Reference state ranks: replay the naive recurrence and take an SVD of the state at every step.

This is the DeltaProduct authors' approach (a token loop with torch.linalg.svdvals per step). In
float64 it is the oracle for `kernels.ranks.chunk`; in float32 it is the peer the benchmark measures.
"""

from __future__ import annotations

import torch

from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.kernels.ranks.chunk import RankMetrics, metrics_from_singular_values


def naive_state_ranks(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    substeps: bool = False,
    normalize_k: bool = False,
    dtype: torch.dtype = torch.float64,
) -> RankMetrics:
    """RankMetrics [B,T,H] ([B,T,n_h,H] with substeps) from a token loop and per-step svdvals in `dtype`."""
    B, T, n_h, H, K = k.shape
    V = v.shape[-1]
    k, v, beta = k.to(dtype), v.to(dtype), beta.to(dtype)
    if normalize_k:
        k = l2_normalize(k)
    state = k.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype).clone()
    per_token = []
    for t in range(T):
        if g is not None:
            state = state * g[:, t].to(dtype).exp()[..., None, None]
        steps = []
        for j in range(n_h):
            kt = k[:, t, j]
            residual = v[:, t, j] - torch.einsum("bhkv,bhk->bhv", state, kt)
            state = state + beta[:, t, j][..., None, None] * kt[..., :, None] * residual[..., None, :]
            if substeps or j == n_h - 1:
                sigma = torch.linalg.svdvals(state)  # [B, H, r]
                fro = state.square().sum((-1, -2)).sqrt()
                steps.append(torch.stack(metrics_from_singular_values(sigma, fro)))  # [6, B, H]
        per_token.append(torch.stack(steps, 2) if substeps else steps[0])
    out = torch.stack(per_token, 2)  # [6, B, T, (n_h,) H]
    return RankMetrics(*out.unbind(0))
