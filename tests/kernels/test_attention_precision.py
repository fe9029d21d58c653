"""The chunked exact attention maps and `chunk_recurrence` in float32 against float64 at strong decays.

Log decays of up to -20 per token sum to about -600 over a 64-token chunk; a decay between two sub-steps taken as
the difference of two such running totals carries fp32's spacing there (6e-5) into the exponent.
`kernels.attention.chunk` sums each decay from the gates it spans (`kernels.delta_rule.chunk.pair_decays`,
`tail_decays`), so float32 stays within 2e-6 (max |ours - ref| / max |ref|) of float64: the map's weights, rebuilt
outputs and initial-state terms against the same map in float64, `chunk_recurrence`'s outputs and final states against
the float64 loop. The references get the same float32 inputs in float64, so the bound measures the chunked arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.attention.chunk import chunk_recurrence, delta_attention
from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.testing import delta_inputs, rel_err

TOL32 = 2e-6


# name: (B, T, Hk, Hv, K, V, n_h, gate)
CASES = {
    "scalar, n_h 1": (1, 150, 2, 2, 16, 8, 1, "scalar"),
    "scalar, n_h 2, grouped": (1, 100, 1, 2, 16, 8, 2, "scalar"),
    "channel, n_h 1": (1, 150, 2, 2, 16, 8, 1, "channel"),
    "channel, n_h 2, grouped": (1, 100, 1, 2, 16, 8, 2, "channel"),
}


def _inputs(name: str, seed: int):
    """float32 inputs of case `name`: unit keys, beta in (0, 2), g ~ U(-20, 0) per token (and channel), an initial
    state (drawn in float64)."""
    x = delta_inputs(*CASES[name], seed=seed + 10 * list(CASES).index(name), unit_keys=True, decay=20.0)
    return x.to(dtype=torch.float32)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", list(CASES))
def test_attention_map_float32_within_2e_6_of_float64_at_strong_decays(name, seed):
    x = _inputs(name, seed)
    got = delta_attention(*x[:5], initial_state=x[5])
    want = delta_attention(*(t.double() for t in x[:5]), initial_state=x[5].double())
    errs = [rel_err(getattr(got, f), getattr(want, f)) for f in ("weights", "output", "initial")]
    assert max(errs) < TOL32, f"{name}, seed {seed}: float32 rel errors weights/output/initial {errs}"


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_recurrence_float32_within_2e_6_of_float64_loop_at_strong_decays(name, seed):
    x = _inputs(name, seed)
    o, final = chunk_recurrence(*x[:5], initial_state=x[5])
    ref = naive_delta_product(*(t.double() for t in x[:5]), initial_state=x[5].double())
    errs = [rel_err(o, ref[0]), rel_err(final, ref[1])]
    assert max(errs) < TOL32, f"{name}, seed {seed}: float32 rel errors o/final {errs}"
