"""The fused one-key-per-token spectra kernel (`kernels.spectra.triton_token`) against the float64 reduction
(`kernels.spectra.householder.householder_spectra`, window 1): one float32 rounding of 1 - b |k|^2 and exp(g) (1 - b
|k|^2) for unit, unnormalised and zero keys, betas in (0, 2) up to 1 - b |k|^2 ~ 0, half and float inputs, strided
views, with and without a gate; on the CPU under TRITON_INTERPRET=1 and on the GPU (marked), where the spectra probe's
capture path (`probes.spectra.plan(...).fn`) takes it and must agree with the torch path it replaced.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xarray as xr

from deltalab.kernels.spectra.householder import householder_spectra
from deltalab.kernels.spectra.triton_token import token_eigenvalues

CPU_OK = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(not CPU_OK, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
HALF_ULP = 2.0**-24  # one rounding to float32, relative


def _inputs(B: int, T: int, H: int, K: int, dtype: torch.dtype, *, seed: int, unit: bool = True,
            strided: bool = False, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [B,T,1,H,K], beta [B,T,1,H], g [B,T,H] in `dtype`: random keys (unit or of norms in (0, 2)), a few zero
    keys (padding), betas in (0, 2) with some at 1 / |k|^2 (eigenvalue ~ 0), gates in (-3, 1). `strided`: every
    tensor a permuted, sliced view of a larger one (keys with a column stride of 2)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, T, 1, H, K, generator=gen, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True)
    if not unit:
        k = k * 2 * torch.rand(B, T, 1, H, 1, generator=gen, dtype=torch.float64)
    k[:, -1, :, 0] = 0  # padding keys
    beta = 2 * torch.rand(B, T, 1, H, generator=gen, dtype=torch.float64)
    norm2 = k.to(dtype).double().square().sum(-1)
    beta[:, 0] = 1 / norm2[:, 0]  # 1 - b |k|^2 close to 0 (beta is rounded to `dtype`)
    g = 4 * torch.rand(B, T, H, generator=gen, dtype=torch.float64) - 3
    if strided:  # the same values laid out in larger tensors, taken back as permuted, sliced views
        big_k = torch.zeros(T, B, 2, H, 2 * K + 3, dtype=dtype)
        big_k[:, :, 1:2, :, 3::2] = k.permute(1, 0, 2, 3, 4).to(dtype)
        big_b = torch.zeros(H, B, T, 3, dtype=dtype)
        big_b[..., 2:3] = beta.permute(3, 0, 1, 2).to(dtype)
        big_g = torch.zeros(H, T, 2 * B, dtype=dtype)
        big_g[..., ::2] = g.permute(2, 1, 0).to(dtype)
        kv = big_k.to(device).permute(1, 0, 2, 3, 4)[:, :, 1:2, :, 3::2]
        bv = big_b.to(device).permute(1, 2, 3, 0)[:, :, 2:3]
        gv = big_g.to(device)[..., ::2].permute(2, 1, 0)
        assert not (kv.is_contiguous() or bv.is_contiguous() or gv.is_contiguous())
        return kv, bv, gv
    return k.to(device, dtype), beta.to(device, dtype), g.to(device, dtype)


def _reference(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """Eigenvalues [B,T,H,1] complex128, all in float64 from the inputs' exact values."""
    gate = None if g is None else g.double()
    return householder_spectra(k.double(), beta.double(), gate, window=1).eigenvalues


def _check_one_rounding(got: torch.Tensor, ref: torch.Tensor) -> None:
    """got is complex64 [B,T,H,1], ref's float32 rounding up to float64 noise; imaginary parts exactly +0."""
    assert got.dtype == torch.complex64 and got.shape == ref.shape
    got, ref = got.cpu(), ref.cpu()
    assert bool((got.imag == 0).all()) and not bool(torch.signbit(got.imag).any())
    err = (got.real.double() - ref.real).abs()
    bound = HALF_ULP * ref.real.abs() * (1 + 1e-9) + 1e-14
    assert bool((err <= bound).all()), (err / ref.abs().clamp(min=1)).max()
    assert bool((err <= 2e-7 * ref.abs().clamp(min=1)).all())


def _check(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None) -> None:
    eig_p, eig_a = token_eigenvalues(k, beta, g)
    assert eig_p.device == k.device
    _check_one_rounding(eig_p, _reference(k, beta, None))
    if g is None:
        assert eig_a is None
        return
    assert eig_a is not None and eig_a.device == k.device
    _check_one_rounding(eig_a, _reference(k, beta, g))
    # padding: eigenvalue exactly 1, exactly exp(g) with the gate
    assert bool((eig_p[:, -1, 0].cpu() == 1).all())
    assert torch.equal(eig_a[:, -1, 0, 0].real.cpu(), g[:, -1, 0].double().exp().float().cpu())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("K", [40, 128])
@pytest.mark.parametrize("unit", [True, False])
def test_matches_float64_reduction(dtype, K, unit):
    k, beta, g = _inputs(2, 5, 3, K, dtype, seed=K + 7 * unit, unit=unit)
    _check(k, beta, g)
    _check(k, beta, None)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("K", [96, 128])
def test_strided_views_are_read_in_place(dtype, K):
    k, beta, g = _inputs(2, 4, 3, K, dtype, seed=3 * K, unit=False, strided=True)
    _check(k, beta, g)


@needs_interpreter
def test_mixed_input_dtypes_and_an_eigenvalue_near_zero():
    k, beta, g = _inputs(1, 3, 2, 96, torch.bfloat16, seed=11)
    norm2 = k.double().square().sum(-1)
    beta64 = torch.where(norm2 > 0, 1 / norm2.clamp(min=1e-30), 1.0)  # 1 - b |k|^2 = 0 up to float64 rounding
    eig_p, eig_a = token_eigenvalues(k, beta64, g.float())
    assert eig_a is not None
    lam, nonzero = eig_p.real[..., 0], norm2[:, :, 0] > 0  # [B,T,H]
    assert bool((lam[nonzero].abs() < 1e-15).all()) and bool((lam[~nonzero] == 1).all())
    _check(k, beta.float(), g.double())
    _check(k, beta64, g.float())


@needs_interpreter
def test_empty_batch():
    eig_p, eig_a = token_eigenvalues(torch.zeros(0, 3, 1, 2, 8), torch.zeros(0, 3, 1, 2), torch.zeros(0, 3, 2))
    assert eig_p.shape == (0, 3, 2, 1) and eig_a is not None and eig_a.shape == (0, 3, 2, 1)


@pytest.mark.parametrize("k_shape, beta_shape, g_shape, name", [
    ((2, 3, 2, 4, 8), (2, 3, 2, 4), None, "k must be"),  # n_h = 2
    ((2, 3, 4, 8), (2, 3, 1, 4), None, "k must be"),
    ((2, 3, 1, 4, 8), (2, 3, 4), None, "beta must be"),
    ((2, 3, 1, 4, 8), (2, 3, 1, 4), (2, 3, 4, 8), "g must be"),
])
def test_bad_shapes_are_one_line_value_errors(k_shape, beta_shape, g_shape, name):
    g = None if g_shape is None else torch.zeros(g_shape)
    with pytest.raises(ValueError, match=name) as err:
        token_eigenvalues(torch.zeros(k_shape), torch.zeros(beta_shape), g)
    assert "\n" not in str(err.value)


def test_integer_inputs_are_refused():
    with pytest.raises(ValueError, match="beta must be bf16"):
        token_eigenvalues(torch.zeros(1, 2, 1, 3, 8), torch.zeros(1, 2, 1, 3, dtype=torch.int32))


def _dataset(B: int, T: int, H: int, K: int) -> xr.Dataset:
    """What the spectra plan reads of a store: sizes and names (capture hands it the tensors)."""
    return xr.Dataset({
        "k": (("seq", "layer", "pos", "step", "head", "dk"), np.zeros((B, 1, T, 1, H, K), np.float16)),
        "beta": (("seq", "layer", "pos", "step", "head"), np.zeros((B, 1, T, 1, H), np.float16)),
        "g": (("seq", "layer", "pos", "head"), np.zeros((B, 1, T, H), np.float16)),
    })


def test_cpu_tensors_keep_the_torch_path(monkeypatch):
    """Only CUDA capture tensors take the fused kernel: on the CPU the plan's fn never calls it."""
    import deltalab.kernels.spectra.triton_token as fused
    from deltalab.probes import spectra

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernel ran for CPU tensors")

    monkeypatch.setattr(fused, "token_eigenvalues", refuse)
    k, beta, g = _inputs(2, 8, 3, 16, torch.bfloat16, seed=5)
    out = spectra.plan(_dataset(2, 8, 3, 16), window=2, device="cpu").fn({"k": k, "beta": beta, "g": g})
    assert out["eig_P"].dtype == torch.complex64 and out["eig_A"].dtype == torch.complex128
    _check_one_rounding(out["eig_P"], _reference(k, beta, None))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matches_float64_reduction(dtype):
    for K, strided in ((128, False), (128, True), (40, True), (96, False)):
        k, beta, g = _inputs(3, 64, 8, K, dtype, seed=K + strided, unit=K != 40, strided=strided, device="cuda")
        _check(k, beta, g)
        _check(k, beta, None)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_plan_fused_path_matches_the_torch_path(gated):
    """The spectra plan's fn on CUDA capture tensors (fused eig_P / eig_A) against the torch path it replaced:
    linalg.token_spectra's eig_P (the same float64 value, rounded once: equal up to summation order) and eig_A =
    eig_P * exp(g) (rounded twice there); window outputs untouched."""
    from deltalab.probes import linalg, spectra

    B, T, H, K = 2, 48, 4, 128
    k, beta, g = _inputs(B, T, H, K, torch.bfloat16, seed=17, device="cuda")
    ds = _dataset(B, T, H, K)
    if not gated:
        ds = ds.drop_vars("g")
    inputs = {"k": k, "beta": beta, **({"g": g} if gated else {})}
    out = spectra.plan(ds, window=4, device="cuda").fn(inputs)
    old_p = linalg.token_spectra(k, beta, device="cuda")
    assert out["eig_P"].dtype == old_p.dtype and out["eig_P"].shape == old_p.shape and out["eig_P"].is_cuda
    assert (out["eig_P"] - old_p).abs().max() <= 2 * HALF_ULP * old_p.abs().max()
    assert torch.equal(out["window_eig_P"], linalg.token_spectra(k, beta, window=4, stride=4, device="cuda"))
    if gated:
        old_a = old_p.to(torch.complex128) * g.double().exp()[..., None]
        assert out["eig_A"].shape == old_a.shape and out["eig_A"].is_cuda
        err = (out["eig_A"].to(torch.complex128) - old_a).abs() / old_a.abs().clamp(min=1)
        assert err.max() <= 4 * HALF_ULP
        _check_one_rounding(out["eig_A"], _reference(k, beta, g))
    else:
        assert "eig_A" not in out
