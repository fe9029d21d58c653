"""Oracles for the Kimi Delta Attention families (Kimi Linear, Bailing hybrid, GLM5-Next): per-channel gates
g [B,T,H,dk]. Tiny random models saved with save_pretrained, opened as deltalab opens them.

(a) logits with deltalab's hooks equal the untouched transformers model's (its own torch KDA kernels), also
    with an attention mask and one cached decode step (the recurrent kernel's call);
(b) q, k, v, beta, g read through the hooks, fed to kernels.delta_rule.naive in float64, reproduce deltalab's kernel
    output, states and cache, and the transformers kernel's inputs reproduce its output and cache, each to 1e-6
    relative (measured 1.0-2.7e-7 for both). Each side is checked on its own inputs: across the two runs the
    later layers' inputs carry different float32 rounding of the layers below (2.8e-6 apart at the last);
(c) beta = 0 on one head through hook_beta equals the same change made by hand inside the layer.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from nnsight import NNsight  # noqa: E402

from deltalab.kernels.delta_rule.naive import l2_normalize, naive_delta_product  # noqa: E402
from deltalab.models import load_checkpoint  # noqa: E402
from deltalab.models.hf.adapter import DeltaRuleHooks  # noqa: E402
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
OURS = 1e-6  # deltalab's float32 kernel against the float64 recurrence on the captured inputs (the float32 bound)
THEIRS = 1e-6  # transformers' float32 torch KDA kernel against it, on its own inputs


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
    for (o_ref, _, inputs), i in zip(calls, KDA_LINEAR, strict=True):
        q, k, v, beta, g, states, o_hooked = (saved[i, n] for n in names)
        assert g.shape == (2, T, KDA_HEADS, KDA_DIM) and states.shape == (2, 3, KDA_HEADS, KDA_DIM, KDA_DIM)
        o, final, bounds = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double(),
                                               scale=KDA_DIM**-0.5)
        cache = out.past_key_values.layers[i].recurrent_states[0]
        ours = [fro(o, o_hooked), fro(final, cache), fro(bounds, states)]
        assert max(ours) < OURS, ours
        # the untouched model's kernel on its own inputs (the same as ours at the first layer)
        t_q, t_k = (l2_normalize(inputs[n].double()) for n in ("query", "key"))
        t_o, t_final, _ = naive_delta_product(t_q, t_k[:, :, None], inputs["value"].double()[:, :, None],
                                              inputs["beta"].double()[:, :, None], inputs["g"].double(),
                                              scale=KDA_DIM**-0.5)
        cache_ref = ref.past_key_values.layers[i].recurrent_states[0]
        theirs = [fro(t_o, o_ref), fro(t_final, cache_ref)]
        assert max(theirs) < THEIRS, theirs
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
