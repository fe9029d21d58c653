"""Pick the fastest correct forward for the device: Triton on CUDA, the chunked PyTorch form elsewhere."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable

import torch

from deltalab.kernels.delta_rule.chunk import chunk_delta_product
from deltalab.kernels.delta_rule.naive import check_inputs


def triton_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor | None) -> tuple[Callable | None, str | None]:
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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delta-product forward the models run: Triton on CUDA when not training (bf16, fp16, fp32 inputs), the
    chunked PyTorch form (`chunk_delta_product`) elsewhere. A shape the Triton paths do not take runs the PyTorch
    form after one warning naming it; DELTALAB_KERNEL=torch forces the PyTorch form everywhere.

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
        normalize_qk (bool): L2-normalise q and k first (fla's in-kernel norm, eps 1e-6).
        cu_seqlens (torch.Tensor | None): `[N + 1]` rising token offsets of packed sequences (then B = 1); None:
            N = B sequences of T tokens.

    Returns:
        o (torch.Tensor): outputs `[B, T, Hv, V]`.
        final_state (torch.Tensor): `[N, Hv, K, V]`, the state after each sequence's last token.
        boundary_states (torch.Tensor): `[B, NB, Hv, K, V]`, the state before tokens 0, C, 2C, ... of each sequence
            and then its final state (C = CHUNK_SIZE, NB = ceil(T / C) + 1 without cu_seqlens; packed: rows
            `boundary_offsets(cu_seqlens)[n]:[n + 1]` hold sequence n's).
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
