"""The chunked DPLR (generalised delta rule) form against the float64 token-loop reference on fresh random
inputs: packed batches with lengths off the chunk grid, a sequence shorter than a chunk, initial states, decays
of e^-20 per token, float32, gradients, and the dispatcher. Measured max relative error: ~7e-15 in float64,
~5e-6 in float32 (T = 200, K = 16) when the decays were differences of running totals (tighter bounds at strong
decays: tests/kernels/test_dplr_chunk_precision.py)."""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.delta_rule.naive import boundary_offsets
from deltalab.kernels.dplr.chunk import chunk_dplr
from deltalab.kernels.dplr.dispatch import dplr_forward
from deltalab.kernels.dplr.naive import naive_dplr
from tests.kernels.test_dplr_naive import rwkv7_inputs


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp(min=1e-300)).item()


@pytest.mark.parametrize("decay,init,T", [(True, True, 150), (False, True, 130), (True, False, 64), (True, True, 40)])
def test_chunk_matches_reference_float64(decay, init, T):
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, T, 2, 16, 8, seed=T + 10 * decay, decay=decay, init=init)
    ref = naive_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    out = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    for got, want in zip(out, ref):
        assert got.shape == want.shape and got.dtype == torch.float64
        assert rel_err(got, want) < 1e-10


def test_packed_sequences_off_the_chunk_grid_with_strong_decays():
    """Lengths 70, 5 (shorter than a chunk), 0 and 129; log decays down to -20 per token, some exactly -20."""
    cu = torch.tensor([0, 70, 75, 75, 204])
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 204, 2, 8, 8, seed=21, log_w_min=-20.0)
    g[:, ::7, :, ::3] = -20.0
    s0 = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    ref = naive_dplr(q, k, v, a, b, g, scale=0.5, initial_state=s0, cu_seqlens=cu)
    out = chunk_dplr(q, k, v, a, b, g, scale=0.5, initial_state=s0, cu_seqlens=cu)
    assert out[2].shape[1] == boundary_offsets(cu)[-1]
    for got, want in zip(out, ref):
        assert rel_err(got, want) < 1e-10
    f32 = chunk_dplr(*(x.float() for x in (q, k, v, a, b, g)), scale=0.5, initial_state=s0.float(), cu_seqlens=cu)
    for got, want in zip(f32, ref):
        assert rel_err(got, want) < 3e-5


def test_chunk_float32_error_bound():
    """float32 inputs: ~1e-5 relative error against float64 (measured ~5e-6)."""
    q, k, v, a, b, g, s0 = rwkv7_inputs(1, 200, 2, 32, 16, seed=5, init=True, log_w_min=-20.0)
    ref = naive_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    out = chunk_dplr(*(x.float() for x in (q, k, v, a, b, g)), scale=1.0, initial_state=s0.float())
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    for got, want in zip(out, ref):
        assert rel_err(got, want) < 3e-5


def test_generic_dplr_not_only_rwkv7():
    """Arbitrary small a, b (not -kappa, kappa * a_rwkv): the chunked form is the general DPLR recurrence."""
    gen = torch.Generator().manual_seed(8)
    q, k, a, b = (torch.randn(1, 100, 2, 8, generator=gen, dtype=torch.float64) * 0.3 for _ in range(4))
    v = torch.randn(1, 100, 2, 4, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, 100, 2, 8, generator=gen, dtype=torch.float64)
    ref = naive_dplr(q, k, v, a, b, g, scale=0.3)
    out = chunk_dplr(q, k, v, a, b, g, scale=0.3)
    for got, want in zip(out, ref):
        assert rel_err(got, want) < 1e-10


def test_chunk_size_and_group_budget_do_not_change_results():
    q, k, v, a, b, g, s0 = rwkv7_inputs(1, 100, 1, 8, 8, seed=9, init=True)
    x = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    y = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0, chunk_size=16)
    z = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0, budget=1)  # one chunk per group
    w = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0, chunk_size=20)  # no 16-token sub-blocks
    assert rel_err(w[0], x[0]) < 1e-12 and rel_err(w[1], x[1]) < 1e-12 and w[2].shape[1] == 6
    assert rel_err(y[0], x[0]) < 1e-12 and rel_err(y[1], x[1]) < 1e-12
    assert torch.allclose(y[2][:, [0, 4, -1]], x[2], rtol=1e-12, atol=1e-12)  # 16-token boundaries 0, 4: tokens 0, 64
    for p, r in zip(z, x):
        assert rel_err(p, r) < 1e-13


def test_gradients_match_the_reference():
    """Autograd through the chunked form equals autograd through the token loop (float64)."""
    inputs = rwkv7_inputs(1, 80, 2, 8, 4, seed=11, init=True, log_w_min=-3.0)
    leaves_c = [x.clone().requires_grad_() for x in inputs]
    leaves_n = [x.clone().requires_grad_() for x in inputs]
    w = torch.randn(1, 80, 2, 4, dtype=torch.float64)
    wf = torch.randn(1, 2, 8, 4, dtype=torch.float64)

    def loss(out):
        return (out[0] * w).sum() + (out[1] * wf).sum()

    loss(chunk_dplr(*leaves_c[:6], scale=1.0, initial_state=leaves_c[6])).backward()
    loss(naive_dplr(*leaves_n[:6], scale=1.0, initial_state=leaves_n[6])).backward()
    for name, c, n in zip("q k v a b g s0".split(), leaves_c, leaves_n):
        assert rel_err(c.grad, n.grad) < 1e-10, name


def test_bfloat16_inputs_return_bfloat16_outputs():
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 70, 1, 8, 8, seed=12)
    bf = [x.bfloat16() for x in (q, k, v, a, b, g)]
    ref = naive_dplr(*(x.double() for x in bf), scale=1.0)
    out = chunk_dplr(*bf, scale=1.0)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
    assert rel_err(out[0], ref[0]) < 3e-2 and rel_err(out[1], ref[1]) < 1e-4


def test_dispatcher_runs_the_chunked_form_with_gradients():
    q, k, v, a, b, g, s0 = rwkv7_inputs(1, 70, 2, 8, 8, seed=13, init=True)
    qg = q.clone().requires_grad_()
    out = dplr_forward(qg, k, v, a, b, g, scale=1.0, initial_state=s0)
    ref = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    for got, want in zip(out, ref):
        assert torch.equal(got.detach(), want)
    out[0].sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    with pytest.raises(ValueError, match="^b must be"):
        dplr_forward(q, k, v, a, b[..., :4], g, scale=1.0)


@pytest.mark.gpu
def test_dispatcher_on_cuda_matches_float64_reference():
    """RWKV-7-sized heads on the GPU (float32 and gradients: the chunked form, not fla)."""
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, 600, 4, 64, 64, seed=14, init=True, log_w_min=-1.0)
    cu = torch.tensor([0, 300, 337, 1200])  # three packed sequences covering all 1200 tokens
    packed = [x.reshape(1, 1200, *x.shape[2:]) for x in (q, k, v, a, b, g)]
    s0 = torch.cat([s0, s0[:1]])
    ref = naive_dplr(*(x.cuda() for x in packed), scale=1.0, initial_state=s0.cuda(), cu_seqlens=cu)
    f32 = [x.cuda().float().requires_grad_() for x in packed]
    out = dplr_forward(*f32, scale=1.0, initial_state=s0.cuda().float(), cu_seqlens=cu)
    for got, want in zip(out, ref):
        assert got.is_cuda and rel_err(got, want) < 3e-5
    out[0].sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in f32)
