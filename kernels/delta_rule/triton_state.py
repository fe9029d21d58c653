"""The delta-rule forward's sequential kernel (`triton_chunk`): over each sequence's chunks and their 64-sub-step
blocks, the pseudo-values D = U - W S and the states S, in fp32, one program per sequence, value head and value
tile."""

from __future__ import annotations

import triton
import triton.language as tl

from deltalab.kernels.triton_utils import _dot_in, _load_t


@triton.jit
def _store(p, x, mask, EVICT: tl.constexpr):
    """x at p in p's dtype; EVICT: first out of L2 (read back only after this kernel, by another)."""
    if EVICT:
        tl.store(p, x.to(p.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    else:
        tl.store(p, x.to(p.dtype.element_ty), mask=mask)


@triton.jit
def _store_state(base, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT: tl.constexpr, EVICT: tl.constexpr = False):
    """A state's tile (its key halves with SPLIT) at `base`; EVICT: first out of L2 (read back only much later)."""
    _store(base + p_h1, b_h1, m_h1, EVICT)
    if SPLIT:
        _store(base + p_h2, b_h2, m_h2, EVICT)


@triton.jit
def _store_state_tma(desc, row, col, b_h1, b_h2, BKH: tl.constexpr, SPLIT: tl.constexpr):
    """A state's tile (its key halves with SPLIT) through a tensor descriptor over [states * heads * dk, dv] rows
    (TMA on Hopper): no [key rows, value tile] pointer or mask tensors held in registers across the loop (ptxas
    sm_90, Triton 3.6, dk 256, 32-wide value tiles, aligned pointers: 220 registers with pointers, 191 with this)."""
    desc.store([row, col], b_h1.to(desc.dtype))
    if SPLIT:
        desc.store([row + BKH, col], b_h2.to(desc.dtype))


@triton.jit
def _block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV: tl.constexpr, V: tl.constexpr):
    """diag(beta) V of one 64-row block (rows s), fp32: what U = T diag(beta) V multiplies."""
    b_v = tl.load(v_base + s[:, None] * (HV * V) + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0)
    return b_v.to(tl.float32) * tl.load(beta_base + s * HV, mask=m_s, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _block_u(U, Ti, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, ref, HV: tl.constexpr, V: tl.constexpr,
             F32: tl.constexpr, PREC: tl.constexpr, FROM_V: tl.constexpr, T_FULL: tl.constexpr):
    """U of one 64-row block: read (`_wu_kernel` wrote it, in its dtype), or with FROM_V formed here (fp32) as
    T (diag(beta) V)."""
    if FROM_V:
        b_bv = _dot_in(_block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV, V), ref, F32)
        b_t = _load_t(Ti, rows, o_r, T_FULL)
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
                  FROM_V: tl.constexpr, T_FULL: tl.constexpr):
    """U - W S for one 64-row block as U - T (diag(c) (K S)), W = T diag(c) K (`_wu_kernel`): from the block's
    keys, which the state update loads anyway, and its 64 x 64 T, instead of W's 64 x dk rows. FROM_V: as
    T (diag(beta) V - diag(c) (K S)), one product with T and no U read (`_wu_kernel` writes none)."""
    if FROM_V:
        b_ks = _keys_times_state(b_k1, b_k2, b_h1, b_h2, ref, SPLIT, F32, PREC)
        b_x = _block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV, V) - b_ks * tl.load(wsc + rows)[:, None]
        b_t = _load_t(Ti, rows, o_r, T_FULL)
        return tl.dot(_dot_in(b_t, ref, F32), _dot_in(b_x, ref, F32), input_precision=PREC)
    else:  # (the measured order of loads and products)
        b_u = tl.load(U + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_ks = _keys_times_state(b_k1, b_k2, b_h1, b_h2, ref, SPLIT, F32, PREC)
        b_x = _dot_in(b_ks * tl.load(wsc + rows)[:, None], ref, F32)
        b_t = _load_t(Ti, rows, o_r, T_FULL)
        return b_u.to(tl.float32) - tl.dot(_dot_in(b_t, ref, F32), b_x, input_precision=PREC)


@triton.jit
def _block_decays(gcum, aux0, blk, b_G1p, NH: tl.constexpr, G0_AHEAD: tl.constexpr = False,
                  USE_G: tl.constexpr = True):
    """(G, G'): the chunk's log decay before block `blk` (0 at a chunk's first block) and at its end. G0_AHEAD: G is
    the previous block's G' (b_G1p, the same row of gcum) instead of a load: Triton left that masked scalar load
    synchronous in the loop (aligned TTGIR, n_h = 3), a memory latency in every block's chain, while it pipelines
    the load of G'. Without gates both are b_G1p, which stays 0 (nothing read)."""
    if not USE_G:
        return b_G1p, b_G1p
    if NH == 1:
        b_G0 = 0.0
    elif G0_AHEAD:
        b_G0 = tl.where(blk % NH > 0, b_G1p, 0.0)
    else:
        b_G0 = tl.load(gcum + aux0 + blk * 64 - 1, mask=blk % NH > 0, other=0.0)
    return b_G0, tl.load(gcum + aux0 + blk * 64 + 63)


@triton.jit
def _row_scales(gcum, rstd, rows, b_G1, USE_G: tl.constexpr):
    """A block's row scales of D before K^T D: the key norm times e^{G' - G_s}; without gates the key norm alone (no
    gcum read, no exp in the step's chain)."""
    if USE_G:
        return tl.load(rstd + rows) * tl.exp(b_G1 - tl.load(gcum + rows))
    else:
        return tl.load(rstd + rows)


@triton.jit
def _decayed(b_h, b_G0, b_G1, USE_G: tl.constexpr):
    """e^{G' - G} S (S itself without gates)."""
    if USE_G:
        return b_h * tl.exp(b_G1 - b_G0)
    else:
        return b_h


@triton.jit
def _update_state(b_h1, b_h2, b_k1, b_k2, b_ds, b_G0, b_G1, ref, SPLIT: tl.constexpr, F32: tl.constexpr,
                  PREC: tl.constexpr, USE_G: tl.constexpr):
    """S' = e^{G' - G} S + K^T (scaled D), the state in its key halves with SPLIT."""
    b_h1 = _decayed(b_h1, b_G0, b_G1, USE_G) + tl.dot(tl.trans(_dot_in(b_k1, ref, F32)), b_ds, input_precision=PREC)
    if SPLIT:
        b_h2 = _decayed(b_h2, b_G0, b_G1, USE_G) + tl.dot(tl.trans(_dot_in(b_k2, ref, F32)), b_ds,
                                                          input_precision=PREC)
    return b_h1, b_h2


@triton.jit
def _state_block(
    k, k_base, W, U, D, gcum, rstd, Ti, wsc, v_base, beta_base, aux0, Tn, o_r, o_k1, o_k2, m_k1, m_k2, o_v, m_v,
    b_h1, b_h2, blk, b_G1p, HK: tl.constexpr, HV: tl.constexpr, NH: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, STORE_D: tl.constexpr, KEYS_WS: tl.constexpr,
    FROM_V: tl.constexpr, EVICT: tl.constexpr = False, T_FULL: tl.constexpr = False, G0_AHEAD: tl.constexpr = False,
    USE_G: tl.constexpr = True,
):
    """One 64-row block `blk` of a sequence (block blk % NH of chunk blk // NH): D = U - W S and
    S' = e^{G'} S + sum_s e^{G' - G_s} k_s d_s^T (G' the log decay to the block's end, from the chunk's start;
    `gcum` restarts each chunk, so the block's own decay is G' - G at the previous block's end). Returns S' and D
    (also stored with STORE_D, as soon as it is known: fewer registers live across the state update).
    KEYS_WS: W S from the keys and T (`_u_minus_tcks`), W unread. FROM_V: U formed from v and beta, U unread."""
    rows = aux0 + blk * 64 + o_r
    s = blk * 64 + o_r
    m_s = s < Tn * NH
    b_G0, b_G1 = _block_decays(gcum, aux0, blk, b_G1p, NH, G0_AHEAD, USE_G)
    if KEYS_WS:  # the keys first: W S needs them
        b_k1, b_k2 = _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK, K, SPLIT)
        b_d = _u_minus_tcks(U, Ti, wsc, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, b_k1, b_k2, b_h1, b_h2, k,
                            HV, V, SPLIT, F32, PREC, FROM_V, T_FULL)
    else:
        b_u = _block_u(U, Ti, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, k, HV, V, F32, PREC, FROM_V, T_FULL)
        b_d = _u_minus_ws(b_u, W, rows, o_k1, o_k2, m_k1, m_k2, b_h1, b_h2, k, K, SPLIT, F32, PREC)
    if STORE_D:  # (EVICT: read back by the output kernel only; L2 keeps the keys the next steps read)
        _store(D + rows[:, None] * V + o_v[None, :], b_d, m_v[None, :], EVICT)
    b_ds = _dot_in(b_d * _row_scales(gcum, rstd, rows, b_G1, USE_G)[:, None], k, F32)
    if not KEYS_WS:
        b_k1, b_k2 = _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK, K, SPLIT)
    b_h1, b_h2 = _update_state(b_h1, b_h2, b_k1, b_k2, b_ds, b_G0, b_G1, k, SPLIT, F32, PREC, USE_G)
    return b_h1, b_h2, b_d, b_G1


@triton.jit
def _state_t_times_keys(b_k1, b_k2, b_h1, b_h2, ref, SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr):
    """(K S)^T = S^T K^T for one 64-row block, fp32, [value tile, 64]: the state held transposed is the product's
    left operand, which stays in registers (no store of S to shared memory for it)."""
    b_y = tl.dot(_dot_in(b_h1, ref, F32), tl.trans(_dot_in(b_k1, ref, F32)), input_precision=PREC)
    if SPLIT:
        b_y += tl.dot(_dot_in(b_h2, ref, F32), tl.trans(_dot_in(b_k2, ref, F32)), input_precision=PREC)
    return b_y


@triton.jit
def _block_bv_t(v_base, beta_base, s, m_s, o_v, m_v, HV: tl.constexpr, V: tl.constexpr):
    """(diag(beta) V)^T of one 64-row block, fp32, [value tile, 64]."""
    b_v = tl.load(v_base + s[None, :] * (HV * V) + o_v[:, None], mask=m_s[None, :] & m_v[:, None], other=0.0)
    return b_v.to(tl.float32) * tl.load(beta_base + s * HV, mask=m_s, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _times_t_t(b_x, Ti, rows, o_r, ref, F32: tl.constexpr, PREC: tl.constexpr, T_FULL: tl.constexpr):
    """X^T T^T for one block's 64 x 64 lower-triangular T, fp32: (T X)^T with X^T in registers."""
    b_t = _load_t(Ti, rows, o_r, T_FULL)
    return tl.dot(_dot_in(b_x, ref, F32), tl.trans(_dot_in(b_t, ref, F32)), input_precision=PREC)


@triton.jit
def _state_block_t(
    k, k_base, W, U, D, gcum, rstd, Ti, wsc, v_base, beta_base, aux0, Tn, o_r, o_k1, o_k2, m_k1, m_k2, o_v, m_v,
    b_h1, b_h2, blk, b_G1p, HK: tl.constexpr, HV: tl.constexpr, NH: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, KEYS_WS: tl.constexpr, FROM_V: tl.constexpr,
    EVICT: tl.constexpr = False, T_FULL: tl.constexpr = False, G0_AHEAD: tl.constexpr = False,
    USE_G: tl.constexpr = True,
):
    """`_state_block` with the state held transposed, S^T [value tile, dk] (its key halves with SPLIT): every
    product of the step, S^T K^T (or S^T W^T), X^T T^T and (scaled D)^T K, takes its left operand from registers,
    so the chain stores nothing to shared memory but the loaded K, T (W) tiles. Returns S'^T and D^T (stored)."""
    rows = aux0 + blk * 64 + o_r
    s = blk * 64 + o_r
    m_s = s < Tn * NH
    b_G0, b_G1 = _block_decays(gcum, aux0, blk, b_G1p, NH, G0_AHEAD, USE_G)
    b_k1, b_k2 = _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK, K, SPLIT)
    if KEYS_WS:  # (W S)^T = (T diag(c) K S)^T
        b_y = _state_t_times_keys(b_k1, b_k2, b_h1, b_h2, k, SPLIT, F32, PREC) * tl.load(wsc + rows)[None, :]
        if FROM_V:
            b_d = _times_t_t(_block_bv_t(v_base, beta_base, s, m_s, o_v, m_v, HV, V) - b_y, Ti, rows, o_r, k, F32,
                             PREC, T_FULL)
        else:
            b_u = tl.load(U + rows[None, :] * V + o_v[:, None], mask=m_v[:, None], other=0.0)
            b_d = b_u.to(tl.float32) - _times_t_t(b_y, Ti, rows, o_r, k, F32, PREC, T_FULL)
    else:  # (W S)^T = S^T W^T from W's rows
        if FROM_V:
            b_u = _times_t_t(_block_bv_t(v_base, beta_base, s, m_s, o_v, m_v, HV, V), Ti, rows, o_r, k, F32, PREC,
                             T_FULL)
        else:
            b_u = tl.load(U + rows[None, :] * V + o_v[:, None], mask=m_v[:, None], other=0.0).to(tl.float32)
        b_w1 = tl.load(W + rows[:, None] * K + o_k1[None, :], mask=m_k1[None, :], other=0.0)
        b_w2 = b_w1
        if SPLIT:
            b_w2 = tl.load(W + rows[:, None] * K + o_k2[None, :], mask=m_k2[None, :], other=0.0)
        b_d = b_u - _state_t_times_keys(b_w1, b_w2, b_h1, b_h2, k, SPLIT, F32, PREC)
    _store(D + rows[None, :] * V + o_v[:, None], b_d, m_v[:, None], EVICT)
    b_ds = _dot_in(b_d * _row_scales(gcum, rstd, rows, b_G1, USE_G)[None, :], k, F32)
    b_h1 = _decayed(b_h1, b_G0, b_G1, USE_G) + tl.dot(b_ds, _dot_in(b_k1, k, F32), input_precision=PREC)
    if SPLIT:
        b_h2 = _decayed(b_h2, b_G0, b_G1, USE_G) + tl.dot(b_ds, _dot_in(b_k2, k, F32), input_precision=PREC)
    return b_h1, b_h2, b_d, b_G1


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
    EVICT: tl.constexpr = False,
    BND_EVERY: tl.constexpr = 1,
    bnd_desc=None,
    ht_desc=None,
    TMA: tl.constexpr = False,
    TRANS: tl.constexpr = False,
    T_FULL: tl.constexpr = False,
    G0_AHEAD: tl.constexpr = False,
    USE_G: tl.constexpr = True,
):
    """One program per (value tile, sequence * value head), looping over the sequence's 64-row blocks (n_h a
    chunk; `_state_block`, in one flat loop unless FUSE_O): store S_c (at chunk starts), D_a = U_a - W_a S_a and
    S_{a+1} = e^{G_a'} S_a + sum_{s in a} e^{G_a' - G_s} k_s D_s^T, G_a' the log-decay over block a.
    D is each sub-step's true pseudo-value, whatever the blocking. The state's key rows are held in two
    halves when dk > 128 (SPLIT): one [256, 32] tile miscompiled on an H100 (Triton 3.6), as [128, 16] did.
    FUSE_O: also o = scale (e^G q S_c + A D) for this value tile (A, Aqk, from the kkt or WY kernel), so that
    neither D nor the fp32 boundary states are read back by an output kernel. EVICT: the boundary states and D are
    stored evict-first (the output kernel reads them after this kernel ends; the keys of later steps stay in L2).
    BND_EVERY = 2: only even chunks' starting states are stored (the output kernel's PAIR reads no others; n_h = 1).
    TMA (not with FUSE_O): the unfused loop's states and the final state are stored through `bnd_desc` and `ht_desc`
    (dk a power of two; EVICT then applies to D only). TRANS (not with FUSE_O or TMA): the state held transposed,
    S^T [value tile, dk], in the unfused loop (`_state_block_t`); what is stored is the same."""
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
    if TRANS:  # tiles [value tile, key rows]
        m_h1 = m_k1[None, :] & m_v[:, None]
        m_h2 = m_k2[None, :] & m_v[:, None]
        p_h1 = o_k1[None, :] * V + o_v[:, None]
        p_h2 = o_k2[None, :] * V + o_v[:, None]
        b_h2 = tl.zeros([BV, BKH], dtype=tl.float32)
    else:
        m_h1 = m_k1[:, None] & m_v[None, :]
        m_h2 = m_k2[:, None] & m_v[None, :]
        p_h1 = o_k1[:, None] * V + o_v[None, :]
        p_h2 = o_k2[:, None] * V + o_v[None, :]
        b_h2 = tl.zeros([BKH, BV], dtype=tl.float32)
    k_base = k + bos * NH * (HK * K) + i_hk * K
    q_base = q + bos * (HK * K) + i_hk * K
    aux0 = (i_h.to(tl.int64) * NCT + gc0) * L
    bnd_base = bnd + ((gc0 + i_n).to(tl.int64) * HV + i_h) * K * V  # this sequence's first boundary
    if HAS_H0:
        h0_base = h0 + i_nh.to(tl.int64) * K * V
        b_h1 = tl.load(h0_base + p_h1, mask=m_h1, other=0.0).to(tl.float32)
        if SPLIT:
            b_h2 = tl.load(h0_base + p_h2, mask=m_h2, other=0.0).to(tl.float32)
    else:
        b_h1 = tl.zeros_like(b_h2)
    v_base = v + bos * NH * (HV * V) + i_h * V
    beta_base = beta + bos * NH * HV + i_h
    blocks = (k, k_base, W, U, D, gcum, rstd, Ti, wsc, v_base, beta_base, aux0, Tn, o_r, o_k1, o_k2, m_k1, m_k2, o_v,
              m_v)
    b_G1p = tl.zeros([], dtype=tl.float32)  # the previous block's G' (G0_AHEAD)
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
                b_h1, b_h2, b_d, b_G1p = _state_block(
                    *blocks, b_h1, b_h2, c * NH + a, b_G1p, HK=HK, HV=HV, NH=NH, K=K, V=V, SPLIT=SPLIT, F32=F32,
                    PREC=PREC, STORE_D=False, KEYS_WS=KEYS_WS, FROM_V=FROM_V, T_FULL=T_FULL,
                    G0_AHEAD=G0_AHEAD, USE_G=USE_G,
                )
                b_a = tl.load(Aqk + (aux // NH + o_r)[:, None] * L + a * 64 + o_r[None, :])
                b_o += tl.dot(_dot_in(b_a, k, F32), _dot_in(b_d, k, F32), input_precision=PREC)
            p_o = o + (bos + t)[:, None] * (HV * V) + i_h * V + o_v[None, :]
            tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    else:  # one flat loop over all blocks (n_h a chunk): one block's code in the loop body at any n_h
        for blk in range(NC * NH):
            if STORE_BND:
                if blk % (NH * BND_EVERY) == 0:  # every chunk's start, or (2) every other one's
                    if TMA:
                        _store_state_tma(bnd_desc, ((gc0 + i_n + blk // NH) * HV + i_h) * K, i_v * BV, b_h1, b_h2,
                                         BKH, SPLIT)
                    else:
                        _store_state(bnd_base + (blk // NH) * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2,
                                     SPLIT, EVICT)
            if TRANS:
                b_h1, b_h2, b_d, b_G1p = _state_block_t(
                    *blocks, b_h1, b_h2, blk, b_G1p, HK=HK, HV=HV, NH=NH, K=K, V=V, SPLIT=SPLIT, F32=F32, PREC=PREC,
                    KEYS_WS=KEYS_WS, FROM_V=FROM_V, EVICT=EVICT, T_FULL=T_FULL,
                    G0_AHEAD=G0_AHEAD, USE_G=USE_G,
                )
            else:
                b_h1, b_h2, b_d, b_G1p = _state_block(
                    *blocks, b_h1, b_h2, blk, b_G1p, HK=HK, HV=HV, NH=NH, K=K, V=V, SPLIT=SPLIT, F32=F32, PREC=PREC,
                    STORE_D=True, KEYS_WS=KEYS_WS, FROM_V=FROM_V, EVICT=EVICT, T_FULL=T_FULL,
                    G0_AHEAD=G0_AHEAD, USE_G=USE_G,
                )
    if TMA:  # (no pointer tensor live across the loop)
        if STORE_BND:
            _store_state_tma(bnd_desc, ((gc0 + i_n + NC) * HV + i_h) * K, i_v * BV, b_h1, b_h2, BKH, SPLIT)
        if STORE_FINAL:
            _store_state_tma(ht_desc, i_nh * K, i_v * BV, b_h1, b_h2, BKH, SPLIT)
    else:
        if STORE_BND:
            _store_state(bnd_base + NC * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
        if STORE_FINAL:
            _store_state(ht + i_nh.to(tl.int64) * K * V, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
