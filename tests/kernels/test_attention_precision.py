"""The chunked exact attention maps and `chunk_recurrence` in float32 against float64 at strong decays.

Log decays of up to -20 per token sum to about -600 over a 64-token chunk; a decay between two sub-steps taken as
the difference of two such running totals carries fp32's spacing there (6e-5) into the exponent.
`kernels.attention.chunk`
sums each decay from the gates it spans (`kernels.delta_rule.chunk.pair_decays`, `tail_decays`), so float32 stays
within 2e-6
(max |ours - ref| / max |ref|) of float64: the map's weights, rebuilt outputs and initial-state terms against the
same map in float64, `chunk_recurrence`'s outputs and final states against the float64 loop. The references get the
same float32 inputs in float64, so the bound measures the chunked arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.attention.chunk import chunk_recurrence, delta_attention
from deltalab.kernels.delta_rule.naive import naive_delta_product

TOL32 = 2e-6


def _inputs(B, T, Hk, Hv, K, V, n_h, channel, seed):
    """float32 inputs: unit keys, beta in (0, 2), g ~ U(-20, 0) per token (and channel), an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, n_h, Hk, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, n_h, Hv, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, n_h, Hv, generator=gen, dtype=torch.float64) * 2
    g = -20 * torch.rand(B, T, Hv, *((K,) if channel else ()), generator=gen, dtype=torch.float64)
    s0 = torch.randn(B, Hv, K, V, generator=gen, dtype=torch.float64)
    return [x.float() for x in (q, k, v, beta, g, s0)]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# name: (B, T, Hk, Hv, K, V, n_h, per-channel gates)
CASES = {
    "scalar, n_h 1": (1, 150, 2, 2, 16, 8, 1, False),
    "scalar, n_h 2, grouped": (1, 100, 1, 2, 16, 8, 2, False),
    "channel, n_h 1": (1, 150, 2, 2, 16, 8, 1, True),
    "channel, n_h 2, grouped": (1, 100, 1, 2, 16, 8, 2, True),
}


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", list(CASES))
def test_attention_map_float32_within_2e_6_of_float64_at_strong_decays(name, seed):
    x = _inputs(*CASES[name], seed=seed + 10 * list(CASES).index(name))
    got = delta_attention(*x[:5], initial_state=x[5])
    want = delta_attention(*(t.double() for t in x[:5]), initial_state=x[5].double())
    errs = [_rel(getattr(got, f), getattr(want, f)) for f in ("weights", "output", "initial")]
    assert max(errs) < TOL32, f"{name}, seed {seed}: float32 rel errors weights/output/initial {errs}"


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_recurrence_float32_within_2e_6_of_float64_loop_at_strong_decays(name, seed):
    x = _inputs(*CASES[name], seed=seed + 10 * list(CASES).index(name))
    o, final = chunk_recurrence(*x[:5], initial_state=x[5])
    ref = naive_delta_product(*(t.double() for t in x[:5]), initial_state=x[5].double())
    errs = [_rel(o, ref[0]), _rel(final, ref[1])]
    assert max(errs) < TOL32, f"{name}, seed {seed}: float32 rel errors o/final {errs}"
