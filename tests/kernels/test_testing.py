"""deltalab.kernels.testing: the inputs have the documented shapes and ranges, a seed names one input set, and
the relative error and tolerances mean what they say."""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels import chunk_delta_product, naive_delta_product
from deltalab.kernels.testing import (
    TOLERANCES,
    cu_seqlens,
    delta_inputs,
    dplr_inputs,
    rel_err,
    tolerance,
    transition_inputs,
)


@pytest.mark.parametrize("gate, g_shape", [(None, None), ("scalar", (2, 9, 4)), (True, (2, 9, 4)),
                                           ("channel", (2, 9, 4, 8))])
def test_delta_inputs_shapes_and_ranges(gate, g_shape):
    x = delta_inputs(2, 9, 2, 4, 8, 5, n_h=3, gate=gate, seed=1, unit_keys=True, beta_max=1.5, decay=0.3, n_seq=3,
                     state_scale=0.5)
    assert x.q.shape == (2, 9, 2, 8) and x.k.shape == (2, 9, 3, 2, 8) and x.v.shape == (2, 9, 3, 4, 5)
    assert x.beta.shape == (2, 9, 3, 4) and x.initial_state.shape == (3, 4, 8, 5)
    assert all(t.dtype == torch.float64 for t in x if t is not None)
    torch.testing.assert_close(x.k.norm(dim=-1), torch.ones(2, 9, 3, 2, dtype=torch.float64))
    assert 0 <= x.beta.min() and x.beta.max() < 1.5
    if g_shape is None:
        assert x.g is None
    else:
        assert x.g.shape == g_shape and -0.3 <= x.g.min() and x.g.max() <= 0
    assert delta_inputs(1, 3, 1, 1, 2, 2, initial_state=False).initial_state is None


def test_a_seed_names_one_input_set_and_the_global_generator_is_used_without_one():
    a, b, c = (delta_inputs(1, 5, 1, 2, 4, 3, 2, "scalar", seed=s) for s in (7, 7, 8))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a.q, c.q)
    torch.manual_seed(3)
    first = delta_inputs(1, 5, 1, 2, 4, 3)
    torch.manual_seed(3)
    assert torch.equal(first.v, delta_inputs(1, 5, 1, 2, 4, 3).v)
    sampled = delta_inputs(1, 5, 1, 2, 4, 3, gate=lambda gen: torch.full((1, 5, 2), -0.5), seed=7)
    assert (sampled.g == -0.5).all() and torch.equal(sampled.q, a.q)


def test_to_casts_every_tensor_and_keeps_none():
    x = delta_inputs(1, 4, 1, 1, 4, 4, gate=None, seed=0).to(dtype=torch.bfloat16)
    assert x.g is None and {t.dtype for t in x if t is not None} == {torch.bfloat16}


def test_transition_and_dplr_inputs():
    k, beta, g = transition_inputs(2, 6, 2, 3, 8, "channel", seed=0, decay=4.0)
    assert k.shape == (2, 6, 2, 3, 8) and beta.shape == (2, 6, 2, 3) and g.shape == (2, 6, 3, 8)
    torch.testing.assert_close(k.norm(dim=-1), torch.ones(2, 6, 2, 3, dtype=torch.float64))
    assert g.min() >= -4.0 and transition_inputs(1, 2, 1, 1, 4)[2] is None
    q, kk, v, a, b, gg, s0 = dplr_inputs(1, 6, 2, 8, 4, seed=0, init=True, dtype=torch.float32)
    assert v.shape == (1, 6, 2, 4) and s0.shape == (1, 2, 8, 4) and gg.min() >= -5.0 and q.dtype == torch.float32
    kappa = -a  # a = -kappa (unit), b = kappa * a_rwkv with a_rwkv in (0, 1)
    torch.testing.assert_close(kappa.norm(dim=-1), torch.ones(1, 6, 2))
    ratio = b / kappa
    assert ratio.min() > 0 and ratio.max() < 1
    assert cu_seqlens([3, 1, 4]).tolist() == [0, 3, 4, 8] and cu_seqlens([2]).dtype == torch.int32


def test_rel_err_norms():
    ref = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    got = torch.tensor([1.5, -4.0, 2.0], dtype=torch.float32)
    assert rel_err(got, ref) == pytest.approx(0.5 / 4)
    assert rel_err(got, ref, norm="fro") == pytest.approx(0.5 / 21**0.5)
    assert rel_err(got, ref, norm="pointwise") == pytest.approx(0.5)
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="norm 'l1' is not one of"):
        rel_err(got, ref, norm="l1")
    with pytest.raises(ValueError, match=r"actual has shape \(3,\), expected \(2,\)"):
        rel_err(got, ref[:2])


def test_tolerances_order_the_dtypes_and_judge_the_chunked_form():
    assert TOLERANCES[torch.float64] < TOLERANCES[torch.float32] < TOLERANCES[torch.float16] < \
        TOLERANCES[torch.bfloat16]
    with pytest.raises(ValueError, match="no tolerance for torch.int8: use one of float64, float32"):
        tolerance(torch.int8)
    x = delta_inputs(1, 150, 1, 2, 16, 8, 2, "scalar", seed=2, unit_keys=True)
    ref = naive_delta_product(*x[:5], initial_state=x.initial_state)
    for dtype in (torch.float64, torch.float32):
        y = x.to(dtype=dtype)
        got = chunk_delta_product(*y[:5], initial_state=y.initial_state)
        errs = [rel_err(a, b) for a, b in zip(got, ref)]
        assert max(errs) < tolerance(dtype), (dtype, errs)
    wrong = x.to(dtype=torch.float32)._replace(beta=x.beta.float() * 0.5)  # a wrong input misses by far
    bad = chunk_delta_product(*wrong[:5], initial_state=wrong.initial_state)[0]
    assert rel_err(bad, ref[0]) > 100 * tolerance(torch.float32)
