"""Hostile or damaged checkpoint folders: every one is a single `error:` line, exit 2, before any model is built
(config.json's fields by type and range, memory, regular files with a size cap, float dtypes, finite weights,
safetensors only)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import deltalab.models.checkpoint as checkpoint
from deltalab.app.cli import app
from deltalab.models import CheckpointError, load_checkpoint

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fla" / "gdp_nh2_all"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "ckpt"))


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if a model is built (i.e. memory allocated for it) before the input is refused."""
    def refuse(config):
        raise AssertionError(f"a model was built from a config that should have been refused: {config}")

    monkeypatch.setattr(checkpoint, "build_model", refuse)


def _edit_config(folder: Path, **changes) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def one_line(folder: Path) -> str:
    res = CliRunner().invoke(app, ["info", str(folder)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.mark.parametrize("key, value, fragment", [
    ("num_heads", "12", "'num_heads' is '12' (str): it must be an integer"),
    ("vocab_size", None, "'vocab_size' is None"),
    ("expand_v", float("nan"), "'expand_v' is nan (float): it must be a finite number"),
    ("expand_v", float("inf"), "'expand_v' is inf"),
    ("allow_neg_eigval", "false", "'allow_neg_eigval' is 'false' (str): it must be true or false"),
    ("use_forget_gate", 1, "'use_forget_gate' is 1 (int)"),
    ("num_hidden_layers", 10**6, "'num_hidden_layers' is 1000000 (int): it must be an integer 1..4096"),
    ("hidden_size", 10**30, "'hidden_size' is 1000000000000000000000000000000"),
    ("num_householder", 0, "'num_householder' is 0"),
    ("head_dim", 32.0, "'head_dim' is 32.0 (float)"),
    ("hidden_act", ["swish"], "'hidden_act' is ['swish'] (list): it must be a string"),
])
def test_bad_config_field_is_one_line_naming_the_key_before_any_build(ckpt, no_build, key, value, fragment):
    _edit_config(ckpt, **{key: value})
    line = one_line(ckpt)
    assert fragment in line and "fix it in config.json" in line, line


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(ckpt, no_build, monkeypatch):
    monkeypatch.setattr("deltalab.models.config.available_memory", lambda: 2 * 10**9)
    _edit_config(ckpt, num_hidden_layers=4000, hidden_size=4096, head_dim=2048)
    line = one_line(ckpt)
    assert "GB of memory is available" in line and "num_hidden_layers" not in line.split(":")[0], line


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "huge"])
def test_config_json_must_be_a_regular_file_of_sane_size(ckpt, no_build, kind):
    cfg = ckpt / "config.json"
    cfg.unlink()
    if kind == "dev-zero":
        cfg.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(cfg)
    elif kind == "folder":
        cfg.mkdir()
    else:
        with open(cfg, "wb") as f:  # sparse: 100 MB of size on no disk
            f.truncate(100 * 1024 * 1024)
    line = one_line(ckpt)
    want = {"dev-zero": "is a device, not a regular file", "fifo": "is a FIFO, not a regular file",
            "folder": "is a folder, not a regular file", "huge": "MB, more than the"}[kind]
    assert want in line, line


def test_a_symlink_to_a_regular_config_still_loads(ckpt, tmp_path):
    real = tmp_path / "elsewhere.json"
    shutil.move(ckpt / "config.json", real)
    (ckpt / "config.json").symlink_to(real)
    assert load_checkpoint(ckpt).config.num_hidden_layers == 2


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64])
def test_integer_or_bool_weights_are_refused_not_cast(ckpt, dtype):
    state = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.attn.q_proj.weight"
    state[name] = torch.ones_like(state[name]).to(dtype)
    save_file(state, str(ckpt / "model.safetensors"))
    line = one_line(ckpt)
    assert f"tensor {name} is stored as {str(dtype).removeprefix('torch.')}" in line and "does not cast" in line


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_named_at_load_unless_allowed(ckpt, value):
    state = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    state[name][0, :3] = value
    save_file(state, str(ckpt / "model.safetensors"))
    line = one_line(ckpt)
    assert f"tensor {name} holds 3 NaN/Inf" in line, line
    assert "--allow-nonfinite" in line
    model = load_checkpoint(ckpt, allow_nonfinite=True)
    assert model.nonfinite_tensors == [name]


def test_finite_checkpoint_records_no_nonfinite(ckpt):
    assert load_checkpoint(ckpt).nonfinite_tensors == []


def test_pickle_only_folder_is_refused_with_the_conversion(ckpt, no_build):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    line = one_line(ckpt)
    assert "safetensors only" in line and "save_file" in line, line
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_checkpoint(ckpt)


def test_weights_file_that_is_a_fifo_is_refused(ckpt):
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    assert "is a FIFO, not a regular file" in one_line(ckpt)


@pytest.mark.slow  # builds and loads a transformers model
def test_nonfinite_weights_of_a_transformers_model_named_unless_allowed(tmp_path):
    pytest.importorskip("transformers")
    from tests.models.hf_tiny import save_tiny

    folder = save_tiny("olmo_hybrid", tmp_path / "olmo")
    files = sorted(folder.glob("*.safetensors"))
    state = load_file(str(files[0]))
    name = next(n for n, t in state.items() if t.is_floating_point() and t.ndim == 2)
    state[name][0, 0] = float("inf")
    save_file(state, str(files[0]), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="holds NaN/Inf value.*--allow-nonfinite"):
        load_checkpoint(folder)
    model = load_checkpoint(folder, allow_nonfinite=True)
    assert len(model.nonfinite_tensors) == 1 and model.nonfinite_tensors[0].endswith(name.split(".", 1)[-1])
