"""Patching the transformers hybrids through the same hook names: clean values reproduce the clean run, batched
patches equal lone ones, and a state patch mid-chunk equals the float64 recurrence restarted from it."""

from __future__ import annotations

import pytest
import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.models import load_checkpoint
from deltalab.probes.patching import HOOKS, ActPatch, PatchingError, Run, StatePatch, patched_logits, state_patching
from deltalab.probes.patching.runs import layer_scale
from tests.models.hf_tiny import VOCAB, save_tiny


@pytest.fixture(scope="module", params=["olmo_hybrid", "qwen3_next"])
def hf_model(request, tmp_path_factory):
    folder = save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")
    return load_checkpoint(folder)


def _pair(T: int, flip: int):
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(3, VOCAB, (T,), generator=gen)
    corrupted = clean.clone()
    corrupted[flip] = 3 + (clean[flip] - 3 + 5) % (VOCAB - 3)
    return clean, corrupted


def test_clean_values_everywhere_reproduce_the_clean_run_and_batches_equal_lone_runs(hf_model):
    clean, corrupted = _pair(20, flip=4)
    source = Run.record(hf_model, clean)
    every = [ActPatch(h, layer) for layer in range(len(hf_model.layers)) for h in HOOKS if (h, layer) in source.cache]
    rows = [[ActPatch("o", 1, 3, 6)], [ActPatch("resid_pre", 3, None, 4)], [ActPatch("beta", 0, 2, None)]]
    states = [[], [StatePatch(1, 2, 9)], [StatePatch(3, 0, 5)]]
    with torch.no_grad():
        assert torch.equal(patched_logits(hf_model, corrupted, source, [every])[0], source.logits)
        batched = patched_logits(hf_model, corrupted, source, rows, states)
        for r in range(len(rows)):
            alone = patched_logits(hf_model, corrupted, source, [rows[r]], [states[r]])[0]
            torch.testing.assert_close(batched[r], alone, rtol=1e-5, atol=1e-5)


def test_state_patch_mid_chunk_restarts_the_recurrence(hf_model):
    # float64 where the model runs in it (Qwen3-Next's MoE grouped matmul has no float64: float32 tolerances)
    exact = "Qwen3Next" not in type(hf_model.hf).__name__
    model = hf_model.double() if exact else hf_model
    tol = dict(rtol=1e-10, atol=1e-10) if exact else dict(rtol=1e-4, atol=1e-5)
    try:
        clean, corrupted = _pair(90, flip=2)
        source, base = Run.record(model, clean), Run.record(model, corrupted)
        layer, head, token = 1, 3, 70
        got = {}

        def keep(o):
            got["o"] = o.clone()
            return o
        with torch.no_grad():
            patched_logits(model, corrupted, source, [[]], [[StatePatch(layer, head, token)]],
                           extra={("o", layer): keep})

        def inputs(run, sl):
            c = run.cache
            return [c[n, layer][:, sl].double() for n in ("q", "k", "v", "beta", "g")]
        scale = layer_scale(model, layer)
        _, S, _ = naive_delta_product(*inputs(source, slice(0, token + 1)), scale=scale)
        rest, _, _ = naive_delta_product(*inputs(base, slice(token + 1, None)), scale=scale, initial_state=S)
        group = model.config.num_heads // model.config.num_key_heads
        q_t = base.cache["q", layer][0, token, head // group].double()
        torch.testing.assert_close(got["o"][0, token, head].double(), scale * S[0, head].T @ q_t, **tol)
        torch.testing.assert_close(got["o"][0, token + 1:, head].double(), rest[0, :, head], **tol)
    finally:
        model.float()


def test_a_softmax_attention_layer_has_no_state_to_patch(hf_model):
    clean, corrupted = _pair(10, flip=2)
    with pytest.raises(PatchingError, match="layer 2 is a softmax attention layer without a delta-rule state"):
        state_patching(hf_model, clean, corrupted, "kl", layers=[2])
