"""The delta-rule output kernel with its key-block tiles loaded one block ahead (`LaunchConfig.out_prefetch`) against
the float64 token loop and against the default loop (o, final and boundary states; `delta_rule_cases`).

The two loops run the same products in the same order, so under the interpreter o is bit-identical; on the GPU
the comparison is to the dtype's tolerance. CPU: several key blocks, a partial last block (dk 40, 96), n_h = 1-3,
packed sequences with one shorter than a chunk, bf16; GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import check_choice, cpu_only, needs_cuda

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 dv 512: four key blocks": (1, 150, 1, 1, 256, 512, 1, True, None),
    "dk 40, n_h 2: one partial block": (1, 100, 2, 2, 40, 24, 2, True, None),
    "dk 96 grouped n_h 3, packed": (1, None, 1, 2, 96, 32, 3, True, [70, 5, 130]),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_prefetch_equals_the_default_loop(name):
    errs = check_choice(CPU_CASES[name], torch.float32, dict(out_prefetch=True), dict(out_prefetch=False))
    assert errs[3] == 0.0, f"o differs from the default loop's by {errs[3]:.2e} (same products, same order)"


@cpu_only
def test_prefetch_bf16_matches_float64():
    errs = check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, dict(out_prefetch=True),
                        dict(out_prefetch=False))
    assert errs[3] == 0.0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("warps", [4])  # 8 warps: slower (0.774 ms against 0.561 at GDN default)
@pytest.mark.parametrize(
    "case",
    [(1, 2048, 6, 6, 256, 512, 1, True, None), (1, None, 16, 32, 128, 128, 1, True, [3000, 64, 1, 700, 129]),
     (2, 1000, 6, 6, 256, 512, 3, True, None)],
    ids=["GDN default", "Qwen3-Next packed", "DeltaProduct n_h=3"],
)
def test_gpu_prefetch_matches_float64(case, warps):
    check_choice(case, torch.bfloat16, dict(out_prefetch=True, out_warps=warps), dict(out_warps=warps),
                 device="cuda")
