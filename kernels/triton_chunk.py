"""Triton chunked (WY/UT) forward of the gated delta product: output, final and chunk-boundary states.

Same contract as `kernels.chunk.chunk_delta_product`: q, k with Hk key heads and v, beta, g with Hv value heads
(value head j reads key head j // (Hv/Hk) in every kernel), dk <= 256, dv <= 512, and packed batches
(`cu_seqlens`: chunks never straddle two sequences; a table maps each global chunk to its sequence). A chunk
is 64 tokens, i.e. L = 64 * n_h Householder sub-steps, split into n_h blocks of 64 sub-steps. Kernels:

1. `_tri_kernel` (persistent, parallel over blocks): T_aa = (I + A_aa)^-1 of each 64-sub-step block,
   A_ij = beta_i e^{Gamma_i - Gamma_j} k_i.k_j (j < i), from four 16x16 forward substitutions merged
   by block rows; also the reciprocal key norms. With `LaunchConfig.tri_split` (the default; any n_h) two
   kernels instead, as fla splits it: `_kkt_kernel` (A in fp32, one program per block and value head) and
   `_tri_inverse_kernel` (16x16 diagonal inverses merged by 16x16 block products), writing the same T.
   `_kkt_kernel` also forms the intra-chunk attention q K^T * decay * mask once a chunk (`out_aqk`), and with
   `state_from_v` on the keys path the row scales and Gamma, so that `_wu_kernel` is not launched.
2. `_wu_kernel` (parallel over chunks): each block's WY factors W_a = T_aa X_a, U_a = T_aa Y_a,
   X = diag(beta e^{Gamma - Gamma_a}) K, Y = diag(beta) V (Gamma_a: the log-decay at the block start).
3. `_state_kernel` (sequential over chunks and their blocks, parallel over sequence * head * value tiles):
   the boundary states S_c and the pseudo-values D_a = U_a - W_a S_a, S_a the state at block a's start.
   (An earlier version solved the whole 64 n_h-sub-step chunk as one WY system, so that the blocks of a
   chunk shared S_c; its cross-block substitution made `_wu_kernel` 2.7x fla's on an H100 at n_h = 3.)
4. `_output_kernel` (parallel over chunks): o = scale (e^Gamma q S_c + (q K^T * decay * mask) D); D holds
   each sub-step's true pseudo-value, so one chunk-level formula covers all its blocks.

`_Phases` allocates the intermediates and launches them as prep (1-2), state (3) and output (4).

With normalize_qk=True (default False), q and k are L2-normalised in-kernel through per-row reciprocal norms.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kernels.naive import CHUNK_SIZE, check_inputs

BLOCK = 64  # sub-steps per WY block; a chunk of 64 tokens holds n_h of them
EPS = 1e-6  # as kernels.naive.l2_normalize


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot_in(x, ref, F32: tl.constexpr):
    """Operand for tl.dot: ref's element type on the GPU, fp32 in the interpreter (its bf16 dot is wrong)."""
    if F32:
        return x.to(tl.float32)
    else:
        return x.to(ref.dtype.element_ty)


@triton.jit
def _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within it, its first token (int64), its length) of global chunk gc."""
    if IS_VARLEN:
        i_n = tl.load(cidx + gc).to(tl.int32)
        c = gc - tl.load(coff + i_n).to(tl.int32)
        bos = tl.load(cu + i_n).to(tl.int64)
        Tn = (tl.load(cu + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        NCH = tl.cdiv(T, 64)
        i_n = gc // NCH
        c = gc % NCH
        bos = i_n.to(tl.int64) * T
        Tn = T
    return i_n, c, bos, Tn


@triton.jit
def _invert_in_place(S, PREC: tl.constexpr):
    """The fp32 [64, 64] block at S (row stride 64) holds A (strictly lower); leaves T = (I + A)^-1 there and
    returns it (lower, fp32). Four 16x16 diagonal inverses by forward substitution (row i of T - I is
    -a_i + sum_j (-a_ij) (T - I)_j), then block rows in place: T_{p,<p} = -T_pp A_{p,<p} T_{<p,<p}."""
    o_r = tl.arange(0, 64)
    o_i = tl.arange(0, 16)
    o_p = tl.arange(0, 4)
    m_tri = o_r[:, None] >= o_r[None, :]
    eye16 = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    b_T3 = tl.zeros([4, 16, 16], dtype=tl.float32)
    for i in range(1, 16):
        b_a = -tl.load(S + (16 * o_p[:, None] + i) * 64 + 16 * o_p[:, None] + o_i[None, :])
        b_a = tl.where(o_i[None, :] < i, b_a, 0.0)
        b_new = b_a + tl.sum(b_a[:, :, None] * b_T3, 1)
        b_T3 = tl.where(o_i[None, :, None] == i, b_new[:, None, :], b_T3)
    b_T3 += eye16[None, :, :]
    p_d = S + (16 * o_p[:, None, None] + o_i[None, :, None]) * 64 + 16 * o_p[:, None, None] + o_i[None, None, :]
    tl.debug_barrier()
    tl.store(p_d, b_T3)
    tl.debug_barrier()
    for p in tl.static_range(1, 4):
        row = 16 * p + o_i
        b_Ap = tl.load(S + row[:, None] * 64 + o_r[None, :], mask=o_r[None, :] < 16 * p, other=0.0)
        b_Tprev = tl.load(S + o_r[:, None] * 64 + o_r[None, :], mask=(o_r[:, None] < 16 * p) & m_tri, other=0.0)
        b_R = tl.dot(b_Ap, b_Tprev, input_precision=PREC)
        b_Tpp = tl.load(S + row[:, None] * 64 + 16 * p + o_i[None, :])
        b_off = -tl.dot(b_Tpp, b_R, input_precision=PREC)
        tl.debug_barrier()
        tl.store(S + row[:, None] * 64 + o_r[None, :], b_off, mask=o_r[None, :] < 16 * p)
        tl.debug_barrier()
    return tl.load(S + o_r[:, None] * 64 + o_r[None, :], mask=m_tri, other=0.0)


@triton.jit
def _unit_lower_inverse16(b_a):
    """(I + A)^-1 of a strictly lower [16, 16] fp32 tile, by forward substitution in registers: row i of the
    inverse is e_i - sum_{j < i} A_ij (row j of the inverse)."""
    o_i = tl.arange(0, 16)
    b_t = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for i in range(1, 16):
        b_ai = tl.sum(tl.where(o_i[:, None] == i, b_a, 0.0), 0)  # row i of A, over j
        b_t -= tl.where(o_i[:, None] == i, tl.sum(b_ai[:, None] * b_t, 0)[None, :], 0.0)
    return b_t


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _invert_blocks(a00, a11, a22, a33, a10, a21, a32, a20, a31, a30, PREC: tl.constexpr):
    """T = (I + A)^-1 of a [64, 64] strictly lower A given as its ten 16 x 16 blocks (fp32, in registers), returned
    the same way: T_II by forward substitution, T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ by block rows. No scratch
    memory and no barriers, unlike `_invert_in_place`."""
    t00 = _unit_lower_inverse16(a00)
    t11 = _unit_lower_inverse16(a11)
    t22 = _unit_lower_inverse16(a22)
    t33 = _unit_lower_inverse16(a33)
    return _merge_blocks(t00, t11, t22, t33, a10, a21, a32, a20, a31, a30, PREC)


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
def _store_upper_zeros(ptr):
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
def _store_lower_blocks(ptr, b00, b11, b22, b33, b10, b21, b32, b20, b31, b30):
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
def _tri_kernel(
    k,
    beta,
    g,
    Ti,
    rstd,
    scratch,
    T,
    cu,
    cidx,
    coff,
    NCT,
    n_jobs,
    HK: tl.constexpr,
    HV: tl.constexpr,
    NH: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    USE_G: tl.constexpr,
    NORM: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """Persistent over (value head, 64-sub-step block): key norms and T = (I + A)^-1 of each block.

    A_ij = beta_i e^{Gamma_i - Gamma_j} k_i.k_j (j < i) goes to this program's fp32 scratch (reused, so it
    stays in L2); four 16x16 diagonal inverses by forward substitution, then block rows merged in place.
    """
    NBT = NCT * NH  # blocks per value head
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_low = o_r[:, None] > o_r[None, :]
    S = scratch + tl.program_id(0).to(tl.int64) * 64 * 64
    for job in range(tl.program_id(0), n_jobs, tl.num_programs(0)):
        i_h, gb = job // NBT, job % NBT
        gc, a = gb // NH, gb % NH
        i_n, c, bos, Tn = _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
        i_hk = i_h // (HV // HK)
        s = c * L + a * 64 + o_r  # sub-step index in the sequence
        m_s = s < Tn * NH
        p_k = k + (bos * NH + s)[:, None] * (HK * K) + i_hk * K + o_k[None, :]
        b_k = tl.load(p_k, mask=m_s[:, None] & m_k[None, :], other=0.0)
        b_beta = tl.load(beta + (bos * NH + s) * HV + i_h, mask=m_s, other=0.0).to(tl.float32)
        if NORM:
            b_kf = b_k.to(tl.float32)
            b_rs = 1.0 / tl.sqrt(tl.sum(b_kf * b_kf, 1) + 1e-6)
        else:
            b_rs = tl.full([64], 1.0, dtype=tl.float32)
        rows = (i_h.to(tl.int64) * NCT + gc) * L + a * 64 + o_r
        tl.store(rstd + rows, b_rs)
        if USE_G:
            m_g = m_s & (s % NH == 0)
            b_g = tl.load(g + (bos + s // NH) * HV + i_h, mask=m_g, other=0.0).to(tl.float32)
            b_G = tl.cumsum(b_g, 0)
            b_dec = tl.exp(tl.where(m_low, b_G[:, None] - b_G[None, :], 0.0))
        else:
            b_dec = tl.full([64, 64], 1.0, dtype=tl.float32)
        b_kd = _dot_in(b_k, k, F32)
        b_kk = tl.dot(b_kd, tl.trans(b_kd), input_precision=PREC)
        b_A = tl.where(m_low, b_kk * (b_beta * b_rs)[:, None] * b_rs[None, :] * b_dec, 0.0)
        tl.debug_barrier()  # the previous job may still read the scratch
        tl.store(S + o_r[:, None] * 64 + o_r[None, :], b_A)
        tl.debug_barrier()
        b_Ti = _invert_in_place(S, PREC)  # T = (I + A)^-1
        tl.store(Ti + rows[:, None] * 64 + o_r[None, :], b_Ti.to(Ti.dtype.element_ty))


@triton.jit
def _gates_before(g, bos, t, m_t, o_r, i_h, a, HV: tl.constexpr, NH: tl.constexpr):
    """Sum of the chunk's log gates before WY block a (tokens t whose first sub-step comes before the block)."""
    m_before = m_t & (o_r * NH < a * 64)
    return tl.sum(tl.load(g + (bos + t) * HV + i_h, mask=m_before, other=0.0).to(tl.float32), 0)


@triton.jit
def _kkt_kernel(
    q,
    k,
    beta,
    g,
    A,
    Aqk,
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
):
    """Split T, step 1 (`LaunchConfig.tri_split`): one program per (64-sub-step block, value head), value heads
    adjacent so that a group's programs share its key block in L2. A_ij = beta_i e^{Gamma_i - Gamma_j} r_i r_j
    k_i.k_j (j < i) by [64, BKC] x [BKC, 64] products over key blocks, stored fp32 (only the ten 16 x 16 blocks
    on and below the diagonal: the inverse reads no others); also the reciprocal key norms r. STORE_AQK: also the
    block's share of the chunk's intra-chunk attention, (q K_a^T * e^{Gamma_q - Gamma_s} * mask) / (|q| |k|), with the
    same key blocks (`_output_kernel` reads it). STORE_SCALES: also Gamma from the chunk start and the row scales
    c = beta e^{Gamma - Gamma_a} / |k|, all the keys path with U from v needs of `_wu_kernel` (not launched then)."""
    job = tl.program_id(0)
    i_h, gb = job % HV, job // HV
    gc, a = gb // NH, gb % NH
    i_n, c, bos, Tn = _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
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
    for kb in range(0, BK, BKC):
        o_k = kb + tl.arange(0, BKC)
        b_k = tl.load(p_k + o_k[None, :], mask=m_s[:, None] & (o_k < K)[None, :], other=0.0)
        b_kd = _dot_in(b_k, k, F32)
        b_kk += tl.dot(b_kd, tl.trans(b_kd), input_precision=PREC)
        if STORE_AQK:
            b_q = tl.load(p_q + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
            if NORM:
                b_qf = b_q.to(tl.float32)
                b_qq += tl.sum(b_qf * b_qf, 1)
            b_qk += tl.dot(_dot_in(b_q, k, F32), tl.trans(b_kd), input_precision=PREC)
    m_low = o_r[:, None] > o_r[None, :]
    if NORM:  # |k_i|^2 is K K^T's diagonal (exact bf16 products, fp32 sums): no second pass over the keys
        b_rs = 1.0 / tl.sqrt(tl.sum(tl.where(o_r[:, None] == o_r[None, :], b_kk, 0.0), 1) + 1e-6)
    else:
        b_rs = tl.full([64], 1.0, dtype=tl.float32)
    rows = (i_h.to(tl.int64) * NCT + gc) * L + a * 64 + o_r
    tl.store(rstd + rows, b_rs)
    b_beta = tl.load(beta + (bos * NH + s) * HV + i_h, mask=m_s, other=0.0).to(tl.float32)
    if USE_G:
        m_g = m_s & (s % NH == 0)
        b_G = tl.cumsum(tl.load(g + (bos + s // NH) * HV + i_h, mask=m_g, other=0.0).to(tl.float32), 0)
        b_A = b_kk * tl.exp(tl.where(m_low, b_G[:, None] - b_G[None, :], 0.0))
    else:
        b_A = b_kk
    b_A = tl.where(m_low, b_A * (b_beta * b_rs)[:, None] * b_rs[None, :], 0.0)
    m_blk = (o_r[:, None] // 16) >= (o_r[None, :] // 16)
    tl.store(A + rows[:, None] * 64 + o_r[None, :], b_A, mask=m_blk)
    if STORE_SCALES:
        if USE_G:
            tl.store(gcum + rows, b_G + _gates_before(g, bos, t, m_t, o_r, i_h, a, HV, NH))
            tl.store(wsc + rows, b_beta * b_rs * tl.exp(b_G))
        else:
            tl.store(gcum + rows, tl.zeros([64], dtype=tl.float32))
            tl.store(wsc + rows, b_beta * b_rs)
    if STORE_AQK:
        if NORM:
            b_rq = 1.0 / tl.sqrt(b_qq + 1e-6)
        else:
            b_rq = tl.full([64], 1.0, dtype=tl.float32)
        tok = (a * 64 + o_r) // NH  # the chunk's token of each sub-step
        m_a = tok[None, :] <= o_r[:, None]
        if USE_G:  # Gamma from the chunk start: the queries' (each token's gate, at its first sub-step), the block's
            b_Gq = tl.cumsum(tl.load(g + (bos + t) * HV + i_h, mask=m_t, other=0.0).to(tl.float32), 0)
            b_carry = _gates_before(g, bos, t, m_t, o_r, i_h, a, HV, NH)
            b_s = b_qk * tl.exp(tl.where(m_a, b_Gq[:, None] - (b_G + b_carry)[None, :], 0.0))
        else:
            b_s = b_qk
        b_s = tl.where(m_a, b_s * b_rq[:, None] * b_rs[None, :], 0.0)
        p_a = Aqk + ((i_h.to(tl.int64) * NCT + gc) * 64 + o_r)[:, None] * L + a * 64 + o_r[None, :]
        tl.store(p_a, b_s.to(Aqk.dtype.element_ty))


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
def _tri_inverse_kernel(A, Ti, PREC: tl.constexpr, UPPER_ZEROS: tl.constexpr):
    """Split T, step 2: one program per 64-sub-step block (the same rows in A and Ti): T = (I + A)^-1 from the
    four 16 x 16 diagonal inverses (forward substitution, the four chains interleaved in one unrolled loop so
    their row loads and reductions overlap) merged by 16 x 16 block products (`_merge_blocks`); T to Ti in its
    dtype, only the blocks on and below the diagonal (the WY kernel reads T's lower triangle), and with UPPER_ZEROS
    zeros above them (for the KDA WY kernel, which reads whole rows)."""
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
    _store_lower_blocks(pt, t00, t11, t22, t33, t10, t21, t32, t20, t31, t30)
    if UPPER_ZEROS:
        _store_upper_zeros(pt)


def launch_inverse(A: torch.Tensor, Ti: torch.Tensor, n_blocks: int, warps: int, prec: str,
                   upper_zeros: bool = False) -> None:
    """T = (I + A)^-1 for each of `n_blocks` [64, 64] blocks (fp32 A, strictly lower) into Ti, a block a program
    (`_tri_inverse_kernel`); an fp32 Ti takes at least 2 warps (ptxas sm_90: 824 bytes of spills at one)."""
    warps = max(warps, 2) if Ti.dtype == torch.float32 else warps
    _tri_inverse_kernel[(n_blocks,)](A, Ti, PREC=prec, UPPER_ZEROS=upper_zeros, num_warps=warps)


@triton.jit
def _wu_kernel(
    q,
    k,
    v,
    beta,
    g,
    Ti,
    W,
    U,
    Aqk,
    gcum,
    rstd,
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
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_G: tl.constexpr,
    NORM: tl.constexpr,
    STORE_AQK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    KEYS_WS: tl.constexpr,
    STORE_U: tl.constexpr = True,
):
    """One program per (global chunk, value head): Gamma from the chunk start, and each block's own WY factors
    W_a = T_aa diag(beta e^{Gamma - Gamma_a}) K_a, U_a = T_aa diag(beta) V_a (Gamma_a: Gamma at the block start);
    U in value tiles of BV, so that dv = 512 fits in registers. With STORE_AQK also the chunk's intra-chunk
    attention A = q K^T * decay * mask [64 tokens, 64 n_h sub-steps] (normalised), which the output (fused or
    not) reads instead of forming q K^T once per value tile.
    KEYS_WS: the row scales c = beta e^{Gamma - Gamma_a} / |k| instead of W (the state kernel forms W S from K).
    Without STORE_U no U (the state kernel forms it from v, `LaunchConfig.state_from_v`)."""
    gc, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c, bos, Tn = _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
    i_hk = i_h // (HV // HK)
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tri = o_r[:, None] >= o_r[None, :]
    k_base = k + bos * NH * (HK * K) + i_hk * K
    v_base = v + bos * NH * (HV * V) + i_h * V
    aux = (i_h.to(tl.int64) * NCT + gc) * L  # row of this chunk in Ti/W/U/gcum/rstd
    if STORE_AQK:
        t = c * 64 + o_r
        m_t = t < Tn
        b_q = tl.load(
            q + (bos + t)[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
        )
        if NORM:
            b_qf = b_q.to(tl.float32)
            b_rq = 1.0 / tl.sqrt(tl.sum(b_qf * b_qf, 1) + 1e-6)
        else:
            b_rq = tl.full([64], 1.0, dtype=tl.float32)
        if USE_G:
            b_Gq = tl.cumsum(tl.load(g + (bos + t) * HV + i_h, mask=m_t, other=0.0).to(tl.float32), 0)
        else:
            b_Gq = tl.zeros([64], dtype=tl.float32)
        b_qd = _dot_in(b_q, W, F32)
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
        if STORE_AQK or not KEYS_WS:
            b_k = tl.load(k_base + s[:, None] * (HK * K) + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
        b_beta = tl.load(beta + (bos * NH + s) * HV + i_h, mask=m_s, other=0.0).to(tl.float32)
        b_rs = tl.load(rstd + aux + a * 64 + o_r)
        rows = aux + a * 64 + o_r
        if STORE_U or not KEYS_WS:
            b_Ti = _dot_in(tl.load(Ti + rows[:, None] * 64 + o_r[None, :], mask=m_tri, other=0.0), W, F32)
        if KEYS_WS:
            tl.store(wsc + rows, b_beta * b_rs * b_dec)
        else:
            b_X = b_k.to(tl.float32) * (b_beta * b_rs * b_dec)[:, None]
            b_W = tl.dot(b_Ti, _dot_in(b_X, W, F32), input_precision=PREC)
            tl.store(W + rows[:, None] * K + o_k[None, :], b_W.to(W.dtype.element_ty), mask=m_k[None, :])
        if STORE_U:
            for iv in range((V + BV - 1) // BV):  # a loop, not unrolled: dv = 512 compiles 4x less U code
                o_v = iv * BV + tl.arange(0, BV)
                m_v = o_v < V
                p_v = v_base + s[:, None] * (HV * V) + o_v[None, :]
                b_v = tl.load(p_v, mask=m_s[:, None] & m_v[None, :], other=0.0)
                b_Y = b_v.to(tl.float32) * b_beta[:, None]
                b_U = tl.dot(b_Ti, _dot_in(b_Y, W, F32), input_precision=PREC)
                tl.store(U + rows[:, None] * V + o_v[None, :], b_U.to(U.dtype.element_ty), mask=m_v[None, :])
        if STORE_AQK:
            tok = (a * 64 + o_r) // NH
            m_a = tok[None, :] <= o_r[:, None]
            b_s = tl.dot(b_qd, tl.trans(_dot_in(b_k, W, F32)), input_precision=PREC)
            b_sdec = tl.exp(tl.where(m_a, b_Gq[:, None] - b_Gc[None, :], 0.0))
            b_s = tl.where(m_a, b_s * b_rq[:, None] * b_rs[None, :] * b_sdec, 0.0)
            p_a = Aqk + (aux // NH + o_r)[:, None] * L + a * 64 + o_r[None, :]
            tl.store(p_a, b_s.to(Aqk.dtype.element_ty))


@triton.jit
def _store_state(base, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT: tl.constexpr):
    """A state's tile (its key halves with SPLIT) at `base`."""
    tl.store(base + p_h1, b_h1, mask=m_h1)
    if SPLIT:
        tl.store(base + p_h2, b_h2, mask=m_h2)


@triton.jit
def _block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV: tl.constexpr, V: tl.constexpr):
    """diag(beta) V of one 64-row block (rows s), fp32: what U = T diag(beta) V multiplies."""
    b_v = tl.load(v_base + s[:, None] * (HV * V) + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0)
    return b_v.to(tl.float32) * tl.load(beta_base + s * HV, mask=m_s, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _block_u(U, Ti, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, ref, HV: tl.constexpr, V: tl.constexpr,
             F32: tl.constexpr, PREC: tl.constexpr, FROM_V: tl.constexpr):
    """U of one 64-row block: read (`_wu_kernel` wrote it, in its dtype), or with FROM_V formed here (fp32) as
    T (diag(beta) V)."""
    if FROM_V:
        b_bv = _dot_in(_block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV, V), ref, F32)
        b_t = tl.load(Ti + rows[:, None] * 64 + o_r[None, :], mask=o_r[:, None] >= o_r[None, :], other=0.0)
        b_u = tl.dot(_dot_in(b_t, ref, F32), b_bv, input_precision=PREC)
    else:
        b_u = tl.load(U + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    return b_u


@triton.jit
def _u_minus_ws(b_u, W, rows, o_k1, o_k2, m_k1, m_k2, b_h1, b_h2, ref, K: tl.constexpr, SPLIT: tl.constexpr,
                F32: tl.constexpr, PREC: tl.constexpr):
    """U - W S for one 64-row block (fp32; the state in its key halves with SPLIT; `ref` gives the dot dtype)."""
    b_w1 = tl.load(W + rows[:, None] * K + o_k1[None, :], mask=m_k1[None, :], other=0.0)
    b_wh = tl.dot(_dot_in(b_w1, ref, F32), _dot_in(b_h1, ref, F32), input_precision=PREC)
    if SPLIT:
        b_w2 = tl.load(W + rows[:, None] * K + o_k2[None, :], mask=m_k2[None, :], other=0.0)
        b_wh += tl.dot(_dot_in(b_w2, ref, F32), _dot_in(b_h2, ref, F32), input_precision=PREC)
    return b_u.to(tl.float32) - b_wh


@triton.jit
def _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr):
    """A 64-row block's raw keys (rows s), in the state's key halves with SPLIT (else the second is the first)."""
    b_k1 = tl.load(k_base + s[:, None] * (HK * K) + o_k1[None, :], mask=m_s[:, None] & m_k1[None, :], other=0.0)
    b_k2 = b_k1
    if SPLIT:
        b_k2 = tl.load(k_base + s[:, None] * (HK * K) + o_k2[None, :], mask=m_s[:, None] & m_k2[None, :], other=0.0)
    return b_k1, b_k2


@triton.jit
def _keys_times_state(b_k1, b_k2, b_h1, b_h2, ref, SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr):
    """K S for one 64-row block (fp32), the keys and the state in their key halves with SPLIT."""
    b_ks = tl.dot(_dot_in(b_k1, ref, F32), _dot_in(b_h1, ref, F32), input_precision=PREC)
    if SPLIT:
        b_ks += tl.dot(_dot_in(b_k2, ref, F32), _dot_in(b_h2, ref, F32), input_precision=PREC)
    return b_ks


@triton.jit
def _u_minus_tcks(U, Ti, wsc, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, b_k1, b_k2, b_h1, b_h2, ref,
                  HV: tl.constexpr, V: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
                  FROM_V: tl.constexpr):
    """U - W S for one 64-row block as U - T (diag(c) (K S)), W = T diag(c) K (`_wu_kernel`): from the block's
    keys, which the state update loads anyway, and its 64 x 64 T, instead of W's 64 x dk rows. FROM_V: as
    T (diag(beta) V - diag(c) (K S)), one product with T and no U read (`_wu_kernel` writes none)."""
    if FROM_V:
        b_ks = _keys_times_state(b_k1, b_k2, b_h1, b_h2, ref, SPLIT, F32, PREC)
        b_x = _block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV, V) - b_ks * tl.load(wsc + rows)[:, None]
        b_t = tl.load(Ti + rows[:, None] * 64 + o_r[None, :], mask=o_r[:, None] >= o_r[None, :], other=0.0)
        return tl.dot(_dot_in(b_t, ref, F32), _dot_in(b_x, ref, F32), input_precision=PREC)
    else:  # (the measured order of loads and products)
        b_u = tl.load(U + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_ks = _keys_times_state(b_k1, b_k2, b_h1, b_h2, ref, SPLIT, F32, PREC)
        b_x = _dot_in(b_ks * tl.load(wsc + rows)[:, None], ref, F32)
        b_t = tl.load(Ti + rows[:, None] * 64 + o_r[None, :], mask=o_r[:, None] >= o_r[None, :], other=0.0)
        return b_u.to(tl.float32) - tl.dot(_dot_in(b_t, ref, F32), b_x, input_precision=PREC)


@triton.jit
def _block_decays(gcum, aux0, blk, NH: tl.constexpr):
    """(G, G'): the chunk's log decay before block `blk` (0 at a chunk's first block) and at its end."""
    if NH == 1:
        b_G0 = 0.0
    else:
        b_G0 = tl.load(gcum + aux0 + blk * 64 - 1, mask=blk % NH > 0, other=0.0)
    return b_G0, tl.load(gcum + aux0 + blk * 64 + 63)


@triton.jit
def _update_state(b_h1, b_h2, b_k1, b_k2, b_ds, b_gam, ref, SPLIT: tl.constexpr, F32: tl.constexpr,
                  PREC: tl.constexpr):
    """S' = gamma S + K^T (scaled D), the state in its key halves with SPLIT."""
    b_h1 = b_h1 * b_gam + tl.dot(tl.trans(_dot_in(b_k1, ref, F32)), b_ds, input_precision=PREC)
    if SPLIT:
        b_h2 = b_h2 * b_gam + tl.dot(tl.trans(_dot_in(b_k2, ref, F32)), b_ds, input_precision=PREC)
    return b_h1, b_h2


@triton.jit
def _state_block(
    k, k_base, W, U, D, gcum, rstd, Ti, wsc, v_base, beta_base, aux0, Tn, o_r, o_k1, o_k2, m_k1, m_k2, o_v, m_v,
    b_h1, b_h2, blk, HK: tl.constexpr, HV: tl.constexpr, NH: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, STORE_D: tl.constexpr, KEYS_WS: tl.constexpr,
    FROM_V: tl.constexpr,
):
    """One 64-row block `blk` of a sequence (block blk % NH of chunk blk // NH): D = U - W S and
    S' = e^{G'} S + sum_s e^{G' - G_s} k_s d_s^T (G' the log decay to the block's end, from the chunk's start;
    `gcum` restarts each chunk, so the block's own decay is G' - G at the previous block's end). Returns S' and D
    (also stored with STORE_D, as soon as it is known: fewer registers live across the state update).
    KEYS_WS: W S from the keys and T (`_u_minus_tcks`), W unread. FROM_V: U formed from v and beta, U unread."""
    rows = aux0 + blk * 64 + o_r
    s = blk * 64 + o_r
    m_s = s < Tn * NH
    b_G0, b_G1 = _block_decays(gcum, aux0, blk, NH)
    if KEYS_WS:  # the keys first: W S needs them
        b_k1, b_k2 = _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK, K, SPLIT)
        b_d = _u_minus_tcks(U, Ti, wsc, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, b_k1, b_k2, b_h1, b_h2, k,
                            HV, V, SPLIT, F32, PREC, FROM_V)
    else:
        b_u = _block_u(U, Ti, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, k, HV, V, F32, PREC, FROM_V)
        b_d = _u_minus_ws(b_u, W, rows, o_k1, o_k2, m_k1, m_k2, b_h1, b_h2, k, K, SPLIT, F32, PREC)
    if STORE_D:
        tl.store(D + rows[:, None] * V + o_v[None, :], b_d.to(D.dtype.element_ty), mask=m_v[None, :])
    b_scale = tl.load(rstd + rows) * tl.exp(b_G1 - tl.load(gcum + rows))  # key norm, e^{G' - G_s}
    b_ds = _dot_in(b_d * b_scale[:, None], k, F32)
    if not KEYS_WS:
        b_k1, b_k2 = _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK, K, SPLIT)
    b_h1, b_h2 = _update_state(b_h1, b_h2, b_k1, b_k2, b_ds, tl.exp(b_G1 - b_G0), k, SPLIT, F32, PREC)
    return b_h1, b_h2, b_d


@triton.jit
def _state_kernel(
    q,
    k,
    v,
    beta,
    W,
    U,
    D,
    Aqk,
    gcum,
    rstd,
    Ti,
    wsc,
    bnd,
    ht,
    h0,
    o,
    T,
    cu,
    coff,
    order,
    NCT,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    NH: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BKH: tl.constexpr,
    SPLIT: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    STORE_BND: tl.constexpr,
    FUSE_O: tl.constexpr,
    NORM: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    F32: tl.constexpr,
    PREC: tl.constexpr,
    KEYS_WS: tl.constexpr,
    FROM_V: tl.constexpr = False,
):
    """One program per (value tile, sequence * value head), looping over the sequence's 64-row blocks (n_h a
    chunk; `_state_block`, in one flat loop unless FUSE_O): store S_c (at chunk starts), D_a = U_a - W_a S_a and
    S_{a+1} = e^{G_a'} S_a + sum_{s in a} e^{G_a' - G_s} k_s D_s^T, G_a' the log-decay over block a.
    D is each sub-step's true pseudo-value, whatever the blocking. The state's key rows are held in two
    halves when dk > 128 (SPLIT): one [256, 32] tile miscompiled on an H100 (Triton 3.6), as [128, 16] did.
    FUSE_O: also o = scale (e^G q S_c + A D) for this value tile (A, Aqk, from the kkt or WY kernel), so that
    neither D nor the fp32 boundary states are read back by an output kernel."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    if IS_VARLEN:  # longest sequences first (`order`), so that they do not start in the last wave
        i_n = tl.load(order + i_n).to(tl.int32)
        i_nh = i_n * HV + i_h
    i_hk = i_h // (HV // HK)
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        Tn = (tl.load(cu + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        gc0 = tl.load(coff + i_n).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        Tn = T
        gc0 = i_n * tl.cdiv(T, 64)
    NC = tl.cdiv(Tn, 64)
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    o_k1 = tl.arange(0, BKH)
    o_k2 = BKH + tl.arange(0, BKH)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k1 = o_k1 < K
    m_k2 = o_k2 < K
    m_v = o_v < V
    m_h1 = m_k1[:, None] & m_v[None, :]
    m_h2 = m_k2[:, None] & m_v[None, :]
    k_base = k + bos * NH * (HK * K) + i_hk * K
    q_base = q + bos * (HK * K) + i_hk * K
    aux0 = (i_h.to(tl.int64) * NCT + gc0) * L
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
    v_base = v + bos * NH * (HV * V) + i_h * V
    beta_base = beta + bos * NH * HV + i_h
    blocks = (k, k_base, W, U, D, gcum, rstd, Ti, wsc, v_base, beta_base, aux0, Tn, o_r, o_k1, o_k2, m_k1, m_k2, o_v,
              m_v)
    if FUSE_O:
        for c in range(NC):
            if STORE_BND:
                _store_state(bnd_base + c * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
            aux = aux0 + c * L
            t = c * 64 + o_r
            m_t = t < Tn
            b_q1 = tl.load(q_base + t[:, None] * (HK * K) + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
            b_qq = tl.sum(b_q1.to(tl.float32) * b_q1.to(tl.float32), 1)
            b_o = tl.dot(_dot_in(b_q1, k, F32), _dot_in(b_h1, k, F32), input_precision=PREC)
            if SPLIT:
                p_q2 = q_base + t[:, None] * (HK * K) + o_k2[None, :]
                b_q2 = tl.load(p_q2, mask=m_t[:, None] & m_k2[None, :], other=0.0)
                b_qq += tl.sum(b_q2.to(tl.float32) * b_q2.to(tl.float32), 1)
                b_o += tl.dot(_dot_in(b_q2, k, F32), _dot_in(b_h2, k, F32), input_precision=PREC)
            if NORM:
                b_rq = 1.0 / tl.sqrt(b_qq + 1e-6)
            else:
                b_rq = tl.full([64], 1.0, dtype=tl.float32)
            b_Gq = tl.load(gcum + aux + o_r * NH + NH - 1)
            b_o = b_o * (b_rq * tl.exp(b_Gq))[:, None]
            for a in tl.static_range(NH):
                b_h1, b_h2, b_d = _state_block(
                    *blocks, b_h1, b_h2, c * NH + a, HK=HK, HV=HV, NH=NH, K=K, V=V, SPLIT=SPLIT, F32=F32,
                    PREC=PREC, STORE_D=False, KEYS_WS=KEYS_WS, FROM_V=FROM_V,
                )
                b_a = tl.load(Aqk + (aux // NH + o_r)[:, None] * L + a * 64 + o_r[None, :])
                b_o += tl.dot(_dot_in(b_a, k, F32), _dot_in(b_d, k, F32), input_precision=PREC)
            p_o = o + (bos + t)[:, None] * (HV * V) + i_h * V + o_v[None, :]
            tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    else:  # one flat loop over all blocks (n_h a chunk): one block's code in the loop body at any n_h
        for blk in range(NC * NH):
            if STORE_BND:
                if blk % NH == 0:
                    _store_state(bnd_base + (blk // NH) * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
            b_h1, b_h2, b_d = _state_block(
                *blocks, b_h1, b_h2, blk, HK=HK, HV=HV, NH=NH, K=K, V=V, SPLIT=SPLIT, F32=F32, PREC=PREC,
                STORE_D=True, KEYS_WS=KEYS_WS, FROM_V=FROM_V,
            )
    if STORE_BND:
        _store_state(bnd_base + NC * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
    if STORE_FINAL:
        _store_state(ht + i_nh.to(tl.int64) * K * V, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)


@triton.jit
def _out_key_block(q_base, h_base, k_base, s0, kb, m_t, m_v, Tn, HK: tl.constexpr, NH: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, QK: tl.constexpr):
    """Key block kb of the output kernel's operands: q [64, BK], S_c rows [BK, BV] and, with QK, each WY block's
    keys [64, BK] (zeros past dk, so a block past the last loads nothing)."""
    o_k = kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_q = tl.load(q_base + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_h = tl.load(h_base + o_k[:, None] * V, mask=m_k[:, None] & m_v[None, :], other=0.0)
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
    b_qd = _dot_in(b_q, k, F32)
    b_o += tl.dot(b_qd, _dot_in(b_h, k, F32), input_precision=PREC)
    if QK:
        b_s0 += tl.dot(b_qd, tl.trans(_dot_in(b_k0, k, F32)), input_precision=PREC)
    if QK and NH > 1:
        b_s1 += tl.dot(b_qd, tl.trans(_dot_in(b_k1, k, F32)), input_precision=PREC)
    if QK and NH > 2:
        b_s2 += tl.dot(b_qd, tl.trans(_dot_in(b_k2, k, F32)), input_precision=PREC)
    return b_qq, b_o, b_s0, b_s1, b_s2


@triton.jit
def _output_kernel(
    q,
    k,
    D,
    Aqk,
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
):
    """One program per (value tile, global chunk, value head): o = scale (e^G q S_c + (q K^T * decay * mask) D).
    The key dimension runs in blocks of BK (a loop, so that the next block's q, K and S_c rows load during this
    block's products): q S_c and each n_h block's q K^T (at most three) accumulate over them. AQK: q K^T * decay
    * mask comes from `_kkt_kernel` (Aqk, formed once a chunk, not once a value tile); the loop forms only q S_c."""
    i_v, gc, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, c, bos, Tn = _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN)
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
    h_base = bnd + ((gc + i_n).to(tl.int64) * HV + i_h) * K * V + o_v[None, :]
    b_qq = tl.zeros([64], dtype=tl.float32)
    b_o = tl.zeros([64, BV], dtype=tl.float32)
    b_s0 = tl.zeros([64, 64], dtype=tl.float32)
    b_s1 = tl.zeros([64, 64], dtype=tl.float32)
    b_s2 = tl.zeros([64, 64], dtype=tl.float32)
    if PREFETCH:  # the next key block's tiles load while this block's products run (a pipeline by hand)
        b_q, b_h, b_k0, b_k1, b_k2 = _out_key_block(
            q_base, h_base, k_base, s0, 0, m_t, m_v, Tn, HK, NH, K, V, BK, not AQK
        )
        for kb in range(tl.cdiv(K, BK)):
            n_q, n_h, n_k0, n_k1, n_k2 = _out_key_block(
                q_base, h_base, k_base, s0, kb + 1, m_t, m_v, Tn, HK, NH, K, V, BK, not AQK
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
            b_qd = _dot_in(b_q, k, F32)
            b_h = tl.load(h_base + o_k[:, None] * V, mask=m_k[:, None] & m_v[None, :], other=0.0)
            b_o += tl.dot(b_qd, _dot_in(b_h, k, F32), input_precision=PREC)
            p_k = k_base + s0[:, None] * (HK * K) + o_k[None, :]
            if not AQK:
                b_k = tl.load(p_k, mask=(s0 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
                b_s0 += tl.dot(b_qd, tl.trans(_dot_in(b_k, k, F32)), input_precision=PREC)
            if NH > 1 and not AQK:
                b_k = tl.load(p_k + 64 * (HK * K), mask=(s0 + 64 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
                b_s1 += tl.dot(b_qd, tl.trans(_dot_in(b_k, k, F32)), input_precision=PREC)
            if NH > 2 and not AQK:
                b_k = tl.load(p_k + 128 * (HK * K), mask=(s0 + 128 < Tn * NH)[:, None] & m_k[None, :], other=0.0)
                b_s2 += tl.dot(b_qd, tl.trans(_dot_in(b_k, k, F32)), input_precision=PREC)
    if NORM:
        b_rq = 1.0 / tl.sqrt(b_qq + 1e-6)
    else:
        b_rq = tl.full([64], 1.0, dtype=tl.float32)
    b_Gq = tl.load(gcum + aux + o_r * NH + NH - 1)
    b_o = b_o * (b_rq * tl.exp(b_Gq))[:, None]
    for a in tl.static_range(NH):
        rows = aux + a * 64 + o_r
        if AQK:  # scaled and masked already (`_kkt_kernel`)
            b_s = tl.load(Aqk + (aux // NH + o_r)[:, None] * L + a * 64 + o_r[None, :])
        else:
            if a == 0:
                b_s = b_s0
            elif a == 1:
                b_s = b_s1
            else:
                b_s = b_s2
            b_G = tl.load(gcum + rows)
            b_rs = tl.load(rstd + rows)
            tok = (a * 64 + o_r) // NH
            m_a = tok[None, :] <= o_r[:, None]
            b_dec = tl.exp(tl.where(m_a, b_Gq[:, None] - b_G[None, :], 0.0))
            b_s = tl.where(m_a, b_s * b_rq[:, None] * b_rs[None, :] * b_dec, 0.0)
        b_d = tl.load(D + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_o += tl.dot(_dot_in(b_s, k, F32), _dot_in(b_d, k, F32), input_precision=PREC)
    p_o = o + (bos + t)[:, None] * (HV * V) + i_h * V + o_v[None, :]
    tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    """Launch choices; None fields pick the default for the shape (see `default_config`).

    Defaults from `python -m benchmarks.fwd_tune` on an H100 (B=8, T=8192): wu_warps 4 beat 8 at every point (4.33 vs
    4.54 ms at n_h=3); 4 tri or 8 state warps, or 64-wide output tiles, were slower.
    """

    state_bv: int | None = None  # value tile of the sequential kernel
    tri_warps: int = 2
    wu_warps: int = 4
    wu_bv: int = 128  # value tile of the WY kernel (U = T Y tile by tile)
    state_warps: int = 4
    state_stages: int = 2
    out_warps: int = 4
    out_bv: int = 128
    out_bk: int = 64  # key block of the output kernel's loop (the whole of dk at once: 1.7x fla's time at dk 256)
    # pipeline stages of the output kernel's key-block loop. Pipelined, that loop miscompiles (Triton 3.9, H200,
    # scripts/lean_check.py): at n_h = 1 with bf16 boundary states, 2 or 3 stages gave o off by 50-90% (fp32
    # states too at 2 stages, dk/dv = 256/512); 1 stage, or one key block, is bit-identical across both dtypes
    out_stages: int = 1
    # the output kernel loads the next key block's tiles before this block's products (a pipeline by hand, in
    # registers, not the compiler's); default_config turns it on where dk spans several key blocks
    out_prefetch: bool = False
    # the kkt kernel (the WY kernel without tri_split) forms the intra-chunk attention q K^T * decay * mask once a chunk
    # (Aqk, in the inputs' dtype, as the output's product rounds it anyway) and the output kernel reads it: q K^T is
    # not formed once a value tile, and the key-block loop holds only q S_c (no [64, 64] accumulator a WY block)
    out_aqk: bool = False
    # the sequential kernel forms W S as T (diag(c) (K S)) from the keys it loads for the state update and the
    # block's 64 x 64 T, instead of reading W (64 x dk a block; the WY kernel then writes no W): fewer bytes a step
    # (dk 256: 32 + 8 KB against 64 KB), one more 64-deep product in the step's chain; default_config's choice
    state_keys_ws: bool = False
    # the sequential kernel forms U = T diag(beta) V from v itself instead of reading U, so the WY kernel writes no U
    # (dv x 2 bytes a sub-step written and read back); with state_keys_ws, D = T (diag(beta) V - diag(c) (K S)) is
    # one product with T, as many as before, and the WY kernel is not launched (the kkt kernel writes the row scales)
    state_from_v: bool = False
    tri_programs_per_sm: int = 8
    fuse_output: bool | None = None  # the state kernel writes o (no output kernel); None: default_config's
    # programs of the sequential kernel that share an SM's shared memory when its pipeline stages are sized; None:
    # all of them, ceil(programs / SMs), which gives packed batches of many short documents one stage (experiment)
    resident_per_sm: int | None = None
    # T = (I + A)^-1 by two kernels, as fla splits it: `_kkt_kernel` (A, fp32, one program per block and value head,
    # key blocks of kkt_bk) then `_tri_inverse_kernel` (16 x 16 diagonal inverses merged by block products), instead
    # of the persistent `_tri_kernel`; every n_h. H100 (scripts/tri_split_ab.py, inverse at 1 warp): GDN default
    # 1x32768 kkt 0.060 + inverse 0.024 ms against _tri_kernel's 0.178, Qwen3-Next 0.202 + 0.118 against 0.709
    tri_split: bool = True
    kkt_warps: int = 4
    kkt_bk: int = 64
    kkt_stages: int = 2
    inv_warps: int = 1  # the inverse's 16 x 16 tiles in one warp: no cross-warp reductions (2 warps: 0.095 / 0.505 ms
    # at the shapes above, 4 warps 0.18 / 0.99); fp32 inputs take 2 (ptxas sm_90: 824 bytes of spills at 1)


MAX_K, MAX_V = 256, 512  # head dims the Triton path takes (dispatch falls back beyond)
MAX_NH = 3  # Householder steps a token: the output kernel keeps one q K^T accumulator per step


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@functools.cache
def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def default_config(B: int, H: int, V: int, n_h: int = 1, K: int = 128) -> LaunchConfig:
    """Value tiles of the sequential kernel: 32, or 64 for dk <= 128 and n_h <= 2 once sequences * value
    heads give about a program per SM (W and K are re-read per tile). The output kernel stays separate: fusing
    it into the sequential kernel measured 0.9-1.1x at the real-model shapes on an H100 (kernels/NOTES.md).
    Never 16 with dk = 128 (nor 32 with dk = 256 unsplit): on an H100 (Triton 3.6) the compiled state kernel
    with 16-wide tiles faulted (n_h = 3) or returned wrong states (n_h = 1) at B = 8, T >= 1024, while the
    interpreter and T = 300 agreed with the reference; see tests/kernels/test_triton_chunk.py.
    B counts sequences (of a packed batch too), H value heads.
    """
    n_sm = _num_sms()
    bv = 32
    if K <= 128 and B * H * triton.cdiv(V, 64) >= (0.9 if n_h <= 2 else 2.0) * n_sm:
        bv = 64
    # Pipeline stages of the sequential kernel sized for one program a SM: three while the programs number at most
    # 8 a SM, else two. H200, o + final: GDN default (dk, dv = 256, 512) 1x32768 1.885 -> 1.816 ms, 8x4096 1.793 ->
    # 1.582, packed (3,072 short programs, two stages) 2.492 -> 2.244; Qwen3-Next (16/32 heads of 128) 1x32768 2.511
    # -> 2.238, 8x4096 2.189 -> 2.050, packed 2.264 -> 2.135 (benchmarks.kernels --sweep, sixth session)
    # dk <= 128 with n_h > 1 keeps stages sized for all programs and the 64-wide output key loop: at B=1 T=2048 H=8
    # n_h=3 this rule measured 0.890 / 0.572 ms (gate off / on) against 0.439 / 0.211 (scripts/grid_ab.py, H200;
    # B=8 T=8192 3.408 vs 3.350), while at n_h = 1 it measured 0.193 / 0.463 against 0.387 / 0.440
    # q K^T from the kkt kernel (out_aqk) at dk > 128, where the output kernel would form it once per value tile and
    # n_h times a key-block loop: H100, o + final against forming it there (eleventh session, scripts/config_ab.py):
    # DeltaProduct n_h = 3 8x4096 1.10x, 1x32768 1.07x (output kernel 1.223 -> 0.676 ms, kkt 0.164 -> 0.345);
    # GDN default 1.02x / 1.01x. At dk = 128 the kkt kernel's cost about doubles and outweighs the output kernel's gain:
    # Qwen3-Next 0.92-0.93x (kkt 0.200 -> 0.435 ms); grid points H = 8, n_h = 2, 3 0.97-1.00x (scripts/grid_ab.py)
    aqk = K > 128
    if K <= 128 and n_h > 1:
        return LaunchConfig(state_bv=min(bv, _pow2(V)), fuse_output=False)
    programs = B * H * triton.cdiv(V, bv)
    stages = 3 if programs <= 8 * n_sm else 2
    # More programs than SMs: W S from the keys and T (state_keys_ws), at two stages. H100, o + final against the
    # W path (tenth session, scripts/config_ab.py): GDN default 8x4096 1.03x, packed 1.12x; Qwen3-Next 8x4096 1.06x,
    # packed 1.08x; DeltaProduct n_h = 2 / 3 8x4096 1.02x / 1.04x, packed 1.17x / 1.21x; at three stages 0.85-0.93x
    # where two won, and at B = 1 (one program a SM, the step's latency binds) 0.80-0.84x at either
    keys_ws = programs > n_sm
    if keys_ws:
        stages = 2
    # On the keys path U from v (state_from_v): D = T (diag(beta) V - diag(c) (K S)) in the sequential kernel, which
    # holds its time, and no WY kernel at all. H100, o + final against reading U (twelfth session,
    # scripts/config_ab.py): GDN default 8x4096 1.11x, Qwen3-Next 8x4096 1.15x, DeltaProduct n_h = 3 8x4096 1.13x.
    # At B = 1 (the W path) not: the keys path with it measured 0.90-0.91x at 1x32768, and the W path with it
    # miscompiles at 32-wide value tiles and two or more stages (scripts/fromv_check.py), so such tiles run there at
    # one stage (`_Phases.state`)
    # dk <= 128: the output kernel takes dk in one key block (no loop: Qwen3-Next 2.511 -> 2.452 ms at 1x32768);
    # more key blocks load one ahead at n_h = 1 (out_prefetch: GDN default 1x32768 output kernel 0.669 -> 0.561 ms,
    # H100; at n_h = 3, with three q K^T accumulators live, 1.225 -> 3.174 ms at 8x4096, so not there)
    out_bk = _pow2(K) if K <= 128 else LaunchConfig.out_bk
    return LaunchConfig(
        state_bv=min(bv, _pow2(V)), fuse_output=False, resident_per_sm=1, state_stages=stages, out_bk=out_bk,
        state_keys_ws=keys_ws, state_from_v=keys_ws, out_prefetch=K > out_bk and n_h == 1, out_aqk=aqk,
    )


def unsupported_reason(q: torch.Tensor, v: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> str | None:
    """Why the Triton path would not take these (valid) inputs, or None when it does."""
    K, V, n_h = q.shape[-1], v.shape[-1], v.shape[2] if v.dim() == 5 else 1
    if n_h > MAX_NH:
        return f"n_h={n_h} (the Triton forward takes n_h <= {MAX_NH})"
    if chunk_size != CHUNK_SIZE:
        return f"chunk_size={chunk_size} (the Triton forward uses {CHUNK_SIZE})"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype} (bf16, fp16 or fp32)"
    if K > MAX_K or V > MAX_V:
        return f"dk={K}, dv={V} (the Triton forward takes dk <= {MAX_K}, dv <= {MAX_V})"
    if not (q.is_cuda or _interpreting()):
        return "tensors not on CUDA"
    return None


def _check(q, k, v, beta, g, initial_state, chunk_size, cu_seqlens) -> int:
    """The shared contract (kernels.naive.check_inputs), then what this path takes; returns N sequences."""
    N = check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)[0]
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"the Triton forward uses chunk_size={CHUNK_SIZE}; use chunk_delta_product for {chunk_size}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} unsupported: pass bf16, fp16 or fp32 (chunk_delta_product for fp64)")
    why = unsupported_reason(q, v, chunk_size)
    if why is not None:
        raise ValueError(f"the Triton forward does not take {why}; use chunk_delta_product")
    return N


_VARLEN_CACHE: list[tuple[torch.Tensor, int, torch.device, tuple]] = []  # most recent first
_VARLEN_CACHE_SIZE = 8


def _varlen_tables(cu_seqlens: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(cu int32, sequence of each global chunk, first global chunk of each sequence [N+1], sequences
    longest first, total chunks). Building them syncs with the GPU (the grids need the chunk count), so the
    tables of the last few cu_seqlens tensors are kept, keyed by the tensor itself (held, so its identity
    cannot pass to another) and its in-place version: every layer of a packed forward reuses them."""
    for i, (t, version, d, tables) in enumerate(_VARLEN_CACHE):
        if t is cu_seqlens and version == cu_seqlens._version and d == dev:
            _VARLEN_CACHE.insert(0, _VARLEN_CACHE.pop(i))
            return tables
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    n_chunks = (cu.diff() + CHUNK_SIZE - 1) // CHUNK_SIZE
    coff = torch.nn.functional.pad(n_chunks.cumsum(0), (1, 0)).to(torch.int32)
    nct = int(coff[-1])  # one host sync: the grids need it
    seq = torch.arange(n_chunks.numel(), device=dev, dtype=torch.int32)
    cidx = seq.repeat_interleave(n_chunks, output_size=nct)
    order = torch.argsort(n_chunks, descending=True, stable=True).to(torch.int32)
    tables = (cu, cidx, coff, order, nct)
    _VARLEN_CACHE.insert(0, (cu_seqlens, cu_seqlens._version, dev, tables))
    del _VARLEN_CACHE[_VARLEN_CACHE_SIZE:]
    return tables


def triton_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    normalize_qk: bool = False,
    output_final_state: bool = True,
    output_boundary_states: bool = True,
    config: LaunchConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Return (o [B,T,Hv,V] in q's dtype, final states [N,Hv,K,V] fp32, boundary states [B,NB,Hv,K,V] fp32).

    Forward only; shapes and the packed (cu_seqlens) boundary layout as `kernels.naive`. Without cu_seqlens
    NB = ceil(T/64) + 1: boundary c is the state before token 64c, the last is the final state. q and k
    keep their Hk heads (value head j reads key head j // (Hv/Hk) in the kernels). bf16/fp16 inputs run the
    matrix products in half precision with fp32 accumulation.
    """
    N = _check(q, k, v, beta, g, initial_state, chunk_size, cu_seqlens)
    B, T, HK, K = q.shape
    n_h, HV, V = k.shape[2], v.shape[3], v.shape[-1]
    dtype = q.dtype
    q, k, v = q.contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()
    beta = beta.contiguous()
    g = g.contiguous() if g is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    varlen = cu_seqlens is not None
    if varlen:
        cu, cidx, coff, order, NCT = _varlen_tables(cu_seqlens, dev)
    else:
        cu = cidx = coff = order = None
        NCT = B * triton.cdiv(T, CHUNK_SIZE)
    NBND = NCT + N  # boundary rows: each sequence's chunk starts and its final state
    interp = _interpreting()
    F32 = interp or dtype == torch.float32  # fp32 operands in tl.dot (the interpreter's bf16 dot is wrong)
    PREC = "ieee" if dtype == torch.float32 else "tf32"
    d = default_config(N, HV, V, n_h, K)
    given = config or d
    cfg = replace(
        given,
        state_bv=given.state_bv or d.state_bv,
        fuse_output=d.fuse_output if given.fuse_output is None else given.fuse_output,
    )
    if cfg.state_bv < 32 and V > 16 and not interp:
        raise ValueError(f"state_bv={cfg.state_bv} miscompiles on CUDA (see default_config); use 32, 64 or 128")
    fuse = bool(cfg.fuse_output)
    store_bnd = output_boundary_states or not fuse  # the output kernel reads them
    # states nobody returns are kept in the inputs' half dtype: the output kernel rounds them to it for its product
    # anyway, so o is bit-identical and their traffic halves (fp32 states dominate it at dk, dv = 256, 512)
    bnd_dtype = torch.float32 if output_boundary_states or F32 else dtype
    bnd = torch.empty(NBND if store_bnd else 0, HV, K, V, dtype=bnd_dtype, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    o = torch.empty(B, T, HV, V, dtype=dtype, device=dev)
    fixed = dict(cfg=cfg, scale=scale, normalize_qk=normalize_qk, F32=F32, PREC=PREC, interp=interp)
    run = _Phases(q, k, v, beta, g, h0, o, ht, bnd, (T, cu, cidx, coff, order, NCT, N), **fixed)
    run.prep()
    run.state()
    run.output()
    bnd_out = bnd.view(1 if varlen else B, -1, HV, K, V) if output_boundary_states else None
    return o, ht, bnd_out


class _Phases:
    """The forward's kernels for one batch in three phases: prep (A, T = (I + A)^-1,
    the WY factors and the intra-chunk attention), the sequential state kernel, and the output kernel. Allocates the
    intermediates; writes o, ht and bnd, which the caller gives."""

    def __init__(self, q, k, v, beta, g, h0, o, ht, bnd, tables: tuple, *, cfg: LaunchConfig, scale: float,
                 normalize_qk: bool, F32: bool, PREC: str, interp: bool) -> None:
        T, cu, cidx, coff, order, NCT, N = tables
        HK, K = q.shape[2], q.shape[3]
        n_h, HV, V = k.shape[2], v.shape[3], v.shape[-1]
        self.q, self.k, self.v, self.beta, self.g, self.h0, self.o, self.ht, self.bnd = q, k, v, beta, g, h0, o, ht, bnd
        self.cfg, self.scale, self.norm, self.interp, self.PREC = cfg, scale, normalize_qk, interp, PREC
        self.N, self.NCT, self.V, self.K, self.HV, self.n_h = N, NCT, V, K, HV, n_h
        self.order = order
        self.common = dict(HK=HK, HV=HV, NH=n_h, K=K, IS_VARLEN=cu is not None, F32=F32, PREC=PREC)
        self.seq_args = (T, cu, cidx, coff, NCT)
        self.BK, self.BVF = _pow2(K), _pow2(V)
        self.BV = min(cfg.state_bv, self.BVF)
        self.fuse = bool(cfg.fuse_output)
        self.keys_ws = bool(cfg.state_keys_ws)
        self.from_v = bool(cfg.state_from_v)
        # the keys path with U from v needs of the WY kernel only Gamma and the row scales: the kkt kernel writes them
        self.scales_in_kkt = self.keys_ws and self.from_v and cfg.tri_split
        self.aqk = self.fuse or bool(cfg.out_aqk)  # the intra-chunk attention from the kkt (else the WY) kernel
        dtype, dev, f32 = q.dtype, q.device, torch.float32
        rows = NCT * n_h * BLOCK  # sub-step rows per value head
        self.Ti = torch.empty(HV, rows, BLOCK, dtype=dtype, device=dev)
        self.rstd = torch.empty(HV, rows, dtype=f32, device=dev)
        self.W = torch.empty(HV, 0 if self.keys_ws else rows, K, dtype=dtype, device=dev)  # keys_ws: no W
        self.wsc = torch.empty(HV, rows if self.keys_ws else 0, dtype=f32, device=dev)
        self.U = torch.empty(HV, 0 if self.from_v else rows, V, dtype=dtype, device=dev)
        self.D = None if self.fuse else torch.empty(HV, rows, V, dtype=dtype, device=dev)
        self.Aqk = torch.empty(HV, NCT * BLOCK, n_h * BLOCK, dtype=dtype, device=dev) if self.aqk else None
        self.gcum = torch.empty(HV, rows, dtype=f32, device=dev)

    def prep(self) -> None:
        """Key norms, T = (I + A)^-1 per 64-row block, W (or the row scales), U (unless from v), Gamma, Aqk."""
        cfg, common, NCT = self.cfg, self.common, self.NCT
        if NCT == 0:
            return
        q, k, v, beta, g = self.q, self.k, self.v, self.beta, self.g
        n_jobs = self.HV * NCT * self.n_h
        if cfg.tri_split:  # A (fp32: T is as exact as the one-kernel path's), then its inverse
            A = torch.empty(self.HV, NCT * self.n_h * BLOCK, BLOCK, dtype=torch.float32, device=q.device)
            _kkt_kernel[(n_jobs,)](
                q, k, beta, g, A, self.Aqk, self.rstd, self.gcum, self.wsc, *self.seq_args,
                BK=self.BK, BKC=min(_pow2(cfg.kkt_bk), self.BK), USE_G=g is not None, NORM=self.norm,
                STORE_AQK=self.aqk, STORE_SCALES=self.scales_in_kkt, num_warps=cfg.kkt_warps,
                num_stages=cfg.kkt_stages, **common,
            )  # fmt: skip
            launch_inverse(A, self.Ti, n_jobs, cfg.inv_warps, self.PREC)
        else:
            n_prog = min(n_jobs, 3 if self.interp else _num_sms() * cfg.tri_programs_per_sm)
            scratch = torch.empty(n_prog, BLOCK, BLOCK, dtype=torch.float32, device=q.device)
            _tri_kernel[(n_prog,)](
                k, beta, g, self.Ti, self.rstd, scratch, *self.seq_args, n_jobs,
                BK=self.BK, USE_G=g is not None, NORM=self.norm, num_warps=cfg.tri_warps, **common,
            )  # fmt: skip
        if not self.scales_in_kkt:
            _wu_kernel[(NCT, self.HV)](
                q, k, v, beta, g, self.Ti, self.W, self.U, self.Aqk, self.gcum, self.rstd, self.wsc, *self.seq_args,
                V=self.V, BK=self.BK, BV=min(cfg.wu_bv, self.BVF), USE_G=g is not None, NORM=self.norm,
                STORE_AQK=self.aqk and not cfg.tri_split, KEYS_WS=self.keys_ws, STORE_U=not self.from_v,
                num_warps=cfg.wu_warps, **common,
            )  # fmt: skip

    def state(self) -> None:
        """The sequential kernel: boundary states, D, the final state (and o when fused)."""
        BK, BV = self.BK, self.BV
        BKH = BK // 2 if BK > 128 else BK
        consts = dict(
            V=self.V, BKH=BKH, SPLIT=BKH < BK, BV=BV, HAS_H0=self.h0 is not None, STORE_FINAL=self.ht is not None,
            STORE_BND=self.bnd.shape[0] > 0, FUSE_O=self.fuse, NORM=self.norm, KEYS_WS=self.keys_ws,
            FROM_V=self.from_v, **self.common,
        )  # fmt: skip
        # one block's W (or T), K and U tiles per pipeline stage (and q and A when fused)
        t_tile = 64 if self.keys_ws or self.from_v else 0  # T's 64 x 64
        w_tile = 0 if self.keys_ws else BK
        smem = 64 * (w_tile + t_tile + BK + BV + (BK + 64 if self.fuse else 0)) * self.q.element_size()
        T, cu, _, coff, NCT = self.seq_args
        args = (self.q, self.k, self.v, self.beta, self.W, self.U, self.D, self.Aqk, self.gcum, self.rstd, self.Ti,
                self.wsc, self.bnd, self.ht, self.h0, self.o, T, cu, coff, self.order, NCT, self.scale)  # fmt: skip
        # U from v on the W path: wrong (or NaN) o and states at BV 32 and 2-3 stages on an H100, right at one stage
        # and at BV 64 at any (scripts/fromv_check.py, twelfth session; the interpreter agrees at all), so one there
        one_stage = self.from_v and not self.keys_ws and BV < 64
        cfg = replace(self.cfg, state_stages=1) if one_stage else self.cfg
        _launch(_state_kernel, (triton.cdiv(self.V, BV), self.N * self.HV), cfg, args, consts, smem)

    def output(self) -> None:
        """o = scale (e^G q S_c + A D) per chunk (nothing when the state kernel wrote o)."""
        if self.NCT == 0 or self.fuse:
            return
        cfg = self.cfg
        obv = min(cfg.out_bv, self.BVF)
        _output_kernel[(triton.cdiv(self.V, obv), self.NCT, self.HV)](
            self.q, self.k, self.D, self.Aqk, self.gcum, self.rstd, self.bnd, self.o, *self.seq_args, self.scale,
            V=self.V, BK=min(_pow2(cfg.out_bk), self.BK), BV=obv, NORM=self.norm, num_warps=cfg.out_warps,
            num_stages=cfg.out_stages, PREFETCH=cfg.out_prefetch, AQK=self.aqk, **self.common,
        )  # fmt: skip


SMEM_PER_SM = 225 * 1024  # shared memory a sequential kernel's resident programs may take (H100/H200: 227 KiB)


def _launch(kernel, grid, cfg: LaunchConfig, args: tuple, consts: dict, smem_per_stage: int) -> None:
    """Launch a sequential kernel so that all its programs are resident at once (one wave): as many
    pipeline stages as the shared memory of ceil(programs / SMs) programs per SM allows, at least one."""
    per_sm = -(-grid[0] * grid[1] // _num_sms())
    resident = getattr(cfg, "resident_per_sm", None)  # (KdaConfig has none)
    if resident is not None:
        per_sm = min(per_sm, resident)
    stages = max(1, min(cfg.state_stages, SMEM_PER_SM // max(per_sm * smem_per_stage, 1)))
    try:
        kernel[grid](*args, num_warps=cfg.state_warps, num_stages=stages, **consts)
    except OutOfResources:
        if stages == 1:
            raise
        kernel[grid](*args, num_warps=cfg.state_warps, num_stages=1, **consts)
