"""Oracles for the Kimi Delta Attention families (Kimi Linear, Bailing hybrid, GLM5-Next): per-channel gates
g [B,T,H,dk]. Tiny random models saved with save_pretrained, opened as deltalab opens them.

(a) logits with deltalab's hooks equal the untouched transformers model's (its own torch KDA kernels), also
    with an attention mask and one cached decode step (the recurrent kernel's call);
(b) q, k, v, beta, g read through the hooks, fed to kernels.naive in float64, reproduce the transformers
    kernel's output and the cache's final state, and deltalab's own: bound 5e-6 relative; measured 2.2e-7 to
    2.4e-7 at the first linear layer (identical inputs in both models) and up to 2.8e-6 at the last (its inputs
    carry the float32 rounding of the layers below, which differs between the two kernels);
(c) beta = 0 on one head through hook_beta equals the same change made by hand inside the layer.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from nnsight import NNsight  # noqa: E402

from kernels.naive import l2_normalize, naive_delta_product  # noqa: E402
from models import load_checkpoint  # noqa: E402
from models.hf.adapter import DeltaRuleHooks  # noqa: E402
from tests.models.hf_tiny import original_kernels  # noqa: E402
from tests.models.kda_tiny import (  # noqa: E402
    KDA_DIM,
    KDA_FAMILIES,
    KDA_HEADS,
    KDA_LINEAR,
    KDA_NAMES,
    KDA_VOCAB,
    load_untouched,
    save_kda,
)
from tests.models.oracles import beta_zero_in_transformers, beta_zero_through_hook, fro  # noqa: E402

T = 70


@pytest.fixture(scope="module", params=KDA_FAMILIES)
def folder(request, tmp_path_factory):
    return save_kda(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hooked(folder):
    return load_checkpoint(folder)


@pytest.fixture
def untouched(folder, hooked):
    return load_untouched(folder, hooked.family.model_type), importlib.import_module(hooked.family.module)


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, KDA_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))



def test_layout(hooked):
    c = hooked.config
    assert c.gate == "channel" and c.delta_layers == list(KDA_LINEAR)
    assert (c.num_key_heads, c.num_heads, c.head_k_dim, c.head_v_dim) == (KDA_HEADS, KDA_HEADS, KDA_DIM, KDA_DIM)
    for i in range(4):
        assert hasattr(hooked.layers[i], "attn") == (i in KDA_LINEAR)
    assert "Kimi Delta Attention [0, 1, 3]" in hooked.summary()


def test_a_logits_equal_untouched(hooked, untouched):
    model, module = untouched
    x, nxt = ids(), ids(2, 1, seed=2)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        with original_kernels(module, names=KDA_NAMES) as calls:
            ref = model(x).logits
            ref_out = model(x, attention_mask=mask, use_cache=True)
            ref_step = model(nxt, attention_mask=mask2, past_key_values=ref_out.past_key_values, use_cache=True)
        assert len(calls) == 2 * len(KDA_LINEAR)
        nn = NNsight(hooked)
        with nn.trace(x):
            g_last = nn.layers[KDA_LINEAR[-1]].attn.hook_g.output.save()
            traced = nn.output.save()
        assert g_last.shape == (2, T, KDA_HEADS, KDA_DIM) and float(g_last.max()) <= 0  # per-channel log decays
        assert fro(traced.logits, ref) < 1e-5 and fro(hooked(x).logits, ref) < 1e-5
        got_out = hooked(x, attention_mask=mask, use_cache=True)
        assert fro(got_out.logits[mask.bool()], ref_out.logits[mask.bool()]) < 1e-5
        got_step = hooked(nxt, attention_mask=mask2, past_key_values=got_out.past_key_values, use_cache=True)
        assert fro(got_step.logits, ref_step.logits) < 1e-5


def test_b_naive_float64_reproduces_kernel_and_cache(hooked, untouched):
    model, module = untouched
    x = ids()
    with torch.no_grad(), original_kernels(module, names=KDA_NAMES) as calls:
        ref = model(x, use_cache=True)
    names = ("q", "k", "v", "beta", "g", "state", "o")
    saved = {}
    nn = NNsight(hooked)
    with torch.no_grad(), nn.trace(x, use_cache=True):
        for i in KDA_LINEAR:
            for n in names:
                saved[i, n] = getattr(nn.layers[i].attn, f"hook_{n}").output.save()
        out = nn.output.save()
    first = calls[0][2]
    torch.testing.assert_close(saved[KDA_LINEAR[0], "q"], l2_normalize(first["query"].float()), rtol=0, atol=1e-7)
    assert torch.equal(saved[KDA_LINEAR[0], "g"], first["g"].float())  # the per-channel gate, bit for bit
    for (o_ref, _, _), i in zip(calls, KDA_LINEAR, strict=True):
        q, k, v, beta, g, states, o_hooked = (saved[i, n] for n in names)
        assert g.shape == (2, T, KDA_HEADS, KDA_DIM) and states.shape == (2, 3, KDA_HEADS, KDA_DIM, KDA_DIM)
        o, final, bounds = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double(),
                                               scale=KDA_DIM**-0.5)
        cache_ref = ref.past_key_values.layers[i].recurrent_states[0]
        cache = out.past_key_values.layers[i].recurrent_states[0]
        errors = [fro(o, o_ref), fro(final, cache_ref), fro(o, o_hooked), fro(final, cache), fro(bounds, states)]
        assert max(errors) < 5e-6, errors
        # decaying along dv instead of dk is measurably wrong: the oracle can tell the two apart
        wrong = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double().mean(-1),
                                    scale=KDA_DIM**-0.5)[0]
        assert fro(wrong, o_ref) > 1e-3


@pytest.mark.parametrize("layer, head", [(1, 1)])
def test_c_beta_zero_through_hook_equals_by_hand(hooked, untouched, layer, head):
    model, module = untouched
    x = ids()
    base, by_hand = beta_zero_in_transformers(model, module, x, KDA_LINEAR.index(layer), head, KDA_NAMES)
    assert fro(by_hand, base) > 1e-4
    assert fro(beta_zero_through_hook(hooked, x, layer, head), by_hand) < 1e-5


def test_gate_of_the_wrong_kind_names_the_tensor():
    adapter = DeltaRuleHooks(3, 2, 2, 8, 8, channel_gate=True)
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"^layer 3: gate g has shape \(1, 5, 2\), the config's per-channel") as e:
        adapter(q, k, v, torch.randn(1, 5, 2), torch.rand(1, 5, 2))
    assert "\n" not in str(e.value)
    scalar = DeltaRuleHooks(0, 2, 2, 8, 8)
    with pytest.raises(ValueError, match=r"gate g has shape \(1, 5, 2, 8\), the config's scalar \[B,T,H\] gate"):
        scalar(q, k, v, torch.randn(1, 5, 2, 8), torch.rand(1, 5, 2))
