"""`deltalab app CHECKPOINT`: a model folder (fla or transformers) is captured over its task or sample text and
probed into a cached store once, then the dashboard opens that store; bad folders fail in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltalab import store
from deltalab.app import cmd_app
from deltalab.app.cli import app as cli
from deltalab.app.default_store import checkpoint_data_spec, checkpoint_store_path, is_built, probes_for

ZOO = Path(__file__).parents[2] / "models" / "zoo"
HYBRID = Path(__file__).parents[1] / "fixtures" / "fla" / "gdn_hybrid_gva"


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Run `deltalab app ...` without starting Streamlit: record the argv it would exec."""
    monkeypatch.setenv("DELTALAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    calls: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:  # exec replaces the process: nothing after it runs
        calls.append(list(argv))
        raise SystemExit(0)

    monkeypatch.setattr(cmd_app.os, "execv", execv)
    return calls


def _wait_built(out: Path, timeout_s: float = 240.0) -> dict:
    """The background build's final report (`deltalab app CHECKPOINT` builds while the server starts)."""
    import time

    from deltalab.app import build_job

    deadline = time.monotonic() + timeout_s
    while (info := build_job.read_progress(out) or {}) and not (info.get("done") or info.get("error")):
        assert time.monotonic() < deadline, f"the build did not finish: {info}"
        time.sleep(0.5)
    return info


def test_text_checkpoint_opens_its_probed_store(launched, tmp_path):
    ckpt = tmp_path / "lm"
    shutil.copytree(ZOO / "stdlib-gated-deltanet", ckpt)
    spec = checkpoint_data_spec(ckpt)
    assert spec.startswith("text:") and spec.endswith(":length=256,tokenizer=auto")
    res = CliRunner().invoke(cli, ["app", str(ckpt)])
    assert res.exit_code == 0, res.output
    out = checkpoint_store_path(ckpt)
    assert launched and launched[0][-1] == str(out) and launched[0][1:3] == ["-m", "deltalab.app.serve"]
    info = _wait_built(out)
    assert info["done"] and not info["error"] and info["fraction"] == 1.0
    assert is_built(out, ckpt.resolve(), spec=spec)
    ds = store.open(out)
    assert ds.attrs["data_spec"] == spec and ds.sizes["pos"] == 256 and ds.sizes["seq"] >= 8
    from deltalab.store.reader import list_results

    assert {"betas", "keys", "spectra", "erank", "lengthgen"} <= set(list_results(out))
    assert "linear" not in list_results(out)  # text stores skip it, and the marker records the probes run
    assert json.loads(out.with_name(out.name + ".built.json").read_text())["probes"] == list(probes_for(spec))
    mtime = (out / "zarr.json").stat().st_mtime_ns
    res = CliRunner().invoke(cli, ["app", str(ckpt)])  # second launch: opened at once, nothing rebuilt
    assert res.exit_code == 0 and (out / "zarr.json").stat().st_mtime_ns == mtime


def test_task_checkpoint_captures_its_task(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTALAB_CACHE", str(tmp_path / "cache"))
    assert checkpoint_data_spec(ZOO / "s4-deltaproduct2").startswith("S4:length=")


def test_hybrid_fla_checkpoint_store_keeps_real_layers(launched, tmp_path):
    res = CliRunner().invoke(cli, ["app", str(HYBRID)])  # vocabulary 64, no tokenizer, no task: one line
    assert res.exit_code == 2 and not launched
    assert res.output.strip().splitlines()[-1].startswith(f"error: capturing {HYBRID.name} into ")
    assert "outside the model's vocabulary (0..63)" in res.output
    ckpt = tmp_path / "hybrid"
    shutil.copytree(HYBRID, ckpt)
    (ckpt / "task.json").write_text('{"name": "S4", "train_length": 64}')
    res = CliRunner().invoke(cli, ["app", str(ckpt)])
    assert res.exit_code == 0, res.output
    assert _wait_built(checkpoint_store_path(ckpt))["done"]
    ds = store.open(checkpoint_store_path(ckpt))
    assert ds.attrs["data_spec"].startswith("S4:length=128")
    assert ds["layer"].values.tolist() == [0, 2] and ds.sizes["head"] == 4


def test_broken_checkpoint_fails_in_one_line(launched, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gated_deltanet"}')
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    res = CliRunner().invoke(cli, ["app", str(bad)])
    assert res.exit_code == 2 and not launched
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "truncated or corrupt" in lines[0]
