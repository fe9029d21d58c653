"""fla's Kimi Delta Attention checkpoints (model type `kda`), written by fla 0.6.0 on the GPU
(tests/fixtures/fla/kda_gva: 2 key / 4 value heads; kda_bounded: fla's bounded gate, lower_bound = -5).

(a) logits through nnsight equal the plain forward exactly and fla's float32 logits within 1e-4 of the largest
    (measured on the GPU: 5.6e-6 and 1.6e-6);
(b) q, k, v, beta, g read through the hooks (g per key channel), fed to kernels.delta_rule.naive in float64, reproduce
    fla's own float32 kernel output and final state per layer (recorded by the fixture script) to 1e-5 relative;
(c) beta = 0 on one value head through hook_beta equals the same change made inside the kernel call;
and the stored per-channel gate gives the spectra probe's exact transition eigenvalues.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from nnsight import NNsight
from safetensors.torch import load_file

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.models import load_checkpoint
from deltalab.models.config import ModelConfig
from tests.models.oracles import beta_zero_by_hand, beta_zero_through_hook, fro

FIXTURES = Path(__file__).parents[1] / "fixtures" / "fla"
NAMES = ("kda_gva", "kda_bounded")



@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    folder = FIXTURES / request.param
    return folder, load_checkpoint(folder), load_file(str(folder / "logits.safetensors"))


def test_config(fixture):
    folder, model, _ = fixture
    cfg = model.config
    assert cfg.model_type == "kda" and cfg.gate == "channel" and cfg.output_gate_activation == "sigmoid"
    raw = json.loads((folder / "config.json").read_text())
    assert cfg.num_value_heads == (raw.get("num_v_heads") or raw["num_heads"]) and cfg.lower_bound == raw["lower_bound"]


def test_a_hooked_logits_equal_fla_and_unhooked(fixture):
    _, model, ref = fixture
    ids = ref["input_ids"]
    with torch.no_grad():
        plain = model(ids).logits
        nn = NNsight(model)
        with nn.trace(ids):
            g = nn.layers[0].attn.hook_g.output.save()
            out = nn.output.save()
    assert torch.equal(out.logits, plain)
    assert g.shape == (2, 150, model.config.num_value_heads, 32) and float(g.max()) <= 0
    if model.config.lower_bound is not None:
        assert float(g.min()) >= model.config.lower_bound
    assert (plain - ref["logits_fp32"]).abs().max() / ref["logits_fp32"].abs().max() < 1e-4


def test_b_naive_float64_reproduces_fla_kernel_output_and_state(fixture):
    folder, model, ref = fixture
    layers = load_file(str(folder / "layers.safetensors"))
    names = ("q", "k", "v", "beta", "g", "state", "o")
    nn = NNsight(model)
    saved = {}
    with torch.no_grad(), nn.trace(ref["input_ids"]):
        for i in range(model.config.num_hidden_layers):
            for n in names:
                saved[i, n] = getattr(nn.layers[i].attn, f"hook_{n}").output.save()
    for i in range(model.config.num_hidden_layers):
        q, k, v, beta, g, states, o_hooked = (saved[i, n] for n in names)
        o, final, bounds = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double(),
                                               scale=32**-0.5)
        fla_o, fla_state = layers[f"o.{i}"], layers[f"state.{i}"].transpose(-1, -2)  # fla: [B, Hv, dv, dk]
        assert fro(o, fla_o) < 1e-5 and fro(final, fla_state) < 1e-5
        assert fro(o, o_hooked) < 1e-6 and fro(bounds, states) < 1e-6  # ours on its own inputs (fla: another run)


def test_c_beta_zero_through_hook_equals_by_hand(fixture, monkeypatch):
    _, model, ref = fixture
    ids, layer, head = ref["input_ids"], 1, 1
    base, by_hand = beta_zero_by_hand(model, ids, layer, head, monkeypatch)
    assert fro(by_hand, base) > 1e-4
    assert fro(beta_zero_through_hook(model, ids, layer, head), by_hand) < 1e-6


def test_capture_and_exact_spectra(tmp_path):
    from typer.testing import CliRunner

    from deltalab import store
    from deltalab.app.cli import app
    from deltalab.kernels.spectra.naive import dplr_eigvals_dense
    from deltalab.store.reader import open_results

    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(FIXTURES / "kda_gva"), "--data", "S4:length=70,samples=4,seed=0",
                                   "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    for probe in ("spectra", "decays"):
        res = CliRunner().invoke(app, ["probe", probe, "--store", str(out)])
        assert res.exit_code == 0, (probe, res.output)
    ds = store.open(out)
    assert ds["g"].dims == ("seq", "layer", "pos", "head", "dk") and ds.sizes["head"] == 4
    sub = dict(seq=slice(0, 2), pos=slice(0, 16))
    k = torch.from_numpy(np.asarray(ds["k"].isel(step=0, **sub).values)).double()
    beta = torch.from_numpy(np.asarray(ds["beta"].isel(step=0, **sub).values)).double()
    g = torch.from_numpy(np.asarray(ds["g"].isel(**sub).values)).double()
    got = np.asarray(open_results(out, "spectra")["eig_A"].isel(**sub).values).real
    np.testing.assert_allclose(got, dplr_eigvals_dense(g.exp(), k, beta).numpy(), rtol=0, atol=1e-6)


def test_bad_kda_config_gives_one_line():
    raw = json.loads((FIXTURES / "kda_gva" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^num_v_heads=3 must be a multiple of num_heads=2$"):
        ModelConfig.from_dict({**raw, "num_v_heads": 3})
