"""Shared by the delta-rule forward's tests of its launch paths (`test_triton_shapes.py`): random inputs
and one check of a launch choice against the float64 token loop and against the path it replaces.

Errors are max |ours - ref| / max |ref| with the tolerances of deltalab.kernels.testing.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.testing import TOLERANCES, cu_seqlens, delta_inputs
from deltalab.kernels.testing import rel_err as rel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
TOL = TOLERANCES

inputs = functools.partial(delta_inputs, seed=0, dtype=torch.float32, decay=0.7, state_scale=0.3)
"""Random inputs, beta in (0, 2), log decays in (-0.7, 0); n_seq initial states (packed sequences), else one per
batch row (`deltalab.kernels.testing.delta_inputs`)."""

cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU without TRITON_INTERPRET")


def check_choice(case: tuple, dtype: torch.dtype, on: dict, off: dict, device: str = "cpu",
                 decay: float = 0.7, keep_boundaries: bool = True) -> tuple[float, ...]:
    """`LaunchConfig(**on)` against float64 (o, final, boundary states) and against `LaunchConfig(**off)` (the same
    three: the paths differ by rounding only). case: (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None).
    Without keep_boundaries no boundary states are returned (their errors and differences read 0)."""
    from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product

    B, T, Hk, Hv, K, V, n_h, gate, lengths = case
    T = sum(lengths) if lengths else T
    N = len(lengths) if lengths else B
    q, k, v, beta, g, s0 = inputs(B, T, Hk, Hv, K, V, n_h, gate, n_seq=N, device=device, decay=decay)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cu = cu_seqlens(lengths, device) if lengths else None
    run = dict(initial_state=s0, normalize_qk=True, cu_seqlens=cu, output_boundary_states=keep_boundaries)
    o, fin, bnd = triton_delta_product(q, k, v, beta, g, config=LaunchConfig(**on), **run)
    o0, fin0, bnd0 = triton_delta_product(q, k, v, beta, g, config=LaunchConfig(**off), **run)
    d = torch.float64
    ro, rfin, rbnd = naive_delta_product(
        q.to(d), k.to(d), v.to(d), beta.to(d), None if g is None else g.to(d), initial_state=s0.to(d),
        normalize_qk=True, cu_seqlens=None if cu is None else cu.cpu(),
    )  # fmt: skip
    assert o.shape == (B, T, Hv, V) and o.dtype == dtype and fin.shape == (N, Hv, K, V)
    if not keep_boundaries:
        assert bnd is None and bnd0 is None
        bnd = bnd0 = rbnd = torch.zeros(1)
    assert bnd.shape == rbnd.shape
    errs = rel(o, ro), rel(fin, rfin), rel(bnd, rbnd)
    assert max(errs) < TOL[dtype], f"{case} {dtype} {on}: rel errors o/final/boundary vs float64 {errs}"
    diff = rel(o, o0), rel(fin, fin0), rel(bnd, bnd0)
    assert max(diff) < TOL[dtype] / 2, f"{case} {dtype}: rel differences o/final/boundary, {on} vs {off}: {diff}"
    return (*errs, *diff)


# realistic shapes for the GPU tests of a launch choice, and the dtypes each runs in
GPU_REAL_CASES = {
    "GDN default": (1, 2048, 6, 6, 256, 512, 1, True, None),
    "Qwen3-Next packed": (1, None, 16, 32, 128, 128, 1, True, [3000, 64, 1, 700, 129]),
    "DeltaProduct n_h=2": (2, 1000, 6, 6, 256, 512, 2, True, None),
    "grouped n_h=3": (2, 1000, 4, 8, 128, 128, 3, True, None),
}
GPU_REAL_RUNS = [(name, torch.bfloat16) for name in GPU_REAL_CASES]
GPU_REAL_RUNS += [("GDN default", torch.float32), ("grouped n_h=3", torch.float16)]
