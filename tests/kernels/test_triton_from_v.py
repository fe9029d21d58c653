"""The sequential kernel forming U = T diag(beta) V from v (`LaunchConfig.state_from_v`: the WY kernel writes no U;
with `state_keys_ws` D = T (diag(beta) V - diag(c) (K S)) in one product) against the float64 token loop and
against the path that reads U (o, final and boundary states; `delta_rule_cases`).

CPU: TRITON_INTERPRET=1, dk 256 / dv 512 in key halves, a partial key block, n_h 1-3, gates on and off, grouped heads,
packed sequences with one shorter than a chunk, the fused output and the one-kernel T; GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import GPU_REAL_CASES, GPU_REAL_RUNS, check_choice, cpu_only, needs_cuda

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 dv 512, key halves": (1, 150, 1, 1, 256, 512, 1, True, None),
    "dk 40 n_h 2, no gate": (2, 100, 2, 2, 40, 24, 2, False, None),
    "dk 96 grouped n_h 3, packed": (1, None, 1, 2, 96, 32, 3, True, [70, 5, 130]),
}
PATHS = {"W": dict(state_keys_ws=False), "keys": dict(state_keys_ws=True)}


@cpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_from_v_matches_float64_and_the_u_path(name, path):
    errs = check_choice(CPU_CASES[name], torch.float32, dict(state_from_v=True, **PATHS[path]), PATHS[path])
    assert max(errs[:3]) < 1e-5, f"float32 against float64: {errs[:3]}"
    assert max(errs[3:]) < 1e-5, f"against the path that reads U: {errs[3:]}"


@cpu_only
@pytest.mark.parametrize("other", [dict(fuse_output=True), dict(tri_split=False)], ids=["fused output", "one-kernel T"])
def test_from_v_with_the_fused_output_and_the_one_kernel_t(other):
    on = dict(state_from_v=True, state_keys_ws=True, **other)
    check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.float32, on, other)


@cpu_only
def test_from_v_bf16():
    check_choice(CPU_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, dict(state_from_v=True,
                 state_keys_ws=True), dict(state_keys_ws=True))  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name, dtype", GPU_REAL_RUNS)
def test_gpu_from_v_matches_float64(name, dtype, path):
    """At two pipeline stages with the keys, as default_config launches that path."""
    stages = dict(state_stages=2) if path == "keys" else {}
    off = dict(PATHS[path], **stages)
    check_choice(GPU_REAL_CASES[name], dtype, dict(state_from_v=True, **off), off, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, dtype", GPU_REAL_RUNS)
def test_gpu_from_v_w_path_64_wide_tiles_at_three_stages(name, dtype):
    """The W path with U from v keeps its stages at 64-wide value tiles (right at 1-3 stages on an H100, twelfth
    session; 32-wide ones miscompiled at 2-3 and run at one)."""
    off = dict(state_keys_ws=False, state_bv=64, state_stages=3)
    check_choice(GPU_REAL_CASES[name], dtype, dict(state_from_v=True, **off), off, device="cuda")


def test_default_config_forms_u_from_v_on_the_keys_path_only():
    """Past one program a SM (8 x 4096, packed) the keys path with U from v; at B = 1 the W path reading U (132 SMs)."""
    from deltalab.kernels.delta_rule.triton_chunk import default_config

    for B, H, V, n_h, K in [(8, 6, 512, 1, 256), (32, 6, 512, 3, 256), (8, 32, 128, 1, 128)]:
        cfg = default_config(B, H, V, n_h, K)
        assert cfg.state_keys_ws and cfg.state_from_v, (B, H, V, n_h, K)
    for B, H, V, n_h, K in [(1, 6, 512, 1, 256), (1, 6, 512, 3, 256)]:
        cfg = default_config(B, H, V, n_h, K)
        assert not cfg.state_keys_ws and not cfg.state_from_v, (B, H, V, n_h, K)


def _launched_state_config(monkeypatch, on: dict, off: dict):
    """The LaunchConfig the sequential kernel was launched with for `on` (checked against float64 and `off` too)."""
    import deltalab.kernels.delta_rule.triton_chunk as tc

    seen = []
    real = tc._launch

    def spy(kernel, grid, cfg, *rest):
        seen.append(cfg)
        return real(kernel, grid, cfg, *rest)

    monkeypatch.setattr(tc, "_launch", spy)
    check_choice((1, 130, 1, 1, 32, 64, 1, True, None), torch.float32, on, off)
    return seen[0]


@cpu_only
@pytest.mark.parametrize("path, bv, stages", [("W", 32, 1), ("W", 64, 3), ("keys", 32, 3)])
def test_u_from_v_on_the_w_path_runs_at_one_stage_at_32_wide_tiles(monkeypatch, path, bv, stages):
    """On an H100 the W path with U from v miscompiled at 32-wide value tiles and 2-3 stages (scripts/fromv_check.py):
    one stage there; 64-wide tiles and the keys path keep theirs."""
    on = dict(state_from_v=True, state_stages=3, state_bv=bv, **PATHS[path])
    assert _launched_state_config(monkeypatch, on, dict(PATHS[path], state_bv=bv)).state_stages == stages


@cpu_only
@pytest.mark.parametrize("path, bv, warps", [("keys", 32, 4), ("W", 32, 4), ("keys", 64, 8)])
def test_u_from_v_at_32_wide_tiles_runs_at_four_warps(monkeypatch, path, bv, warps):
    """On an H200 the keys path with U from v at 32-wide value tiles and 8 warps gave NaN (and an illegal memory access
    when packed): 4 warps there; 64-wide tiles keep the warps asked for."""
    on = dict(state_from_v=True, state_warps=8, state_bv=bv, **PATHS[path])
    assert _launched_state_config(monkeypatch, on, dict(PATHS[path], state_bv=bv)).state_warps == warps


def test_default_config_at_dk_128_with_several_householder_steps_follows_the_general_rules():
    """dk <= 128, n_h > 1 (the grid's H = 8 points) gets the stages, output key block and paths of every other shape
    (it took LaunchConfig's plain defaults until the sixteenth session: H200 B=1 T=8192 n_h=3 0.827 -> 0.676 ms)."""
    from deltalab.kernels.delta_rule.triton_chunk import default_config

    one = default_config(1, 8, 128, 3, 128)  # 32 programs on 132 SMs: the W path at four stages, one key block
    assert (one.state_stages, one.out_bk, one.resident_per_sm, one.state_keys_ws) == (4, 128, 1, False)
    assert default_config(1, 6, 512, 3, 256).state_stages == 3  # dk 256: a stage's tiles twice the size
    many = default_config(8, 8, 128, 3, 128)  # 256 programs: the keys path with U from v, two stages
    assert (many.state_stages, many.state_keys_ws, many.state_from_v, many.state_bv) == (2, True, True, 32)
