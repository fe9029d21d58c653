"""The sequential and output kernels without gates (`USE_G` false when g is None): they read no log decays and
form no exponentials, since every one would be e^0. So o, the final and the boundary states must equal, bit for bit,
those of the same inputs with all-zero log decays (which take the gated code), and match float64, on every path of
the step (W or keys path) and of the output kernel (q K^T its own or the kkt kernel's, chunk pairs), n_h 1 to 3,
packed with a sequence shorter than a chunk. GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product
from tests.kernels.delta_rule_cases import (
    GPU_REAL_CASES,
    TOL,
    cpu_only,
    cu_seqlens,
    inputs,
    needs_cuda,
    rel,
)

# (B, T or None, Hk, Hv, K, V, n_h, lengths or None)
CPU_CASES = {
    "n_h=1, 2 chunks and a part": (1, 150, 1, 2, 32, 16, 1, None),
    "n_h=3": (2, 70, 1, 1, 32, 16, 3, None),
    "n_h=2 packed 2, 1, 3 chunks": (1, None, 1, 2, 32, 16, 2, [70, 5, 130]),
}
PATHS = {"W path": {}, "keys path": dict(state_keys_ws=True),
         "q K^T from the kkt kernel, chunk pairs": dict(out_aqk=True, out_pair=True)}  # fmt: skip


def _no_gate_against_zero_gates(case: tuple, dtype: torch.dtype, choice: dict, device: str = "cpu") -> None:
    B, T, Hk, Hv, K, V, n_h, lengths = case
    T = sum(lengths) if lengths else T
    N = len(lengths) if lengths else B
    q, k, v, beta, _, s0 = inputs(B, T, Hk, Hv, K, V, n_h, False, n_seq=N, device=device)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cu = cu_seqlens(lengths, device) if lengths else None
    run = dict(initial_state=s0, normalize_qk=True, cu_seqlens=cu, config=LaunchConfig(**choice) if choice else None)
    got = triton_delta_product(q, k, v, beta, None, **run)
    zero = triton_delta_product(q, k, v, beta, torch.zeros(B, T, Hv, device=device), **run)
    for name, a, b in zip(("o", "final", "boundary"), got, zero):
        assert torch.equal(a, b), f"{name}: no gates differs from zero log decays by {rel(a, b):.1e}"
    d = torch.float64
    ref = naive_delta_product(q.to(d), k.to(d), v.to(d), beta.to(d), None, initial_state=s0.to(d), normalize_qk=True,
                              cu_seqlens=None if cu is None else cu.cpu())  # fmt: skip
    errs = [rel(a, b) for a, b in zip(got, ref)]
    assert max(errs) < TOL[dtype], f"o/final/boundary against float64: {errs}"


@cpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_no_gates_equal_zero_log_decays_and_float64(name, path):
    _no_gate_against_zero_gates(CPU_CASES[name], torch.float32, PATHS[path])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_REAL_CASES))
def test_gpu_no_gates_equal_zero_log_decays(name):
    B, T, Hk, Hv, K, V, n_h, _, lengths = GPU_REAL_CASES[name]
    _no_gate_against_zero_gates((B, T, Hk, Hv, K, V, n_h, lengths), torch.bfloat16, {}, device="cuda")
