"""Oracles for the transformers Gated DeltaNet families (OLMo-Hybrid, Qwen3-Next, Qwen3.5, Qwen3.5-MoE,
Qwen4-Exp): tiny random models saved with save_pretrained, opened as deltalab opens them.

(a) logits with deltalab's hooks attached equal the untouched transformers model's (kernel rounding);
(b) q, k, v, beta, g read through the hooks, fed to kernels.delta_rule.naive in float64, reproduce deltalab's kernel
    output, states and cache to OURS (1e-6), and the layer's own transformers kernel output and the cache's
    final state to THEIRS (the captured inputs themselves are exact);
(c) beta = 0 on one head through hook_beta equals the same change made by hand inside the layer.

Bounds. The tiny random models decay hard (log decays down to -67 per token), where transformers' float32
kernel takes decays as differences of running totals: measured 4-6e-6 from the float64 recurrence per layer on
identical inputs (o; final states 1.5-3.3e-6), while deltalab's chunked form, which sums each decay from the
gates it spans, is 7e-8 to 1e-7 from it. Through the model this gives transformers' own float32 logits 1.5e-5
from its float64 run (Qwen3.5), and the two float32 runs up to 3.2e-5 apart: THEIRS and LOGITS allow for it.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

pytest.importorskip("transformers")

from nnsight import NNsight  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from deltalab.kernels.delta_rule.naive import l2_normalize, naive_delta_product  # noqa: E402
from deltalab.models import load_checkpoint  # noqa: E402
from deltalab.models.hf import FAMILIES as SUPPORTED  # noqa: E402
from deltalab.models.hf import HookedHFModel  # noqa: E402
from tests.models.hf_tiny import (  # noqa: E402
    FAMILIES,
    LINEAR_LAYERS,
    NUM_K_HEADS,
    NUM_V_HEADS,
    VOCAB,
    build,
    original_kernels,
    save_tiny,
)
from tests.models.oracles import beta_zero_in_transformers, beta_zero_through_hook, fro  # noqa: E402

T = 70  # crosses one 64-token chunk boundary
OURS = 1e-6  # deltalab's float32 kernel against the float64 recurrence on the same inputs
THEIRS = 1e-5  # transformers' float32 kernel against it, on its own inputs (measured 4-6e-6)
LOGITS = 1e-4  # two float32 runs of the model, each ~1.5e-5 from float64 (see the module docstring)


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hooked(folder) -> HookedHFModel:
    return load_checkpoint(folder)


@pytest.fixture
def untouched(folder, hooked):
    """The transformers model alone (loaded without deltalab), and its family's modeling module."""
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()
    return model, importlib.import_module(hooked.family.module)


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))



def test_layout(hooked):
    c = hooked.config
    assert c.delta_layers == list(LINEAR_LAYERS) and (c.num_key_heads, c.num_heads) == (NUM_K_HEADS, NUM_V_HEADS)
    assert c.key_head_of == [0, 0, 1, 1]
    for i in range(4):
        assert hasattr(hooked.layers[i], "attn") == (i in LINEAR_LAYERS)
        assert hasattr(hooked.layers[i], "hook_resid_pre") == c.single_residual
    assert c.single_residual == (hooked.family.model_type not in ("qwen4_exp", "qwen4_exp_text"))
    assert c.allow_neg_eigval == (hooked.family.model_type == "olmo_hybrid")


def test_a_logits_equal_untouched(hooked, untouched):
    model, module = untouched
    x, nxt = ids(), ids(2, 1, seed=2)
    mask = torch.ones_like(x)
    mask[0, :5] = 0  # left padding, the mask transformers' linear layers need
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        with original_kernels(module) as calls:
            ref = model(x).logits
            ref_out = model(x, attention_mask=mask, use_cache=True)
            ref_step = model(nxt, attention_mask=mask2, past_key_values=ref_out.past_key_values, use_cache=True)
        assert len(calls) == 2 * len(LINEAR_LAYERS)  # the untouched model ran the transformers kernel
        nn = NNsight(hooked)
        with nn.trace(x):
            o_last = nn.layers[LINEAR_LAYERS[-1]].attn.hook_o.output.save()  # the hooks ran
            traced = nn.output.save()
        assert o_last.shape == (2, T, NUM_V_HEADS, 8)
        assert fro(traced.logits, ref) < LOGITS and torch.equal(hooked(x).logits, traced.logits)
        # padded positions excepted, then one cached decode step (the recurrent kernel's call)
        got_out = hooked(x, attention_mask=mask, use_cache=True)
        assert fro(got_out.logits[mask.bool()], ref_out.logits[mask.bool()]) < LOGITS
        got_step = hooked(nxt, attention_mask=mask2, past_key_values=got_out.past_key_values, use_cache=True)
        assert fro(got_step.logits, ref_step.logits) < LOGITS


def test_b_naive_float64_reproduces_kernel_and_cache(hooked, untouched):
    """Relative error = Frobenius norm of the difference / norm of the reference.

    The first linear layer sees bit-identical inputs in both models: there the hooks must hand out
    exactly what transformers hands its kernel (v, beta, g bit for bit; q, k after the kernel's own L2
    norm). The float64 recurrence on the captured inputs must match deltalab's float32 kernel to OURS, and on the
    transformers kernel's own inputs its float32 output and cache to THEIRS (module docstring: measured errors).
    """
    model, module = untouched
    x = ids()
    with torch.no_grad(), original_kernels(module) as calls:
        ref = model(x, use_cache=True)
    assert len(calls) == len(LINEAR_LAYERS)
    nn = NNsight(hooked)
    names = ("q", "k", "v", "beta", "g", "state", "o")
    saved = {}
    with torch.no_grad(), nn.trace(x, use_cache=True):
        for i in LINEAR_LAYERS:
            for n in names:
                saved[i, n] = getattr(nn.layers[i].attn, f"hook_{n}").output.save()
        out = nn.output.save()
    head_map = torch.tensor(hooked.config.key_head_of)
    first = calls[0][2]
    torch.testing.assert_close(saved[LINEAR_LAYERS[0], "q"], l2_normalize(first["query"].float()), rtol=0, atol=1e-7)
    torch.testing.assert_close(saved[LINEAR_LAYERS[0], "k"][:, :, 0], l2_normalize(first["key"].float()), rtol=0,
                               atol=1e-7)
    assert torch.equal(saved[LINEAR_LAYERS[0], "v"][:, :, 0], first["value"])
    assert torch.equal(saved[LINEAR_LAYERS[0], "beta"][:, :, 0], first["beta"].float())
    assert torch.equal(saved[LINEAR_LAYERS[0], "g"], first["g"])
    for (o_ref, _, inputs), i in zip(calls, LINEAR_LAYERS, strict=True):
        q, k, v, beta, g, states, o_hooked = (saved[i, n] for n in names)
        assert q.shape == (2, T, NUM_K_HEADS, 8) and k.shape == (2, T, 1, NUM_K_HEADS, 8)
        assert v.shape == (2, T, 1, NUM_V_HEADS, 8) and beta.shape == (2, T, 1, NUM_V_HEADS)
        assert g.shape == (2, T, NUM_V_HEADS) and states.shape == (2, 3, NUM_V_HEADS, 8, 8)
        assert torch.allclose(q.norm(dim=-1), torch.ones(()), atol=1e-3)  # L2-normalised (eps 1e-6)
        if hooked.config.allow_neg_eigval:
            assert float(beta.max()) > 1.0  # OLMo-Hybrid: beta in (0, 2)
        else:
            assert float(beta.max()) < 1.0
        q64, k64 = q.double()[:, :, head_map], k.double()[:, :, :, head_map]  # value head j reads key head j // 2
        o, final, bounds = naive_delta_product(q64, k64, v.double(), beta.double(), g.double(), scale=8**-0.5)
        cache = out.past_key_values.layers[i].recurrent_states[0]
        assert fro(o, o_hooked) < OURS and fro(final, cache) < OURS and fro(bounds, states) < OURS
        # the untouched model's kernel on its own inputs (the same as ours at the first layer, then apart by the
        # upstream layers' rounding)
        tq, tk = (l2_normalize(inputs[n].double())[:, :, head_map] for n in ("query", "key"))
        t_o, t_final, _ = naive_delta_product(tq, tk[:, :, None], inputs["value"].double()[:, :, None],
                                              inputs["beta"].double()[:, :, None], inputs["g"].double(),
                                              scale=8**-0.5)
        cache_ref = ref.past_key_values.layers[i].recurrent_states[0]
        assert fro(t_o, o_ref) < THEIRS and fro(t_final, cache_ref) < THEIRS
        assert torch.equal(cache, states[:, -1])  # the cache holds hook_state's final entry


@pytest.mark.parametrize("layer, head", [(1, 3)])
def test_c_beta_zero_through_hook_equals_by_hand(hooked, untouched, layer, head):
    model, module = untouched
    x = ids()
    base, by_hand = beta_zero_in_transformers(model, module, x, LINEAR_LAYERS.index(layer), head)
    assert fro(by_hand, base) > 1e-3  # the change matters
    assert fro(beta_zero_through_hook(hooked, x, layer, head), by_hand) < LOGITS


def test_resid_hooks(hooked):
    if not hooked.config.single_residual:  # Qwen4-Exp: hyper-connections keep several residual streams
        assert not any("hook_resid" in name for name, _ in hooked.named_modules())
        return
    x = ids()
    nn = NNsight(hooked)
    with torch.no_grad(), nn.trace(x):
        post0 = nn.layers[0].hook_resid_post.output.save()
        pre1 = nn.layers[1].hook_resid_pre.output.save()
        mid1 = nn.layers[1].hook_resid_mid.output.save()
    assert torch.equal(post0, pre1) and mid1.shape == pre1.shape and not torch.equal(mid1, pre1)
    with torch.no_grad():  # writing resid_mid (in place) = writing the residual after the token mixer
        with nn.trace(x):
            nn.layers[1].hook_resid_mid.output[:] = 0.0
            zeroed = nn.layers[1].hook_resid_post.output.save()
        with nn.trace(x):
            mid = nn.layers[1].hook_resid_mid.output.save()
            post = nn.layers[1].hook_resid_post.output.save()
    assert torch.all(zeroed == 0)  # post = mid + mlp(norm(mid)) = 0 when mid = 0 (no biases)
    assert not torch.equal(post, mid)


def test_info_through_cli(folder, hooked):
    from deltalab.app.cli import app

    res = CliRunner().invoke(app, ["info", str(folder)])  # reads config.json and the safetensors headers only
    assert res.exit_code == 0, res.output
    assert "Gated DeltaNet [0, 1, 3], 1 attention" in res.output and "2 key / 4 value heads" in res.output
    res = CliRunner().invoke(app, ["info", str(folder), "--json"])
    saved = build(hooked.family.model_type)  # the checkpoint's whole model (vision tower included)
    assert json.loads(res.stdout)["parameters"] == sum(p.numel() for p in saved.parameters())


def test_supported_types_listed():
    assert set(FAMILIES) <= set(SUPPORTED)


def test_state_edit_restarts_the_recurrence(hooked):
    """Zeroing the chunk-start state before token 64 through hook_state: the layer's outputs from token 64 on
    are the float64 recurrence restarted from zero there; earlier outputs are untouched."""
    layer, x = LINEAR_LAYERS[0], ids()
    nn = NNsight(hooked)
    saved: dict[str, torch.Tensor] = {}
    with torch.no_grad(), nn.trace(x):
        attn = nn.layers[layer].attn
        for n in ("q", "k", "v", "beta", "g"):
            saved[n] = getattr(attn, f"hook_{n}").output.save()
        attn.hook_state.output[:, 1] = 0.0
        saved["o"] = attn.hook_o.output.save()
    with torch.no_grad(), nn.trace(x):
        clean = nn.layers[layer].attn.hook_o.output.save()
    head_map = torch.tensor(hooked.config.key_head_of)
    q, k = saved["q"].double()[:, 64:, head_map], saved["k"].double()[:, 64:, :, head_map]
    o_ref, _, _ = naive_delta_product(q, k, saved["v"].double()[:, 64:], saved["beta"].double()[:, 64:],
                                      saved["g"].double()[:, 64:], scale=8**-0.5)
    assert torch.equal(saved["o"][:, :64], clean[:, :64])
    assert fro(saved["o"][:, 64:], o_ref) < 1e-5 and fro(clean[:, 64:], o_ref) > 1e-4  # the edit matters


def test_router_passes_unhooked_models_through(hooked, untouched):
    """With deltalab's router installed, a model that was not hooked runs transformers' kernel, bit for bit;
    positional arguments reach the hooked adapter under their transformers names."""
    from deltalab.models.hf.route import attach

    model, module = untouched
    x = ids()
    with torch.no_grad():
        routed = model(x).logits
        with original_kernels(module):
            plain = model(x).logits
    assert torch.equal(routed, plain)
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((len(args), kwargs))
            return args[2], None

    layer = torch.nn.Identity()
    handles = attach(layer, Spy())
    q, v = torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 4, 8)
    g, beta = torch.zeros(1, 2, 4), torch.ones(1, 2, 4)
    calls = {"torch_chunk_gated_delta_rule": (64, None, True, True),  # chunk_size comes first there
             "torch_recurrent_gated_delta_rule": (None, True, True)}
    for name, extra in calls.items():
        fn = getattr(module, name)
        layer.register_forward_hook(lambda *_, fn=fn, extra=extra: fn(q, q, v, g, beta, *extra), prepend=True)
    layer(torch.zeros(1))
    for h in handles:
        h.remove()
    assert [n for n, _ in seen] == [5, 5]
    assert all(kw["output_final_state"] is True and kw["use_qk_l2norm_in_kernel"] is True for _, kw in seen)
