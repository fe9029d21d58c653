"""nnsight reads and overwrites the hook points, and the recurrence explains what overwriting does."""

from __future__ import annotations

import pytest
import torch
from nnsight import NNsight

from kernels import naive_delta_product
from models import DeltaProductForCausalLM, ModelConfig

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
