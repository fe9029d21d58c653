"""The delta-rule forward's sequential kernel taking chunks two at a time (`LaunchConfig.pair_chunks`, `_state_pair`)
against the float64 token loop and against the chunk-by-chunk kernel.

CPU: TRITON_INTERPRET=1 on small shapes (odd and even chunk counts, partial last chunks, packed sequences, grouped
heads, dk = 256 in key halves, gate off, bf16); GPU tests are marked. Errors are max |ours - ref| / max |ref| with
the tolerances of tests/kernels/test_triton_shapes.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.naive import naive_delta_product

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 8e-3}

cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU without TRITON_INTERPRET")
gpu = pytest.mark.gpu


def _inputs(B, T, Hk, Hv, K, V, gate, n_seq=None, device="cpu", seed=0):
    """Random inputs with one key a token, beta in (0, 2), log decays in (-0.05, 0); an initial state per sequence."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen)
    k = torch.randn(B, T, 1, Hk, K, generator=gen)
    v = torch.randn(B, T, 1, Hv, V, generator=gen)
    beta = torch.rand(B, T, 1, Hv, generator=gen) * 2
    g = -torch.rand(B, T, Hv, generator=gen) * 0.05 if gate else None  # weak: states carry across chunks
    s0 = torch.randn(n_seq or B, Hv, K, V, generator=gen) * 0.3
    return [x.to(device) if x is not None else None for x in (q, k, v, beta, g, s0)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _cu(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _check(case: tuple, dtype: torch.dtype, device: str = "cpu") -> tuple[float, ...]:
    """Pairs on against float64 (o, final, boundary states) and against pairs off (o, final, boundary)."""
    from kernels.triton_chunk import LaunchConfig, triton_delta_product

    B, T, Hk, Hv, K, V, gate, lengths = case
    T = sum(lengths) if lengths else T
    N = len(lengths) if lengths else B
    q, k, v, beta, g, s0 = _inputs(B, T, Hk, Hv, K, V, gate, n_seq=N, device=device)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cu = _cu(lengths, device) if lengths else None
    run = dict(initial_state=s0, normalize_qk=True, cu_seqlens=cu)
    o, fin, bnd = triton_delta_product(q, k, v, beta, g, config=LaunchConfig(pair_chunks=True), **run)
    o0, fin0, bnd0 = triton_delta_product(q, k, v, beta, g, config=LaunchConfig(pair_chunks=False), **run)
    d = torch.float64
    ro, rfin, rbnd = naive_delta_product(
        q.to(d), k.to(d), v.to(d), beta.to(d), None if g is None else g.to(d), initial_state=s0.to(d),
        normalize_qk=True, cu_seqlens=None if cu is None else cu.cpu(),
    )  # fmt: skip
    assert o.shape == (B, T, Hv, V) and o.dtype == dtype and fin.shape == (N, Hv, K, V) and bnd.shape == rbnd.shape
    errs = _rel(o, ro), _rel(fin, rfin), _rel(bnd, rbnd)
    assert max(errs) < TOL[dtype], f"{case} {dtype}: rel errors o/final/boundary vs float64 {errs}"
    diff = _rel(o, o0), _rel(fin, fin0), _rel(bnd, bnd0)  # the two paths differ by rounding only
    assert max(diff) < TOL[dtype] / 2, f"{case} {dtype}: rel differences o/final/boundary from pairs off {diff}"
    return (*errs, *diff)


# ---------------------------------------------------------------- interpreter

# (B, T or None, Hk, Hv, K, V, gate, lengths or None)
CPU_CASES = {
    "five chunks, partial last": (2, 300, 2, 2, 32, 16, True, None),
    "four chunks": (1, 256, 1, 1, 16, 32, True, None),
    "one chunk (no pair)": (1, 40, 1, 1, 16, 16, True, None),
    "grouped Hk<Hv, gate off": (1, 200, 1, 2, 32, 16, False, None),
    "dk=256 dv=512 (key halves)": (1, 150, 1, 1, 256, 512, True, None),
    "varlen, odd and even chunk counts": (1, None, 1, 2, 16, 16, True, [70, 20, 0, 200, 5, 128]),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_pairs_fp32_match_float64_and_chunk_by_chunk(name):
    _check(CPU_CASES[name], torch.float32)


@cpu_only
def test_pairs_bf16_varlen_grouped():
    _check(CPU_CASES["varlen, odd and even chunk counts"], torch.bfloat16)


@cpu_only
def test_pairs_are_ignored_where_they_do_not_apply():
    """n_h = 2 (blocks chained within a chunk) runs chunk by chunk with pair_chunks on: identical results."""
    from kernels.triton_chunk import LaunchConfig, triton_delta_product

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 130, 1, 16, generator=gen)
    k = torch.randn(1, 130, 2, 1, 16, generator=gen)
    v = torch.randn(1, 130, 2, 1, 16, generator=gen)
    beta = torch.rand(1, 130, 2, 1, generator=gen) * 2
    g = -torch.rand(1, 130, 1, generator=gen)
    a = triton_delta_product(q, k, v, beta, g, normalize_qk=True, config=LaunchConfig(pair_chunks=True))
    b = triton_delta_product(q, k, v, beta, g, normalize_qk=True, config=LaunchConfig(pair_chunks=False))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- GPU (run on the device)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [(2, 2048, 8, 8, 128, 128, True, None), (1, 4100, 16, 32, 128, 128, True, None),
     (1, 1000, 6, 6, 256, 512, True, None), (1, None, 16, 32, 128, 128, True, [3000, 64, 1, 700, 129])],
    ids=["grid", "Qwen3-Next, partial chunk", "GDN default", "packed"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_pairs_match_float64(case, dtype):
    _check(case, dtype, device="cuda")
