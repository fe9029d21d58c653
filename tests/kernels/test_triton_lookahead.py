"""The sequential kernel forming each next block's W S a step ahead (`LaunchConfig.state_lookahead`: D' = U' -
(e^{G'} W' S + (W' K^T) (scaled D)), `_state_block_ahead`) against the float64 token loop and against the default path.

The two paths round differently (W' K^T and its product against W' times the updated state), so they agree to the
dtype's tolerance, not bit for bit. CPU: dk 256 / dv 512 (the state in key halves), a partial key block, n_h = 1-3 with
and without gates, grouped heads, packed sequences with one shorter than a chunk and one of a single token; GPU tests
are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import check_choice, cpu_only, needs_cuda

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 dv 512, key halves": (1, 150, 1, 1, 256, 512, 1, True, None),
    "dk 40 n_h 2, no gate": (2, 100, 2, 2, 40, 24, 2, False, None),
    "dk 96 grouped n_h 3, packed": (1, None, 1, 2, 96, 32, 3, True, [70, 5, 130, 1]),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_lookahead_matches_float64_and_the_default_path(name):
    errs = check_choice(CPU_CASES[name], torch.float32, dict(state_lookahead=True), dict())
    assert max(errs[:3]) < 1e-5, f"float32 against float64: {errs[:3]}"


@cpu_only
def test_lookahead_bf16():
    check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, dict(state_lookahead=True), dict())


@cpu_only
def test_lookahead_refuses_the_keys_path_and_the_fused_output():
    from kernels.triton_chunk import LaunchConfig, triton_delta_product
    from tests.kernels.delta_rule_cases import inputs

    q, k, v, beta, g, s0 = inputs(1, 64, 1, 1, 16, 16, 1, True, n_seq=1, device="cpu", decay=0.7)
    for other in (dict(state_keys_ws=True), dict(fuse_output=True)):
        with pytest.raises(ValueError, match="state_lookahead"):
            triton_delta_product(q, k, v, beta, g, config=LaunchConfig(state_lookahead=True, **other))


GPU_CASES = {
    "GDN default": (1, 2048, 6, 6, 256, 512, 1, True, None),
    "Qwen3-Next packed": (1, None, 16, 32, 128, 128, 1, True, [3000, 64, 1, 700, 129]),
    "DeltaProduct n_h=3": (2, 1000, 6, 6, 256, 512, 3, True, None),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, dtype", [(n, torch.bfloat16) for n in GPU_CASES] + [("GDN default", torch.float32)])
def test_gpu_lookahead_matches_float64(name, dtype):
    check_choice(GPU_CASES[name], dtype, dict(state_lookahead=True), dict(), device="cuda")
