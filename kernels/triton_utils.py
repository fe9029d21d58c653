"""Helpers every Triton forward here shares: the block size, the interpreter switch, dot operands, the chunk ->
sequence map of packed batches and its host-side tables, tile sizes, the SM count and the launch of a sequential
kernel with all its programs resident (`delta_rule.triton_chunk`, `delta_rule.triton_kda`)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from deltalab.kernels.constants import CHUNK_SIZE

BLOCK = 64  # sub-steps per WY block; a chunk of 64 tokens holds n_h of them
SMEM_PER_SM = 225 * 1024  # shared memory a sequential kernel's resident programs may take (Hopper: 227 KiB)


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dot_in(x, ref, F32: tl.constexpr):
    """Operand for tl.dot: ref's element type on the GPU, fp32 in the interpreter (its bf16 dot is wrong)."""
    if F32:
        return x.to(tl.float32)
    else:
        return x.to(ref.dtype.element_ty)


@triton.jit
def load_t(Ti, rows, o_r):
    """A block's 64 x 64 T = (I + A)^-1, lower triangular with zeros stored above the diagonal, so the load needs no
    mask: Triton pipelines (cp.async) only loads whose mask is constant along a row's 16-byte runs."""
    return tl.load(Ti + rows[:, None] * 64 + o_r[None, :])


@triton.jit
def chunk_seq(gc, T, cu, cidx, coff, IS_VARLEN: tl.constexpr):
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


def pow2(n: int) -> int:
    """The tile that covers n: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of GPU 0 (132, as on Hopper, without CUDA: the interpreter's tile choices)."""
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


_VARLEN_CACHE: list[tuple[torch.Tensor, int, torch.device, tuple]] = []  # most recent first
_VARLEN_CACHE_SIZE = 8


def varlen_tables(cu_seqlens: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(cu int32, sequence of each global chunk, first global chunk of each sequence [N+1], sequences
    longest first, total chunks). Building them syncs with the GPU (the grids need the chunk count), so the
    tables of the last few cu_seqlens tensors are kept, keyed by the tensor itself (held, so its identity
    cannot pass to another) and its in-place version: every layer of a packed forward reuses them."""
    for i, (t, version, d, tables) in enumerate(_VARLEN_CACHE):
        if t is cu_seqlens and version == cu_seqlens._version and d == dev:
            _VARLEN_CACHE.insert(0, _VARLEN_CACHE.pop(i))
            return tables
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    n_chunks = (cu.diff() + CHUNK_SIZE - 1) // CHUNK_SIZE
    coff = torch.nn.functional.pad(n_chunks.cumsum(0), (1, 0)).to(torch.int32)
    nct = int(coff[-1])  # one host sync: the grids need it
    seq = torch.arange(n_chunks.numel(), device=dev, dtype=torch.int32)
    cidx = seq.repeat_interleave(n_chunks, output_size=nct)
    order = torch.argsort(n_chunks, descending=True, stable=True).to(torch.int32)
    tables = (cu, cidx, coff, order, nct)
    _VARLEN_CACHE.insert(0, (cu_seqlens, cu_seqlens._version, dev, tables))
    del _VARLEN_CACHE[_VARLEN_CACHE_SIZE:]
    return tables


def launch_resident(kernel, grid: tuple[int, int], args: tuple, consts: dict, smem_per_stage: int, *, stages: int,
                    warps: int, resident_per_sm: int | None = None) -> None:
    """Launch a sequential kernel with as many pipeline stages (at most `stages`, at least one) as the shared memory
    of its resident programs allows: `resident_per_sm` a SM, or ceil(programs / SMs) when None (all at once, one
    wave). A compile that runs out of shared memory anyway retries at one stage."""
    per_sm = -(-grid[0] * grid[1] // num_sms())
    if resident_per_sm is not None:
        per_sm = min(per_sm, resident_per_sm)
    stages = max(1, min(stages, SMEM_PER_SM // max(per_sm * smem_per_stage, 1)))
    try:
        kernel[grid](*args, num_warps=warps, num_stages=stages, **consts)
    except OutOfResources:
        if stages == 1:
            raise
        kernel[grid](*args, num_warps=warps, num_stages=1, **consts)
