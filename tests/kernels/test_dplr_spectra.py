"""Exact spectra of the generalised delta rule's transitions diag(d) + b a^T (RWKV-7: a = -kappa,
b = kappa * a_rwkv) by `dplr_eigvals_general`, against dense float64 eigvals of the matrices themselves and
eigvalsh of the similar symmetric diag(d) - z z^T. Measured max |error| vs dense eigvals: 1.0e-14 at n = 128."""

from __future__ import annotations

import warnings

import pytest
import torch

from deltalab.kernels.spectra.dplr import dplr_eigvals_general


def rwkv7_transitions(N: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d = e^g with RWKV-7's log decay range (-e^-0.5, 0), a = -kappa, b = kappa * a_rwkv."""
    gen = torch.Generator().manual_seed(seed)
    d = (-torch.rand(N, n, generator=gen, dtype=torch.float64) * 0.6065).exp()
    kappa = torch.nn.functional.normalize(torch.randn(N, n, generator=gen, dtype=torch.float64), dim=-1)
    a_rwkv = torch.rand(N, n, generator=gen, dtype=torch.float64)
    return d, -kappa, kappa * a_rwkv


def dense(d, a, b):
    return torch.linalg.eigvals(torch.diag_embed(d) + b[..., :, None] * a[..., None, :])


def symmetric(d, a, b):
    z = (-(a * b)).clamp(min=0).sqrt()
    return torch.linalg.eigvalsh(torch.diag_embed(d) - z[..., :, None] * z[..., None, :])


def exact(d, a, b):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # RWKV-7's sign pattern never falls back to the dense path
        return dplr_eigvals_general(d, a, b)


@pytest.mark.parametrize("n", [2, 16, 64, 128])
def test_random_rwkv7_transitions_match_dense(n):
    N = 48 if n < 128 else 12
    d, a, b = rwkv7_transitions(N, n, seed=n)
    got = exact(d, a, b)
    assert got.dtype == torch.float64 and got.shape == (N, n)
    ref = dense(d, a, b)
    assert ref.imag.abs().max() < 1e-12  # the spectrum is real
    assert (got - torch.sort(ref.real, -1).values).abs().max() < 1e-12
    assert (got - symmetric(d, a, b)).abs().max() < 1e-13


@pytest.mark.parametrize("n", [16, 64])
def test_hard_cases_match_dense(n):
    d, a, b = rwkv7_transitions(8, n, seed=50 + n)
    kappa, a_rwkv = -a, torch.where(a != 0, b / -a, torch.zeros_like(b))
    kappa[0, ::3] = 0.0                                     # zero kappa components
    a_rwkv[1] = 0.0                                         # no removal: M = diag(d)
    a_rwkv[2] = 1.0                                         # full removal rate
    d[3] = 1.0                                              # ... and no decay: I - kappa kappa^T, a projection
    a_rwkv[3] = 1.0
    d[4, 1::2] = d[4, 0::2][: d[4, 1::2].shape[0]] * (1 + 1e-15)  # near-repeated decays
    d[5, : n // 2] = d[5, 0]                                # exactly repeated decays
    d[6] = torch.linspace(1e-9, 1e-6, n, dtype=torch.float64)  # decays near 0 (strong: e^-20 and below)
    kappa[7] = 0.0                                          # a zero removal key
    kappa = torch.where(kappa.norm(dim=-1, keepdim=True) > 0, torch.nn.functional.normalize(kappa, dim=-1), kappa)
    a, b = -kappa, kappa * a_rwkv
    got = exact(d, a, b)
    assert (got - symmetric(d, a, b)).abs().max() < 1e-13
    assert (got - torch.sort(dense(d, a, b).real, -1).values).abs().max() < 1e-12
    assert torch.equal(got[1], torch.sort(d[1]).values) and torch.equal(got[7], torch.sort(d[7]).values)
    projection = torch.cat([torch.zeros(1, dtype=torch.float64), torch.ones(n - 1, dtype=torch.float64)])
    assert (got[3] - projection).abs().max() < 1e-14


def test_eigenvalues_interlace_the_decays_and_batch_shapes_pass_through():
    d, a, b = rwkv7_transitions(60, 12, seed=3)
    got = exact(d.view(3, 4, 5, 12), a.view(3, 4, 5, 12), b.view(3, 4, 5, 12)).view(60, 12)
    ds = torch.sort(d, -1).values
    assert bool((got[:, 1:] >= ds[:, :-1] - 1e-15).all() and (got <= ds + 1e-15).all())


def test_mixed_signs_warn_and_take_dense_eigvals():
    """a_1 b_1 > 0 > a_2 b_2 can give a complex pair: diag(0, 1) + (1, 1)(1, -1)^T has (1 +- i sqrt 3) / 2."""
    d = torch.tensor([[0.0, 1.0], [0.5, 0.9]], dtype=torch.float64)
    a = torch.tensor([[1.0, -1.0], [-0.3, -0.4]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [0.2, 0.1]], dtype=torch.float64)
    with pytest.warns(UserWarning, match="dense float64 eigvals") as record:
        got = dplr_eigvals_general(d, a, b)
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert got.dtype == torch.complex128
    pair = torch.tensor([0.5 - 0.75**0.5 * 1j, 0.5 + 0.75**0.5 * 1j], dtype=torch.complex128)
    assert (got[0] - pair).abs().max() < 1e-14
    assert (got[1].real - exact(d[1:], a[1:], b[1:])[0]).abs().max() < 1e-14 and torch.equal(got[1].imag,
                                                                                              torch.zeros(2).double())


def test_bad_shapes_name_the_tensors():
    d, a, b = rwkv7_transitions(2, 8, seed=0)
    with pytest.raises(ValueError, match="must have one shape"):
        dplr_eigvals_general(d, a[:, :4], b)
