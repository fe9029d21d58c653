"""The bundled RWKV-7 on running parity (models/zoo/parity-rwkv7), written by deltalab's trainer in fla's format.

It loads as an fla rwkv7 model, still solves its task on fresh sequences at its training length (a bound below
the accuracy its model card reports, so the test fails if the weights or the rwkv7 forward change meaningfully),
stays under the size the zoo allows, and `deltalab info` / the app's data spec open it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from deltalab.models import RWKV7ForCausalLM, load_checkpoint
from deltalab.tasks.state_tracking import get_task
from deltalab.train.evaluate import evaluate

ZOO_RWKV7 = Path(__file__).resolve().parents[2] / "models" / "zoo" / "parity-rwkv7"
TOKEN_BOUND = 0.97
"""Token accuracy at the training length (64) on fresh sequences; the card reports 0.989 on 512 sequences."""


def _task() -> dict:
    return json.loads((ZOO_RWKV7 / "task.json").read_text())


def test_bundled_rwkv7_is_small_and_opens_as_fla_rwkv7():
    files = {p.name: p.stat().st_size for p in ZOO_RWKV7.iterdir()}
    assert {"config.json", "model.safetensors", "task.json", "train_config.json", "README.md"} <= set(files)
    assert sum(files.values()) < 1_000_000, files
    assert json.loads((ZOO_RWKV7 / "config.json").read_text())["model_type"] == "rwkv7"
    model = load_checkpoint(ZOO_RWKV7, device="cpu")
    assert isinstance(model, RWKV7ForCausalLM) and model.config.model_type == "rwkv7"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bundled_rwkv7_solves_its_task_at_training_length():
    spec = _task()
    task = get_task(spec["name"])
    model = load_checkpoint(ZOO_RWKV7, device="cpu")
    torch.set_num_threads(1)
    length = int(spec["train_length"])
    res = evaluate(model, task, [length], samples=128, seed=987_654, curves=False)  # not a training seed
    token = res["accuracy"][str(length)]["token"]
    assert token >= TOKEN_BOUND, res["accuracy"]


def test_info_and_app_data_spec_open_it(tmp_path, monkeypatch):
    from deltalab.app.cli import app
    from deltalab.app.default_store import checkpoint_data_spec

    res = CliRunner().invoke(app, ["info", str(ZOO_RWKV7)])
    assert res.exit_code == 0, res.output
    assert "rwkv7" in res.stdout
    monkeypatch.setenv("DELTALAB_CACHE", str(tmp_path / "cache"))
    assert checkpoint_data_spec(ZOO_RWKV7).startswith(f"{_task()['name']}:length=")


def test_card_spectra_script_matches_dense_eig_on_a_capture(tmp_path):
    """The card's token_spectra.py (its spectra table) on a fresh capture: its smallest eigenvalues equal dense
    float64 eig of diag(w) - (kappa * a) kappa^T built from the stored tensors (as its transpose, which has the
    same eigenvalues), and stay above min w - 1."""
    import importlib.util

    import numpy as np

    from deltalab import store
    from deltalab.app.cli import app

    out = tmp_path / "p.zarr"
    res = CliRunner().invoke(app, ["capture", str(ZOO_RWKV7), "--data", "parity:length=20,samples=3,seed=5",
                                   "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    path = ZOO_RWKV7 / "token_spectra.py"
    spec = importlib.util.spec_from_file_location("token_spectra", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokens, smallest = script.smallest_eigenvalues(str(out))
    ds = store.open(out)
    assert smallest.shape == (3, ds.sizes["layer"], 20, ds.sizes["head"])
    w = np.exp(np.asarray(ds["g"].values, dtype=np.float64))  # [S, L, T, H, K]
    kappa = np.asarray(ds["kappa"].values, dtype=np.float64)[:, :, :, 0]
    a = np.asarray(ds["beta"].values, dtype=np.float64)[:, :, :, 0]
    dense = np.linalg.eigvals(w[..., :, None] * np.eye(w.shape[-1]) - kappa[..., :, None] * (kappa * a)[..., None, :])
    assert np.abs(dense.imag).max() < 1e-9
    np.testing.assert_allclose(smallest, dense.real.min(-1), atol=1e-9)
    assert (smallest > w.min(-1) - 1 - 1e-9).all() and smallest.min() > -0.4551
    summary = script.summarise(tokens, smallest)
    assert set(summary[0][0]) >= {"x=0", "x=1", "prev=1,x=1"}
