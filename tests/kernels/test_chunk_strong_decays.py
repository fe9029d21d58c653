"""The chunked PyTorch form in float32 against the float64 loop at strong decays, for both gate kinds: one log
decay per head (scalar, Gated DeltaNet) and one per key channel (Kimi Delta Attention).

Log decays of up to -20 per token sum to about -600 over a 64-token chunk; a decay between two sub-steps taken as
the difference of two such running totals carries fp32's spacing there (6e-5) into the exponent. The chunked form
sums each decay from the gates it spans instead (`kernels.delta_rule.chunk.pair_decays` / `tail_decays`), so float32
stays within 2e-6 of float64 (max |ours - ref| / max |ref| per output: o, final states, chunk-boundary states); before,
the worst cases were 1.4e-5 (scalar) and 2.5e-5 (per channel). The reference gets the same float32 inputs in float64, so
the bound measures the chunked form's arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.delta_rule.chunk import chunk_delta_product
from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.testing import delta_inputs, rel_err

TOL32 = 2e-6
GATES = ("scalar", "channel")


def _gates(gen, B, T, Hv, K, kind, gate):
    """uniform: g ~ U(-20, 0) per token and head (or channel); mixed: g ~ U(-s, 0) with strengths s spread
    log-evenly from 1e-3 (near 0) to 30 (running totals near -1000) over the heads, or over each head's channels
    in a different order."""
    if gate == "scalar":
        u = torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
        return -20 * u if kind == "uniform" else -u * torch.logspace(-3, 1.5, Hv, dtype=torch.float64)
    u = torch.rand(B, T, Hv, K, generator=gen, dtype=torch.float64)
    if kind == "uniform":
        return -20 * u
    order = torch.stack([torch.randperm(K, generator=gen) for _ in range(Hv)])  # [Hv, K]
    return -u * torch.logspace(-3, 1.5, K, dtype=torch.float64)[order]


# name: (B, T or sequence lengths, Hk, Hv, K, V, n_h, gates)
CASES = {
    "uniform, n_h 1": (2, 150, 2, 2, 16, 8, 1, "uniform"),
    "uniform, n_h 2, grouped": (1, 130, 1, 3, 16, 8, 2, "uniform"),
    "mixed, n_h 1, grouped": (2, 140, 2, 4, 32, 8, 1, "mixed"),
    "mixed, n_h 2": (1, 100, 4, 4, 16, 8, 2, "mixed"),
    "uniform, packed, grouped, n_h 1": (1, [70, 9, 0, 130, 64], 1, 2, 16, 8, 1, "uniform"),
    "mixed, packed, grouped, n_h 2": (1, [65, 3, 0, 128], 2, 4, 16, 8, 2, "mixed"),
}


def strong_decay_errors(name, gate, seed=0, dtype=torch.float32):
    """(o, final, boundary) relative errors of the chunked form in `dtype` against the float64 loop."""
    B, T, Hk, Hv, K, V, n_h, kind = CASES[name]
    lengths = T if isinstance(T, list) else None
    T = sum(lengths) if lengths else T
    N = len(lengths) if lengths else B
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if lengths else None
    x = delta_inputs(B, T, Hk, Hv, K, V, n_h, lambda gen: _gates(gen, B, T, Hv, K, kind, gate), unit_keys=True,
                     n_seq=N, seed=seed + 100 * list(CASES).index(name)).to(dtype=torch.float32)
    ref = naive_delta_product(*(t.double() for t in x[:5]), initial_state=x[5].double(), cu_seqlens=cu)
    got = chunk_delta_product(*(t.to(dtype) for t in x[:5]), initial_state=x[5].to(dtype), cu_seqlens=cu)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and torch.isfinite(a).all()
    return tuple(rel_err(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("gate", GATES)
def test_float32_within_2e_6_of_float64_at_strong_decays(gate, name, seed):
    errs = strong_decay_errors(name, gate, seed)
    assert max(errs) < TOL32, f"{gate} {name}, seed {seed}: float32 rel errors o/final/boundary {errs}"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("gate", GATES)
def test_float64_matches_float64_loop_at_strong_decays(gate, name):
    errs = strong_decay_errors(name, gate, dtype=torch.float64)
    assert max(errs) < 1e-10, f"{gate} {name}: float64 rel errors o/final/boundary {errs}"


@pytest.mark.parametrize("gate", GATES)
def test_gradients_at_strong_decays(gate):
    """Differentiable in every input, the gates included, where decays reach e^-20 per token (float64)."""
    gen = torch.Generator().manual_seed(3)
    B, T, K, V, n_h = 1, 12, 3, 2, 2
    H = 3 if gate == "scalar" else 1  # the three strengths over heads, or over one head's channels
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, n_h, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, n_h, H, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, n_h, H, generator=gen, dtype=torch.float64)
    shape = (B, T, H) if gate == "scalar" else (B, T, H, K)
    g = -torch.rand(*shape, generator=gen, dtype=torch.float64) * torch.tensor([0.01, 3.0, 20.0])
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v, beta, g, s0)]

    def f(q, k, v, beta, g, s0):
        o, final, bnd = chunk_delta_product(q, k, v, beta, g, initial_state=s0, chunk_size=5)
        return o.sum() + final.square().sum() + bnd[:, 1].sum()

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("channels", [1, 3])
def test_pair_and_tail_decays(channels):
    """`pair_decays` (one gate per sub-step: torch's cumulative sum; per channel: `_PairDecays`) is
    e^{Gamma_i - Gamma_j} on and below the diagonal and 0 above it, twice differentiable; `tail_decays` is
    e^{Gamma_L - Gamma_j} (float64)."""
    from deltalab.kernels.delta_rule.chunk import pair_decays, tail_decays

    gen = torch.Generator().manual_seed(4)
    strength = torch.tensor([20.0] if channels == 1 else [0.01, 3.0, 20.0], dtype=torch.float64)
    g = -torch.rand(2, 7, channels, generator=gen, dtype=torch.float64) * strength
    cum = g.cumsum(-2)
    idx = torch.arange(7)
    want = (cum[:, :, None, :] - cum[:, None, :, :]).exp() * (idx[:, None] >= idx[None, :])[..., None]
    torch.testing.assert_close(pair_decays(g), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(tail_decays(g), (cum[:, -1:] - cum).exp(), rtol=1e-12, atol=0)
    g.requires_grad_()
    assert torch.autograd.gradcheck(pair_decays, (g,))
    assert torch.autograd.gradgradcheck(pair_decays, (g,))
