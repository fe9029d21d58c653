"""The reference recurrence with a per-channel (Kimi Delta Attention) gate, against transitions multiplied out."""

from __future__ import annotations

import pytest
import torch

from kernels.naive import naive_delta_product


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
