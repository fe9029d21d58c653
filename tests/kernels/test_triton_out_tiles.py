"""The output kernel's value tile in `default_config`: 256 wide at dv 512 when the chunk states it reads are in the
inputs' half dtype (no boundary states returned), 128 otherwise. On an H200 the 256-wide tile gained 1.00-1.07x
with half states and lost with fp32 ones (GDN default 8 x 4096 1.556 -> 2.193 ms; kernels/NOTES.md); o is
bit-identical either way, which the CPU test checks in the interpreter against the 128-wide tile and float64.
"""

from __future__ import annotations

import pytest
import torch

import deltalab.kernels.delta_rule.triton_chunk as tc
from tests.kernels.delta_rule_cases import check_choice, cpu_only, inputs


@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("n_h", [1, 2, 3])
def test_wide_output_tiles_only_with_half_states_at_dv_512(B, n_h):
    assert tc.default_config(B, 6, 512, n_h, 256).out_bv == 256
    assert tc.default_config(B, 6, 512, n_h, 256, half_states=False).out_bv == 128
    assert tc.default_config(B, 32, 128, n_h, 128).out_bv == 128


@cpu_only
@pytest.mark.parametrize(
    "dtype, keep, half", [(torch.bfloat16, False, True), (torch.bfloat16, True, False), (torch.float32, False, False)]
)
def test_the_forward_asks_for_the_states_it_stores(monkeypatch, dtype, keep, half):
    seen = []
    real = tc.default_config
    monkeypatch.setattr(tc, "default_config", lambda *a, **kw: (seen.append(kw.get("half_states")), real(*a, **kw))[1])
    q, k, v, beta, g, _ = inputs(1, 70, 1, 1, 16, 16, 1, True)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    tc.triton_delta_product(q, k, v, beta, g, normalize_qk=True, output_boundary_states=keep)
    assert seen == [half]


@cpu_only
def test_wide_output_tiles_equal_narrow_ones():
    errs = check_choice((1, 150, 1, 1, 32, 512, 1, True, None), torch.float32, dict(out_bv=256), dict(out_bv=128))
    assert errs[3] == 0.0, f"o differs between 256- and 128-wide output tiles: {errs[3]:.2e}"
