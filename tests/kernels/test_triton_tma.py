"""The sequential kernel's state stores through tensor descriptors (`LaunchConfig.state_tma`): the chunk states and
the final state written as [states * heads * dk, dv] rows by boxes of a key half and a value tile, instead of
through pointer tensors held in registers across the loop. Only where the stores go changes, so o, the final and the
boundary states must equal the pointer stores' exactly; checked also against float64, with every other state stored
(output chunk pairs), for packed sequences with one shorter than a chunk, and where the descriptors cannot be used
(dk not a power of two, dv rows not 16-byte multiples: the pointer stores). Off by default: fewer spills did not
make the kernel faster on an H200 (kernels/NOTES.md). GPU tests are marked.
"""

from __future__ import annotations

import pytest
import torch

import deltalab.kernels.delta_rule.triton_chunk as tc
from tests.kernels.delta_rule_cases import GPU_REAL_CASES, GPU_REAL_RUNS, check_choice, cpu_only, inputs, needs_cuda

TMA = dict(state_tma=True)

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk 256 in key halves, 5 chunks": (1, 300, 1, 1, 256, 64, 1, True, None),
    "grouped n_h=2, no gate": (2, 130, 1, 2, 64, 32, 2, False, None),
    "packed 2, 1, 4, 3 chunks": (1, None, 1, 2, 32, 16, 1, True, [70, 5, 200, 130]),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_descriptor_stores_equal_pointer_stores(name):
    errs = check_choice(CPU_CASES[name], torch.float32, TMA, {})
    assert errs[3:] == (0.0, 0.0, 0.0), f"o/final/boundary differ from the pointer stores: {errs[3:]}"


@cpu_only
def test_every_other_state_through_descriptors():
    """Output chunk pairs with no boundary states returned: half-dtype states, every other one stored."""
    q, k, v, beta, g, s0 = inputs(1, 330, 1, 2, 64, 32, 1, True)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    runs = [
        tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, output_boundary_states=False,
                                config=tc.LaunchConfig(out_aqk=True, out_pair=True, **cfg))
        for cfg in (TMA, {})
    ]  # fmt: skip
    assert runs[0][2] is None and torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@cpu_only
@pytest.mark.parametrize(
    "K, V, n_h, final, taken",
    [(64, 32, 1, True, True), (256, 64, 2, False, True), (96, 32, 1, True, False), (32, 6, 1, True, False)],
    ids=["dk 64", "dk 256 n_h 2 no final", "dk 96", "dv 6"],
)
def test_descriptors_taken_only_where_a_box_fits(monkeypatch, K, V, n_h, final, taken):
    seen = []
    real = tc._launch
    monkeypatch.setattr(tc, "_launch", lambda *a: (seen.append(a[4].get("TMA", False)), real(*a))[1])
    q, k, v, beta, g, s0 = inputs(1, 80, 1, 1, K, V, n_h, True)
    o, fin, bnd = tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True,
                                          output_final_state=final, config=tc.LaunchConfig(**TMA))
    assert seen == [taken] and torch.isfinite(o).all() and torch.isfinite(bnd).all()
    assert (fin is not None) == final


@pytest.mark.parametrize("B, H, V, n_h, K", [(1, 6, 512, 1, 256), (8, 6, 512, 1, 256), (8, 32, 128, 1, 128),
                                             (8, 6, 512, 3, 256)])
def test_default_config_keeps_pointer_stores(B, H, V, n_h, K):
    """Measured on an H200 against the pointer stores: 0.56-0.59x at B = 1, 0.99-1.02x at 8 x 4096 and packed."""
    assert not tc.default_config(B, H, V, n_h, K).state_tma


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, dtype", GPU_REAL_RUNS, ids=[f"{n}-{d}" for n, d in GPU_REAL_RUNS])
def test_gpu_descriptor_stores_are_bit_identical(name, dtype):
    errs = check_choice(GPU_REAL_CASES[name], dtype, TMA, dict(state_tma=False), device="cuda")
    assert errs[3:] == (0.0, 0.0, 0.0), f"descriptor stores changed values: o/final/boundary differences {errs[3:]}"
