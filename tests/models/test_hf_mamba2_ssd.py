"""kernels.ssd on fresh random inputs: the chunked form against the float64 recurrence (per dtype), the exact
attention matrix reproducing the recurrence to rounding in float64, and the shape errors."""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.ssd.chunk import chunk_ssd
from deltalab.kernels.ssd.naive import expand_key_heads, naive_ssd, ssd_attention_matrix
from tests.models.oracles import fro

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def inputs(T: int, seed: int, dtype=torch.float32, Hk: int = 2, H: int = 4, dk: int = 8, dv: int = 6):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, T, Hk, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(2, T, H, dv, generator=gen, dtype=dtype)
    g = -3 * torch.rand(2, T, H, generator=gen, dtype=dtype)  # log decays down to -3 per token
    s0 = torch.randn(2, H, dk, dv, generator=gen, dtype=dtype)
    return q, k, v, g, s0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 63, 64, 150])
def test_chunk_matches_float64_recurrence(dtype, T):
    q, k, v, g, s0 = inputs(T, seed=T, dtype=dtype)
    o, final, states = chunk_ssd(q, k, v, g, scale=0.5, initial_state=s0)
    o_ref, final_ref = naive_ssd(q, k, v, g, scale=0.5, initial_state=s0)
    assert o.dtype == dtype and states.shape == (2, (T + 63) // 64 + 1, 4, 8, 6)
    assert fro(o, o_ref) < TOL[dtype] and fro(final, final_ref) < TOL[dtype]
    assert torch.equal(states[:, 0], s0) and torch.equal(states[:, -1], final)
    for c in range(1, states.shape[1] - 1):  # every chunk start is the recurrence's state there
        _, at = naive_ssd(q[:, :64 * c], k[:, :64 * c], v[:, :64 * c], g[:, :64 * c], initial_state=s0)
        assert fro(states[:, c], at) < TOL[dtype]


def test_no_removal_term():
    """One token written twice with no decay: the state holds twice the write (the delta rule would hold it once)."""
    k = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2).repeat(1, 2, 1, 1)
    v = torch.ones(1, 2, 1, 1)
    o, final = naive_ssd(k, k, v, torch.zeros(1, 2, 1))
    assert final.flatten().tolist() == [2.0, 0.0] and o.flatten().tolist() == [1.0, 2.0]


def test_attention_matrix_reproduces_the_output():
    q, k, v, g, _ = inputs(90, seed=3, dtype=torch.float64)
    A = ssd_attention_matrix(q, k, g, scale=0.5)
    o_ref, _ = naive_ssd(q, k, v, g, scale=0.5)
    o = (A @ v.transpose(1, 2)).transpose(1, 2)
    assert A.shape == (2, 4, 90, 90) and torch.equal(A.triu(1), torch.zeros_like(A))
    assert fro(o, o_ref) < 1e-13
    # the diagonal is the current token's own score, undecayed: q_t . k_t
    qk = (expand_key_heads(q, 4) * expand_key_heads(k, 4)).sum(-1).transpose(1, 2)
    assert torch.allclose(A.diagonal(dim1=-2, dim2=-1), 0.5 * qk, rtol=0, atol=1e-12)


def test_heads_must_be_a_multiple_of_groups():
    q, k, v, g, _ = inputs(4, seed=0, Hk=3)
    with pytest.raises(ValueError, match="not a multiple of 3 key heads"):
        chunk_ssd(q, k, v, g)


@pytest.mark.parametrize("T, chunk", [(70, 32), (130, 256)])
def test_adapter_matches_transformers_scan(T, chunk):
    """deltalab's SSDHooks (discretisation, kernels.ssd, D skip) and transformers' torch `mamba2_chunk_scan` on the
    same fresh random arguments, with an initial state: both within float32 rounding of the float64 recurrence."""
    mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    from deltalab.models.hf.ssd_adapter import SSDHooks

    scan = getattr(mamba2.mamba2_chunk_scan, "deltalab_original", mamba2.mamba2_chunk_scan)
    gen = torch.Generator().manual_seed(T)
    B_, H, P, G, N = 2, 4, 6, 2, 8
    x = torch.randn(B_, T, H, P, generator=gen)
    dt = torch.randn(B_, T, H, generator=gen)
    A = -torch.rand(H, generator=gen) * 4
    Bm, Cm = (torch.randn(B_, T, G, N, generator=gen) for _ in range(2))
    D, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    h0 = torch.randn(B_, H, P, N, generator=gen)
    args = dict(D=D, dt_bias=dt_bias, initial_states=h0, dt_softplus=True, dt_limit=(0.01, 2.0),
                return_final_states=True)
    y_ref, final_ref = scan(x, dt, A, Bm, Cm, chunk, **args)
    y, final = SSDHooks(0, G, H, N, P)(x, dt, A, Bm, Cm, **args)
    step = torch.nn.functional.softplus(dt + dt_bias).clamp(0.01, 2.0)
    o64, final64 = naive_ssd(Cm, Bm, x * step[..., None], A * step, initial_state=h0.transpose(-1, -2))
    y64 = o64 + D.double()[:, None] * x.double()
    assert y.dtype == y_ref.dtype == torch.float32 and final.shape == final_ref.shape == (B_, H, P, N)
    assert fro(y, y64) < 1e-5 and fro(final, final64.transpose(-1, -2)) < 1e-5
    assert fro(y_ref, y64) < 1e-5 and fro(final_ref, final64.transpose(-1, -2)) < 1e-5


def test_adapter_refuses_packed_sequences():
    from deltalab.models.hf.route import PackedSequencesError
    from deltalab.models.hf.ssd_adapter import SSDHooks

    call = dict(hidden_states=torch.zeros(1, 4, 4, 6), dt=torch.zeros(1, 4, 4), A=-torch.ones(4),
                B=torch.zeros(1, 4, 2, 8), C=torch.zeros(1, 4, 2, 8), kwargs={"seq_idx": torch.zeros(1, 4)})
    with pytest.raises(PackedSequencesError, match="one sequence per row"):
        SSDHooks(0, 2, 4, 8, 6).route_call(call)
