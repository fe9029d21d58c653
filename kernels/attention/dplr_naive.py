"""Float64 oracle for the exact attention map of the generalised delta rule (DPLR transitions, RWKV-7).

Per head, token s's transition is the dense dk x dk matrix M_s = diag(e^{g_s}) + b_s a_s^T and
H_s = M_s H_{s-1} + k_s v_s^T (`kernels.dplr.naive`). With Phi(t, s) = M_t ... M_{s+1} (Phi(t, t) = I) the
recurrence unrolls to
    o_t = scale H_0^T Phi(t, -1)^T q_t + sum_{s <= t} alpha_{t,s} v_s,     alpha_{t,s} = scale q_t^T Phi(t, s) k_s.
Every M_s is built as a matrix and the row q_t^T Phi(t, s) is multiplied out one transition at a time, backwards
from t. O(T^2 dk^2) per head: small shapes only.
"""

from __future__ import annotations

import torch

from deltalab.kernels.dplr.naive import check_dplr_inputs

__all__ = ["dplr_transitions", "naive_dplr_attention"]


def dplr_transitions(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """Dense transitions diag(e^g) + b a^T as [..., K, K] for a, b, g [..., K] (g None: the identity)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    diag = eye if g is None else torch.diag_embed(g.to(a.dtype).exp())
    return diag + b[..., :, None] * a[..., None, :]


def naive_dplr_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor | None,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (alpha [B, T, H, T], initial-state term [B, T, H, dv]) in float64.

    alpha[b, t, h, s] is the signed weight of v_s in o_t (zero for s > t); the initial-state term is
    scale H_0^T Phi(t, -1)^T q_t (zero without an initial state). Inputs as `naive_dplr` (no cu_seqlens).
    """
    check_dplr_inputs(q, k, v, a, b, g, initial_state)
    q, k, a, b = (x.double() for x in (q, k, a, b))
    B, T, H, _ = q.shape
    V = v.shape[-1]
    M = dplr_transitions(a, b, None if g is None else g.double())  # [B, T, H, K, K]
    alpha = torch.zeros(B, T, H, T, dtype=torch.float64)
    init = torch.zeros(B, T, H, V, dtype=torch.float64)
    for t in range(T):
        r = q[:, t]  # the row q_t^T Phi(t, s) as s walks back
        for s in range(t, -1, -1):
            alpha[:, t, :, s] = scale * (r * k[:, s]).sum(-1)
            r = torch.einsum("bhk,bhkl->bhl", r, M[:, s])
        if initial_state is not None:
            init[:, t] = scale * torch.einsum("bhk,bhkv->bhv", r, initial_state.double())
    return alpha, init
