"""The Triton secular-equation solver (`kernels.linalg.triton_secular`) against dense float64 eigvalsh and the torch
solver, on the CPU under TRITON_INTERPRET=1 (small shapes) and on the GPU (marked), including the torch solver's
hard cases: near-repeated and equal decays, zero key components, beta 0 / 1 / 2, decays near 0 and exactly 1.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from deltalab.kernels.linalg.triton_secular import secular_eigvals
from deltalab.kernels.spectra.dplr import ITERATIONS, dplr_eigvals, dplr_eigvals_general
from tests.kernels.test_spectra_dplr import hard_cases, random_inputs, symmetric_reference

CPU_OK = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(not CPU_OK, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
# the interpreter evaluates converged and deflated roots' lanes too (their results are masked out); numpy warns.
# dplr_eigvals re-solves matrices that miss their trace with the torch solver after a warning: here that warning
# is an error, so the kernel's own roots are what the tests check.
pytestmark = [pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
              pytest.mark.filterwarnings("error:dplr_eigvals. the Triton secular solver")]


@needs_interpreter
@pytest.mark.parametrize("n", [4, 16, 32])
def test_random_transitions_match_eigvalsh_and_torch(n):
    d, k, beta = random_inputs(48, n, seed=200 + n)
    got = dplr_eigvals(d, k, beta, method="triton")
    err = (got - symmetric_reference(d, k, beta)).abs().max()
    assert err < 1e-13, err
    assert (got - dplr_eigvals(d, k, beta, method="torch")).abs().max() < 1e-13


@needs_interpreter
def test_starts_and_mixed_precision_converge_before_the_cap():
    d, k, beta = random_inputs(16, 24, seed=9)
    w, rho = d.sqrt() * k, beta
    ref = symmetric_reference(d, k, beta)
    for guess, mixed in ((True, False), (False, False), (True, True)):
        steps: list[torch.Tensor] = []
        got = secular_eigvals(d, w, rho, guess=guess, mixed=mixed, steps=steps)
        assert (got - ref).abs().max() < 1e-13
        assert 0 < int(steps[0][0].max()) < ITERATIONS  # every root stopped on its own test, none at the cap
        assert (int(steps[0][1].max()) > 0) == mixed


@needs_interpreter
@pytest.mark.parametrize("block_r, mixed", [(16, False), (8, True)])
def test_one_sum_per_evaluation_gives_the_same_roots(block_r, mixed):
    """one_sum=True (pole chunks added into tiles, reduced once) changes only the order of the additions."""
    d, k, beta = random_inputs(12, 40, seed=23)  # 40 poles: two chunks of 32, the second partial
    hd, hk, hb = hard_cases(40)
    d, k, beta = torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb])
    w, rho = d.sqrt() * k, beta.clamp(min=0)
    ref = symmetric_reference(d, k, beta.clamp(min=0))
    for one_sum in (False, True):
        got = secular_eigvals(d, w, rho, block_r=block_r, mixed=mixed, one_sum=one_sum)
        assert (got - ref).abs().max() < 1e-13


@needs_interpreter
def test_counted_loop_takes_the_same_steps_as_the_while_loop():
    """for_loop=True (a GPU-miscompile check, kernels/NOTES.md) must change nothing: same roots, same step counts."""
    d, k, beta = random_inputs(24, 20, seed=17)
    hd, hk, hb = hard_cases(20)
    d, k, beta = torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb])
    w, rho = d.sqrt() * k, beta.clamp(min=0)
    for mixed in (False, True):
        s_while: list[torch.Tensor] = []
        s_for: list[torch.Tensor] = []
        a = secular_eigvals(d, w, rho, mixed=mixed, steps=s_while)
        b = secular_eigvals(d, w, rho, mixed=mixed, steps=s_for, for_loop=True)
        assert torch.equal(a, b) and torch.equal(s_while[0], s_for[0])
        assert (a - symmetric_reference(d, k, beta.clamp(min=0))).abs().max() < 1e-13


@needs_interpreter
@pytest.mark.parametrize("n", [4, 16, 32])
def test_hard_cases_match_eigvalsh(n):
    d, k, beta = hard_cases(n)
    got = dplr_eigvals(d, k, beta, method="triton")
    err = (got - symmetric_reference(d, k, beta)).abs().max()
    assert err < 1e-13, err
    assert torch.equal(got[10], torch.sort(d[10]).values)  # zero key: exactly the decays
    reflection = torch.cat([torch.tensor([-1.0], dtype=torch.float64), torch.ones(n - 1, dtype=torch.float64)])
    assert (got[9] - reflection).abs().max() < 1e-14
    mixed = secular_eigvals(d, d.sqrt() * k, beta.clamp(min=0), mixed=True)  # float32 steps seed float64 ones
    assert (mixed - symmetric_reference(d, k, beta)).abs().max() < 1e-13


@needs_interpreter
def test_many_small_matrices_interlace_and_match_torch():
    d, k, beta = random_inputs(120, 6, seed=11)
    d[::3, 1] = d[::3, 0]  # a repeated decay in every third matrix
    k[1::3, 2] = 0.0       # a zero key component in others
    beta[::7] = 0.0
    got = dplr_eigvals(d, k, beta, method="triton")
    assert (got - symmetric_reference(d, k, beta)).abs().max() < 1e-13
    assert (got - dplr_eigvals(d, k, beta, method="torch")).abs().max() < 1e-13
    lam, ds = got[beta <= 1], torch.sort(d[beta <= 1], dim=-1).values
    assert bool((lam[:, 1:] >= ds[:, :-1] - 1e-15).all() and (lam <= ds + 1e-15).all())


@needs_interpreter
def test_general_rwkv_sign_pattern_uses_triton():
    g = torch.Generator().manual_seed(5)
    d = torch.rand(20, 8, generator=g, dtype=torch.float64) + 0.01
    kappa = torch.randn(20, 8, generator=g, dtype=torch.float64)
    a_rwkv = torch.rand(20, 8, generator=g, dtype=torch.float64)
    a, b = -kappa, kappa * a_rwkv
    got = dplr_eigvals_general(d, a, b, method="triton")
    dense = torch.linalg.eigvals(torch.diag_embed(d) + b[..., :, None] * a[..., None, :])
    ref = torch.sort(dense.real, dim=-1).values
    assert (got - ref).abs().max() < 1e-12


def test_a_root_that_misses_the_trace_is_re_solved_after_a_warning(monkeypatch):
    """The trace check (kernels.spectra.dplr._trace_checked) catches a grossly wrong root, like the one a Hopper GPU
    returned once, and re-solves that matrix only; a correct matrix passes it untouched."""
    import deltalab.kernels.linalg.triton_secular as ts

    d, k, beta = random_inputs(6, 8, seed=3)
    ref = symmetric_reference(d, k, beta)
    exact = dplr_eigvals(d, k, beta, method="torch")

    def faulty(d_, w_, rho_, **kw):  # what the GPU did: one root left at its start
        lam = exact.clone()
        lam[4, 0] += 0.03
        return lam

    monkeypatch.setattr(ts, "secular_eigvals", faulty)
    with pytest.warns(UserWarning, match="1 of 6 matrices missed their trace"):
        got = dplr_eigvals(d, k, beta, method="triton")
    assert (got - ref).abs().max() < 1e-13
    assert torch.equal(got[:4], exact[:4]) and torch.equal(got[5], exact[5])


def test_bad_method_is_one_line():
    d, k, beta = random_inputs(2, 4, seed=0)
    with pytest.raises(ValueError, match="method 'cuda' must be"):
        dplr_eigvals(d, k, beta, method="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 128])
def test_gpu_matches_eigvalsh_and_torch(n):
    dev = torch.device("cuda")
    d, k, beta = random_inputs(2048, n, seed=300 + n)
    hd, hk, hb = hard_cases(n)
    d, k, beta = torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb])
    w = (d.sqrt() * k).to(dev)
    got = secular_eigvals(d.to(dev), w, beta.clamp(min=0).to(dev)).cpu()  # the kernel's roots, no trace check
    ref = symmetric_reference(d, k, beta)
    err = (got - ref).abs().max()
    assert err < 1e-13, err
    assert (got - dplr_eigvals(d, k, beta, method="torch")).abs().max() < 1e-13
    auto = dplr_eigvals(d.to(dev), k.to(dev), beta.to(dev)).cpu()  # "auto": Triton on CUDA, with the trace check
    assert (auto - ref).abs().max() < 1e-13
    mixed = secular_eigvals(d.to(dev), w, beta.clamp(min=0).to(dev), mixed=True).cpu()
    assert (mixed - ref).abs().max() < 1e-13
    counted = secular_eigvals(d.to(dev), w, beta.clamp(min=0).to(dev), for_loop=True).cpu()
    assert (counted - ref).abs().max() < 1e-13


EPS32 = float(torch.finfo(torch.float32).eps)
F32_BOUND = 16
"""float32 path: max |error| <= f32_bound(n) eps32 (max |d| + beta ||w||^2) per matrix against float64 references of
the float32-rounded inputs. The math allows a few eps32 of that scale: the inputs' float32 w = sqrt(d) k (an eps32
relative change of each term of rho w w^T), deflation's 8 eps32 scale tolerance, and a root found to f's rounding
level, a sum of n terms (so the bound grows with n: n / 4 from n = 64). Measured <= 3.6 on the interpreter's cases
(n <= 40) and 20.7 on a Hopper GPU over 262,144 matrices at n = 128 (rcp.approx); a root in a wrong bracket is off by
an eigenvalue gap, ~1e-2 here, 1e4 times the bound."""


def f32_bound(n: int) -> float:
    return max(F32_BOUND, n / 4)


def _rounded(d, k, beta):
    """The float32 inputs a bf16/fp16/fp32 model gives, back in float64 (the 'same matrices' of the references)."""
    return d.float().double(), k.float().double(), beta.float().double()


def _f32_error(got, d, k, beta):
    """Max over matrices of |got - eigvals(M)| / (eps32 scale), M = (I - beta k k^T) diag(d) formed in float64."""
    m = torch.diag_embed(d) - beta[:, None, None] * k[:, :, None] * (k * d)[:, None, :]
    ref = torch.sort(torch.linalg.eigvals(m).real, dim=-1).values
    scale = d.abs().amax(-1) + beta.clamp(min=0) * (d * k * k).sum(-1)
    return float(((got.double() - ref).abs().amax(-1) / (EPS32 * scale)).max())


@needs_interpreter
@pytest.mark.parametrize("n", [6, 24, 40])
def test_float32_path_matches_dense_eigvals(n):
    """precision="float32" on random (beta in (0, 2)) and hard cases, dk not a power of two."""
    d, k, beta = random_inputs(16, n, seed=500 + n)
    hd, hk, hb = hard_cases(n)  # near-repeated and equal decays, zero key components, beta 1 and near 2, ...
    d, k, beta = _rounded(torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb]))
    assert bool((beta > 1).any()) and bool(((beta > 0) & (beta < 1)).any())
    steps: list[torch.Tensor] = []
    got = secular_eigvals(d, d.sqrt() * k, beta.clamp(min=0), precision="float32", steps=steps)
    assert got.dtype == torch.float32
    err = _f32_error(got, d, k, beta)
    assert err < f32_bound(d.shape[-1]), err
    assert 0 < int(steps[0][0].max()) < ITERATIONS  # every root stopped on its own test
    via = dplr_eigvals(d, k, beta, method="triton", precision="float32")  # with the float32 trace check
    assert via.dtype == torch.float32 and _f32_error(via, d, k, beta) < f32_bound(d.shape[-1])


@needs_interpreter
def test_float32_launch_choices_agree():
    """More lanes or programs per matrix, and the stop test without f's rounding level, give the same roots up to
    float32 rounding; a wrong root would differ by an eigenvalue gap."""
    d, k, beta = _rounded(*random_inputs(8, 40, seed=41))
    d[0, 3] = d[0, 2]  # an exactly repeated decay: deflated
    k[1, ::3] = 0.0    # zero key components: deflated
    w, rho = d.sqrt() * k, beta
    for lanes, programs, err_stop in ((32, 1, True), (64, 1, True), (32, 2, False)):
        got = secular_eigvals(d, w, rho, precision="float32", lanes=lanes, programs=programs, err_stop=err_stop)
        assert _f32_error(got, d, k, beta) < f32_bound(d.shape[-1])


def test_float32_trace_check_re_solves_a_wrong_root(monkeypatch):
    """The trace check works at float32's tolerance: a root off by 1e-3 is caught and re-solved (float64, then
    rounded), and the correct matrices pass untouched."""
    import deltalab.kernels.linalg.triton_secular as ts

    d, k, beta = _rounded(*random_inputs(6, 32, seed=4))
    exact = dplr_eigvals(d, k, beta, method="torch").float()

    def faulty(d_, w_, rho_, **kw):
        assert kw.get("precision") == "float32" and d_.dtype == torch.float32
        lam = exact.clone()
        lam[2, 5] += 1e-3
        return lam

    monkeypatch.setattr(ts, "secular_eigvals", faulty)
    with pytest.warns(UserWarning, match="1 of 6 matrices missed their trace"):
        got = dplr_eigvals(d, k, beta, method="triton", precision="float32")
    assert got.dtype == torch.float32 and _f32_error(got, d, k, beta) < f32_bound(d.shape[-1])
    assert torch.equal(got[:2], exact[:2]) and torch.equal(got[3:], exact[3:])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 128])
def test_gpu_float32_path_matches_the_float64_solver(n):
    """262,144 float32-rounded matrices: the float32 path (compiled: rcp.approx, and with FMA contraction on too)
    against the float64 solver of the same inputs, and through dplr_eigvals' trace check (a miss is an error)."""
    dev = torch.device("cuda")
    d, k, beta = random_inputs(262144 - 12, n, seed=600 + n)
    hd, hk, hb = hard_cases(n)
    d, k, beta = (torch.cat(p).float().to(dev) for p in ((d, hd), (k, hk), (beta, hb)))
    w = d.sqrt() * k  # float32, as the float32 path forms it
    rho = beta.clamp(min=0)
    ref = secular_eigvals(d.double(), w.double(), rho.double())
    scale = d.abs().amax(-1).double() + rho.double() * (w.double() ** 2).sum(-1)
    for fusion in (False, True):
        got = secular_eigvals(d, w, rho, precision="float32", fp_fusion=fusion)
        err = float(((got.double() - ref).abs().amax(-1) / (EPS32 * scale)).max())
        assert err < f32_bound(n), (fusion, err)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a trace-check miss (a re-solved matrix) fails the test
        via = dplr_eigvals(d, k, beta, precision="float32")  # "auto": Triton on CUDA, float32 trace check
    assert float(((via.double() - ref).abs().amax(-1) / (EPS32 * scale)).max()) < f32_bound(n)
