"""The sequential kernel with its state held transposed (`LaunchConfig.state_trans`: S^T [value tile, dk], each
product of the step taking its left operand from registers) and T loaded without a mask (`state_t_full`: the
inverse kernel writes zeros above T's diagonal, so Triton can pipeline that load). Both change only how the same
products are formed, so o, the final and the boundary states must match float64 within the dtype's bound and the
default path within half of it, on every path of the step (W or keys, U read or formed from v), for dk 256 in key
halves, grouped heads at n_h = 2, packed sequences with one shorter than a chunk, and T from the one-kernel
inverse; also the WY kernel's T load unmasked (`wu_t_full`). `state_t_full` is the default (H200: GDN default
8x4096 1.10x), `wu_t_full` too (1.00-1.01x); `state_trans` lost and is off (kernels/NOTES.md). GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

import deltalab.kernels.delta_rule.triton_chunk as tc
from deltalab.kernels.delta_rule.triton_prep import launch_inverse
from tests.kernels.delta_rule_cases import GPU_REAL_CASES, GPU_REAL_RUNS, check_choice, cpu_only, inputs, needs_cuda

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 in key halves, 5 chunks": (1, 300, 1, 1, 256, 64, 1, True, None),
    "grouped n_h=2, no gate": (2, 130, 1, 2, 64, 32, 2, False, None),
    "packed 2, 1, 4, 3 chunks": (1, None, 1, 2, 32, 16, 1, True, [70, 5, 200, 130]),
}
PATHS = {"keys, U from v": (True, True), "keys, U read": (True, False), "W, U from v": (False, True),
         "W, U read": (False, False)}  # fmt: skip


def _config(case: tuple, keys_ws: bool, from_v: bool, **choice) -> dict:
    return dict(state_keys_ws=keys_ws, state_from_v=from_v, state_bv=32 if case[5] >= 32 else 16, **choice)


@cpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_transposed_state_matches_float64_and_the_default(name, path):
    case = CPU_CASES[name]
    on = _config(case, *PATHS[path], state_trans=True, state_t_full=True)
    check_choice(case, torch.float32, on, _config(case, *PATHS[path], state_t_full=False))


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_unmasked_t_with_the_one_kernel_inverse(name):
    case = CPU_CASES[name]
    check_choice(case, torch.float32, _config(case, True, True, state_t_full=True, tri_split=False),
                 _config(case, True, True, state_t_full=False))  # fmt: skip


@cpu_only
def test_transposed_state_in_bf16_with_every_other_state():
    """Half-dtype chunk states, every other one stored (output chunk pairs), no boundary states returned."""
    q, k, v, beta, g, s0 = inputs(1, 330, 1, 2, 64, 32, 1, True)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    common = dict(out_aqk=True, out_pair=True, state_keys_ws=True, state_from_v=True)
    runs = [
        tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, output_boundary_states=False,
                                config=tc.LaunchConfig(**common, **cfg))
        for cfg in (dict(state_trans=True, state_t_full=True), dict(state_t_full=False))
    ]  # fmt: skip
    assert runs[0][2] is None
    assert (runs[0][0].float() - runs[1][0].float()).abs().max() <= 2e-2 * runs[1][0].float().abs().max()
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-2, atol=1e-2)


@cpu_only
@pytest.mark.parametrize("choice, trans, t_full", [
    (dict(state_trans=True, state_t_full=True, state_keys_ws=True), True, True),
    (dict(state_trans=True, state_t_full=True, state_keys_ws=True, fuse_output=True), False, True),  # fused: plain
    (dict(state_t_full=True, state_keys_ws=False, state_from_v=False), False, False),  # T unread: no zeros asked
    (dict(state_keys_ws=True, state_t_full=False), False, False),
])  # fmt: skip
def test_choices_reach_the_launch(monkeypatch, choice, trans, t_full):
    seen, zeros = [], []
    real_launch, real_inverse = tc._launch, tc.launch_inverse
    monkeypatch.setattr(tc, "_launch", lambda *a: (seen.append((a[4]["TRANS"], a[4]["T_FULL"])), real_launch(*a))[1])
    monkeypatch.setattr(tc, "launch_inverse", lambda *a, **kw: (zeros.append(kw["upper_zeros"]),
                                                                 real_inverse(*a, **kw))[1])  # fmt: skip
    q, k, v, beta, g, s0 = inputs(1, 80, 1, 1, 32, 16, 1, True)
    cfg = tc.LaunchConfig(**choice, wu_t_full=False)  # (the WY kernel's own ask: the wu_t_full test below)
    o, *_ = tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, config=cfg)
    assert seen == [(trans, t_full)] and zeros == [t_full] and torch.isfinite(o).all()


@cpu_only
@pytest.mark.parametrize("upper_zeros", [True, False])
def test_inverse_writes_zeros_above_the_diagonal_only_when_asked(upper_zeros):
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(3, 64, 64, generator=gen).tril(-1) * 0.1
    Ti = torch.full((3, 64, 64), float("nan"))
    launch_inverse(A, Ti, 3, 1, "ieee", upper_zeros=upper_zeros)
    want = torch.linalg.inv(torch.eye(64) + A.double())
    lower = torch.ones(64, 64, dtype=torch.bool).tril()
    torch.testing.assert_close(Ti[:, lower].double(), want[:, lower], rtol=1e-5, atol=1e-6)
    blocks = torch.arange(64) // 16
    above_blocks = blocks[:, None] < blocks[None, :]
    if upper_zeros:
        assert (Ti.triu(1) == 0).all()  # (within the diagonal blocks by forward substitution, above them written)
    else:
        assert Ti[:, above_blocks].isnan().all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, dtype", GPU_REAL_RUNS, ids=[f"{n}-{d}" for n, d in GPU_REAL_RUNS])
@pytest.mark.parametrize("choice", [dict(state_t_full=True), dict(state_t_full=True, state_trans=True),
                                    dict(state_t_full=True, state_trans=True, state_bv=64)],
                         ids=["t_full", "trans", "trans bv64"])  # fmt: skip
def test_gpu_transposed_state_and_unmasked_t(name, dtype, choice):
    base = dict(state_keys_ws=True, state_from_v=True, state_t_full=False)  # (the path where T is read)
    check_choice(GPU_REAL_CASES[name], dtype, dict(base, **choice), base, device="cuda")


@pytest.mark.parametrize("B, H, V, n_h, K", [(1, 6, 512, 1, 256), (8, 6, 512, 1, 256), (8, 32, 128, 1, 128),
                                             (8, 6, 512, 3, 256)])
def test_default_config_loads_t_unmasked_and_keeps_the_state_upright(B, H, V, n_h, K):
    cfg = tc.default_config(B, H, V, n_h, K)
    assert cfg.state_t_full and not cfg.state_trans


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
@pytest.mark.parametrize("keys_ws", [False, True], ids=["W path", "keys path, U read"])
def test_wy_kernel_loads_t_unmasked_with_the_same_result(monkeypatch, name, keys_ws):
    """`wu_t_full`: the WY kernel's T load without a mask, the inverse then writing the zeros above the diagonal."""
    zeros = []
    real_inverse = tc.launch_inverse
    monkeypatch.setattr(tc, "launch_inverse", lambda *a, **kw: (zeros.append(kw["upper_zeros"]),
                                                                 real_inverse(*a, **kw))[1])  # fmt: skip
    case = CPU_CASES[name]
    errs = check_choice(case, torch.float32, _config(case, keys_ws, False, wu_t_full=True, state_t_full=False),
                        _config(case, keys_ws, False, state_t_full=False, wu_t_full=False))  # fmt: skip
    assert errs[3:] == (0.0, 0.0, 0.0) and zeros == [True, False]
