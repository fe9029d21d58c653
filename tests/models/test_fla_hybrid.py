"""An fla-format hybrid with grouped value heads, written by fla 0.6.0 on the GPU (tests/fixtures/fla/gdn_hybrid_gva).

Layers 1 and 3 are fla softmax attention (GQA, and a 32-token window with qkv bias); layers 0 and 2 are Gated
DeltaNet with 2 key heads and 4 value heads, beta in (0, 2). The three oracle checks of the transformers
families, against fla itself:
(a) logits with the hooks read through nnsight equal fla's float32 logits (1e-4 of the largest logit, as the
    other fla fixtures; measured 3.6e-6 on the GPU) and the unhooked forward's exactly;
(b) q, k, v, beta, g read through the hooks, fed to kernels.delta_rule.naive in float64, reproduce fla's own float32
kernel
    output and final state of each delta-rule layer (recorded by the fixture script) to 1e-5 relative;
(c) beta = 0 on one value head through hook_beta equals the same change made inside the layer's kernel call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from nnsight import NNsight
from safetensors.torch import load_file

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.models import load_checkpoint
from deltalab.models.config import ConfigError, ModelConfig
from deltalab.models.softmax_attention import SoftmaxAttention
from tests.models.oracles import beta_zero_by_hand, beta_zero_through_hook, fro

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fla" / "gdn_hybrid_gva"
DELTA, SOFTMAX = [0, 2], [1, 3]



@pytest.fixture(scope="module")
def model():
    return load_checkpoint(FIXTURE)


@pytest.fixture(scope="module")
def ref():
    return load_file(str(FIXTURE / "logits.safetensors"))


def test_layout(model):
    cfg = model.config
    assert cfg.delta_layers == DELTA and sorted(cfg.attn_specs) == SOFTMAX
    assert (cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_of) == (2, 4, [0, 0, 1, 1])
    assert all(isinstance(model.layers[i].attn, SoftmaxAttention) for i in SOFTMAX)
    assert model.layers[3].attn.window_size == 32 and model.layers[3].attn.q_proj.bias is not None
    assert model.layers[1].attn.num_kv_heads == 2 and model.layers[1].attn.window_size is None
    assert "delta-rule 0,2; softmax 1,3" in model.summary() and "2 key / 4 value heads" in model.summary()


def test_a_hooked_logits_equal_fla_and_unhooked(model, ref):
    ids = ref["input_ids"]
    with torch.no_grad():
        plain = model(ids).logits
        nn = NNsight(model)
        with nn.trace(ids):
            for i in DELTA:
                nn.layers[i].attn.hook_state.output.save()
            out = nn.output.save()
    assert torch.equal(out.logits, plain)
    scale = ref["logits_fp32"].abs().max()
    assert (plain - ref["logits_fp32"]).abs().max() / scale < 1e-4


def test_b_naive_float64_reproduces_fla_kernel_output_and_state(model, ref):
    layers = load_file(str(FIXTURE / "layers.safetensors"))
    names = ("q", "k", "v", "beta", "g", "state", "o")
    nn = NNsight(model)
    saved = {}
    with torch.no_grad(), nn.trace(ref["input_ids"]):
        for i in DELTA:
            for n in names:
                saved[i, n] = getattr(nn.layers[i].attn, f"hook_{n}").output.save()
    head_map = torch.tensor(model.config.key_head_of)
    for i in DELTA:
        q, k, v, beta, g, states, o_hooked = (saved[i, n] for n in names)
        assert q.shape == (2, 150, 2, 32) and k.shape == (2, 150, 1, 2, 32) and v.shape == (2, 150, 1, 4, 32)
        assert beta.shape == (2, 150, 1, 4) and g.shape == (2, 150, 4) and states.shape == (2, 4, 4, 32, 32)
        assert float(beta.max()) > 1.0  # allow_neg_eigval: beta in (0, 2)
        o, final, bounds = naive_delta_product(q.double()[:, :, head_map], k.double()[:, :, :, head_map],
                                               v.double(), beta.double(), g.double(), scale=32**-0.5)
        fla_o, fla_state = layers[f"o.{i}"], layers[f"state.{i}"].transpose(-1, -2)  # fla: [B, Hv, dv, dk]
        assert fro(o, fla_o) < 1e-5 and fro(final, fla_state) < 1e-5
        assert fro(o, o_hooked) < 1e-5 and fro(bounds, states) < 1e-5
        # the grouped kernel with q, k per key head equals the float64 recurrence on repeated heads
        o_grouped = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double(),
                                        scale=32**-0.5)[0]
        torch.testing.assert_close(o_grouped, o, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layer, head", [(2, 3)])
def test_c_beta_zero_through_hook_equals_by_hand(model, ref, monkeypatch, layer, head):
    ids = ref["input_ids"]
    base, by_hand = beta_zero_by_hand(model, ids, DELTA.index(layer), head, monkeypatch)
    assert fro(by_hand, base) > 1e-4  # the change matters
    assert fro(beta_zero_through_hook(model, ids, layer, head), by_hand) < 1e-6


def _softmax_reference(attn: SoftmaxAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer written out in float64: rotary as complex rotation of (x_i, x_{i+d/2}), explicit softmax."""
    B, T, _ = x.shape
    d, H, Hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    lin = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    w = {n: (m.weight.double(), None if m.bias is None else m.bias.double()) for n, m in lin.items()}

    def proj(n, heads):
        y = x.double() @ w[n][0].T + (0 if w[n][1] is None else w[n][1])
        return y.view(B, T, heads, d)

    def rotate(y):
        freq = attn.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        phase = torch.polar(torch.ones(T, d // 2, dtype=torch.float64), torch.arange(T)[:, None] * freq)
        z = torch.complex(y[..., : d // 2], y[..., d // 2:]) * phase[None, :, None]
        return torch.cat([z.real, z.imag], -1)

    q, k, v = rotate(proj("q_proj", H)), rotate(proj("k_proj", Hkv)), proj("v_proj", Hkv)
    out = torch.zeros(B, T, H, d, dtype=torch.float64)
    for h in range(H):
        kv = h // (H // Hkv)
        for t in range(T):
            lo = 0 if attn.window_size is None else max(0, t - attn.window_size + 1)
            s = torch.einsum("bd,bsd->bs", q[:, t, h], k[:, lo : t + 1, kv]) / d**0.5
            out[:, t, h] = torch.einsum("bs,bsd->bd", s.softmax(-1), v[:, lo : t + 1, kv])
    return out.reshape(B, T, -1) @ w["o_proj"][0].T


@pytest.mark.parametrize("spec", [
    {"num_heads": 4, "num_kv_heads": 2, "qkv_bias": False, "window_size": None, "rope_theta": 10000.0},
    {"num_heads": 2, "num_kv_heads": 1, "qkv_bias": True, "window_size": 5, "rope_theta": 500.0},
])
def test_softmax_attention_matches_float64_formula(spec):
    torch.manual_seed(0)
    attn = SoftmaxAttention(32, spec).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _softmax_reference(attn, x), rtol=1e-10, atol=1e-10)


def test_config_round_trip_keeps_hybrid_and_grouped_fields(tmp_path, model):
    from deltalab.models.checkpoint import save_checkpoint

    save_checkpoint(model, tmp_path / "copy")
    raw = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert raw["num_v_heads"] == 4 and [s["layers"] for s in raw["attn"]] == [[1], [3]]
    again = load_checkpoint(tmp_path / "copy")
    ids = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("change, message", [
    ({"attn": {"layers": [7], "num_heads": 2}}, r"^'attn' layer 7 is not a layer index 0\.\.3$"),
    ({"attn": {"layers": [1]}}, r"^'attn' spec .* needs 'layers' and 'num_heads'$"),
    ({"attn": [{"layers": [1], "num_heads": 2}, {"layers": [1], "num_heads": 2}]}, r"^'attn' assigns layer 1 twice$"),
    ({"attn": {"layers": [1], "num_heads": 3}}, r"num_heads=3 must divide hidden_size=64"),
    ({"num_v_heads": 3}, r"^num_v_heads=3 must be a multiple of num_heads=2$"),
])
def test_bad_hybrid_configs_give_one_line(change, message):
    raw = {**json.loads((FIXTURE / "config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(err.value)


def test_capture_and_probes_on_the_hybrid(tmp_path):
    """Capture keeps the delta-rule layers under their real numbers and q, k per key head; probes run on them."""
    import numpy as np
    from typer.testing import CliRunner

    from deltalab import store
    from deltalab.app.cli import app

    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(FIXTURE), "--data", "S4:length=70,samples=4,seed=0", "--out",
                                   str(out), "--batch-size", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
    ds = store.open(out, key_heads="key")
    assert ds["layer"].values.tolist() == DELTA
    assert ds.sizes["key_head"] == 2 and ds.sizes["head"] == 4 and ds.attrs["key_head_of"] == [0, 0, 1, 1]
    assert ds["state"].dims == ("seq", "layer", "chunk", "head", "dk", "dv")
    res = CliRunner().invoke(app, ["capture", str(FIXTURE), "--data", "S4:length=70,samples=4,seed=0", "--out",
                                   str(tmp_path / "t.zarr"), "--layers", "1"])
    assert res.exit_code == 2 and "layer 1 is a softmax-attention layer: the delta-rule layers are 0,2" in res.output
    for probe in ("spectra", "erank", "keys"):
        res = CliRunner().invoke(app, ["probe", probe, "--store", str(out), "--json"])
        assert res.exit_code == 0, (probe, res.output)
    res = CliRunner().invoke(app, ["probe", "betas", "--store", str(out), "--json"])
    rows = json.loads(res.output)
    assert sorted({(r["layer"], r["head"]) for r in rows}) == [(i, h) for i in DELTA for h in range(4)]
    beta = np.asarray(ds["beta"].sel(layer=0, head=1).values)
    row = next(r for r in rows if (r["layer"], r["head"]) == (0, 1))
    assert row["frac_negative"] == pytest.approx(float((beta > 1).mean()))  # beta in (0, 2): negative eigenvalues


def test_pruning_study_refuses_the_hybrid_in_one_line():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "deltalab.app.cli", "prune", str(FIXTURE), "--no-throughput"],
                         cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: {FIXTURE}: the pruning study takes fla-format models without softmax-attention layers or grouped "
        "value heads; pass such a checkpoint"]
