"""fla's RWKV-7 checkpoints (model type `rwkv7`), written by fla 0.6.0 itself (tests/fixtures/make_fla_fixtures.py
--rwkv7; report.json says where): rwkv7_fused (4 heads of 16, fla's fused norms) and rwkv7_wide_v (3 layers,
dk = 32, dv = 64, torch's norms, tied embeddings).

(a) logits through nnsight (hooks read) equal the plain forward exactly and fla's float32 logits within 1e-4;
(b) r, k, v, a_rwkv, kappa and log w read through the hooks, fed to kernels.dplr.naive in float64 (a = -kappa,
    b = kappa a_rwkv, scale 1), reproduce fla's own kernel output and final state per layer to 1e-5 relative, and
    equal fla's recorded kernel inputs;
(c) a_rwkv = 0 on one head through hook_beta equals the same change made inside the layer (a_lora's output at
    -inf, so the sigmoid gives exactly 0 there: both the key update and the removal see it);
(d) RWKV-6 and other unsupported layouts fail in one line naming what deltalab loads.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from nnsight import NNsight
from safetensors.torch import load_file, save_file

from deltalab.kernels.dplr.naive import naive_dplr
from deltalab.models import CheckpointError, load_checkpoint
from deltalab.models.config import ModelConfig
from tests.models.oracles import fro

FIXTURES = Path(__file__).parents[1] / "fixtures" / "fla"
NAMES = ("rwkv7_fused", "rwkv7_wide_v")
HOOKS = ("q", "beta", "kappa", "k", "v", "g", "state", "o")  # the order they run in


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    folder = FIXTURES / request.param
    return folder, load_checkpoint(folder), load_file(str(folder / "logits.safetensors"))


def run_hooked(model, ids) -> tuple[torch.Tensor, dict[tuple[int, str], torch.Tensor]]:
    nn, saved = NNsight(model), {}
    with torch.no_grad(), nn.trace(ids):
        for i in range(model.config.num_hidden_layers):
            for name in HOOKS:
                saved[i, name] = getattr(nn.layers[i].attn, f"hook_{name}").output.save()
        out = nn.output.save()
    return out.logits, saved


@pytest.mark.parametrize("name", NAMES)
def test_fixtures_were_written_by_fla_on_a_gpu(name):
    """The fixtures are fla's own output on CUDA (make_fla_fixtures.py --rwkv7 on the device), not the interpreter's."""
    report = json.loads((FIXTURES / "report.json").read_text())[name]
    assert report["produced_by"].startswith("fla 0.6.0 RWKV7ForCausalLM, float32, on cuda"), report["produced_by"]


def test_config_round_trips(fixture):
    folder, model, _ = fixture
    raw = json.loads((folder / "config.json").read_text())
    cfg = model.config
    assert cfg.model_type == "rwkv7" and cfg.gate == "channel" and cfg.num_householder == 1
    assert cfg.head_k_dim == raw["head_dim"] and cfg.num_heads == raw["hidden_size"] // raw["head_dim"]
    assert cfg.head_v_dim == raw["value_dim"][0] // cfg.num_heads and cfg.norm_eps == raw["norm_eps"]
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert (model.lm_head.weight is model.embeddings.weight) == raw["tie_word_embeddings"]


def test_a_hooked_logits_equal_plain_and_fla(fixture):
    _, model, ref = fixture
    ids = ref["input_ids"]
    with torch.no_grad():
        plain = model(ids).logits
    hooked, saved = run_hooked(model, ids)
    assert torch.equal(hooked, plain)
    B, T = ids.shape
    H, dk, dv = model.config.num_heads, model.config.head_k_dim, model.config.head_v_dim
    for name, shape in (("q", (B, T, H, dk)), ("beta", (B, T, H, dk)), ("kappa", (B, T, H, dk)),
                        ("k", (B, T, H, dk)), ("v", (B, T, H, dv)), ("g", (B, T, H, dk)), ("o", (B, T, H, dv)),
                        ("state", (B, 3, H, dk, dv))):
        assert saved[1, name].shape == shape, name
    g, beta = saved[1, "g"], saved[1, "beta"]
    assert float(g.max()) < 0 and float(g.min()) >= -math.exp(-0.5) - 1e-6  # -exp(-0.5) <= log w < 0
    assert 0 < float(beta.min()) and float(beta.max()) < 1
    assert torch.allclose(saved[1, "kappa"].norm(dim=-1), torch.ones(()), atol=1e-4)
    err = (plain - ref["logits_fp32"]).abs().max() / ref["logits_fp32"].abs().max()
    assert err < 1e-4, float(err)


def test_b_float64_reference_reproduces_fla_kernel(fixture):
    folder, model, ref = fixture
    layers = load_file(str(folder / "layers.safetensors"))
    inputs = load_file(str(folder / "inputs.safetensors"))
    _, saved = run_hooked(model, ref["input_ids"])
    for i in range(model.config.num_hidden_layers):
        r, beta, kappa, k, v, g, states, o_hooked = (saved[i, n].double() for n in HOOKS)
        a, b = -kappa, kappa * beta
        for name, mine in (("r", r), ("w", g), ("k", k), ("v", v), ("a", a), ("b", b)):  # fla's own, float16
            assert fro(mine[0], inputs[f"{name}.{i}"].double()) < 2e-3, (i, name)
        o, final, bounds = naive_dplr(r, k, v, a, b, g, scale=1.0)
        assert fro(o, layers[f"o.{i}"]) < 1e-5, (i, fro(o, layers[f"o.{i}"]))
        assert fro(final, layers[f"state.{i}"]) < 1e-5, (i, fro(final, layers[f"state.{i}"]))
        assert fro(o, o_hooked) < 1e-5 and fro(bounds, states) < 1e-5


def test_c_beta_zero_through_hook_equals_by_hand(fixture):
    _, model, ref = fixture
    ids, layer, head, dk = ref["input_ids"], 1, 1, model.config.head_k_dim

    def at_minus_inf(module, args, output):
        output = output.clone()
        output[..., head * dk : (head + 1) * dk] = float("-inf")
        return output

    with torch.no_grad():
        base = model(ids).logits
        handle = model.layers[layer].attn.a_lora.register_forward_hook(at_minus_inf)
        try:
            by_hand = model(ids).logits
        finally:
            handle.remove()
    assert fro(by_hand, base) > 1e-4
    nn = NNsight(model)
    with torch.no_grad(), nn.trace(ids):
        nn.layers[layer].attn.hook_beta.output[:, :, head] = 0.0
        out = nn.output.save()
    assert fro(out.logits, by_hand) < 1e-6


def test_state_edit_replays_from_the_patched_chunk(fixture):
    _, model, ref = fixture
    ids = ref["input_ids"]
    with torch.no_grad():
        base = model(ids).logits
    nn = NNsight(model)
    with torch.no_grad(), nn.trace(ids):
        nn.layers[0].attn.hook_state.output[:, 1] = 0.0  # forget everything before token 64
        out = nn.output.save()
    assert torch.equal(out.logits[:, :64], base[:, :64]) and fro(out.logits[:, 64:], base[:, 64:]) > 1e-4


def copy_fixture(tmp_path: Path, name: str = "rwkv7_fused") -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


def test_version1_stacked_mixes_load_like_fla(tmp_path):
    folder = copy_fixture(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    for i in range(2):
        pre = f"model.layers.{i}.attn."
        state[pre + "x_x"] = torch.cat([state.pop(pre + f"x_{p}").reshape(1, -1) for p in "rwkvag"])
    save_file(state, str(folder / "model.safetensors"))
    ids = load_file(str(folder / "logits.safetensors"))["input_ids"]
    with torch.no_grad():
        assert torch.equal(load_checkpoint(folder)(ids).logits, load_checkpoint(FIXTURES / "rwkv7_fused")(ids).logits)


def cli_line(*args: str) -> str:
    from typer.testing import CliRunner

    from deltalab.app.cli import app

    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_d_rwkv6_model_type_names_what_is_supported(tmp_path):
    folder = copy_fixture(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": "rwkv6"}))
    with pytest.raises(CheckpointError, match=r"'rwkv6'.*RWKV-6 or older.*RWKV-7 only.*supported: .*rwkv7"):
        load_checkpoint(folder)
    assert "rwkv7" in cli_line("info", str(folder))


@pytest.mark.parametrize("extra", ["model.layers.0.attn.bonus", "model.layers.1.attn.x_proj.0.weight"])
def test_d_rwkv6_tensor_names_name_what_is_supported(tmp_path, extra):
    folder = copy_fixture(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    state[extra] = torch.zeros(4)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"is an RWKV-6 \(or older\) layout: deltalab loads fla's rwkv7"):
        load_checkpoint(folder)
    line = cli_line("info", str(folder))
    assert "RWKV-6" in line and "\n" not in line


def test_d_blinkdl_layout_and_hybrid_config(tmp_path):
    folder = copy_fixture(tmp_path)
    save_file({"blocks.0.att.r_k": torch.zeros(4), "emb.weight": torch.zeros(4, 4)},
              str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="BlinkDL's RWKV-LM layout, not fla's"):
        load_checkpoint(folder)
    raw = json.loads((FIXTURES / "rwkv7_fused" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^rwkv7 with softmax-attention layers \('attn'\) is not supported"):
        ModelConfig.from_dict({**raw, "attn": {"layers": [1], "num_heads": 2}})


def test_info_opens_it():
    from typer.testing import CliRunner

    from deltalab.app.cli import app

    res = CliRunner().invoke(app, ["info", str(FIXTURES / "rwkv7_wide_v")])
    assert res.exit_code == 0, res.output
    assert "rwkv7" in res.stdout and "dk=32 dv=64" in res.stdout


def test_capture_stores_per_channel_beta_and_kappa(tmp_path):
    """A default capture of an rwkv7 model keeps beta per key channel and kappa (with a step axis of 1), and the
    stored q, k, v, kappa, beta, g through the float64 reference give the stored chunk-start and final states."""
    from typer.testing import CliRunner

    from deltalab import store
    from deltalab.app.cli import app
    from deltalab.store import schema

    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(FIXTURES / "rwkv7_fused"), "--data", "S4:length=70,samples=3,seed=0",
                                   "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    ds = store.open(out)
    assert ds["beta"].dims == ("seq", "layer", "pos", "step", "head", "dk") and ds.sizes["step"] == 1
    assert ds["kappa"].dims == ds["k"].dims and ds["g"].dims == ("seq", "layer", "pos", "head", "dk")
    got = {n: torch.from_numpy(np.asarray(ds[n].isel(layer=1).values)).double() for n in ("q", "k", "v", "kappa",
                                                                                          "beta", "g", "state")}
    k, v, kappa, beta = (got[n][:, :, 0] for n in ("k", "v", "kappa", "beta"))
    _, _, bounds = naive_dplr(got["q"], k, v, -kappa, kappa * beta, got["g"], scale=1.0)
    assert fro(bounds, got["state"]) < 1e-5
    with pytest.raises(ValueError, match="only rwkv7 models have a removal key"):
        schema.variables_for(["k", "kappa"], gated=True)
    res = CliRunner().invoke(app, ["probe", "betas", "--store", str(out)])  # per-channel a_rwkv (tests/probes)
    assert res.exit_code == 0, res.output


def test_trained_by_deltalab_on_a_state_tracking_task(tmp_path):
    """`deltalab train --model-type rwkv7` builds RWKV7ForCausalLM, lowers the loss on length-2 S3 words (the first
    label is the input itself), and its run folder opens as an fla-format rwkv7 checkpoint."""
    from deltalab.train.run import TrainError
    from deltalab.train.state_tracking import TrainConfig, train
    from tests.train.test_state_tracking import TINY, _losses

    cfg = TrainConfig(task="S3", model_type="rwkv7", steps=30, lr=1e-2,
                      **{**TINY, "batch_size": 32, "train_length": 2, "log_every": 5})
    train(cfg, tmp_path, device="cpu", progress=False)
    losses = _losses(tmp_path)
    assert losses[-1] < losses[0] - 0.2, losses
    model = load_checkpoint(tmp_path)
    assert model.config.model_type == "rwkv7" and (model.config.num_heads, model.config.head_dim) == (2, 8)
    with pytest.raises(TrainError, match="rwkv7 has its own token shift and gates.*drop --short-conv"):
        train(TrainConfig(task="S3", model_type="rwkv7", short_conv=True, **TINY), tmp_path / "x", device="cpu",
              progress=False)


def test_bfloat16_load_stays_close_to_fla_float32():
    """Loading in bfloat16 on the CPU keeps the recurrence in float32 (kernels.dplr.chunk; CUDA runs fla's bf16 kernel)
    and stays near fla's float32 logits."""
    ref = load_file(str(FIXTURES / "rwkv7_fused" / "logits.safetensors"))
    model = load_checkpoint(FIXTURES / "rwkv7_fused", dtype=torch.bfloat16)
    assert model.layers[0].attn.r_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits.float()
    err = (logits - ref["logits_fp32"]).abs().max() / ref["logits_fp32"].abs().max()
    assert 0 < err < 5e-2, float(err)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_cuda_matches_fla_and_hooks_edit(name):
    """On the GPU: float32 logits within 1e-4 of fla's, and a hook_beta edit through nnsight takes effect."""
    folder = FIXTURES / name
    ref = load_file(str(folder / "logits.safetensors"))
    model = load_checkpoint(folder, device="cuda")
    ids = ref["input_ids"].cuda()
    with torch.no_grad():
        plain = model(ids).logits.float().cpu()
    assert (plain - ref["logits_fp32"]).abs().max() / ref["logits_fp32"].abs().max() < 1e-4
    nn = NNsight(model)
    with torch.no_grad(), nn.trace(ids):
        nn.layers[1].attn.hook_beta.output[:, :, 0] = 0.0
        out = nn.output.save()
    assert fro(out.logits.float().cpu(), plain) > 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_cuda_bfloat16_runs_fla_kernel_near_fla_bfloat16(name, monkeypatch):
    """bfloat16 on CUDA runs fla's chunk_dplr_delta_rule (kernels.dplr.fla): our logits sit as close to fla's own
    bfloat16 logits (`logits_bf16`, recorded on CUDA by make_fla_fixtures.py --rwkv7) as fla's bfloat16 sits to
    its float32, or within 1e-2."""
    import deltalab.kernels.dplr.dispatch

    pytest.importorskip("fla")
    ref = load_file(str(FIXTURES / name / "logits.safetensors"))
    if "logits_bf16" not in ref:
        pytest.skip("fixture recorded without CUDA: regenerate on a GPU: tests/fixtures/make_fla_fixtures.py --rwkv7")

    def no_fallback(*args, **kw):
        raise AssertionError("bfloat16 on CUDA fell back to the chunked form")

    monkeypatch.setattr(deltalab.kernels.dplr.dispatch, "chunk_dplr", no_fallback)
    model = load_checkpoint(FIXTURES / name, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ours = model(ref["input_ids"].cuda()).logits.float().cpu()
    scale = ref["logits_fp32"].abs().max()
    ours_err = float((ours - ref["logits_bf16"]).abs().max() / scale)
    fla_err = float((ref["logits_bf16"] - ref["logits_fp32"]).abs().max() / scale)
    print(f"{name}: ours bf16 vs fla bf16 {ours_err:.2e}, fla bf16 vs fla fp32 {fla_err:.2e}")
    assert ours_err < max(2 * fla_err, 1e-2)
