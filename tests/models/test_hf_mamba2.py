"""Oracles for the transformers Mamba-2 (SSD) families (mamba2, bamba, granitemoehybrid, nemotron_h, falcon_h1,
zamba2): tiny random models saved with save_pretrained, opened as deltalab opens them.

(a) logits with deltalab's hooks equal the untouched transformers model's;
(b) C, B, dt * x, dt * A read through the hooks, fed to kernels.ssd.naive in float64, reproduce deltalab's hook_o
    and chunk-start states to OURS, and the layer's own transformers scan (its output less the D skip, its final
    state) to THEIRS; the hooks hand out exactly what the scan receives, discretised;
(c) zeroing one group's query C through hook_q equals the same change made by hand inside transformers' scan;
(d) an edited chunk-start state restarts the recurrence there.

Bounds. transformers' float32 scan takes decays as differences of running totals over its chunk (32 tokens here,
log decays down to about -5 per token): measured 1e-6 to 4e-6 from the float64 recurrence on its own inputs;
deltalab's chunked form sums each decay from the gates it spans. Through the model the two float32 runs differ by
up to ~3e-6 relative (Zamba2's shared blocks amplify most).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from nnsight import NNsight  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from deltalab.kernels.ssd.naive import naive_ssd  # noqa: E402
from deltalab.models import load_checkpoint  # noqa: E402
from deltalab.models.hf import FAMILIES as SUPPORTED  # noqa: E402
from tests.models.mamba2_tiny import (  # noqa: E402
    FAMILIES,
    GROUPS,
    HEAD_DIM,
    HEADS,
    SSD_LAYERS,
    STATE,
    VOCAB,
    original_scan,
    save_tiny,
)
from tests.models.oracles import fro  # noqa: E402

T = 70  # crosses deltalab's 64-token chunk and transformers' 32-token scan chunks
OURS = 1e-5  # deltalab's float32 chunked form against the float64 recurrence on the same inputs
THEIRS = 2e-5  # transformers' float32 scan against it, on its own inputs (measured up to 4e-6)
LOGITS = 2e-5  # two float32 runs of the model, relative (Frobenius)


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hooked(folder):
    return load_checkpoint(folder)


@pytest.fixture(scope="module")
def untouched(folder, hooked):
    """The transformers model alone (loaded without deltalab), and its family's modeling module."""
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()
    return model, importlib.import_module(hooked.family.module)


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def step_sizes(args: dict) -> torch.Tensor:
    """dt [B, T, H] as transformers' scan derives it from its arguments (softplus, then its dt_limit clamp)."""
    low, high = args.get("dt_limit", (0.0, float("inf")))
    return torch.nn.functional.softplus(args["dt"] + args["dt_bias"]).clamp(low, high).float().detach()


def test_layout(hooked):
    c, layers = hooked.config, SSD_LAYERS[hooked.family.model_type]
    assert c.delta_layers == layers and not c.removal and not c.use_beta
    assert (c.num_heads, c.num_key_heads, c.head_k_dim, c.head_v_dim) == (HEADS, GROUPS, STATE, HEAD_DIM)
    assert c.key_head_of == [0, 0, 1, 1]
    for i in range(4):
        layer = hooked.layers[i]
        assert hasattr(layer, "attn") == (i in layers)
        if i in layers:
            assert not hasattr(layer.attn, "hook_beta")  # no removal, every write whole
        assert hasattr(layer, "hook_resid_mid") == (i in layers and hooked.family.resid_mid)
    assert hooked.family.model_type in SUPPORTED and hooked.family.layer_kind == "Mamba-2"


def test_a_logits_equal_untouched(hooked, untouched):
    model, module = untouched
    x = ids()
    with torch.no_grad():
        with original_scan(module) as calls:
            ref = model(x).logits
        assert len(calls) == len(SSD_LAYERS[hooked.family.model_type])  # the untouched model ran its scan
        nn = NNsight(hooked)
        with nn.trace(x):
            o_last = nn.layers[hooked.config.delta_layers[-1]].attn.hook_o.output.save()  # the hooks ran
            traced = nn.output.save()
    assert o_last.shape == (2, T, HEADS, HEAD_DIM)
    assert fro(traced.logits, ref) < LOGITS and torch.equal(hooked(x).logits, traced.logits)


def test_b_float64_recurrence_reproduces_hooks_and_scan(hooked, untouched):
    """Relative errors in the Frobenius norm. The first SSD layer sees bit-identical inputs in both models: there
    the hooks hold exactly transformers' discretisation (C, B as passed; dt * x and dt * A in float32)."""
    model, module = untouched
    x = ids()
    with torch.no_grad(), original_scan(module) as calls:
        model(x, use_cache=True)  # every scan hands back its final state for the cache
    layers = hooked.config.delta_layers
    names = ("q", "k", "v", "g", "state", "o")
    nn = NNsight(hooked)
    saved = {}
    with torch.no_grad(), nn.trace(x):
        for i in layers:
            for n in names:
                saved[i, n] = getattr(nn.layers[i].attn, f"hook_{n}").output.save()
    first = calls[0][0]
    dt = step_sizes(first)
    assert torch.equal(saved[layers[0], "q"], first["C"].float())
    assert torch.equal(saved[layers[0], "k"][:, :, 0], first["B"].float())
    assert torch.equal(saved[layers[0], "v"][:, :, 0], first["hidden_states"].float() * dt[..., None])
    assert torch.equal(saved[layers[0], "g"], first["A"].float() * dt)
    for (args, (y_ref, their_final)), i in zip(calls, layers, strict=True):
        q, k, v, g, states, o = (saved[i, n] for n in names)
        assert q.shape == (2, T, GROUPS, STATE) and k.shape == (2, T, 1, GROUPS, STATE)
        assert v.shape == (2, T, 1, HEADS, HEAD_DIM) and g.shape == (2, T, HEADS)
        assert states.shape == (2, 3, HEADS, STATE, HEAD_DIM) and float(g.max()) <= 0.0
        o64, final = naive_ssd(q, k[:, :, 0], v[:, :, 0], g)
        _, at64 = naive_ssd(q[:, :64], k[:, :64, 0], v[:, :64, 0], g[:, :64])
        assert fro(o, o64) < OURS and fro(states[:, 1], at64) < OURS and fro(states[:, 2], final) < OURS
        assert torch.equal(states[:, 0], torch.zeros_like(states[:, 0]))
        # transformers' own scan on its own inputs, D skip removed; and its final state ([B, H, P, N])
        dt = step_sizes(args)
        xs = args["hidden_states"].float()
        t_o, t_final = naive_ssd(args["C"], args["B"], xs * dt[..., None], args["A"].float() * dt)
        assert fro(t_o, y_ref - args["D"].detach().float()[:, None] * xs) < THEIRS
        assert fro(t_final.transpose(-1, -2), their_final) < THEIRS


def test_c_query_zero_through_hook_equals_by_hand(hooked, untouched):
    model, module = untouched
    layer, x = hooked.config.delta_layers[1], ids()
    call = hooked.config.delta_layers.index(layer)

    def zero_group(i, arguments):
        if i == call:
            arguments["C"] = arguments["C"].clone()
            arguments["C"][:, :, 1] = 0.0

    with torch.no_grad():
        with original_scan(module):
            base = model(x).logits
        with original_scan(module, zero_group):
            by_hand = model(x).logits
        nn = NNsight(hooked)
        with nn.trace(x):
            nn.layers[layer].attn.hook_q.output[:, :, 1] = 0.0
            through_hook = nn.output.save()
    assert fro(by_hand, base) > 1e-3  # the change matters
    assert fro(through_hook.logits, by_hand) < LOGITS


def test_d_state_edit_restarts_the_recurrence(hooked):
    """Zeroing the chunk-start state before token 64: the layer's outputs from token 64 on are the float64
    recurrence restarted from zero there; earlier outputs are untouched."""
    layer, x = hooked.config.delta_layers[0], ids()
    nn = NNsight(hooked)
    saved: dict[str, torch.Tensor] = {}
    with torch.no_grad(), nn.trace(x):
        attn = nn.layers[layer].attn
        for n in ("q", "k", "v", "g"):
            saved[n] = getattr(attn, f"hook_{n}").output.save()
        attn.hook_state.output[:, 1] = 0.0
        saved["o"] = attn.hook_o.output.save()
    with torch.no_grad(), nn.trace(x):
        clean = nn.layers[layer].attn.hook_o.output.save()
    o_ref, _ = naive_ssd(saved["q"][:, 64:], saved["k"][:, 64:, 0], saved["v"][:, 64:, 0], saved["g"][:, 64:])
    assert torch.equal(saved["o"][:, :64], clean[:, :64])
    assert fro(saved["o"][:, 64:], o_ref) < OURS and fro(clean[:, 64:], o_ref) > 1e-4  # the edit matters


def test_e_cache_holds_the_final_state(hooked, untouched):
    """use_cache=True: the cache holds hook_state's final entry (transposed to transformers' [B, H, P, N]), and a
    decode step from it (transformers' own single-token update, not hooked) matches the untouched model's."""
    model, module = untouched
    x, nxt = ids(), ids(2, 1, seed=2)
    layer = hooked.config.delta_layers[0]
    with torch.no_grad():
        with original_scan(module):
            ref = model(x, use_cache=True)
            ref_step = model(nxt, past_key_values=ref.past_key_values, use_cache=True)
        nn = NNsight(hooked)
        with nn.trace(x, use_cache=True):
            states = nn.layers[layer].attn.hook_state.output.save()
            out = nn.output.save()
        cache = out.past_key_values.layers[layer].recurrent_states[0]
        assert torch.equal(cache, states[:, -1].transpose(-1, -2))
        step = hooked(nxt, past_key_values=out.past_key_values, use_cache=True)
    assert fro(out.logits, ref.logits) < LOGITS and fro(step.logits, ref_step.logits) < LOGITS
