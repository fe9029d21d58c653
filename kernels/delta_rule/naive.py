"""Plain token-by-token gated delta product: the oracle every fast path is checked against.

Shapes follow docs/architecture.md (fla's [K, V] state layout), with Hk key heads and Hv value heads (Hv a
multiple of Hk; value head j reads key head j // (Hv / Hk), as fla's grouped value attention):
  q [B, T, Hk, K], k [B, T, n_h, Hk, K], v [B, T, n_h, Hv, V], beta [B, T, n_h, Hv], and the log forget gate
  g [B, T, Hv] (scalar, Gated DeltaNet) or [B, T, Hv, K] (per key channel, Kimi Delta Attention) or None.
A per-channel gate decays the state's K (row) axis before the token's first Householder step:
  H_t = (I - b k k^T) diag(exp g_t) H_{t-1} + b k v^T.
Packed variable-length batches: B = 1 and `cu_seqlens` (N + 1 increasing token offsets, as fla and
transformers pass them); sequence n is tokens cu_seqlens[n]:cu_seqlens[n+1], starts from initial_state[n]
and never sees the others. Its boundary states are rows `boundary_offsets(cu_seqlens)[n]:[n+1]` of the
boundary tensor [1, NB, Hv, K, V]: its chunk-start states, then its final state.
Computes in the dtype of the inputs (pass float64 for a reference).
"""

from __future__ import annotations

import torch

from deltalab.kernels.constants import CHUNK_SIZE


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's in-kernel L2 norm: x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def num_boundaries(seq_len: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Chunk-start states plus the final state: ceil(T / C) + 1."""
    return -(-seq_len // chunk_size) + 1


def boundary_offsets(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> list[int]:
    """Row offsets of each sequence's boundary states in a packed batch: sequence n owns rows
    [off[n], off[n+1]) of the boundary tensor, ceil(T_n / C) chunk starts and then its final state."""
    lens = torch.as_tensor(cu_seqlens).diff().tolist()
    off = [0]
    for n in lens:
        off.append(off[-1] + num_boundaries(int(n), chunk_size))
    return off


_CU_CHECKED: list[tuple[torch.Tensor, int, int]] = []  # (cu_seqlens, its version, T) that passed, newest first


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, B: int, T: int) -> int:
    """The number of sequences N: B, or that of a packed batch's `cu_seqlens` (B = 1, offsets rising 0..T);
    one-line ValueError otherwise. The check reads the offsets back from the GPU (one sync), so the last few
    tensors that passed are remembered (held, with their in-place version) and not read again."""
    if cu_seqlens is None:
        return B
    if B != 1:
        raise ValueError(f"cu_seqlens needs packed inputs with batch size 1, got B={B}")
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be 1-D integer (N+1 offsets), got {cu.dtype} {tuple(cu.shape)}")
    if any(t is cu and version == cu._version and tt == T for t, version, tt in _CU_CHECKED):
        return cu.numel() - 1
    first, last, falls = torch.stack([cu[0], cu[-1], (cu.diff() < 0).any().to(cu.dtype)]).tolist()
    if first != 0 or last != T or falls:
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu.tolist()[:8]}...")
    _CU_CHECKED.insert(0, (cu, cu._version, T))
    del _CU_CHECKED[8:]
    return cu.numel() - 1


def check_inputs(q, k, v, beta, g=None, initial_state=None, cu_seqlens=None) -> tuple[int, int, int, int, int, int]:
    """Validate the shared contract with one-line ValueErrors; return (N sequences, Hk, Hv, K, V, n_h)."""
    if q.dim() != 4 or k.dim() != 5 or v.dim() != 5 or beta.dim() != 4:
        raise ValueError(
            "expected q [B,T,Hk,K], k [B,T,n_h,Hk,K], v [B,T,n_h,Hv,V], beta [B,T,n_h,Hv]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(beta.shape)}"
        )
    B, T, Hk, K = q.shape
    n_h, Hv, V = k.shape[2], v.shape[3], v.shape[4]
    if k.shape != (B, T, n_h, Hk, K) or v.shape[:3] != (B, T, n_h) or beta.shape != (B, T, n_h, Hv):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}"
        )
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if g is not None and g.shape not in ((B, T, Hv), (B, T, Hv, K)):
        raise ValueError(f"g must be [B,T,Hv] = {(B, T, Hv)} (scalar gate) or [B,T,Hv,K] = {(B, T, Hv, K)} "
                         f"(per-channel gate), got {tuple(g.shape)}")
    N = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None and initial_state.shape != (N, Hv, K, V):
        raise ValueError(f"initial_state must be [N,Hv,K,V] = {(N, Hv, K, V)}, got {tuple(initial_state.shape)}")
    return N, Hk, Hv, K, V, n_h


def _naive_dense(q, k, v, beta, g, scale, state, chunk_size):
    """The recurrence over [B, T] with one head count (q, k already repeated to the value heads)."""
    T, n_h = q.shape[1], k.shape[2]
    outputs, boundaries = [], []
    for t in range(T):
        if t % chunk_size == 0:
            boundaries.append(state)
        if g is not None:
            decay = g[:, t].exp().to(q.dtype)  # [B, Hv] or [B, Hv, K]
            state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        for j in range(n_h):
            k_tj, v_tj, b_tj = k[:, t, j], v[:, t, j], beta[:, t, j]
            residual = v_tj - torch.einsum("bhkv,bhk->bhv", state, k_tj)
            state = state + b_tj[..., None, None] * k_tj[..., :, None] * residual[..., None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    boundaries.append(state)
    o = torch.stack(outputs, 1) if outputs else q.new_zeros(q.shape[0], 0, *v.shape[3:])
    return o, state, torch.stack(boundaries, 1)


def naive_delta_product(
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
    """The delta-product recurrence token by token, in the inputs' dtype: the reference every fast form is checked
    against (in float64).

    H_{t,j} = (I - b k k^T) D_{t,j} H_{t,j-1} + b k v^T, D_{t,1} = exp(g_t) (a scalar, or diag(exp g_t) for a
    per-channel gate), D_{t,j>1} = I; o_t = scale H_t^T q_t.

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
    N, Hk, Hv, K, V, _ = check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = K**-0.5 if scale is None else scale
    q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=3)  # key head j // G
    h0 = q.new_zeros(N, Hv, K, V) if initial_state is None else initial_state.to(q.dtype)
    if cu_seqlens is None:
        return _naive_dense(q, k, v, beta, g, scale, h0.clone(), chunk_size)
    outs, finals, bounds = [], [], []
    cu = torch.as_tensor(cu_seqlens).tolist()
    for n in range(N):
        sl = slice(cu[n], cu[n + 1])
        o, fin, bnd = _naive_dense(
            q[:, sl], k[:, sl], v[:, sl], beta[:, sl], None if g is None else g[:, sl], scale, h0[n : n + 1], chunk_size
        )
        outs.append(o)
        finals.append(fin)
        bounds.append(bnd)
    return torch.cat(outs, 1), torch.cat(finals, 0), torch.cat(bounds, 1)
