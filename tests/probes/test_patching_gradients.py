"""Exact state gradients against finite differences (float64, 1e-6), and attribution patching against the
derivative of actual patching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.probes.patching import (
    ActPatch,
    Run,
    StatePatch,
    attribution_patching,
    patched_logits,
    perturbation_outputs,
    state_gradients,
)
from deltalab.probes.patching.metrics import Metric
from tests.probes.patching_models import pair, tiny_model


def _layer_inputs(B=2, T=75, Hk=2, Hv=4, n_h=2, dk=5, dv=3, channel_gate=True):
    f = dict(dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.randn(B, T, Hk, dk, **f), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, n_h, Hk, dk, **f), dim=-1)
    v = torch.randn(B, T, n_h, Hv, dv, **f)
    beta = torch.rand(B, T, n_h, Hv, **f) * 2
    g = -torch.rand(B, T, Hv, dk, **f) * 0.3 if channel_gate else -torch.rand(B, T, Hv, **f) * 0.3
    return q, k, v, beta, g


@pytest.mark.parametrize("channel_gate", [True, False])
def test_state_gradients_equal_finite_differences_in_float64(channel_gate):
    q, k, v, beta, g = _layer_inputs(channel_gate=channel_gate)
    B, T, Hv, dk, dv = 2, q.shape[1], v.shape[3], q.shape[3], v.shape[4]
    scale = 0.7
    W = torch.randn(B, T, Hv, dv, dtype=torch.float64)
    E = torch.zeros(B, T, Hv, dk, dv, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad((W * perturbation_outputs(q, k, beta, g, scale, E)).sum(), E)

    def metric_with_state(t: int, dS: torch.Tensor) -> float:
        """sum(W * o) with S_t replaced by S_t + dS and the recurrence restarted from it (the naive oracle)."""
        o_head, S, _ = naive_delta_product(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], beta[:, : t + 1],
                                           g[:, : t + 1], scale=scale)
        S = S + dS
        G = Hv // q.shape[2]
        o_t = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t].repeat_interleave(G, 1))
        o_rest, _, _ = naive_delta_product(q[:, t + 1:], k[:, t + 1:], v[:, t + 1:], beta[:, t + 1:], g[:, t + 1:],
                                           scale=scale, initial_state=S)
        o = torch.cat([o_head[:, :t], o_t[:, None], o_rest], 1)
        return float((W * o).sum())

    eps = 1e-4
    for t in (0, 40, 63, 64, T - 1):
        D = torch.randn(B, Hv, dk, dv, dtype=torch.float64)
        fd = (metric_with_state(t, eps * D) - metric_with_state(t, -eps * D)) / (2 * eps)
        assert abs(fd - float((grad[:, t] * D).sum())) <= 1e-6 * max(1.0, abs(fd))
        one = torch.zeros_like(D)
        one[1, 2, 3, 1] = 1.0
        fd = (metric_with_state(t, eps * one) - metric_with_state(t, -eps * one)) / (2 * eps)
        assert abs(fd - float(grad[1, t, 2, 3, 1])) <= 1e-6 * max(1.0, abs(fd))


def test_perturbation_leaves_the_forward_unchanged_and_model_gradients_match_state_patches():
    model = tiny_model("deltaproduct2", torch.float64)
    ids, _ = pair(20, flip=0)
    metric = Metric.parse("logit-diff:1,2")
    ds = state_gradients(model, ids, metric)
    run = Run.record(model, ids)
    assert ds.attrs["metric_value"] == float(metric(run.logits[None], ids, run.logits)[0])
    assert ds.grad.dims == ("layer", "token", "head", "key", "value")
    eps = 1e-3
    for layer, head, t in ((0, 1, 7), (1, 0, 15), (0, 0, 19)):
        D = torch.randn(*ds.grad.shape[-2:], dtype=torch.float64)
        S = run.states(layer)[t, head]
        with torch.no_grad():
            logits = patched_logits(model, ids, run, state=[[StatePatch(layer, head, t, value=S + eps * D)],
                                                            [StatePatch(layer, head, t, value=S - eps * D)]])
        m = metric(logits, ids, run.logits)
        fd = float(m[0] - m[1]) / (2 * eps)
        want = float((torch.as_tensor(ds.grad.sel(layer=layer, token=t, head=head).values) * D).sum())
        assert abs(fd) > 1e-3 and abs(fd - want) <= 1e-3 * abs(fd) + 1e-5  # float32 norms inside the model


def test_attribution_is_the_derivative_of_actual_patching():
    model = tiny_model("kda", torch.float64)
    clean, corrupted = pair(12, flip=4)
    metric = Metric("logprob", (3,), positions=(5,))  # token 3's log-probability at position 5
    ds = attribution_patching(model, clean, corrupted, metric, hooks=["resid_mid", "v", "o"])
    base, source = Run.record(model, corrupted), Run.record(model, clean)
    eps = 1e-2
    # the last two cannot reach the metric at position 5 (a later position; the last layer's read-out at 4)
    cells = [("resid_mid", 0, -1, 4), ("v", 1, 1, 4), ("o", 0, 0, 5), ("o", 1, -1, 5), ("o", 0, 1, 9),
             ("o", 1, 0, 4)]
    rows = [[ActPatch(h, layer, None if head == -1 else head, p)] for h, layer, head, p in cells]
    m = []
    for sign in (1, -1):  # central differences along (source - base)
        near = Run(model, clean, source.logits, {k: base.cache[k] + sign * eps * (source.cache[k] - base.cache[k])
                                                 for k in base.cache})
        with torch.no_grad():
            m.append(metric(patched_logits(model, corrupted, near, rows), clean, source.logits))
    base_m = ds.attrs["base_metric"]
    for n, ((h, layer, head, p), derivative) in enumerate(zip(cells, ((m[0] - m[1]) / (2 * eps)).tolist())):
        est = float(ds.attribution_metric.sel(hook=h, layer=layer, head=head, position=p)) - base_m
        if n >= 4:  # no effect, and none estimated
            assert derivative == 0 and est == 0
            continue
        assert abs(derivative) > 1e-4 and abs(est - derivative) <= 2e-2 * abs(derivative) + 1e-4
    assert np.isfinite(ds.state_attribution.values).all()


def test_state_attribution_is_the_derivative_of_a_state_patch():
    model = tiny_model("grouped_gdn", torch.float64)
    clean, corrupted = pair(14, flip=3)
    metric = Metric.parse("logit-diff:2,7")
    ds = attribution_patching(model, clean, corrupted, metric, hooks=[])
    base, source = Run.record(model, corrupted), Run.record(model, clean)
    eps = 1e-2
    for layer, head, t in ((0, 3, 5), (1, 0, 9)):
        S, S_src = base.states(layer)[t, head], source.states(layer)[t, head]
        with torch.no_grad():
            logits = patched_logits(model, corrupted, source,
                                    state=[[StatePatch(layer, head, t, value=S + eps * (S_src - S))],
                                           [StatePatch(layer, head, t, value=S - eps * (S_src - S))]])
        m = metric(logits, clean, source.logits)
        derivative = float(m[0] - m[1]) / (2 * eps)
        span = ds.attrs["clean_metric"] - ds.attrs["corrupted_metric"]
        est = float(ds.state_attribution.sel(state_layer=layer, state_head=head, token=t)) * span
        assert abs(derivative) > 1e-4 and abs(est - derivative) <= 2e-2 * abs(derivative) + 1e-4
