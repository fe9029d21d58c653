"""Triton chunked (WY/UT) forward of Kimi Delta Attention: per-key-channel gates, one Householder step a token.

H_t = (I - b_t k_t k_t^T) diag(e^{g_t}) H_{t-1} + b_t k_t v_t^T,  o_t = scale H_t^T q_t,  g_t in R^dk (log decays,
g <= 0). Same contract as `kernels.delta_rule.triton_chunk.triton_delta_product` (o, final states and the fp32 states at
every 64-token chunk boundary; grouped heads read in the kernels; packed batches via `cu_seqlens`; bf16, fp16 or
fp32 inputs), for g [B, T, Hv, dk] and n_h = 1. Within a chunk with cumulative log decays Gamma_i in R^dk
(from the chunk start, token i's gate included) and start state S:

    (I + A) Dlt = diag(b) (V - (e^Gamma * K) S),  A_ij = b_i sum_c k_ic k_jc e^{Gamma_ic - Gamma_jc}   (j < i)
    o_i = scale ((e^Gamma_i * q_i) S + sum_{j <= i} Aqk_ij Dlt_j),  Aqk_ij = sum_c q_ic k_jc e^{Gamma_ic - Gamma_jc}
    S' = diag(e^{Gamma_last}) S + (e^{Gamma_last - Gamma} * K)^T Dlt

Every exponent is a difference Gamma_i - Gamma_j with j <= i, never positive, and is summed from the gates it
spans (g_{j+1} + ... + g_i) rather than subtracted, which keeps fp32 to ~1e-7 at strong decays. The pairs are
taken in 16-token sub-blocks: a pair in two different sub-blocks factors through the first token r of the later one,
e^{Gamma_i - Gamma_j} = e^{Gamma_i - Gamma_r} e^{Gamma_r - Gamma_j} (both <= 1), so A and Aqk are matrix
products there; pairs within a sub-block (16 x 16 per sub-block) are summed channel by channel, their decays
e^{g_{j+1} + ... + g_i} built column by column as running products of the per-token factors e^{g_u} (each <= 1).

Kernels:
1. `_intra_chunk_kernel` (one program per chunk and value head): Gamma's differences, A (fp32, into a temporary
   [Hv, chunks * 64, 64]) and Aqk as 4 x 4 blocks of 16 x 16 tokens; triton_prep's `_tri_inverse_kernel`
   (`launch_inverse`): T = (I + A)^-1 a block a program; `_wy_kernel` (one program per key block or value tile,
   chunk and value head): W = T diag(b) (e^Gamma * K), U = T diag(b) V, Kd = e^{Gamma_last - Gamma} * K,
   Qd = e^Gamma * q and Gamma_last.
2. `_state_kernel` (sequential over a sequence's chunks, parallel over sequence x value head x value tile):
   stores S_c, Dlt = U - W S_c, S_{c+1} = e^{Gamma_last} S_c + Kd^T Dlt (dk > 128 as two key halves, as
   `triton_chunk`: a [256, 32] tile miscompiled on a Hopper GPU).
3. `_output_kernel` (parallel over chunks): o = scale (Qd S_c + Aqk Dlt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltalab.kernels.delta_rule.naive import CHUNK_SIZE, check_inputs, l2_normalize
from deltalab.kernels.delta_rule.triton_chunk import default_config
from deltalab.kernels.delta_rule.triton_prep import launch_inverse, store_lower_blocks, store_upper_zeros
from deltalab.kernels.delta_rule.triton_state import store_state, u_minus_ws
from deltalab.kernels.triton_utils import (
    chunk_seq,
    dot_in,
    interpreting,
    launch_resident,
    pow2,
    varlen_tables,
)

MAX_K, MAX_V = 256, 512  # head dims this path takes (the dispatcher falls back beyond)


@triton.jit
def _chunk_bases(i_h, gc, q, k, g, T, cu, cidx, coff, NCT, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 IS_VARLEN: tl.constexpr):  # fmt: skip
    """(first token of the sequence, its length, the chunk's first token within it, the chunk's key, query and
    gate row-0 pointers, and blk = i_h * NCT + gc, the chunk's block of 64 rows in W/U/Kd/Qd/Aqk/A) of global
    chunk gc of value head i_h."""
    i_n, c, bos, Tn = chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
    i_hk = i_h // (HV // HK)
    k_base = k + bos * (HK * K) + i_hk * K
    q_base = q + bos * (HK * K) + i_hk * K
    g_base = g + (bos * HV + i_h) * K  # token row u at + u * HV * K; padded tokens read 0 (no decay)
    return bos, Tn, c * 64, k_base, q_base, g_base, i_h.to(tl.int64) * NCT + gc


@triton.jit
def _own_pairs_by_channel(r, q_base, k_base, g_base, t0, Tn, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                          BK: tl.constexpr, BKW: tl.constexpr):  # fmt: skip
    """The 16 x 16 pairs of the sub-block starting at chunk row r, channel by channel: (Akk strictly lower, without
    beta; Aqk lower with the diagonal). Column by column from the last: P_i = e^{g_{j+1} + ... + g_i} (i > j) is
    P_i for column j + 1 times e^{g_{j+1}}, one [dk] exponential per column (no scan); a product of factors <= 1
    rounds like the sum, ~(i - j) ulps, whatever the decays. Key channels in blocks of BKW (a loop, not unrolled)."""
    o_i = tl.arange(0, 16)
    ri = r + o_i
    m_ri = (t0 + ri) < Tn
    b_Ad = tl.zeros([16, 16], dtype=tl.float32)
    b_Qd = tl.zeros([16, 16], dtype=tl.float32)
    for cw in range(BK // BKW):
        o_w = cw * BKW + tl.arange(0, BKW)
        m_rw = m_ri[:, None] & (o_w < K)[None, :]
        b_kI = tl.load(k_base + (t0 + ri)[:, None] * (HK * K) + o_w[None, :], mask=m_rw, other=0.0).to(tl.float32)
        b_qI = tl.load(q_base + (t0 + ri)[:, None] * (HK * K) + o_w[None, :], mask=m_rw, other=0.0).to(tl.float32)
        b_P = tl.full([16, BKW], 1.0, dtype=tl.float32)
        for s in range(16):
            jj = 15 - s
            j = r + jj
            m_kj = o_w < tl.where(t0 + j < Tn, K, 0)  # (a scalar & a vector mask trips the interpreter)
            b_kj = tl.load(k_base + (t0 + j) * (HK * K) + o_w, mask=m_kj, other=0.0).to(tl.float32)
            m_g1 = o_w < tl.where((jj < 15) & (t0 + j + 1 < Tn), K, 0)
            b_e1 = tl.exp(tl.load(g_base + (t0 + j + 1) * (HV * K) + o_w, mask=m_g1, other=0.0).to(tl.float32))
            b_P = tl.where(o_i[:, None] > jj, b_P * b_e1[None, :], 1.0)
            b_ke = b_kj[None, :] * b_P
            b_kk = tl.sum(b_kI * b_ke, 1)
            b_qk = tl.sum(b_qI * b_ke, 1)
            sel = o_i[None, :] == jj
            b_Ad = tl.where(sel & (o_i > jj)[:, None], b_Ad + b_kk[:, None], b_Ad)
            b_Qd = tl.where(sel & (o_i >= jj)[:, None], b_Qd + b_qk[:, None], b_Qd)
    return b_Ad, b_Qd


@triton.jit
def _sub_tiles(I: tl.constexpr, o_c, m_c, q_base, k_base, g_base, t0, Tn, HK: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, BOUND: tl.constexpr, F32: tl.constexpr):  # fmt: skip
    """Key channels o_c of sub-block I (chunk rows r = 16 I .. r + 15), every exponent a sum of the gates it spans:
    X = e^{G_i - G_r} k_i and Q = e^{G_i - G_r} q_i (rows), Z = e^{-(G_j - G_r)} k_j clamped at e^BOUND (its own
    columns), Y = e^{G_{r+16} - G_j} k_j (columns for later sub-blocks), tot = G_{r+16} - G_r per channel, and low,
    the smallest G_{r+15} - G_r over the channels (Z is exact when low >= -BOUND)."""
    o_i = tl.arange(0, 16)
    t = t0 + 16 * I + o_i
    m = (t < Tn)[:, None] & m_c
    p = t[:, None] * (HK * K) + o_c[None, :]
    b_g = tl.load(g_base + t[:, None] * (HV * K) + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    b_rc = tl.cumsum(tl.where(o_i[:, None] > 0, b_g, 0.0), 0)  # G_i - G_r
    b_k = tl.load(k_base + p, mask=m, other=0.0).to(tl.float32)
    b_q = tl.load(q_base + p, mask=m, other=0.0).to(tl.float32)
    b_r = tl.exp(b_rc)
    low = tl.min(tl.sum(tl.where(o_i[:, None] > 0, b_g, 0.0), 0), 0)
    b_z = dot_in(b_k * tl.exp(tl.minimum(-b_rc, BOUND)), k_base, F32)
    if I < 3:  # g_{j+1}: the gates shifted up a row (row 15 is the next sub-block's first token)
        m_s = ((t + 1) < Tn)[:, None] & m_c
        b_gs = tl.load(g_base + (t + 1)[:, None] * (HV * K) + o_c[None, :], mask=m_s, other=0.0).to(tl.float32)
        b_y = b_k * tl.exp(tl.cumsum(b_gs, 0, reverse=True))
        tot = tl.sum(b_gs, 0)
    else:
        b_y = b_k
        tot = tl.sum(b_g, 0)
    return dot_in(b_k * b_r, k_base, F32), dot_in(b_q * b_r, k_base, F32), b_z, b_y, tot, low


@triton.jit
def _own_block(b_akk, b_aqk, I: tl.constexpr, low, q_base, k_base, g_base, t0, Tn, HK: tl.constexpr,
               HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr,
               BOUND: tl.constexpr):  # fmt: skip
    """Sub-block I's own 16 x 16 blocks (Akk strictly lower, without beta; Aqk lower): the products, masked to
    the triangle, where they were exact, else channel by channel (`_own_pairs_by_channel`)."""
    o_i = tl.arange(0, 16)
    if low >= -BOUND:
        b_akk = tl.where(o_i[:, None] > o_i[None, :], b_akk, 0.0)
        b_aqk = tl.where(o_i[:, None] >= o_i[None, :], b_aqk, 0.0)
    else:
        b_akk, b_aqk = _own_pairs_by_channel(16 * I, q_base, k_base, g_base, t0, Tn, HK, HV, K, BK, BKW)
    return b_akk, b_aqk


@triton.jit
def _intra_chunk_kernel(
    q,
    k,
    beta,
    g,
    A,
    Aqk,
    T,
    cu,
    cidx,
    coff,
    NCT,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BKW: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    BOUND: tl.constexpr,
):
    """Prep, first kernel, one program per (global chunk, value head): the chunk's Aqk and A = diag(b) Akk (fp32,
    into a temporary [Hv, chunks * 64, 64]) as 4 x 4 blocks of 16 x 16 tokens. Block (I, J < I) factors through the
    sub-block boundaries r_I and r_{J+1}: e^{G_i - G_j} = e^{G_i - G_{r_I}} e^{G_{r_I} - G_{r_{J+1}}}
    e^{G_{r_{J+1}} - G_j}, every factor <= 1 and summed from the gates it spans (`_sub_tiles`), never taken as a
    difference of two cumulative sums over the chunk: those reach -600 at g = -20 per token, where fp32 spacing
    (6e-5) is the relative error of a decay near 1. The own blocks (I, I) factor through r_I as well when every
    channel's decay over the sub-block stays above e^-BOUND (the second factor <= e^BOUND, finite in the dot's
    operand type), else their pairs are summed channel by channel (`_own_pairs_by_channel`), their decays built as
    running products of the per-token factors e^{g_u}. Each key-channel block loads a sub-block's q, k and g once."""
    gc, i_h = tl.program_id(0), tl.program_id(1)
    bos, Tn, t0, k_base, q_base, g_base, blk = _chunk_bases(i_h, gc, q, k, g, T, cu, cidx, coff, NCT, HK, HV, K,
                                                            IS_VARLEN)  # fmt: skip
    A_blk = A + blk * (64 * 64)
    Aqk_blk = Aqk + blk * (64 * 64)
    z = tl.zeros([16, 16], dtype=tl.float32)
    a00, a11, a22, a33, a10, a21, a32, a20, a31, a30 = z, z, z, z, z, z, z, z, z, z
    q00, q11, q22, q33, q10, q21, q32, q20, q31, q30 = z, z, z, z, z, z, z, z, z, z
    low0, low1, low2, low3 = 0.0, 0.0, 0.0, 0.0
    for cb in range(BK // BKC):
        o_c = cb * BKC + tl.arange(0, BKC)
        m_c = (o_c < K)[None, :]
        x0, p0, z0, y0, t0_, l0 = _sub_tiles(0, o_c, m_c, q_base, k_base, g_base, t0, Tn, HK, HV, K, BOUND, F32)
        x1, p1, z1, y1, t1_, l1 = _sub_tiles(1, o_c, m_c, q_base, k_base, g_base, t0, Tn, HK, HV, K, BOUND, F32)
        x2, p2, z2, y2, t2_, l2 = _sub_tiles(2, o_c, m_c, q_base, k_base, g_base, t0, Tn, HK, HV, K, BOUND, F32)
        x3, p3, z3, y3, t3_, l3 = _sub_tiles(3, o_c, m_c, q_base, k_base, g_base, t0, Tn, HK, HV, K, BOUND, F32)
        low0, low1 = tl.minimum(low0, l0), tl.minimum(low1, l1)
        low2, low3 = tl.minimum(low2, l2), tl.minimum(low3, l3)
        e1 = tl.exp(t1_)[None, :]  # G_{r_2} - G_{r_1}
        e2 = tl.exp(t2_)[None, :]  # G_{r_3} - G_{r_2}
        y0b = y0 * e1  # columns of sub-block 0 seen from r_2
        y0c = dot_in(y0b * e2, k_base, F32)  # ... from r_3
        y1b = dot_in(y1 * e2, k_base, F32)  # sub-block 1 from r_3
        y0b = dot_in(y0b, k_base, F32)
        y0 = dot_in(y0, k_base, F32)
        y1 = dot_in(y1, k_base, F32)
        y2 = dot_in(y2, k_base, F32)
        a00 += tl.dot(x0, tl.trans(z0), input_precision=PREC)
        a11 += tl.dot(x1, tl.trans(z1), input_precision=PREC)
        a22 += tl.dot(x2, tl.trans(z2), input_precision=PREC)
        a33 += tl.dot(x3, tl.trans(z3), input_precision=PREC)
        a10 += tl.dot(x1, tl.trans(y0), input_precision=PREC)
        a21 += tl.dot(x2, tl.trans(y1), input_precision=PREC)
        a32 += tl.dot(x3, tl.trans(y2), input_precision=PREC)
        a20 += tl.dot(x2, tl.trans(y0b), input_precision=PREC)
        a31 += tl.dot(x3, tl.trans(y1b), input_precision=PREC)
        a30 += tl.dot(x3, tl.trans(y0c), input_precision=PREC)
        q00 += tl.dot(p0, tl.trans(z0), input_precision=PREC)
        q11 += tl.dot(p1, tl.trans(z1), input_precision=PREC)
        q22 += tl.dot(p2, tl.trans(z2), input_precision=PREC)
        q33 += tl.dot(p3, tl.trans(z3), input_precision=PREC)
        q10 += tl.dot(p1, tl.trans(y0), input_precision=PREC)
        q21 += tl.dot(p2, tl.trans(y1), input_precision=PREC)
        q32 += tl.dot(p3, tl.trans(y2), input_precision=PREC)
        q20 += tl.dot(p2, tl.trans(y0b), input_precision=PREC)
        q31 += tl.dot(p3, tl.trans(y1b), input_precision=PREC)
        q30 += tl.dot(p3, tl.trans(y0c), input_precision=PREC)
    o_i = tl.arange(0, 16)
    b0 = tl.load(beta + (bos + t0 + o_i) * HV + i_h, mask=(t0 + o_i) < Tn, other=0.0).to(tl.float32)
    b1 = tl.load(beta + (bos + t0 + 16 + o_i) * HV + i_h, mask=(t0 + 16 + o_i) < Tn, other=0.0).to(tl.float32)
    b2 = tl.load(beta + (bos + t0 + 32 + o_i) * HV + i_h, mask=(t0 + 32 + o_i) < Tn, other=0.0).to(tl.float32)
    b3 = tl.load(beta + (bos + t0 + 48 + o_i) * HV + i_h, mask=(t0 + 48 + o_i) < Tn, other=0.0).to(tl.float32)
    a00, q00 = _own_block(a00, q00, 0, low0, q_base, k_base, g_base, t0, Tn, HK, HV, K, BK, BKW, BOUND)
    a11, q11 = _own_block(a11, q11, 1, low1, q_base, k_base, g_base, t0, Tn, HK, HV, K, BK, BKW, BOUND)
    a22, q22 = _own_block(a22, q22, 2, low2, q_base, k_base, g_base, t0, Tn, HK, HV, K, BK, BKW, BOUND)
    a33, q33 = _own_block(a33, q33, 3, low3, q_base, k_base, g_base, t0, Tn, HK, HV, K, BK, BKW, BOUND)
    store_lower_blocks(Aqk_blk, q00, q11, q22, q33, q10, q21, q32, q20, q31, q30)
    store_upper_zeros(Aqk_blk)
    # diag(b) Akk, block row by block row
    a00, a11, a22, a33 = a00 * b0[:, None], a11 * b1[:, None], a22 * b2[:, None], a33 * b3[:, None]
    a10, a20, a30 = a10 * b1[:, None], a20 * b2[:, None], a30 * b3[:, None]
    a21, a31, a32 = a21 * b2[:, None], a31 * b3[:, None], a32 * b3[:, None]
    store_lower_blocks(A_blk, a00, a11, a22, a33, a10, a21, a32, a20, a31, a30)
    store_upper_zeros(A_blk)


@triton.jit
def _wy_key_block(
    cb, b_Ti, b_b, q_base, k_base, g_base, W, Kd, Qd, glast, t, m_t, Tn, rows, blk,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BKC: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
    KD_DIFF: tl.constexpr,
):  # fmt: skip
    """Key columns cb * BKC + [0, BKC) of the chunk's W = T diag(b) (e^Gamma * K), Kd = e^{Gamma_last - Gamma} * K,
    Qd = e^Gamma * q and Gamma_last: W is separable by key columns."""
    o_c = cb * BKC + tl.arange(0, BKC)
    m_c = (o_c < K)[None, :]
    p_gc = g_base + t[:, None] * (HV * K) + o_c[None, :]
    b_g = tl.load(p_gc, mask=m_t[:, None] & m_c, other=0.0).to(tl.float32)
    b_Gl = tl.sum(b_g, 0)
    b_G = tl.cumsum(b_g, 0)
    b_eG = tl.exp(b_G)  # e^{Gamma_i}
    p_c = t[:, None] * (HK * K) + o_c[None, :]
    b_k = tl.load(k_base + p_c, mask=m_t[:, None] & m_c, other=0.0).to(tl.float32)
    b_q = tl.load(q_base + p_c, mask=m_t[:, None] & m_c, other=0.0).to(tl.float32)
    tl.store(Qd + rows[:, None] * K + o_c[None, :], (b_q * b_eG).to(Qd.dtype.element_ty), mask=m_c)
    if KD_DIFF:  # e^{Gamma_last - Gamma_j} k_j from the cumulative sums: no second load, no second scan
        b_kd = b_k * tl.exp(b_Gl[None, :] - b_G)
    else:
        o_r = tl.arange(0, 64)
        b_gs = tl.load(p_gc + HV * K, mask=((o_r < 63) & (t + 1 < Tn))[:, None] & m_c, other=0.0).to(tl.float32)
        b_kd = b_k * tl.exp(tl.cumsum(b_gs, 0, reverse=True))  # e^{g_{j+1} + ... + g_last} k_j
    tl.store(Kd + rows[:, None] * K + o_c[None, :], b_kd.to(Kd.dtype.element_ty), mask=m_c)
    tl.store(glast + blk * K + o_c, b_Gl, mask=o_c < K)
    b_X = dot_in(b_k * b_eG * b_b[:, None], k_base, F32)  # last, so that G, k and q are dead during the product
    b_W = tl.dot(b_Ti, b_X, input_precision=PREC)
    tl.store(W + rows[:, None] * K + o_c[None, :], b_W.to(W.dtype.element_ty), mask=m_c)


@triton.jit
def _wy_value_tile(
    iv, b_Ti, b_b, v_base, U, t, m_t, rows, k_base,
    HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Value columns iv * BV + [0, BV) of the chunk's U = T diag(b) V."""
    o_v = iv * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_v = tl.load(v_base + t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_U = tl.dot(b_Ti, dot_in(b_v.to(tl.float32) * b_b[:, None], k_base, F32), input_precision=PREC)
    tl.store(U + rows[:, None] * V + o_v[None, :], b_U.to(U.dtype.element_ty), mask=m_v[None, :])


@triton.jit
def _wy_rows(
    b_Ti,
    q_base,
    k_base,
    g_base,
    v,
    beta,
    W,
    U,
    Kd,
    Qd,
    glast,
    bos,
    Tn,
    t0,
    i_h,
    blk,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BV: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    KD_DIFF: tl.constexpr,
    part,
):
    """Given T (b_Ti, in dot operand precision), block `part` of the chunk's W, Kd, Qd and Gamma_last (key blocks
    first) or of U (value tiles after them), stored at block blk."""
    o_r = tl.arange(0, 64)
    t = t0 + o_r
    m_t = t < Tn
    rows = blk * 64 + o_r
    b_b = tl.load(beta + (bos + t) * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    v_base = v + bos * (HV * V) + i_h * V
    NKB: tl.constexpr = BK // BKC
    if part < NKB:
        _wy_key_block(part, b_Ti, b_b, q_base, k_base, g_base, W, Kd, Qd, glast, t, m_t, Tn, rows, blk,
                      HK, HV, K, BKC, F32, PREC, KD_DIFF)  # fmt: skip
    else:
        _wy_value_tile(part - NKB, b_Ti, b_b, v_base, U, t, m_t, rows, k_base, HV, V, BV, F32, PREC)


@triton.jit
def _wy_kernel(
    q,
    k,
    v,
    beta,
    g,
    A,
    W,
    U,
    Kd,
    Qd,
    glast,
    T,
    cu,
    cidx,
    coff,
    NCT,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    KD_DIFF: tl.constexpr,
):
    """Prep, second kernel: one program per (key block or value tile, global chunk, value head), each loading the
    chunk's T = (I + A)^-1 (from `_tri_inverse_kernel`, zeros above the diagonal) for its block of W, Kd, Qd and
    Gamma_last or its value tile of U (`_wy_rows`): more loads in flight than one program's sequence of blocks.
    KD_DIFF: Kd's factors e^{Gamma_last - Gamma_j} from the cumulative sums (half dtypes), not a second gate load
    and a reverse scan (fp32)."""
    part, gc, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, Tn, t0, k_base, q_base, g_base, blk = _chunk_bases(i_h, gc, q, k, g, T, cu, cidx, coff, NCT, HK, HV, K,
                                                            IS_VARLEN)  # fmt: skip
    o_r = tl.arange(0, 64)
    b_Ti = dot_in(tl.load(A + blk * (64 * 64) + o_r[:, None] * 64 + o_r[None, :]), k, F32)
    _wy_rows(b_Ti, q_base, k_base, g_base, v, beta, W, U, Kd, Qd, glast, bos, Tn, t0, i_h, blk,
             HK, HV, K, V, BK, BKC, BV, F32, PREC, KD_DIFF, part)  # fmt: skip


@triton.jit
def _state_kernel(
    W,
    U,
    Kd,
    D,
    glast,
    bnd,
    ht,
    h0,
    T,
    cu,
    coff,
    order,
    NCT,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BKH: tl.constexpr,
    SPLIT: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    STORE_BND: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program per (value tile, sequence * value head), over the sequence's chunks: store S_c,
    D = U - W S_c and S_{c+1} = diag(e^{Gamma_last}) S_c + Kd^T D. Key rows in two halves when dk > 128."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    if IS_VARLEN:  # longest sequences first (`order`)
        i_n = tl.load(order + i_n).to(tl.int32)
        i_nh = i_n * HV + i_h
        bos = tl.load(cu + i_n).to(tl.int64)
        Tn = (tl.load(cu + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        gc0 = tl.load(coff + i_n).to(tl.int32)
    else:
        Tn = T
        gc0 = i_n * tl.cdiv(T, 64)
    NC = tl.cdiv(Tn, 64)
    o_r = tl.arange(0, 64)
    o_k1 = tl.arange(0, BKH)
    o_k2 = BKH + tl.arange(0, BKH)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k1 = o_k1 < K
    m_k2 = o_k2 < K
    m_v = o_v < V
    m_h1 = m_k1[:, None] & m_v[None, :]
    m_h2 = m_k2[:, None] & m_v[None, :]
    p_h1 = o_k1[:, None] * V + o_v[None, :]
    p_h2 = o_k2[:, None] * V + o_v[None, :]
    bnd_base = bnd + ((gc0 + i_n).to(tl.int64) * HV + i_h) * K * V  # this sequence's first boundary
    b_h2 = tl.zeros([BKH, BV], dtype=tl.float32)
    if HAS_H0:
        h0_base = h0 + i_nh.to(tl.int64) * K * V
        b_h1 = tl.load(h0_base + p_h1, mask=m_h1, other=0.0).to(tl.float32)
        if SPLIT:
            b_h2 = tl.load(h0_base + p_h2, mask=m_h2, other=0.0).to(tl.float32)
    else:
        b_h1 = tl.zeros([BKH, BV], dtype=tl.float32)
    for c in range(NC):
        if STORE_BND:
            store_state(bnd_base + c * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
        blk = i_h.to(tl.int64) * NCT + gc0 + c
        rows = blk * 64 + o_r
        b_u = tl.load(U + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_d = dot_in(u_minus_ws(b_u, W, rows, o_k1, o_k2, m_k1, m_k2, b_h1, b_h2, W, K, SPLIT, F32, PREC), W, F32)
        tl.store(D + rows[:, None] * V + o_v[None, :], b_d.to(D.dtype.element_ty), mask=m_v[None, :])
        b_k1 = tl.load(Kd + rows[:, None] * K + o_k1[None, :], mask=m_k1[None, :], other=0.0)
        b_l1 = tl.exp(tl.load(glast + blk * K + o_k1, mask=m_k1, other=0.0))
        b_h1 = b_h1 * b_l1[:, None] + tl.dot(tl.trans(dot_in(b_k1, W, F32)), b_d, input_precision=PREC)
        if SPLIT:
            b_k2 = tl.load(Kd + rows[:, None] * K + o_k2[None, :], mask=m_k2[None, :], other=0.0)
            b_l2 = tl.exp(tl.load(glast + blk * K + o_k2, mask=m_k2, other=0.0))
            b_h2 = b_h2 * b_l2[:, None] + tl.dot(tl.trans(dot_in(b_k2, W, F32)), b_d, input_precision=PREC)
    if STORE_BND:
        store_state(bnd_base + NC * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
    if STORE_FINAL:
        store_state(ht + i_nh.to(tl.int64) * K * V, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)


@triton.jit
def _output_kernel(
    Qd,
    D,
    Aqk,
    bnd,
    o,
    T,
    cu,
    cidx,
    coff,
    NCT,
    scale,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program per (value tile, global chunk, value head): o = scale (Qd S_c + Aqk D); the key dimension in
    blocks of BK (a loop: the next block's loads overlap this block's product)."""
    i_v, gc, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, c, bos, Tn = chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
    o_r = tl.arange(0, 64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    rows = (i_h.to(tl.int64) * NCT + gc) * 64 + o_r
    h_base = bnd + ((gc + i_n).to(tl.int64) * HV + i_h) * K * V + o_v[None, :]
    b_o = tl.zeros([64, BV], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(Qd + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_h = tl.load(h_base + o_k[:, None] * V, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(dot_in(b_q, Qd, F32), dot_in(b_h, Qd, F32), input_precision=PREC)
    b_a = tl.load(Aqk + rows[:, None] * 64 + o_r[None, :])
    b_d = tl.load(D + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    b_o += tl.dot(dot_in(b_a, Qd, F32), dot_in(b_d, Qd, F32), input_precision=PREC)
    t = c * 64 + o_r
    p_o = o + (bos + t)[:, None] * (HV * V) + i_h * V + o_v[None, :]
    tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=(t < Tn)[:, None] & m_v[None, :])


PREP_BK = 16  # key-channel block of the intra kernel's products (ptxas sm_90, 4 warps: 80 bytes of spills; 32: 448)
PREP_BKW = 32  # key-channel block of its channel-by-channel own pairs
PREP_WARPS = 1  # warps of the intra kernel (2 and 4 were slower at B = 8, T = 8192, H = 32)
INV_WARPS = 1  # warps of the triangular inverse (`launch_inverse`: 2 for fp32)
WY_BK = 32  # key-column block of the WY kernel, one program each (16 was slower)
WY_BV = 32  # its value tile of U (ptxas sm_90, 4 warps: 128 registers, no spills)
WY_WARPS = 4  # warps of the WY kernel
STATE_WARPS = 4  # warps of the sequential kernel
STATE_STAGES = 3  # at most: `launch_resident` gives fewer where more programs share an SM (one at 8 an SM)
OUT_WARPS = 4  # warps of the output kernel
OUT_BV = 128  # its value tile
OUT_BK = 64  # key block of its loop
OUT_STAGES = 1  # its pipeline stages: pipelined, the delta-rule output kernel's like loop miscompiled


@dataclass(frozen=True)
class KdaConfig:
    """Launch choices; state_bv None picks `triton_chunk.default_config`'s value tile (32, or 64 when sequences
    x value heads fill the GPU at dk <= 128; never 16 on CUDA, see there)."""

    state_bv: int | None = None  # value tile of the sequential kernel


# the largest log decay over 15 tokens that the products take for a sub-block's own pairs, by input dtype: the
# second factor e^bound must stay finite in the dot operand (fp16: 65504 = e^11.1) and its fp32 sums accurate
# (fp32 inputs: 2 x 16 x 6e-8 = 2e-6 relative against the tests' 1e-5; bf16 rounds operands to 4e-3 anyway); a bound
# of 0 sums every own pair channel by channel
OWN_PAIRS_BOUND = {torch.bfloat16: 60.0, torch.float16: 8.0, torch.float32: 16.0}


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> str | None:
    """Why this path would not take these (valid, per-channel-gated) inputs, or None when it does."""
    K, V, n_h = q.shape[-1], v.shape[-1], k.shape[2]
    if n_h != 1:
        return f"n_h={n_h} (the Triton KDA forward takes one Householder step a token)"
    if chunk_size != CHUNK_SIZE:
        return f"chunk_size={chunk_size} (the Triton forward uses {CHUNK_SIZE})"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype} (bf16, fp16 or fp32)"
    if K > MAX_K or V > MAX_V:
        return f"dk={K}, dv={V} (the Triton KDA forward takes dk <= {MAX_K}, dv <= {MAX_V})"
    if not (q.is_cuda or interpreting()):
        return "tensors not on CUDA"
    return None


def triton_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    normalize_qk: bool = False,
    output_final_state: bool = True,
    output_boundary_states: bool = True,
    config: KdaConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Return (o [B,T,Hv,V] in q's dtype, final states [N,Hv,K,V] fp32, boundary states [B,NB,Hv,K,V] fp32).

    Without output_boundary_states the internal boundary states are bf16/fp16 (as the inputs), o unchanged.
    Forward only. q [B,T,Hk,K], k [B,T,1,Hk,K], v [B,T,1,Hv,V], beta [B,T,1,Hv], g [B,T,Hv,K] (log decays <= 0;
    any float dtype, read as fp32); shapes, grouped heads and the packed boundary layout as `kernels.delta_rule.naive`.
    bf16/fp16 inputs run the matrix products in half precision with fp32 accumulation.
    """
    N = check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)[0]
    if g is None or g.dim() != 4:
        raise ValueError("triton_kda needs a per-channel gate g [B,T,Hv,K]; use triton_delta_product for scalar gates")
    why = unsupported_reason(q, k, v, chunk_size)
    if why is not None:
        raise ValueError(f"the Triton KDA forward does not take {why}; use chunk_delta_product")
    B, T, HK, K = q.shape
    HV, V = v.shape[3], v.shape[-1]
    dtype = q.dtype
    k, v = k.to(dtype), v.to(dtype)
    if normalize_qk:  # in fp32, then back to the inputs' precision
        q, k = l2_normalize(q.float()).to(dtype), l2_normalize(k.float()).to(dtype)
    q, k, v, beta, g = (x.contiguous() for x in (q, k, v, beta, g))
    h0 = initial_state.contiguous() if initial_state is not None else None
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    varlen = cu_seqlens is not None
    if varlen:
        cu, cidx, coff, order, NCT = varlen_tables(cu_seqlens, dev)
    else:
        cu = cidx = coff = order = None
        NCT = B * triton.cdiv(T, CHUNK_SIZE)
    interp = interpreting()
    F32 = interp or dtype == torch.float32  # fp32 operands in tl.dot (the interpreter's bf16 dot is wrong)
    PREC = "ieee" if dtype == torch.float32 else "tf32"
    cfg = config or KdaConfig()
    state_bv = cfg.state_bv or default_config(N, HV, V, 1, K).state_bv
    if state_bv < 32 and V > 16 and not interp:
        raise ValueError(f"state_bv={state_bv} miscompiles on CUDA (see triton_chunk.default_config); use 32 or 64")
    BK, BVF = pow2(K), pow2(V)
    BV = min(state_bv, BVF)
    common = dict(HV=HV, K=K, V=V, IS_VARLEN=varlen, F32=F32, PREC=PREC)
    bound = OWN_PAIRS_BOUND[dtype]
    seq_args = (T, cu, cidx, coff, NCT)

    f32 = torch.float32
    rows = NCT * CHUNK_SIZE  # token rows per value head, chunks padded to 64
    W = torch.empty(HV, rows, K, dtype=dtype, device=dev)
    Kd = torch.empty(HV, rows, K, dtype=dtype, device=dev)
    Qd = torch.empty(HV, rows, K, dtype=dtype, device=dev)
    U = torch.empty(HV, rows, V, dtype=dtype, device=dev)
    D = torch.empty(HV, rows, V, dtype=dtype, device=dev)
    Aqk = torch.empty(HV, rows, CHUNK_SIZE, dtype=dtype, device=dev)
    glast = torch.empty(HV, NCT, K, dtype=f32, device=dev)
    # each sequence's chunk starts, then its final state; kept in the inputs' half dtype when nobody asks for them
    # (the output kernel rounds them to it for its product anyway: o is bit-identical, their traffic halves)
    bnd_dtype = f32 if output_boundary_states or F32 else dtype
    bnd = torch.empty(NCT + N, HV, K, V, dtype=bnd_dtype, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=f32, device=dev) if output_final_state else None
    o = torch.empty(B, T, HV, V, dtype=dtype, device=dev)
    BVW = min(pow2(WY_BV), BVF)
    if NCT > 0:  # A (fp32) by the intra kernel, T = (I + A)^-1 in the inputs' type, then W, U, Kd, Qd, Gamma_last
        A = torch.empty(HV, rows, CHUNK_SIZE, dtype=f32, device=dev)
        _intra_chunk_kernel[(NCT, HV)](
            q, k, beta, g, A, Aqk, *seq_args, HK=HK, K=K, HV=HV, BK=BK, BKC=min(pow2(PREP_BK), BK),
            BKW=min(pow2(PREP_BKW), BK), IS_VARLEN=varlen, F32=F32, PREC=PREC, BOUND=bound, num_warps=PREP_WARPS,
        )  # fmt: skip
        Ti = torch.empty(HV, rows, CHUNK_SIZE, dtype=f32 if F32 else dtype, device=dev)
        launch_inverse(A, Ti, HV * NCT, INV_WARPS, PREC)
        del A
        BKW = min(pow2(WY_BK), BK)
        _wy_kernel[(BK // BKW + triton.cdiv(V, BVW), NCT, HV)](
            q, k, v, beta, g, Ti, W, U, Kd, Qd, glast, *seq_args, HK=HK, BK=BK, BKC=BKW, BV=BVW,
            KD_DIFF=dtype != torch.float32, num_warps=WY_WARPS, **common,
        )  # fmt: skip
        del Ti
    BKH = BK // 2 if BK > 128 else BK
    state_consts = dict(
        BKH=BKH, SPLIT=BKH < BK, BV=BV, HAS_H0=h0 is not None, STORE_FINAL=output_final_state, STORE_BND=True,
        **common,
    )  # fmt: skip
    smem = 64 * (2 * BK + BV) * q.element_size()  # one chunk's W, Kd and U tiles per pipeline stage
    launch_resident(_state_kernel, (triton.cdiv(V, BV), N * HV), (W, U, Kd, D, glast, bnd, ht, h0, T, cu, coff, order,
                    NCT), state_consts, smem, stages=STATE_STAGES, warps=STATE_WARPS)
    if NCT > 0:
        obv = min(OUT_BV, BVF)
        _output_kernel[(triton.cdiv(V, obv), NCT, HV)](
            Qd, D, Aqk, bnd, o, *seq_args, scale, BK=min(pow2(OUT_BK), BK), BV=obv, num_warps=OUT_WARPS,
            num_stages=OUT_STAGES,
            **common,
        )  # fmt: skip
    bnd_out = bnd.view(1 if varlen else B, -1, HV, K, V) if output_boundary_states else None
    return o, ht, bnd_out
