"""Pick the fastest correct forward for the device: Triton on CUDA, the chunked PyTorch form elsewhere."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable

import torch

from deltalab.kernels.delta_rule.chunk import chunk_delta_product
from deltalab.kernels.delta_rule.naive import check_inputs


def triton_path(q, k, v, g) -> tuple[Callable | None, str | None]:
    """(the Triton forward that takes these valid inputs, None), or (None, why not); (None, None) without Triton.

    Per-channel gates g [B,T,Hv,K] go to `triton_kda` (n_h = 1), scalar or no gates to `triton_delta_product`.
    """
    try:
        from deltalab.kernels.delta_rule import triton_chunk, triton_kda
    except ImportError:
        return None, None
    if g is not None and g.dim() == 4:
        why = triton_kda.unsupported_reason(q, k, v)
        return (triton_kda.triton_kda if why is None else None), why
    why = triton_chunk.unsupported_reason(q, v)
    return (triton_chunk.triton_delta_product if why is None else None), why


def delta_product_forward(
    q, k, v, beta, g=None, scale=None, initial_state=None, normalize_qk=False, cu_seqlens=None
):  # fmt: skip
    """Same contract as `kernels.delta_rule.chunk.chunk_delta_product` (grouped heads, cu_seqlens, scalar or per-channel
    gates); Triton on CUDA when not training. A shape the Triton paths do not take runs the PyTorch form after
    one warning naming it.

    DELTALAB_KERNEL=torch forces the PyTorch chunked form everywhere.
    """
    use_triton = os.environ.get("DELTALAB_KERNEL", "auto") != "torch"
    half_or_single = q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    args = dict(scale=scale, initial_state=initial_state, normalize_qk=normalize_qk, cu_seqlens=cu_seqlens)
    if use_triton and q.is_cuda and half_or_single and not torch.is_grad_enabled():
        check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)  # malformed inputs raise on every path
        forward, why = triton_path(q, k, v, g)
        if forward is not None:
            # Triton launches on the current device's stream: a layer on another GPU (a model spread over GPUs
            # with accelerate) would run on the wrong stream, racing the work that produced its inputs
            guard = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
            with guard:  # (the interpreter's tests run CPU tensors that claim to be on CUDA)
                return forward(q, k, v, beta, g, **args)
        if why is not None:
            warnings.warn(
                f"delta_product_forward: Triton path does not take q {tuple(q.shape)}, v {tuple(v.shape)} ({why});"
                " using the PyTorch chunked form",
                stacklevel=2,
            )
    return chunk_delta_product(q, k, v, beta, g, **args)
