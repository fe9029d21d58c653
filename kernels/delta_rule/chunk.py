"""Chunked (WY/UT) gated delta product in PyTorch: differentiable, for the CPU and for training.

Each chunk of C tokens is C * n_h Householder sub-steps. Within a chunk the sub-steps are
solved at once through the UT transform  (I + A) Delta = diag(beta) (V - e^Gamma K S_0),
A_ij = beta_i e^{Gamma_i - Gamma_j} k_i.k_j (j < i); across chunks the state is carried.
Same signature and results as `kernels.delta_rule.naive.naive_delta_product` (grouped heads: q and k are repeated to
the value heads; packed batches: one chunked solve per sequence). Per-channel gates g [B, T, Hv, K] (Kimi Delta
Attention) take `_channel_gate_factors`, which builds the pairwise per-channel decays for groups of chunks; each
is summed from the gates it spans, never taken as a difference of two running totals; scalar gates g [B, T, H]
take `_scalar_gate_factors`, whose [L, L] pairwise decays are summed the same way. Float32 stays within 2e-6 of
float64 at decays of e^-20 per token with either gate (tests/kernels/test_chunk_strong_decays.py).
"""

from __future__ import annotations

import torch

from deltalab.kernels.delta_rule.naive import CHUNK_SIZE, check_inputs, l2_normalize


def _interleave(k: torch.Tensor) -> torch.Tensor:
    """[B, T, n_h, H, ...] -> [B, H, T * n_h, ...] (sub-steps in time order)."""
    B, T, n_h, H = k.shape[:4]
    return k.movedim(3, 1).reshape(B, H, T * n_h, *k.shape[4:])


def chunk_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    normalize_qk: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence of `naive_delta_product` in chunks of `chunk_size` tokens (the WY/UT form), in PyTorch.

    Computes in float32 (float64 if given float64); o is returned in q's dtype, the states in float32 (float64).

    Args:
        q (torch.Tensor): queries `[B, T, Hk, K]`.
        k (torch.Tensor): keys `[B, T, n_h, Hk, K]`, one per Householder sub-step (unit length, or normalised here
            with `normalize_qk`).
        v (torch.Tensor): values `[B, T, n_h, Hv, V]`; Hv is a multiple of Hk and value head j reads key head
            j // (Hv / Hk).
        beta (torch.Tensor): write strengths `[B, T, n_h, Hv]`, in [0, 2] for a contraction (above 1: negative
            eigenvalues).
        g (torch.Tensor | None): log decays, `[B, T, Hv]` (one per head, Gated DeltaNet) or `[B, T, Hv, K]` (one per
            key channel, Kimi Delta Attention), applied before the token's first sub-step; None: no decay.
        scale (float | None): read-out scale; None: K ** -0.5.
        initial_state (torch.Tensor | None): `[N, Hv, K, V]` states before the first token; None: zeros.
        chunk_size (int): tokens per chunk, which sets the boundary states' spacing.
        normalize_qk (bool): L2-normalise q and k first (fla's in-kernel norm, eps 1e-6).
        cu_seqlens (torch.Tensor | None): `[N + 1]` rising token offsets of packed sequences (then B = 1); None:
            N = B sequences of T tokens.

    Returns:
        o (torch.Tensor): outputs `[B, T, Hv, V]`.
        final_state (torch.Tensor): `[N, Hv, K, V]`, the state after each sequence's last token.
        boundary_states (torch.Tensor): `[B, NB, Hv, K, V]`, the state before tokens 0, C, 2C, ... of each sequence
            and then its final state (NB = ceil(T / C) + 1 without cu_seqlens; packed: rows
            `boundary_offsets(cu_seqlens)[n]:[n + 1]` hold sequence n's).
    """
    N, Hk, Hv, _, _, _ = check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=3)
    args = dict(scale=scale, chunk_size=chunk_size, normalize_qk=normalize_qk)
    if cu_seqlens is None:
        return _chunk_dense(q, k, v, beta, g, initial_state=initial_state, **args)
    cu = torch.as_tensor(cu_seqlens).tolist()
    outs, finals, bounds = [], [], []
    for n in range(N):
        sl = slice(cu[n], cu[n + 1])
        h0 = None if initial_state is None else initial_state[n : n + 1]
        o, fin, bnd = _chunk_dense(
            q[:, sl], k[:, sl], v[:, sl], beta[:, sl], None if g is None else g[:, sl], initial_state=h0, **args
        )
        outs.append(o)
        finals.append(fin)
        bounds.append(bnd)
    return torch.cat(outs, 1), torch.cat(finals, 0), torch.cat(bounds, 1)


def _chunk_dense(q, k, v, beta, g, scale, initial_state, chunk_size, normalize_qk):
    """The chunked solve of [B, T] sequences with one head count."""
    B, T, H, K = q.shape
    n_h, V = k.shape[2], v.shape[-1]
    out_dtype = q.dtype
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = K**-0.5 if scale is None else scale
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)

    if T == 0:  # an empty sequence of a packed batch: its initial state is its final and only boundary
        return q.new_zeros(B, 0, H, V, dtype=out_dtype), state, state[:, None]
    # A sequence shorter than one chunk is solved as a single chunk of its own length: the
    # boundary states (initial, final) are the same, and no padding work is done.
    C = min(chunk_size, T)
    channel = g is not None and g.dim() == 4
    gamma = torch.zeros(B, T, n_h, H, *((K,) if channel else ()), dtype=dtype, device=q.device)
    if g is not None:  # the gate sits at each token's first sub-step
        gamma[:, :, 0] = g.to(dtype)
    chunks = _chunks(q, k, v, beta, gamma, C)
    if channel:
        factors = _channel_gate_factors(*chunks)
    else:
        factors = _scalar_gate_factors(*chunks, gated=g is not None)
    o, boundaries = _carry(*factors, state, scale)
    o = o.reshape(B, H, -1, V)[:, :, :T].movedim(1, 2)
    return o.to(out_dtype), boundaries[:, -1], boundaries


def _chunks(q, k, v, beta, gamma, C):
    """Pad to whole chunks and lay out per chunk: qs [B,H,NC,C,K], ks [B,H,NC,L,K], vs [B,H,NC,L,V],
    bs [B,H,NC,L] and each sub-step's log decay gs [B,H,NC,L] (or [B,H,NC,L,K])."""
    B, T, H, K = q.shape
    n_chunks = -(-T // C)
    pad = n_chunks * C - T
    if pad:
        q, k, v, beta, gamma = (
            torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, beta, gamma)
        )

    def per_chunk(x: torch.Tensor) -> torch.Tensor:
        return _interleave(x).reshape(B, H, n_chunks, -1, *x.shape[4:])

    return (q.movedim(2, 1).reshape(B, H, n_chunks, C, K), per_chunk(k), per_chunk(v), per_chunk(beta),
            per_chunk(gamma))


def _scalar_gate_factors(qs, ks, vs, bs, gs, gated: bool):
    """Intra-chunk factors with one log decay per head (or none): (I + A) Delta = diag(beta)(V - e^Gamma K S_0),
    A_ij = beta_i e^{Gamma_i - Gamma_j} k_i.k_j (j < i), Gamma the cumulative log decays within the chunk.

    As in `_channel_gate_factors`, every exponent Gamma_i - Gamma_j (j <= i) is summed from the gates it spans,
    g_{j+1} + ... + g_i (a cumulative sum over i of the gates masked to m > j, one [L, L] tensor per chunk as the
    differences were), and the tail decays e^{Gamma_L - Gamma_j} from a reverse sum of the gates shifted up a row:
    never a difference of two running totals, which reach about -600 at g = -20 per token (fp32 spacing 6e-5).
    float32 stays within 2e-6 of float64 there (tests/kernels/test_chunk_strong_decays.py)."""
    cum = gs.cumsum(3)
    C, L = qs.shape[3], ks.shape[3]
    n_h = L // C
    idx = torch.arange(L, device=qs.device)
    causal = idx[:, None] >= idx[None, :]
    last = idx[n_h - 1 :: n_h]  # the sub-step at which each token's query reads the state
    gram = ks @ ks.transpose(-1, -2)
    if not gated:  # every decay factor is 1, so skip the L x L exponentials
        decay = causal.to(qs.dtype)
        W_rhs = bs[..., None] * ks
        q_decayed, k_tail, chunk_decay = qs, ks, torch.ones_like(cum[..., -1])[..., None, None]
    else:
        decay = pair_decays(gs[..., None])[..., 0]  # e^{g_{j+1} + ... + g_i}, j <= i, else 0
        W_rhs = (bs * cum.exp())[..., None] * ks
        q_decayed = qs * cum[..., last].exp()[..., None]
        k_tail = ks * tail_decays(gs[..., None])  # e^{Gamma_L - Gamma_j} k_j
        chunk_decay = cum[..., -1].exp()[..., None, None]
    A = (bs[..., :, None] * decay * gram).tril(-1)
    lhs = torch.eye(L, dtype=qs.dtype, device=qs.device) + A
    U = torch.linalg.solve_triangular(lhs, bs[..., None] * vs, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(lhs, W_rhs, upper=False, unitriangular=True)
    attn = (qs @ ks.transpose(-1, -2)) * decay[..., last, :]  # [B,H,NC,C,L]
    return U, W, attn, q_decayed, k_tail, chunk_decay


class _PairDecays(torch.autograd.Function):
    """e^{g_{j+1} + ... + g_i} for j <= i, else 0: [..., L(i), L(j), K] from log decays g [..., L, K].

    Each exponent is a running sum over i of the gates masked to m > j, so it is summed from the gates it spans
    (never a difference of two running totals). Written as a Function so that neither pass holds more than one
    extra [L, L, K] tensor: the forward works in place, and the backward forms dL/dg_m = sum over the pairs
    j < m <= i of dL/dD_ij D_ij with one cumulative sum over j (autograd's backward of a cumulative sum over i
    would flip and copy). Differentiable again (create_graph) through torch operations.
    """

    @staticmethod
    def forward(ctx, g: torch.Tensor) -> torch.Tensor:
        L, K = g.shape[-2:]
        idx = torch.arange(L, device=g.device)
        spans = g[..., :, None, :].expand(*g.shape[:-2], L, L, K).clone(memory_format=torch.contiguous_format)
        spans.masked_fill_((idx[:, None] <= idx[None, :])[..., None], 0.0)  # keep g_m for m > j
        for i in range(1, L):  # the cumulative sum over i (torch.cumsum over this axis is ~30x slower on the CPU)
            spans[..., i, :, :] += spans[..., i - 1, :, :]
        decay = spans.masked_fill_((idx[:, None] < idx[None, :])[..., None], -torch.inf).exp_()
        ctx.save_for_backward(decay)
        return decay

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (decay,) = ctx.saved_tensors
        idx = torch.arange(decay.shape[-2], device=decay.device)
        # P_ij = sum_{j' <= j} grad_ij' D_ij' (zero above the diagonal), and dL/dg_m = sum_{i >= m} P_{i, m-1}
        P = (grad * decay).cumsum_(-2)
        col = P.masked_fill_((idx[:, None] <= idx[None, :])[..., None], 0.0).sum(-3)  # [..., L, K]: i > j
        return torch.nn.functional.pad(col[..., :-1, :], (0, 0, 1, 0))


def pair_decays(g: torch.Tensor) -> torch.Tensor:
    """e^{g_{j+1} + ... + g_i} for j <= i, else 0: [..., L(i), L(j), K] from log decays g [..., L, K] (K = 1 for
    scalar gates), each exponent summed from the gates it spans; differentiable. K = 1 takes torch's cumulative sum
    over i of the gates masked to m > j (a loop of L slice additions of [..., L, 1] costs more than the sum), wider
    K `_PairDecays`."""
    if g.shape[-1] > 1:
        return _PairDecays.apply(g)
    idx = torch.arange(g.shape[-2], device=g.device)
    spans = torch.where((idx[:, None] > idx[None, :])[..., None], g[..., :, None, :], 0.0).cumsum_(-3)
    return spans.masked_fill_((idx[:, None] < idx[None, :])[..., None], -torch.inf).exp_()


def tail_decays(g: torch.Tensor) -> torch.Tensor:
    """e^{g_{j+1} + ... + g_L} (the decay from row j to the end) from log decays g [..., L, K]: a reverse sum of
    the gates shifted up a row, not a difference of running totals."""
    return torch.nn.functional.pad(g[..., 1:, :], (0, 0, 0, 1)).flip(-2).cumsum(-2).flip(-2).exp()


def _channel_gate_factors(qs, ks, vs, bs, gs, budget: int = 1 << 29):
    """Intra-chunk factors with per-channel gates (Kimi Delta Attention: g [B, T, H, K] decays the key rows).

    Within a chunk of L sub-steps with log decays g_m in R^K and cumulative ones Gamma_i = g_1 + ... + g_i,
    S_i = diag(e^{Gamma_i}) S_0 + sum_{j<=i} diag(e^{Gamma_i - Gamma_j}) k_j u_j^T, where
    (I + A) U = diag(b) (V - Ktilde S_0), A_ij = b_i k_i^T diag(e^{Gamma_i - Gamma_j}) k_j (j < i) and
    Ktilde_i = e^{Gamma_i} * k_i. Every exponent Gamma_i - Gamma_j (j <= i) is summed from the gates it spans,
    g_{j+1} + ... + g_i (`_PairDecays`), never subtracted from two running totals: those reach about -600 at
    g = -20 per token, where fp32's spacing (6e-5) would enter the exponent. The gates share a sign, so each sum
    is accurate relative to its own size, and no exponent is positive. The factors are built for groups of chunks
    at once (the pairwise [L, L, K] decays bounded by `budget` bytes).
    """
    B, H, n_chunks, C, K = qs.shape
    L, V = ks.shape[3], vs.shape[-1]
    n_h = L // C
    cum = gs.cumsum(3)  # Gamma_i from the chunk start (e^{Gamma_i} is as accurate as Gamma_i itself)
    last = torch.arange(n_h - 1, L, n_h, device=qs.device)
    eye = torch.eye(L, dtype=qs.dtype, device=qs.device)
    U = qs.new_empty(B, H, n_chunks, L, V)
    W = qs.new_empty(B, H, n_chunks, L, K)
    attn = qs.new_empty(B, H, n_chunks, C, L)
    group = max(1, budget // max(1, B * H * L * L * K * qs.element_size() * 3))
    for c0 in range(0, n_chunks, group):
        sl = slice(c0, min(n_chunks, c0 + group))
        kc, bc = ks[:, :, sl], bs[:, :, sl]
        decay = pair_decays(gs[:, :, sl])  # [B, H, G, L(i), L(j), K]: e^{Gamma_i - Gamma_j}, j <= i
        A = (bc[..., :, None] * torch.einsum("bhgik,bhgjk,bhgijk->bhgij", kc, kc, decay)).tril(-1)
        attn[:, :, sl] = torch.einsum("bhgtk,bhgjk,bhgtjk->bhgtj", qs[:, :, sl], kc, decay[..., last, :, :])
        lhs = eye + A
        U[:, :, sl] = torch.linalg.solve_triangular(lhs, bc[..., None] * vs[:, :, sl], upper=False,
                                                    unitriangular=True)
        W[:, :, sl] = torch.linalg.solve_triangular(lhs, bc[..., None] * kc * cum[:, :, sl].exp(), upper=False,
                                                    unitriangular=True)
    q_decayed = qs * cum[..., last, :].exp()
    k_tail = ks * tail_decays(gs)  # e^{Gamma_L - Gamma_j} k_j, summed from g_{j+1..L}
    chunk_decay = cum[..., -1, :].exp()[..., None]  # [B, H, NC, K, 1]
    return U, W, attn, q_decayed, k_tail, chunk_decay


def _carry(U, W, attn, q_decayed, k_tail, chunk_decay, state, scale):
    """Carry the state across chunks: o [B, H, NC, C, V] and the boundary states [B, NC + 1, H, K, V]."""
    outs, boundaries = [], [state]
    for c in range(U.shape[2]):
        delta = U[:, :, c] - W[:, :, c] @ state
        outs.append(scale * (q_decayed[:, :, c] @ state + attn[:, :, c] @ delta))
        state = chunk_decay[:, :, c] * state + k_tail[:, :, c].transpose(-1, -2) @ delta
        boundaries.append(state)
    return torch.stack(outs, 2), torch.stack(boundaries, 1)
