"""Stretch analyses of the generalised delta rule: state ranks over time (chunked replay from boundary states vs
a float64 token loop with an SVD per step) and the float64 exact attention map (rebuilds the output; equals the
per-channel-gated delta rule's map in that special case; reduces to decay-only attention without removal)."""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.attention.dplr_naive import naive_dplr_attention
from deltalab.kernels.attention.naive import naive_attention
from deltalab.kernels.dplr.chunk import chunk_dplr
from deltalab.kernels.dplr.naive import naive_dplr
from deltalab.kernels.ranks.chunk import RankMetrics, metrics_from_singular_values
from deltalab.kernels.ranks.dplr import dplr_state_rank_metrics
from deltalab.kernels.testing import dplr_inputs as rwkv7_inputs
from deltalab.kernels.testing import rel_err


def svd_loop_ranks(k, v, a, b, g, s0) -> RankMetrics:
    """Float64 token loop with svdvals of every state."""
    B, T, H, K = k.shape
    state = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if s0 is None else s0.double().clone()
    rows = []
    for t in range(T):
        read = torch.einsum("bhkv,bhk->bhv", state, a[:, t])
        state = g[:, t].exp()[..., None] * state + b[:, t, ..., None] * read[:, :, None] + \
            k[:, t, ..., None] * v[:, t, :, None, :]
        rows.append(torch.stack(metrics_from_singular_values(torch.linalg.svdvals(state),
                                                             torch.linalg.matrix_norm(state))))
    return RankMetrics(*torch.stack(rows, 2).unbind(0))  # [B, T, H] each


def max_rel(ours: RankMetrics, ref: RankMetrics) -> float:
    """The largest pointwise relative error over the metrics."""
    return max(rel_err(x, y, norm="pointwise", floor=1e-12) for x, y in zip(ours, ref))


@pytest.mark.parametrize("dtype,method,tol", [(torch.float32, "auto", 1e-3), (torch.float64, "auto", 1e-6),
                                              (torch.float64, "svd64", 1e-10)])
def test_state_ranks_match_svd_per_step(dtype, method, tol):
    """float32 boundaries: 1e-3 (kernels.ranks.chunk's target); float64 with the Gram (~1e-8 sigma_max absolute) or
    with svdvals."""
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, 150, 2, 12, 16, seed=31, init=True)
    _, _, bounds = chunk_dplr(*(x.to(dtype) for x in (q, k, v, a, b, g)), scale=1.0, initial_state=s0.to(dtype))
    ours = dplr_state_rank_metrics(k, v, a, b, g, bounds, max_states=200, method=method)  # several groups of chunks
    assert ours.erank.shape == (2, 150, 2) and ours.erank.dtype == dtype
    assert max_rel(ours, svd_loop_ranks(k, v, a, b, g, s0)) < tol


def test_state_ranks_without_boundaries_and_strided():
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 130, 1, 8, 8, seed=32)
    full = dplr_state_rank_metrics(k, v, a, b, g, None, method="svd64")  # boundaries from chunk_dplr, float64
    ref = svd_loop_ranks(k, v, a, b, g, None)
    assert max_rel(full, ref) < 1e-10
    for every in (5, 64):
        part = dplr_state_rank_metrics(k, v, a, b, g, None, every=every, method="svd64")
        ranked = torch.arange(130)[(torch.arange(130) + 1) % every == 0]
        assert torch.isnan(part.erank).sum() == 130 - len(ranked)
        assert torch.allclose(part.erank[:, ranked], full.erank[:, ranked], rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="boundary_states has 1 chunk states"):
        dplr_state_rank_metrics(k, v, a, b, g, torch.zeros(1, 1, 1, 8, 8, dtype=torch.float64))


@pytest.mark.parametrize("init", [False, True])
def test_attention_map_rebuilds_the_output(init):
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, 20, 2, 6, 5, seed=33, init=init)
    alpha, init_term = naive_dplr_attention(q, k, v, a, b, g, scale=0.8, initial_state=s0)
    o = naive_dplr(q, k, v, a, b, g, scale=0.8, initial_state=s0)[0]
    rebuilt = torch.einsum("bths,bshv->bthv", alpha, v) + init_term
    assert (rebuilt - o).abs().max() < 1e-12
    assert bool((alpha.permute(0, 2, 1, 3).triu(1) == 0).all())  # causal: alpha_{t,s} = 0 for s > t


def test_attention_map_equals_the_gated_delta_rules_map():
    """Per-channel-gated delta rule = DPLR with a = e^g k, b = -beta k, key beta k: the maps agree."""
    gen = torch.Generator().manual_seed(34)
    B, T, H, K, V = 1, 16, 2, 6, 4
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 2
    g = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    ref, _ = naive_attention(q, k[:, :, None], v[:, :, None], beta[:, :, None], g, scale=0.5)
    bk = beta[..., None] * k
    got, _ = naive_dplr_attention(q, bk, v, g.exp() * k, -bk, g, scale=0.5)
    assert (got - ref[..., 0]).abs().max() < 1e-12


def test_attention_without_removal_is_decay_only():
    """a_rwkv = 0 (b = 0): alpha_{t,s} = scale q_t^T diag(e^{g_{s+1} + ... + g_t}) k_s."""
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 12, 1, 4, 3, seed=35)
    alpha, _ = naive_dplr_attention(q, k, v, a, torch.zeros_like(b), g, scale=1.0)
    cum = torch.cat([torch.zeros_like(g[:, :1]), g.cumsum(1)], 1)  # cum[t + 1] = g_0 + ... + g_t
    for t in range(12):
        for s in range(t + 1):
            want = (q[:, t] * (cum[:, t + 1] - cum[:, s + 1]).exp() * k[:, s]).sum(-1)
            assert (alpha[:, t, :, s] - want).abs().max() < 1e-13
