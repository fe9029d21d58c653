"""The reference recurrence with a per-channel (Kimi Delta Attention) gate, against transitions multiplied out."""

from __future__ import annotations

import functools

import pytest
import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.testing import delta_inputs

channel_inputs = functools.partial(delta_inputs, gate="channel", unit_keys=True, initial_state=False)
"""Unit keys, beta in [0, 2), per-channel log decays in (-decay, 0], no initial state."""


def _dense_oracle(q, k, v, beta, g, scale):
    """H_t = (I - b k k^T) diag(exp g_t) H_{t-1} + b k v^T written with explicit K x K matrices (float64)."""
    B, T, n_h, H, V = v.shape
    K = q.shape[-1]
    eye = torch.eye(K, dtype=torch.float64)
    state = torch.zeros(B, H, K, V, dtype=torch.float64)
    out = []
    for t in range(T):
        state = torch.diag_embed(g[:, t].exp()) @ state
        for j in range(n_h):
            kk, b = k[:, t, j], beta[:, t, j]
            householder = eye - b[..., None, None] * kk[..., :, None] * kk[..., None, :]
            state = householder @ state + b[..., None, None] * kk[..., :, None] * v[:, t, j][..., None, :]
        out.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1), state


@pytest.mark.parametrize("n_h", [1, 2])
def test_per_channel_gate_decays_key_rows_before_the_householder_step(n_h):
    torch.manual_seed(n_h)
    B, T, H, K, V = 2, 11, 3, 5, 4
    q = torch.randn(B, T, H, K, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, n_h, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, n_h, H, V, dtype=torch.float64)
    beta = torch.rand(B, T, n_h, H, dtype=torch.float64) * 2
    g = -torch.rand(B, T, H, K, dtype=torch.float64) * 2
    o, final, bounds = naive_delta_product(q, k, v, beta, g, scale=0.5, chunk_size=4)
    o_ref, final_ref = _dense_oracle(q, k, v, beta, g, 0.5)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    assert bounds.shape == (B, 4, H, K, V)


def test_per_channel_gate_equal_across_channels_is_the_scalar_gate():
    torch.manual_seed(0)
    B, T, H, K, V = 1, 9, 2, 4, 3
    q, k = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, 1, H, K, dtype=torch.float64)
    v, beta = torch.randn(B, T, 1, H, V, dtype=torch.float64), torch.rand(B, T, 1, H, dtype=torch.float64)
    g = -torch.rand(B, T, H, dtype=torch.float64)
    scalar = naive_delta_product(q, k, v, beta, g, normalize_qk=True)
    channel = naive_delta_product(q, k, v, beta, g[..., None].expand(B, T, H, K), normalize_qk=True)
    for a, b in zip(scalar, channel):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_gate_of_the_wrong_shape_names_the_tensor():
    q, k = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 1, 2, 4)
    v, beta = torch.randn(1, 3, 1, 2, 4), torch.rand(1, 3, 1, 2)
    with pytest.raises(ValueError, match=r"^g must be \[B,T,Hv\]"):
        naive_delta_product(q, k, v, beta, torch.randn(1, 3, 2, 5))


@pytest.mark.parametrize("n_h, Hk, Hv, T, strength", [
    (1, 2, 2, 150, 1.0),     # Kimi Delta Attention: three chunks, the last partial
    (1, 1, 3, 70, 20.0),     # grouped heads, strong decays (e^-20 per token): no overflow
    (2, 2, 4, 33, 0.05),     # n_h = 2 (the gate at each token's first sub-step), weak decays
    (1, 2, 2, 9, 0.5),       # shorter than one chunk
])
def test_chunked_per_channel_gate_matches_reference_float64(n_h, Hk, Hv, T, strength):
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product

    q, k, v, beta, g = channel_inputs(2, T, Hk, Hv, 8, 5, n_h, decay=strength, seed=T)[:5]
    h0 = torch.randn(2, Hv, 8, 5, dtype=torch.float64)
    ref = naive_delta_product(q, k, v, beta, g, initial_state=h0)
    got = chunk_delta_product(q, k, v, beta, g, initial_state=h0)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_chunked_per_channel_gate_packed_sequences_and_float32():
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product

    q, k, v, beta, g = channel_inputs(1, 140, 2, 4, 16, 8, 1, decay=1.0, seed=5)[:5]
    cu = torch.tensor([0, 20, 100, 140])
    ref = naive_delta_product(q, k, v, beta, g, cu_seqlens=cu)
    got = chunk_delta_product(q, k, v, beta, g, cu_seqlens=cu)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    got32 = chunk_delta_product(*(x.float() for x in (q, k, v, beta, g)), cu_seqlens=cu)
    for a, b in zip(got32, ref):  # float32: a few ulps of the O(1) outputs and states
        assert float((a.double() - b).abs().max()) < 5e-5


def test_chunked_per_channel_gate_equal_across_channels_is_the_scalar_path():
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product

    q, k, v, beta, g = channel_inputs(1, 100, 2, 2, 8, 4, 2, decay=1.0, seed=9)[:5]
    scalar = chunk_delta_product(q, k, v, beta, g[..., 0])
    channel = chunk_delta_product(q, k, v, beta, g[..., :1].expand_as(g).contiguous())
    for a, b in zip(scalar, channel):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_chunk_groups_do_not_change_the_result(monkeypatch):
    """The intra-chunk factors are built for groups of chunks within a memory budget: one chunk per group
    gives the same result as all at once."""
    from functools import partial

    from deltalab.kernels.delta_rule import chunk

    q, k, v, beta, g = channel_inputs(1, 200, 2, 2, 8, 4, 1, decay=1.0, seed=11)[:5]
    whole = chunk.chunk_delta_product(q, k, v, beta, g)
    monkeypatch.setattr(chunk, "_channel_gate_factors", partial(chunk._channel_gate_factors, budget=1))
    single = chunk.chunk_delta_product(q, k, v, beta, g)
    for a, b in zip(whole, single):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
