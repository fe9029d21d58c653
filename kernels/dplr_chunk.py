"""Chunked (WY/UT) generalised delta rule in PyTorch: differentiable, for the CPU and for training.

The recurrence of `kernels.dplr_naive`, H_t = (diag(e^{g_t}) + b_t a_t^T) H_{t-1} + k_t v_t^T, over chunks of
C tokens. Within a chunk (tokens i = 1..C, H_0 the chunk's initial state) let Gamma_i = sum_{j<=i} g_j
(per key channel, Gamma_0 = 0) and u_i = H_{i-1}^T a_i, the value each token's rank-one term reads. Unrolled,
    H_i = e^{Gamma_i} * H_0 + sum_{j<=i} e^{Gamma_i - Gamma_j} * (b_j u_j^T + k_j v_j^T),
so the reads solve one unit lower-triangular system per chunk (the UT transform of a DPLR product):
    (I - A_ab) U = A_ak V + (e^{Gamma_{i-1}} * a_i) H_0,   A_xy[i, j] = x_i^T diag(e^{Gamma_{i-1} - Gamma_j}) y_j,
with j < i, and the outputs and the next chunk's state follow from U:
    o_i = scale (e^{Gamma_i} * q_i)^T H_0 + sum_{j<=i} scale q_i^T diag(e^{Gamma_i - Gamma_j}) (b_j u_j^T + k_j v_j^T).
Every exponent is a difference Gamma_x - Gamma_j with x >= j (never positive), so decays of e^-20 per token
cannot overflow; the pairwise [C, C, K] decays are built for groups of chunks whose size `budget` bounds, and the
state is carried through each group before the next is built (memory O(group), not O(T C K)).
"""

from __future__ import annotations

import torch

from kernels.constants import CHUNK_SIZE
from kernels.dplr_naive import check_dplr_inputs

__all__ = ["chunk_dplr"]

BUDGET = 1 << 28
"""Bytes for one group's pairwise decays ([G, C, C, K] twice, plus the einsum temporaries)."""


def chunk_dplr(
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
    budget: int = BUDGET,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (o [B,T,H,V], final states [N,H,K,V], chunk-boundary states [B,NB,H,K,V]) like `naive_dplr`.

    Computes in float32 (float64 if q is float64); o comes back in q's dtype, states in float32 or float64.
    """
    N = check_dplr_inputs(q, k, v, a, b, g, initial_state, cu_seqlens)[0]
    args = dict(scale=scale, chunk_size=chunk_size, budget=budget)
    if cu_seqlens is None:
        return _chunk_dense(q, k, v, a, b, g, initial_state, **args)
    cu = torch.as_tensor(cu_seqlens).tolist()
    outs, finals, bounds = [], [], []
    for n in range(N):
        sl = slice(cu[n], cu[n + 1])
        h0 = None if initial_state is None else initial_state[n : n + 1]
        o, fin, bnd = _chunk_dense(q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl],
                                   None if g is None else g[:, sl], h0, **args)
        outs.append(o)
        finals.append(fin)
        bounds.append(bnd)
    return torch.cat(outs, 1), torch.cat(finals, 0), torch.cat(bounds, 1)


def _chunk_dense(q, k, v, a, b, g, initial_state, scale, chunk_size, budget):
    """The chunked solve of [B, T] sequences of one length."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    state = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    if T == 0:  # an empty sequence of a packed batch: its initial state is its final and only boundary
        return q.new_zeros(B, 0, H, V, dtype=out_dtype), state, state[:, None]
    C = min(chunk_size, T)  # a sequence shorter than a chunk is one chunk of its own length
    n_chunks = -(-T // C)
    pad = n_chunks * C - T
    if g is None:
        g = torch.zeros_like(q, dtype=dtype)

    def per_chunk(x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [B, H, NC, C, D]; padded tokens (zero key, value, a, b and log decay) leave H alone."""
        x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, pad))
        return x.movedim(2, 1).reshape(B, H, n_chunks, C, x.shape[-1])

    qs, ks, vs, as_, bs, gs = (per_chunk(x) for x in (q, k, v, a, b, g))
    gam = gs.cumsum(3)  # Gamma_i, inclusive
    gex = torch.cat([torch.zeros_like(gam[..., :1, :]), gam[..., :-1, :]], 3)  # Gamma_{i-1}, exactly
    idx = torch.arange(C, device=q.device)
    incl = (idx[:, None] >= idx[None, :])[..., None]  # [C, C, 1]: j <= i
    excl = (idx[:, None] > idx[None, :])[..., None]  # j < i
    eye = torch.eye(C, dtype=dtype, device=q.device)
    elem = torch.finfo(dtype).bits // 8
    group = max(1, budget // max(1, B * H * C * C * K * elem * 4))
    outs, boundaries = [], [state]
    for c0 in range(0, n_chunks, group):
        sl = slice(c0, min(n_chunks, c0 + group))
        q_, k_, v_, a_, b_, g_, x_ = qs[:, :, sl], ks[:, :, sl], vs[:, :, sl], as_[:, :, sl], bs[:, :, sl], \
            gam[:, :, sl], gex[:, :, sl]
        d_in = g_[..., :, None, :] - g_[..., None, :, :]  # [B, H, G, C, C, K]: Gamma_i - Gamma_j
        d_in = torch.where(incl, d_in, torch.full_like(d_in, -torch.inf)).exp()
        d_ex = x_[..., :, None, :] - g_[..., None, :, :]  # Gamma_{i-1} - Gamma_j
        d_ex = torch.where(excl, d_ex, torch.full_like(d_ex, -torch.inf)).exp()
        pair = "bhgik,bhgjk,bhgijk->bhgij"
        A_qk, A_qb = torch.einsum(pair, q_, k_, d_in), torch.einsum(pair, q_, b_, d_in)
        A_ak, A_ab = torch.einsum(pair, a_, k_, d_ex), torch.einsum(pair, a_, b_, d_ex)
        lhs = eye - A_ab
        U0 = torch.linalg.solve_triangular(lhs, A_ak @ v_, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(lhs, a_ * x_.exp(), upper=False, unitriangular=True)
        q_dec = q_ * g_.exp()
        tail = (g_[..., -1:, :] - g_).exp()  # e^{Gamma_C - Gamma_j}
        b_tail, k_tail = (b_ * tail).transpose(-1, -2), (k_ * tail).transpose(-1, -2)
        chunk_decay = g_[..., -1, :].exp()[..., None]  # [B, H, G, K, 1]
        for c in range(U0.shape[2]):
            U = U0[:, :, c] + W[:, :, c] @ state
            outs.append(scale * (q_dec[:, :, c] @ state + A_qb[:, :, c] @ U + A_qk[:, :, c] @ v_[:, :, c]))
            state = chunk_decay[:, :, c] * state + b_tail[:, :, c] @ U + k_tail[:, :, c] @ v_[:, :, c]
            boundaries.append(state)
    o = torch.stack(outs, 2).reshape(B, H, n_chunks * C, V)[:, :, :T].movedim(1, 2)
    bnd = torch.stack(boundaries, 1)
    return o.to(out_dtype), state, bnd
