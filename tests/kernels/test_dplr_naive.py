"""The DPLR (generalised delta rule, RWKV-7) token-loop reference against independent formulations:
dense per-token transition matrices, fla's transposed S [V, K] convention, and the per-channel-gated delta
rule (Kimi Delta Attention) of `kernels.delta_rule.naive`, which is a DPLR recurrence with a = e^g k, b = -beta k."""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.delta_rule.naive import boundary_offsets, naive_delta_product, num_boundaries
from deltalab.kernels.dplr.naive import naive_dplr
from deltalab.kernels.testing import dplr_inputs as rwkv7_inputs


def dense_loop(q, k, v, a, b, g, scale, s0):
    """Build every token's K x K transition explicitly: H <- M H + k v^T, M = diag(e^g) + b a^T."""
    B, T, H, K = q.shape
    state = torch.zeros(B, H, K, v.shape[-1], dtype=q.dtype) if s0 is None else s0.clone()
    outs = []
    for t in range(T):
        M = b[:, t, :, :, None] * a[:, t, :, None, :]
        if g is not None:
            M = M + torch.diag_embed(g[:, t].exp())
        else:
            M = M + torch.eye(K, dtype=q.dtype)
        state = M @ state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(scale * (state.transpose(-1, -2) @ q[:, t, :, :, None])[..., 0])
    return torch.stack(outs, 1), state


def fla_layout_loop(q, k, v, a, b, g, scale):
    """fla's naive RWKV-7 convention, state S [V, K]: S <- S diag(w) + (S a) b^T + v k^T, o = S (scale q)."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, v.shape[-1], K, dtype=q.dtype)
    outs = []
    for t in range(T):
        sa = (S @ a[:, t, :, :, None])  # [B, H, V, 1]
        S = S * g[:, t, :, None, :].exp() + sa * b[:, t, :, None, :] + v[:, t, :, :, None] * k[:, t, :, None, :]
        outs.append((S @ (scale * q[:, t, :, :, None]))[..., 0])
    return torch.stack(outs, 1), S.transpose(-1, -2)


@pytest.mark.parametrize("decay,init", [(True, True), (False, True), (True, False)])
def test_reference_matches_dense_transitions(decay, init):
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, 70, 2, 8, 6, seed=1, decay=decay, init=init)
    o, fin, bnd = naive_dplr(q, k, v, a, b, g, scale=0.7, initial_state=s0)
    o_ref, fin_ref = dense_loop(q, k, v, a, b, g, 0.7, s0)
    assert (o - o_ref).abs().max() < 1e-12 and (fin - fin_ref).abs().max() < 1e-12
    assert bnd.shape == (2, num_boundaries(70), 2, 8, 6)
    assert torch.equal(bnd[:, -1], fin)


def test_reference_is_fla_convention_transposed():
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 40, 3, 8, 8, seed=2)
    o, fin, _ = naive_dplr(q, k, v, a, b, g, scale=1.0)
    o_fla, fin_fla = fla_layout_loop(q, k, v, a, b, g, 1.0)
    assert (o - o_fla).abs().max() < 1e-12 and (fin - fin_fla).abs().max() < 1e-12


def test_reference_reduces_to_per_channel_gated_delta_rule():
    """(I - beta k k^T) diag(e^g) H + beta k v^T is DPLR with a = e^g * k, b = -beta k and key beta k."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 50, 2, 8, 4
    q, k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), torch.randn(B, T, H, K, generator=gen,
                                                                                     dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 2
    g = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    ref = naive_delta_product(q, k[:, :, None], v[:, :, None], beta[:, :, None], g, scale=0.5)
    bk = beta[..., None] * k
    got = naive_dplr(q, bk, v, g.exp() * k, -bk, g, scale=0.5)
    for x, y in zip(got, ref):
        assert (x - y).abs().max() < 1e-12


def test_boundaries_restart_the_recurrence_and_packing_isolates_sequences():
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 150, 2, 4, 4, seed=4)
    s0 = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    cu = torch.tensor([0, 70, 75, 150])
    o, fin, bnd = naive_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0, cu_seqlens=cu)
    off = boundary_offsets(cu)
    assert bnd.shape[1] == off[-1]
    for n in range(3):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        o_n, fin_n, bnd_n = naive_dplr(q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl], g[:, sl], scale=1.0,
                                       initial_state=s0[n : n + 1])
        assert torch.equal(o[:, sl], o_n) and torch.equal(fin[n], fin_n[0])
        assert torch.equal(bnd[:, off[n] : off[n + 1]], bnd_n)
    # restarting sequence 0 from its second boundary (token 64) gives the same tail
    tail = naive_dplr(q[:, 64:70], k[:, 64:70], v[:, 64:70], a[:, 64:70], b[:, 64:70], g[:, 64:70], scale=1.0,
                      initial_state=bnd[:, 1])
    assert (tail[0] - o[:, 64:70]).abs().max() < 1e-12 and (tail[1][0] - fin[0]).abs().max() < 1e-12


def test_empty_packed_sequence_keeps_its_initial_state():
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 10, 1, 4, 4, seed=5)
    s0 = torch.randn(2, 1, 4, 4, dtype=torch.float64)
    o, fin, bnd = naive_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0, cu_seqlens=torch.tensor([0, 0, 10]))
    assert o.shape == (1, 10, 1, 4) and torch.equal(fin[0], s0[0]) and bnd.shape[1] == 1 + 2


@pytest.mark.parametrize("bad,match", [("k", "k must be"), ("v", "v must be"), ("a", "a must be"),
                                        ("b", "b must be"), ("g", "g must be"), ("s0", "initial_state must be"),
                                        ("cu", "cu_seqlens must rise")])
def test_bad_shapes_name_the_tensor(bad, match):
    q, k, v, a, b, g, s0 = rwkv7_inputs(1, 8, 2, 4, 4, seed=6, init=True)
    args = dict(q=q, k=k, v=v, a=a, b=b, g=g)
    kw: dict = dict(scale=1.0, initial_state=s0)
    if bad == "s0":
        kw["initial_state"] = s0[:, :1]
    elif bad == "cu":
        kw["cu_seqlens"] = torch.tensor([0, 5])
    else:
        args[bad] = args[bad][..., :3] if bad != "v" else args[bad][:, :4]
    with pytest.raises(ValueError, match=match) as info:
        naive_dplr(**args, **kw)
    assert "\n" not in str(info.value)
