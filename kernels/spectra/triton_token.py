"""Per-token spectra for one key per token (n_h = 1) in one fused Triton pass: eig_P and eig_A of every (b, t, h).

With one key a token's P = I - b k k^T has one non-trivial eigenvalue, 1 - b |k|^2 (`kernels.spectra.householder`), and
a scalar gate multiplies every eigenvalue of A = exp(g) P by exp(g). `kernels.spectra.householder`'s torch path spends
three passes over the keys on |k|^2 (a float32 copy of them included) and a dozen small complex128 ops on the rest: 57
ms a batch of a 7B capture on a Hopper GPU. Here each program reads a block of BLOCK_R rows of keys once, in their own
dtype and strides (no copy), accumulates |k|^2 in float64 (squares of half or float32 keys are exact there), forms 1 - b
|k|^2 and exp(g) (1 - b |k|^2) in float64 and rounds once, to float32, into the complex64 outputs (imaginary parts +0).
Only CUDA tensors run compiled; under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_D, NUM_WARPS = 32, 64, 4
"""Rows (token-heads) per program, key columns per loaded tile, warps. Hopper, bf16 keys [8, 4096, 1, 32, 128] (268 MB,
one layer of a 7B capture), eig_P and eig_A: 138 us (1.9 TB/s of keys) against 2.4 ms for the torch path (eig_P by
`kernels.spectra.householder`, eig_A = eig_P exp(g) in complex128); 128 x 64 x 4 and 64 x 64 x 2 or 8 within 3%, 128
columns a tile 15-50% slower (do_bench, 100 ms a config)."""
FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@triton.jit
def _row_offsets(rows, T, H, s_b, s_t, s_h):
    """Offset of row (b, t, h) = rows (row-major over [B, T, H]) in a tensor of strides s_b, s_t, s_h."""
    h = rows % H
    bt = rows // H
    return (bt // T) * s_b + (bt % T) * s_t + h * s_h


@triton.jit
def _token_eig_kernel(K, BETA, G, EIG_P, EIG_A, N, T, H, D,
                      sk_b, sk_t, sk_h, sk_d, sb_b, sb_t, sb_h, sg_b, sg_t, sg_h,
                      HAS_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows pid * BLOCK_R ...: EIG_P[row] = 1 - b |k|^2 and EIG_A[row] = exp(g) EIG_P[row] as (re, im) float32."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < N
    k_row = _row_offsets(rows, T, H, sk_b, sk_t, sk_h)
    cols = tl.arange(0, BLOCK_D)
    norm2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        m = live[:, None] & (d < D)[None, :]
        x = tl.load(K + k_row[:, None] + d[None, :].to(tl.int64) * sk_d, mask=m, other=0.0).to(tl.float64)
        norm2 += tl.sum(x * x, axis=1)
    b = tl.load(BETA + _row_offsets(rows, T, H, sb_b, sb_t, sb_h), mask=live, other=0.0).to(tl.float64)
    lam = 1.0 - b * norm2
    zero = tl.zeros([BLOCK_R], dtype=tl.float32)
    tl.store(EIG_P + 2 * rows, lam.to(tl.float32), mask=live)
    tl.store(EIG_P + 2 * rows + 1, zero, mask=live)
    if HAS_G:
        g = tl.load(G + _row_offsets(rows, T, H, sg_b, sg_t, sg_h), mask=live, other=0.0).to(tl.float64)
        tl.store(EIG_A + 2 * rows, (tl.exp(g) * lam).to(tl.float32), mask=live)
        tl.store(EIG_A + 2 * rows + 1, zero, mask=live)


def token_eigenvalues(k: torch.Tensor, beta: torch.Tensor,
                      g: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k [B,T,1,H,K] (bf16, fp16, fp32 or fp64), beta [B,T,1,H], g [B,T,H] or None (any float dtypes and strides,
    one device) -> (eig_P, eig_A) [B,T,H,1] complex64: 1 - b |k|^2 and exp(g) (1 - b |k|^2) (eig_A None without g),
    computed in float64 and rounded once; imaginary parts +0."""
    if k.dim() != 5 or k.shape[2] != 1:
        raise ValueError(f"token_eigenvalues: k must be [B,T,1,H,K] (one key per token), got {tuple(k.shape)}")
    B, T, _, H, D = k.shape
    if tuple(beta.shape) != (B, T, 1, H):
        raise ValueError(f"token_eigenvalues: beta must be [B,T,1,H] = {(B, T, 1, H)}, got {tuple(beta.shape)}")
    if g is not None and tuple(g.shape) != (B, T, H):
        raise ValueError(f"token_eigenvalues: g must be [B,T,H] = {(B, T, H)}, got {tuple(g.shape)}")
    named = [("k", k), ("beta", beta)] + ([("g", g)] if g is not None else [])
    for name, x in named:
        if x.dtype not in FLOATS:
            raise ValueError(f"token_eigenvalues: {name} must be bf16, fp16, fp32 or fp64, got {x.dtype}")
        if x.device != k.device:
            raise ValueError(f"token_eigenvalues: {name} is on {x.device}, k on {k.device}: pass them on one device")
    eig_p = torch.empty(B, T, H, 1, dtype=torch.complex64, device=k.device)
    eig_a = torch.empty_like(eig_p) if g is not None else None
    N = B * T * H
    if N == 0:
        return eig_p, eig_a
    out_p = torch.view_as_real(eig_p)
    out_a = torch.view_as_real(eig_a) if eig_a is not None else out_p  # unused without g
    gate = g if g is not None else beta  # a placeholder pointer: HAS_G is off
    sg = (g.stride(0), g.stride(1), g.stride(2)) if g is not None else (0, 0, 0)
    block_d = min(BLOCK_D, max(16, triton.next_power_of_2(max(D, 1))))
    with torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext():  # launch on k's GPU
        _token_eig_kernel[(triton.cdiv(N, BLOCK_R),)](
            k, beta, gate, out_p, out_a, N, T, H, D,
            k.stride(0), k.stride(1), k.stride(3), k.stride(4),
            beta.stride(0), beta.stride(1), beta.stride(3),
            *sg,
            HAS_G=g is not None, BLOCK_R=BLOCK_R, BLOCK_D=block_d, num_warps=NUM_WARPS,
        )
    return eig_p, eig_a
