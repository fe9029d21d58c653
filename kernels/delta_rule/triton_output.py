"""The delta-rule forward's output kernel (`triton_chunk`): o = scale (e^Gamma q S_c + (q K^T * decay * mask) D),
one program per chunk, value head and value tile."""

from __future__ import annotations

import triton
import triton.language as tl

from deltalab.kernels.triton_utils import chunk_seq, dot_in


@triton.jit
def _load_state_rows(h_base, o_k, m_k, m_v, V: tl.constexpr, EVICT: tl.constexpr):
    """S_c rows o_k [BK, BV]; EVICT: first out of L2 (each is read once; q and K are read again by other tiles)."""
    if EVICT:
        return tl.load(h_base + o_k[:, None] * V, mask=m_k[:, None] & m_v[None, :], other=0.0,
                       eviction_policy="evict_first")
    else:
        return tl.load(h_base + o_k[:, None] * V, mask=m_k[:, None] & m_v[None, :], other=0.0)


@triton.jit
def _out_key_block(q_base, h_base, k_base, s0, kb, m_t, m_v, Tn, HK: tl.constexpr, NH: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, QK: tl.constexpr, EVICT: tl.constexpr):
    """Key block kb of the output kernel's operands: q [64, BK], S_c rows [BK, BV] and, with QK, each WY block's
    keys [64, BK] (zeros past dk, so a block past the last loads nothing)."""
    o_k = kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_q = tl.load(q_base + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_h = _load_state_rows(h_base, o_k, m_k, m_v, V, EVICT)
    p_k = k_base + s0[:, None] * (HK * K) + o_k[None, :]
    b_k0 = b_q  # placeholders where there is no such block (never read)
    if QK:
        b_k0 = tl.load(p_k, mask=(s0 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
    b_k1 = b_k0
    b_k2 = b_k0
    if QK and NH > 1:
        b_k1 = tl.load(p_k + 64 * (HK * K), mask=(s0 + 64 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
    if QK and NH > 2:
        b_k2 = tl.load(p_k + 128 * (HK * K), mask=(s0 + 128 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
    return b_q, b_h, b_k0, b_k1, b_k2


@triton.jit
def _out_key_products(k, b_q, b_h, b_k0, b_k1, b_k2, b_qq, b_o, b_s0, b_s1, b_s2, NH: tl.constexpr,
                      NORM: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, QK: tl.constexpr):
    """One key block's share of |q|^2, q S_c and, with QK, each WY block's q K^T."""
    if NORM:
        b_qf = b_q.to(tl.float32)
        b_qq += tl.sum(b_qf * b_qf, 1)
    b_qd = dot_in(b_q, k, F32)
    b_o += tl.dot(b_qd, dot_in(b_h, k, F32), input_precision=PREC)
    if QK:
        b_s0 += tl.dot(b_qd, tl.trans(dot_in(b_k0, k, F32)), input_precision=PREC)
    if QK and NH > 1:
        b_s1 += tl.dot(b_qd, tl.trans(dot_in(b_k1, k, F32)), input_precision=PREC)
    if QK and NH > 2:
        b_s2 += tl.dot(b_qd, tl.trans(dot_in(b_k2, k, F32)), input_precision=PREC)
    return b_qq, b_o, b_s0, b_s1, b_s2


@triton.jit
def output_kernel(
    q,
    k,
    D,
    Aqk,
    Aqp,
    gcum,
    rstd,
    bnd,
    o,
    T,
    cu,
    cidx,
    coff,
    NCT,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    NH: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NORM: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    AQK: tl.constexpr = False,
    EVICT: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    USE_G: tl.constexpr = True,
):
    """One program per (value tile, global chunk, value head): o = scale (e^G q S_c + (q K^T * decay * mask) D).
    The key dimension runs in blocks of BK (a loop, so that the next block's q, K and S_c rows load during this
    block's products): q S_c and each n_h block's q K^T (at most three) accumulate over them. AQK: q K^T * decay
    * mask comes from `kkt_kernel` (Aqk, formed once a chunk, not once a value tile); the loop forms only q S_c.
    EVICT: the chunk states are loaded evict-first (each is read once; q and K are read again by the other value
    tiles). PAIR (n_h = 1, with AQK): an odd chunk c of a sequence reads S_{c-1}, not S_c, and adds chunk c-1's
    share, o = scale (e^{G + G_end'} q S_{c-1} + Aqp D' + Aqk D) (primes: chunk c-1; Aqp = (q K'^T * e^{G + G_end' -
    G'}) / (|q| |k'|) from `kkt_kernel`), so that the state kernel stores only even chunks' states when nobody returns
    them. Without gates (USE_G false) every decay is e^0: no log decay is read and no exponential formed."""
    i_v, gc, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, c, bos, Tn = chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
    i_hk = i_h // (HV // HK)
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    aux = (i_h.to(tl.int64) * NCT + gc) * L
    t = c * 64 + o_r
    m_t = t < Tn
    q_base = q + (bos + t)[:, None] * (HK * K) + i_hk * K
    k_base = k + bos * NH * (HK * K) + i_hk * K
    s0 = c * L + o_r  # sub-steps of block 0 (block a: s0 + 64 a)
    par = c % 2 if PAIR else 0  # 1: an odd chunk under PAIR, which reads S_{c-1}
    h_base = bnd + ((gc + i_n - par).to(tl.int64) * HV + i_h) * K * V + o_v[None, :]
    b_qq = tl.zeros([64], dtype=tl.float32)
    b_o = tl.zeros([64, BV], dtype=tl.float32)
    b_s0 = tl.zeros([64, 64], dtype=tl.float32)
    b_s1 = tl.zeros([64, 64], dtype=tl.float32)
    b_s2 = tl.zeros([64, 64], dtype=tl.float32)
    if PREFETCH:  # the next key block's tiles load while this block's products run (a pipeline by hand)
        b_q, b_h, b_k0, b_k1, b_k2 = _out_key_block(
            q_base, h_base, k_base, s0, 0, m_t, m_v, Tn, HK, NH, K, V, BK, not AQK, EVICT
        )
        for kb in range(tl.cdiv(K, BK)):
            n_q, n_h, n_k0, n_k1, n_k2 = _out_key_block(
                q_base, h_base, k_base, s0, kb + 1, m_t, m_v, Tn, HK, NH, K, V, BK, not AQK, EVICT
            )  # all masked off after the last block: no memory access
            b_qq, b_o, b_s0, b_s1, b_s2 = _out_key_products(
                k, b_q, b_h, b_k0, b_k1, b_k2, b_qq, b_o, b_s0, b_s1, b_s2, NH, NORM, F32, PREC, not AQK
            )
            b_q, b_h, b_k0, b_k1, b_k2 = n_q, n_h, n_k0, n_k1, n_k2
    else:  # the measured default: each block's loads next to their products
        for kb in range(tl.cdiv(K, BK)):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q = tl.load(q_base + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            if NORM:
                b_qf = b_q.to(tl.float32)
                b_qq += tl.sum(b_qf * b_qf, 1)
            b_qd = dot_in(b_q, k, F32)
            b_h = _load_state_rows(h_base, o_k, m_k, m_v, V, EVICT)
            b_o += tl.dot(b_qd, dot_in(b_h, k, F32), input_precision=PREC)
            p_k = k_base + s0[:, None] * (HK * K) + o_k[None, :]
            if not AQK:
                b_k = tl.load(p_k, mask=(s0 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
                b_s0 += tl.dot(b_qd, tl.trans(dot_in(b_k, k, F32)), input_precision=PREC)
            if NH > 1 and not AQK:
                b_k = tl.load(p_k + 64 * (HK * K), mask=(s0 + 64 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
                b_s1 += tl.dot(b_qd, tl.trans(dot_in(b_k, k, F32)), input_precision=PREC)
            if NH > 2 and not AQK:
                b_k = tl.load(p_k + 128 * (HK * K), mask=(s0 + 128 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
                b_s2 += tl.dot(b_qd, tl.trans(dot_in(b_k, k, F32)), input_precision=PREC)
    if NORM:
        b_rq = 1.0 / tl.sqrt(b_qq + 1e-6)
    else:
        b_rq = tl.full([64], 1.0, dtype=tl.float32)
    if USE_G:
        b_Gq = tl.load(gcum + aux + o_r * NH + NH - 1)
        b_Gs = b_Gq  # the log decay from the state read to each query
        if PAIR:  # an odd chunk's S_{c-1} decays over chunk c-1 first (G_end'; no load for an even chunk)
            b_Gs += tl.load(gcum + aux - 1 + o_r * 0, mask=(o_r * 0 + par) == 1, other=0.0)
        b_o = b_o * (b_rq * tl.exp(b_Gs))[:, None]
    else:
        b_o = b_o * b_rq[:, None]
    if PAIR:
        if par == 1:  # chunk c-1's share
            b_x = tl.load(Aqp + (aux // NH + o_r)[:, None] * 64 + o_r[None, :])
            b_dp = tl.load(D + (aux - 64 + o_r)[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
            b_o += tl.dot(dot_in(b_x, k, F32), dot_in(b_dp, k, F32), input_precision=PREC)
    for a in tl.static_range(NH):
        rows = aux + a * 64 + o_r
        if AQK:  # scaled and masked already (`kkt_kernel`)
            b_s = tl.load(Aqk + (aux // NH + o_r)[:, None] * L + a * 64 + o_r[None, :])
        else:
            if a == 0:
                b_s = b_s0
            elif a == 1:
                b_s = b_s1
            else:
                b_s = b_s2
            if USE_G:  # (loaded before rstd, as the gated kernel always did: one branch reorders its TTGIR)
                b_G = tl.load(gcum + rows)
            b_rs = tl.load(rstd + rows)
            tok = (a * 64 + o_r) // NH
            m_a = tok[None, :] <= o_r[:, None]
            if USE_G:
                b_dec = tl.exp(tl.where(m_a, b_Gq[:, None] - b_G[None, :], 0.0))
                b_s = tl.where(m_a, b_s * b_rq[:, None] * b_rs[None, :] * b_dec, 0.0)
            else:
                b_s = tl.where(m_a, b_s * b_rq[:, None] * b_rs[None, :], 0.0)
        b_d = tl.load(D + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_o += tl.dot(dot_in(b_s, k, F32), dot_in(b_d, k, F32), input_precision=PREC)
    p_o = o + (bos + t)[:, None] * (HV * V) + i_h * V + o_v[None, :]
    tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
