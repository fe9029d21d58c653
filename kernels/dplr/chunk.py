"""Chunked (WY/UT) generalised delta rule in PyTorch: differentiable, for the CPU and for training.

The recurrence of `kernels.dplr.naive`, H_t = (diag(e^{g_t}) + b_t a_t^T) H_{t-1} + k_t v_t^T, over chunks of
C tokens. Within a chunk (tokens i = 1..C, H_0 the chunk's initial state) let Gamma_i = sum_{j<=i} g_j
(per key channel, Gamma_0 = 0) and u_i = H_{i-1}^T a_i, the value each token's rank-one term reads. Unrolled,
    H_i = e^{Gamma_i} * H_0 + sum_{j<=i} e^{Gamma_i - Gamma_j} * (b_j u_j^T + k_j v_j^T),
so the reads solve one unit lower-triangular system per chunk (the UT transform of a DPLR product):
    (I - A_ab) U = A_ak V + (e^{Gamma_{i-1}} * a_i) H_0,   A_xy[i, j] = x_i^T diag(e^{Gamma_{i-1} - Gamma_j}) y_j,
with j < i, and the outputs and the next chunk's state follow from U:
    o_i = scale (e^{Gamma_i} * q_i)^T H_0 + sum_{j<=i} scale q_i^T diag(e^{Gamma_i - Gamma_j}) (b_j u_j^T + k_j v_j^T).
Every exponent is Gamma_x - Gamma_j with x >= j (never positive), so decays of e^-20 per token cannot overflow,
and each is summed from the gates it spans, g_{j+1} + ... + g_x, never taken as a difference of two running totals
(those reach about -600 at g = -20 per token, where fp32's spacing is 6e-5: 6.8e-6 relative error in o; now within
2e-6 of float64, tests/kernels/test_dplr_chunk_precision.py). Within sub-blocks of SUB tokens the decays are
pairwise [SUB, SUB, K]; across sub-blocks they split at the earlier block's last token into two factors of at most
1 and the products are matmuls (`dplr_decayed_products`). Factors are built for groups of chunks whose size
`budget` bounds, and the state is carried through each group before the next is built (memory O(group), not
O(T C K)).
"""

from __future__ import annotations

import torch

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.delta_rule.chunk import tail_decays
from deltalab.kernels.dplr.naive import check_dplr_inputs

__all__ = ["chunk_dplr"]

BUDGET = 1 << 28
"""Bytes for one group's decay factors (about 8 tensors of [G, C, K] times (C / SUB + SUB))."""

SUB = 16
"""Tokens per sub-block: pairs within a sub-block take pairwise [SUB, SUB, K] decays, pairs across sub-blocks
split their decay at the earlier block's end into two factors at most 1 and become matrix products."""


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
    """The recurrence of `naive_dplr` in chunks of `chunk_size` tokens, in PyTorch.

    Computes in float32 (float64 if q is float64); o comes back in q's dtype, states in float32 or float64.
    `budget`: bytes for one group's decay factors; chunks are solved in groups under it (memory O(group)).

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
    # A sequence shorter than a chunk is one chunk, padded to whole sub-blocks where the chunk size allows
    # (padded tokens change nothing, and the boundaries are still (initial, final)).
    C = min(chunk_size, T if chunk_size % SUB else -(-T // SUB) * SUB)
    sub = SUB if C % SUB == 0 else C
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
    eye = torch.eye(C, dtype=dtype, device=q.device)
    elem = torch.finfo(dtype).bits // 8
    group = max(1, budget // max(1, B * H * C * K * (C // sub + sub) * elem * 8))
    outs, boundaries = [], [state]
    for c0 in range(0, n_chunks, group):
        sl = slice(c0, min(n_chunks, c0 + group))
        q_, k_, v_, a_, b_, g_, x_ = qs[:, :, sl], ks[:, :, sl], vs[:, :, sl], as_[:, :, sl], bs[:, :, sl], \
            gam[:, :, sl], gex[:, :, sl]
        (A_qk, A_qb), = dplr_decayed_products([q_], [k_, b_], gs[:, :, sl], sub, strict=False)
        (A_ak, A_ab), = dplr_decayed_products([a_], [k_, b_], gs[:, :, sl], sub, strict=True)
        lhs = eye - A_ab
        U0 = torch.linalg.solve_triangular(lhs, A_ak @ v_, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(lhs, a_ * x_.exp(), upper=False, unitriangular=True)
        q_dec = q_ * g_.exp()
        tail = tail_decays(gs[:, :, sl])  # e^{Gamma_C - Gamma_j}
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


class _Cumsum(torch.autograd.Function):
    """Cumulative sum along `dim` (from the end if `reverse`) as a loop of slice additions, with the opposite sum as
    its backward (differentiable again). On the CPU torch.cumsum (and a flipped one) over a middle axis of the
    [..., sub, sub, K] pair tensor took 3x (5x) the loop's time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
        ctx.dim, ctx.reverse = dim, reverse
        out = x.clone(memory_format=torch.contiguous_format)
        n = x.shape[dim]
        steps = range(n - 2, -1, -1) if reverse else range(1, n)
        for i in steps:
            out.select(dim, i).add_(out.select(dim, i + 1 if reverse else i - 1))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Cumsum.apply(grad, ctx.dim, not ctx.reverse), None, None


def dplr_decayed_products(lefts: list[torch.Tensor], rights: list[torch.Tensor], g: torch.Tensor, sub: int,
                          strict: bool) -> list[list[torch.Tensor]]:
    """A[n][m][i, j] = sum_k x_{n,i,k} y_{m,j,k} e^{g_{j+1,k} + ... + g_{i-s,k}} for j <= i - s, else 0.

    x, y and the log decays g [..., C, K] of the chunk's tokens (not cumulated); s = 1 if strict (pairs j < i, the
    left row reads the state before token i's decay: exponent Gamma_{i-1} - Gamma_j), else s = 0 (pairs j <= i,
    exponent Gamma_i - Gamma_j). Every exponent is summed from the gates it spans, never taken as a difference of
    two running totals (those reach about -600 at log decays of -20 per token, where fp32's spacing is 6e-5), and
    none is positive. Pairs within one sub-block of `sub` tokens take pairwise [sub, sub, K] decays (a cumulative
    sum over i of the gates masked to m > j + s). A pair (i, j) with j in an earlier sub-block r than i splits at
    that block's last token e_r: e^{g_{e_r+1} + ... + g_{i-s}} e^{g_{j+1} + ... + g_{e_r}}, both factors at most 1
    (a forward sum from e_r and a reverse sum within block r), so the off-diagonal blocks are plain matrix products.
    """
    *lead, C, K = g.shape
    nb = C // sub
    s = 1 if strict else 0
    # gl_m = g_{m-s}: the gate that the left's exponent adds at row m (0 at the chunk's first row when strict)
    gl = torch.nn.functional.pad(g[..., : C - s, :], (0, 0, s, 0)) if s else g
    idx = torch.arange(C, device=g.device)
    ends = torch.arange(nb, device=g.device) * sub + sub - 1  # e_r
    # left_decay[r, i] = e^{g_{e_r+1} + ... + g_{i-s}} for i in a block after r, else 0: [..., nb, C, K]
    after_end = (idx[None, :] > ends[:, None] + s)[..., None]  # rows m that the sum from e_r spans
    left_decay = _Cumsum.apply(torch.where(after_end, gl[..., None, :, :], 0.0), -2, False)
    later = ((idx // sub)[None, :] > torch.arange(nb, device=g.device)[:, None])[..., None]  # [nb, C, 1]
    left_decay = left_decay.masked_fill_(~later, -torch.inf).exp_()
    right_decay = tail_decays(g.reshape(*lead, nb, sub, K))  # [..., nb, sub, K]: e^{g_{j+1} + ... + g_{e_r}}
    # pair[r, i, j] = e^{g_{j+1} + ... + g_{i-s}} within block r for j <= i - s, else 0: [..., nb, sub, sub, K]
    s_idx = torch.arange(sub, device=g.device)
    spans_rows = (s_idx[:, None] > s_idx[None, :] + s)[..., None]  # [sub(m), sub(j), 1]: m > j + s
    keep = ((s_idx[:, None] - s) >= s_idx[None, :])[..., None]  # [sub(i), sub(j), 1]
    pair = _Cumsum.apply(torch.where(spans_rows, gl.reshape(*lead, nb, sub, 1, K), 0.0), -3, False)
    pair = pair.masked_fill_(~keep, -torch.inf).exp_()
    block_eye = torch.eye(nb, dtype=g.dtype, device=g.device)[:, None, :, None]  # [nb, 1, nb, 1]
    out = []
    for x in lefts:
        xl = x[..., None, :, :] * left_decay  # [..., nb, C, K]
        xd = x.reshape(*lead, nb, sub, 1, K) * pair  # [..., nb, sub, sub, K]
        row = []
        for y in rights:
            yb = y.reshape(*lead, nb, sub, K)
            off = xl @ (yb * right_decay).transpose(-1, -2)  # [..., nb(r), C(i), sub(j)]
            off = off.permute(*range(len(lead)), -2, -3, -1).reshape(*lead, C, C)
            diag = (xd * yb[..., None, :, :]).sum(-1)  # [..., nb, sub, sub]
            row.append(off + (diag[..., :, :, None, :] * block_eye).reshape(*lead, C, C))
        out.append(row)
    return out
