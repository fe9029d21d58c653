"""The chunked DPLR form (RWKV-7's generalised delta rule) in float32 against the float64 loop at strong decays.

Per-channel log decays of up to -20 per token sum to about -600 over a 64-token chunk; a decay between two tokens
taken as the difference of two such running totals carries fp32's spacing there (6e-5) into the exponent. The
chunked form sums each decay from the gates it spans (`dplr_decayed_products`, `tail_decays`), so float32 stays
within 2e-6 of float64 (max |ours - ref| / max |ref| per output: o, final states, chunk-boundary states), and within
5e-7 in RWKV-7's own range (log w = -e^{-0.5} sigmoid(x) in (-0.61, 0)). The reference gets the same float32 inputs
in float64, so the bounds measure the chunked form's arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltalab.kernels.dplr.chunk import chunk_dplr
from deltalab.kernels.dplr.naive import naive_dplr
from deltalab.kernels.testing import rel_err

TOL32 = 2e-6
TOL32_RWKV7 = 5e-7


def _gates(gen, B, T, H, K, kind):
    """uniform: g ~ U(-20, 0) per token and channel; mixed: g ~ U(-s_c, 0) with channel strengths s_c from 1e-3
    to 30, in a different order in each head; rwkv7: g = -e^{-0.5} sigmoid(x), x ~ N(0, 9)."""
    if kind == "rwkv7":
        return -math.exp(-0.5) * torch.sigmoid(3 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64))
    u = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    if kind == "uniform":
        return -20 * u
    strength = torch.logspace(-3, 1.5, K, dtype=torch.float64)
    order = torch.stack([torch.randperm(K, generator=gen) for _ in range(H)])  # [H, K]
    return -u * strength[order]


def _inputs(B, T, H, K, V, kind, n_seq, seed):
    """float32 RWKV-7-shaped inputs (a = -kappa, b = kappa * a_rwkv), an initial state per sequence."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    kappa = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    a_rwkv = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K) / K**0.5, rnd(B, T, H, V)
    g = _gates(gen, B, T, H, K, kind)
    s0 = rnd(n_seq, H, K, V)
    return [x.float() for x in (q, k, v, -kappa, kappa * a_rwkv, g, s0)]


# name: (B, T or sequence lengths, H, K, V, gates)
CASES = {
    "uniform": (2, 150, 2, 16, 8, "uniform"),
    "mixed": (2, 140, 2, 32, 8, "mixed"),
    "uniform, packed": (1, [70, 9, 0, 130, 64], 2, 16, 8, "uniform"),
    "mixed, packed": (1, [65, 3, 0, 128], 2, 16, 8, "mixed"),
    "rwkv7": (2, 150, 2, 32, 16, "rwkv7"),
    "rwkv7, long": (1, 512, 2, 64, 16, "rwkv7"),
    "rwkv7, packed": (1, [65, 3, 0, 128], 2, 16, 8, "rwkv7"),
}


def dplr_errors(name, seed=0, dtype=torch.float32):
    """(o, final, boundary) relative errors of `chunk_dplr` in `dtype` against the float64 loop."""
    B, T, H, K, V, kind = CASES[name]
    lengths = T if isinstance(T, list) else None
    T = sum(lengths) if lengths else T
    N = len(lengths) if lengths else B
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if lengths else None
    x = _inputs(B, T, H, K, V, kind, N, seed=seed + 100 * list(CASES).index(name))
    ref = naive_dplr(*(t.double() for t in x[:6]), scale=1.0, initial_state=x[6].double(), cu_seqlens=cu)
    got = chunk_dplr(*(t.to(dtype) for t in x[:6]), scale=1.0, initial_state=x[6].to(dtype), cu_seqlens=cu)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and torch.isfinite(a).all()
    return tuple(rel_err(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", list(CASES))
def test_float32_within_bound_of_float64_at_strong_decays(name, seed):
    errs = dplr_errors(name, seed)
    tol = TOL32_RWKV7 if CASES[name][-1] == "rwkv7" else TOL32
    assert max(errs) < tol, f"{name}, seed {seed}: float32 rel errors o/final/boundary {errs}"


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_float64_loop_at_strong_decays(name):
    errs = dplr_errors(name, dtype=torch.float64)
    assert max(errs) < 1e-10, f"{name}: float64 rel errors o/final/boundary {errs}"


def test_gradients_at_strong_decays_across_sub_blocks():
    """Differentiable in every input, the decays included, at e^-20 per token, with pairs within and across
    16-token sub-blocks (float64)."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 20, 1, 3, 2  # one 32-token chunk of two sub-blocks (padded)
    x = [torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) * 0.5 for D in (K, K, V, K, K)]
    g = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) * torch.tensor([0.01, 3.0, 20.0])
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (*x, g, s0)]

    def f(q, k, v, a, b, g, s0):
        o, final, bnd = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0, chunk_size=32)
        return o.sum() + final.square().sum() + bnd[:, 1].sum()

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


def test_loop_cumsum_values_and_second_derivatives():
    """`_Cumsum` (the loop cumulative sum behind the decays) is torch.cumsum forwards and from the end, with first
    and second derivatives that match finite differences (float64)."""
    from deltalab.kernels.dplr.chunk import _Cumsum

    x = torch.randn(2, 5, 3, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    torch.testing.assert_close(_Cumsum.apply(x, -3, False), x.cumsum(-3), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(_Cumsum.apply(x, -2, True), x.flip(-2).cumsum(-2).flip(-2), rtol=1e-14, atol=1e-14)
    x.requires_grad_()
    for reverse in (False, True):
        assert torch.autograd.gradcheck(lambda t, r=reverse: _Cumsum.apply(t, -3, r), (x,))
        assert torch.autograd.gradgradcheck(lambda t, r=reverse: _Cumsum.apply(t, -3, r), (x,))
