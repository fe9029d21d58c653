"""One sequence in consecutive pieces (`LaunchConfig.pieces`): each piece's sequential kernel starts from the previous
piece's fp32 final state and every other kernel works chunk by chunk, so o, the final and the boundary states must be
bit-identical to the one-piece run's, and match the float64 token loop (`delta_rule_cases`).

CPU: TRITON_INTERPRET=1 (pieces run one after another): uneven pieces with a partial last chunk, more pieces than
chunks, n_h 2 and 3 with gates, dk 256 / dv 512 on the keys path with U from v, grouped heads, no initial state and
no boundary states. GPU (marked): the pieces on two CUDA streams at real shapes, and a batch of B > 1 unaffected.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import check_choice, cpu_only, inputs, needs_cuda, rel

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "5 chunks in 3 pieces, the last partial": ((1, 300, 1, 2, 32, 16, 1, True, None), dict(pieces=3)),
    "3 chunks, 10 pieces asked": ((1, 150, 1, 1, 16, 16, 2, True, None), dict(pieces=10)),
    "n_h 3 grouped, 2 pieces": ((1, 200, 1, 2, 40, 24, 3, True, None), dict(pieces=2)),
    "dk 256 dv 512, keys and U from v": ((1, 150, 1, 1, 256, 512, 1, True, None),
                                         dict(pieces=2, state_keys_ws=True, state_from_v=True)),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_pieces_equal_one_piece_and_float64(name):
    case, on = CPU_CASES[name]
    off = {key: val for key, val in on.items() if key != "pieces"}
    errs = check_choice(case, torch.float32, on, off)
    assert max(errs[:3]) < 1e-5, f"float32 against float64: {errs[:3]}"
    assert max(errs[3:]) == 0.0, f"pieces against one piece (o, final, boundary): {errs[3:]}"


def _run_without_state(device: str, pieces: int):
    from kernels.triton_chunk import LaunchConfig, triton_delta_product

    q, k, v, beta, g, _ = inputs(1, 260, 1, 1, 32, 16, 2, True, device=device, seed=5)
    return triton_delta_product(q, k, v, beta, g, normalize_qk=True, output_final_state=False,
                                output_boundary_states=False, config=LaunchConfig(pieces=pieces))  # fmt: skip


@cpu_only
def test_pieces_without_initial_state_or_returned_states():
    o1, fin1, bnd1 = _run_without_state("cpu", 1)
    o3, fin3, bnd3 = _run_without_state("cpu", 3)
    assert fin1 is None and fin3 is None and bnd1 is None and bnd3 is None
    assert torch.equal(o1, o3)


def test_piece_bounds():
    from kernels.triton_chunk import _piece_bounds

    assert _piece_bounds(300, 3) == [(0, 128), (128, 256), (256, 300)]
    assert _piece_bounds(150, 10) == [(0, 64), (64, 128), (128, 150)]
    assert _piece_bounds(64, 4) == [(0, 64)]
    assert _piece_bounds(1000, 1) == [(0, 1000)]
    assert _piece_bounds(0, 4) == [(0, 0)]


GPU_CASES = {
    "GDN default 1x8192, 4 pieces": ((1, 8192, 6, 6, 256, 512, 1, True, None), dict(pieces=4)),
    "Qwen3-Next 1x8192, 4 pieces": ((1, 8192, 16, 32, 128, 128, 1, True, None), dict(pieces=4)),
    "DeltaProduct n_h=3 1x4100, 3 pieces": ((1, 4100, 6, 6, 256, 512, 3, True, None), dict(pieces=3)),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_pieces_on_two_streams(name):
    """bf16; pieces against one piece bit-identical (the same kernels on the same chunks), both against float64."""
    case, on = GPU_CASES[name]
    errs = check_choice(case, torch.bfloat16, on, {}, device="cuda")
    assert max(errs[3:]) == 0.0, f"pieces against one piece (o, final, boundary): {errs[3:]}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_pieces_leave_batches_alone():
    """B > 1 ignores `pieces` (each row is its own sequence already)."""
    from kernels.triton_chunk import LaunchConfig, triton_delta_product

    q, k, v, beta, g, s0 = inputs(2, 500, 2, 2, 64, 64, 1, True, device="cuda")
    a = triton_delta_product(q, k, v, beta, g, initial_state=s0, config=LaunchConfig(pieces=4))
    b = triton_delta_product(q, k, v, beta, g, initial_state=s0, config=LaunchConfig())
    assert all(rel(x, y) == 0.0 for x, y in zip(a, b))

