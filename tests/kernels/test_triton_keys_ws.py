"""The sequential kernel forming W S from the keys and T (`LaunchConfig.state_keys_ws`: W S = T diag(c) (K S), W never
written) against the float64 token loop and against the default path that reads W (`delta_rule_cases`).

The two paths round differently (K S and T's product against W's rows), so they agree to the dtype's tolerance, not
bit for bit. CPU: dk 256 / dv 512 (the state in key halves), a partial key block, n_h = 1-3 with gates, grouped heads,
packed sequences with one shorter than a chunk, the fused output; GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import GPU_REAL_CASES, GPU_REAL_RUNS, check_choice, cpu_only, needs_cuda

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 dv 512, key halves": (1, 150, 1, 1, 256, 512, 1, True, None),
    "dk 40 n_h 2, no gate": (2, 100, 2, 2, 40, 24, 2, False, None),
    "dk 96 grouped n_h 3, packed": (1, None, 1, 2, 96, 32, 3, True, [70, 5, 130]),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_keys_ws_matches_float64_and_the_w_path(name):
    errs = check_choice(CPU_CASES[name], torch.float32, dict(state_keys_ws=True), dict(state_keys_ws=False))
    assert max(errs[:3]) < 1e-5, f"float32 against float64: {errs[:3]}"


@cpu_only
def test_keys_ws_fused_output_bf16():
    check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, dict(state_keys_ws=True, fuse_output=True),
                 dict(fuse_output=True))




@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, dtype", GPU_REAL_RUNS)
def test_gpu_keys_ws_matches_float64(name, dtype):
    """At two pipeline stages, as default_config launches it."""
    check_choice(GPU_REAL_CASES[name], dtype, dict(state_keys_ws=True, state_stages=2), dict(), device="cuda")
