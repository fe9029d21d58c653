"""Pick the fastest correct forward for the device: Triton on CUDA, the chunked PyTorch form elsewhere."""

from __future__ import annotations

import os
import warnings

import torch

from kernels.chunk import chunk_delta_product
from kernels.naive import check_inputs


def delta_product_forward(
    q, k, v, beta, g=None, scale=None, initial_state=None, normalize_qk=False, cu_seqlens=None
):  # fmt: skip
    """Same contract as `kernels.chunk.chunk_delta_product` (grouped heads, cu_seqlens); Triton on CUDA when
    not training. A shape the Triton path does not take runs the PyTorch form after one warning naming it.

    DELTALAB_KERNEL=torch forces the PyTorch chunked form everywhere.
    """
    use_triton = os.environ.get("DELTALAB_KERNEL", "auto") != "torch"
    half_or_single = q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    args = dict(scale=scale, initial_state=initial_state, normalize_qk=normalize_qk, cu_seqlens=cu_seqlens)
    if use_triton and q.is_cuda and half_or_single and not torch.is_grad_enabled():
        try:
            from kernels import triton_chunk
        except ImportError:
            triton_chunk = None
        if triton_chunk is not None:
            check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)  # malformed inputs raise on every path
            channel_gate = g is not None and g.dim() == 4
            why = "per-channel gate g [B,T,Hv,K]" if channel_gate else triton_chunk.unsupported_reason(q, v)
            if why is None:
                return triton_chunk.triton_delta_product(q, k, v, beta, g, **args)
            warnings.warn(
                f"delta_product_forward: Triton path does not take q {tuple(q.shape)}, v {tuple(v.shape)} ({why});"
                " using the PyTorch chunked form",
                stacklevel=2,
            )
    return chunk_delta_product(q, k, v, beta, g, **args)
