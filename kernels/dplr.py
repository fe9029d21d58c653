"""Forward dispatcher for the generalised delta rule (diagonal-plus-rank-one transitions, RWKV-7).

There is no Triton DPLR kernel yet: every device (CPU and CUDA) runs the chunked PyTorch form
`kernels.dplr_chunk.chunk_dplr`, with gradients allowed (training on the CPU uses it). A Triton path would slot
in here behind the same contract, as `kernels.dispatch.delta_product_forward` does for the delta product.
"""

from __future__ import annotations

import torch

from kernels.constants import CHUNK_SIZE
from kernels.dplr_chunk import chunk_dplr

__all__ = ["dplr_forward"]


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
    """(o [B,T,H,V], final [N,H,K,V], boundaries [B,NB,H,K,V]) of H_t = (diag(e^g_t) + b_t a_t^T) H_{t-1} +
    k_t v_t^T, o_t = scale H_t^T q_t; the contract of `kernels.dplr_naive.naive_dplr`."""
    return chunk_dplr(q, k, v, a, b, g, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                      chunk_size=chunk_size)
