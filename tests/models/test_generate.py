"""Cached decoding equals full-sequence forwards on every fla-format family; batches, sampling, stops, hooks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltalab.models import load_checkpoint
from deltalab.models.generate import GenerationError, generate

FIXTURES = Path(__file__).parents[1] / "fixtures" / "fla"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
TOL = 1e-6  # float64 models keep beta and the gates in float32 (as fla): float32 roundings apart, ~1e-7
RTOL = 1e-7  # (relative, for logits of size ~50)


def load(name: str, dtype=torch.float64):
    return load_checkpoint(FIXTURES / name, dtype=dtype)


def prompts(lengths, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_decoding_equals_full_forward(name):
    """Every step's logits equal a full forward over prompt + generated tokens; greedy picks their argmax."""
    model = load(name)
    rows = prompts((7, 3, 7))
    out = generate(model, rows, 6, output_logits=True)
    for r, seq in enumerate(out.sequences):
        with torch.no_grad():
            full = model(torch.tensor([seq])).logits[0]
        P = len(rows[r])
        want = full[P - 1 : P - 1 + 6]
        torch.testing.assert_close(out.logits[r].double(), want, rtol=RTOL, atol=TOL)
        assert out.tokens[r] == want.argmax(-1).tolist()


@pytest.mark.parametrize("name", ["gdn_hybrid_gva", "rwkv7_fused", "kda_gva", "gdp_nh3_conv"])
def test_cached_equals_uncached_and_float32(name):
    model = load(name, torch.float32)
    rows = prompts((5, 9))
    cached = generate(model, rows, 8, output_logits=True)
    uncached = generate(model, rows, 8, output_logits=True, use_cache=False)
    assert cached.tokens == uncached.tokens
    torch.testing.assert_close(cached.logits, uncached.logits, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["gdn_hybrid_gva", "rwkv7_wide_v"])
def test_batched_prompts_of_different_lengths_equal_one_at_a_time(name):
    model = load(name)
    rows = prompts((4, 11, 1, 11))
    batched = generate(model, rows, 5, output_logits=True)
    for r, row in enumerate(rows):
        alone = generate(model, [row], 5, output_logits=True)
        assert alone.tokens[0] == batched.tokens[r]
        torch.testing.assert_close(alone.logits[0], batched.logits[r], rtol=0, atol=TOL)
    # the same prompts left-padded into one tensor with an attention mask
    ids = torch.zeros(4, 11, dtype=torch.long)
    mask = torch.zeros(4, 11, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, 11 - len(row):], mask[r, 11 - len(row):] = torch.tensor(row), 1
    assert generate(model, ids, 5, attention_mask=mask).tokens == batched.tokens


def test_sampling_is_seeded_and_its_filters_reduce_to_greedy():
    model = load("gated_deltanet")
    rows = prompts((6, 6))
    greedy = generate(model, rows, 10).tokens
    a = generate(model, rows, 10, do_sample=True, temperature=2.0, seed=1).tokens
    assert a == generate(model, rows, 10, do_sample=True, temperature=2.0, seed=1).tokens
    assert a != generate(model, rows, 10, do_sample=True, temperature=2.0, seed=2).tokens
    assert a != greedy
    assert generate(model, rows, 10, do_sample=True, top_k=1, seed=3).tokens == greedy
    assert generate(model, rows, 10, do_sample=True, top_p=1e-6, seed=3).tokens == greedy
    assert generate(model, rows, 10, do_sample=True, temperature=0.0, seed=3).tokens == greedy


def test_top_k_samples_only_the_k_most_likely():
    from deltalab.models.generate import choose

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    top = logits.topk(5, -1).indices
    for s in range(20):
        picked = choose(logits, True, 3.0, 5, None, torch.Generator().manual_seed(s))
        assert (top == picked[:, None]).any(-1).all()


def test_stop_tokens_end_each_row_on_its_own():
    model = load("delta_net")
    rows = prompts((5, 8), seed=4)
    free = generate(model, rows, 8)
    stop = free.tokens[0][2]
    first = free.tokens[0].index(stop)
    out = generate(model, rows, 8, stop_tokens=[stop])
    assert out.tokens[0] == free.tokens[0][: first + 1] and out.stopped[0]
    if stop not in free.tokens[1]:
        assert out.tokens[1] == free.tokens[1] and not out.stopped[1]


ATTN_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_g", "hook_state", "hook_o")


@pytest.mark.parametrize("name", ["gdp_nh3_gate", "rwkv7_fused", "gdn_hybrid_gva"])
def test_hooks_fire_at_every_step_with_full_forward_shapes(name):
    """Each hook fires once per step; a decode step's value is the full forward's at T = 1, and hook_state's
    entry 0 is the state before the token: the full forward's final state over the tokens before it."""
    model = load(name)
    layer = model.config.delta_layers[0] if hasattr(model.config, "delta_layers") else 0
    names = [f"layers.{layer}.attn.{h}" for h in ATTN_HOOKS if h != "hook_g" or name != "delta_net"]
    names += [f"layers.{layer}.{h}" for h in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")]
    rows, N = prompts((9,)), 4
    out = generate(model, rows, N, record=names)
    seq = out.sequences[0]
    for hook in names:
        steps = [s for s, _ in out.records[hook]]
        assert steps == list(range(N)), hook
        full = generate(model, [seq[:-1]], 1, record=[hook]).records[hook][0][1]
        for s, value in out.records[hook][1:]:
            if hook.endswith("hook_state"):
                assert value.shape == (1, 2, *full.shape[2:])
                before = generate(model, [seq[: 9 + s - 1]], 1, record=[hook]).records[hook][0][1][:, -1]
                torch.testing.assert_close(value[:, 0], before, rtol=0, atol=TOL)
            else:
                assert value.shape == (1, 1, *full.shape[2:]), hook
                torch.testing.assert_close(value[:, 0].double(), full[:, 9 + s - 1].double(), rtol=0, atol=TOL)


def test_bad_requests_give_one_line_errors():
    model = load("delta_net")
    for bad, message in ((0, "max_new_tokens must be a positive integer"), (-3, "positive integer")):
        with pytest.raises(GenerationError, match=message):
            generate(model, [[1, 2]], bad)
    with pytest.raises(GenerationError, match="token id 64 outside the vocabulary 0..63"):
        generate(model, [[1, 64]], 2)
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        generate(model, [[1], []], 2)
    model.config.max_position_embeddings = 10
    with pytest.raises(GenerationError, match="max_position_embeddings=10"):
        generate(model, [list(range(8))], 5)
    with pytest.raises(GenerationError, match="top_p"):
        generate(model, [[1]], 2, do_sample=True, top_p=0.0)


def test_softmax_layer_hooks_at_decode_equal_the_full_forward():
    """A hybrid's softmax layers (full, and windowed on layer 3) read their KV cache: q, k (rotated at the token's
    own position), v and z of each step equal the full forward's at that position."""
    model = load("gdn_hybrid_gva")
    names = [f"layers.{i}.attn.hook_{h}" for i in (1, 3) for h in ("q", "k", "v", "z")]
    rows = [prompts((40,))[0], prompts((29,), seed=1)[0]]  # longer than layer 3's 32-token window
    out = generate(model, rows, 6, record=names)
    for r, seq in enumerate(out.sequences):
        alone = generate(model, [seq[:-1]], 1, record=names)
        P = len(rows[r])
        for hook in names:
            full = alone.records[hook][0][1][0]
            decode = [(s, value) for s, value in out.records[hook] if s >= 1]  # step 0: one record per prefill group
            assert [s for s, _ in decode] == list(range(1, 6))
            for s, value in decode:
                torch.testing.assert_close(value[r, 0].double(), full[P + s - 1].double(), rtol=0, atol=TOL)
