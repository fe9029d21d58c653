"""Householder-product spectra (kernels.spectra.householder) against dense float64 eigvals of the same products."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deltalab.kernels.spectra.householder import householder_spectra, small_eigenvalues, sort_eigenvalues
from deltalab.kernels.spectra.naive import dense_products, naive_spectra
from deltalab.kernels.testing import transition_inputs


def matched_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| after pairing the eigenvalues of each token in the best order (n <= 6)."""
    n = a.shape[-1]
    best = None
    for perm in itertools.permutations(range(n)):
        err = (a[..., list(perm)] - b).abs().amax(-1)
        best = err if best is None else torch.minimum(best, err)
    return best.max().item()


def random_inputs(B=2, T=7, n_h=2, H=3, K=16, gated=False, dtype=torch.float32):
    """Unit keys (beta = 2 is an exact reflection), beta in [0, 2), log decays in (-1, 0] when gated (global
    generator)."""
    k, beta, g = transition_inputs(B, T, n_h, H, K, gated, dtype=dtype)
    beta[:, 0] = 2.0  # exact reflections somewhere in every test
    return k, beta, g


@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("window", [1, 2])
def test_matches_dense_eigvals(n_h, gated, window):
    k, beta, g = random_inputs(n_h=n_h, gated=gated)
    spec = householder_spectra(k, beta, g, window=window)
    ref = naive_spectra(k, beta, g, window=window)
    assert spec.eigenvalues.shape == ref.shape == (2, 7 - window + 1, 3, window * n_h)
    assert spec.eigenvalues.dtype == torch.complex128
    assert matched_error(spec.eigenvalues, ref) < 1e-9
    assert torch.allclose(spec.angles, spec.eigenvalues.angle().abs())


def test_sorted_by_angle_then_modulus_and_matches_reference_order():
    k, beta, g = random_inputs(n_h=3, T=20, gated=True, dtype=torch.float64)
    eig = householder_spectra(k, beta, g).eigenvalues
    ang, mod = eig.angle(), eig.abs()
    assert (ang.diff(dim=-1) >= 0).all()
    ties = ang.diff(dim=-1) == 0
    assert (mod.diff(dim=-1)[ties] >= 0).all()
    # P is real: non-real eigenvalues come in conjugate pairs.
    assert eig.prod(-1).imag.abs().max() < 1e-12
    ref = naive_spectra(k, beta, g)
    assert (eig - ref).abs().max() < 1e-8  # same deterministic order as the dense reference


@pytest.mark.parametrize("n_h,window,stride", [(1, 4, 1), (2, 2, 2), (3, 2, 1), (1, 3, 2)])
def test_windows_are_products_of_token_transitions(n_h, window, stride):
    """The window spectrum is that of P_{t+w-1}...P_t; beyond 3 keys it goes through the eigvals path."""
    k, beta, g = random_inputs(T=9, n_h=n_h, gated=True, dtype=torch.float64)
    spec = householder_spectra(k, beta, g, window=window, stride=stride)
    ref = naive_spectra(k, beta, g, window=window, stride=stride)
    assert spec.eigenvalues.shape[1] == (9 - window) // stride + 1
    assert matched_error(spec.eigenvalues, ref) < 1e-9
    # Window product = product of the per-token dense products, in time order.
    prods = dense_products(k, beta)
    t = stride  # second window
    manual = torch.eye(k.shape[-1], dtype=torch.float64)
    for s in range(t, t + window):
        manual = prods[:, s] @ manual
    assert torch.allclose(dense_products(k, beta, window=window, stride=stride)[:, 1], manual, atol=1e-12)


def test_gate_scales_every_eigenvalue():
    k, beta, g = random_inputs(n_h=2, gated=True, dtype=torch.float64)
    plain = householder_spectra(k, beta).eigenvalues
    gated = householder_spectra(k, beta, g).eigenvalues
    assert torch.allclose(gated, plain * g.exp()[..., None], atol=1e-14)


def test_reflections_have_unit_modulus_pairs():
    """beta = 2: every factor is a reflection, P is orthogonal; a single one has eigenvalue -1."""
    k, beta, _ = random_inputs(n_h=2, T=16, dtype=torch.float64)
    beta.fill_(2.0)
    eig = householder_spectra(k, beta).eigenvalues
    assert (eig.abs() - 1).abs().max() < 1e-12
    assert (eig.prod(-1) - 1).abs().max() < 1e-12  # det = +1: a rotation
    one = householder_spectra(k[:, :, :1], beta[:, :, :1]).eigenvalues
    assert (one + 1).abs().max() < 1e-14


@pytest.mark.parametrize("phi", [0.1, 0.4, math.pi / 4, 1.2, math.pi / 2 - 1e-3])
def test_two_reflections_rotate_by_twice_the_angle(phi):
    """Planes (normals k1, k2) meeting at angle phi: P = R2 R1 rotates by 2 phi: eigenvalues e^{+-2 i phi}."""
    K = 12
    basis, _ = torch.linalg.qr(torch.randn(K, 2, dtype=torch.float64))
    k1 = basis[:, 0]
    k2 = math.cos(phi) * basis[:, 0] + math.sin(phi) * basis[:, 1]
    k = torch.stack([k1, k2])[None, None, :, None, :]  # [1,1,2,1,K]
    beta = torch.full((1, 1, 2, 1), 2.0, dtype=torch.float64)
    spec = householder_spectra(k, beta)
    c, s = math.cos(2 * phi), math.sin(2 * phi)
    expected = torch.tensor([complex(c, -s), complex(c, s)], dtype=torch.complex128)
    assert (spec.eigenvalues[0, 0, 0] - expected).abs().max() < 1e-12
    assert torch.allclose(spec.angles[0, 0, 0], torch.full((2,), 2 * phi, dtype=torch.float64), atol=1e-12)


def test_degenerate_keys():
    """Repeated, opposite and zero keys and zero betas: the reduction is exact for any keys."""
    k, beta, _ = random_inputs(n_h=3, T=12, dtype=torch.float64)
    k[:, 0:3, 1] = k[:, 0:3, 0]  # repeated key
    k[:, 3:6, 2] = -k[:, 3:6, 0]  # opposite key
    k[:, 6:9, 1] = 0  # zero key
    beta[:, 9:, 1] = 0  # identity factor
    spec = householder_spectra(k, beta)
    assert spec.eigenvalues.isfinite().all()
    # Multiple eigenvalues (1 from the dead factors) are sensitive as sqrt(eps).
    assert matched_error(spec.eigenvalues, naive_spectra(k, beta)) < 1e-6
    # Same key twice with beta = 2: two identical reflections cancel.
    k2 = k[:, :1, :2].clone()
    k2[:, :, 1] = k2[:, :, 0]
    both = householder_spectra(k2, torch.full(k2.shape[:4], 2.0, dtype=torch.float64)).eigenvalues
    assert (both - 1).abs().max() < 1e-7


def test_float32_small_problem_and_unnormalised_keys():
    k, beta, g = random_inputs(n_h=3, T=10, gated=True)
    raw = k * (1 + torch.rand(k.shape[:-1]))[..., None]
    spec = householder_spectra(raw, beta, g, normalize_k=True, dtype=torch.float32)
    assert spec.eigenvalues.dtype == torch.complex64
    assert matched_error(spec.eigenvalues.to(torch.complex128), naive_spectra(k, beta, g)) < 2e-3


def test_cubic_closed_form_on_many_random_matrices():
    c = torch.randn(20000, 3, 3, dtype=torch.float64)
    ours = small_eigenvalues(c)
    assert matched_error(ours, torch.linalg.eigvals(c)) < 1e-7
    ours2 = small_eigenvalues(c[:, :2, :2])
    assert matched_error(ours2, torch.linalg.eigvals(c[:, :2, :2])) < 1e-7


def test_sort_canonicalises_negative_zero():
    re = torch.tensor([[-1.0, 0.5]], dtype=torch.float64)
    eig = torch.complex(re, torch.tensor([[-0.0, 0.0]], dtype=torch.float64))
    out = sort_eigenvalues(eig)
    assert out[0, 0].real == 0.5 and out.angle()[0, 1] == math.pi


def test_bad_inputs_raise_value_error():
    k, beta, g = random_inputs()
    with pytest.raises(ValueError, match="beta"):
        householder_spectra(k, beta[..., :1])
    with pytest.raises(ValueError, match="g"):
        householder_spectra(k, beta, torch.zeros(2, 7, 5))
    with pytest.raises(ValueError, match="window"):
        householder_spectra(k, beta, window=8)


def test_nan_keys_of_wide_windows_raise_one_line_instead_of_crashing_lapack():
    """Windows of more than 3 keys go to LAPACK on the CPU (and for the few the GPU's QR does not converge); a NaN
    key there once ended a capture in an MKL error and a segfault."""
    k, beta, _ = random_inputs()
    k[0, 2, 0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        householder_spectra(k, beta, window=4)
    from deltalab.kernels.spectra.householder import cpu_eigvals

    with pytest.raises(ValueError, match="NaN or inf"):
        cpu_eigvals(torch.full((2, 3, 3), float("nan"), dtype=torch.float64))


@pytest.mark.gpu
def test_gpu_realistic_shapes_match_reference():
    k, beta, g = random_inputs(B=2, T=2048, n_h=3, H=8, K=128, gated=True)
    spec = householder_spectra(k.cuda(), beta.cuda(), g.cuda())
    sub = slice(0, 2048, 97)
    ref = naive_spectra(k[:, sub].cuda(), beta[:, sub].cuda(), g[:, sub].cuda())
    assert matched_error(spec.eigenvalues[:, sub], ref) < 1e-9
    cpu = householder_spectra(k, beta, g).eigenvalues
    assert matched_error(spec.eigenvalues.cpu(), cpu) < 1e-10
    win = householder_spectra(k.cuda(), beta.cuda(), g.cuda(), window=2, stride=64)
    ref_w = naive_spectra(k.cuda(), beta.cuda(), g.cuda(), window=2, stride=64)
    assert matched_error(win.eigenvalues, ref_w) < 1e-9


def _argsort_order(eig: torch.Tensor) -> torch.Tensor:
    """The two stable argsorts (modulus, then angle) the sorting network replaces, NaN rows canonical."""
    im = eig.imag
    eig = torch.complex(eig.real, torch.where(im == 0, torch.zeros_like(im), im))
    eig = eig.gather(-1, eig.abs().argsort(dim=-1, stable=True))
    return eig.gather(-1, eig.angle().argsort(dim=-1, stable=True))


@pytest.mark.parametrize("n", [2, 3, 4, 8, 12, 16])
def test_sorting_network_equals_stable_argsorts(n):
    gen = torch.Generator().manual_seed(n)
    re = torch.randn(500, n, generator=gen, dtype=torch.float64)
    im = torch.randn(500, n, generator=gen, dtype=torch.float64)
    im[::3] = 0  # real sets: ties in angle (0 or pi), broken by modulus
    re[1::5, : n // 2] = 0.5  # ties in angle and modulus: kept in order
    im[1::5, : n // 2] = 0.0
    pairs = n // 2  # conjugate pairs: columns 2j and 2j + 1
    re[2::7, 1 : 2 * pairs : 2] = re[2::7, 0 : 2 * pairs : 2]
    im[2::7, 1 : 2 * pairs : 2] = -im[2::7, 0 : 2 * pairs : 2]
    eig = torch.complex(re, im)
    eig[4::11] = complex(float("nan"), float("nan"))  # padding rows
    ours = sort_eigenvalues(eig)
    want = _argsort_order(eig)
    finite = ~eig.isnan().any(-1)
    assert torch.equal(ours[finite], want[finite])
    assert ours[~finite].isnan().all()
    assert (ours.angle()[finite].diff(dim=-1) >= 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_keys_token_eigenvalue_is_exact_in_float64(dtype):
    """n_h = 1, one token: 1 - beta |k|^2 from half keys (squared in float32, exact) equals the float64 formula."""
    gen = torch.Generator().manual_seed(3)
    k = torch.nn.functional.normalize(torch.randn(2, 50, 1, 3, 64, generator=gen), dim=-1).to(dtype)
    beta = torch.rand(2, 50, 1, 3, generator=gen, dtype=torch.float64) * 2
    eig = householder_spectra(k, beta).eigenvalues[..., 0]
    want = 1 - beta[:, :, 0] * k[:, :, 0].double().square().sum(-1)
    assert torch.equal(eig.real, want) and (eig.imag == 0).all()
