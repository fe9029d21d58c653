"""The delta-rule forward's sequential kernel (`triton_chunk`): over each sequence's chunks and their 64-sub-step
blocks, the pseudo-values D = U - W S and the states S, in fp32, one program per sequence, value head and value
tile. `store_state` and `u_minus_ws` serve the KDA forward's sequential kernel too."""

from __future__ import annotations

import triton
import triton.language as tl

from deltalab.kernels.triton_utils import dot_in, load_t


@triton.jit
def store_state(base, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT: tl.constexpr):
    """A state's tile (its key halves with SPLIT) at `base`, in base's dtype."""
    tl.store(base + p_h1, b_h1.to(base.dtype.element_ty), mask=m_h1)
    if SPLIT:
        tl.store(base + p_h2, b_h2.to(base.dtype.element_ty), mask=m_h2)


@triton.jit
def _block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV: tl.constexpr, V: tl.constexpr):
    """diag(beta) V of one 64-row block (rows s), fp32: what U = T diag(beta) V multiplies."""
    b_v = tl.load(v_base + s[:, None] * (HV * V) + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0)
    return b_v.to(tl.float32) * tl.load(beta_base + s * HV, mask=m_s, other=0.0).to(tl.float32)[:, None]


@triton.jit
def u_minus_ws(b_u, W, rows, o_k1, o_k2, m_k1, m_k2, b_h1, b_h2, ref, K: tl.constexpr, SPLIT: tl.constexpr,
               F32: tl.constexpr, PREC: tl.constexpr):
    """U - W S for one 64-row block (fp32; the state in its key halves with SPLIT; `ref` gives the dot dtype)."""
    b_w1 = tl.load(W + rows[:, None] * K + o_k1[None, :], mask=m_k1[None, :], other=0.0)
    b_wh = tl.dot(dot_in(b_w1, ref, F32), dot_in(b_h1, ref, F32), input_precision=PREC)
    if SPLIT:
        b_w2 = tl.load(W + rows[:, None] * K + o_k2[None, :], mask=m_k2[None, :], other=0.0)
        b_wh += tl.dot(dot_in(b_w2, ref, F32), dot_in(b_h2, ref, F32), input_precision=PREC)
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
    b_ks = tl.dot(dot_in(b_k1, ref, F32), dot_in(b_h1, ref, F32), input_precision=PREC)
    if SPLIT:
        b_ks += tl.dot(dot_in(b_k2, ref, F32), dot_in(b_h2, ref, F32), input_precision=PREC)
    return b_ks


@triton.jit
def _v_minus_cks_times_t(Ti, wsc, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, b_k1, b_k2, b_h1, b_h2, ref,
                         HV: tl.constexpr, V: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr,
                         PREC: tl.constexpr):
    """D = U - W S for one 64-row block as T (diag(beta) V - diag(c) (K S)), W = T diag(c) K: from the block's keys,
    which the state update loads anyway, its v and its 64 x 64 T, instead of W's 64 x dk rows and U's (the WY kernel
    is not launched on this path: the kkt kernel writes the row scales c)."""
    b_ks = _keys_times_state(b_k1, b_k2, b_h1, b_h2, ref, SPLIT, F32, PREC)
    b_x = _block_bv(v_base, beta_base, s, m_s, o_v, m_v, HV, V) - b_ks * tl.load(wsc + rows)[:, None]
    b_t = load_t(Ti, rows, o_r)
    return tl.dot(dot_in(b_t, ref, F32), dot_in(b_x, ref, F32), input_precision=PREC)


@triton.jit
def _block_decays(gcum, aux0, blk, b_G1p, NH: tl.constexpr, USE_G: tl.constexpr = True):
    """(G, G'): the chunk's log decay before block `blk` (0 at a chunk's first block) and at its end. G is the
    previous block's G' (b_G1p, the same row of gcum) rather than a load: Triton left that masked scalar load
    synchronous in the loop while it pipelines the load of G'. Without gates both are b_G1p, which stays 0."""
    if not USE_G:
        return b_G1p, b_G1p
    if NH == 1:
        b_G0 = 0.0
    else:
        b_G0 = tl.where(blk % NH > 0, b_G1p, 0.0)
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
    b_h1 = _decayed(b_h1, b_G0, b_G1, USE_G) + tl.dot(tl.trans(dot_in(b_k1, ref, F32)), b_ds, input_precision=PREC)
    if SPLIT:
        b_h2 = _decayed(b_h2, b_G0, b_G1, USE_G) + tl.dot(tl.trans(dot_in(b_k2, ref, F32)), b_ds,
                                                          input_precision=PREC)
    return b_h1, b_h2


@triton.jit
def _state_block(
    k, k_base, W, U, D, gcum, rstd, Ti, wsc, v_base, beta_base, aux0, Tn, o_r, o_k1, o_k2, m_k1, m_k2, o_v, m_v,
    b_h1, b_h2, blk, b_G1p, HK: tl.constexpr, HV: tl.constexpr, NH: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, KEYS_WS: tl.constexpr, USE_G: tl.constexpr = True,
):
    """One 64-row block `blk` of a sequence (block blk % NH of chunk blk // NH): D = U - W S, stored as soon as it is
    known (fewer registers live across the state update), and S' = e^{G'} S + sum_s e^{G' - G_s} k_s d_s^T (G' the
    log decay to the block's end, from the chunk's start; `gcum` restarts each chunk, so the block's own decay is
    G' - G at the previous block's end). Returns S', D and G'.
    KEYS_WS (the keys path): D = T (diag(beta) V - diag(c) (K S)) from the keys, v and T; W and U unread."""
    rows = aux0 + blk * 64 + o_r
    s = blk * 64 + o_r
    m_s = s < Tn * NH
    b_G0, b_G1 = _block_decays(gcum, aux0, blk, b_G1p, NH, USE_G)
    if KEYS_WS:  # the keys first: W S needs them
        b_k1, b_k2 = _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK, K, SPLIT)
        b_d = _v_minus_cks_times_t(Ti, wsc, v_base, beta_base, rows, s, m_s, o_r, o_v, m_v, b_k1, b_k2, b_h1, b_h2, k,
                                   HV, V, SPLIT, F32, PREC)
    else:
        b_u = tl.load(U + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_d = u_minus_ws(b_u, W, rows, o_k1, o_k2, m_k1, m_k2, b_h1, b_h2, k, K, SPLIT, F32, PREC)
    p_d = D + rows[:, None] * V + o_v[None, :]
    tl.store(p_d, b_d.to(p_d.dtype.element_ty), mask=m_v[None, :])
    b_ds = dot_in(b_d * _row_scales(gcum, rstd, rows, b_G1, USE_G)[:, None], k, F32)
    if not KEYS_WS:
        b_k1, b_k2 = _block_keys(k_base, s, m_s, o_k1, o_k2, m_k1, m_k2, HK, K, SPLIT)
    b_h1, b_h2 = _update_state(b_h1, b_h2, b_k1, b_k2, b_ds, b_G0, b_G1, k, SPLIT, F32, PREC, USE_G)
    return b_h1, b_h2, b_d, b_G1


@triton.jit
def state_kernel(
    k, v, beta, W, U, D, gcum, rstd, Ti, wsc, bnd, ht, h0, T, cu, coff, order, NCT,
    HK: tl.constexpr, HV: tl.constexpr, NH: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKH: tl.constexpr,
    SPLIT: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_BND: tl.constexpr,
    IS_VARLEN: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, KEYS_WS: tl.constexpr,
    BND_EVERY: tl.constexpr = 1, USE_G: tl.constexpr = True,
):
    """One program per (value tile, sequence * value head), looping over the sequence's 64-row blocks (n_h a
    chunk; `_state_block`, one flat loop): store S_c (at chunk starts), D_a = U_a - W_a S_a and
    S_{a+1} = e^{G_a'} S_a + sum_{s in a} e^{G_a' - G_s} k_s D_s^T, G_a' the log-decay over block a.
    D is each sub-step's true pseudo-value, whatever the blocking. The state's key rows are held in two
    halves when dk > 128 (SPLIT): one [256, 32] tile miscompiled on a Hopper GPU (Triton 3.6), as [128, 16] did.
    BND_EVERY = 2: only even chunks' starting states are stored (the output kernel's PAIR reads no others; n_h = 1)."""
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
    p_h1 = o_k1[:, None] * V + o_v[None, :]
    p_h2 = o_k2[:, None] * V + o_v[None, :]
    b_h2 = tl.zeros([BKH, BV], dtype=tl.float32)
    k_base = k + bos * NH * (HK * K) + i_hk * K
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
    b_G1p = tl.zeros([], dtype=tl.float32)  # the previous block's G'
    for blk in range(NC * NH):  # one block's code in the loop body at any n_h
        if STORE_BND:
            if blk % (NH * BND_EVERY) == 0:  # every chunk's start, or (2) every other one's
                store_state(bnd_base + (blk // NH) * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
        b_h1, b_h2, b_d, b_G1p = _state_block(
            *blocks, b_h1, b_h2, blk, b_G1p, HK=HK, HV=HV, NH=NH, K=K, V=V, SPLIT=SPLIT, F32=F32, PREC=PREC,
            KEYS_WS=KEYS_WS, USE_G=USE_G,
        )
    if STORE_BND:
        store_state(bnd_base + NC * (HV * K * V), b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
    if STORE_FINAL:
        store_state(ht + i_nh.to(tl.int64) * K * V, b_h1, b_h2, p_h1, p_h2, m_h1, m_h2, SPLIT)
