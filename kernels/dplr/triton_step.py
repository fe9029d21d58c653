"""One decoding step of the generalised delta rule (RWKV-7) for every head at once: the state update and read-out.

Per batch row, head and value tile, in float32 whatever the inputs' dtype (`kernels.dplr.naive` with T = 1):
    S <- diag(exp g) S + b (a^T S) + k v^T,   o = scale S^T q.
Value columns update independently, so a program owns a [K, BV] slice of the state, read once and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dplr_step_kernel(q, k, v, a, b, g, h0, o, h1, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_H0: tl.constexpr):
    """S <- diag(exp g) S + b (a^T S) + k v^T, o = scale S^T q for one (row, head) and value tile: the rank-one
    term reads the state before the decay (`kernels.dplr.naive`)."""
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = pid_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = pid_bh * K * V + o_k[:, None] * V + o_v[None, :]
    if HAS_H0:
        s = tl.load(h0 + p_s, mask=m_s, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    p_k = pid_bh * K + o_k
    b_a = tl.load(a + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_b = tl.load(b + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + pid_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    read = tl.sum(s * b_a[:, None], 0)
    if GATE:
        s = s * tl.exp(tl.load(g + p_k, mask=m_k, other=0.0).to(tl.float32))[:, None]
    s = s + b_b[:, None] * read[None, :] + b_k[:, None] * b_v[None, :]
    out = scale * tl.sum(s * b_q[:, None], 0)
    tl.store(o + pid_bh * V + o_v, out.to(o.dtype.element_ty), mask=m_v)
    tl.store(h1 + p_s, s, mask=m_s)


def triton_dplr_step(q, k, v, a, b, g, scale: float, state: torch.Tensor | None,
                     block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of the generalised delta rule (RWKV-7), the contract of `models.cache.dplr_step`: q, k, a, b, g
    [B, 1, H, K] (g may be None), v [B, 1, H, V], state [B, H, K, V] or None -> (o [B, 1, H, V] in q's dtype,
    state after [B, H, K, V] float32, boundaries [B, 2, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T != 1 or K > 256:
        raise ValueError(f"triton_dplr_step: one token of head key dim <= 256, got T={T}, K={K}")
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    g_arg = a if g is None else g.contiguous()
    h0 = None if state is None else state.to(torch.float32).contiguous()
    o = torch.empty(B, 1, H, V, dtype=q.dtype, device=q.device)
    h1 = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    BK = triton.next_power_of_2(K)
    BV = block_v or min(triton.next_power_of_2(V), max(16, 4096 // BK))
    grid = (triton.cdiv(V, BV), B * H)
    _dplr_step_kernel[grid](q, k, v, a, b, g_arg, h1 if h0 is None else h0, o, h1, float(scale), H, K, V, BK, BV,
                            g is not None, h0 is not None)
    before = torch.zeros_like(h1) if h0 is None else h0
    return o, h1, torch.stack([before, h1], 1)
