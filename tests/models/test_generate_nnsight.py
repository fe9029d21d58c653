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
