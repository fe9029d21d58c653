"""Triton kernel for exact attention maps of delta-rule layers (any gate: none, scalar, per channel; n_h >= 1; GQA).

Same math and result as `kernels.attention.chunk.delta_attention` (read its docstring), split by cost:
- per chunk c, in batched PyTorch (O(T L (L + dk)) per head; per-channel gates O(T L^2 dk) through pairwise
  decays e^{Gamma_w - Gamma_z}, z <= w, so no exponent is positive): the UT factors, the end-of-chunk score
  matrix Z_c = scale * diag(b) T^T K~ (dk x L, K~ the keys decayed to the chunk end, so a query row r
  that reads the state after the chunk scores its sub-steps as r Z_c), the compact transposed product
  P_c = diag(e^{Gamma_L}) - K~^T W (dk x dk, r carried to the chunk start is r P_c), and each chunk's own
  queries: their intra-chunk scores and their rows carried to the chunk start;
- the O(T^2 dk) cross-chunk part in `_cross_kernel`: one program per (64-token query chunk, batch*head)
  holds its 64 carried rows in registers and walks back through chunks c = cq-1 .. 0, writing r Z_c and
  carrying r <- r P_c; the rows it ends with are Phi(t,-1)^T q_t, which give the initial-state term.
  The walk does not depend on the gate's kind: per-channel gates change only the factors.
Full rows are written for query tiles of `tile` tokens. With top_k <= KERNEL_TOP_K, `_cross_topk_kernel` keeps
a running top-k per query row in registers (max-and-replace rounds over packed int64 keys), with the squared row
norms and the rebuilt output: no score matrix is stored, memory O(Tw (top_k + dk + dv)). Larger top_k reduce each
tile with torch.topk before the next, memory O(tile * sources).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.kernels.attention.chunk import (
    AttentionInputs,
    AttentionMap,
    check_mode,
    decayed_products,
    prepare_inputs,
    query_window,
)
from deltalab.kernels.delta_rule.chunk import pair_decays, tail_decays

C = 64  # tokens per chunk: the query block of one program
PRECISIONS = ("tf32x3", "ieee", "tf32")  # tl.dot input precisions; the interpreter computes all in float32


@triton.jit
def _cross_kernel(
    R0,
    Z,
    P,
    OUT,
    RC,
    first_chunk,
    n_cols,
    NQ,
    NC,
    BK: tl.constexpr,
    NH: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (i_q, i_bh): query chunk cq = first_chunk + i_q, rows R0[i_bh, 64 i_q : 64 i_q + 64] (at cq's start).

    Z [BH, NC, BK, 64 NH], P [BH, NC, BK, BK], OUT [BH, 64 NQ, n_cols] (n_cols = sources), RC like R0.
    """
    i_q, i_bh = tl.program_id(0), tl.program_id(1)
    cq = first_chunk + i_q
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    rows = i_bh.to(tl.int64) * NQ * 64 + i_q * 64 + o_r
    b_r = tl.load(R0 + rows[:, None] * BK + o_k[None, :])
    for i in range(0, cq):
        c = cq - 1 - i
        base = i_bh.to(tl.int64) * NC + c
        for a in tl.static_range(NH):
            b_z = tl.load(Z + (base * BK + o_k[:, None]) * L + a * 64 + o_r[None, :])
            b_s = tl.dot(b_r, b_z, input_precision=PREC)
            tl.store(OUT + rows[:, None] * n_cols + c * L + a * 64 + o_r[None, :], b_s)
        b_p = tl.load(P + (base * BK + o_k[:, None]) * BK + o_k[None, :])
        b_r = tl.dot(b_r, b_p, input_precision=PREC)
    tl.store(RC + rows[:, None] * BK + o_k[None, :], b_r)


@triton.jit
def _absorb(b_s, cols, valid, V, VN, v_base, o_v, DV, acc, sq, top, KP: tl.constexpr, BY_NORM: tl.constexpr,
            PREC: tl.constexpr):
    """Fold one [64, 64] block of scores (flat sources cols) into the output, the squared row norms and the top KP.

    Ranks by |alpha| (or |alpha| ||v_u||) packed with the sign and the source into one int64, float bits high (a
    non-negative float's bits order like the float), so a max over packed keys carries key, sign and index
    together. The block's largest key replaces the buffer's smallest while it is larger: at most as many rounds
    as the most candidates any row has above its current smallest (none, for most old, decayed blocks).
    """
    b_v = tl.load(V + (v_base + cols[:, None]) * DV + o_v[None, :], mask=o_v[None, :] < DV, other=0.0)
    acc += tl.dot(b_s, b_v, input_precision=PREC)
    sq += tl.sum(b_s * b_s, 1)
    key = tl.abs(b_s)
    if BY_NORM:
        key = key * tl.load(VN + v_base + cols)[None, :]
    bits = key.to(tl.int32, bitcast=True).to(tl.int64)
    packed = (bits << 32) | ((b_s < 0).to(tl.int64) << 31) | cols[None, :].to(tl.int64)
    packed = tl.where(valid, packed, -1)
    floor = tl.min(top, 1)
    rounds = tl.minimum(tl.max(tl.sum((packed > floor[:, None]).to(tl.int32), 1)), KP)
    slot = tl.arange(0, KP)
    for _ in range(rounds):
        best = tl.max(packed, 1)
        floor = tl.min(top, 1)
        at = tl.argmin(top, 1)
        top = tl.where((slot[None, :] == at[:, None]) & (best > floor)[:, None], best[:, None], top)
        packed = tl.where(packed == best[:, None], -1, packed)
    return acc, sq, top


@triton.jit
def _cross_topk_kernel(
    R0,
    Z,
    P,
    INTRA,
    V,
    VN,
    TOP,
    SQ,
    OUT,
    RC,
    first_chunk,
    n_src,
    NQ,
    NC,
    DV,
    BK: tl.constexpr,
    NH: tl.constexpr,
    BV: tl.constexpr,
    KP: tl.constexpr,
    BY_NORM: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (i_q, i_bh, i_v): as `_cross_kernel`, but the scores never leave the program.

    Each 64-source block is folded into a running top-KP per query row (packed int64, TOP [BH, 64 NQ, KP], in no
    order), the squared row norms SQ and the rebuilt output OUT[..., i_v BV : i_v BV + BV] (= sum_u alpha_u v_u); the
    query's own chunk is read from INTRA [BH, NC, 64, 64 NH] and masked causally. Memory: O(rows * KP).
    V [BH, 64 NH NC, DV] and VN [BH, 64 NH NC] (value norms) are padded to whole chunks.
    """
    i_q, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cq = first_chunk + i_q
    L: tl.constexpr = 64 * NH
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = i_bh.to(tl.int64) * NQ * 64 + i_q * 64 + o_r
    v_base = i_bh.to(tl.int64) * NC * L
    acc = tl.zeros([64, BV], dtype=tl.float32)
    sq = tl.zeros([64], dtype=tl.float32)
    top = tl.full([64, KP], -1, dtype=tl.int64)
    read = (cq * 64 + o_r) * NH + NH - 1  # the sub-step after which each row's query reads the state
    b_r = tl.load(R0 + rows[:, None] * BK + o_k[None, :])
    for i in range(0, cq + 1):  # the query's own chunk first (i = 0), then c = cq - 1 .. 0; one _absorb in the code
        c = cq - i
        base = i_bh.to(tl.int64) * NC + c
        for a in range(NH):
            cols = c * L + a * 64 + o_r
            if i == 0:
                b_s = tl.load(INTRA + (base * 64 + o_r[:, None]) * L + a * 64 + o_r[None, :])
                valid = (cols[None, :] <= read[:, None]) & (cols[None, :] < n_src)
            else:
                b_z = tl.load(Z + (base * BK + o_k[:, None]) * L + a * 64 + o_r[None, :])
                b_s = tl.dot(b_r, b_z, input_precision=PREC)
                valid = (cols[None, :] >= 0) & (o_r[:, None] >= 0)  # every source of an earlier chunk
            acc, sq, top = _absorb(b_s, cols, valid, V, VN, v_base, o_v, DV, acc, sq, top, KP, BY_NORM, PREC)
        if i > 0:
            b_p = tl.load(P + (base * BK + o_k[:, None]) * BK + o_k[None, :])
            b_r = tl.dot(b_r, b_p, input_precision=PREC)
    tl.store(OUT + rows[:, None] * DV + o_v[None, :], acc, mask=o_v[None, :] < DV)
    if i_v == 0:
        tl.store(RC + rows[:, None] * BK + o_k[None, :], b_r)
        tl.store(SQ + rows, sq)
        tl.store(TOP + rows[:, None] * KP + tl.arange(0, KP)[None, :], top)


def _factors(inp: AttentionInputs, BK: int, budget: int = 1 << 28):
    """Per-chunk factors, batched over chunks: (Z, P, intra scores, rows of every token carried to its chunk start).

    Gates: G = 1 log-decay per sub-step (scalar or none) or G = dk (per channel). The pairwise decays
    e^{Gamma_w - Gamma_z} (z <= w, never a positive exponent, summed from the gates they span:
    `kernels.delta_rule.chunk.pair_decays`) are [L, L] per chunk for scalar gates and [L, L, dk] per channel; those are
    built for groups of chunks of at most `budget` bytes.
    """
    BH, T, K = inp.q.shape
    n_h, L = inp.n_h, C * inp.n_h
    NC = -(-T // C)
    X = BH * NC  # chunks of every head, batched
    pad = NC * C - T
    G = inp.lg.shape[-1]
    dt, dev = inp.q.dtype, inp.q.device
    ks = torch.nn.functional.pad(inp.k, (0, 0, 0, pad * n_h)).reshape(X, L, K)
    bs = torch.nn.functional.pad(inp.b, (0, pad * n_h)).reshape(X, L)
    lgs = torch.nn.functional.pad(inp.lg, (0, 0, 0, pad * n_h)).reshape(X, L, G)
    gam = lgs.cumsum(1)
    qs = torch.nn.functional.pad(inp.q, (0, 0, 0, pad)).reshape(X, C, K)
    idx = torch.arange(L, device=dev)
    strict = idx[:, None] > idx[None, :]
    p = torch.arange(C, device=dev) * n_h + n_h - 1  # token i of a chunk reads after sub-step i n_h + n_h - 1
    gp = gam[:, p]  # [X, C, G]
    A = torch.empty(X, L, L, dtype=dt, device=dev)
    M = torch.empty(X, C, L, dtype=dt, device=dev)
    group = X if G == 1 else max(1, budget // (L * (L + C) * K * 4 * 2))
    for x0 in range(0, X, group):
        sl = slice(x0, min(X, x0 + group))
        decay = pair_decays(lgs[sl])  # [x, L, L, G]: e^{Gamma_w - Gamma_z}, z <= w, summed from the gates
        A[sl] = decayed_products(ks[sl], ks[sl], decay, strict)
        M[sl] = decayed_products(qs[sl], ks[sl], decay[:, p], None)
    lhs = A * bs[..., None] + torch.eye(L, dtype=dt, device=dev)
    W = torch.linalg.solve_triangular(lhs, (bs[..., None] * gam.exp()) * ks, upper=False, unitriangular=True)
    gam_end = gam[:, -1:]  # [X, 1, G]
    k_end = ks * tail_decays(lgs)  # keys decayed to the chunk end
    TtK = torch.linalg.solve_triangular(lhs.transpose(-1, -2), k_end, upper=True, unitriangular=True)
    Z = torch.zeros(X, BK, L, dtype=torch.float32, device=dev)
    Z[:, :K] = (inp.scale * TtK * bs[..., None]).transpose(-1, -2)
    P = torch.zeros(X, BK, BK, dtype=torch.float32, device=dev)
    P[:, :K, :K] = torch.diag_embed(gam_end[:, 0].exp().expand(X, K)) - k_end.transpose(-1, -2) @ W
    intra = inp.scale * torch.linalg.solve_triangular(lhs, M, upper=False, left=False, unitriangular=True) * bs[:, None]
    carried = gp.exp() * qs - M @ W  # [X, C, K]
    return (Z.view(BH, NC, BK, L), P.view(BH, NC, BK, BK), intra.view(BH, NC, C, L), carried.view(BH, NC, C, K))


KERNEL_TOP_K = 64  # top_k up to this runs the running top-k inside the kernel; larger ones tile in PyTorch


def _top_k_walk(inp: AttentionInputs, factors, start: int, stop: int, top_k: int, by_norm: bool, precision: str):
    """(top index, top weight, output without the initial term, squared row norms, rows at the start) of the
    window's rows, each [BH, Tw, ...]: the running top-k of `_cross_topk_kernel`, no score matrix in memory."""
    Z, P, intra, carried = factors
    BH, NC, BK, L = Z.shape
    K, n_h, N = inp.q.shape[-1], inp.n_h, stop * inp.n_h
    DV = inp.v.shape[-1]
    BV = min(64, max(16, triton.next_power_of_2(DV)))
    KP = max(2, triton.next_power_of_2(top_k))  # a power of two for tl.arange
    dev = inp.q.device
    c_lo, c_hi = start // C, -(-stop // C)
    NQ = c_hi - c_lo
    R0 = torch.zeros(BH, NQ, C, BK, dtype=torch.float32, device=dev)
    R0[..., :K] = carried[:, c_lo:c_hi]
    pad = NC * L - inp.v.shape[1]
    V = torch.nn.functional.pad(inp.v, (0, 0, 0, pad)).contiguous()
    VN = torch.nn.functional.pad(inp.v.norm(dim=-1), (0, pad)).contiguous()
    TOP = torch.empty(BH, NQ * C, KP, dtype=torch.int64, device=dev)
    SQ = torch.empty(BH, NQ * C, dtype=torch.float32, device=dev)
    OUT = torch.empty(BH, NQ * C, DV, dtype=torch.float32, device=dev)
    RC = torch.empty_like(R0)
    grid = (NQ, BH, -(-DV // BV))
    _cross_topk_kernel[grid](R0, Z, P, intra.contiguous(), V, VN, TOP, SQ, OUT, RC, c_lo, N, NQ, NC, DV, BK=BK,
                             NH=n_h, BV=BV, KP=KP, BY_NORM=by_norm, PREC=precision, num_stages=1)
    sel = slice(start - c_lo * C, stop - c_lo * C)
    packed = TOP[:, sel].sort(dim=-1, descending=True).values[..., :top_k]
    ok = packed >= 0
    idx = (packed & 0x7FFFFFFF).masked_fill(~ok, -1)
    key = (packed >> 32).to(torch.int32).view(torch.float32)
    sign = 1 - 2 * ((packed >> 31) & 1).to(torch.float32)
    if by_norm:  # the key is |alpha| ||v_u||: divide the norm back out
        key = key / VN.gather(1, idx.clamp(min=0).flatten(1)).view_as(key)
    w = (sign * key).masked_fill(~ok, 0)
    return idx, w, OUT[:, sel], SQ[:, sel], RC.view(BH, NQ * C, BK)[:, sel, :K]


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    top_k: int | None = None,
    rank_by: str = "weight",
    normalize_qk: bool = False,
    tile: int = 1024,
    precision: str = "tf32x3",
) -> AttentionMap:
    """Exact attention map of the query tokens in window, as `kernels.attention.chunk.delta_attention` (float32).

    Gates: None, scalar [B, T, Hv] or per channel [B, T, Hv, dk]. top_k <= KERNEL_TOP_K runs inside the kernel.
    precision: tl.dot's input precision: 'tf32x3' (default: three TF32 tensor-core products, float32 accuracy),
    'ieee' (FMA loops: on sm_90 Triton 3.6 took minutes to compile the top-k kernel) or 'tf32' (fastest, ~1e-3).
    """
    check_mode(top_k, rank_by, C)
    if tile < C or tile % C:
        raise ValueError(f"tile={tile}: pass a positive multiple of {C} query tokens")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)}")
    start, stop = query_window(window, q.shape[1])
    x = [None if t is None else t.float() for t in (q, k, v, beta, g, initial_state)]
    inp = prepare_inputs(*x[:5], scale, x[5], normalize_qk, stop)
    BH, _, K = inp.q.shape
    B, Hv, n_h = inp.B, inp.Hv, inp.n_h
    BK = max(16, triton.next_power_of_2(K))
    Z, P, intra, carried = _factors(inp, BK)
    NC, L, N = Z.shape[1], C * n_h, stop * n_h
    dev = inp.q.device
    vnorm = inp.v.norm(dim=-1)
    Tw = stop - start
    out = inp.q.new_zeros(BH, Tw, inp.v.shape[-1])
    rows_end = inp.q.new_zeros(BH, Tw, K)
    full = inp.q.new_zeros(BH, Tw, N) if top_k is None else None
    if top_k is not None:
        top = (torch.full((BH, Tw, top_k), -1, dtype=torch.long, device=dev), inp.q.new_zeros(BH, Tw, top_k))
    sq = inp.q.new_zeros(BH, Tw)
    # ranked by contribution, the kernel keeps |alpha| ||v_u|| and divides ||v_u|| back out: not where v_u = 0
    in_kernel = top_k is not None and top_k <= KERNEL_TOP_K and not (rank_by == "contribution" and (vnorm == 0).any())
    if in_kernel:
        idx, w, out, sq, rows_end = _top_k_walk(
            inp, (Z, P, intra, carried), start, stop, top_k, rank_by == "contribution", precision
        )
        top = (idx, w)
    for t0 in range(start - start % C, stop if not in_kernel else start, tile):
        t1 = min(t0 + tile, stop)
        c_lo, c_hi = t0 // C, -(-t1 // C)
        NQ = c_hi - c_lo
        R0 = torch.zeros(BH, NQ, C, BK, dtype=torch.float32, device=dev)
        R0[..., :K] = carried[:, c_lo:c_hi]
        scores = torch.zeros(BH, NQ * C, N, dtype=torch.float32, device=dev)
        RC = torch.empty_like(R0)
        _cross_kernel[(NQ, BH)](R0, Z, P, scores, RC, c_lo, N, NQ, NC, BK=BK, NH=n_h, PREC=precision,
                                num_stages=1)  # no software pipelining: a pipelined Z/P/R tile set overflows smem
        for i in range(NQ):  # intra-chunk scores (sources up to the chunk's end, clipped to the window's stop)
            c = c_lo + i
            width = min(L, N - c * L)
            scores[:, i * C : (i + 1) * C, c * L : c * L + width] = intra[:, c, :, :width]
        # window rows of this tile
        lo, hi = max(t0, start), t1
        sel = slice(lo - c_lo * C, hi - c_lo * C)
        rows = slice(lo - start, hi - start)
        s = scores[:, sel]
        rows_end[:, rows] = RC.view(BH, NQ * C, BK)[:, sel, :K]
        out[:, rows] = s @ inp.v
        sq[:, rows] = (s * s).sum(-1)
        if top_k is None:
            full[:, rows] = s
            continue
        key = s.abs() * (vnorm[:, None] if rank_by == "contribution" else 1)
        tok = torch.arange(lo, hi, device=dev)
        causal = torch.arange(N, device=dev)[None, :] // n_h <= tok[:, None]
        key = key.masked_fill(~causal, -torch.inf)
        kk = min(top_k, N)
        best = key.topk(kk, dim=-1)
        ok = best.values > -torch.inf
        top[0][:, rows, :kk] = best.indices.masked_fill(~ok, -1)
        top[1][:, rows, :kk] = s.gather(-1, best.indices) * ok

    initial = torch.zeros_like(out) if inp.h0 is None else inp.scale * rows_end @ inp.h0

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(B, Hv, Tw, *t.shape[2:]).transpose(1, 2)

    top_out = [None, None, None]
    if top_k is not None:
        idx, w = top
        norm = w.abs() * vnorm.gather(1, idx.clamp(min=0).flatten(1)).view_as(w) * (idx >= 0)
        top_out = [heads(idx), heads(w), heads(norm)]
    return AttentionMap(
        start=start,
        stop=stop,
        n_h=n_h,
        weights=None if full is None else heads(full.view(BH, Tw, stop, n_h)),
        top_index=top_out[0],
        top_weight=top_out[1],
        top_norm=top_out[2],
        initial=heads(initial),
        output=heads(out + initial),
        row_norm=heads(sq.sqrt()),
    )
