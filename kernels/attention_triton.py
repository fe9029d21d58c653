"""Triton kernel for exact attention maps of delta-rule layers (scalar or no gate, n_h >= 1, grouped heads).

Same math and result as `kernels.attention.delta_attention` (read its docstring), split by cost:
- per chunk c, in batched PyTorch (O(T L (L + dk)) per head): the UT factors, the end-of-chunk score
  matrix Z_c = scale * diag(b) T^T K~ (dk x L, K~ the keys decayed to the chunk end, so a query row r
  that reads the state after the chunk scores its sub-steps as r Z_c), the compact transposed product
  P_c = e^{Gamma_L} I - K~^T W (dk x dk, r carried to the chunk start is r P_c), and each chunk's own
  queries: their intra-chunk scores and their rows carried to the chunk start;
- the O(T^2 dk) cross-chunk part in `_cross_kernel`: one program per (64-token query chunk, batch*head)
  holds its 64 carried rows in registers and walks back through chunks c = cq-1 .. 0, writing r Z_c and
  carrying r <- r P_c; the rows it ends with are Phi(t,-1)^T q_t, which give the initial-state term.
Full rows are written for query tiles of `tile` tokens; with top_k each tile is reduced with torch.topk
before the next, so memory stays O(tile * sources) whatever the window.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention import AttentionMap, _check_mode, _decayed, _Inputs, _prepare, _window

C = 64  # tokens per chunk: the query block of one program


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def _factors(inp: _Inputs, BK: int, budget: int = 1 << 28):
    """Per-chunk factors, batched over chunks: (Z, P, intra scores, rows of every token carried to its chunk start).

    Gates: G = 1 log-decay per sub-step (scalar or none) or G = dk (per channel). The pairwise decays
    e^{Gamma_w - Gamma_z} (z <= w, never a positive exponent) are [L, L] per chunk for scalar gates and
    [L, L, dk] per channel; those are built for groups of chunks of at most `budget` bytes.
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
    gam = torch.nn.functional.pad(inp.lg, (0, 0, 0, pad * n_h)).reshape(X, L, G).cumsum(1)
    qs = torch.nn.functional.pad(inp.q, (0, 0, 0, pad)).reshape(X, C, K)
    idx = torch.arange(L, device=dev)
    strict = idx[:, None] > idx[None, :]
    p = torch.arange(C, device=dev) * n_h + n_h - 1  # token i of a chunk reads after sub-step i n_h + n_h - 1
    causal = p[:, None] >= idx[None, :]
    gp = gam[:, p]  # [X, C, G]
    A = torch.empty(X, L, L, dtype=dt, device=dev)
    M = torch.empty(X, C, L, dtype=dt, device=dev)
    group = X if G == 1 else max(1, budget // (L * (L + C) * K * 4 * 2))
    for x0 in range(0, X, group):
        sl = slice(x0, min(X, x0 + group))
        A[sl] = _decayed(ks[sl], gam[sl], ks[sl], gam[sl], strict)
        M[sl] = _decayed(qs[sl], gp[sl], ks[sl], gam[sl], causal)
    lhs = A * bs[..., None] + torch.eye(L, dtype=dt, device=dev)
    W = torch.linalg.solve_triangular(lhs, (bs[..., None] * gam.exp()) * ks, upper=False, unitriangular=True)
    gam_end = gam[:, -1:]  # [X, 1, G]
    k_end = ks * (gam_end - gam).exp()  # keys decayed to the chunk end
    TtK = torch.linalg.solve_triangular(lhs.transpose(-1, -2), k_end, upper=True, unitriangular=True)
    Z = torch.zeros(X, BK, L, dtype=torch.float32, device=dev)
    Z[:, :K] = (inp.scale * TtK * bs[..., None]).transpose(-1, -2)
    P = torch.zeros(X, BK, BK, dtype=torch.float32, device=dev)
    P[:, :K, :K] = torch.diag_embed(gam_end[:, 0].exp().expand(X, K)) - k_end.transpose(-1, -2) @ W
    intra = inp.scale * torch.linalg.solve_triangular(lhs, M, upper=False, left=False, unitriangular=True) * bs[:, None]
    carried = gp.exp() * qs - M @ W  # [X, C, K]
    return (Z.view(BH, NC, BK, L), P.view(BH, NC, BK, BK), intra.view(BH, NC, C, L), carried.view(BH, NC, C, K))


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
    precision: str = "ieee",
) -> AttentionMap:
    """Exact attention map of the query tokens in window, as `kernels.attention.delta_attention` (float32).

    Scalar or no gate. precision: tl.dot's input precision ('ieee' float32, or 'tf32': faster, ~1e-3).
    """
    _check_mode(top_k, rank_by, C)
    if tile < C or tile % C:
        raise ValueError(f"tile={tile}: pass a positive multiple of {C} query tokens")
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision={precision!r}: use 'ieee' or 'tf32'")
    start, stop = _window(window, q.shape[1])
    x = [None if t is None else t.float() for t in (q, k, v, beta, g, initial_state)]
    inp = _prepare(*x[:5], scale, x[5], normalize_qk, stop)
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
    for t0 in range(start - start % C, stop, tile):
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
