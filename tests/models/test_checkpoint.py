"""Checkpoint I/O: round trips, legacy layouts, and one clear error per kind of bad checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltalab.models import CheckpointError, DeltaProductForCausalLM, ModelConfig, load_checkpoint, save_checkpoint

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fla" / "gdp_nh2_all"


def tiny(**kw) -> DeltaProductForCausalLM:
    base = dict(model_type="gated_deltaproduct", vocab_size=16, hidden_size=32, num_hidden_layers=1, num_heads=2,
                head_dim=16, expand_v=1.0, num_householder=2, use_forget_gate=True, allow_neg_eigval=True)
    return DeltaProductForCausalLM(ModelConfig(**{**base, **kw}))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, folder)
    return folder


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


@pytest.mark.parametrize("kw", [dict(), dict(model_type="delta_net", num_heads=2), dict(model_type="gated_deltanet"),
                                dict(tie_word_embeddings=True), dict(num_householder=3, use_short_conv=False)])
def test_save_load_round_trip(tmp_path, kw):
    model = tiny(**kw).eval()
    save_checkpoint(model, tmp_path / "m")
    again = load_checkpoint(tmp_path / "m")
    ids = torch.randint(0, 16, (1, 40))
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert not again.training
    names = load_file(str(tmp_path / "m" / "model.safetensors")).keys()
    assert all(n.startswith("model.") or n.startswith("lm_head.") for n in names)


def test_dtype_and_device_arguments(ckpt):
    model = load_checkpoint(ckpt, device="cpu", dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.A_log.dtype == torch.float32  # gate parameters stay float32, as in fla


def test_missing_folder(tmp_path):
    expect_error(tmp_path / "nope", "does not exist")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    expect_error(ckpt, "config.json", "missing")


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    expect_error(ckpt, "model.safetensors")


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect_error(ckpt, "unknown model_type 'mamba'")


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    expect_error(ckpt, "not valid JSON")


def _edit_weights(ckpt: Path, edit) -> None:
    state = load_file(str(ckpt / "model.safetensors"))
    edit(state)
    save_file(state, str(ckpt / "model.safetensors"))


def test_missing_tensor_named(ckpt):
    _edit_weights(ckpt, lambda s: s.pop("model.layers.1.attn.b_proj.weight"))
    expect_error(ckpt, "missing tensor", "layers.1.attn.b_proj.weight")


def test_unexpected_tensor_named(ckpt):
    _edit_weights(ckpt, lambda s: s.__setitem__("model.layers.0.attn.extra.weight", torch.zeros(2)))
    expect_error(ckpt, "unexpected tensor", "layers.0.attn.extra.weight")


def test_misshaped_tensor_named(ckpt):
    _edit_weights(ckpt, lambda s: s.__setitem__("model.layers.0.attn.q_proj.weight", torch.zeros(3, 64)))
    expect_error(ckpt, "layers.0.attn.q_proj.weight", "shape (3, 64)")


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    expect_error(ckpt, "truncated or corrupt")


def test_corrupt_safetensors_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-garbage-")
    expect_error(ckpt, "truncated or corrupt")


def test_pickle_only_checkpoint_is_refused_naming_the_conversion(ckpt, monkeypatch):
    """safetensors only: a folder holding pytorch_model.bin is refused before anything is unpickled."""
    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load called in the load path")

    monkeypatch.setattr(torch, "load", no_unpickling)
    msg = expect_error(ckpt, "pickled weights", "safetensors only", "save_file")
    assert "\n" not in msg


def test_pickle_with_code_is_refused_unread(ckpt):
    (ckpt / "model.safetensors").unlink()
    torch.save({"evil": Path("/tmp")}, ckpt / "pytorch_model.bin")
    expect_error(ckpt, "pickled weights", "never unpickles")


def test_legacy_per_step_layout_and_use_gate(tmp_path):
    """The DeltaProduct authors' `k_projs.{j}` lists and `use_gate` load into the fused fla layout."""
    model = tiny(use_output_gate=True).eval()
    save_checkpoint(model, tmp_path / "new")
    state = load_file(str(tmp_path / "new" / "model.safetensors"))
    legacy = {}
    for name, t in state.items():
        stem = name.rsplit(".", 1)[0]
        for fused in ("k_proj", "v_proj", "b_proj", "k_conv1d", "v_conv1d"):
            if stem.endswith(f"attn.{fused}"):
                plural = fused.replace("_proj", "_projs").replace("_conv1d", "_conv1ds")
                for j, part in enumerate(t.chunk(2, 0)):
                    legacy[name.replace(f".{fused}.", f".{plural}.{j}.")] = part.clone()
                break
        else:
            legacy[name] = t
    folder = tmp_path / "legacy"
    folder.mkdir()
    save_file(legacy, str(folder / "model.safetensors"))
    cfg = json.loads((tmp_path / "new" / "config.json").read_text())
    cfg["use_gate"] = cfg.pop("use_output_gate")
    (folder / "config.json").write_text(json.dumps(cfg))
    again = load_checkpoint(folder)
    assert again.config.use_output_gate
    ids = torch.randint(0, 16, (1, 30))
    assert torch.equal(model(ids).logits, again(ids).logits)
