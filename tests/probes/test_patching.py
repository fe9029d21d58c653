"""Activation and state patching: batched patches equal the same patch run alone, clean values reproduce the clean
run, and a state patch mid-chunk equals the float64 recurrence restarted from the patched state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.probes.patching import (
    HOOKS,
    ActPatch,
    Metric,
    PatchingError,
    Run,
    StatePart,
    StatePatch,
    activation_patching,
    patched_logits,
    state_patching,
)
from deltalab.probes.patching.runs import layer_scale
from tests.probes.patching_models import CONFIGS, VOCAB, pair, tiny_model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_batched_patch_equals_the_same_patch_run_alone(name):
    model = tiny_model(name)
    clean, corrupted = pair(12, flip=4)
    source = Run.record(model, clean)
    rows = [[ActPatch("resid_pre", 1, None, 5)], [ActPatch("o", 0, 1, 7)], [ActPatch("k", 1, 0, None)],
            [ActPatch("beta", 0, None, 4), ActPatch("v", 1, 1, 9)], [ActPatch("g", 1, 1, 6)],
            [], [ActPatch("q", 0, 1, 4)]]
    states = [[StatePatch(0, 1, 6)], [], [StatePatch(1, 0, 4, StatePart("top", 2))], [], [],
              [StatePatch(0, 0, 11, StatePart("rank", 1))], []]
    with torch.no_grad():
        batched = patched_logits(model, corrupted, source, rows, states)
        alone = [patched_logits(model, corrupted, source, [a], [s])[0] for a, s in zip(rows, states)]
    for r, logits in enumerate(alone):
        torch.testing.assert_close(batched[r], logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(batched[0], batched[5])  # the patches do change the runs


def test_sweep_values_do_not_depend_on_the_batch_size():
    model = tiny_model("deltaproduct2")
    clean, corrupted = pair(10, flip=3)
    kw = dict(hooks=["resid_mid", "o", "beta"], positions=[2, 3, 9])
    one = activation_patching(model, clean, corrupted, "logit-diff:1,2", batch_size=1, **kw)
    many = activation_patching(model, clean, corrupted, "logit-diff:1,2", batch_size=9, **kw)
    np.testing.assert_allclose(one.metric.values, many.metric.values, rtol=1e-5, atol=1e-6)
    assert np.isfinite(one.patched.sel(hook="o", head=[0, 1]).values).all()
    assert np.isnan(one.patched.sel(hook="resid_mid", head=0).values).all()  # the residual stream has no heads


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_patching_every_hook_with_clean_values_reproduces_the_clean_run(name):
    model = tiny_model(name)
    clean, corrupted = pair(9, flip=2)
    source = Run.record(model, clean)
    every = [ActPatch(h, layer) for layer in range(2) for h in HOOKS]
    first = [ActPatch("resid_pre", 0)]
    with torch.no_grad():
        for patches in (every, first):
            logits = patched_logits(model, corrupted, source, [patches])
            assert torch.equal(logits[0], source.logits)
    metric = Metric.parse("logprob:3")
    ds = activation_patching(model, clean, corrupted, metric, hooks=["resid_pre"], layers=[0], per_position=False)
    assert ds.patched.sel(hook="resid_pre", layer=0, head=-1, position=-1) == 1.0
    noised = activation_patching(model, clean, corrupted, metric, hooks=["resid_post"], layers=[1],
                                 per_position=False, direction="noise")
    assert noised.patched.item() == 0.0  # noising every position of the last residual gives the corrupted run


def test_denoising_before_the_corruption_changes_nothing():
    model = tiny_model("kda")
    clean, corrupted = pair(10, flip=6)
    ds = activation_patching(model, clean, corrupted, "kl", hooks=["resid_pre", "o"])
    np.testing.assert_array_equal(ds.patched.sel(position=slice(0, 5)).fillna(0).values, 0.0)
    assert ds.patched.sel(hook="resid_pre", layer=0, head=-1, position=6) == 1.0
    sd = state_patching(model, clean, corrupted, "kl")
    # the same state recomputed in float32 through another path: zero up to rounding
    np.testing.assert_allclose(sd.patched.sel(token=slice(0, 5)).values, 0.0, atol=1e-5)
    assert np.abs(sd.patched.sel(token=slice(6, None)).values).max() > 0


def _hook_o(model, ids, source, patch):
    """The layer's recurrence outputs (hook_o) in a run with `patch` applied."""
    got = {}

    def keep(o):
        got["o"] = o.clone()
        return o
    with torch.no_grad():
        patched_logits(model, ids, source, [[]], [[patch]], extra={("o", patch.layer): keep})
    return got["o"][0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("token", [70, 63, 64, 0, 99])
def test_state_patch_mid_chunk_equals_the_recurrence_restarted_from_the_patched_state(name, token):
    model = tiny_model(name, torch.float64)
    clean, corrupted = pair(100, flip=1)
    source, base = Run.record(model, clean), Run.record(model, corrupted)
    layer, head = 1, 1
    got = _hook_o(model, corrupted, source, StatePatch(layer, head, token))

    def inputs(run, sl):
        c = run.cache
        g = c.get(("g", layer))
        return (c["q", layer][:, sl].double(), c["k", layer][:, sl].double(), c["v", layer][:, sl].double(),
                c["beta", layer][:, sl].double(), None if g is None else g[:, sl].double())
    scale = layer_scale(model, layer)
    _, clean_state, _ = naive_delta_product(*inputs(source, slice(0, token + 1)), scale=scale)
    q_t = inputs(base, slice(token, token + 1))[0]
    group = model.config.num_value_heads // model.config.num_key_heads
    want_t = scale * torch.einsum("kv,k->v", clean_state[0, head], q_t[0, 0, head // group])
    want_rest, _, _ = naive_delta_product(*inputs(base, slice(token + 1, None)), scale=scale,
                                          initial_state=clean_state)
    want = base.cache["o", layer][0].clone()
    want[token, head] = want_t
    want[token + 1:, head] = want_rest[0, :, head]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    others = [h for h in range(want.shape[1]) if h != head]
    assert torch.equal(got[:, others], base.cache["o", layer][0][:, others])


def test_state_parts():
    model = tiny_model("deltaproduct2", torch.float64)
    clean, corrupted = pair(20, flip=2)
    source = Run.record(model, clean)
    full = _hook_o(model, corrupted, source, StatePatch(0, 1, 9))
    dk = model.config.head_k_dim
    for part in (StatePart("rank", dk), StatePart("top", dk)):  # every direction: the whole state
        torch.testing.assert_close(_hook_o(model, corrupted, source, StatePatch(0, 1, 9, part)), full)
    base = Run.record(model, corrupted)
    own, src = base.states(0)[9, 1], source.states(0)[9, 1]
    u = torch.randn(dk, dtype=torch.float64)
    part = StatePart("key", direction=u)
    u = u / u.norm()
    value = own + torch.outer(u, u @ (src - own))
    torch.testing.assert_close(_hook_o(model, corrupted, source, StatePatch(0, 1, 9, part)),
                               _hook_o(model, corrupted, source, StatePatch(0, 1, 9, value=value)))
    torch.testing.assert_close(StatePart("rank", 1).apply(None, src[None])[0].double(),
                               torch.linalg.svd(src)[1][0] * torch.outer(torch.linalg.svd(src)[0][:, 0],
                                                                          torch.linalg.svd(src)[2][0]))


def test_token_states_match_the_plain_recurrence():
    model = tiny_model("kda", torch.float64)
    ids, _ = pair(70, flip=0)
    run = Run.record(model, ids)
    c = run.cache
    for t in (0, 5, 63, 64, 69):
        _, want, _ = naive_delta_product(c["q", 0][:, :t + 1], c["k", 0][:, :t + 1], c["v", 0][:, :t + 1],
                                         c["beta", 0][:, :t + 1].double(), c["g", 0][:, :t + 1].double(),
                                         scale=layer_scale(model, 0))
        torch.testing.assert_close(run.states(0)[t], want[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("call, message", [
    (lambda m, a, b: activation_patching(m, a, b[:-1], "kl"), "differ in length"),
    (lambda m, a, b: activation_patching(m, a, b, f"logit-diff:1,{VOCAB}"), "outside the model's vocabulary"),
    (lambda m, a, b: activation_patching(m, a, b, "logprob:1", positions=[40]), "position 40 is out of range"),
    (lambda m, a, b: activation_patching(m, a, b, Metric("kl", positions=(12,))), "position 12 is out of range"),
    (lambda m, a, b: state_patching(m, a, b, "kl", heads=[5]), "head 5 is out of range"),
    (lambda m, a, b: state_patching(m, a, b, "kl", tokens=[12]), "token 12 is out of range"),
    (lambda m, a, b: activation_patching(m, a, b, "kl", hooks=["hook_x"]), "unknown hook"),
    (lambda m, a, b: activation_patching(m, a, b, "kl", layers=[2]), "layer 2 is out of range"),
    (lambda m, a, b: activation_patching(m, a, b, "logit-diff:1"), "takes 2 token id(s)"),
])
def test_bad_input_is_one_line(call, message):
    model = tiny_model("deltaproduct2")
    clean, corrupted = pair(12, flip=3)
    with pytest.raises(PatchingError) as err:
        call(model, clean, corrupted)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_rwkv7_activation_patching_through_the_same_hook_names():
    from pathlib import Path

    from deltalab.models import load_checkpoint

    model = load_checkpoint(Path(__file__).resolve().parents[2] / "models" / "zoo" / "parity-rwkv7")
    clean = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 0])
    corrupted = clean.clone()
    corrupted[3] = 1
    source = Run.record(model, clean)
    every = [ActPatch(h, layer) for layer in range(len(model.layers)) for h in HOOKS if (h, layer) in source.cache]
    with torch.no_grad():
        assert torch.equal(patched_logits(model, corrupted, source, [every])[0], source.logits)
    ds = activation_patching(model, clean, corrupted, "kl", hooks=["resid_pre", "o", "k"], positions=[2, 3])
    assert ds.patched.sel(hook="resid_pre", layer=0, head=-1, position=3) == 1.0
    assert np.isfinite(ds.patched.sel(hook="o", head=0).values).all()
    with pytest.raises(PatchingError, match="no delta-rule layer"):
        state_patching(model, clean, corrupted, "kl")
