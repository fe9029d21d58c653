"""State ranks over time for the generalised delta rule (DPLR transitions, RWKV-7), as `kernels.ranks.chunk` does for
the delta product: chunk c is replayed token by token from its boundary state (the state before token c*C),
H <- e^{g} * H + b (a^T H) + k v^T, a group of chunks at a time; the states become metrics in a batch and are
dropped. Metrics, singular-value methods and precision are `kernels.ranks.chunk`'s (`state_metrics`).
"""

from __future__ import annotations

import torch

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.dplr.naive import check_dplr_inputs
from deltalab.kernels.ranks.chunk import RankMetrics, check_choice, full_precision, ranks_at_boundaries, state_metrics

__all__ = ["dplr_replay_chunks", "dplr_state_rank_metrics"]


def dplr_replay_chunks(start: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       g: torch.Tensor | None) -> torch.Tensor:
    """States after every token of a group of chunks: start [N, H, K, V]; k, a, b, g [N, L, H, K]; v [N, L, H, V]
    -> [L, N, H, K, V] (time first), three batched GEMMs per token."""
    N, L, H, K = k.shape
    V = v.shape[-1]
    M, dtype = N * H, k.dtype

    def rows(x: torch.Tensor) -> torch.Tensor:  # [N, L, H, D] -> [L, M, D]
        return x.to(dtype).permute(1, 0, 2, 3).reshape(L, M, x.shape[-1])

    kk, vv, aa, bb = rows(k), rows(v), rows(a), rows(b)
    gate = None if g is None else rows(g).exp()[..., None]  # [L, M, K, 1]: decays the key rows
    out = torch.empty(L, N, H, K, V, dtype=dtype, device=k.device)
    state = start.to(dtype).reshape(M, K, V)
    for t in range(L):
        read = torch.bmm(aa[t][:, None, :], state)  # a^T H  [M, 1, V]
        nxt = state * gate[t] if gate is not None else state.clone()
        nxt = torch.baddbmm(nxt, bb[t][:, :, None], read)
        state = torch.baddbmm(nxt, kk[t][:, :, None], vv[t][:, None, :], out=out[t].view(M, K, V))
    return out


def dplr_state_rank_metrics(
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor | None,
    boundary_states: torch.Tensor | None,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    method: str = "auto",
    backend: str = "auto",
    max_states: int | None = None,
    every: int = 1,
) -> RankMetrics:
    """Rank metrics [B, T, H] of the state after every token (`every=N`: only after tokens N-1, 2N-1, ...;
    the others are NaN), as `kernels.ranks.chunk.state_rank_metrics`.

    k, a, b, g [B,T,H,K] (g None: no decay), v [B,T,H,V] as given to `kernels.dplr.naive.naive_dplr`;
    boundary_states [B,NC,H,K,V] as the DPLR forwards return them (None: computed here with `chunk_dplr` from
    initial_state). Replayed in float32 (float64 if the boundary states are float64), in groups of about
    `max_states` states (default 32768 on CUDA, 8192 otherwise).
    """
    if every < 1:
        raise ValueError(f"every={every}: pass a positive token stride")
    check_dplr_inputs(k, k, v, a, b, g, initial_state)
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    n_chunks = -(-T // C)
    if boundary_states is None:
        from deltalab.kernels.dplr.chunk import chunk_dplr

        dt = torch.float64 if k.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            boundary_states = chunk_dplr(torch.zeros_like(k, dtype=dt), k, v, a, b, g, scale=1.0,
                                         initial_state=initial_state, chunk_size=C)[2]
    if boundary_states.dim() != 5 or boundary_states.shape[0] != B or boundary_states.shape[2:] != (H, K, V):
        raise ValueError(f"boundary_states must be [B,NC,H,K,V] = [{B},NC,{H},{K},{V}], "
                         f"got {tuple(boundary_states.shape)}")
    if boundary_states.shape[1] < n_chunks:
        raise ValueError(f"boundary_states has {boundary_states.shape[1]} chunk states, T={T} needs {n_chunks} "
                         f"(one per {C} tokens); pass the kernel's boundary states and chunk_size")
    check_choice(method, backend)
    if every > 1 and every % C == 0 and boundary_states.shape[1] > T // C:
        return ranks_at_boundaries(boundary_states, T, C, every, method, backend)
    dtype = torch.float64 if boundary_states.dtype == torch.float64 else torch.float32
    pad = n_chunks * C - T

    def per_chunk(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B * NC, C, H, D]
        x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, pad))
        return x.reshape(B * n_chunks, C, H, x.shape[-1])

    k, v, a, b = (per_chunk(x) for x in (k, v, a, b))
    g = None if g is None else per_chunk(g)
    starts = boundary_states[:, :n_chunks].reshape(B * n_chunks, H, K, V)
    max_states = max_states or (32768 if k.is_cuda else 8192)
    group = max(1, max_states // (C * H))
    n_fields = len(RankMetrics._fields)
    out = torch.full((n_fields, B * n_chunks, C, H), float("nan"), dtype=dtype, device=k.device)
    t_all = (torch.arange(B * n_chunks, device=k.device) % n_chunks)[:, None] * C + torch.arange(C, device=k.device)
    keep_all = ((t_all + 1) % every == 0) & (t_all < T)  # [B * NC, C]
    with full_precision():
        for c0 in range(0, B * n_chunks, group):
            c1 = min(B * n_chunks, c0 + group)
            keep = keep_all[c0:c1]
            if not bool(keep.any()):
                continue
            states = dplr_replay_chunks(starts[c0:c1], k[c0:c1], v[c0:c1], a[c0:c1], b[c0:c1],
                                        None if g is None else g[c0:c1])  # [C, n, H, K, V]
            picked = states.transpose(0, 1)[keep]  # [kept, H, K, V]
            part = out[:, c0:c1]
            part[:, keep] = torch.stack(state_metrics(picked, method, backend)).to(dtype)
            del states
    out = out.reshape(n_fields, B, n_chunks * C, H)[:, :, :T]
    return RankMetrics(*out.unbind(0))
