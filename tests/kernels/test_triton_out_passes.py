"""The delta-rule output kernel with each further WY block's q K^T in a pass of its own (n_h > 1,
`LaunchConfig.out_block_passes`) against the float64 token loop and against the default loop (`delta_rule_cases`).

Each block's q K^T sums the same products over the key blocks in the same order, and o takes them in the same order, so
under the interpreter o is bit-identical to the default loop; on the GPU the comparison is to the dtype's tolerance.
CPU: n_h = 2 and 3, several key blocks and a partial one, grouped heads, packed sequences with one shorter than a chunk,
bf16; GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import check_choice, cpu_only, needs_cuda

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 dv 512 n_h 2: four key blocks": (1, 150, 1, 1, 256, 512, 2, True, None),
    "dk 40 n_h 2: one partial block, no gate": (2, 100, 2, 2, 40, 24, 2, False, None),
    "dk 96 grouped n_h 3, packed": (1, None, 1, 2, 96, 32, 3, True, [70, 5, 130]),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_passes_equal_the_default_loop(name):
    errs = check_choice(CPU_CASES[name], torch.float32, dict(out_block_passes=True), dict(out_block_passes=False))
    assert errs[3] == 0.0, f"o differs from the default loop's by {errs[3]:.2e} (same products, same order)"


@cpu_only
def test_passes_bf16_match_float64():
    errs = check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, dict(out_block_passes=True),
                        dict(out_block_passes=False))
    assert errs[3] == 0.0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [(2, 1000, 6, 6, 256, 512, 3, True, None), (1, None, 6, 6, 256, 512, 2, True, [3000, 64, 1, 700, 129])],
    ids=["DeltaProduct n_h=3", "DeltaProduct n_h=2 packed"],
)
def test_gpu_passes_match_float64(case):
    check_choice(case, torch.bfloat16, dict(out_block_passes=True), dict(), device="cuda")
