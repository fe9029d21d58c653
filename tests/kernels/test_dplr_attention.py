"""The chunked exact attention map of DPLR transitions (kernels.attention.dplr_chunk) against the dense float64 oracle
(kernels.attention.dplr_naive) on fresh random RWKV-7-shaped inputs: full rows, windows, initial states, decays
down to e^-20 per token, chunk sizes that do and do not divide into sub-blocks; o rebuilt from the map; top-k;
the decay-only approximation against the oracle without the rank-one term."""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.attention.dplr_chunk import compare_dplr_attention, dplr_attention, dplr_gla_attention
from deltalab.kernels.attention.dplr_naive import naive_dplr_attention
from deltalab.kernels.dplr.chunk import chunk_dplr
from deltalab.kernels.dplr.naive import naive_dplr
from deltalab.kernels.testing import dplr_inputs as rwkv7_inputs


@pytest.mark.parametrize("chunk_size,log_w_min,init,window", [
    (16, -5.0, True, None), (64, -20.0, True, (13, 37)), (10, -20.0, False, (0, 23)), (32, -1.0, True, (40, 45)),
])
def test_map_equals_the_dense_oracle(chunk_size, log_w_min, init, window):
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, 45, 2, 8, 5, seed=41 + chunk_size, init=init, log_w_min=log_w_min)
    alpha, init_term = naive_dplr_attention(q, k, v, a, b, g, scale=0.7, initial_state=s0)
    o = naive_dplr(q, k, v, a, b, g, scale=0.7, initial_state=s0)[0]
    lo, hi = window or (0, 45)
    m = dplr_attention(q, k, v, a, b, g, scale=0.7, initial_state=s0, window=window, chunk_size=chunk_size)
    assert m.weights.shape == (2, hi - lo, 2, hi, 1) and m.weights.dtype == torch.float64
    assert (m.weights[..., 0] - alpha[:, lo:hi, :, :hi]).abs().max() < 1e-10
    assert (m.initial - init_term[:, lo:hi]).abs().max() < 1e-10
    assert (m.output - o[:, lo:hi]).abs().max() < 1e-10
    assert (m.row_norm - alpha[:, lo:hi].norm(dim=-1)).abs().max() < 1e-10
    if not init:
        assert bool((m.initial == 0).all())


def test_no_decay_and_the_decay_only_approximation():
    q, k, v, a, b, _, s0 = rwkv7_inputs(1, 40, 3, 6, 4, seed=47, init=True)
    g = rwkv7_inputs(1, 40, 3, 6, 4, seed=48, log_w_min=-20.0)[5]
    alpha = naive_dplr_attention(q, k, v, a, b, None, scale=1.0, initial_state=s0)[0]
    m = dplr_attention(q, k, v, a, b, None, scale=1.0, initial_state=s0, chunk_size=16)
    assert (m.weights[..., 0] - alpha).abs().max() < 1e-10
    # approximation: Phi = product of the diagonal decays = the oracle with the rank-one term b a^T removed
    zero = torch.zeros_like(a)
    ref, ref_init = naive_dplr_attention(q, k, v, zero, zero, g, scale=1.0, initial_state=s0)
    ap = dplr_gla_attention(q, k, v, a, b, g, scale=1.0, initial_state=s0, chunk_size=16, window=(5, 40))
    assert (ap.weights[..., 0] - ref[:, 5:, :, :40]).abs().max() < 1e-10
    assert (ap.initial - ref_init[:, 5:]).abs().max() < 1e-10
    # the comparison walks both at once; its errors are those of the two maps
    cmp = compare_dplr_attention(q, k, v, a, b, g, scale=1.0, initial_state=s0, chunk_size=16, window=(5, 40))
    ex = naive_dplr_attention(q, k, v, a, b, g, scale=1.0, initial_state=s0)[0][:, 5:]
    assert (cmp.exact.weights[..., 0] - ex).abs().max() < 1e-10
    assert (cmp.approx.weights[..., 0] - ref[:, 5:]).abs().max() < 1e-10
    werr = (ex - ref[:, 5:]).norm(dim=-1) / ex.norm(dim=-1)
    assert (cmp.weight_error - werr).abs().max() < 1e-10 and werr.min() > 1e-3  # the removal matters
    oerr = (cmp.approx.output - cmp.exact.output).norm(dim=-1) / cmp.exact.output.norm(dim=-1)
    assert torch.allclose(cmp.output_error, oerr)


@pytest.mark.parametrize("rank_by", ["weight", "contribution"])
def test_top_k_is_the_top_of_the_full_rows(rank_by):
    q, k, v, a, b, g, s0 = rwkv7_inputs(1, 50, 2, 8, 6, seed=49, init=True)
    full = dplr_attention(q, k, v, a, b, g, scale=1.0, initial_state=s0, window=(3, 50), chunk_size=16)
    top = dplr_attention(q, k, v, a, b, g, scale=1.0, initial_state=s0, window=(3, 50), chunk_size=16, top_k=5,
                         rank_by=rank_by)
    w = full.weights[..., 0]
    key = w.abs() * (v.norm(dim=-1).transpose(1, 2)[:, None] if rank_by == "contribution" else 1)
    pos = torch.arange(3, 50)[None, :, None, None]
    key = key.masked_fill(torch.arange(50) > pos, -torch.inf)
    best = key.topk(5, dim=-1)
    n_src = (pos + 1).expand_as(best.indices)
    ok = torch.arange(5) < n_src  # query 3 has only 4 sources
    assert bool((top.top_index[ok] == best.indices[ok]).all()) and bool((top.top_index[~ok] == -1).all())
    assert (top.top_weight - w.gather(-1, top.top_index.clamp(min=0)).masked_fill(~ok, 0)).abs().max() < 1e-12
    assert (top.output - full.output).abs().max() < 1e-12 and (top.row_norm - full.row_norm).abs().max() < 1e-12


def test_float32_rebuilds_the_output():
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, 70, 2, 16, 8, seed=50, init=True, log_w_min=-20.0)
    o = naive_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0)[0]
    f32 = [x.float() for x in (q, k, v, a, b, g)]
    m = dplr_attention(*f32, scale=1.0, initial_state=s0.float())
    assert m.weights.dtype == torch.float32
    err = ((m.output.double() - o).norm(dim=-1) / o.norm(dim=-1)).max()
    # float32 bound: that of the chunked forward kernel on the same inputs (about 2e-5 per token here)
    ref = chunk_dplr(*f32, scale=1.0, initial_state=s0.float())[0]
    ref_err = ((ref.double() - o).norm(dim=-1) / o.norm(dim=-1)).max()
    assert err < 1e-4 and err < 2 * ref_err + 1e-6, (err, ref_err)
    alpha = naive_dplr_attention(q, k, v, a, b, g, scale=1.0, initial_state=s0)[0]
    assert (m.weights[..., 0].double() - alpha).abs().max() < 1e-4 * alpha.abs().max()  # ~1e-5 measured


def test_bad_inputs_are_named():
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 8, 1, 4, 4, seed=51)
    with pytest.raises(ValueError, match="a must be"):
        dplr_attention(q, k, v, a[..., :3], b, g, scale=1.0)
    with pytest.raises(ValueError, match="window"):
        dplr_attention(q, k, v, a, b, g, scale=1.0, window=(4, 9))
    with pytest.raises(ValueError, match="top_k"):
        dplr_attention(q, k, v, a, b, g, scale=1.0, top_k=0)


@pytest.mark.gpu
def test_gpu_long_sequence_equals_the_cpu_float64_map():
    """On CUDA at T = 2048, dk = 64: float64 full rows equal the CPU's; float32 top-8 rebuilds the float64 output."""
    q, k, v, a, b, g, s0 = rwkv7_inputs(1, 2048, 2, 64, 64, seed=52, init=True, log_w_min=-20.0)
    window = (1900, 2048)
    cpu = dplr_attention(q, k, v, a, b, g, scale=1.0, initial_state=s0, window=window)
    cuda = [x.cuda() for x in (q, k, v, a, b, g, s0)]
    gpu = dplr_attention(*cuda[:6], scale=1.0, initial_state=cuda[6], window=window)
    assert (gpu.weights.cpu() - cpu.weights).abs().max() < 1e-10 * cpu.weights.abs().max()
    top = dplr_attention(*(x.float() for x in cuda[:6]), scale=1.0, initial_state=cuda[6].float(), window=window,
                         top_k=8)
    err = ((top.output.cpu().double() - cpu.output).norm(dim=-1) / cpu.output.norm(dim=-1)).max()
    ref = chunk_dplr(*(x.float() for x in cuda[:6]), scale=1.0, initial_state=cuda[6].float())[0][:, window[0]:]
    ref_err = ((ref.cpu().double() - cpu.output).norm(dim=-1) / cpu.output.norm(dim=-1)).max()
    assert err < 2 * ref_err + 1e-5, (err, ref_err)  # the chunked forward's own float32 error (8e-5 on the CPU)
