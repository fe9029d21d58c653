"""Pick the fastest correct forward for the device: Triton on CUDA, the chunked PyTorch form elsewhere."""

from __future__ import annotations

import os

import torch

from kernels.chunk import chunk_delta_product


def delta_product_forward(q, k, v, beta, g=None, scale=None, initial_state=None, normalize_qk=False):
    """Same contract as `kernels.chunk.chunk_delta_product`; Triton on CUDA when not training.

    DELTALAB_KERNEL=torch forces the PyTorch chunked form everywhere.
    """
    use_triton = os.environ.get("DELTALAB_KERNEL", "auto") != "torch"
    half_or_single = q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if use_triton and q.is_cuda and half_or_single and not torch.is_grad_enabled():
        try:
            from kernels.triton_chunk import triton_delta_product
        except ImportError:
            triton_delta_product = None
        if triton_delta_product is not None:
            return triton_delta_product(
                q, k, v, beta, g, scale=scale, initial_state=initial_state, normalize_qk=normalize_qk
            )
    return chunk_delta_product(q, k, v, beta, g, scale=scale, initial_state=initial_state, normalize_qk=normalize_qk)
