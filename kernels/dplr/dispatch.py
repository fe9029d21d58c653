"""Forward dispatcher for the generalised delta rule (diagonal-plus-rank-one transitions, RWKV-7).

On CUDA, without gradients, for bfloat16/float16 inputs it runs fla's chunked kernel (`kernels.dplr.fla`,
where flash-linear-attention is importable): our Triton kernels take tied rank-one removals (k k^T beta), not
the two free vectors of diag(e^g) + b a^T. Everywhere else it runs the chunked PyTorch form
`kernels.dplr.chunk.chunk_dplr` (differentiable: training uses it), after one warning where fla is absent or
does not take the shape. float32 stays on the chunked form: fla's Triton dots on float32 inputs run in TF32
(Triton's default precision), ~1e-3 relative, while float32 analyses and fixture checks rely on ~1e-6.
DELTALAB_KERNEL=torch forces the PyTorch form, as for `kernels.delta_rule.dispatch.delta_product_forward`.
"""

from __future__ import annotations

import os
import warnings

import torch

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.dplr import fla as dplr_fla
from deltalab.kernels.dplr.chunk import chunk_dplr
from deltalab.kernels.dplr.naive import check_dplr_inputs

__all__ = ["dplr_forward"]

_warned: set[str] = set()


def _fla_wanted(q: torch.Tensor) -> bool:
    """The fast-path condition: half-precision CUDA inputs, no autograd graph being built, not forced to PyTorch."""
    forced_torch = os.environ.get("DELTALAB_KERNEL", "auto") == "torch"
    half = q.dtype in (torch.bfloat16, torch.float16)
    return q.is_cuda and half and not torch.is_grad_enabled() and not forced_torch


def dplr_forward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The generalised delta rule H_t = (diag(e^g_t) + b_t a_t^T) H_{t-1} + k_t v_t^T, o_t = scale H_t^T q_t, as
    the RWKV-7 model runs it: fla's chunk_dplr_delta_rule on CUDA for bf16/fp16 when fla is importable, else
    `chunk_dplr` (one warning naming why).

    Args:
        q (torch.Tensor): queries `[B, T, H, K]`.
        k (torch.Tensor): keys `[B, T, H, K]` (written as k v^T).
        v (torch.Tensor): values `[B, T, H, V]`.
        a (torch.Tensor): `[B, T, H, K]`, the read side of the rank-one term b a^T (RWKV-7: -kappa).
        b (torch.Tensor): `[B, T, H, K]`, its write side (RWKV-7: kappa * a).
        g (torch.Tensor | None): per-channel log decays `[B, T, H, K]`; None: no decay.
        scale (float): read-out scale.
        initial_state (torch.Tensor | None): `[N, H, K, V]` states before the first token; None: zeros.
        cu_seqlens (torch.Tensor | None): `[N + 1]` rising token offsets of packed sequences (then B = 1).
        chunk_size (int): tokens per chunk, which sets the boundary states' spacing.

    Returns:
        o (torch.Tensor): outputs `[B, T, H, V]`.
        final_state (torch.Tensor): `[N, H, K, V]`.
        boundary_states (torch.Tensor): `[B, NB, H, K, V]`, the state before tokens 0, C, 2C, ... and the final
            state (NB = ceil(T / C) + 1; packed: the per-sequence layout of `kernels.delta_rule.naive`).
    """
    args = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if _fla_wanted(q):
        check_dplr_inputs(q, k, v, a, b, g, initial_state, cu_seqlens)  # malformed inputs raise on every path
        kernel = dplr_fla.load_fla_kernel()
        why = "fla is not importable" if kernel is None else dplr_fla.unsupported_reason(q, v)
        if why is None:
            return dplr_fla.fla_dplr(q, k, v, a, b, g, kernel=kernel, **args)
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"dplr_forward: fla's chunk_dplr_delta_rule not used ({why}); using the PyTorch "
                          "chunked form", stacklevel=2)
    return chunk_dplr(q, k, v, a, b, g, **args)
