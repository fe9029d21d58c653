"""Both trainers build real Kimi Delta Attention (`kda`) models: the run folder is an fla `kda` checkpoint that
reloads through models.checkpoint with one log decay per key channel (hook_g [B, T, Hv, dk]); model types and
options a trainer cannot build are one-line errors naming what it can build."""

from __future__ import annotations

import json

import pytest
import torch
from nnsight import NNsight
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.models import DeltaProductForCausalLM, load_checkpoint
from deltalab.models.config import MODEL_TYPES
from deltalab.tasks.state_tracking import get_task
from deltalab.train.lm import LMTrainConfig, LMTrainError, train_lm
from deltalab.train.run import STATE_FILE, TrainError
from deltalab.train.state_tracking import TrainConfig, train
from tests.train.test_lm import small
from tests.train.test_state_tracking import TINY


def captured_g(model, ids: torch.Tensor) -> torch.Tensor:
    """hook_g of layer 0, read through nnsight as capture reads it."""
    nn = NNsight(model)
    with torch.no_grad(), nn.trace(ids):
        g = nn.layers[0].attn.hook_g.output.save()
    return g


def _check_kda_run(folder, heads: int, v_heads: int, dk: int, ids: torch.Tensor) -> torch.Tensor:
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "kda" and raw["architectures"] == ["KDAForCausalLM"]
    assert raw["head_dim"] == dk and raw.get("num_v_heads", heads) == v_heads
    model = load_checkpoint(folder)
    assert isinstance(model, DeltaProductForCausalLM) and model.config.gate == "channel"
    attn = model.layers[0].attn
    assert attn.dt_bias.shape == (v_heads * dk,) and hasattr(attn, "f_proj") and not hasattr(attn, "a_proj")
    g = captured_g(model, ids)
    B, T = ids.shape
    assert g.shape == (B, T, v_heads, dk) and float(g.max()) <= 0
    assert not torch.equal(g[..., 0], g[..., 1])  # one decay per key channel, not one per head
    return g


def test_task_trainer_cli_writes_a_kda_checkpoint(tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", "S3", "--out", str(run), "--model-type", "kda", "--heads", "2",
                                   "--head-dim", "8", "--num-v-heads", "4", "--steps", "2", "--batch-size", "8",
                                   "--train-length", "16", "--eval-every", "0", "--device", "cpu",
                                   "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["step"] == 2
    x, _ = get_task("S3").generate(16, 3, 0)
    _check_kda_run(run, 2, 4, 8, x)
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["model_type"] == "kda" and saved["num_v_heads"] == 4


def test_task_trainer_api_bounded_kda_trains_and_resumes(tmp_path):
    cfg = TrainConfig(task="S3", model_type="kda", lower_bound=-5.0, steps=3, **TINY)
    part = train(cfg, tmp_path, device="cpu", progress=False, stop_after=2)
    assert part.step == 2
    done = train(TrainConfig(task="ignored-on-resume"), tmp_path, resume=True, device="cpu", progress=False)
    assert done.finished and done.step == 3
    assert json.loads((tmp_path / "config.json").read_text())["lower_bound"] == -5.0
    x, _ = get_task("S3").generate(16, 2, 1)
    g = _check_kda_run(tmp_path, 2, 2, 8, x)
    assert float(g.min()) >= -5.0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(model_type="kda", num_householder=2), "^kda has one Householder step per token: drop --num-householder"),
    (dict(model_type="gated_deltaproduct", num_v_heads=4), "^--num-v-heads groups value heads in gated_deltanet "
                                                           "and kda only"),
    (dict(model_type="gated_deltanet", lower_bound=-5.0), "^--lower-bound bounds kda's per-channel gate only"),
    (dict(model_type="kda", lower_bound=1.0), "^--lower-bound must be < 0"),
    (dict(model_type="mamba"), "^unknown --model-type 'mamba': choose " + ", ".join(MODEL_TYPES) + "$"),
])
def test_task_trainer_refuses_in_one_line(tmp_path, kwargs, needle):
    with pytest.raises(TrainError, match=needle) as err:
        train(TrainConfig(**{"task": "S3", **TINY, "steps": 1, **kwargs}), tmp_path, device="cpu", progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / STATE_FILE).exists()


def test_task_trainer_cli_names_the_supported_model_types(tmp_path):
    res = CliRunner().invoke(app, ["train", "S3", "--out", str(tmp_path / "x"), "--model-type", "mamba"])
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line and line.endswith("choose " + ", ".join(MODEL_TYPES))


def test_lm_trainer_writes_a_kda_checkpoint(corpus_root, tmp_path):
    cfg = small(corpus_root, model_type="kda", num_v_heads=4, steps=2, eval_every=0, save_every=0)
    done = train_lm(cfg, tmp_path, device="cpu", progress=False)
    assert done.finished and done.eval["perplexity"] > 1
    ids = torch.randint(0, 256, (2, 12))
    _check_kda_run(tmp_path, 2, 4, 8, ids)
    card = (tmp_path / "README.md").read_text()
    assert "| model_type | kda |" in card and "| forget gate | per key channel |" in card
    assert "| heads | 2 key / 4 value |" in card


LM_TYPES = "gated_deltaproduct, delta_net, gated_deltanet, kda"


@pytest.mark.parametrize("kwargs,needle", [
    (dict(model_type="kda", num_householder=2), "^kda has one Householder step per token"),
    (dict(model_type="kda", output_gate=False), "^kda always has its sigmoid output gate"),
    (dict(model_type="delta_net", num_v_heads=4), "^--num-v-heads groups value heads in gated_deltanet and kda"),
    (dict(model_type="rwkv7"), f"^--model-type rwkv7: the language-model trainer builds {LM_TYPES}; "),
    (dict(model_type="mamba"), f"^unknown --model-type 'mamba': choose {LM_TYPES}$"),
])
def test_lm_trainer_refuses_in_one_line(corpus_root, tmp_path, kwargs, needle):
    with pytest.raises(LMTrainError, match=needle) as err:
        train_lm(small(corpus_root, **kwargs), tmp_path, device="cpu", progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / STATE_FILE).exists()


def test_lm_model_types_are_the_ones_model_config_builds(corpus_root):
    from deltalab.train.lm import model_config

    for kind in LMTrainConfig.model_types:
        assert model_config(small(corpus_root, model_type=kind)).model_type == kind
