"""The delta-rule output kernel's alternative loops against the float64 token loop and against the default loop (o,
final and boundary states; `delta_rule_cases`):
- `out_prefetch`: each key block's q, S_c and K tiles loaded one block ahead;
- `out_block_passes` (n_h > 1): each further WY block's q K^T in a key-block pass of its own.

Both run the same products in the same order as the default loop, so under the interpreter o is bit-identical to it;
on the GPU the comparison is to the dtype's tolerance. CPU: several key blocks, a partial last block (dk 40, 96), n_h =
1-3, grouped heads, packed sequences with one shorter than a chunk, bf16; GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import check_choice, cpu_only, needs_cuda

LOOPS = {"prefetch": "out_prefetch", "passes": "out_block_passes"}
# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 dv 512: four key blocks": (1, 150, 1, 1, 256, 512, 1, True, None),
    "dk 256 dv 512 n_h 2": (1, 150, 1, 1, 256, 512, 2, True, None),
    "dk 40, n_h 2: one partial block": (1, 100, 2, 2, 40, 24, 2, True, None),
    "dk 40 n_h 2, no gate": (2, 100, 2, 2, 40, 24, 2, False, None),
    "dk 96 grouped n_h 3, packed": (1, None, 1, 2, 96, 32, 3, True, [70, 5, 130]),
}
CPU_RUNS = [("prefetch", name) for name in ("dk 256 dv 512: four key blocks", "dk 40, n_h 2: one partial block",
                                            "dk 96 grouped n_h 3, packed")]
CPU_RUNS += [("passes", name) for name in ("dk 256 dv 512 n_h 2", "dk 40 n_h 2, no gate",
                                          "dk 96 grouped n_h 3, packed")]


@cpu_only
@pytest.mark.parametrize("loop, name", CPU_RUNS)
def test_loop_equals_the_default_loop(loop, name):
    flag = LOOPS[loop]
    errs = check_choice(CPU_CASES[name], torch.float32, {flag: True}, {flag: False})
    assert errs[3] == 0.0, f"{loop}: o differs from the default loop's by {errs[3]:.2e} (same products, same order)"


@cpu_only
@pytest.mark.parametrize("loop", list(LOOPS))
def test_loop_bf16_matches_float64(loop):
    flag = LOOPS[loop]
    errs = check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, {flag: True}, {flag: False})
    assert errs[3] == 0.0


GPU_CASES = {
    "GDN default": (1, 2048, 6, 6, 256, 512, 1, True, None),
    "Qwen3-Next packed": (1, None, 16, 32, 128, 128, 1, True, [3000, 64, 1, 700, 129]),
    "DeltaProduct n_h=3": (2, 1000, 6, 6, 256, 512, 3, True, None),
    "DeltaProduct n_h=2 packed": (1, None, 6, 6, 256, 512, 2, True, [3000, 64, 1, 700, 129]),
}
GPU_RUNS = [("prefetch", n) for n in ("GDN default", "Qwen3-Next packed", "DeltaProduct n_h=3")]
GPU_RUNS += [("passes", n) for n in ("DeltaProduct n_h=3", "DeltaProduct n_h=2 packed")]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("loop, name", GPU_RUNS)
def test_gpu_loop_matches_float64(loop, name):
    """bf16 at 4 warps (8 warps measured slower for both, kernels/NOTES.md)."""
    check_choice(GPU_CASES[name], torch.bfloat16, {LOOPS[loop]: True}, dict(), device="cuda")
