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
1. `_prep_kernel` (persistent over chunk x value head): Gamma, A and Aqk, T = (I + A)^-1 by 16 x 16 forward
   substitutions merged by block rows, then W = T diag(b) (e^Gamma * K), U = T diag(b) V, Kd = e^{Gamma_last -
   Gamma} * K, Qd = e^Gamma * q and Gamma_last.
   With `KdaConfig.split_prep` the same work runs as two non-persistent kernels built from the same helpers:
   `_intra_kernel` (one program per 16-token sub-block and value head: its 16 rows of A, fp32 into a temporary
   [Hv, chunks * 64, 64], and of Aqk) and `_wy_kernel` (one program per chunk and value head: T in place in that
   temporary, then W, U, Kd, Qd and Gamma_last).
2. `_state_kernel` (sequential over a sequence's chunks, parallel over sequence x value head x value tile):
   stores S_c, Dlt = U - W S_c, S_{c+1} = e^{Gamma_last} S_c + Kd^T Dlt (dk > 128 as two key halves, as
   `triton_chunk`: a [256, 32] tile miscompiled on an H100).
3. `_output_kernel` (parallel over chunks): o = scale (Qd S_c + Aqk Dlt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltalab.kernels.delta_rule.naive import CHUNK_SIZE, check_inputs, l2_normalize
from deltalab.kernels.delta_rule.triton_chunk import _launch, _varlen_tables, default_config
from deltalab.kernels.delta_rule.triton_prep import (
    _invert_blocks,
    _invert_in_place,
    _store_lower_blocks,
    _store_upper_zeros,
    launch_inverse,
)
from deltalab.kernels.delta_rule.triton_state import _store_state, _u_minus_ws
from deltalab.kernels.triton_utils import _chunk_seq, _dot_in, _interpreting, _num_sms, _pow2

MAX_K, MAX_V = 256, 512  # head dims this path takes (the dispatcher falls back beyond)


@triton.jit
def _chunk_bases(i_h, gc, q, k, g, T, cu, cidx, coff, NCT, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 IS_VARLEN: tl.constexpr):  # fmt: skip
    """(first token of the sequence, its length, the chunk's first token within it, the chunk's key, query and
    gate row-0 pointers, and blk = i_h * NCT + gc, the chunk's block of 64 rows in W/U/Kd/Qd/Aqk/A) of global
    chunk gc of value head i_h."""
    i_n, c, bos, Tn = _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
    i_hk = i_h // (HV // HK)
    k_base = k + bos * (HK * K) + i_hk * K
    q_base = q + bos * (HK * K) + i_hk * K
    g_base = g + (bos * HV + i_h) * K  # token row u at + u * HV * K; padded tokens read 0 (no decay)
    return bos, Tn, c * 64, k_base, q_base, g_base, i_h.to(tl.int64) * NCT + gc


@triton.jit
def _subblock_rows(
    I,
    q_base,
    k_base,
    g_base,
    beta,
    A_blk,
    Aqk_blk,
    bos,
    Tn,
    t0,
    i_h,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BKW: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    BOUND: tl.constexpr,
):
    """Rows r = 16 I .. r + 15 of the chunk's A = diag(b) Akk (strictly lower, fp32) and Aqk (lower, diagonal
    included), stored at A_blk and Aqk_blk (row stride 64). I is a constexpr in the persistent kernel and a
    program id in `_intra_kernel`; the arithmetic is the same.

    Every log-decay difference is summed from the gates it spans (Gamma_i - Gamma_j = g_{j+1} + ... + g_i, by
    cumulative sums of the gates shifted and masked, or running products of e^{g_u}), never taken as a difference
    of two cumulative sums over the chunk: those reach -600 at g = -20 per token, where fp32 spacing (6e-5) is the
    relative error of a decay near 1. Earlier sub-blocks factor through token r (both factors <= 1). The
    sub-block's own pairs factor through r as well, e^{Gamma_i - Gamma_r} e^{-(Gamma_j - Gamma_r)}, when every
    channel's decay over the sub-block stays above e^-BOUND (the second factor <= e^BOUND, finite in the dot's
    operand type; the two sums of at most 15 gates carry ~BOUND * 1e-7 relative): then one product covers all 64
    columns. Otherwise (or BOUND = 0) those 16 x 16 pairs are summed channel by channel, their decays built as
    running products of the per-token factors e^{g_u}. [*, dk] work runs in key-column blocks of BKC (the
    products) and BKW (the channel-by-channel pairs; BK in the persistent kernel), in loops that are not
    unrolled (kernels/NOTES.md)."""
    o_r = tl.arange(0, 64)
    o_i = tl.arange(0, 16)
    t = t0 + o_r
    m_t = t < Tn
    r = 16 * I
    ri = r + o_i
    m_ri = (t0 + ri) < Tn
    b_bI = tl.load(beta + (bos + t0 + ri) * HV + i_h, mask=m_ri, other=0.0).to(tl.float32)
    n_own = 0  # 16 when the sub-block's own columns factor through r
    if BOUND > 0:  # the smallest decay over the sub-block, per channel g_{r+1} + ... + g_{r+15}
        b_low = tl.zeros([BKC], dtype=tl.float32)
        for cb in range(BK // BKC):
            o_c = cb * BKC + tl.arange(0, BKC)
            m_g = (m_ri & (o_i > 0))[:, None] & (o_c < K)[None, :]
            b_g = tl.load(g_base + (t0 + ri)[:, None] * (HV * K) + o_c[None, :], mask=m_g, other=0.0)
            b_low = tl.minimum(b_low, tl.sum(b_g.to(tl.float32), 0))
        n_own = tl.where(tl.min(b_low, 0) >= -BOUND, 16, 0)
    m_j = o_r < r  # earlier sub-blocks
    m_w = (o_r >= r) & (o_r < r + n_own)  # this one's columns, when they factor through r
    b_Akk = tl.zeros([16, 64], dtype=tl.float32)
    b_Aqk = tl.zeros([16, 64], dtype=tl.float32)
    for cb in range(BK // BKC):
        o_c = cb * BKC + tl.arange(0, BKC)
        m_c = (o_c < K)[None, :]
        p_I = (t0 + ri)[:, None] * (HK * K) + o_c[None, :]
        b_gIc = tl.load(
            g_base + (t0 + ri)[:, None] * (HV * K) + o_c[None, :], mask=m_ri[:, None] & m_c, other=0.0
        ).to(tl.float32)
        b_eI = tl.exp(tl.cumsum(tl.where(o_i[:, None] > 0, b_gIc, 0.0), 0))  # g_{r+1} + ... + g_i
        b_kIc = tl.load(k_base + p_I, mask=m_ri[:, None] & m_c, other=0.0).to(tl.float32) * b_eI
        b_qIc = tl.load(q_base + p_I, mask=m_ri[:, None] & m_c, other=0.0).to(tl.float32) * b_eI
        # column j's exponent: g_{j+1} + ... + g_r for j < r (the gates shifted up a row, summed from the bottom),
        # -(g_{r+1} + ... + g_j) for j in the sub-block (the shifted gates summed from r, exclusive), else -inf
        p_s = g_base + (t + 1)[:, None] * (HV * K) + o_c[None, :]
        b_gs = tl.load(p_s, mask=((m_j | m_w) & (t + 1 < Tn))[:, None] & m_c, other=0.0).to(tl.float32)
        b_gw = tl.where(m_w[:, None], b_gs, 0.0)
        b_x = tl.where(
            m_j[:, None],
            tl.cumsum(tl.where(m_j[:, None], b_gs, 0.0), 0, reverse=True),
            tl.where(m_w[:, None], b_gw - tl.cumsum(b_gw, 0), float("-inf")),
        )
        p_c = k_base + t[:, None] * (HK * K) + o_c[None, :]
        b_kc = tl.load(p_c, mask=((m_j | m_w) & m_t)[:, None] & m_c, other=0.0).to(tl.float32)
        b_kc = _dot_in(b_kc * tl.exp(b_x), k_base, F32)
        b_Akk += tl.dot(_dot_in(b_kIc, k_base, F32), tl.trans(b_kc), input_precision=PREC)
        b_Aqk += tl.dot(_dot_in(b_qIc, k_base, F32), tl.trans(b_kc), input_precision=PREC)
    # the sub-block's own columns only below (Akk) or on and below (Aqk) the diagonal; zeros right of it
    m_own = (o_r[None, :] >= r) & (o_r[None, :] < r + 16)
    b_Akk = tl.where((o_r[None, :] < r) | (m_own & (o_r[None, :] < ri[:, None])), b_Akk, 0.0)
    b_Aqk = tl.where((o_r[None, :] < r) | (m_own & (o_r[None, :] <= ri[:, None])), b_Aqk, 0.0)
    # without the product for its own columns: all but those now (their [16, 64] tiles are then dead during the
    # loop below, which keeps [16, 16] ones; disjoint masks, no two stores to one element)
    m_out = (o_r[None, :] < r) | (o_r[None, :] >= r + 16 - n_own)
    tl.store(A_blk + ri[:, None] * 64 + o_r[None, :], b_Akk * b_bI[:, None], mask=m_out)
    tl.store(Aqk_blk + ri[:, None] * 64 + o_r[None, :], b_Aqk.to(Aqk_blk.dtype.element_ty), mask=m_out)
    if n_own == 0:
        b_Ad, b_Qd = _own_pairs_by_channel(r, q_base, k_base, g_base, t0, Tn, HK, HV, K, BK, BKW)
        tl.store(A_blk + ri[:, None] * 64 + ri[None, :], b_Ad * b_bI[:, None])
        tl.store(Aqk_blk + ri[:, None] * 64 + ri[None, :], b_Qd.to(Aqk_blk.dtype.element_ty))


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
    b_z = _dot_in(b_k * tl.exp(tl.minimum(-b_rc, BOUND)), k_base, F32)
    if I < 3:  # g_{j+1}: the gates shifted up a row (row 15 is the next sub-block's first token)
        m_s = ((t + 1) < Tn)[:, None] & m_c
        b_gs = tl.load(g_base + (t + 1)[:, None] * (HV * K) + o_c[None, :], mask=m_s, other=0.0).to(tl.float32)
        b_y = b_k * tl.exp(tl.cumsum(b_gs, 0, reverse=True))
        tot = tl.sum(b_gs, 0)
    else:
        b_y = b_k
        tot = tl.sum(b_g, 0)
    return _dot_in(b_k * b_r, k_base, F32), _dot_in(b_q * b_r, k_base, F32), b_z, b_y, tot, low


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
    INVERT: tl.constexpr,
):
    """Split prep, first kernel, one program per (global chunk, value head): the chunk's Aqk and A = diag(b) Akk
    as 4 x 4 blocks of 16 x 16 tokens, and with INVERT T = (I + A)^-1 from those blocks in registers (diagonal ones
    by forward substitution, the rest by block rows), stored fp32 in the temporary A instead of A. Block
    (I, J < I) factors through the sub-block boundaries r_I and r_{J+1}:
    e^{G_i - G_j} = e^{G_i - G_{r_I}} e^{G_{r_I} - G_{r_{J+1}}} e^{G_{r_{J+1}} - G_j},
    every factor <= 1 and summed from the gates it spans (`_sub_tiles`); the own blocks (I, I) factor through r_I
    when the sub-block's decays allow (as `_subblock_rows`), else go channel by channel. Each key-channel block
    loads a sub-block's q, k and g once (the per-sub-block kernel re-read the earlier rows for each later one)."""
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
        y0c = _dot_in(y0b * e2, k_base, F32)  # ... from r_3
        y1b = _dot_in(y1 * e2, k_base, F32)  # sub-block 1 from r_3
        y0b = _dot_in(y0b, k_base, F32)
        y0 = _dot_in(y0, k_base, F32)
        y1 = _dot_in(y1, k_base, F32)
        y2 = _dot_in(y2, k_base, F32)
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
    _store_lower_blocks(Aqk_blk, q00, q11, q22, q33, q10, q21, q32, q20, q31, q30)
    _store_upper_zeros(Aqk_blk)
    # diag(b) Akk, block row by block row
    a00, a11, a22, a33 = a00 * b0[:, None], a11 * b1[:, None], a22 * b2[:, None], a33 * b3[:, None]
    a10, a20, a30 = a10 * b1[:, None], a20 * b2[:, None], a30 * b3[:, None]
    a21, a31, a32 = a21 * b2[:, None], a31 * b3[:, None], a32 * b3[:, None]
    if INVERT:  # T = (I + A)^-1 from the blocks (`_invert_blocks`)
        a00, a11, a22, a33, a10, a21, a32, a20, a31, a30 = _invert_blocks(a00, a11, a22, a33, a10, a21, a32, a20, a31,
                                                                            a30, PREC)  # fmt: skip
    _store_lower_blocks(A_blk, a00, a11, a22, a33, a10, a21, a32, a20, a31, a30)
    _store_upper_zeros(A_blk)


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
    b_X = _dot_in(b_k * b_eG * b_b[:, None], k_base, F32)  # last, so that G, k and q are dead during the product
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
    b_U = tl.dot(b_Ti, _dot_in(b_v.to(tl.float32) * b_b[:, None], k_base, F32), input_precision=PREC)
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
    ONE: tl.constexpr,
    part,
):
    """Given T (b_Ti, in dot operand precision), the chunk's W, U, Kd, Qd and Gamma_last (stored at block blk):
    every key block and value tile in turn, or with ONE only block `part` (key blocks, then value tiles)."""
    o_r = tl.arange(0, 64)
    t = t0 + o_r
    m_t = t < Tn
    rows = blk * 64 + o_r
    b_b = tl.load(beta + (bos + t) * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    v_base = v + bos * (HV * V) + i_h * V
    NKB: tl.constexpr = BK // BKC
    if not ONE:
        for cb in range(NKB):
            _wy_key_block(cb, b_Ti, b_b, q_base, k_base, g_base, W, Kd, Qd, glast, t, m_t, Tn, rows, blk,
                          HK, HV, K, BKC, F32, PREC, KD_DIFF)  # fmt: skip
        for iv in range((V + BV - 1) // BV):  # a loop, not unrolled
            _wy_value_tile(iv, b_Ti, b_b, v_base, U, t, m_t, rows, k_base, HV, V, BV, F32, PREC)
    elif part < NKB:
        _wy_key_block(part, b_Ti, b_b, q_base, k_base, g_base, W, Kd, Qd, glast, t, m_t, Tn, rows, blk,
                      HK, HV, K, BKC, F32, PREC, KD_DIFF)  # fmt: skip
    else:
        _wy_value_tile(part - NKB, b_Ti, b_b, v_base, U, t, m_t, rows, k_base, HV, V, BV, F32, PREC)


@triton.jit
def _prep_kernel(
    q,
    k,
    v,
    beta,
    g,
    W,
    U,
    Kd,
    Qd,
    Aqk,
    glast,
    scratch,
    T,
    cu,
    cidx,
    coff,
    NCT,
    n_jobs,
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
    BOUND: tl.constexpr,
):
    """Persistent over jobs (value head, global chunk): the chunk's intra-chunk factors (module docstring):
    A and Aqk by 16-token sub-blocks (`_subblock_rows`), T = (I + A)^-1 (`_invert_in_place`), then W, U, Kd, Qd
    and Gamma_last (`_wy_rows`). Per program an fp32 scratch holds A [64, 64] (rows read back by the forward
    substitution); reused job after job, so it stays in L2. Whole [64, 128] tiles spilled 2.3 KB per thread
    (ptxas for sm_90 with Triton 3.9, 4 warps), hence the key-column blocks (kernels/NOTES.md)."""
    S = scratch + tl.program_id(0).to(tl.int64) * (64 * 64)
    for job in range(tl.program_id(0), n_jobs, tl.num_programs(0)):
        i_h, gc = job // NCT, job % NCT
        bos, Tn, t0, k_base, q_base, g_base, blk = _chunk_bases(i_h, gc, q, k, g, T, cu, cidx, coff, NCT, HK, HV, K,
                                                                IS_VARLEN)  # fmt: skip
        tl.debug_barrier()  # the previous job may still read the scratch
        for I in tl.static_range(4):  # 16-token sub-blocks: rows 16 I .. 16 I + 15
            _subblock_rows(I, q_base, k_base, g_base, beta, S, Aqk + blk * (64 * 64), bos, Tn, t0, i_h,
                           HK, HV, K, BK, BKC, BK, F32, PREC, BOUND)  # fmt: skip
        tl.debug_barrier()
        b_Ti = _dot_in(_invert_in_place(S, PREC), k, F32)
        _wy_rows(b_Ti, q_base, k_base, g_base, v, beta, W, U, Kd, Qd, glast, bos, Tn, t0, i_h, blk,
                 HK, HV, K, V, BK, BKC, BV, F32, PREC, False, False, 0)  # fmt: skip


@triton.jit
def _intra_kernel(
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
    """Split prep, first kernel: one program per (16-token sub-block I of global chunk gc, value head), program
    ids (4 gc + I, i_h): rows 16 I .. 16 I + 15 of the chunk's A (fp32, into the temporary A) and Aqk."""
    pid, i_h = tl.program_id(0), tl.program_id(1)
    I, gc = pid % 4, pid // 4
    bos, Tn, t0, k_base, q_base, g_base, blk = _chunk_bases(i_h, gc, q, k, g, T, cu, cidx, coff, NCT, HK, HV, K,
                                                            IS_VARLEN)  # fmt: skip
    _subblock_rows(I, q_base, k_base, g_base, beta, A + blk * (64 * 64), Aqk + blk * (64 * 64), bos, Tn, t0, i_h,
                   HK, HV, K, BK, BKC, BKW, F32, PREC, BOUND)  # fmt: skip


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
    INVERTED: tl.constexpr,
    KD_DIFF: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Split prep, second kernel: one program per (global chunk, value head): T = (I + A)^-1 in place in the
    chunk's block of A (written by an intra kernel; INVERTED: T itself, from `_tri_inverse_kernel` or the inverting
    `_intra_chunk_kernel`), then W, U,
    Kd, Qd and Gamma_last. BLOCKS (needs INVERTED): one program per (key block or value tile, chunk, value head),
    each loading T, for more loads in flight than one program's sequence of blocks."""
    if BLOCKS:
        part, gc, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        part, gc, i_h = 0, tl.program_id(0), tl.program_id(1)
    bos, Tn, t0, k_base, q_base, g_base, blk = _chunk_bases(i_h, gc, q, k, g, T, cu, cidx, coff, NCT, HK, HV, K,
                                                            IS_VARLEN)  # fmt: skip
    if INVERTED:
        o_r = tl.arange(0, 64)
        b_Ti = _dot_in(tl.load(A + blk * (64 * 64) + o_r[:, None] * 64 + o_r[None, :]), k, F32)
    else:
        b_Ti = _dot_in(_invert_in_place(A + blk * (64 * 64), PREC), k, F32)
    _wy_rows(b_Ti, q_base, k_base, g_base, v, beta, W, U, Kd, Qd, glast, bos, Tn, t0, i_h, blk,
             HK, HV, K, V, BK, BKC, BV, F32, PREC, KD_DIFF, BLOCKS, part)  # fmt: skip


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
            _store_state(bnd_base + c * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
        blk = i_h.to(tl.int64) * NCT + gc0 + c
        rows = blk * 64 + o_r
        b_u = tl.load(U + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_d = _dot_in(_u_minus_ws(b_u, W, rows, o_k1, o_k2, m_k1, m_k2, b_h1, b_h2, W, K, SPLIT, F32, PREC), W, F32)
        tl.store(D + rows[:, None] * V + o_v[None, :], b_d.to(D.dtype.element_ty), mask=m_v[None, :])
        b_k1 = tl.load(Kd + rows[:, None] * K + o_k1[None, :], mask=m_k1[None, :], other=0.0)
        b_l1 = tl.exp(tl.load(glast + blk * K + o_k1, mask=m_k1, other=0.0))
        b_h1 = b_h1 * b_l1[:, None] + tl.dot(tl.trans(_dot_in(b_k1, W, F32)), b_d, input_precision=PREC)
        if SPLIT:
            b_k2 = tl.load(Kd + rows[:, None] * K + o_k2[None, :], mask=m_k2[None, :], other=0.0)
            b_l2 = tl.exp(tl.load(glast + blk * K + o_k2, mask=m_k2, other=0.0))
            b_h2 = b_h2 * b_l2[:, None] + tl.dot(tl.trans(_dot_in(b_k2, W, F32)), b_d, input_precision=PREC)
    if STORE_BND:
        _store_state(bnd_base + NC * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
    if STORE_FINAL:
        _store_state(ht + i_nh.to(tl.int64) * K * V, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)


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
    i_n, c, bos, Tn = _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
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
        b_o += tl.dot(_dot_in(b_q, Qd, F32), _dot_in(b_h, Qd, F32), input_precision=PREC)
    b_a = tl.load(Aqk + rows[:, None] * 64 + o_r[None, :])
    b_d = tl.load(D + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    b_o += tl.dot(_dot_in(b_a, Qd, F32), _dot_in(b_d, Qd, F32), input_precision=PREC)
    t = c * 64 + o_r
    p_o = o + (bos + t)[:, None] * (HV * V) + i_h * V + o_v[None, :]
    tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=(t < Tn)[:, None] & m_v[None, :])


@dataclass(frozen=True)
class KdaConfig:
    """Launch choices; state_bv None picks `triton_chunk.default_config`'s value tile (32, or 64 when sequences
    x value heads fill the GPU at dk <= 128; never 16 on CUDA, see there). Not tuned on a GPU yet."""

    state_bv: int | None = None  # value tile of the sequential kernel
    prep_warps: int = 4  # 255 registers and some spills (8 warps: fewer), but two programs fit an SM
    prep_bv: int = 64  # value tile of U = T diag(b) V
    prep_bk: int = 16  # key-column block of the prep kernel's [64, dk] work (32: 256 bytes of spills)
    prep_programs_per_sm: int = 2  # H100, B=8 T=8192 H=32: 4 warps x 2 programs 20.1 ms, 8 warps x 1 29.4 ms
    split_prep: bool = True  # the prep as `_intra_kernel` + `_wy_kernel`; H200: 16.5 vs 22.2 ms persistent (B=8 T=8192
    # H=32), 0.68 vs 0.71 ms (B=1 T=2048 H=16), first call 3.3 vs 9.4 s (scripts/kda_split_check.py)
    intra_warps: int = 4  # split prep: warps of `_intra_kernel` (one 16-token sub-block a program)
    intra_bk: int = 32  # split prep: key-channel block of the within-sub-block pairs (the persistent kernel: dk)
    intra_maxnreg: int | None = 128  # split prep: register cap of `_intra_kernel` (ptxas sm_90: 127, no spills)
    intra_bkc: int = 16  # split prep: key-channel block of the cross-sub-block products
    intra_per_chunk: bool = True  # split prep: `_intra_chunk_kernel` (a chunk a program) for `_intra_kernel`
    intra_inverts: bool = True  # the per-chunk kernel also inverts (I + A) in registers (the WY kernel then does not)
    intra_chunk_bk: int = 16  # its key-channel block (ptxas sm_90, 4 warps: 80 bytes of spills; 32: 448)
    intra_chunk_warps: int = 1  # H200, B=8 T=8192 H=32, inverting (kda_split_check): 1 warp 8.46 ms, 2 10.49, 4 13.68
    inverse_kernel: bool = True  # split prep: T = (I + A)^-1 by triton_prep's `_tri_inverse_kernel` (a block a
    # program) between the intra kernel (then not inverting) and the WY kernel. H100, B=8 T=8192 H=32: 8.10 ms against
    # 8.55 inverting in the intra kernel (intra 3.24 + inverse 0.23 against 3.73; scripts/kda_split_check.py)
    inverse_warps: int = 1
    wy_warps: int = 4  # split prep: warps of `_wy_kernel` (one chunk a program; prep_bv as the prep's)
    wy_bk: int = 32  # split prep: its key-column block (H100, B=8 T=8192 H=32, a program a block: 16 2.20 ms, 32 1.91)
    wy_bv: int = 32  # its value tile of U (ptxas sm_90, a program a block, 4 warps, 32/32: 128 registers, no spills)
    wy_kd_by_difference: bool = True  # Kd's factors e^{Gamma_last - Gamma_j} from the cumulative sums (half dtypes)
    # instead of a second gate load and a reverse scan
    wy_blocks: bool = True  # one WY program per (key block or value tile, chunk, head) when T comes inverted:
    # H100, B=8 T=8192 H=32: the WY kernel 2.90 -> 1.91 ms (scripts/kda_split_check.py; with Kd by difference)
    state_warps: int = 4
    state_stages: int = 3  # at most: `_launch` gives fewer where more programs share an SM (one stage at 8 an SM).
    # H100, B=1 T=8192 H=32 (128 programs, one an SM): the state kernel 0.29 -> 0.23 ms at 3 stages against 2
    # (scripts/kda_split_check.py); o, final and boundary states bit-identical to one stage (GPU test)
    out_warps: int = 4
    out_bv: int = 128
    out_bk: int = 64  # key block of the output kernel's loop
    out_stages: int = 1  # its pipeline stages: pipelined, the delta-rule forward's like loop miscompiled (LaunchConfig)
    own_pairs_bound: float | None = None  # a sub-block's own pairs by the products when every channel decays less
    # than e^-bound over it (`_subblock_rows`); None: OWN_PAIRS_BOUND by dtype; 0: always channel by channel


# the largest log decay over 15 tokens that the products take for a sub-block's own pairs, by input dtype: the
# second factor e^bound must stay finite in the dot operand (fp16: 65504 = e^11.1) and its fp32 sums accurate
# (fp32 inputs: 2 x 16 x 6e-8 = 2e-6 relative against the tests' 1e-5; bf16 rounds operands to 4e-3 anyway)
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
    if not (q.is_cuda or _interpreting()):
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
        cu, cidx, coff, order, NCT = _varlen_tables(cu_seqlens, dev)
    else:
        cu = cidx = coff = order = None
        NCT = B * triton.cdiv(T, CHUNK_SIZE)
    interp = _interpreting()
    F32 = interp or dtype == torch.float32  # fp32 operands in tl.dot (the interpreter's bf16 dot is wrong)
    PREC = "ieee" if dtype == torch.float32 else "tf32"
    cfg = config or KdaConfig()
    state_bv = cfg.state_bv or default_config(N, HV, V, 1, K).state_bv
    if state_bv < 32 and V > 16 and not interp:
        raise ValueError(f"state_bv={state_bv} miscompiles on CUDA (see triton_chunk.default_config); use 32 or 64")
    BK, BVF = _pow2(K), _pow2(V)
    BV = min(state_bv, BVF)
    common = dict(HV=HV, K=K, V=V, IS_VARLEN=varlen, F32=F32, PREC=PREC)
    bound = OWN_PAIRS_BOUND[dtype] if cfg.own_pairs_bound is None else float(cfg.own_pairs_bound)
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
    BKC, BVP = min(_pow2(cfg.prep_bk), BK), min(cfg.prep_bv, BVF)
    BVW = min(_pow2(cfg.wy_bv), BVF)
    if NCT > 0 and cfg.split_prep:
        in_intra = cfg.intra_per_chunk and cfg.intra_inverts and not cfg.inverse_kernel  # T from the intra kernel
        inverted = in_intra or cfg.inverse_kernel  # T given to the WY kernel, in the dot operand type
        A = torch.empty(HV, rows, CHUNK_SIZE, dtype=dtype if in_intra and not F32 else f32, device=dev)
        if cfg.intra_per_chunk:
            _intra_chunk_kernel[(NCT, HV)](
                q, k, beta, g, A, Aqk, *seq_args, HK=HK, K=K, HV=HV, BK=BK, BKC=min(_pow2(cfg.intra_chunk_bk), BK),
                BKW=min(_pow2(cfg.intra_bk), BK), IS_VARLEN=varlen, F32=F32, PREC=PREC, BOUND=bound,
                INVERT=in_intra, num_warps=cfg.intra_chunk_warps,
            )  # fmt: skip
        else:
            _intra_kernel[(4 * NCT, HV)](
                q, k, beta, g, A, Aqk, *seq_args, HK=HK, K=K, HV=HV, BK=BK, BKC=min(_pow2(cfg.intra_bkc), BK),
                BKW=min(_pow2(cfg.intra_bk), BK), IS_VARLEN=varlen, F32=F32, PREC=PREC, BOUND=bound,
                num_warps=cfg.intra_warps,
                **({} if cfg.intra_maxnreg is None or interp else dict(maxnreg=cfg.intra_maxnreg)),
            )  # fmt: skip
        if cfg.inverse_kernel:  # A (fp32) -> T in the inputs' type, a block a program (triton_prep's)
            Ti = torch.empty(HV, rows, CHUNK_SIZE, dtype=f32 if F32 else dtype, device=dev)
            launch_inverse(A, Ti, HV * NCT, cfg.inverse_warps, PREC, upper_zeros=True)
            A = Ti
        BKW = min(_pow2(cfg.wy_bk), BK)
        blocks = cfg.wy_blocks and inverted
        grid = (BK // BKW + triton.cdiv(V, BVW), NCT, HV) if blocks else (NCT, HV)
        _wy_kernel[grid](
            q, k, v, beta, g, A, W, U, Kd, Qd, glast, *seq_args, HK=HK, BK=BK, BKC=BKW, BV=BVW,
            INVERTED=inverted, KD_DIFF=cfg.wy_kd_by_difference and dtype != torch.float32, BLOCKS=blocks,
            num_warps=cfg.wy_warps, **common,
        )  # fmt: skip
        del A
    elif NCT > 0:
        n_jobs = HV * NCT
        n_prog = min(n_jobs, 3 if interp else _num_sms() * cfg.prep_programs_per_sm)
        scratch = torch.empty(n_prog, 64 * 64, dtype=f32, device=dev)
        _prep_kernel[(n_prog,)](
            q, k, v, beta, g, W, U, Kd, Qd, Aqk, glast, scratch, *seq_args, n_jobs,
            HK=HK, BK=BK, BKC=BKC, BV=BVP, BOUND=bound, num_warps=cfg.prep_warps,
            **common,
        )  # fmt: skip
    BKH = BK // 2 if BK > 128 else BK
    state_consts = dict(
        BKH=BKH, SPLIT=BKH < BK, BV=BV, HAS_H0=h0 is not None, STORE_FINAL=output_final_state, STORE_BND=True,
        **common,
    )  # fmt: skip
    smem = 64 * (2 * BK + BV) * q.element_size()  # one chunk's W, Kd and U tiles per pipeline stage
    _launch(
        _state_kernel,
        (triton.cdiv(V, BV), N * HV),
        cfg,
        (W, U, Kd, D, glast, bnd, ht, h0, T, cu, coff, order, NCT),
        state_consts,
        smem,
    )
    if NCT > 0:
        obv = min(cfg.out_bv, BVF)
        _output_kernel[(triton.cdiv(V, obv), NCT, HV)](
            Qd, D, Aqk, bnd, o, *seq_args, scale, BK=min(_pow2(cfg.out_bk), BK), BV=obv, num_warps=cfg.out_warps,
            num_stages=cfg.out_stages,
            **common,
        )  # fmt: skip
    bnd_out = bnd.view(1 if varlen else B, -1, HV, K, V) if output_boundary_states else None
    return o, ht, bnd_out
