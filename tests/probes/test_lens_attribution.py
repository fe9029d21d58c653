"""Direct logit attribution: contributions + constant + remainder = logit (1e-5 relative in float32), heads sum to
their mixer, each head's attribution equals the logit change of zeroing it for real where its path is linear
(and the reported linearisation error is that gap where it is not: RWKV-7's bonus and GroupNorm bias,
OLMo-Hybrid's post-norms); a delta-rule head's source split sums to its contribution in float64 and its weights
are the real change of o when a source's value is removed. Bad input: one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.models import load_checkpoint
from deltalab.probes.attribution import direct_logit_attribution, source_attribution, value_readout
from deltalab.probes.core import ProbeError

FLA = Path(__file__).resolve().parents[1] / "fixtures" / "fla"
OWN = ("gdn_hybrid_gva", "rwkv7_fused", "kda_gva", "gdp_nh3_gate", "delta_net")
HF = ("olmo_hybrid", "qwen3_next")


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.models.hf_tiny import save_tiny

    root = tmp_path_factory.mktemp("attribution_hf")
    return {f: save_tiny(f, root / f) for f in HF}


def _ids(vocab, T=24, B=2, seed=5):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _check_sums(ds):
    logit = ds["logit"].values
    total = ds["contribution"].values.sum(-1) + ds["constant"].values
    scale = np.nanmax(np.abs(logit))
    ok = ~np.isnan(logit)
    assert ok[:, :-1].all() and not ok[:, -1].any()  # the last position has no next token
    np.testing.assert_allclose(total[ok] + ds["remainder"].values[ok], logit[ok], rtol=0, atol=1e-12 * scale)
    assert np.abs(ds["remainder"].values[ok]).max() <= 1e-5 * scale
    assert np.abs(total[ok] - logit[ok]).max() <= 1e-5 * scale
    for layer in np.unique(ds["unit_layer"].values):
        heads = ds["head_contribution"].values[..., ds["unit_layer"].values == layer].sum(-1)
        mixer = ds["contribution"].sel(component=f"L{layer}.mixer").values
        np.testing.assert_allclose(heads[ok], mixer[ok], rtol=0, atol=1e-5 * np.abs(mixer[ok]).max())


@pytest.mark.parametrize("name", OWN)
def test_contributions_sum_to_the_logit_deltalab_models(name):
    model = load_checkpoint(FLA / name)
    ds = direct_logit_attribution(model, _ids(model.config.vocab_size))
    _check_sums(ds)
    kinds = set(ds["component_kind"].values)
    assert {"embed", "delta_rule", "mlp"} <= kinds


@pytest.mark.parametrize("family", HF)
def test_contributions_sum_to_the_logit_transformers_hybrids(hf_folders, family):
    ds = direct_logit_attribution(load_checkpoint(hf_folders[family]), _ids(64), check_heads=True)
    _check_sums(ds)
    assert set(ds["component_kind"].values) >= {"delta_rule", "attention", "moe" if family == "qwen3_next" else "mlp"}
    err = np.nanmax(np.abs(ds["linearisation_error"].values), axis=(0, 1))
    delta = ds["unit_kind"].values == "delta_rule"
    assert err[delta].max() <= 1e-5 * np.nanmax(np.abs(ds["head_contribution"].values))  # per-head norm + gate
    if family == "olmo_hybrid":  # softmax attention: post-norm over all heads, its scale frozen: a real gap
        assert err[~delta].min() > 1e-4


def test_logit_difference():
    model = load_checkpoint(FLA / "gdn_hybrid_gva")
    ids = _ids(64)
    a = direct_logit_attribution(model, ids, target=7)
    b = direct_logit_attribution(model, ids, target=11)
    d = direct_logit_attribution(model, ids, target=7, minus=11)
    np.testing.assert_allclose(d["logit"].values, a["logit"].values - b["logit"].values, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(d["contribution"].values, a["contribution"].values - b["contribution"].values,
                               rtol=1e-6, atol=1e-7)
    assert (d["minus"].values == 11).all()


def _frozen_logit_change(model, final, delta, target):
    """(delta . u): the change of target's logit when `delta` is removed from the final residual, the final
    norm's scale frozen at `final` (by hand: RMSNorm or LayerNorm)."""
    x, dl = final.double(), delta.double()
    norm = model.norm
    if isinstance(norm, torch.nn.LayerNorm):
        dl = dl - dl.mean(-1, keepdim=True)
        s = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
    else:
        s = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    W = model.lm_head.weight.detach().double()[target]  # [B, T, D]
    return (dl * s * norm.weight.detach().double() * W).sum(-1).detach()


def _zero_head_forward(model, ids, layer, head):
    """resid_mid of `layer` and the final norm's input, with head `head`'s output zeroed (hook_o, or hook_z of
    softmax attention), by plain forward hooks."""
    attn = model.layers[layer].attn
    got = {}
    point = attn.hook_o if hasattr(attn, "hook_o") else attn.hook_z

    def zero(_m, _a, out):
        out = out.clone()
        out[:, :, head] = 0
        return out

    hs = [point.register_forward_hook(zero),
          model.layers[layer].hook_resid_mid.register_forward_hook(lambda m, a, o: got.__setitem__("mid", o)),
          model.norm.register_forward_pre_hook(lambda m, a: got.__setitem__("final", a[0]))]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hs:
            h.remove()
    return got["mid"], got["final"]


def _clean_forward(model, ids, layer):
    got = {}
    hs = [model.layers[layer].hook_resid_mid.register_forward_hook(lambda m, a, o: got.__setitem__("mid", o)),
          model.norm.register_forward_pre_hook(lambda m, a: got.__setitem__("final", a[0]))]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hs:
            h.remove()
    return got


@pytest.mark.parametrize("name", ("gdn_hybrid_gva", "rwkv7_fused"))
def test_head_attribution_against_zeroing_the_head(name):
    """Brute force: zero one head in a real forward; its layer's write changes by delta (resid_pre is untouched);
    delta read through the frozen final norm is the head's attribution where the head's path is linear (GDN's
    per-head gated norm, softmax attention), and attribution - linearisation_error where it is not (RWKV-7)."""
    model = load_checkpoint(FLA / name)
    ids = _ids(model.config.vocab_size, B=1)
    ds = direct_logit_attribution(model, ids, check_heads=True)
    tgt = ds["target"].values.clip(0)
    scale = np.nanmax(np.abs(ds["head_contribution"].values))
    ok = ds["target"].values[0] >= 0
    gaps = []
    for u in range(ds.sizes["unit"]):
        layer, head = int(ds["unit_layer"].values[u]), int(ds["unit_head"].values[u])
        base = _clean_forward(model, ids, layer)
        mid, _ = _zero_head_forward(model, ids, layer, head)
        real = _frozen_logit_change(model, base["final"], base["mid"] - mid, torch.as_tensor(tgt))[0].numpy()
        attr = ds["head_contribution"].values[0, :, u]
        lin = ds["linearisation_error"].values[0, :, u]
        np.testing.assert_allclose(attr[ok] - lin[ok], real[ok], rtol=0, atol=1e-5 * scale)
        gaps.append(np.abs(lin[ok]).max())
    if name == "rwkv7_fused":
        assert min(gaps) > 1e-4 * scale  # the bonus and GroupNorm bias stay when the state read-out is zeroed
    else:
        assert max(gaps) <= 1e-5 * scale


@pytest.mark.parametrize("name", ("gdn_hybrid_gva", "gdp_nh3_gate", "kda_gva", "rwkv7_fused", "delta_net"))
def test_source_split_sums_to_the_head_float64(name):
    model = load_checkpoint(FLA / name).double()
    ids = _ids(model.config.vocab_size, T=30, B=2)
    t = 21
    dla = direct_logit_attribution(model, ids)
    layers = sorted({int(x) for x, k in zip(dla["unit_layer"].values, dla["unit_kind"].values) if k == "delta_rule"})
    for layer in layers:
        src = source_attribution(model, ids, layer, t, seq=1)
        head = src["head_contribution"].values
        scale = np.abs(head).max()
        assert scale > 0
        total = src["contribution"].values.sum((1, 2)) + src["constant"].values
        np.testing.assert_allclose(total, head, rtol=0, atol=1e-10 * scale)
        assert np.abs(src["error"].values).max() <= 1e-10 * scale
        units = dla["unit_layer"].values == layer
        np.testing.assert_allclose(head, dla["head_contribution"].values[1, t, units], rtol=1e-9, atol=1e-12 * scale)
        if name != "rwkv7_fused":  # per-head RMSNorm + gate: everything passes the state
            assert np.abs(src["constant"].values).max() <= 1e-10 * scale
        else:  # the bonus (the token's own value, read directly) and GroupNorm bias do not
            assert np.abs(src["constant"].values).max() > 1e-6 * scale


@pytest.mark.parametrize("name", ("gdp_nh3_gate", "rwkv7_fused", "gdn_hybrid_gva"))
def test_value_readout_times_weight_is_the_source_contribution(name):
    """The write side: a source's contribution at t is its weight times its value read out at t (float64)."""
    model = load_checkpoint(FLA / name).double()
    ids = _ids(model.config.vocab_size, T=26, B=1)
    t, layer = 19, 0
    src = source_attribution(model, ids, layer, t)
    target = src.attrs["target"]
    for s in (3, 11, t):
        val = value_readout(model, ids, layer, s, position=t, top_k=4)
        want = src["contribution"].values[:, s]  # [head, step]
        got = src["weight"].values[:, s] * val["logits"].values[..., target]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7 * np.abs(src["contribution"].values).max())
        top = val["top_token"].values[..., 0]
        np.testing.assert_array_equal(top, val["logits"].values.argmax(-1))
        assert (val["top_logit"].values[..., 0] >= val["bottom_logit"].values[..., 0]).all()
    with pytest.raises(ProbeError, match="pick 0 <= source <= position"):
        value_readout(model, ids, layer, 20, position=t)


def test_source_weights_are_the_real_change_of_o():
    """Removing one source's value v_{s,j} (hook_v) changes head h's o_t by exactly weight * v_{s,j}."""
    model = load_checkpoint(FLA / "gdp_nh3_gate").double()
    ids = _ids(64, T=30, B=1)
    t, layer = 20, 1
    src = source_attribution(model, ids, layer, t)
    c = np.abs(src["contribution"].values)
    h, s, j = np.unravel_index(np.argmax(c), c.shape)
    attn = model.layers[layer].attn
    got = {}

    def run(edit: bool):
        hs = [attn.hook_o.register_forward_hook(lambda m, a, o: got.__setitem__("o", o)),
              attn.hook_v.register_forward_hook(lambda m, a, o: got.__setitem__("v", o.clone()))]
        if edit:
            def zero(_m, _a, out):
                out = out.clone()
                out[:, s, j, h] = 0
                return out
            hs.insert(0, attn.hook_v.register_forward_hook(zero))
        with torch.no_grad():
            model(ids)
        for hd in hs:
            hd.remove()
        return got["o"][0, t, h].clone(), got["v"]

    o_clean, v = run(False)
    o_cut, _ = run(True)
    want = src["weight"].values[h, s, j] * v[0, s, j, h].numpy()
    np.testing.assert_allclose((o_clean - o_cut).numpy(), want, rtol=1e-9, atol=1e-12)


def test_source_split_transformers_hybrid(hf_folders):
    model = load_checkpoint(hf_folders["olmo_hybrid"], dtype=torch.float64)
    ids = _ids(64, T=30, B=1)
    src = source_attribution(model, ids, 3, 25)
    head = src["head_contribution"].values
    assert np.abs(src["error"].values).max() <= 1e-9 * np.abs(head).max()


def test_bad_input_one_line():
    model = load_checkpoint(FLA / "gdn_hybrid_gva")
    ids = _ids(64, B=1)
    with pytest.raises(ProbeError, match="no delta-rule mixer: pick one of"):
        source_attribution(model, ids, 1, 5)
    with pytest.raises(ProbeError, match="no next token"):
        source_attribution(model, ids, 0, ids.shape[1] - 1)
    with pytest.raises(ProbeError, match="outside the vocabulary"):
        direct_logit_attribution(model, ids, target=64)
    ckpt = str(FLA / "gdn_hybrid_gva")
    for argv, needle in ((["--position", "40"], "--position 40"),
                         (["--sources", "0"], "needs --position"),
                         (["--sources", "1", "--position", "3"], "no delta-rule mixer"),
                         (["--minus", "-3"], "outside the vocabulary")):
        res = CliRunner().invoke(app, ["probe", "attribution", "--checkpoint", ckpt, "--tokens", "1,5,9,3,22", *argv])
        assert res.exit_code == 2, (argv, res.output)
        assert needle in res.output and res.output.strip().count("\n") == 0, res.output


def test_cli_typed_and_store(tmp_path):
    ckpt = str(FLA / "gdn_hybrid_gva")
    res = CliRunner().invoke(app, ["probe", "attribution", "--checkpoint", ckpt, "--tokens", "1,5,9,3,22,7",
                                   "--position", "4", "--sources", "0", "--json"])
    assert res.exit_code == 0, res.output
    recs = json.loads(res.output)
    assert {r["head"] for r in recs} == {0, 1, 2, 3} and all(r["source"] <= 4 for r in recs)
    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", ckpt, "--data", "S4:length=20,samples=2,seed=0", "--out", str(out),
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["probe", "attribution", "--store", str(out), "--checkpoint", ckpt, "--seq", "1",
                                   "--json"])
    assert res.exit_code == 0, res.output
    recs = {r["component"]: r for r in json.loads(res.output)}
    assert "embed" in recs and "L3.H1" in recs and abs(recs["remainder"]["mean_abs"]) < 1e-4
    res = CliRunner().invoke(app, ["probe", "attribution", "--store", str(out), "--checkpoint", ckpt, "--seq", "5"])
    assert res.exit_code == 2 and "--seq 5" in res.output
