"""The chunked WY/UT form against the float64 token-by-token reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from deltalab.kernels import chunk_delta_product, naive_delta_product
from deltalab.kernels.testing import delta_inputs, rel_err


@pytest.mark.parametrize("n_h,gate,init", list(itertools.product([1, 2, 3], [False, True], [False, True])))
def test_chunk_matches_reference_float64(n_h, gate, init):
    q, k, v, beta, g, s0 = delta_inputs(2, 150, 2, 2, 16, 12, n_h, gate, initial_state=init)
    ref = naive_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    out = chunk_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    assert out[2].shape == (2, 4, 2, 16, 12)  # ceil(150/64) chunk starts + the final state
    for got, want in zip(out, ref):
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("T", [1, 20, 64])
def test_sequences_of_at_most_one_chunk(T):
    """Short sequences are solved as one chunk of their own length; boundaries are (initial, final)."""
    q, k, v, beta, g, s0 = delta_inputs(1, T, 2, 2, 8, 8, 2, True, initial_state=True)
    ref = naive_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    out = chunk_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    assert out[2].shape[1] == 2
    for got, want in zip(out, ref):
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("n_h,gate", [(1, True), (2, False), (3, True)])
def test_chunk_float32_error_bound(n_h, gate):
    """float32 inputs: relative error against float64 stays below 1e-4 (measured ~1e-6)."""
    q, k, v, beta, g, s0 = delta_inputs(1, 200, 2, 2, 32, 32, n_h, gate, initial_state=True)
    ref = naive_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    f32 = [x.float() if x is not None else None for x in (q, k, v, beta, g, s0)]
    out = chunk_delta_product(*f32[:5], initial_state=f32[5], normalize_qk=True)
    assert out[0].dtype == torch.float32
    for got, want in zip(out, ref):
        assert rel_err(got, want) < 1e-4


def test_chunk_bfloat16_inputs_error_bound():
    """bf16 inputs are rounded once (2^-8); accumulation is float32, so error stays below 3e-2."""
    q, k, v, beta, g, _ = delta_inputs(1, 130, 2, 2, 32, 32, 2, True, initial_state=False)
    bf = [x.bfloat16() for x in (q, k, v, beta, g)]
    ref = naive_delta_product(*[x.double() for x in bf], normalize_qk=True)
    out = chunk_delta_product(*bf, normalize_qk=True)
    assert out[0].dtype == torch.bfloat16
    assert rel_err(out[0], ref[0]) < 3e-2
    assert rel_err(out[1], ref[1]) < 1e-4  # states from the same bf16 inputs, float32 arithmetic


def test_chunk_size_does_not_change_results():
    q, k, v, beta, g, s0 = delta_inputs(1, 100, 1, 1, 8, 8, 2, True, initial_state=True)
    a = chunk_delta_product(q, k, v, beta, g, initial_state=s0, chunk_size=64, normalize_qk=True)
    b = chunk_delta_product(q, k, v, beta, g, initial_state=s0, chunk_size=16, normalize_qk=True)
    assert rel_err(a[0], b[0]) < 1e-12 and rel_err(a[1], b[1]) < 1e-12
    assert torch.allclose(a[2][:, :2], b[2][:, [0, 4]])  # 16-token boundaries 0 and 4 are tokens 0 and 64
    assert torch.allclose(a[2][:, -1], b[2][:, -1])  # the final state


def test_boundary_states_restart_the_recurrence():
    """Running chunk c from boundary c reproduces the outputs of that chunk."""
    q, k, v, beta, g, _ = delta_inputs(1, 128, 2, 2, 8, 8, 2, True, initial_state=False)
    o, _, states = naive_delta_product(q, k, v, beta, g, normalize_qk=True)
    part = slice(64, 128)
    o2, final2, _ = naive_delta_product(q[:, part], k[:, part], v[:, part], beta[:, part], g[:, part],
                                        initial_state=states[:, 1], normalize_qk=True)
    assert rel_err(o2, o[:, part]) < 1e-12 and rel_err(final2, states[:, -1]) < 1e-12


def test_chunk_is_differentiable():
    q, k, v, beta, g, s0 = delta_inputs(1, 20, 1, 1, 4, 3, 2, True, initial_state=True)
    inputs = [x.requires_grad_() for x in (q, k, v, beta, g)]

    def f(*xs):
        o, final, _ = chunk_delta_product(*xs, initial_state=s0, chunk_size=8, normalize_qk=True)
        return o.sum() + final.sum()

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)
