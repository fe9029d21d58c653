"""Exact attention maps of delta-rule layers, chunked (WY/UT) in PyTorch: O(T^2 dk) per head, bounded memory.

The recurrence H_u = A_u H_{u-1} + b_u k_u v_u^T over Householder sub-steps u = (s, j) (flat index
s * n_h + j) unrolls to  o_t = scale H_0^T Phi(t,-1)^T q_t + sum_{u <= e_t} alpha_{t,u} v_u  with
alpha_{t,u} = scale b_u q_t^T Phi(t, u) k_u  (see `kernels.attention.naive` for Phi and A_u). This module
computes alpha for a window of query tokens against every earlier sub-step, and the initial-state term.

Chunked form (chunks of C tokens = L sub-steps, per-channel log-decays Gamma_w cumulated from the chunk
start and including sub-step w's own gate; scalar gates broadcast over dk):
  A_{wz} = b_w k_w^T diag(e^{Gamma_w - Gamma_z}) k_z (z < w),  T = (I + A)^{-1},
  W = T diag(b) diag-rows(e^{Gamma}) K  (the UT factors of chunkwise training).
A query row r that reads the state after chunk sub-step p (a token's own query, or a query carried back
to this chunk's end, p = L - 1) has  M_{w} = r^T diag(e^{Gamma_p - Gamma_w}) k_w  (w <= p), and then
  alpha over the chunk's sub-steps = scale (M T) * b,     r carried to the chunk start = e^{Gamma_p} r - M W,
because within a chunk S_p = e^{Gamma_p} S_0 + sum_{w <= p} e^{Gamma_p - Gamma_w} k_w delta_w^T with pseudo-
values Delta = T diag(b) V - W S_0. Chunks are walked backwards from the window's last, each carrying all
window queries that lie after it: O(Tw * S n_h * (dk + L)) per head for Tw queries and S source tokens.
Memory is O(Tw dk + L^2 dk) per head plus the result: full rows, or a running top-k per query.
Every decay e^{Gamma_p - Gamma_w} (w <= p) is summed from the gates it spans (`kernels.delta_rule.chunk.pair_decays`,
and
`tail_decays` to the chunk end), never a difference of two running totals, which reach about -600 at g = -20 per
token (fp32 spacing 6e-5): float32 stays within 2e-6 of float64 there (tests/kernels/test_attention_precision.py).

The gated-linear-attention approximation is the same walk with T = I and W = 0 (Phi replaced by the decays).

Layouts (value heads Hv; value head h reads key head h // (Hv / Hk)):
  q [B, T, Hk, dk], k [B, T, n_h, Hk, dk], v [B, T, n_h, Hv, dv], beta [B, T, n_h, Hv],
  g None | [B, T, Hv] (scalar log-gate) | [B, T, Hv, dk] (per-channel: H <- (I - b k k^T) diag(e^g) H + b k v^T),
  initial_state [B, Hv, dk, dv].
Results (`AttentionMap`) are in the compute dtype (float64 for float64 inputs, float32 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltalab.kernels.delta_rule.chunk import pair_decays, tail_decays
from deltalab.kernels.delta_rule.naive import CHUNK_SIZE, l2_normalize


@dataclass
class AttentionMap:
    """Exact (or approximate) attention of query tokens [start, stop) over all sub-steps of tokens [0, stop).

    weights     [B, Tw, Hv, stop, n_h]  signed alpha_{t,(s,j)}, zero for s > t (full rows; None in top-k mode)
    top_index   [B, Tw, Hv, K]  flat source sub-step s * n_h + j, best first; -1 where a row has < K sources
    top_weight  [B, Tw, Hv, K]  signed alpha of those sources (0 at -1)
    top_norm    [B, Tw, Hv, K]  |alpha| * ||v_u||, the norm of each source's contribution to o_t
    initial     [B, Tw, Hv, dv] the initial-state term scale H_0^T Phi(t,-1)^T q_t (zeros without a state)
    output      [B, Tw, Hv, dv] initial + sum_u alpha_{t,u} v_u over all sources: o_t rebuilt from the map
    row_norm    [B, Tw, Hv]     ||alpha_t||_2 over all sources
    """

    start: int
    stop: int
    n_h: int
    weights: torch.Tensor | None
    top_index: torch.Tensor | None
    top_weight: torch.Tensor | None
    top_norm: torch.Tensor | None
    initial: torch.Tensor
    output: torch.Tensor
    row_norm: torch.Tensor


@dataclass
class AttentionComparison:
    """The exact map, the gated-linear-attention approximation, and how far apart they are per query.

    weight_error [B, Tw, Hv]: ||alpha_t - alpha~_t|| / ||alpha_t|| over all sources (initial term excluded).
    output_error [B, Tw, Hv]: ||o~_t - o_t|| / ||o_t||, o~ rebuilt from the approximation (its initial term too).
    """

    exact: AttentionMap
    approx: AttentionMap
    weight_error: torch.Tensor
    output_error: torch.Tensor


@dataclass
class AttentionInputs:
    """Inputs flattened to value heads, batch * head first, sub-steps interleaved in time order."""

    B: int
    Hv: int
    n_h: int
    T: int
    q: torch.Tensor  # [BH, T, K]
    k: torch.Tensor  # [BH, N, K]
    v: torch.Tensor  # [BH, N, V]
    b: torch.Tensor  # [BH, N]
    lg: torch.Tensor  # [BH, N, G] log-decay of each sub-step (G = 1 scalar/none, dk per-channel)
    h0: torch.Tensor | None  # [BH, K, V]
    scale: float


def check_inputs(q, k, v, beta, g, initial_state) -> None:
    """Raise a one-line ValueError naming the first inconsistent shape and the expected layout."""
    if q.dim() != 4 or k.dim() != 5 or v.dim() != 5 or beta.dim() != 4:
        raise ValueError(
            f"expected q [B,T,Hk,dk], k [B,T,n_h,Hk,dk], v [B,T,n_h,Hv,dv], beta [B,T,n_h,Hv]; got q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)} beta{tuple(beta.shape)}: pass tensors in these layouts"
        )
    B, T, Hk, K = q.shape
    n_h, Hv = v.shape[2], v.shape[3]
    if k.shape != (B, T, n_h, Hk, K):
        raise ValueError(f"k has shape {tuple(k.shape)}, expected {(B, T, n_h, Hk, K)} from q and v")
    if v.shape[:3] != (B, T, n_h) or beta.shape != (B, T, n_h, Hv):
        raise ValueError(f"v {tuple(v.shape)} / beta {tuple(beta.shape)} disagree with q {tuple(q.shape)}, n_h {n_h}")
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads: use Hv = m * Hk")
    if g is not None and g.shape not in ((B, T, Hv), (B, T, Hv, K)):
        raise ValueError(
            f"g has shape {tuple(g.shape)}: expected {(B, T, Hv)} (scalar) or {(B, T, Hv, K)} (per channel)"
        )
    if initial_state is not None and initial_state.shape != (B, Hv, K, v.shape[-1]):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(B, Hv, K, v.shape[-1])}")


def prepare_inputs(q, k, v, beta, g, scale, initial_state, normalize_qk, stop) -> AttentionInputs:
    check_inputs(q, k, v, beta, g, initial_state)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, beta = (x[:, :stop].to(dtype) for x in (q, k, v, beta))
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    B, T, Hk, K = q.shape
    n_h, Hv, V = v.shape[2], v.shape[3], v.shape[4]
    heads = torch.arange(Hv, device=q.device) // (Hv // Hk)
    q, k = q[:, :, heads], k[:, :, :, heads]

    def steps(x: torch.Tensor) -> torch.Tensor:  # [B, T, n_h, Hv, ...] -> [B*Hv, T*n_h, ...]
        return x.movedim(3, 1).reshape(B * Hv, T * n_h, *x.shape[4:])

    lg = torch.zeros(B, T, n_h, Hv, 1 if g is None or g.dim() == 3 else K, dtype=dtype, device=q.device)
    if g is not None:
        gg = g[:, :stop].to(dtype)
        lg[:, :, 0] = gg[..., None] if gg.dim() == 3 else gg
    h0 = None if initial_state is None else initial_state.to(dtype).reshape(B * Hv, K, V)
    return AttentionInputs(
        B=B,
        Hv=Hv,
        n_h=n_h,
        T=T,
        q=q.movedim(2, 1).reshape(B * Hv, T, K),
        k=steps(k),
        v=steps(v),
        b=steps(beta),
        lg=steps(lg),
        h0=h0,
        scale=K**-0.5 if scale is None else scale,
    )


def decayed_products(x: torch.Tensor, y: torch.Tensor, decay: torch.Tensor, mask: torch.Tensor | None):
    """M_{mw} = x_m^T diag(decay_{mw}) y_w where mask (else 0): [BH, m, L].

    decay [BH, m, L, G]: rows of `kernels.delta_rule.chunk.pair_decays` of the chunk's log decays (e^{Gamma_p -
    Gamma_w}, each exponent summed from the gates it spans, 0 for w > p); G = 1 (scalar gates) broadcasts over dk.
    """
    if decay.shape[-1] == 1:
        out = (x @ y.transpose(1, 2)) * decay[..., 0]
    else:
        out = torch.einsum("bmc,blc,bmlc->bml", x, y, decay)
    return out if mask is None else out.masked_fill(~mask, 0.0)


def _step(exact: bool, lhs, W, b, scale: float, r: torch.Tensor, M: torch.Tensor, decay: torch.Tensor):
    """(scores [BH, m, L], r carried to the chunk start) of query rows r with chunk products M and e^{Gamma_p}.

    Exact: scores = scale (M T) * b with T = lhs^{-1}, carried = e^{Gamma_p} r - M W. Approximation: T = I, W = 0.
    """
    if exact:
        MT = torch.linalg.solve_triangular(lhs, M, upper=False, left=False, unitriangular=True)
        return scale * MT * b[:, None], decay * r - M @ W
    return scale * M * b[:, None], decay * r


def _scan(inp: AttentionInputs, start: int, stop: int, exact_modes: tuple[bool, ...], chunk_size: int, on_block):
    """Walk chunks backwards; call on_block(rows, s0, s1, causal, [scores per mode]) and return carried queries.

    rows: window-row slice of the queries scored against sub-steps [s0, s1); causal [m, L] marks sources at or
    before each query's read point (None: all). The returned [BH, Tw, dk] per mode are Phi(t,-1)^T q_t.
    """
    n_h, C = inp.n_h, chunk_size
    BH, _, K = inp.q.shape
    Tw = stop - start
    carried = [inp.q.new_zeros(BH, Tw, K) for _ in exact_modes]
    for c in range((stop - 1) // C, -1, -1):
        c0, c1 = c * C, min((c + 1) * C, inp.T)
        s0, s1 = c0 * n_h, c1 * n_h
        L = s1 - s0
        kc, bc, lg = inp.k[:, s0:s1], inp.b[:, s0:s1], inp.lg[:, s0:s1]
        gam = lg.cumsum(1)  # [BH, L, G]
        gam_end = gam[:, -1:]  # [BH, 1, G]
        k_end = kc * tail_decays(lg)  # keys decayed to the chunk end
        decay = pair_decays(lg)  # [BH, L, L, G]: e^{Gamma_w - Gamma_z}, z <= w, summed from the gates
        lhs = W = None
        if any(exact_modes):
            idx = torch.arange(L, device=kc.device)
            A = decayed_products(kc, kc, decay, idx[:, None] > idx[None, :]) * bc[..., None]
            lhs = A + torch.eye(L, dtype=A.dtype, device=A.device)
            W = torch.linalg.solve_triangular(lhs, (bc[..., None] * gam.exp()) * kc, upper=False, unitriangular=True)

        # queries carried from later chunks read the state after this chunk's last sub-step
        if c1 < stop:
            old = slice(c1 - start if c1 > start else 0, Tw)
            if old.start < old.stop:
                results = []
                for i, exact in enumerate(exact_modes):
                    r = carried[i][:, old]
                    scores, carried[i][:, old] = _step(
                        exact, lhs, W, bc, inp.scale, r, r @ k_end.transpose(1, 2), gam_end.exp()
                    )
                    results.append(scores)
                on_block(old, s0, s1, None, results)
        # queries of this chunk's own tokens read the state after their token's last sub-step
        t_lo, t_hi = max(start, c0), min(stop, c1)
        if t_lo < t_hi:
            new = slice(t_lo - start, t_hi - start)
            p = torch.arange(t_lo - c0, t_hi - c0, device=kc.device) * n_h + n_h - 1
            causal = p[:, None] >= torch.arange(L, device=kc.device)[None, :]
            qn = inp.q[:, t_lo:t_hi]
            M = decayed_products(qn, kc, decay[:, p], causal)
            results = []
            for i, exact in enumerate(exact_modes):
                scores, carried[i][:, new] = _step(exact, lhs, W, bc, inp.scale, qn, M, gam[:, p].exp())
                results.append(scores)
            on_block(new, s0, s1, causal, results)
    return carried


class TopKCollector:
    """Accumulates one mode's blocks into full rows or a running top-k, the rebuilt output and row norms."""

    def __init__(self, inp: AttentionInputs, start: int, stop: int, top_k: int | None, rank_by: str):
        BH, Tw, dt, dev = inp.q.shape[0], stop - start, inp.q.dtype, inp.q.device
        self.inp, self.start, self.stop, self.top_k, self.rank_by = inp, start, stop, top_k, rank_by
        self.vnorm = inp.v.norm(dim=-1)  # [BH, N]
        self.out = inp.q.new_zeros(BH, Tw, inp.v.shape[-1])
        self.sq = inp.q.new_zeros(BH, Tw)
        if top_k is None:
            self.full = inp.q.new_zeros(BH, Tw, stop * inp.n_h)
        else:
            self.key = torch.full((BH, Tw, top_k), -torch.inf, dtype=dt, device=dev)
            self.idx = torch.full((BH, Tw, top_k), -1, dtype=torch.long, device=dev)
            self.w = inp.q.new_zeros(BH, Tw, top_k)

    def add(self, rows: slice, s0: int, s1: int, causal: torch.Tensor | None, scores: torch.Tensor) -> None:
        self.out[:, rows] += scores @ self.inp.v[:, s0:s1]
        self.sq[:, rows] += (scores * scores).sum(-1)
        if self.top_k is None:
            self.full[:, rows, s0:s1] = scores
            return
        key = scores.abs()
        if self.rank_by == "contribution":
            key = key * self.vnorm[:, None, s0:s1]
        if causal is not None:
            key = key.masked_fill(~causal, -torch.inf)
        src = torch.arange(s0, s1, device=scores.device).expand_as(scores)
        cand_key = torch.cat([self.key[:, rows], key], -1)
        best = cand_key.topk(min(self.top_k, cand_key.shape[-1]), dim=-1).indices
        self.key[:, rows] = cand_key.gather(-1, best)
        self.idx[:, rows] = torch.cat([self.idx[:, rows], src], -1).gather(-1, best)
        self.w[:, rows] = torch.cat([self.w[:, rows], scores], -1).gather(-1, best)

    def result(self, carried: torch.Tensor) -> AttentionMap:
        inp = self.inp
        B, Hv, n_h, Tw = inp.B, inp.Hv, inp.n_h, self.stop - self.start
        if inp.h0 is None:
            initial = torch.zeros_like(self.out)
        else:
            initial = inp.scale * carried @ inp.h0

        def heads(x: torch.Tensor) -> torch.Tensor:  # [BH, Tw, ...] -> [B, Tw, Hv, ...]
            return x.reshape(B, Hv, Tw, *x.shape[2:]).transpose(1, 2)

        top = [None, None, None]
        full = None
        if self.top_k is None:
            full = heads(self.full.reshape(B * Hv, Tw, self.stop, n_h))
        else:
            missing = self.key == -torch.inf  # fewer than K causal sources: ties among -inf are arbitrary
            self.idx = self.idx.masked_fill(missing, -1)
            norm = (self.w.abs() * self.vnorm.gather(1, self.idx.clamp(min=0).flatten(1)).view_as(self.w)).masked_fill(
                missing, 0
            )
            top = [heads(self.idx), heads(self.w.masked_fill(missing, 0)), heads(norm)]
        return AttentionMap(
            start=self.start,
            stop=self.stop,
            n_h=n_h,
            weights=full,
            top_index=top[0],
            top_weight=top[1],
            top_norm=top[2],
            initial=heads(initial),
            output=heads(self.out + initial),
            row_norm=heads(self.sq.sqrt()),
        )


def query_window(window: tuple[int, int] | None, T: int) -> tuple[int, int]:
    start, stop = (0, T) if window is None else window
    if not 0 <= start < stop <= T:
        raise ValueError(f"window {window} is not a token range inside [0, {T}): pass (start, stop), 0 <= start < stop")
    return start, stop


def check_mode(top_k: int | None, rank_by: str, chunk_size: int) -> None:
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: pass a positive number of sources, or None for full rows")
    if rank_by not in ("weight", "contribution"):
        raise ValueError(f"rank_by={rank_by!r}: use 'weight' (|alpha|) or 'contribution' (|alpha| ||v||)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: pass a positive number of tokens")


def delta_attention(
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
    exact: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> AttentionMap:
    """The exact attention map (exact=False: the gated-linear-attention approximation) of query tokens in window.

    window (start, stop): query tokens (default all); sources are every sub-step of tokens [0, stop) plus the
    initial state. top_k None gives full rows; top_k=K keeps the K sources of largest |alpha| (rank_by=
    'weight') or largest contribution |alpha| ||v_u|| ('contribution') per query and value head.
    """
    check_mode(top_k, rank_by, chunk_size)
    start, stop = query_window(window, q.shape[1])
    inp = prepare_inputs(q, k, v, beta, g, scale, initial_state, normalize_qk, stop)
    col = TopKCollector(inp, start, stop, top_k, rank_by)
    carried = _scan(inp, start, stop, (exact,), chunk_size, lambda r, s0, s1, m, sc: col.add(r, s0, s1, m, sc[0]))
    return col.result(carried[0])


def gla_attention(q, k, v, beta, g=None, **kwargs) -> AttentionMap:
    """The gated-linear-attention approximation (Phi replaced by the product of the decays); see delta_attention."""
    return delta_attention(q, k, v, beta, g, exact=False, **kwargs)


def compare_attention(
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
    chunk_size: int = CHUNK_SIZE,
) -> AttentionComparison:
    """Exact map and approximation in one walk, with the approximation's error per query (over all sources)."""
    check_mode(top_k, rank_by, chunk_size)
    start, stop = query_window(window, q.shape[1])
    inp = prepare_inputs(q, k, v, beta, g, scale, initial_state, normalize_qk, stop)
    ex, ap = TopKCollector(inp, start, stop, top_k, rank_by), TopKCollector(inp, start, stop, top_k, rank_by)
    diff = inp.q.new_zeros(inp.q.shape[0], stop - start)

    def on_block(rows, s0, s1, mask, scores):
        ex.add(rows, s0, s1, mask, scores[0])
        ap.add(rows, s0, s1, mask, scores[1])
        diff[:, rows] += ((scores[0] - scores[1]) ** 2).sum(-1)

    carried = _scan(inp, start, stop, (True, False), chunk_size, on_block)
    exact, approx = ex.result(carried[0]), ap.result(carried[1])
    tiny = torch.finfo(diff.dtype).tiny
    werr = diff.sqrt().reshape(inp.B, inp.Hv, -1).transpose(1, 2) / exact.row_norm.clamp(min=tiny)
    oerr = (approx.output - exact.output).norm(dim=-1) / exact.output.norm(dim=-1).clamp(min=tiny)
    return AttentionComparison(exact=exact, approx=approx, weight_error=werr, output_error=oerr)


def chunk_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, Hv, dv], final state [B, Hv, dk, dv]) of the recurrence, chunked, for every family here.

    Grouped heads and per-channel gates included (what state surgery needs to recompute a head's outputs);
    the same UT factors as the map, walked forwards: Delta = T diag(b) V - W S, o = scale (e^{Gamma_p} q S + M Delta),
    S <- e^{Gamma_L} S + K~^T Delta. Computes in float32 (float64 for float64 inputs).
    """
    inp = prepare_inputs(q, k, v, beta, g, scale, initial_state, False, q.shape[1])
    BH, T, K = inp.q.shape
    n_h, V = inp.n_h, inp.v.shape[-1]
    S = inp.q.new_zeros(BH, K, V) if inp.h0 is None else inp.h0.clone()
    outs = []
    for c0 in range(0, T, chunk_size):
        c1 = min(c0 + chunk_size, T)
        s0, s1 = c0 * n_h, c1 * n_h
        L = s1 - s0
        kc, bc, vc, lg = inp.k[:, s0:s1], inp.b[:, s0:s1], inp.v[:, s0:s1], inp.lg[:, s0:s1]
        gam = lg.cumsum(1)
        decay = pair_decays(lg)
        idx = torch.arange(L, device=kc.device)
        A = decayed_products(kc, kc, decay, idx[:, None] > idx[None, :]) * bc[..., None]
        lhs = A + torch.eye(L, dtype=A.dtype, device=A.device)
        W = torch.linalg.solve_triangular(lhs, (bc[..., None] * gam.exp()) * kc, upper=False, unitriangular=True)
        U = torch.linalg.solve_triangular(lhs, bc[..., None] * vc, upper=False, unitriangular=True)
        delta = U - W @ S
        p = torch.arange(c1 - c0, device=kc.device) * n_h + n_h - 1
        qc = inp.q[:, c0:c1]
        M = decayed_products(qc, kc, decay[:, p], None)
        outs.append(inp.scale * ((gam[:, p].exp() * qc) @ S + M @ delta))
        S = gam[:, -1:].transpose(1, 2).exp() * S + (kc * tail_decays(lg)).transpose(1, 2) @ delta
    o = torch.cat(outs, 1).reshape(inp.B, inp.Hv, T, V).transpose(1, 2)
    return o, S.reshape(inp.B, inp.Hv, K, V)
