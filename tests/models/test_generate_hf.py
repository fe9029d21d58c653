"""Generation of transformers Gated DeltaNet hybrids through deltalab's hooks: transformers' own cached generate
gives the tokens of uncached greedy decoding, and deltalab's `generate` (interventions, records) runs on it."""

from __future__ import annotations

import pytest
import torch

from deltalab.models import load_checkpoint
from deltalab.models.generate import generate
from deltalab.models.interventions import StateEdit, Steering
from tests.models.hf_tiny import VOCAB, save_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_next", "olmo_hybrid"])
def model(request, tmp_path_factory):
    folder = save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=3)
    return load_checkpoint(folder, dtype=torch.float32)


def greedy_by_hand(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Uncached greedy decoding: a full forward over the whole sequence for every new token."""
    for _ in range(n):
        with torch.no_grad():
            logits = model(ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids


def test_transformers_cached_generate_through_the_hooks_equals_uncached_greedy(model):
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    fired = []
    hook = model.layers[0].attn.hook_state.register_forward_hook(lambda _m, _a, out: fired.append(out.shape))
    try:
        out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
    finally:
        hook.remove()
    assert torch.equal(out, greedy_by_hand(model, ids, 8))
    assert len(fired) == 8 and all(s[1] == 2 for s in fired[1:])  # prompt, then one-token steps (before, after)


def test_deltalab_generate_on_a_transformers_model(model):
    rows = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    out = generate(model, rows, 6, record=["layers.0.attn.hook_k"])
    for r, row in enumerate(rows):
        alone = greedy_by_hand(model, torch.tensor([row]), 6)[0, len(row):].tolist()
        assert out.tokens[r] == alone
    assert [s for s, _ in out.records["layers.0.attn.hook_k"]] == list(range(6))
    assert out.records["layers.0.attn.hook_k"][1][1].shape[1] == 1
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 20
    steered = generate(model, rows, 6, interventions=[Steering(1, vector)])
    assert steered.tokens != out.tokens
    erased = generate(model, rows, 6, interventions=[StateEdit(i, 0.0) for i in (0, 1, 3)], output_logits=True)
    clean = generate(model, rows, 6, output_logits=True)
    torch.testing.assert_close(erased.logits[:, 0], clean.logits[:, 0])
    assert not torch.allclose(erased.logits[:, 1:], clean.logits[:, 1:], atol=1e-4)


def test_a_decode_time_state_edit_is_carried_by_transformers_cache(model):
    """Erasing layer 0's state once, before generated token 0: transformers' cached decoding equals its uncached
    decoding with the same state erased at the chunk start of that token (a prompt of one 64-token chunk)."""
    from deltalab.models.interventions import HookEdit

    rows = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(7)).tolist()

    def by_hand(states, ctx):
        if states.shape[1] == 3:  # chunk starts 0 and 64, then the final state
            states = states.clone()
            states[:, 1] = 0.0
        return states

    once = StateEdit(0, 0.0, from_step=1, to_step=1)
    cached = generate(model, rows, 5, interventions=[once], output_logits=True)
    uncached = generate(model, rows, 5, interventions=[HookEdit("layers.0.attn.hook_state", by_hand)],
                        use_cache=False, output_logits=True)
    clean = generate(model, rows, 5, output_logits=True)
    torch.testing.assert_close(cached.logits, uncached.logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cached.logits[:, 2:], clean.logits[:, 2:], atol=1e-4)
