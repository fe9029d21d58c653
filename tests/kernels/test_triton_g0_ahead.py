"""The sequential kernel taking a block's starting log decay from the previous block's end (`LaunchConfig.
state_g0_ahead`, n_h > 1) instead of loading it: the same row of gcum, so o, the final and the boundary states must
equal the loading kernel's exactly, on the W and the keys path, with and without gates, packed with a sequence
shorter than a chunk, in the state held transposed and in the fused output. The default since the sixteenth
session (H200: 1.00-1.02x).
GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import GPU_REAL_CASES, check_choice, cpu_only, needs_cuda

AHEAD, LOAD = dict(state_g0_ahead=True), dict(state_g0_ahead=False)

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "n_h=2, 3 chunks": (1, 150, 1, 2, 32, 16, 2, True, None),
    "n_h=3, no gate": (2, 70, 1, 1, 32, 16, 3, False, None),
    "n_h=3 packed 2, 1, 3 chunks": (1, None, 1, 2, 32, 16, 3, True, [70, 5, 130]),
}
PATHS = {"W path": {}, "keys path, U from v": dict(state_keys_ws=True, state_from_v=True),
         "transposed": dict(state_trans=True), "fused output": dict(fuse_output=True)}  # fmt: skip


@cpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_decay_from_the_previous_block_equals_its_load(name, path):
    errs = check_choice(CPU_CASES[name], torch.float32, dict(PATHS[path], **AHEAD), dict(PATHS[path], **LOAD))
    assert errs[3:] == (0.0, 0.0, 0.0), f"o/final/boundary differ from loading G: {errs[3:]}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["DeltaProduct n_h=2", "grouped n_h=3"])
@pytest.mark.parametrize("path", ["W path", "keys path, U from v"])
def test_gpu_decay_from_the_previous_block(name, path):
    errs = check_choice(GPU_REAL_CASES[name], torch.bfloat16, dict(PATHS[path], **AHEAD), dict(PATHS[path], **LOAD),
                        device="cuda")
    assert errs[3:] == (0.0, 0.0, 0.0), f"o/final/boundary differ from loading G: {errs[3:]}"
