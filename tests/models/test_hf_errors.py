"""Bad transformers folders: one CheckpointError line naming the problem and the fix; exit code 2 from the CLI."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from deltalab.models import CheckpointError, load_checkpoint  # noqa: E402
from deltalab.models.hf import check_transformers  # noqa: E402
from tests.models.hf_tiny import save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny("olmo_hybrid", tmp_path_factory.mktemp("olmo"))


@pytest.fixture
def folder(saved, tmp_path):
    """A fresh copy of the tiny OLMo-Hybrid folder, to break."""
    out = tmp_path / "model"
    out.mkdir()
    for f in saved.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def cli_error(*args: str) -> str:
    """Run `deltalab ARGS` in-process; assert exit code 2 and one stderr line; return it."""
    from deltalab.app.cli import app

    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_model_type_without_delta_layers_lists_supported(folder):
    edit_config(folder, model_type="llama")
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'.*supported: .*gated_deltanet.*olmo_hybrid"):
        load_checkpoint(folder)
    line = cli_error("info", str(folder))
    assert "qwen3_next" in line and "qwen4_exp" in line


def test_no_linear_layer(folder):
    edit_config(folder, layer_types=["full_attention"] * 4)
    with pytest.raises(CheckpointError, match="no linear_attention layer"):
        load_checkpoint(folder)


def test_remote_code_refused(folder):
    edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(CheckpointError, match="needs remote code.*never runs trust_remote_code"):
        load_checkpoint(folder)
    edit_config(folder, model_type="my_custom_rnn")
    assert "remote code" in cli_error("info", str(folder))


def test_missing_shard(tmp_path):
    folder = save_tiny("olmo_hybrid", tmp_path / "sharded", max_shard_size="30KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    load_checkpoint(folder)  # sharded loads
    (folder / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=f"lacks shard {shards[1]}.*download every shard"):
        load_checkpoint(folder)
    assert "lacks shard" in cli_error("info", str(folder))


def test_pickled_weights_refused(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_checkpoint(folder)


def test_transformers_version_out_of_range(folder, monkeypatch):
    assert check_transformers("5.23.0") == "5.23.0" and check_transformers("5.40.1") == "5.40.1"
    for bad in ("4.57.1", "5.22.0", "6.0.0"):
        with pytest.raises(CheckpointError, match=f"transformers {bad} is not supported.*>=5.23,<6"):
            check_transformers(bad)
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    assert "pip install 'transformers>=5.23,<6'" in cli_error("info", str(folder))


def test_family_newer_than_the_installed_transformers():
    """Lara-Mini ships with transformers 5.24: under 5.23 (inside deltalab's range) it is one line naming the
    version to install, not transformers' own failure to import its module."""
    from deltalab.models.hf.families import FAMILIES
    from deltalab.models.hf.loader import check_family_version

    lara = FAMILIES["lara_mini"]
    with pytest.raises(CheckpointError, match=r"needs transformers >= 5\.24, found 5\.23\.0: pip install "
                                              r"'transformers>=5\.24,<6'"):
        check_family_version(lara, "5.23.0")
    check_family_version(lara, "5.24.0")
    check_family_version(FAMILIES["olmo_hybrid"], "5.23.0")
