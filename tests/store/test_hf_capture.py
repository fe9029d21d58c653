"""`deltalab capture` on transformers Gated DeltaNet folders: grouped heads in the store, real layer numbers,
and oracle (b) through the store: stored q, k, v, beta, g -> kernels.delta_rule.naive in float64 reproduce the stored
o, the transformers kernel's output and its cache's final state."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from deltalab import store  # noqa: E402
from deltalab.app.cli import app  # noqa: E402
from deltalab.kernels.delta_rule.naive import naive_delta_product  # noqa: E402
from deltalab.models.hf import family_of  # noqa: E402
from tests.models.hf_tiny import FAMILIES, LINEAR_LAYERS, NUM_K_HEADS, NUM_V_HEADS, original_kernels, save_tiny  # noqa: E402

SPEC = "S4:length=70,samples=4,seed=0"
HOOKS = "tokens,labels,loss,q,k,v,beta,g,state,o"


def fro(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a)).double(), torch.as_tensor(np.asarray(b)).double()
    return float((a - b).norm() / b.norm())


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_grouped_heads_and_oracle_b(family, tmp_path):
    folder = save_tiny(family, tmp_path / family)
    out = tmp_path / "s.zarr"
    res = cli("capture", str(folder), "--data", SPEC, "--out", str(out), "--hooks", HOOKS, "--batch-size", "2",
              "--no-progress")
    assert res.exit_code == 0, res.output
    ds = store.open(out, key_heads="key")  # as stored: q, k per key head
    assert ds["layer"].values.tolist() == list(LINEAR_LAYERS)  # real layer numbers, attention layer 2 absent
    assert ds["q"].dims == ("seq", "layer", "pos", "key_head", "dk")
    assert ds["k"].dims == ("seq", "layer", "pos", "step", "key_head", "dk")
    assert ds.sizes["key_head"] == NUM_K_HEADS and ds.sizes["head"] == NUM_V_HEADS
    assert ds["key_head_of"].values.tolist() == [0, 0, 1, 1]
    by_value = store.open(out)  # the default view: q, k per value head, like every other variable
    assert by_value["k"].dims == ("seq", "layer", "pos", "step", "head", "dk") and "key_head" not in by_value.dims
    np.testing.assert_array_equal(by_value["k"].values, ds["k"].values[:, :, :, :, [0, 0, 1, 1]])
    np.testing.assert_array_equal(by_value["q"].values, ds["q"].values[:, :, :, [0, 0, 1, 1]])
    assert ds["v"].dims == ("seq", "layer", "pos", "step", "head", "dv")
    assert ds["state"].dims == ("seq", "layer", "chunk", "head", "dk", "dv")
    assert ds.attrs["key_head_of"] == [0, 0, 1, 1]
    assert ds.attrs["model_config"]["model_type"] == family and ds.attrs["checkpoint_digest"] != "sha256:unknown"

    tokens = torch.from_numpy(ds["tokens"].values.astype(np.int64))
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()
    module = importlib.import_module(family_of(ds.attrs["model_config"]["model_type"]).module)
    with torch.no_grad(), original_kernels(module) as calls:
        refs = [model(tokens[a:a + 2], use_cache=True) for a in (0, 2)]  # the capture's batches
    head_map = ds.attrs["key_head_of"]
    for n, layer in enumerate(LINEAR_LAYERS):
        lay = store.select(ds, layer=layer)
        q = torch.from_numpy(lay["q"].values).double()[:, :, head_map]
        k = torch.from_numpy(lay["k"].values).double()[:, :, :, head_map]
        v, beta, g = (torch.from_numpy(lay[name].values).double() for name in ("v", "beta", "g"))
        o, final, bounds = naive_delta_product(q, k, v, beta, g, scale=8**-0.5)
        o_ref = torch.cat([calls[b * len(LINEAR_LAYERS) + n][0] for b in range(2)])
        cache = torch.cat([r.past_key_values.layers[layer].recurrent_states[0] for r in refs])
        # both kernels compute in float32 (~1e-6 from the float64 recurrence each)
        assert fro(o, o_ref) < 1e-5 and fro(final, cache) < 1e-5
        assert fro(o, lay["o"].values) < 1e-5 and fro(bounds, lay["state"].values) < 1e-5
        if n == 0:  # identical inputs in both models: the store holds exactly what transformers' kernel got
            hf_v = torch.cat([calls[b * len(LINEAR_LAYERS)][2]["value"] for b in range(2)])
            assert torch.equal(torch.from_numpy(lay["v"].values)[:, :, 0], hf_v)
    loss = ds["loss"].values
    assert np.isfinite(loss[ds["labels"].values != -100]).all()


def test_capture_refuses_attention_layer_and_resid_on_hyper_connections(tmp_path):
    olmo = save_tiny("olmo_hybrid", tmp_path / "olmo")
    res = cli("capture", str(olmo), "--data", SPEC, "--out", str(tmp_path / "a.zarr"), "--layers", "1,2")
    assert res.exit_code == 2 and "layer 2 is a softmax-attention layer: the delta-rule layers are 0,1,3" in res.stderr
    qwen4 = save_tiny("qwen4_exp", tmp_path / "q4")
    res = cli("capture", str(qwen4), "--data", SPEC, "--out", str(tmp_path / "b.zarr"), "--hooks", "beta,resid_pre")
    assert res.exit_code == 2 and "several residual streams" in res.stderr
    res = cli("capture", str(olmo), "--data", SPEC, "--out", str(tmp_path / "c.zarr"), "--hooks",
              "tokens,beta,resid_pre,resid_mid,resid_post", "--layers", "3", "--no-progress")
    assert res.exit_code == 0, res.output
    ds = store.open(tmp_path / "c.zarr")
    assert ds["resid_mid"].dims == ("seq", "layer", "pos", "hidden") and ds["layer"].values.tolist() == [3]
    assert "key_head" not in ds["beta"].dims


def test_capture_in_bfloat16_and_device_map_only_for_transformers(tmp_path):
    olmo = save_tiny("olmo_hybrid", tmp_path / "olmo")
    out = tmp_path / "bf16.zarr"
    res = cli("capture", str(olmo), "--data", SPEC, "--out", str(out), "--hooks", "tokens,q,beta,state",
              "--model-dtype", "bfloat16", "--no-progress")
    assert res.exit_code == 0, res.output
    ds = store.open(out)
    assert np.isfinite(ds["state"].values).all() and ds["q"].dtype == np.float32
    res = cli("capture", str(olmo), "--data", SPEC, "--out", str(tmp_path / "x.zarr"), "--model-dtype", "fp8")
    assert res.exit_code == 2 and "--model-dtype 'fp8' is not supported" in res.stderr
