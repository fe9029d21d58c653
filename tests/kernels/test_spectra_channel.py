"""Spectra of per-channel-gated windows (kernels.spectra.channel) against the recurrence itself and closed forms."""

from __future__ import annotations

import functools

import pytest
import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.spectra.channel import channel_spectra, channel_window_products
from deltalab.kernels.spectra.householder import householder_spectra
from deltalab.kernels.testing import transition_inputs

channel_transitions = functools.partial(transition_inputs, gate="channel", seed=0)
"""float64 unit keys, beta in [0, 2), per-channel log decays in (-decay, 0]."""


def _hausdorff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest distance from a point of either set [..., n] to the nearest point of the other."""
    dist = (a[..., :, None] - b[..., None, :]).abs()
    return max(dist.min(-1).values.max().item(), dist.min(-2).values.max().item())


@pytest.mark.parametrize("n_h, window, stride", [(1, 3, 2), (2, 2, 1), (1, 1, 1)])
def test_products_are_the_recurrence_from_the_identity(n_h, window, stride):
    """With v = 0 and H_0 = I, the reference recurrence over a window's tokens ends at the window's product."""
    B, T, H, K = 2, 9, 2, 5
    k, beta, g = channel_transitions(B, T, n_h, H, K, seed=n_h)
    prod = channel_window_products(k, beta, g, window=window, stride=stride)
    assert prod.shape == (B, (T - window) // stride + 1, H, K, K)
    eye = torch.eye(K, dtype=torch.float64).expand(B, H, K, K)
    for i in range(prod.shape[1]):
        sl = slice(i * stride, i * stride + window)
        q = torch.zeros(B, window, H, K, dtype=torch.float64)
        v = torch.zeros(B, window, n_h, H, K, dtype=torch.float64)
        _, final, _ = naive_delta_product(q, k[:, sl], v, beta[:, sl], g[:, sl], initial_state=eye.clone())
        torch.testing.assert_close(prod[:, i], final, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("n_h, window", [(1, 4), (2, 1), (3, 2)])
def test_window_eigenvalues_equal_dense_and_the_determinant(n_h, window):
    B, T, H, K = 1, 12, 3, 16
    k, beta, g = channel_transitions(B, T, n_h, H, K, decay=2.0, seed=window)
    spec = channel_spectra(k, beta, g, window=window, stride=window)
    Tw = T // window
    assert spec.eigenvalues.shape == (B, Tw, H, K) and spec.eigenvalues.dtype == torch.complex128
    dense = torch.linalg.eigvals(channel_window_products(k, beta, g, window=window, stride=window))
    assert _hausdorff(spec.eigenvalues, dense) < 1e-12
    # det A = prod_t e^{sum_c g_tc} prod_j (1 - b_j |k_j|^2), a closed form independent of the products
    g_sum = g.sum(-1).unfold(1, window, window).sum(-1)  # [B, T', H]
    house = (1 - beta * (k * k).sum(-1)).unfold(1, window, window)  # [B, T', n_h, H, w]
    det = g_sum.exp() * house.prod(-1).prod(2)
    torch.testing.assert_close(spec.eigenvalues.prod(-1), det.to(torch.complex128), rtol=1e-10, atol=1e-14)


def test_one_token_uses_the_exact_solver_and_agrees_with_dense():
    k, beta, g = channel_transitions(2, 7, 1, 2, 16, decay=3.0, seed=5)
    spec = channel_spectra(k, beta, g)
    dense = torch.linalg.eigvals(channel_window_products(k, beta, g))
    assert (spec.eigenvalues.imag == 0).all()  # similar to a symmetric matrix: real
    assert _hausdorff(spec.eigenvalues, dense) < 1e-13


def test_equal_channels_give_the_scalar_gate_window_spectrum():
    """g equal across channels: the Householder window spectrum times e^{sum g}, and e^{sum g} for the rest."""
    B, T, n_h, H, K, w = 1, 8, 2, 2, 8, 2
    k, beta, g = channel_transitions(B, T, n_h, H, K, seed=7)
    gs = g[..., 0]
    spec = channel_spectra(k, beta, gs[..., None].expand_as(g).contiguous(), window=w, stride=w)
    scalar = householder_spectra(k, beta, gs, window=w, stride=w).eigenvalues  # the w * n_h non-trivial ones
    trivial = gs.unfold(1, w, w).sum(-1).exp()[..., None].to(torch.complex128)
    assert _hausdorff(spec.eigenvalues, torch.cat([scalar, trivial], -1)) < 1e-12


def test_bad_inputs_name_the_tensor_in_one_line():
    k, beta, g = channel_transitions(1, 5, 1, 2, 4)
    with pytest.raises(ValueError, match=r"^expected a per-channel gate g \[B,T,H,K\]"):
        channel_spectra(k, beta, g[..., 0])
    with pytest.raises(ValueError, match="window=6"):
        channel_spectra(k, beta, g, window=6)
