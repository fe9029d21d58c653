"""L2 eviction hints (`LaunchConfig.state_evict_first`, `out_evict_first`): the chunk states and D stored, and the
chunk states loaded, evict-first. A hint only: o, the final and the boundary states must be bit-identical to the
default launch. CPU: the hints reach the kernels (the interpreter ignores them, so the values must match exactly);
GPU (marked): bit-identical at real shapes.
"""

from __future__ import annotations

import pytest
import torch

import deltalab.kernels.delta_rule.triton_chunk as tc
from tests.kernels.delta_rule_cases import check_choice, cpu_only, inputs, needs_cuda

HINTS = dict(state_evict_first=True, out_evict_first=True)


@cpu_only
def test_hints_reach_both_kernels_and_change_no_value(monkeypatch):
    seen = []
    real_launch, real_out = tc._launch, tc._output_kernel

    class OutSpy:
        def __getitem__(self, grid):
            return lambda *a, **kw: (seen.append(("out", kw["EVICT"])), real_out[grid](*a, **kw))[1]

    monkeypatch.setattr(tc, "_launch", lambda *a: (seen.append(("state", a[4]["EVICT"])), real_launch(*a))[1])
    monkeypatch.setattr(tc, "_output_kernel", OutSpy())
    q, k, v, beta, g, s0 = inputs(1, 150, 1, 2, 64, 32, 1, True)
    runs = [tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True,
                                    config=tc.LaunchConfig(**cfg))
            for cfg in (HINTS, {})]
    assert seen == [("state", True), ("out", True), ("state", False), ("out", False)]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)


GPU_CASES = {
    "GDN default": (1, 2048, 6, 6, 256, 512, 1, True, None),
    "GDN default 8 sequences": (8, 1000, 6, 6, 256, 512, 1, True, None),
    "Qwen3-Next packed": (1, None, 16, 32, 128, 128, 1, True, [3000, 64, 1, 700, 129]),
    "DeltaProduct n_h=2": (2, 1000, 6, 6, 256, 512, 2, True, None),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_hints_are_bit_identical(name):
    errs = check_choice(GPU_CASES[name], torch.bfloat16, HINTS, {}, device="cuda")
    assert errs[3:] == (0.0, 0.0, 0.0), f"hints changed values: o/final/boundary differences {errs[3:]}"


def test_default_config_hints_the_state_loads_at_one_key_block_only():
    """Measured on an H200: the output kernel's evict-first state loads won at dk 128, lost at dk 256."""
    assert tc.default_config(1, 32, 128, 1, 128).out_evict_first
    assert tc.default_config(8, 32, 128, 1, 128).out_evict_first
    assert not tc.default_config(8, 6, 512, 1, 256).out_evict_first
    assert not tc.default_config(1, 6, 512, 1, 256).state_evict_first
