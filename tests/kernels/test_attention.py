"""Exact attention maps of delta-rule layers: the float64 oracle, the chunked form, top-k, the GLA approximation."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from deltalab.kernels.attention.chunk import chunk_recurrence, compare_attention, delta_attention, gla_attention
from deltalab.kernels.attention.naive import naive_attention, naive_gla_attention, naive_recurrence
from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.testing import delta_inputs, rel_err

GATES = [None, "scalar", "channel"]
SMALL = dict(B=2, T=11, Hk=2, Hv=4, K=8, V=5, n_h=2, gate="scalar")
"""The default case: grouped heads (2 key heads, 4 value heads), two sub-steps."""

rel = functools.partial(rel_err, norm="fro")


def make_inputs(init: bool = True, **case):
    """Fresh random inputs of SMALL changed by `case`: unit keys, beta in [0, 2), log-gates in (-1, 0]."""
    return delta_inputs(**{**SMALL, **case}, unit_keys=True, initial_state=init)


def rebuild(weights: torch.Tensor, initial: torch.Tensor, v: torch.Tensor, start: int = 0) -> torch.Tensor:
    """sum_u alpha_{t,u} v_u + initial-state term, from full rows [B, Tw, Hv, S, n_h]."""
    S = weights.shape[3]
    return torch.einsum("bthsj,bsjhv->bthv", weights, v[:, :S].to(weights.dtype)) + initial


# ---------------------------------------------------------------- the oracle itself


@pytest.mark.parametrize("n_h,gate", [(1, None), (3, "scalar")])
def test_recurrence_oracle_matches_naive_delta_product(n_h, gate):
    q, k, v, beta, g, s0 = make_inputs(Hk=3, Hv=3, n_h=n_h, gate=gate)
    want, state, _ = naive_delta_product(q, k, v, beta, g, initial_state=s0)
    got, final = naive_recurrence(q, k, v, beta, g, initial_state=s0)
    assert rel(got, want) < 1e-13 and rel(final, state) < 1e-13


def test_per_channel_gate_equal_over_channels_is_the_scalar_gate():
    q, k, v, beta, g, s0 = make_inputs(gate="scalar")
    gc = g[..., None].expand(*g.shape, q.shape[-1])
    for f in (naive_attention, naive_gla_attention):
        a, i = f(q, k, v, beta, g, initial_state=s0)
        ac, ic = f(q, k, v, beta, gc, initial_state=s0)
        assert rel(ac, a) < 1e-13 and rel(ic, i) < 1e-13
    assert (
        rel(
            naive_recurrence(q, k, v, beta, gc, initial_state=s0)[0],
            naive_recurrence(q, k, v, beta, g, initial_state=s0)[0],
        )
        < 1e-13
    )


# ---------------------------------------------------------------- the reconstruction identity


@pytest.mark.parametrize("n_h,gate", list(itertools.product([1, 2, 3], GATES)))
def test_outputs_rebuilt_from_the_map_float64(n_h, gate):
    """sum_u alpha_{t,u} v_u + initial term == o_t to 1e-10 relative, grouped heads (Hv = 2 Hk), with a state."""
    q, k, v, beta, g, s0 = make_inputs(n_h=n_h, gate=gate)
    o, _ = naive_recurrence(q, k, v, beta, g, initial_state=s0)
    a, init = naive_attention(q, k, v, beta, g, initial_state=s0)
    assert init.abs().max() > 1e-3  # the initial state does contribute
    assert rel(rebuild(a, init, v), o) < 1e-10
    m = delta_attention(q, k, v, beta, g, initial_state=s0, chunk_size=4)  # 11 tokens: 3 chunks, the last partial
    assert rel(rebuild(m.weights, m.initial, v), o) < 1e-10
    assert rel(m.output, o) < 1e-10
    assert rel(m.weights, a) < 1e-10 and rel(m.initial, init) < 1e-10


@pytest.mark.parametrize("gate", GATES)
def test_map_is_causal_and_independent_of_values(gate):
    q, k, v, beta, g, s0 = make_inputs(n_h=2, gate=gate)
    m = delta_attention(q, k, v, beta, g, initial_state=s0, chunk_size=4)
    T = q.shape[1]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # [t, s] with s > t
    assert m.weights.permute(0, 2, 4, 1, 3)[..., future].abs().max() == 0
    m2 = delta_attention(q, k, torch.randn_like(v), beta, g, initial_state=s0, chunk_size=4)
    assert torch.equal(m2.weights, m.weights)
    assert rel(m2.output, m.output) > 0.1


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_chunk_size_and_window_do_not_change_the_map(chunk_size):
    q, k, v, beta, g, s0 = make_inputs(T=13, n_h=3, gate="channel")
    full = delta_attention(q, k, v, beta, g, initial_state=s0, chunk_size=5)
    m = delta_attention(q, k, v, beta, g, initial_state=s0, window=(4, 9), chunk_size=chunk_size)
    assert m.weights.shape == (2, 5, 4, 9, 3)
    assert rel(m.weights, full.weights[:, 4:9, :, :9]) < 1e-12
    assert rel(m.initial, full.initial[:, 4:9]) < 1e-12 and rel(m.output, full.output[:, 4:9]) < 1e-12


@pytest.mark.parametrize("gate", GATES)
def test_window_restarted_from_a_boundary_state(gate):
    """What the probe does: start at token c from the state H_c; sources before c fold into the initial term."""
    q, k, v, beta, g, s0 = make_inputs(T=12, n_h=2, gate=gate)
    c = 5
    _, h_c = naive_recurrence(*(x[:, :c] for x in (q, k, v, beta)), None if g is None else g[:, :c], initial_state=s0)
    full = delta_attention(q, k, v, beta, g, initial_state=s0, chunk_size=4)
    tail = [None if x is None else x[:, c:] for x in (q, k, v, beta, g)]
    part = delta_attention(*tail, initial_state=h_c, chunk_size=4)
    assert rel(part.weights, full.weights[:, c:, :, c:]) < 1e-12
    folded = full.initial[:, c:] + rebuild(full.weights[:, c:, :, :c], torch.zeros_like(part.initial), v)
    assert rel(part.initial, folded) < 1e-12


def test_reconstruction_float32_and_bfloat16_within_dtype_bounds():
    """float32 compute: rebuilt outputs within 1e-5 of the float64 recurrence on the same (rounded) inputs."""
    x = make_inputs(B=1, T=40, Hk=1, Hv=2, K=16, V=16, n_h=3, gate="scalar")
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        xr = [None if t is None else t.to(dtype) for t in x]
        o, _ = naive_recurrence(*[None if t is None else t.double() for t in xr[:5]], initial_state=xr[5].double())
        m = delta_attention(*xr[:5], initial_state=xr[5], chunk_size=16)
        assert m.weights.dtype == torch.float32
        assert rel(m.output, o) < bound
        assert rel(rebuild(m.weights.double(), m.initial.double(), xr[2].double()), o) < bound


@pytest.mark.parametrize("n_h,gate", [(1, None), (2, "scalar"), (3, "channel")])
def test_chunked_recurrence_matches_the_token_loop(n_h, gate):
    """The forward walk over the same UT factors (what state surgery recomputes heads with)."""
    q, k, v, beta, g, s0 = make_inputs(T=13, n_h=n_h, gate=gate)
    o, state = naive_recurrence(q, k, v, beta, g, initial_state=s0)
    o2, state2 = chunk_recurrence(q, k, v, beta, g, initial_state=s0, chunk_size=4)
    assert rel(o2, o) < 1e-12 and rel(state2, state) < 1e-12


# ---------------------------------------------------------------- top-k


@pytest.mark.parametrize("rank_by", ["weight", "contribution"])
def test_top_k_are_the_largest_entries_of_the_full_rows(rank_by):
    q, k, v, beta, g, s0 = make_inputs(T=10, n_h=2, gate="scalar")
    full = delta_attention(q, k, v, beta, g, initial_state=s0, chunk_size=3)
    top = delta_attention(q, k, v, beta, g, initial_state=s0, chunk_size=3, top_k=4, rank_by=rank_by)
    w = full.weights.flatten(3)  # [B, T, Hv, S * n_h], flat index s * n_h + j
    vnorm = v.norm(dim=-1).permute(0, 3, 1, 2).flatten(2)[:, None]  # [B, 1, Hv, S * n_h]
    key = w.abs() * (vnorm if rank_by == "contribution" else 1)
    T = q.shape[1]
    causal = torch.arange(w.shape[-1])[None, :] // 2 <= torch.arange(T)[:, None]  # [t, u]
    key = key.masked_fill(~causal[None, :, None], -1.0)
    want = key.topk(4, dim=-1)
    valid = want.values >= 0  # query 0 has only n_h = 2 sources
    assert torch.equal(top.top_index[valid], want.indices[valid])
    assert (top.top_index[~valid] == -1).all() and (~valid).sum() == 2 * 2 * 4  # B * (4 - 2) * Hv
    assert torch.allclose(top.top_weight, w.gather(-1, top.top_index.clamp(min=0)) * valid)
    chosen = top.top_index.clamp(min=0)
    norms = w.gather(-1, chosen).abs() * vnorm.expand_as(w).gather(-1, chosen)
    assert torch.allclose(top.top_norm, norms * valid)
    assert torch.allclose(top.output, full.output) and torch.allclose(top.row_norm, full.row_norm)
    assert top.weights is None


# ---------------------------------------------------------------- the gated-linear-attention approximation


@pytest.mark.parametrize("n_h,gate", [(1, None), (2, "scalar"), (3, "channel")])
def test_approximation_matches_its_reference(n_h, gate):
    q, k, v, beta, g, s0 = make_inputs(n_h=n_h, gate=gate)
    a, init = naive_gla_attention(q, k, v, beta, g, initial_state=s0)
    m = gla_attention(q, k, v, beta, g, initial_state=s0, chunk_size=4)
    assert rel(m.weights, a) < 1e-12 and rel(m.initial, init) < 1e-12


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_approximation_is_exact_when_the_keys_do_not_interact(gate):
    """Orthonormal keys (axis keys for per-channel gates, which diag(e^g) maps to themselves): Phi k_u = decay k_u."""
    B, T, n_h, H, K = 1, 5, 2, 2, 12
    q, _, v, beta, g, s0 = make_inputs(B=B, T=T, Hk=H, Hv=H, K=K, n_h=n_h, gate=gate)
    if gate == "scalar":
        basis = torch.linalg.qr(torch.randn(H, K, K, dtype=torch.float64))[0].transpose(1, 2)  # rows orthonormal
    else:
        basis = torch.eye(K, dtype=torch.float64)[torch.stack([torch.randperm(K) for _ in range(H)])]
    k = basis[:, : T * n_h].reshape(H, T, n_h, K).permute(1, 2, 0, 3)[None]
    cmp = compare_attention(q, k, v, beta, g, initial_state=s0, chunk_size=2)
    assert rel(cmp.approx.weights, cmp.exact.weights) < 1e-12
    assert cmp.weight_error.max() < 1e-12
    # the initial-state term still differs: Phi(t,-1)^T q removes the keys' directions from q
    assert rel(cmp.approx.initial, cmp.exact.initial) > 1e-3


def test_comparison_errors_equal_those_of_the_full_rows():
    q, k, v, beta, g, s0 = make_inputs(n_h=2, gate="channel")
    cmp = compare_attention(q, k, v, beta, g, initial_state=s0, chunk_size=4, top_k=3)
    ex = delta_attention(q, k, v, beta, g, initial_state=s0, chunk_size=4)
    ap = gla_attention(q, k, v, beta, g, initial_state=s0, chunk_size=4)
    werr = (ex.weights - ap.weights).flatten(3).norm(dim=-1) / ex.weights.flatten(3).norm(dim=-1)
    oerr = (ap.output - ex.output).norm(dim=-1) / ex.output.norm(dim=-1)
    assert rel(cmp.weight_error, werr) < 1e-12 and rel(cmp.output_error, oerr) < 1e-12
    assert werr.min() > 1e-3  # random keys do interact
    assert torch.equal(cmp.exact.top_index, delta_attention(q, k, v, beta, g, initial_state=s0, top_k=3).top_index)


# ---------------------------------------------------------------- invariants and errors


def test_zero_betas_leave_only_the_decayed_initial_state():
    q, k, v, beta, g, s0 = make_inputs(n_h=2, gate="channel")
    m = delta_attention(q, k, v, torch.zeros_like(beta), g, initial_state=s0)
    assert m.weights.abs().max() == 0
    qh = q.repeat_interleave(2, dim=2)
    want = q.shape[-1] ** -0.5 * torch.einsum("bthk,bhkv->bthv", qh * g.cumsum(1).exp(), s0)
    assert rel(m.initial, want) < 1e-12


def test_reflections_keep_the_carried_query_norm():
    """beta = 2, no gate: every Phi is orthogonal, so ||Phi(t,-1)^T q_t|| = ||q_t|| (seen through H_0 = I)."""
    q, k, v, beta, _, _ = make_inputs(B=1, Hk=1, Hv=1, K=6, V=6, n_h=3, gate=None, init=False)
    m = delta_attention(
        q, k, v, torch.full_like(beta, 2.0), initial_state=torch.eye(6, dtype=torch.float64)[None, None]
    )
    assert torch.allclose(m.initial.norm(dim=-1), 6**-0.5 * q.norm(dim=-1), rtol=1e-12)


def test_normalize_qk_is_normalising_first():
    q, k, v, beta, g, s0 = make_inputs(gate="scalar")
    a = delta_attention(3 * q, 2 * k, v, beta, g, initial_state=s0, normalize_qk=True)
    b = delta_attention(torch.nn.functional.normalize(q, dim=-1), k, v, beta, g, initial_state=s0)
    assert rel(a.weights, b.weights) < 1e-6  # fla's eps inside the norm


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(window=(5, 3)), "window"),
        (dict(top_k=0), "top_k"),
        (dict(rank_by="size"), "rank_by"),
        (dict(g=torch.zeros(2, 11, 3)), "g has shape"),
        (dict(initial_state=torch.zeros(2, 4, 8, 4)), "initial_state"),
        (dict(q=torch.zeros(2, 11, 3, 8, dtype=torch.float64)), "k has shape"),
    ],
)
def test_errors_are_one_line(change, match):
    q, k, v, beta, g, s0 = make_inputs()
    args = dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=s0) | change
    with pytest.raises(ValueError, match=match) as err:
        delta_attention(**args)
    assert "\n" not in str(err.value)
