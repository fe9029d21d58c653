"""The kkt kernel serving all value heads of a key head at once (`LaunchConfig.kkt_group`): K K^T, q K^T and q K'^T
are formed once for the group and each value head's A, norms, scales, Aqk and Aqp follow from its own beta and
gates. The arithmetic a value head sees is the same, so o, the final and the boundary states must equal the
per-head kernel's exactly in the interpreter, and stay within the dtype's bound of float64: groups of 2 and 4, at
n_h = 1 and 2, with and without gates, packed with a sequence shorter than a chunk, with the intra-chunk attention
and output chunk pairs. Groups that are not a power of two keep one head a program. The default since an H200 measured
it at 1.01x on Qwen3-Next (kernels/NOTES.md). GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

import deltalab.kernels.delta_rule.triton_chunk as tc
from tests.kernels.delta_rule_cases import GPU_REAL_CASES, TOL, check_choice, cpu_only, inputs, needs_cuda

GROUP = dict(kkt_group=True)

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "group 2, 3 chunks": (1, 150, 1, 2, 32, 16, 1, True, None),
    "group 4, n_h=2, no gate": (2, 70, 2, 8, 32, 16, 2, False, None),
    "group 2, packed 2, 1, 3 chunks": (1, None, 2, 4, 32, 16, 1, True, [70, 5, 130]),
}
PATHS = {"keys path, U from v": dict(state_keys_ws=True, state_from_v=True),
         "W path, Aqk and pairs": dict(out_aqk=True, out_pair=True)}  # fmt: skip


@cpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_grouped_kkt_equals_one_head_a_program(name, path):
    errs = check_choice(CPU_CASES[name], torch.float32, dict(PATHS[path], **GROUP), dict(PATHS[path], kkt_group=False))
    assert errs[3:] == (0.0, 0.0, 0.0), f"o/final/boundary differ from one head a program: {errs[3:]}"


@cpu_only
@pytest.mark.parametrize("Hk, Hv, heads", [(2, 4, 2), (1, 4, 4), (2, 6, 1), (2, 2, 1)],
                         ids=["group 2", "group 4", "group 3", "no groups"])  # fmt: skip
def test_programs_serve_a_power_of_two_group(monkeypatch, Hk, Hv, heads):
    seen = []
    real = tc._kkt_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid[0], kw["KG"]))
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(tc, "_kkt_kernel", Spy())
    q, k, v, beta, g, s0 = inputs(1, 100, Hk, Hv, 32, 16, 1, True)
    o, *_ = tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True,
                                    config=tc.LaunchConfig(**GROUP))
    assert seen == [(Hv * 2 // heads, heads)] and torch.isfinite(o).all()  # (two chunks)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["Qwen3-Next packed", "grouped n_h=3"])
@pytest.mark.parametrize("path", list(PATHS))
def test_gpu_grouped_kkt(name, path):
    off = dict(PATHS[path], kkt_group=False)
    errs = check_choice(GPU_REAL_CASES[name], torch.bfloat16, dict(PATHS[path], **GROUP), off, device="cuda")
    assert max(errs[:3]) < TOL[torch.bfloat16]


@pytest.mark.parametrize("B, H, V, n_h, K", [(1, 32, 128, 1, 128), (8, 6, 512, 1, 256)])
def test_default_config_groups_the_kkt_programs(B, H, V, n_h, K):
    assert tc.default_config(B, H, V, n_h, K).kkt_group
