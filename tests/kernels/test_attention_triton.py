"""Triton exact attention maps against the float64 oracle (CPU: TRITON_INTERPRET=1, tiny shapes; GPU: marked).

The kernel computes in float32 (tl.dot at 'tf32x3' on the GPU: float32 accuracy); the references get the same
inputs in float64, so the bounds measure float32 arithmetic: 1e-5 relative on the weights and rebuilt outputs.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("triton")

from deltalab.kernels.attention.chunk import delta_attention  # noqa: E402
from deltalab.kernels.attention.naive import naive_attention, naive_recurrence  # noqa: E402
from deltalab.kernels.testing import delta_inputs, rel_err  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1")

make_inputs = functools.partial(delta_inputs, seed=0, unit_keys=True, decay=0.2)
"""Float64 inputs (B, T, Hk, Hv, K, V, n_h, gate): unit keys, log-decays uniform in [-decay, 0], an initial state."""
rel = functools.partial(rel_err, norm="fro")


@cpu_only
@pytest.mark.parametrize("n_h,gate", [(1, False), (2, True), (3, True)])
def test_triton_matches_the_float64_oracle(n_h, gate):
    """Two chunks and a partial third (T = 140), grouped heads, an initial state, a window not on chunk bounds."""
    from deltalab.kernels.attention.triton_attention import triton_attention

    q, k, v, beta, g, s0 = make_inputs(1, 140, 1, 2, 16, 8, n_h, gate)
    m = triton_attention(q, k, v, beta, g, initial_state=s0, window=(60, 140), tile=64)
    assert m.weights.shape == (1, 80, 2, 140, n_h) and m.weights.dtype == torch.float32
    o, _ = naive_recurrence(q, k, v, beta, g, initial_state=s0)
    rows = [70, 139] if n_h == 3 else [60, 64, 127, 130, 139]  # the oracle is slow: a few query rows
    sub = [None if x is None else x[:, : max(rows) + 1] for x in (q, k, v, beta, g)]
    a, init = naive_attention(*sub, initial_state=s0)
    for t in rows:
        assert rel(m.weights[:, t - 60, :, : t + 1], a[:, t, :, : t + 1]) < 1e-5
        # the initial term decays to ~1e-6 of o_t by t = 139; float32 bounds it relative to o_t
        assert (m.initial[:, t - 60] - init[:, t]).norm() / o[:, t].norm() < 1e-6
    assert rel(m.output, o[:, 60:]) < 1e-5
    assert m.weights[:, 0, :, 61:].abs().max() == 0  # causal


@cpu_only
@pytest.mark.parametrize(
    "n_h,gate,rank_by", [(2, "scalar", "contribution"), (2, "channel", "weight"), (1, None, "weight")]
)
def test_triton_top_k_matches_the_chunked_form(n_h, gate, rank_by):
    """The running top-k inside the kernel (top_k <= KERNEL_TOP_K): index, signed weight, norm, rebuilt output.

    Small top_k and two chunks: the interpreter runs tl.topk's sorting network slowly."""
    from deltalab.kernels.attention.triton_attention import triton_attention

    q, k, v, beta, g, s0 = make_inputs(1, 100, 1, 2, 16, 8, n_h, gate)
    want = delta_attention(q, k, v, beta, g, initial_state=s0, top_k=3, rank_by=rank_by)
    got = triton_attention(q, k, v, beta, g, initial_state=s0, top_k=3, rank_by=rank_by)
    assert got.weights is None
    assert (got.top_index == want.top_index).float().mean() > 0.999  # float32 ties aside
    assert rel(got.top_weight, want.top_weight) < 1e-5 and rel(got.top_norm, want.top_norm) < 1e-5
    assert (got.top_index[:, 0, :, n_h:] == -1).all() and (got.top_index[:, 0, :, :n_h] >= 0).all()  # token 0
    assert (got.top_weight[:, 0, :, n_h:] == 0).all()
    assert rel(got.output, want.output) < 1e-5 and rel(got.row_norm, want.row_norm) < 1e-5
    assert rel(got.initial, want.initial) < 1e-5


@cpu_only
def test_triton_top_k_in_the_kernel_equals_the_tiled_form(monkeypatch):
    """Both top-k paths of triton_attention (in the kernel, and tiles of full rows for top_k > KERNEL_TOP_K)."""
    import deltalab.kernels.attention.triton_attention as at

    q, k, v, beta, g, s0 = make_inputs(1, 140, 1, 1, 16, 8, 3, "channel")
    args = dict(initial_state=s0, window=(70, 140), top_k=2, rank_by="contribution", tile=64)
    got = at.triton_attention(q, k, v, beta, g, **args)
    monkeypatch.setattr(at, "KERNEL_TOP_K", 0)
    tiled = at.triton_attention(q, k, v, beta, g, **args)
    assert (got.top_index == tiled.top_index).float().mean() > 0.999
    assert rel(got.top_weight, tiled.top_weight) < 1e-5 and rel(got.top_norm, tiled.top_norm) < 1e-5
    assert rel(got.output, tiled.output) < 1e-5 and rel(got.row_norm, tiled.row_norm) < 1e-5


@cpu_only
def test_triton_top_k_by_contribution_with_zero_values():
    """Sources with v_u = 0 (contribution 0) still report their exact signed weight, never NaN."""
    from deltalab.kernels.attention.triton_attention import triton_attention

    q, k, v, beta, g, s0 = make_inputs(1, 70, 1, 1, 16, 8, 1, "scalar")
    v[:, 3:60] = 0  # fewer than top_k sources with a non-zero contribution for the early rows
    want = delta_attention(q, k, v, beta, g, initial_state=s0, top_k=4, rank_by="contribution")
    got = triton_attention(q, k, v, beta, g, initial_state=s0, top_k=4, rank_by="contribution")
    assert torch.isfinite(got.top_weight).all()
    same = got.top_index == want.top_index  # ties at contribution 0 are arbitrary
    assert same[:, :3].all() and rel(got.top_weight[same], want.top_weight[same]) < 1e-5


@cpu_only
@pytest.mark.parametrize("n_h,Hk,Hv", [(1, 1, 2), (2, 2, 4)])
def test_triton_per_channel_gates_match_the_float64_oracle(n_h, Hk, Hv):
    """Kimi Delta Attention gates g [B, T, Hv, dk]: T = 140 (a partial third chunk), grouped heads, a state."""
    from deltalab.kernels.attention.triton_attention import triton_attention

    q, k, v, beta, g, s0 = make_inputs(1, 140, Hk, Hv, 16, 8, n_h, "channel")
    m = triton_attention(q, k, v, beta, g, initial_state=s0, window=(60, 140), tile=64)
    assert m.weights.shape == (1, 80, Hv, 140, n_h) and m.weights.dtype == torch.float32
    ref = delta_attention(q, k, v, beta, g, initial_state=s0, window=(60, 140))  # float64, every row
    assert rel(m.weights, ref.weights) < 1e-5 and rel(m.output, ref.output) < 1e-5
    o, _ = naive_recurrence(q, k, v, beta, g, initial_state=s0)
    assert rel(m.output, o[:, 60:]) < 1e-5
    t = 66  # one row against the dense oracle (a query after the first chunk boundary)
    a, init = naive_attention(*(x[:, : t + 1] for x in (q, k, v, beta, g)), initial_state=s0)
    assert rel(m.weights[:, t - 60, :, : t + 1], a[:, t]) < 1e-5
    assert (m.initial[:, t - 60] - init[:, t]).norm() / o[:, t].norm() < 1e-6


@cpu_only
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_triton_strong_decays_stay_finite_and_exact(gate):
    """Log-decays down to -30 per token: every exponent is a difference Gamma_w - Gamma_z <= 0, nothing overflows."""
    from deltalab.kernels.attention.triton_attention import triton_attention

    q, k, v, beta, g, s0 = make_inputs(1, 130, 1, 2, 16, 8, 2, gate, decay=30.0)
    m = triton_attention(q, k, v, beta, g, initial_state=s0)
    ref = delta_attention(q, k, v, beta, g, initial_state=s0)
    assert torch.isfinite(m.weights).all() and torch.isfinite(m.initial).all()
    assert rel(m.weights, ref.weights) < 1e-5 and rel(m.output, ref.output) < 1e-5
    assert ((m.initial - ref.initial).norm(dim=-1) / ref.output.norm(dim=-1)).max() < 1e-6


def test_per_channel_factors_do_not_depend_on_the_byte_budget():
    """The [L, L, dk] pairwise decays are built for groups of chunks; one chunk at a time gives the same factors."""
    from deltalab.kernels.attention.chunk import prepare_inputs
    from deltalab.kernels.attention.triton_attention import _factors

    q, k, v, beta, g, _ = make_inputs(2, 150, 1, 2, 16, 8, 2, "channel")
    inp = prepare_inputs(*(x.float() for x in (q, k, v, beta, g)), None, None, False, 150)
    for whole, grouped in zip(_factors(inp, 16), _factors(inp, 16, budget=1)):
        assert torch.allclose(whole, grouped, rtol=1e-6, atol=1e-7)  # BLAS may block batches differently


def test_triton_refuses_a_bad_gate_shape():
    from deltalab.kernels.attention.triton_attention import triton_attention

    q, k, v, beta, _, _ = make_inputs(1, 8, 1, 1, 16, 8, 1, False)
    with pytest.raises(ValueError, match="g has shape") as err:
        triton_attention(q, k, v, beta, torch.zeros(1, 8, 1, 15))
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("n_h,gate", [(1, "scalar"), (2, "scalar"), (1, "channel"), (2, "channel")])
def test_triton_gpu_4096_tokens(n_h, gate):
    """T = 4096, 2 value heads on 1 key head, dk = dv = 128, an initial state: against the float64 chunked form on
    the GPU (checked against the dense oracle on small shapes) and the float64 chunked recurrence.

    Full rows for a 1024-token window; the in-kernel top-k for all 4096 queries. Under a minute on a Hopper GPU."""
    import time

    from deltalab.kernels.attention.chunk import chunk_recurrence
    from deltalab.kernels.attention.triton_attention import triton_attention

    q, k, v, beta, g, s0 = make_inputs(1, 4096, 1, 2, 128, 128, n_h, gate, device="cuda", decay=0.05)
    t0 = time.perf_counter()
    m = triton_attention(q, k, v, beta, g, initial_state=s0, window=(3072, 4096))
    ref = delta_attention(q, k, v, beta, g, initial_state=s0, window=(3072, 4096))
    o, _ = chunk_recurrence(q, k, v, beta, g, initial_state=s0)
    errs = dict(weights=rel(m.weights, ref.weights), output=rel(m.output, o[:, 3072:]),
                initial=((m.initial - ref.initial).norm() / o[:, 3072:].norm()).item())
    top = triton_attention(q, k, v, beta, g, initial_state=s0, top_k=8, rank_by="contribution")
    ref_top = delta_attention(q, k, v, beta, g, initial_state=s0, top_k=8, rank_by="contribution")
    same = top.top_index == ref_top.top_index  # float32 near ties may swap a pair: compare where they agree
    errs |= dict(agree=same.float().mean().item(), top_weight=rel(top.top_weight[same], ref_top.top_weight[same]),
                 top_norm=rel(top.top_norm, ref_top.top_norm), top_output=rel(top.output, o))
    print(f"n_h={n_h} gate={gate}: {errs} in {time.perf_counter() - t0:.1f} s")
    assert errs["weights"] < 2e-5 and errs["output"] < 2e-5 and errs["initial"] < 2e-5
    assert errs["agree"] > 0.999 and errs["top_weight"] < 2e-5 and errs["top_norm"] < 2e-5  # sorted: swap-proof
    assert errs["top_output"] < 2e-5
