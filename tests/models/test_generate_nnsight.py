"""nnsight traces generation: `model.generate` as the traced function, `tracer.iter` to each step's hooks."""

from __future__ import annotations

import pytest
import torch
from nnsight import NNsight

from deltalab.models.generate import generate
from deltalab.models.interventions import Steering
from tests.models.test_generate import load


@pytest.mark.parametrize("name", ["gated_deltanet", "rwkv7_fused"])
def test_nnsight_reads_and_steers_every_step(name):
    model = load(name)
    nm = NNsight(model)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    assert nm.generate(ids, 4).tokens == generate(model, ids, 4).tokens  # a plain call generates
    with torch.no_grad(), nm.trace(ids, fn=model.generate, max_new_tokens=4) as tracer:
        shapes = list().save()
        for _ in tracer.iter[0:4]:
            shapes.append(tuple(nm.layers[0].attn.hook_k.output.shape))
    assert [s[1] for s in shapes] == [5, 1, 1, 1]
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 10
    with torch.no_grad(), nm.trace(ids, fn=model.generate, max_new_tokens=4) as tracer:
        for _ in tracer.iter[0:4]:
            nm.layers[1].hook_resid_pre.output = nm.layers[1].hook_resid_pre.output + vector
        out = tracer.result.save()
    assert out.tokens == generate(model, ids, 4, interventions=[Steering(1, vector)]).tokens
    assert out.tokens != generate(model, ids, 4).tokens


@pytest.mark.parametrize("name", ["gdp_nh2_all", "rwkv7_wide_v"])
def test_an_in_place_state_edit_through_nnsight_equals_the_state_edit(name):
    """`hook_state.output[:, 0] = 0` at one decode step (an in-place write) erases that state and the cache carries
    the erased dynamics on, as StateEdit does."""
    from deltalab.models.interventions import StateEdit

    model = load(name)
    nm = NNsight(model)
    ids = torch.tensor([[2, 9, 4, 7, 1, 3]])
    with torch.no_grad(), nm.trace(ids, fn=model.generate, max_new_tokens=6, output_logits=True) as tracer:
        for step in tracer.iter[0:6]:
            if step == 2:
                nm.layers[0].attn.hook_state.output[:, 0] = 0.0
        out = tracer.result.save()
    want = generate(model, ids, 6, interventions=[StateEdit(0, 0.0, from_step=2, to_step=2)], output_logits=True)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=1e-6)
    assert not torch.allclose(out.logits[:, 3:], generate(model, ids, 6, output_logits=True).logits[:, 3:])
