"""nnsight reads and overwrites the hook points, and the recurrence explains what overwriting does."""

from __future__ import annotations

import pytest
import torch
from nnsight import NNsight

from deltalab.kernels import naive_delta_product
from deltalab.models import DeltaProductForCausalLM, ModelConfig

HOOKS = ["hook_q", "hook_k", "hook_v", "hook_beta", "hook_g", "hook_state", "hook_o"]


@pytest.fixture
def model():
    cfg = ModelConfig(model_type="gated_deltaproduct", vocab_size=20, hidden_size=48, num_hidden_layers=2,
                      num_heads=3, head_dim=16, expand_v=1.0, num_householder=2, use_forget_gate=True,
                      allow_neg_eigval=True)
    return DeltaProductForCausalLM(cfg).eval()


def test_hook_names_are_greppable(model):
    names = {n for n, _ in model.named_modules()}
    for i in range(2):
        for hook in HOOKS:
            assert f"layers.{i}.attn.{hook}" in names
        for hook in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post"):
            assert f"layers.{i}.{hook}" in names


def test_nnsight_reads_hook_shapes(model):
    ids = torch.randint(0, 20, (2, 70))
    nm = NNsight(model)
    with torch.no_grad(), nm.trace(ids):
        k = nm.layers[1].attn.hook_k.output.save()  # nnsight reads hooks in execution order
        beta = nm.layers[1].attn.hook_beta.output.save()
        g = nm.layers[1].attn.hook_g.output.save()
        state = nm.layers[1].attn.hook_state.output.save()
    assert beta.shape == (2, 70, 2, 3) and 0 <= beta.min() and beta.max() <= 2
    assert k.shape == (2, 70, 2, 3, 16)
    assert torch.allclose(k.norm(dim=-1), torch.ones(()), atol=1e-3)  # keys are L2-normalised
    assert state.shape == (2, 3, 3, 16, 16)  # chunk starts at 0 and 64, plus the final state
    assert g.shape == (2, 70, 3) and g.max() <= 0


def test_overwriting_beta_follows_the_recurrence(model):
    """Zeroing one step's beta of one head: hook_o equals the reference recurrence on the edited betas."""
    ids = torch.randint(0, 20, (1, 80))
    nm = NNsight(model)
    attn = nm.layers[0].attn
    with torch.no_grad(), nm.trace(ids):
        q, k, v = attn.hook_q.output.save(), attn.hook_k.output.save(), attn.hook_v.output.save()
        beta, g = attn.hook_beta.output.save(), attn.hook_g.output.save()
        o_clean = attn.hook_o.output.save()
        logits_clean = nm.output.logits.save()
    with torch.no_grad(), nm.trace(ids):
        edited = attn.hook_beta.output.clone()
        edited[:, :, 1, 2] = 0.0  # step 2 of head 2 no longer writes or erases
        attn.hook_beta.output = edited
        o_edit = attn.hook_o.output.save()
        logits_edit = nm.output.logits.save()
    want_beta = beta.clone()
    want_beta[:, :, 1, 2] = 0.0
    want, _, _ = naive_delta_product(*(x.double() for x in (q, k, v, want_beta, g)))
    assert torch.allclose(o_edit.double(), want, atol=1e-5)
    assert torch.allclose(o_edit[..., :2, :], o_clean[..., :2, :])  # other heads are untouched
    assert not torch.allclose(o_edit[..., 2, :], o_clean[..., 2, :], atol=1e-3)
    assert not torch.allclose(logits_edit, logits_clean, atol=1e-4)


EDITABLE = [f"attn.{h}" for h in HOOKS] + ["hook_resid_pre", "hook_resid_mid", "hook_resid_post"]


def _envoy(nm, path: str):
    """`layers.0.<path>` of an nnsight-wrapped model."""
    node = nm.layers[0]
    for part in path.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("hook", EDITABLE)
def test_overwriting_any_hook_changes_the_model(model, hook):
    """Every hook point's output is what the model goes on with: zeroing it changes the logits."""
    ids = torch.randint(0, 20, (1, 80))
    nm = NNsight(model)
    with torch.no_grad():
        clean = model(ids).logits
    with torch.no_grad(), nm.trace(ids):
        point = _envoy(nm, hook)
        point.output = torch.zeros_like(point.output)
        edited = nm.output.logits.save()
    assert not torch.allclose(edited, clean, atol=1e-4), f"overwriting layers.0.{hook} had no effect"


def _clean_run(nm, ids):
    attn = nm.layers[0].attn
    with torch.no_grad(), nm.trace(ids):
        q, k, v = attn.hook_q.output.save(), attn.hook_k.output.save(), attn.hook_v.output.save()
        beta, g = attn.hook_beta.output.save(), attn.hook_g.output.save()
        state, o = attn.hook_state.output.save(), attn.hook_o.output.save()
        logits = nm.output.logits.save()
    return (q, k, v, beta, g, state, o), logits


def _replayed(q, k, v, beta, g, o_clean, start: torch.Tensor, chunk: int) -> torch.Tensor:
    """float64 reference: clean outputs before chunk `chunk`, then the recurrence from state `start` onward."""
    t0 = 64 * chunk
    tail, _, _ = naive_delta_product(*(x[:, t0:].double() for x in (q, k, v, beta, g)),
                                     initial_state=start.double())
    return torch.cat([o_clean[:, :t0].double(), tail], 1)


@pytest.mark.parametrize("how", ["zero in place", "scale by assignment"])
def test_overwriting_state_restarts_the_recurrence_from_it(model, how):
    """Editing the state at the start of chunk 1 (tokens 64..127) of sequence 0: that sequence's outputs from
    token 64 on are the recurrence run from the edited state; its earlier outputs and sequence 1 are untouched."""
    ids = torch.randint(0, 20, (2, 150))  # chunk starts 0, 64, 128, then the final state
    nm = NNsight(model)
    attn = nm.layers[0].attn
    (q, k, v, beta, g, state, o_clean), logits_clean = _clean_run(nm, ids)
    with torch.no_grad(), nm.trace(ids):
        if how == "zero in place":
            attn.hook_state.output[0, 1] = 0.0
        else:
            edited = attn.hook_state.output.clone()
            edited[0, 1] *= 0.5
            attn.hook_state.output = edited
        o_edit = attn.hook_o.output.save()
        logits_edit = nm.output.logits.save()
    start = state[0:1, 1] * (0.0 if how == "zero in place" else 0.5)
    want = _replayed(*(x[0:1] for x in (q, k, v, beta, g, o_clean)), start, chunk=1)
    assert torch.allclose(o_edit[0:1].double(), want, atol=1e-5)
    assert torch.equal(o_edit[0, :64], o_clean[0, :64]) and torch.equal(o_edit[1], o_clean[1])
    assert (o_edit[0, 128:] - o_clean[0, 128:]).abs().max() > 1e-4  # the edit carries into chunk 2 (float noise ~1e-7)
    assert torch.equal(logits_edit[1], logits_clean[1])
    assert not torch.allclose(logits_edit[0, 64:], logits_clean[0, 64:], atol=1e-4)


def test_overwriting_two_chunk_starts_patches_each(model):
    """Zeroing chunk 1 and scaling chunk 2 of one head: the replay takes chunk 2's patch, not the carried state."""
    ids = torch.randint(0, 20, (1, 150))
    nm = NNsight(model)
    attn = nm.layers[0].attn
    (q, k, v, beta, g, state, o_clean), _ = _clean_run(nm, ids)
    with torch.no_grad(), nm.trace(ids):
        attn.hook_state.output[:, 1] = 0.0
        attn.hook_state.output[:, 2, 1] *= 2.0  # head 1 only
        o_edit = attn.hook_o.output.save()
    from_1 = _replayed(q, k, v, beta, g, o_clean, torch.zeros_like(state[:, 1]), chunk=1)
    _, _, carried = naive_delta_product(*(x[:, 64:128].double() for x in (q, k, v, beta, g)),
                                        initial_state=torch.zeros_like(state[:, 1]).double())
    start_2 = carried[:, -1].clone()
    start_2[:, 1] = 2.0 * state[:, 2, 1].double()
    tail, _, _ = naive_delta_product(*(x[:, 128:].double() for x in (q, k, v, beta, g)), initial_state=start_2)
    want = torch.cat([from_1[:, :128], tail], 1)
    assert torch.allclose(o_edit.double(), want, atol=1e-5)


def test_reading_hooks_or_editing_the_final_state_changes_nothing(model):
    """The no-intervention path is the plain forward, bit for bit; the final state feeds no output."""
    ids = torch.randint(0, 20, (2, 150))
    nm = NNsight(model)
    with torch.no_grad():
        plain = model(ids).logits
    _, logits_read = _clean_run(nm, ids)
    with torch.no_grad(), nm.trace(ids):
        nm.layers[0].attn.hook_state.output[:, -1] = 0.0
        logits_final = nm.output.logits.save()
    assert torch.equal(logits_read, plain) and torch.equal(logits_final, plain)


def test_overwriting_state_with_another_shape_is_refused(model):
    ids = torch.randint(0, 20, (1, 70))
    nm = NNsight(model)
    with pytest.raises(Exception, match="hook_state must keep its shape"), torch.no_grad(), nm.trace(ids):
        nm.layers[0].attn.hook_state.output = nm.layers[0].attn.hook_state.output[:, :1]
