"""The delta-rule forward's sequential kernel taking chunks two at a time (`LaunchConfig.pair_chunks`, `_state_pair`)
against the float64 token loop and against the chunk-by-chunk kernel.

CPU: TRITON_INTERPRET=1 on small shapes (odd and even chunk counts, partial last chunks, packed sequences, grouped
heads, dk = 256 in key halves, gate off, bf16); GPU tests are marked. Checks and tolerances: `delta_rule_cases`.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import check_choice, cpu_only, needs_cuda

gpu = pytest.mark.gpu
WEAK = 0.05  # log decays in (-0.05, 0) a token: states carry across chunks, so an error in a carried state shows


def _check(case: tuple, dtype: torch.dtype, device: str = "cpu") -> tuple[float, ...]:
    """Pairs on against float64 and against chunk by chunk (o, final, boundary states)."""
    B, T, Hk, Hv, K, V, gate, lengths = case
    return check_choice((B, T, Hk, Hv, K, V, 1, gate, lengths), dtype, dict(pair_chunks=True),
                        dict(pair_chunks=False), device=device, decay=WEAK)


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
