"""The kkt kernel's pipeline stages: three (or more) with n_h > 1 on packed sequences gave o off by 3.5e-2 from two
stages on an H200 (Triton 3.6; bit-identical at the other real rows), so `_Phases.prep` launches two there whatever
the config asks; elsewhere the asked stages are launched."""

from __future__ import annotations

import pytest
import torch

import deltalab.kernels.delta_rule.triton_chunk as tc
from tests.kernels.delta_rule_cases import cpu_only, cu_seqlens, inputs


@cpu_only
@pytest.mark.parametrize("n_h, packed, expected", [(2, True, 2), (3, True, 2), (1, True, 3), (2, False, 3)])
def test_kkt_stages_capped_only_for_packed_products(monkeypatch, n_h, packed, expected):
    seen = []
    real = tc._kkt_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: (seen.append(kw["num_stages"]), real[grid](*a, **kw))[1]

    monkeypatch.setattr(tc, "_kkt_kernel", Spy())
    lengths = [70, 5, 60]
    q, k, v, beta, g, s0 = inputs(1 if packed else 2, sum(lengths) if packed else 70, 1, 1, 16, 16, n_h, True,
                                  n_seq=3 if packed else 2)
    cu = cu_seqlens(lengths) if packed else None
    o, _, _ = tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, cu_seqlens=cu,
                                      config=tc.LaunchConfig(kkt_stages=3))
    assert seen == [expected] and torch.isfinite(o).all()
