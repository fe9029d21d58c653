"""One decoding step of the gated delta product for every head at once: the state update and its read-out.

For each batch row and value head hv (reading key head hv // (Hv / Hk)) and one value tile:
    S <- diag(exp g) S  (or exp(g) S for a scalar gate),  then for each of the n_h Householder sub-steps j
    S <- S + beta_j k_j (v_j - S^T k_j)^T,   and   o = scale S^T q,
in float32 whatever the inputs' dtype (the state is float32 in and out). Value columns update independently, so a
program owns a [K, BV] slice of the state: it is read once and written once, which is all a one-token step costs.
Shapes as `kernels.delta_rule.naive` with T = 1: q [B, 1, Hk, K], k [B, 1, n_h, Hk, K], v [B, 1, n_h, Hv, V],
beta [B, 1, n_h, Hv], g [B, 1, Hv] or [B, 1, Hv, K] or None, state [B, Hv, K, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_step_kernel(q, k, v, beta, g, h0, o, h1, scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, NH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                        HAS_H0: tl.constexpr):
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hv = pid_bh // HV, pid_bh % HV
    hk = hv // (HV // HK)
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
    if GATE == 1:  # one log decay per head
        s = s * tl.exp(tl.load(g + pid_bh).to(tl.float32))
    if GATE == 2:  # one per key channel: decays the state's rows
        s = s * tl.exp(tl.load(g + pid_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32))[:, None]
    for j in tl.static_range(NH):
        b_k = tl.load(k + ((b * NH + j) * HK + hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + ((b * NH + j) * HV + hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_b = tl.load(beta + (b * NH + j) * HV + hv).to(tl.float32)
        residual = b_v - tl.sum(s * b_k[:, None], 0)
        s = s + b_b * b_k[:, None] * residual[None, :]
    b_q = tl.load(q + (b * HK + hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    out = scale * tl.sum(s * b_q[:, None], 0)
    tl.store(o + pid_bh * V + o_v, out.to(o.dtype.element_ty), mask=m_v)
    tl.store(h1 + p_s, s, mask=m_s)


def unsupported_reason(q: torch.Tensor, v: torch.Tensor, n_h: int) -> str | None:
    """Why the step kernel does not take these inputs (None: it does)."""
    if q.shape[1] != 1:
        return f"one token per step, got T={q.shape[1]}"
    if q.shape[-1] > 256:
        return f"head key dim {q.shape[-1]} > 256"
    if n_h > 8:
        return f"n_h = {n_h} > 8 Householder sub-steps"
    return None


def triton_delta_rule_step(q, k, v, beta, g, scale: float, state: torch.Tensor | None,
                           block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, 1, Hv, V] in q's dtype, the state after [B, Hv, K, V] float32, boundaries [B, 2, Hv, K, V]: before,
    after) of one token; the contract of `models.cache.delta_rule_step`. `block_v` picks the value tile (tests)."""
    B, _, HK, K = q.shape
    n_h, HV, V = k.shape[2], v.shape[3], v.shape[4]
    why = unsupported_reason(q, v, n_h)
    if why is not None:
        raise ValueError(f"triton_delta_rule_step: {why}")
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g_arg = beta if g is None else g.contiguous()
    h0 = None if state is None else state.to(torch.float32).contiguous()
    o = torch.empty(B, 1, HV, V, dtype=q.dtype, device=q.device)
    h1 = torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)
    BK = triton.next_power_of_2(K)
    BV = block_v or min(triton.next_power_of_2(V), max(16, 4096 // BK))
    grid = (triton.cdiv(V, BV), B * HV)
    _decode_step_kernel[grid](q, k, v, beta, g_arg, h1 if h0 is None else h0, o, h1, float(scale), HK, HV, K, V,
                              n_h, BK, BV, gate, h0 is not None)
    before = torch.zeros_like(h1) if h0 is None else h0
    return o, h1, torch.stack([before, h1], 1)

