"""Exact attention maps of the generalised delta rule (DPLR transitions, RWKV-7), chunked: O(T^2 dk) per head.

Per head H_t = M_t H_{t-1} + k_t v_t^T with M_t = diag(e^{g_t}) + b_t a_t^T, so with Phi(t, s) = M_t ... M_{s+1}
    o_t = scale H_0^T Phi(t, -1)^T q_t + sum_{s <= t} alpha_{t,s} v_s,   alpha_{t,s} = scale q_t^T Phi(t, s) k_s
(`kernels.attention.dplr_naive` is the dense float64 oracle). Within a chunk (tokens i = 1..C, Gamma_i the per-
channel log decays cumulated from the chunk start, inclusive) `kernels.dplr.chunk` writes the state after token p as
    H_p = e^{Gamma_p} * H_0 + sum_{j<=p} e^{Gamma_p - Gamma_j} * (b_j u_j^T + k_j v_j^T),
    U = T (A_ak V + X H_0),  T = (I - A_ab)^{-1},  X_i = e^{Gamma_{i-1}} * a_i,
A_xy[i, j] = x_i^T diag(e^{Gamma_{i-1} - Gamma_j}) y_j (j < i). A query row r reading H_p (a token's own query, p its
token; or a query carried back to this chunk's end, p = C) has Mk_j = r^T diag(e^{Gamma_p - Gamma_j}) k_j and Mb_j
likewise with b_j (j <= p), so r^T H_p = (e^{Gamma_p} r + Mb T X) H_0 + (Mk + Mb T A_ak) V:
    alpha over the chunk's tokens = scale (Mk + (Mb T) A_ak),   r carried to the chunk start = e^{Gamma_p} r + (Mb T) X.
Chunks are walked backwards from the window's last, each carrying every window query after it (as
`kernels.attention.chunk` does for Householder products). Every exponent is a difference Gamma_x - Gamma_j with x after
j (never positive; the sub-block split of `kernels.dplr.chunk._decayed_products`), so decays of e^-20 per token cannot
overflow. Memory O(Tw dk + C^2 dk / SUB) per head plus the result (full rows, or a running top-k per query).

The gated-linear-attention-style approximation is the same walk with Phi replaced by the product of the diagonal
decays alone (the rank-one removal b a^T dropped): alpha~ = scale q_t^T diag(e^{Gamma_t - Gamma_s}) k_s.

Layout (`kernels.dplr.naive`): q, k, a, b, g [B, T, H, K] (g None: no decay), v [B, T, H, V], initial_state
[B, H, K, V]; RWKV-7 passes a = -kappa, b = kappa * a_rwkv and scale 1. Results are
`kernels.attention.chunk.AttentionMap` with one sub-step per token (weights [B, Tw, H, stop, 1]), in float64 for float64
inputs, float32 otherwise.
"""

from __future__ import annotations

import torch

from deltalab.kernels.attention.chunk import (
    AttentionComparison,
    AttentionInputs,
    AttentionMap,
    TopKCollector,
    check_mode,
    query_window,
)
from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.delta_rule.chunk import tail_decays
from deltalab.kernels.dplr.chunk import SUB, dplr_decayed_products
from deltalab.kernels.dplr.naive import check_dplr_inputs

__all__ = ["compare_dplr_attention", "dplr_attention", "dplr_gla_attention"]


def _prepare(q, k, v, a, b, g, scale, initial_state, stop) -> tuple[AttentionInputs, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """(inputs as `kernels.attention.chunk` lays them out with n_h = 1, a, b, log decays [BH, T, K]) for tokens [0,
    stop)."""
    check_dplr_inputs(q, k, v, a, b, g, initial_state)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, _, H, K = q.shape
    V = v.shape[-1]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B*H, stop, D]
        x = x[:, :stop].to(dtype)
        return x.movedim(2, 1).reshape(B * H, x.shape[1], x.shape[-1])

    qh, kh, vh, ah, bh = (heads(x) for x in (q, k, v, a, b))
    lg = torch.zeros_like(qh) if g is None else heads(g)
    h0 = None if initial_state is None else initial_state.to(dtype).reshape(B * H, K, V)
    inp = AttentionInputs(B=B, Hv=H, n_h=1, T=qh.shape[1], q=qh, k=kh, v=vh, b=bh, lg=lg, h0=h0, scale=float(scale))
    return inp, ah, bh, lg


def _chunking(T: int, chunk_size: int) -> tuple[int, int]:
    """(C, sub): chunk length (a whole number of sub-blocks where the chunk size allows) and sub-block length."""
    C = min(chunk_size, T if chunk_size % SUB else -(-T // SUB) * SUB)
    return C, SUB if C % SUB == 0 else C


def _scan(inp: AttentionInputs, a, b, lg, start: int, stop: int, exact_modes: tuple[bool, ...], chunk_size: int,
          on_block):
    """Walk chunks backwards; on_block(rows, s0, s1, causal, [scores per mode]); return Phi(t,-1)^T q_t per mode."""
    BH, T, K = inp.q.shape
    C, sub = _chunking(T, chunk_size)
    n_chunks = -(-T // C)
    pad = n_chunks * C - T

    def padded(x: torch.Tensor) -> torch.Tensor:  # padded tokens: zero key, a, b, decay; never sources
        return torch.nn.functional.pad(x, (0, 0, 0, pad))

    q, k, a, b, lg = (padded(x) for x in (inp.q, inp.k, a, b, lg))
    Tw = stop - start
    carried = [inp.q.new_zeros(BH, Tw, K) for _ in exact_modes]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    exact_any = any(exact_modes)
    for c in range((stop - 1) // C, -1, -1):
        c0 = c * C
        L = min(C, stop - c0)  # real source tokens of this chunk
        qc, kc, ac, bc, gc = (x[:, c0 : c0 + C] for x in (q, k, a, b, lg))
        gam = gc.cumsum(1)
        gex = torch.cat([torch.zeros_like(gam[:, :1]), gam[:, :-1]], 1)  # Gamma_{i-1}
        lhs = X = A_ak = None
        if exact_any:
            (A_ak, A_ab), = dplr_decayed_products([ac], [kc, bc], gc, sub, strict=True)
            lhs, X = eye - A_ab, ac * gex.exp()

        factors = (lhs, A_ak, X, L, inp.scale)
        # queries carried from later chunks read the state after this chunk's last token
        if c0 + C < stop:
            old = slice(max(c0 + C - start, 0), Tw)
            if old.start < old.stop:
                tail = tail_decays(gc)
                k_end, b_end, decay = (kc * tail).transpose(1, 2), (bc * tail).transpose(1, 2), gam[:, -1:].exp()
                results = []
                for i, exact in enumerate(exact_modes):
                    r = carried[i][:, old]
                    Mb = r @ b_end if exact else None
                    scores, carried[i][:, old] = _step(exact, factors, r, r @ k_end, Mb, decay)
                    results.append(scores)
                on_block(old, c0, c0 + L, None, results)
        # queries of this chunk's own tokens read the state after their token
        t_lo, t_hi = max(start, c0), min(stop, c0 + C)
        if t_lo < t_hi:
            new, rows = slice(t_lo - start, t_hi - start), slice(t_lo - c0, t_hi - c0)
            (A_qk, A_qb), = dplr_decayed_products([qc], [kc, bc], gc, sub, strict=False)
            p = torch.arange(t_lo - c0, t_hi - c0, device=q.device)
            causal = p[:, None] >= torch.arange(L, device=q.device)[None, :]
            results = []
            for i, exact in enumerate(exact_modes):
                scores, carried[i][:, new] = _step(exact, factors, qc[:, rows], A_qk[:, rows], A_qb[:, rows],
                                                   gam[:, rows].exp())
                results.append(scores)
            on_block(new, c0, c0 + L, causal, results)
    return carried


def _step(exact: bool, factors, r: torch.Tensor, Mk: torch.Tensor, Mb: torch.Tensor | None, decay: torch.Tensor):
    """(scores [BH, m, L], r carried to the chunk start) of query rows r with chunk products Mk, Mb and e^{Gamma_p}.

    Exact: scores = scale (Mk + (Mb T) A_ak), carried = e^{Gamma_p} r + (Mb T) X.
    Approximation: scale Mk and e^{Gamma_p} r.
    """
    lhs, A_ak, X, L, scale = factors
    if not exact:
        return scale * Mk[..., :L], decay * r
    MbT = torch.linalg.solve_triangular(lhs, Mb, upper=False, left=False, unitriangular=True)
    return scale * (Mk + MbT @ A_ak)[..., :L], decay * r + MbT @ X


def dplr_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    top_k: int | None = None,
    rank_by: str = "weight",
    exact: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> AttentionMap:
    """The exact attention map of DPLR transitions (exact=False: the decay-only approximation) of window's queries.

    window (start, stop): query tokens (default all); sources are tokens [0, stop) plus the initial state. top_k
    None gives full rows [B, Tw, H, stop, 1]; top_k=K keeps the K sources of largest |alpha| (rank_by='weight') or
    |alpha| ||v_s|| ('contribution') per query and head, as `kernels.attention.chunk.delta_attention`.
    """
    check_mode(top_k, rank_by, chunk_size)
    start, stop = query_window(window, q.shape[1])
    inp, a_, b_, lg = _prepare(q, k, v, a, b, g, scale, initial_state, stop)
    col = TopKCollector(inp, start, stop, top_k, rank_by)
    carried = _scan(inp, a_, b_, lg, start, stop, (exact,), chunk_size,
                    lambda r, s0, s1, m, sc: col.add(r, s0, s1, m, sc[0]))
    return col.result(carried[0])


def dplr_gla_attention(q, k, v, a, b, g=None, **kwargs) -> AttentionMap:
    """The approximation with Phi replaced by the product of the diagonal decays (no rank-one removal)."""
    return dplr_attention(q, k, v, a, b, g, exact=False, **kwargs)


def compare_dplr_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    top_k: int | None = None,
    rank_by: str = "weight",
    chunk_size: int = CHUNK_SIZE,
) -> AttentionComparison:
    """Exact map and decay-only approximation in one walk, with the approximation's error per query (all sources)."""
    check_mode(top_k, rank_by, chunk_size)
    start, stop = query_window(window, q.shape[1])
    inp, a_, b_, lg = _prepare(q, k, v, a, b, g, scale, initial_state, stop)
    ex, ap = TopKCollector(inp, start, stop, top_k, rank_by), TopKCollector(inp, start, stop, top_k, rank_by)
    diff = inp.q.new_zeros(inp.q.shape[0], stop - start)

    def on_block(rows, s0, s1, mask, scores):
        ex.add(rows, s0, s1, mask, scores[0])
        ap.add(rows, s0, s1, mask, scores[1])
        diff[:, rows] += ((scores[0] - scores[1]) ** 2).sum(-1)

    carried = _scan(inp, a_, b_, lg, start, stop, (True, False), chunk_size, on_block)
    exact, approx = ex.result(carried[0]), ap.result(carried[1])
    tiny = torch.finfo(diff.dtype).tiny
    werr = diff.sqrt().reshape(inp.B, inp.Hv, -1).transpose(1, 2) / exact.row_norm.clamp(min=tiny)
    oerr = (approx.output - exact.output).norm(dim=-1) / exact.output.norm(dim=-1).clamp(min=tiny)
    return AttentionComparison(exact=exact, approx=approx, weight_error=werr, output_error=oerr)
