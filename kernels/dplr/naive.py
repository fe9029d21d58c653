"""Plain token-by-token generalised delta rule (diagonal-plus-rank-one transitions, RWKV-7): the oracle.

Per head the state H in R^{K x V} (deltalab's and fla's [K, V] layout) follows
    H_t = (diag(exp g_t) + b_t a_t^T) H_{t-1} + k_t v_t^T,     o_t = scale * H_t^T q_t.
This is fla's `dplr_recurrence` / `naive_recurrent_rwkv7` (which hold S = H^T [V, K] and write
S <- S diag(w) + (S a) b^T + v k^T): the rank-one term reads the state before the decay, and the decay does not
act on it. RWKV-7 passes a = -kappa, b = kappa * a_rwkv (kappa the L2-normalised removal key, a_rwkv in (0, 1)
the in-context learning rate), g = log w <= 0 per key channel and scale = 1.

Shapes: q, k, a, b [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] or None (no decay). Packed variable-length
batches (B = 1, `cu_seqlens`) and the boundary layout follow `kernels.delta_rule.naive` exactly: boundary c holds the
state before token c*C, the last entry the final state; sequence n owns rows
`kernels.delta_rule.naive.boundary_offsets(cu_seqlens)[n]:[n+1]`. Computes in the inputs' dtype (pass float64).
"""

from __future__ import annotations

import torch

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.delta_rule.naive import check_cu_seqlens

__all__ = ["check_dplr_inputs", "naive_dplr"]


def check_dplr_inputs(q, k, v, a, b, g=None, initial_state=None, cu_seqlens=None) -> tuple[int, int, int, int]:
    """Validate the DPLR contract with one-line ValueErrors naming the tensor; return (N sequences, H, K, V)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B,T,H,K], got {tuple(q.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B,T,H,V] with B,T,H = {tuple(q.shape[:3])} of q, got {tuple(v.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, x in (("k", k), ("a", a), ("b", b), ("g", g)):
        if x is not None and x.shape != q.shape:
            raise ValueError(f"{name} must be [B,T,H,K] = {tuple(q.shape)} like q, got {tuple(x.shape)}")
    N = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N,H,K,V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}")
    return N, H, K, V


def _naive_dense(q, k, v, a, b, g, scale, state, chunk_size):
    """The recurrence over [B, T] sequences of one length."""
    outputs, boundaries = [], []
    for t in range(q.shape[1]):
        if t % chunk_size == 0:
            boundaries.append(state)
        read = torch.einsum("bhkv,bhk->bhv", state, a[:, t])  # a_t^T H_{t-1}
        decayed = state if g is None else g[:, t].exp()[..., None] * state
        state = decayed + b[:, t, :, :, None] * read[:, :, None, :] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    boundaries.append(state)
    o = torch.stack(outputs, 1) if outputs else v.new_zeros(v.shape)
    return o, state, torch.stack(boundaries, 1)


def naive_dplr(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor | None,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The generalised (diagonal-plus-low-rank) delta rule token by token, in the inputs' dtype: the reference.

    H_t = (diag(exp g_t) + b_t a_t^T) H_{t-1} + k_t v_t^T, o_t = scale H_t^T q_t.

    Args:
        q (torch.Tensor): queries `[B, T, H, K]`.
        k (torch.Tensor): keys `[B, T, H, K]` (written as k v^T).
        v (torch.Tensor): values `[B, T, H, V]`.
        a (torch.Tensor): `[B, T, H, K]`, the read side of the rank-one term b a^T (RWKV-7: -kappa).
        b (torch.Tensor): `[B, T, H, K]`, its write side (RWKV-7: kappa * a).
        g (torch.Tensor | None): per-channel log decays `[B, T, H, K]`; None: no decay.
        scale (float): read-out scale.
        initial_state (torch.Tensor | None): `[N, H, K, V]` states before the first token; None: zeros.
        cu_seqlens (torch.Tensor | None): `[N + 1]` rising token offsets of packed sequences (then B = 1).
        chunk_size (int): tokens per chunk, which sets the boundary states' spacing.

    Returns:
        o (torch.Tensor): outputs `[B, T, H, V]`.
        final_state (torch.Tensor): `[N, H, K, V]`.
        boundary_states (torch.Tensor): `[B, NB, H, K, V]`, the state before tokens 0, C, 2C, ... and the final
            state (NB = ceil(T / C) + 1; packed: the per-sequence layout of `kernels.delta_rule.naive`).
    """
    N, H, K, V = check_dplr_inputs(q, k, v, a, b, g, initial_state, cu_seqlens)
    dtype = q.dtype
    k, v, a, b = (x.to(dtype) for x in (k, v, a, b))
    g = None if g is None else g.to(dtype)
    h0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dtype)
    if cu_seqlens is None:
        return _naive_dense(q, k, v, a, b, g, scale, h0.clone(), chunk_size)
    outs, finals, bounds = [], [], []
    cu = torch.as_tensor(cu_seqlens).tolist()
    for n in range(N):
        sl = slice(cu[n], cu[n + 1])
        o, fin, bnd = _naive_dense(
            q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl], None if g is None else g[:, sl], scale,
            h0[n : n + 1], chunk_size,
        )
        outs.append(o)
        finals.append(fin)
        bounds.append(bnd)
    return torch.cat(outs, 1), torch.cat(finals, 0), torch.cat(bounds, 1)
