"""Interventions while generating: steering vectors, hook edits from a step on, state edits at decode time."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from deltalab.models.generate import generate
from deltalab.models.interventions import (
    HookEdit,
    InterventionError,
    StateEdit,
    Steering,
    difference_vector,
    load_vector,
    mean_residual,
)
from tests.models.test_generate import load, prompts


@pytest.mark.parametrize("name", ["gated_deltanet", "rwkv7_fused", "gdn_hybrid_gva"])
def test_steering_changes_the_continuation_and_cached_equals_uncached(name):
    model = load(name)
    rows = prompts((6, 10))
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for steer in ([Steering(1, vector, 3.0)], [Steering(0, vector, 3.0, hook="hook_resid_post", from_step=3)]):
        cached = generate(model, rows, 6, interventions=steer, output_logits=True)
        uncached = generate(model, rows, 6, interventions=steer, use_cache=False, output_logits=True)
        assert cached.tokens == uncached.tokens
        torch.testing.assert_close(cached.logits, uncached.logits, rtol=1e-7, atol=1e-6)
    clean = generate(model, rows, 6, output_logits=True)
    late = generate(model, rows, 6, interventions=[Steering(1, vector, 3.0, from_step=3)], output_logits=True)
    assert late.tokens != clean.tokens
    # steps before from_step are untouched
    torch.testing.assert_close(late.logits[:, :3], clean.logits[:, :3], rtol=0, atol=0)


def test_a_state_edit_at_decode_equals_the_same_edit_in_full_forwards():
    """Erasing head 1's state before generated token 0 (step 1): cached decoding equals full forwards whose
    hook_state chunk start at that token (prompt of one chunk, 64 tokens) is erased the same way."""
    model = load("gdp_nh2_all")
    rows = prompts((64, 64), seed=2)
    edit = StateEdit(0, 0.0, heads=[1], from_step=1, to_step=1)

    def by_hand(states, ctx):
        if states.shape[1] == 3:  # chunk starts 0 and 64, the final state
            states = states.clone()
            states[:, 1, 1] = 0.0
        return states

    cached = generate(model, rows, 6, interventions=[edit], output_logits=True)
    uncached = generate(model, rows, 6, interventions=[HookEdit("layers.0.attn.hook_state", by_hand)],
                        use_cache=False, output_logits=True)
    clean = generate(model, rows, 6, output_logits=True)
    torch.testing.assert_close(cached.logits, uncached.logits, rtol=1e-7, atol=1e-6)
    assert cached.tokens == uncached.tokens
    assert not torch.allclose(cached.logits[:, 1:], clean.logits[:, 1:], atol=1e-3)
    torch.testing.assert_close(cached.logits[:, 0], clean.logits[:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["kda_gva", "rwkv7_wide_v"])
def test_erasing_every_state_changes_the_continuation_and_scale_one_does_nothing(name):
    model = load(name)
    rows = prompts((12,), seed=5)
    layers = range(model.config.num_hidden_layers)
    clean = generate(model, rows, 8, output_logits=True)
    same = generate(model, rows, 8, interventions=[StateEdit(i, 1.0) for i in layers], output_logits=True)
    torch.testing.assert_close(same.logits, clean.logits, rtol=0, atol=1e-6)
    erased = generate(model, rows, 8, interventions=[StateEdit(i, 0.0) for i in layers], output_logits=True)
    assert not torch.allclose(erased.logits[:, 1:], clean.logits[:, 1:], atol=1e-3)


def test_a_hook_edit_from_a_step_on_acts_from_that_step():
    model = load("gated_deltanet")
    rows = prompts((7,), seed=3)

    def no_beta(beta, ctx):
        return torch.zeros_like(beta)

    clean = generate(model, rows, 6, output_logits=True)
    edit = HookEdit("layers.1.attn.hook_beta", no_beta, from_step=2)
    cached = generate(model, rows, 6, interventions=[edit], output_logits=True)
    torch.testing.assert_close(cached.logits[:, :2], clean.logits[:, :2], rtol=0, atol=0)
    assert not torch.allclose(cached.logits[:, 2:], clean.logits[:, 2:], atol=1e-4)


def test_difference_vector_and_vector_files(tmp_path):
    model = load("delta_net")
    a, b = torch.tensor(prompts((5,), seed=1)), torch.tensor(prompts((8,), seed=2))
    seen = generate(model, a, 1, record=["layers.1.hook_resid_pre"]).records["layers.1.hook_resid_pre"][0][1]
    torch.testing.assert_close(mean_residual(model, a, 1), seen.float().mean((0, 1)))
    v = difference_vector(model, a, b, 1)
    torch.testing.assert_close(v, mean_residual(model, a, 1) - mean_residual(model, b, 1))
    save_file({"direction": v}, str(tmp_path / "v.safetensors"))
    torch.testing.assert_close(load_vector(tmp_path / "v.safetensors"), v)
    save_file({"x": v.clone(), "y": v.clone()}, str(tmp_path / "two.safetensors"))
    assert torch.equal(load_vector(tmp_path / "two.safetensors", "y"), v)
    with pytest.raises(InterventionError, match="holds 2 tensors"):
        load_vector(tmp_path / "two.safetensors")
    with pytest.raises(InterventionError, match="does not exist"):
        load_vector(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(InterventionError, match="not a readable safetensors file"):
        load_vector(tmp_path / "bad.safetensors")


def test_interventions_that_do_not_fit_the_model_fail_in_one_line():
    model = load("delta_net")
    with pytest.raises(InterventionError, match=r"shape \(63,\); the model's residual stream needs \(64,\)"):
        generate(model, [[1, 2]], 2, interventions=[Steering(0, torch.zeros(63))])
    with pytest.raises(InterventionError, match="layer 5 does not exist: the model has layers 0..1"):
        generate(model, [[1, 2]], 2, interventions=[Steering(5, torch.zeros(64))])
    with pytest.raises(InterventionError, match="no hook point 'layers.0.attn.hook_nope'"):
        generate(model, [[1, 2]], 2, interventions=[HookEdit("layers.0.attn.hook_nope", lambda x, c: x)])


@pytest.mark.parametrize("name", ["gdp_nh3_conv", "rwkv7_fused"])
def test_editing_the_state_after_a_step_is_what_the_next_step_starts_from(name):
    model = load(name)

    def write_after(states, ctx):
        states = states.clone()
        states[:, -1] = 0.5
        return states

    edit = HookEdit("layers.0.attn.hook_state", write_after, from_step=2, to_step=2)
    out = generate(model, prompts((6,)), 4, interventions=[edit], record=["layers.0.attn.hook_state"])
    seen = dict(out.records["layers.0.attn.hook_state"])
    assert torch.all(seen[3][:, 0] == 0.5)
    assert not torch.all(seen[2][:, 0] == 0.5)
