"""The Francis QR Triton kernel (kernels.linalg.triton_eig) against LAPACK and dense float64 products.

On the CPU it runs under TRITON_INTERPRET=1 on a handful of small matrices; the GPU test runs it at scale.
"""

from __future__ import annotations

import os

import pytest
import torch

from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.kernels.linalg.triton_eig import householder_eigvals, triton_eigvals
from deltalab.kernels.spectra.householder import householder_spectra, wide_eigenvalues
from deltalab.kernels.spectra.naive import naive_spectra

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def matched_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| after greedily pairing each eigenvalue of a with the nearest unused one of b."""
    worst = 0.0
    for row_a, row_b in zip(a.reshape(-1, a.shape[-1]).tolist(), b.reshape(-1, b.shape[-1]).tolist()):
        pool = list(row_b)
        for x in row_a:
            j = min(range(len(pool)), key=lambda i: abs(pool[i] - x))
            worst = max(worst, abs(pool.pop(j) - x))
    return worst


def dense_eigvals(keys: torch.Tensor, betas: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of the dk x dk product (I - b_n k_n k_n^T) ... (I - b_1 k_1 k_1^T), float64."""
    N, n, dk = keys.shape
    eye = torch.eye(dk, dtype=torch.float64)
    P = eye.expand(N, dk, dk).clone()
    for i in range(n):
        P = (eye - betas[:, i, None, None] * keys[:, i, :, None] * keys[:, i, None, :]) @ P
    return torch.linalg.eigvals(P)


def keys_in_subspace(N: int, n: int, dk: int, rank: int | None, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, n, rank or dk, dtype=torch.float64, generator=gen)
    if rank is not None:
        basis, _ = torch.linalg.qr(torch.randn(dk, rank, dtype=torch.float64, generator=gen))
        x = x @ basis.T
    return x / x.norm(dim=-1, keepdim=True)  # exactly unit (l2_normalize's eps would spoil reflections)


@needs_triton
@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_general_matrices_match_lapack(n):
    a = torch.randn(3, n, n, dtype=torch.float64)
    a[0] = torch.linalg.qr(a[0])[0]  # orthogonal: every eigenvalue on the unit circle
    eig, ok = triton_eigvals(a)
    assert ok.all()
    assert matched_error(eig, torch.linalg.eigvals(a)) < 1e-12


@needs_triton
def test_structured_matrices():
    """Zero, identity, a Jordan block and triangular matrices: already (quasi-)triangular inputs."""
    n = 6
    jordan = 0.5 * torch.eye(n, dtype=torch.float64) + torch.diag(torch.ones(n - 1, dtype=torch.float64), 1)
    a = torch.stack([torch.zeros(n, n), torch.eye(n), torch.triu(torch.randn(n, n))]).to(torch.float64)
    a = torch.cat([a, jordan[None]])
    eig, ok = triton_eigvals(a)
    assert ok.all()
    assert matched_error(eig[:3], torch.linalg.eigvals(a[:3])) < 1e-14
    assert (eig[3] - 0.5).abs().max() < 1e-2  # a defective eigenvalue is only eps^(1/n) accurate anyway


@needs_triton
@pytest.mark.parametrize(
    "n,dk,rank,beta",
    [(12, 32, 3, 2.0), (12, 32, 3, None), (8, 24, None, None), (10, 8, None, None), (6, 16, None, 2.0)],
)
def test_householder_products_match_dense(n, dk, rank, beta):
    """Keys in a 3-D subspace with exact reflections are the hard case (9 eigenvalues equal to 1 beside a
    rotation); through Z = I - R M R^T they stay exact. n > dk leaves n - dk eigenvalues equal to 1."""
    keys = keys_in_subspace(2, n, dk, rank, seed=n + dk)
    gen = torch.Generator().manual_seed(7)
    betas = torch.full((2, n), beta, dtype=torch.float64) if beta else 2 * torch.rand(2, n, generator=gen).double()
    eig = householder_eigvals(keys, betas)
    assert eig.shape == (2, n) and eig.dtype == torch.complex128
    dense = dense_eigvals(keys, betas)
    if n <= dk:
        ours = torch.cat([eig, torch.ones(2, dk - n, dtype=eig.dtype)], -1)
        assert matched_error(ours, dense) < 1e-12
    else:
        assert matched_error(dense, eig) < 1e-12
    assert matched_error(eig, wide_eigenvalues(keys, betas)) < 1e-12  # the CPU path agrees


@needs_triton
def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="square"):
        triton_eigvals(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="n <= 32"):
        householder_eigvals(torch.zeros(1, 33, 8), torch.zeros(1, 33))


def test_cpu_window_spectra_exact_for_reflections_in_a_subspace():
    """The CPU path of a 4-token window (12 keys in 3-D, beta = 2) against dense float64 eigvals."""
    B, T, n_h, H, K = 1, 6, 3, 2, 16
    keys = keys_in_subspace(B * T * H, n_h, K, 3, seed=3).reshape(B, T, H, n_h, K).transpose(2, 3)
    beta = torch.full((B, T, n_h, H), 2.0, dtype=torch.float64)
    spec = householder_spectra(keys, beta, window=4)
    ref = naive_spectra(keys, beta, window=4)
    assert matched_error(spec.eigenvalues, ref) < 1e-12
    assert (spec.eigenvalues.abs() - 1).abs().max() < 1e-12


@pytest.mark.gpu
def test_gpu_window_spectra_match_dense():
    """Realistic: dk = 128, n_h = 3, windows of 4 (12 keys), gated, against dense float64 eigvals."""
    B, T, n_h, H, K = 1, 257, 3, 4, 128
    k = l2_normalize(torch.randn(B, T, n_h, H, K, dtype=torch.float64))
    beta = 2 * torch.rand(B, T, n_h, H, dtype=torch.float64)
    beta[:, ::5] = 2.0
    g = -torch.rand(B, T, H, dtype=torch.float64)
    spec = householder_spectra(k.cuda(), beta.cuda(), g.cuda(), window=4)
    sub = slice(0, T - 3, 23)
    ref = naive_spectra(k, beta, g, window=4)
    assert matched_error(spec.eigenvalues[:, sub].cpu(), ref[:, sub]) < 1e-11
    cpu = householder_spectra(k, beta, g, window=4).eigenvalues
    assert matched_error(spec.eigenvalues.cpu(), cpu) < 1e-11
    keys = keys_in_subspace(4096, 12, 128, 3, seed=0)
    eig = householder_eigvals(keys.cuda(), torch.full((4096, 12), 2.0, dtype=torch.float64).cuda())
    assert (eig.abs() - 1).abs().max() < 1e-12


def test_cpu_path_survives_lapack_stall():
    """A window of the bundled S4 model (the same two tokens twice: keys in 3 dimensions, 8 factors) on which
    LAPACK's batched QR failed to converge; the CPU path retries it after a random orthogonal similarity."""
    import json
    from pathlib import Path

    fixture = json.loads((Path(__file__).parents[1] / "fixtures" / "lapack_stall_window.json").read_text())
    keys = torch.tensor(fixture["keys"], dtype=torch.float64)[None]
    betas = torch.tensor(fixture["betas"], dtype=torch.float64)[None]
    eig = wide_eigenvalues(keys, betas)
    dense = dense_eigvals(keys, betas)
    ours = torch.cat([eig, torch.ones(1, keys.shape[-1] - keys.shape[1], dtype=eig.dtype)], -1)
    assert matched_error(ours, dense) < 1e-12


def test_matrices_that_do_not_converge_go_to_the_fallback(monkeypatch):
    """A QR iteration that fails (faked here: the kernel reports no convergence) hands those matrices to the
    fallback that kernels.spectra.householder passes (its LAPACK path); without a fallback it is one clear error."""
    import deltalab.kernels.linalg.triton_eig as te

    class NotConverging:
        def __getitem__(self, grid):
            def launch(keys, betas, scratch, re, im, ok, *args, **kwargs):
                re.zero_(), im.zero_(), ok.zero_()
            return launch

    monkeypatch.setattr(te, "_householder_eig_kernel", NotConverging())
    gen = torch.Generator().manual_seed(5)
    keys = torch.nn.functional.normalize(torch.randn(5, 4, 8, generator=gen, dtype=torch.float64), dim=-1)
    betas = 2 * torch.rand(5, 4, generator=gen, dtype=torch.float64)
    got = te.householder_eigvals(keys, betas, fallback=wide_eigenvalues)
    assert torch.equal(got, wide_eigenvalues(keys, betas))
    with pytest.raises(RuntimeError, match=r"^householder_eigvals: 5 of 5 matrices did not converge; pass fallback="):
        te.householder_eigvals(keys, betas)
