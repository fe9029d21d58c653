"""State ranks over time (kernels.ranks.chunk) against a float64 replay with an SVD at every step."""

from __future__ import annotations

import os

import pytest
import torch

from deltalab.kernels.delta_rule.chunk import chunk_delta_product
from deltalab.kernels.delta_rule.naive import l2_normalize, naive_delta_product
from deltalab.kernels.ranks.chunk import (
    RankMetrics,
    metrics_from_singular_values,
    singular_values,
    state_metrics,
    state_rank_metrics,
    state_ranks,
)
from deltalab.kernels.ranks.naive import naive_state_ranks
from deltalab.kernels.testing import delta_inputs, rel_err

TOL = 1e-3  # the target: relative error against a float64 SVD


def random_inputs(B=2, T=150, n_h=2, H=2, K=16, V=12, gated=False, device="cpu"):
    """float32 inputs (global generator) with fla's L2 norm on the keys, exact reflections (beta = 2) at the first
    5 tokens, log decays in (-0.2, 0] when gated."""
    q, k, v, beta, g, _ = delta_inputs(B, T, H, H, K, V, n_h, gated, dtype=torch.float32, decay=0.2,
                                       initial_state=False, device=device)
    beta[:, :5] = 2.0
    return q, l2_normalize(k), v, beta, g


def max_rel_error(ours: RankMetrics, ref: RankMetrics) -> dict[str, float]:
    """Each metric's largest pointwise relative error."""
    return {f: rel_err(getattr(ours, f), getattr(ref, f), norm="pointwise", floor=1e-12) for f in RankMetrics._fields}


@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("gated", [False, True])
def test_matches_float64_svd_replay(n_h, gated):
    """Float32 chunk-boundary states (as the kernels return them) + chunked replay vs float64 per-step SVD."""
    q, k, v, beta, g = random_inputs(n_h=n_h, gated=gated)
    _, _, bounds = chunk_delta_product(q, k, v, beta, g)
    ours = state_rank_metrics(k, v, beta, g, bounds, max_states=300)  # several chunk groups
    ref = naive_state_ranks(k, v, beta, g)
    assert ours.erank.shape == (2, 150, 2)
    errs = max_rel_error(ours, ref)
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("n_h", [2, 3])
def test_substeps_and_initial_state(n_h):
    q, k, v, beta, g = random_inputs(T=70, n_h=n_h, K=12, V=16, gated=True)
    h0 = torch.randn(2, 2, 12, 16, dtype=torch.float64)
    _, _, bounds = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double(), initial_state=h0)
    ours = state_rank_metrics(k, v, beta, g, bounds, substeps=True)
    ref = naive_state_ranks(k, v, beta, g, initial_state=h0, substeps=True)
    assert ours.erank.shape == (2, 70, n_h, 2) and ours.erank.dtype == torch.float64
    errs = max_rel_error(ours, ref)
    assert max(errs.values()) < 1e-8, errs
    # The last sub-step of each token is the token's state.
    per_token = state_rank_metrics(k, v, beta, g, bounds)
    assert torch.allclose(per_token.erank, ours.erank[:, :, -1])
    # Without boundary states they are computed here from the initial state.
    rebuilt = state_rank_metrics(k.double(), v.double(), beta.double(), g.double(), None, initial_state=h0)
    assert max(max_rel_error(rebuilt, per_token).values()) < 1e-8


def test_large_head_dims_rank_deficient_states():
    """dk = dv = 64 and T < dk / n_h: the states are rank-deficient, the hard case for Gram eigenvalues."""
    q, k, v, beta, g = random_inputs(B=1, T=20, n_h=2, H=2, K=64, V=64)
    _, _, bounds = chunk_delta_product(q, k, v, beta, g)
    ours = state_rank_metrics(k, v, beta, g, bounds)
    ref = naive_state_ranks(k, v, beta, g)
    assert (ref.erank <= 2 * torch.arange(1, 21)[None, :, None]).all()  # rank <= n_h t
    errs = max_rel_error(ours, ref)
    assert max(errs.values()) < TOL, errs


def test_known_values():
    eye = torch.eye(8, dtype=torch.float64)
    rank1 = torch.outer(torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64))
    states = torch.stack([3 * eye, rank1, torch.zeros(8, 8, dtype=torch.float64)])
    m = state_metrics(states)
    assert torch.allclose(m.erank, torch.tensor([8.0, 1.0, 0.0], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(m.stable_rank, torch.tensor([8.0, 1.0, 0.0], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(m.rank_utilisation, torch.tensor([1.0, 1 / 8, 0.0], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(m.spectral[0], torch.tensor(3.0, dtype=torch.float64))
    assert torch.allclose(m.nuclear[0], torch.tensor(24.0, dtype=torch.float64))
    assert torch.allclose(m.frobenius[1], rank1.norm())
    # Two equal singular values and one half as large: p = (2/5, 2/5, 1/5).
    s = torch.tensor([[2.0, 2.0, 1.0]], dtype=torch.float64)
    p = s / 5
    assert torch.allclose(metrics_from_singular_values(s).erank, (-(p * p.log()).sum()).exp())


def test_singular_value_methods_agree():
    h = torch.randn(6, 20, 12)
    ref = torch.linalg.svdvals(h.double())
    for method in ("gram64", "svd", "svd64"):
        s = singular_values(h, method).double().sort(-1, descending=True).values
        assert torch.allclose(s, ref, rtol=1e-5, atol=1e-5), method


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", [(16, 12), (40, 24)])
def test_triton_svdvals_interpreted(shape):
    """Full rank, rank 2 and zero; 40 x 24 pads to 64 and runs the trailing-half phase (64 -> 32; the 128 -> 64 -> 32
    phases are the same helpers, and the interpreter's paired reductions take minutes at 128)."""
    from deltalab.kernels.linalg.triton_svd import svdvals

    h = torch.randn(3, *shape)
    h[1] = torch.randn(shape[0], 2) @ torch.randn(2, shape[1])  # rank 2
    h[2] = 0
    ref = torch.linalg.svdvals(h.double()).flip(-1)
    s = svdvals(h)
    assert s.shape == (3, min(shape))
    assert ((s.double() - ref).abs().amax(-1) <= 1e-6 * ref.amax(-1).clamp(min=1)).all()
    if max(shape) <= 16:  # the metrics through the default kernel (the interpreter is slow at larger tiles)
        m, r = state_metrics(h[:2], method="triton"), state_metrics(h[:2].double(), method="svd64")
        assert max(max_rel_error(m, r).values()) < TOL


def test_dict_helper_and_attributes():
    q, k, v, beta, g = random_inputs(T=40, n_h=1)
    _, _, bounds = chunk_delta_product(q, k, v, beta, g)
    out = state_ranks(k, v, beta, g, bounds)
    assert set(out) == set(RankMetrics._fields)
    assert out["erank"].shape == (2, 40, 2) and out.erank is out["erank"]
    assert not hasattr(out, "missing")


def test_bad_inputs_raise_value_error():
    q, k, v, beta, g = random_inputs(T=130)
    _, _, bounds = chunk_delta_product(q, k, v, beta, g)
    with pytest.raises(ValueError, match="chunk"):
        state_rank_metrics(k, v, beta, g, bounds[:, :2])
    with pytest.raises(ValueError, match="boundary_states"):
        state_rank_metrics(k, v, beta, g, bounds[..., :3])
    with pytest.raises(ValueError, match="method"):
        state_rank_metrics(k, v, beta, g, bounds, method="magic")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["auto", "gram64", "triton"])
def test_gpu_realistic_shapes(method):
    """dk = dv = 128, n_h = 3, gated, two chunks and a half, against the float64 replay on the GPU."""
    q, k, v, beta, g = random_inputs(B=1, T=160, n_h=3, H=4, K=128, V=128, gated=True, device="cuda")
    _, _, bounds = chunk_delta_product(q, k, v, beta, g)
    ours = state_rank_metrics(k, v, beta, g, bounds, method=method)
    ref = naive_state_ranks(k, v, beta, g)
    errs = max_rel_error(ours, ref)
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("every", [1, 4, 5, 64, 100, 128])
def test_every_ranks_only_every_nth_token_and_equals_the_full_run_there(every):
    """`every=N` (capture-time reductions): the state after tokens N-1, 2N-1, ... exactly as without it, NaN
    elsewhere; chunk groups smaller than a sequence (max_states) and T not a multiple of the chunk size."""
    torch.manual_seed(every)
    B, T, n_h, H, K, V = 2, 150, 2, 3, 8, 8
    k = torch.nn.functional.normalize(torch.randn(B, T, n_h, H, K, dtype=torch.float64), dim=-1)
    v, beta = torch.randn(B, T, n_h, H, V, dtype=torch.float64), 2 * torch.rand(B, T, n_h, H, dtype=torch.float64)
    g = -0.1 * torch.rand(B, T, H, dtype=torch.float64)
    full = state_rank_metrics(k, v, beta, g, None)
    part = state_rank_metrics(k, v, beta, g, None, every=every, max_states=300)
    keep = (torch.arange(T) + 1) % every == 0
    for name in ("erank", "stable_rank", "frobenius"):
        a, b = getattr(part, name), getattr(full, name)
        assert torch.isnan(a[:, ~keep]).all()
        torch.testing.assert_close(a[:, keep], b[:, keep], rtol=1e-10, atol=1e-12)


def test_auto_method_avoids_the_triton_kernel_for_large_or_unequal_real_head_dims():
    """OLMo-Hybrid's 96 x 192 states would be padded to 256 x 256 by the Triton kernel (about 3 ms a matrix on an
    Hopper): auto takes the float64 Gram of the 96 side there, and the Triton kernel only up to 128 a side."""
    from deltalab.kernels.ranks.chunk import resolve_method

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_method("auto", cuda, (128, 128)) == "triton"
    assert resolve_method("auto", cuda, (96, 192)) == "gram64" and resolve_method("auto", cuda, (256, 512)) == "gram64"
    assert resolve_method("auto", cpu, (64, 64)) == "gram64" and resolve_method("svd", cuda, (96, 192)) == "svd"


def test_non_finite_states_are_one_line_naming_the_inputs():
    """LAPACK's eigensolver fails on NaN with an error code; ranks say what holds the NaN instead."""
    from deltalab.kernels.ranks.chunk import singular_values

    h = torch.randn(3, 8, 6, dtype=torch.float64)
    h[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^ranks: a state holds NaN or inf .*check the model's activations"):
        singular_values(h, method="gram64")
    assert torch.isfinite(singular_values(h[[0, 2]], method="gram64")).all()
