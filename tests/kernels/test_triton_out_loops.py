"""The delta-rule output kernel's alternative loops against the float64 token loop and against the default loop (o,
final and boundary states; `delta_rule_cases`):
- `out_prefetch`: each key block's q, S_c and K tiles loaded one block ahead;
- `out_aqk`: the intra-chunk attention q K^T * decay * mask formed once a chunk by the WY kernel and read by the
  output kernel, whose key-block loop then forms only q S_c.

The prefetch runs the default loop's products in the same order, so under the interpreter o is bit-identical to it;
`out_aqk` sums q K^T over dk in one product instead of key blocks, so it differs by rounding. On the GPU the comparison
is to the dtype's tolerance. CPU: several key blocks, a partial last block (dk 40, 96), n_h = 1-3, grouped heads,
packed sequences with one shorter than a chunk, no gate, bf16; GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import check_choice, cpu_only, needs_cuda

LOOPS = {"prefetch": dict(out_prefetch=True), "aqk": dict(out_aqk=True),
         "aqk + prefetch": dict(out_aqk=True, out_prefetch=True)}
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
CPU_RUNS += [("aqk", name) for name in CPU_CASES]
CPU_RUNS += [("aqk + prefetch", name) for name in ("dk 256 dv 512: four key blocks", "dk 96 grouped n_h 3, packed")]


@cpu_only
@pytest.mark.parametrize("loop, name", CPU_RUNS)
def test_loop_matches_float64_and_the_default_loop(loop, name):
    errs = check_choice(CPU_CASES[name], torch.float32, LOOPS[loop], dict(out_prefetch=False, out_aqk=False))
    assert max(errs[:3]) < 1e-5, f"{loop}: float32 against float64 {errs[:3]}"
    if loop == "prefetch":
        assert errs[3] == 0.0, f"{loop}: o differs from the default loop's by {errs[3]:.2e} (same products, same order)"
    else:
        assert errs[3] < 1e-5, f"{loop}: o differs from the default loop's by {errs[3]:.2e} (only sums reordered)"
    assert errs[4] == 0.0 and errs[5] == 0.0, f"{loop}: the states changed ({errs[4:]}), the output kernel writes none"


@cpu_only
@pytest.mark.parametrize("loop", list(LOOPS))
def test_loop_bf16_matches_float64(loop):
    check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, LOOPS[loop], dict())


GPU_CASES = {
    "GDN default": (1, 2048, 6, 6, 256, 512, 1, True, None),
    "Qwen3-Next packed": (1, None, 16, 32, 128, 128, 1, True, [3000, 64, 1, 700, 129]),
    "DeltaProduct n_h=3": (2, 1000, 6, 6, 256, 512, 3, True, None),
    "DeltaProduct n_h=2 packed": (1, None, 6, 6, 256, 512, 2, True, [3000, 64, 1, 700, 129]),
}
GPU_RUNS = [("prefetch", n) for n in ("GDN default", "Qwen3-Next packed", "DeltaProduct n_h=3")]
GPU_RUNS += [("aqk", n) for n in GPU_CASES] + [("aqk + prefetch", "GDN default")]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("loop, name", GPU_RUNS)
def test_gpu_loop_matches_float64(loop, name):
    """bf16 at 4 warps (8 warps measured slower for the prefetch, kernels/NOTES.md)."""
    check_choice(GPU_CASES[name], torch.bfloat16, LOOPS[loop], dict(), device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_aqk_fp16_n_h_3():
    check_choice(GPU_CASES["DeltaProduct n_h=3"], torch.float16, LOOPS["aqk"], dict(), device="cuda")
