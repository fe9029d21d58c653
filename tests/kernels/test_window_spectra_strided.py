"""The strided window kernel (kernels.triton_eig.window_householder_eigvals) against the contiguous one.

It reads k [B,T,n_h,H,K] and beta in place and converts them to float64 in registers; the same float64 values
then go through the same arithmetic (one shared jitted body) as `householder_eigvals` of `window_keys` in float64,
so the results are compared bit for bit. CPU tests run under TRITON_INTERPRET=1; the GPU test at a capture shape.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels.spectra as spectra
import kernels.triton_eig as te
from kernels.spectra import householder_spectra, window_keys
from kernels.spectra_naive import naive_spectra

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def inputs(B, T, n_h, H, K, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, T, n_h, H, K, dtype=torch.float64, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = 2 * torch.rand(B, T, n_h, H, dtype=torch.float64, generator=gen)
    beta[:, ::3] = 2.0  # exact reflections
    return k.to(device=device, dtype=dtype), beta.to(device=device, dtype=dtype)


def contiguous_reference(k, beta, window, stride, **kwargs):
    """What `householder_spectra` computed before: window_keys, float64 copies, the contiguous kernel."""
    keys, betas = window_keys(k, beta, window, stride)
    B, Tw, H, n, K = keys.shape
    eig = te.householder_eigvals(keys.reshape(-1, n, K).double(), betas.reshape(-1, n).double(), **kwargs)
    return eig.reshape(B, Tw, H, n)


@needs_triton
@pytest.mark.parametrize(
    "dtype,n_h,window,stride,B,T,H,K",
    [
        (torch.float64, 1, 4, 4, 2, 13, 3, 16),  # the capture's windows; T not a multiple of the stride
        (torch.bfloat16, 1, 4, 4, 2, 13, 3, 16),
        (torch.float16, 1, 4, 4, 1, 12, 2, 24),
        (torch.float64, 1, 5, 2, 1, 10, 2, 24),  # overlapping windows
        (torch.float64, 1, 4, 6, 2, 13, 2, 16),  # stride > window: tokens skipped
        (torch.float64, 2, 3, 2, 1, 9, 2, 16),  # n = 6, two steps per token
        (torch.bfloat16, 2, 3, 3, 2, 8, 1, 24),
        (torch.float64, 4, 1, 1, 1, 4, 2, 16),  # one token of 4 steps
    ],
)
def test_strided_equals_contiguous_bit_for_bit(dtype, n_h, window, stride, B, T, H, K):
    k, beta = inputs(B, T, n_h, H, K, dtype, seed=T + K + n_h)
    got = te.window_householder_eigvals(k, beta, window, stride)
    ref = contiguous_reference(k, beta, window, stride)
    assert got.shape == ref.shape == (B, (T - window) // stride + 1, H, window * n_h)
    assert got.dtype == torch.complex128
    assert torch.equal(got, ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_strided_reads_non_contiguous_views(dtype):
    """k stored [B,T,H,n_h,K'] and viewed as [B,T,n_h,H,K] (permuted, K sliced out of a wider K'), beta
    transposed, every other batch: all strides but none of them contiguous."""
    B, T, n_h, H, K = 4, 8, 2, 2, 16
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(B, T, H, n_h, K + 8, dtype=torch.float64, generator=gen)
    k = (k / k[..., :K].norm(dim=-1, keepdim=True)).to(dtype).permute(0, 1, 3, 2, 4)[::2, :, :, :, :K]
    beta = (2 * torch.rand(B, H, n_h, T, dtype=torch.float64, generator=gen)).to(dtype).permute(0, 3, 2, 1)[::2]
    assert not k.is_contiguous() and not beta.is_contiguous()
    got = te.window_householder_eigvals(k, beta, 2, 3, programs=3)
    ref = contiguous_reference(k.contiguous(), beta.contiguous(), 2, 3)
    assert torch.equal(got, ref)


@needs_triton
def test_strided_matches_dense_spectra():
    """Not only the same as the contiguous kernel: right (against dense float64 products)."""
    k, beta = inputs(1, 9, 1, 2, 16, torch.float64, seed=4)
    got = spectra.sort_eigenvalues(te.window_householder_eigvals(k, beta, 4, 2))
    assert (got - naive_spectra(k, beta, window=4, stride=2)).abs().max() < 1e-12


class _Unconverged:
    """Stands in for the strided kernel: runs it (if any), then reports the windows in `bad` as not converged."""

    def __init__(self, kernel, bad):
        self.kernel, self.bad = kernel, bad

    def __getitem__(self, grid):
        def launch(k, beta, scratch, re, im, ok, *args, **kwargs):
            if self.kernel is None:
                ok.fill_(1)
            else:
                self.kernel[grid](k, beta, scratch, re, im, ok, *args, **kwargs)
            for b, w, h in self.bad:
                re[b, w, h], im[b, w, h], ok[b, w, h] = float("nan"), float("nan"), 0

        return launch


@needs_triton
def test_windows_that_do_not_converge_go_to_the_fallback(monkeypatch):
    """The non-converged windows' keys (gathered from k, in window_keys' order, in float64) go to the fallback
    and its answers land in their places; without a fallback it is one clear error."""
    B, T, n_h, H, K, window, stride = 2, 7, 2, 2, 16, 3, 2
    k, beta = inputs(B, T, n_h, H, K, torch.bfloat16, seed=9)
    k = k.transpose(2, 3).contiguous().transpose(2, 3)  # strided: the gather must follow k's layout
    bad = [(0, 0, 1), (1, 2, 0), (1, 1, 1)]
    good = te.window_householder_eigvals(k, beta, window, stride)
    monkeypatch.setattr(te, "_window_householder_eig_kernel", _Unconverged(te._window_householder_eig_kernel, bad))
    keys, betas = window_keys(k, beta, window, stride)
    seen = []

    def fallback(fk, fb):
        seen.append((fk, fb))
        return spectra._wide_eigenvalues_cpu(fk, fb)

    got = te.window_householder_eigvals(k, beta, window, stride, fallback=fallback)
    (fk, fb), = seen
    idx = tuple(torch.tensor(list(i)) for i in zip(*sorted(bad)))
    assert fk.dtype == fb.dtype == torch.float64 and fk.device.type == "cpu"
    assert torch.equal(fk, keys[idx].double()) and torch.equal(fb, betas[idx].double())
    mask = torch.ones(got.shape[:3], dtype=torch.bool)
    mask[idx] = False
    assert torch.equal(got[mask], good[mask])
    assert torch.equal(got[idx], spectra._wide_eigenvalues_cpu(fk, fb))
    sort = spectra.sort_eigenvalues
    assert (sort(got[idx]) - sort(good[idx])).abs().max() < 1e-12  # LAPACK agrees with the kernel (unordered)
    monkeypatch.setattr(te, "_window_householder_eig_kernel", _Unconverged(None, bad))
    with pytest.raises(RuntimeError, match=r"^window_householder_eigvals: 3 of 12 windows did not converge; pass "):
        te.window_householder_eigvals(k, beta, window, stride)


@needs_triton
def test_bad_arguments_raise():
    k, beta = inputs(1, 6, 1, 2, 8, torch.float64)
    with pytest.raises(ValueError, match="n <= 32"):
        te.window_householder_eigvals(torch.zeros(1, 40, 3, 2, 8), torch.zeros(1, 40, 3, 2), 11, 1)
    with pytest.raises(ValueError, match="window=7"):
        te.window_householder_eigvals(k, beta, 7, 1)
    with pytest.raises(ValueError, match="expected k"):
        te.window_householder_eigvals(k, beta[..., 0], 2, 1)


def test_cpu_spectra_keep_the_block_path(monkeypatch):
    """CPU tensors never take the strided path (it is CUDA only): same results with the switch on or off."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the strided kernel ran on CPU tensors")

    monkeypatch.setattr(te, "window_householder_eigvals", forbidden)
    k, beta = inputs(1, 9, 2, 2, 16, torch.float64, seed=2)
    monkeypatch.setattr(spectra, "STRIDED_WINDOWS", True)
    on = householder_spectra(k, beta, window=3, stride=2)
    monkeypatch.setattr(spectra, "STRIDED_WINDOWS", False)
    off = householder_spectra(k, beta, window=3, stride=2)
    assert torch.equal(on.eigenvalues, off.eigenvalues)
    assert (on.eigenvalues - naive_spectra(k, beta, window=3, stride=2)).abs().max() < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gpu_strided_spectra_equal_the_block_path(monkeypatch, dtype):
    """A capture-like shape (dk = 128, windows of 4 every 4 tokens, one step) and n_h = 3 windows of 2: the
    strided path of householder_spectra gives the block path's spectra bit for bit."""
    for n_h, window, stride, T in [(1, 4, 4, 1030), (3, 2, 1, 131)]:
        k, beta = inputs(2, T, n_h, 8, 128, dtype, seed=T, device="cuda")
        g = -torch.rand(2, T, 8, dtype=torch.float64, device="cuda")
        monkeypatch.setattr(spectra, "STRIDED_WINDOWS", True)
        on = householder_spectra(k, beta, g, window=window, stride=stride)
        monkeypatch.setattr(spectra, "STRIDED_WINDOWS", False)
        off = householder_spectra(k, beta, g, window=window, stride=stride)
        assert torch.equal(on.eigenvalues, off.eigenvalues)
