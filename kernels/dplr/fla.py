"""fla 0.6.0's chunked generalised-delta-rule kernel behind the `kernels.dplr.naive` contract (CUDA, no grad).

Our Triton chunk kernels (`kernels.delta_rule.triton_kda`) take a diagonal decay plus a rank-one *removal* k k^T beta
whose two vectors are tied; the DPLR transition diag(e^g) + b a^T of RWKV-7 has two free vectors and a rank-one
term that reads the undecayed state, so it does not fit them. On CUDA `kernels.dplr.dispatch.dplr_forward` therefore
calls fla's `chunk_dplr_delta_rule`, imported lazily (fla stays an optional dependency).

Argument mapping (fla 0.6.0, `fla/ops/generalized_delta_rule/dplr`): inputs [B, T, H, K] / [B, T, H, V] as
ours; fla's state S is [N, H, K, V] like ours and follows S <- S * e^{gk} + k v^T + b (a^T S) (`dplr_recurrence`),
so a -> a, b -> b, g (log decay per key channel, None meaning 0) -> gk, scale -> scale (explicit: fla's
default is K^-1/2), initial_state -> initial_state (float32), cu_seqlens -> cu_seqlens (int64).

fla returns no chunk-boundary states, and we need the state before every C-th token. They are rebuilt exactly
from two more fla calls over the sequences cut into C-token segments (one packed batch, all segments at once):
with zero initial state each segment's final state is F_s, its inhomogeneous part; with k = v = 0 and the
identity as initial state it is the segment's transition P_s = prod (diag(e^g) + b a^T) (the state map is
linear). Then boundary_{c+1} = P_c boundary_c + F_c, a scan of ceil(T/C) small K x K products per sequence.
This costs about three forward passes on the GPU and no PyTorch chunk loop; running fla per segment with the
previous final state would need ceil(T/C) dependent launches per call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.dplr.naive import check_dplr_inputs

__all__ = ["fla_dplr", "load_fla_kernel", "unsupported_reason"]

MAX_HEAD_DIM = 256
"""fla's state kernel holds one key block of at most 256 channels (it asserts BK <= 256)."""


def load_fla_kernel() -> Callable | None:
    """fla's `chunk_dplr_delta_rule`, or None where fla is not importable."""
    try:
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
    except ImportError:
        return None
    return chunk_dplr_delta_rule


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why fla's kernel cannot take these inputs (a short phrase), or None where it can."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype} (fla takes bfloat16, float16, float32)"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims K={q.shape[-1]}, V={v.shape[-1]} above {MAX_HEAD_DIM}"
    return None


def _call(kernel, q, k, v, a, b, gk, scale, h0, cu, final):
    """One fla call; its float32 advisory warning is silenced (we test float32 against float64 ourselves)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*float32.*", category=RuntimeWarning)
        return kernel(q, k, v, a, b, gk, scale=scale, initial_state=h0, output_final_state=final, cu_seqlens=cu)


def fla_dplr(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor | None,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    kernel: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B,T,H,V], final [N,H,K,V], boundaries) of `kernels.dplr.naive.naive_dplr` through fla's kernel.

    `kernel` defaults to fla's `chunk_dplr_delta_rule` (tests pass a stand-in). o comes back in q's dtype,
    states in float32.
    """
    N, H, K, V = check_dplr_inputs(q, k, v, a, b, g, initial_state, cu_seqlens)
    kernel = kernel or load_fla_kernel()
    if kernel is None:
        raise ImportError("fla_dplr needs flash-linear-attention 0.6 (pip install flash-linear-attention)")
    B, T = q.shape[:2]
    dev, dt = q.device, q.dtype
    k, v, a, b = (x.to(dt) for x in (k, v, a, b))
    gk = torch.zeros_like(q, dtype=torch.float32) if g is None else g.float()  # fla cumsums it in float32
    h0 = q.new_zeros(N, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    lengths = [T] * B if cu_seqlens is None else torch.as_tensor(cu_seqlens).diff().tolist()
    full = [n for n, L in enumerate(lengths) if L > 0]  # fla gets no empty sequences

    o = q.new_zeros(B, T, H, V)
    if full and cu_seqlens is None:
        o = _call(kernel, q, k, v, a, b, gk, scale, h0, None, False)[0]
    elif full:
        cu_full = torch.tensor([0] + [lengths[n] for n in full], device=dev).cumsum(0)
        o = _call(kernel, q, k, v, a, b, gk, scale, h0[full].contiguous(), cu_full, False)[0]
    boundaries = _boundaries(kernel, q, k, a, b, gk, v, scale, h0, lengths, chunk_size)
    rows = torch.tensor([0] + [-(-L // chunk_size) + 1 for L in lengths]).cumsum(0)
    final = boundaries[rows[1:] - 1]
    if cu_seqlens is None:
        return o.to(dt), final, boundaries.view(B, -1, H, K, V)
    return o.to(dt), final, boundaries[None]


def _boundaries(kernel, q, k, a, b, gk, v, scale, h0, lengths, chunk_size) -> torch.Tensor:
    """Every sequence's states before tokens 0, C, 2C, ... and its final state, rows in sequence order."""
    N, H, K, V = h0.shape
    flat = [x.reshape(1, -1, *x.shape[2:]) for x in (q, k, a, b, gk)]
    segs = [[min(L, s + chunk_size) - s for s in range(0, L, chunk_size)] for L in lengths]
    sizes = [s for seq in segs for s in seq]
    first = torch.tensor([0] + [len(seq) for seq in segs]).cumsum(0).tolist()  # segment index of each sequence
    count = [len(seq) for seq in segs]
    out = h0.new_empty(sum(count) + N, H, K, V)
    state = h0.clone()
    rows = torch.tensor([0] + [c + 1 for c in count]).cumsum(0)[:-1].to(h0.device)
    out[rows] = state
    if not sizes:
        return out
    cu = torch.tensor([0] + sizes, device=q.device).cumsum(0)
    fq, fk, fa, fb, fg = flat
    inhom = _call(kernel, fq, fk, v.reshape(1, -1, H, V), fa, fb, fg, scale, None, cu, True)[1]
    eye = torch.eye(K, device=q.device, dtype=torch.float32).expand(len(sizes), H, K, K).contiguous()
    kz = torch.zeros_like(fk)
    trans = _call(kernel, fq, kz, v.new_zeros(1, fq.shape[1], H, K), fa, fb, fg, scale, eye, cu, True)[1]
    for c in range(max(count)):
        live = [n for n in range(N) if count[n] > c]
        seg = torch.tensor([first[n] + c for n in live], device=q.device)
        idx = torch.tensor(live, device=q.device)
        state[idx] = trans[seg].float() @ state[idx] + inhom[seg].float()
        out[rows[idx] + c + 1] = state[idx]
    return out
