"""Helpers every Triton forward here shares: the block size, the interpreter switch, dot operands, the chunk ->
sequence map of packed batches, tile sizes and the SM count (`triton_chunk`, `triton_kda`)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

BLOCK = 64  # sub-steps per WY block; a chunk of 64 tokens holds n_h of them


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot_in(x, ref, F32: tl.constexpr):
    """Operand for tl.dot: ref's element type on the GPU, fp32 in the interpreter (its bf16 dot is wrong)."""
    if F32:
        return x.to(tl.float32)
    else:
        return x.to(ref.dtype.element_ty)


@triton.jit
def _load_t(Ti, rows, o_r, T_FULL: tl.constexpr):
    """A block's 64 x 64 T = (I + A)^-1 (lower triangular). T_FULL: Ti holds zeros above the diagonal, so the load
    needs no mask, and Triton pipelines (cp.async) only loads whose mask is constant along a row's 16-byte runs."""
    if T_FULL:
        return tl.load(Ti + rows[:, None] * 64 + o_r[None, :])
    else:
        return tl.load(Ti + rows[:, None] * 64 + o_r[None, :], mask=o_r[:, None] >= o_r[None, :], other=0.0)


@triton.jit
def _chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within it, its first token (int64), its length) of global chunk gc."""
    if IS_VARLEN:
        i_n = tl.load(cidx + gc).to(tl.int32)
        c = gc - tl.load(coff + i_n).to(tl.int32)
        bos = tl.load(cu + i_n).to(tl.int64)
        Tn = (tl.load(cu + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        NCH = tl.cdiv(T, 64)
        i_n = gc // NCH
        c = gc % NCH
        bos = i_n.to(tl.int64) * T
        Tn = T
    return i_n, c, bos, Tn


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@functools.cache
def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
