"""The delta-rule forward's parallel prep kernels (`triton_chunk`): per 64-sub-step block A = strictly lower
beta e^{Gamma_i - Gamma_j} k_i.k_j and q K^T once a chunk (`kkt_kernel`), T = (I + A)^-1 (`_tri_inverse_kernel`,
launched by `launch_inverse`), and the WY factors W = T X, U = T Y (`wu_kernel`). `launch_inverse` and the block
stores (`store_lower_blocks`, `store_upper_zeros`) serve the KDA forward too."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.kernels.triton_utils import chunk_seq, dot_in, load_t


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _merge_blocks(t00, t11, t22, t33, a10, a21, a32, a20, a31, a30, PREC: tl.constexpr):
    """The off-diagonal 16 x 16 blocks of T = (I + A)^-1 from its diagonal ones T_II and A's blocks below the
    diagonal: T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ (block forward substitution); returns all ten of T."""
    t10 = -_mm(t11, _mm(a10, t00, PREC), PREC)
    t21 = -_mm(t22, _mm(a21, t11, PREC), PREC)
    t32 = -_mm(t33, _mm(a32, t22, PREC), PREC)
    t20 = -_mm(t22, _mm(a20, t00, PREC) + _mm(a21, t10, PREC), PREC)
    t31 = -_mm(t33, _mm(a31, t11, PREC) + _mm(a32, t21, PREC), PREC)
    t30 = -_mm(t33, _mm(a30, t00, PREC) + _mm(a31, t10, PREC) + _mm(a32, t20, PREC), PREC)
    return t00, t11, t22, t33, t10, t21, t32, t20, t31, t30


@triton.jit
def _store_block(ptr, I: tl.constexpr, J: tl.constexpr, b_x):
    """Block (I, J) of 16 x 16 of a [64, 64] matrix at ptr (row stride 64)."""
    o_i = tl.arange(0, 16)
    tl.store(ptr + (16 * I + o_i)[:, None] * 64 + 16 * J + o_i[None, :], b_x.to(ptr.dtype.element_ty))


@triton.jit
def store_upper_zeros(ptr):
    """Zeros in the six 16 x 16 blocks above the block diagonal of a [64, 64] matrix at ptr (for readers of whole
    rows)."""
    z = tl.zeros([16, 16], dtype=tl.float32)
    _store_block(ptr, 0, 1, z)
    _store_block(ptr, 0, 2, z)
    _store_block(ptr, 0, 3, z)
    _store_block(ptr, 1, 2, z)
    _store_block(ptr, 1, 3, z)
    _store_block(ptr, 2, 3, z)


@triton.jit
def store_lower_blocks(ptr, b00, b11, b22, b33, b10, b21, b32, b20, b31, b30):
    """The ten 16 x 16 blocks on and below the block diagonal of a [64, 64] matrix at ptr (row stride 64)."""
    _store_block(ptr, 0, 0, b00)
    _store_block(ptr, 1, 1, b11)
    _store_block(ptr, 2, 2, b22)
    _store_block(ptr, 3, 3, b33)
    _store_block(ptr, 1, 0, b10)
    _store_block(ptr, 2, 1, b21)
    _store_block(ptr, 3, 2, b32)
    _store_block(ptr, 2, 0, b20)
    _store_block(ptr, 3, 1, b31)
    _store_block(ptr, 3, 0, b30)


@triton.jit
def _gates_before(b_gt, o_r, a, NH: tl.constexpr):
    """Sum of the chunk's log gates b_gt (a token a row, 0 past the sequence) before WY block a (tokens whose first
    sub-step comes before the block)."""
    return tl.sum(tl.where(o_r * NH < a * 64, b_gt, 0.0), 0)


@triton.jit
def kkt_kernel(
    q,
    k,
    beta,
    g,
    A,
    Aqk,
    Aqp,
    rstd,
    gcum,
    wsc,
    T,
    cu,
    cidx,
    coff,
    NCT,
    HK: tl.constexpr,
    HV: tl.constexpr,
    NH: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    USE_G: tl.constexpr,
    NORM: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    STORE_AQK: tl.constexpr,
    STORE_SCALES: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    KG: tl.constexpr = 1,
):
    """T, step 1: one program per (64-sub-step block, value head), value heads
    adjacent so that a group's programs share its key block in L2. A_ij = beta_i e^{Gamma_i - Gamma_j} r_i r_j
    k_i.k_j (j < i) by [64, BKC] x [BKC, 64] products over key blocks, stored fp32 (only the ten 16 x 16 blocks
    on and below the diagonal: the inverse reads no others); also the reciprocal key norms r. STORE_AQK: also the
    block's share of the chunk's intra-chunk attention, (q K_a^T * e^{Gamma_q - Gamma_s} * mask) / (|q| |k|), with the
    same key blocks (`output_kernel` reads it). STORE_SCALES: also Gamma from the chunk start and the row scales
    c = beta e^{Gamma - Gamma_a} / |k|, all the keys path with U from v needs of `wu_kernel` (not launched then).
    PAIR (with STORE_AQK, n_h = 1): for an odd chunk of a sequence also its queries against the previous chunk's keys,
    (q K'^T * e^{Gamma_q + Gamma_end' - Gamma'}) / (|q| |k'|) (primes: chunk c-1), to Aqp: the output kernel's share of
    chunk c-1 when it reads S_{c-1} instead of S_c (`LaunchConfig.out_pair`). KG > 1 (grouped heads, Hv / Hk a power
    of two): one program serves KG value heads of one key head, forming K K^T, q K^T (and q K'^T) once for them."""
    job = tl.program_id(0)
    i_g, gb = job % (HV // KG), job // (HV // KG)
    gc, a = gb // NH, gb % NH
    i_n, c, bos, Tn = chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
    i_h = i_g * KG  # (the first of the program's value heads)
    i_hk = i_h // (HV // HK)
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    s = c * L + a * 64 + o_r  # sub-step index in the sequence
    m_s = s < Tn * NH
    p_k = k + (bos * NH + s)[:, None] * (HK * K) + i_hk * K
    t = c * 64 + o_r  # the chunk's tokens (queries)
    m_t = t < Tn
    p_q = q + (bos + t)[:, None] * (HK * K) + i_hk * K
    b_kk = tl.zeros([64, 64], dtype=tl.float32)
    b_qk = tl.zeros([64, 64], dtype=tl.float32)
    b_qq = tl.zeros([64], dtype=tl.float32)
    odd = (o_r * 0 + c % 2) == 1  # [64]: this chunk is odd (a pair's second)
    b_qp = tl.zeros([64, 64], dtype=tl.float32)  # PAIR: q K'^T
    b_pp = tl.zeros([64], dtype=tl.float32)  # PAIR: |k'|^2
    # the epilogue's beta and gates ([64, KG]: the program's value heads, adjacent in memory), loaded before the key
    # loop so that their latency overlaps its products; the block's gates (at sub-steps), the chunk's (at tokens) and,
    # for pairs, the previous chunk's (odd chunks only)
    o_g = tl.arange(0, KG)
    b_beta = _head_rows(beta, (bos * NH + s) * HV + i_h, o_g, m_s)
    b_g, b_gt, b_gp = b_beta, b_beta, b_beta  # (unused without gates)
    if USE_G:
        b_g = _head_rows(g, (bos + s // NH) * HV + i_h, o_g, m_s & (s % NH == 0))
        b_gt = _head_rows(g, (bos + t) * HV + i_h, o_g, m_t)
        if PAIR:
            b_gp = _head_rows(g, (bos + t - 64) * HV + i_h, o_g, odd)
    for kb in range(0, BK, BKC):
        o_k = kb + tl.arange(0, BKC)
        b_k = tl.load(p_k + o_k[None, :], mask=m_s[:, None] & (o_k < K)[None, :], other=0.0)
        b_kd = dot_in(b_k, k, F32)
        b_kk += tl.dot(b_kd, tl.trans(b_kd), input_precision=PREC)
        if STORE_AQK:
            b_q = tl.load(p_q + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
            if NORM:
                b_qf = b_q.to(tl.float32)
                b_qq += tl.sum(b_qf * b_qf, 1)
            b_qk += tl.dot(dot_in(b_q, k, F32), tl.trans(b_kd), input_precision=PREC)
            if PAIR:  # the previous chunk's keys (no memory access for an even chunk)
                b_kp = tl.load(p_k - 64 * (HK * K) + o_k[None, :], mask=odd[:, None] & (o_k < K)[None, :], other=0.0)
                b_kpf = b_kp.to(tl.float32)
                b_pp += tl.sum(b_kpf * b_kpf, 1)
                b_qp += tl.dot(dot_in(b_q, k, F32), tl.trans(dot_in(b_kp, k, F32)), input_precision=PREC)
    if NORM:  # |k_i|^2 is K K^T's diagonal (exact bf16 products, fp32 sums): no second pass over the keys
        b_rs = 1.0 / tl.sqrt(tl.sum(tl.where(o_r[:, None] == o_r[None, :], b_kk, 0.0), 1) + 1e-6)
        b_rq = 1.0 / tl.sqrt(b_qq + 1e-6)
        b_rp = 1.0 / tl.sqrt(b_pp + 1e-6)
    else:
        b_rs = tl.full([64], 1.0, dtype=tl.float32)
        b_rq, b_rp = b_rs, b_rs
    norms = (b_kk, b_rs, b_qk, b_rq, b_qp, b_rp)
    dests = (A, Aqk, Aqp, rstd, gcum, wsc, NCT, gc, a, o_r, odd)
    for j in tl.static_range(KG):
        _kkt_head(*dests, i_h + j, *norms, _head(b_beta, o_g, j), _head(b_g, o_g, j), _head(b_gt, o_g, j),
                  _head(b_gp, o_g, j), NH, USE_G, STORE_AQK, STORE_SCALES, PAIR)


@triton.jit
def _head_rows(x, offs, o_g, m):
    """x at offs + h for the program's value heads h < KG (o_g), fp32 [64, KG] ([64] for one head), 0 where m is
    false."""
    if o_g.shape[0] == 1:
        return tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    else:
        return tl.load(x + offs[:, None] + o_g[None, :], mask=m[:, None], other=0.0).to(tl.float32)


@triton.jit
def _head(x, o_g, j: tl.constexpr):
    """The j-th value head's rows of `_head_rows`' tile."""
    if len(x.shape) == 1:
        return x
    else:
        return tl.sum(tl.where(o_g[None, :] == j, x, 0.0), 1)


@triton.jit
def _kkt_head(A, Aqk, Aqp, rstd, gcum, wsc, NCT, gc, a, o_r, odd, i_h, b_kk, b_rs, b_qk, b_rq, b_qp, b_rp, b_beta, b_g,
              b_gt, b_gp, NH: tl.constexpr, USE_G: tl.constexpr, STORE_AQK: tl.constexpr,
              STORE_SCALES: tl.constexpr, PAIR: tl.constexpr):
    """The kkt kernel's outputs for value head i_h from the block's key products (shared by the value heads of a key
    head): the key norms, A, with STORE_SCALES Gamma and the row scales, with STORE_AQK Aqk (and Aqp with PAIR)."""
    L: tl.constexpr = 64 * NH
    m_low = o_r[:, None] > o_r[None, :]
    rows = (i_h.to(tl.int64) * NCT + gc) * L + a * 64 + o_r
    tl.store(rstd + rows, b_rs)
    if USE_G:
        b_G = tl.cumsum(b_g, 0)
        b_A = b_kk * tl.exp(tl.where(m_low, b_G[:, None] - b_G[None, :], 0.0))
    else:
        b_A = b_kk
    b_A = tl.where(m_low, b_A * (b_beta * b_rs)[:, None] * b_rs[None, :], 0.0)
    m_blk = (o_r[:, None] // 16) >= (o_r[None, :] // 16)
    tl.store(A + rows[:, None] * 64 + o_r[None, :], b_A, mask=m_blk)
    if STORE_SCALES:
        if USE_G:
            tl.store(gcum + rows, b_G + _gates_before(b_gt, o_r, a, NH))
            tl.store(wsc + rows, b_beta * b_rs * tl.exp(b_G))
        else:
            tl.store(gcum + rows, tl.zeros([64], dtype=tl.float32))
            tl.store(wsc + rows, b_beta * b_rs)
    if STORE_AQK:
        tok = (a * 64 + o_r) // NH  # the chunk's token of each sub-step
        m_a = tok[None, :] <= o_r[:, None]
        if USE_G:  # Gamma from the chunk start: the queries' (each token's gate, at its first sub-step), the block's
            b_Gq = tl.cumsum(b_gt, 0)
            b_carry = _gates_before(b_gt, o_r, a, NH)
            b_s = b_qk * tl.exp(tl.where(m_a, b_Gq[:, None] - (b_G + b_carry)[None, :], 0.0))
        else:
            b_s = b_qk
        b_s = tl.where(m_a, b_s * b_rq[:, None] * b_rs[None, :], 0.0)
        p_a = Aqk + ((i_h.to(tl.int64) * NCT + gc) * 64 + o_r)[:, None] * L + a * 64 + o_r[None, :]
        tl.store(p_a, b_s.to(Aqk.dtype.element_ty))
        if PAIR:
            b_x = b_qp * b_rq[:, None] * b_rp[None, :]
            if USE_G:  # Gamma' from chunk c-1's start, and its total (the decay between S_{c-1} and S_c)
                b_x = b_x * tl.exp(b_Gq[:, None] + tl.sum(b_gp, 0) - tl.cumsum(b_gp, 0)[None, :])
            p_x = Aqp + ((i_h.to(tl.int64) * NCT + gc) * 64 + o_r)[:, None] * 64 + o_r[None, :]
            tl.store(p_x, b_x.to(Aqp.dtype.element_ty), mask=odd[:, None])


@triton.jit
def _subst_row(pa, P: tl.constexpr, i: tl.constexpr, b_t):
    """Row i of the inverse of (I + A_PP), A_PP the P-th 16 x 16 diagonal block at pa (row stride 64), b_t the
    inverse so far (rows < i final, the others identity rows): t_i = e_i - sum_{j < i} a_ij t_j."""
    o_i = tl.arange(0, 16)
    b_a = tl.load(pa + (16 * P + i) * 64 + 16 * P + o_i, mask=o_i < i, other=0.0)
    return tl.where(o_i[:, None] == i, b_t - tl.sum(b_a[:, None] * b_t, 0)[None, :], b_t)


@triton.jit
def _load_block(pa, I: tl.constexpr, J: tl.constexpr):
    """Block (I, J) of 16 x 16 of the fp32 [64, 64] matrix at pa (row stride 64)."""
    o_i = tl.arange(0, 16)
    return tl.load(pa + (16 * I + o_i)[:, None] * 64 + 16 * J + o_i[None, :])


@triton.jit
def _tri_inverse_kernel(A, Ti, PREC: tl.constexpr):
    """Split T, step 2: one program per 64-sub-step block (the same rows in A and Ti): T = (I + A)^-1 from the
    four 16 x 16 diagonal inverses (forward substitution, the four chains interleaved in one unrolled loop so
    their row loads and reductions overlap) merged by 16 x 16 block products (`_merge_blocks`); T to Ti in its
    dtype, the blocks on and below the diagonal and zeros above them (its readers load whole rows, unmasked)."""
    base = tl.program_id(0).to(tl.int64) * 64 * 64
    pa, pt = A + base, Ti + base
    o_i = tl.arange(0, 16)
    eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    t00, t11, t22, t33 = eye, eye, eye, eye
    for i in tl.static_range(1, 16):
        t00 = _subst_row(pa, 0, i, t00)
        t11 = _subst_row(pa, 1, i, t11)
        t22 = _subst_row(pa, 2, i, t22)
        t33 = _subst_row(pa, 3, i, t33)
    t00, t11, t22, t33, t10, t21, t32, t20, t31, t30 = _merge_blocks(
        t00, t11, t22, t33, _load_block(pa, 1, 0), _load_block(pa, 2, 1), _load_block(pa, 3, 2),
        _load_block(pa, 2, 0), _load_block(pa, 3, 1), _load_block(pa, 3, 0), PREC,
    )  # fmt: skip
    store_lower_blocks(pt, t00, t11, t22, t33, t10, t21, t32, t20, t31, t30)
    store_upper_zeros(pt)


def launch_inverse(A: torch.Tensor, Ti: torch.Tensor, n_blocks: int, warps: int, prec: str) -> None:
    """T = (I + A)^-1 for each of `n_blocks` [64, 64] blocks (fp32 A, strictly lower) into Ti, a block a program
    (`_tri_inverse_kernel`); an fp32 Ti takes at least 2 warps (ptxas sm_90: 824 bytes of spills at one)."""
    warps = max(warps, 2) if Ti.dtype == torch.float32 else warps
    _tri_inverse_kernel[(n_blocks,)](A, Ti, PREC=prec, num_warps=warps)


@triton.jit
def wu_kernel(
    k, v, beta, g, Ti, W, U, gcum, rstd, T, cu, cidx, coff, NCT,
    HK: tl.constexpr, HV: tl.constexpr, NH: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_G: tl.constexpr, NORM: tl.constexpr, IS_VARLEN: tl.constexpr, F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """The W path's WY factors, one program per (global chunk, value head): Gamma from the chunk start, and each
    block's own W_a = T_aa diag(beta e^{Gamma - Gamma_a}) K_a, U_a = T_aa diag(beta) V_a (Gamma_a: Gamma at the block
    start); U in value tiles of BV, so that dv = 512 fits in registers. T loads unmasked (zeros above its diagonal),
    so it vectorises."""
    gc, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c, bos, Tn = chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
    i_hk = i_h // (HV // HK)
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    k_base = k + bos * NH * (HK * K) + i_hk * K
    v_base = v + bos * NH * (HV * V) + i_h * V
    aux = (i_h.to(tl.int64) * NCT + gc) * L  # row of this chunk in Ti/W/U/gcum/rstd
    carry = tl.zeros([1], dtype=tl.float32)
    for a in tl.static_range(NH):
        s = c * L + a * 64 + o_r
        m_s = s < Tn * NH
        if USE_G:
            m_g = m_s & (s % NH == 0)
            b_gs = tl.load(g + (bos + s // NH) * HV + i_h, mask=m_g, other=0.0).to(tl.float32)
            b_Gblk = tl.cumsum(b_gs, 0)  # from the block start
            b_Gc = b_Gblk + carry  # from the chunk start
            tl.store(gcum + aux + a * 64 + o_r, b_Gc)
            carry += tl.sum(b_gs, 0)
            b_dec = tl.exp(b_Gblk)
        else:
            b_Gc = tl.zeros([64], dtype=tl.float32)
            tl.store(gcum + aux + a * 64 + o_r, b_Gc)
            b_dec = tl.full([64], 1.0, dtype=tl.float32)
        b_k = tl.load(k_base + s[:, None] * (HK * K) + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
        b_beta = tl.load(beta + (bos * NH + s) * HV + i_h, mask=m_s, other=0.0).to(tl.float32)
        b_rs = tl.load(rstd + aux + a * 64 + o_r)
        rows = aux + a * 64 + o_r
        b_Ti = dot_in(load_t(Ti, rows, o_r), W, F32)
        b_X = b_k.to(tl.float32) * (b_beta * b_rs * b_dec)[:, None]
        b_W = tl.dot(b_Ti, dot_in(b_X, W, F32), input_precision=PREC)
        tl.store(W + rows[:, None] * K + o_k[None, :], b_W.to(W.dtype.element_ty), mask=m_k[None, :])
        for iv in range((V + BV - 1) // BV):  # a loop, not unrolled: dv = 512 compiles 4x less U code
            o_v = iv * BV + tl.arange(0, BV)
            m_v = o_v < V
            p_v = v_base + s[:, None] * (HV * V) + o_v[None, :]
            b_v = tl.load(p_v, mask=m_s[:, None] & m_v[None, :], other=0.0)
            b_Y = b_v.to(tl.float32) * b_beta[:, None]
            b_U = tl.dot(b_Ti, dot_in(b_Y, W, F32), input_precision=PREC)
            tl.store(U + rows[:, None] * V + o_v[None, :], b_U.to(U.dtype.element_ty), mask=m_v[None, :])
