"""Capture under nnsight into a store: values, crash safety (SIGKILL + resume), disk full, CLI errors, torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from deltalab import store
from deltalab.app.cli import app
from deltalab.kernels import naive_delta_product
from deltalab.models import DeltaProductForCausalLM, ModelConfig, load_checkpoint, save_checkpoint
from tests.conftest import fill_disk

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
SPEC = "S4:length=130,samples=10,seed=0"


def tiny_config(**over) -> ModelConfig:
    kw = dict(model_type="gated_deltaproduct", vocab_size=24, hidden_size=32, num_hidden_layers=2, num_heads=2,
              head_dim=16, expand_v=1.0, num_householder=2, use_forget_gate=True, use_output_gate=False,
              use_short_conv=False, allow_neg_eigval=True)
    kw.update(over)
    return ModelConfig(**kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(DeltaProductForCausalLM(tiny_config()), tmp_path_factory.mktemp("ckpt") / "gdp")


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Every file but the root metadata (its `created`/`command_line` differ between runs)."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.relative_to(path).as_posix() != "zarr.json"}


def test_capture_matches_model_and_float64_reference(ckpt, tmp_path):
    out = tmp_path / "s.zarr"
    summary = store.capture(ckpt, SPEC, out, batch_size=4, progress=False)
    assert summary["written"] == 10 and summary["complete"] == 10
    ds = store.open(out)
    assert set(ds.data_vars) == {"tokens", "labels", "doc_start", "pad", "loss", "correct", "q", "k", "v", "beta", "g",
                                 "state", "complete"}
    assert ds.sizes["chunk"] == 4 and ds["chunk_pos"].values.tolist() == [0, 64, 128, 130]
    model = load_checkpoint(ckpt)
    seen: dict[str, list[torch.Tensor]] = {}
    for i, block in enumerate(model.layers):
        for name in ("q", "k", "v", "beta", "g", "state"):
            getattr(block.attn, f"hook_{name}").register_forward_hook(
                lambda m, a, o, key=f"{name}{i}": seen.setdefault(key, []).append(o))
    x = torch.from_numpy(ds["tokens"].values.astype(np.int64))
    y = torch.from_numpy(ds["labels"].values.astype(np.int64))
    with torch.no_grad():  # the same batches as the capture: CPU matmuls may differ in the last bit otherwise
        logits = torch.cat([model(x[a:a + 4]).logits for a in range(0, 10, 4)])
    seen = {key: torch.cat(parts) for key, parts in seen.items()}
    for i in range(2):
        for name in ("q", "k", "v", "beta", "g", "state"):
            np.testing.assert_array_equal(ds[name].sel(layer=i).values, seen[f"{name}{i}"].numpy(), err_msg=name)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    np.testing.assert_allclose(ds["loss"].values, ce.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ds["correct"].values, (logits.argmax(-1) == y).numpy())
    # chunk-boundary states agree with the float64 recurrence run on the captured inputs
    lay = store.select(ds, layer=1)
    args = [torch.from_numpy(lay[n].values).double() for n in ("q", "k", "v", "beta", "g")]
    _, final, bounds = naive_delta_product(*args, scale=16 ** -0.5)
    np.testing.assert_allclose(lay["state"].values, bounds.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lay["state"].values[:, -1], final.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_min_bytes", [1 << 30, 0], ids=["stacked", "layer by layer"])
def test_gpu_capture_equals_the_hooked_forward(tmp_path, monkeypatch, stream_min_bytes):
    """On CUDA the capture copies asynchronously into pinned memory: every batch must still be the one hooked,
    whether a variable is stacked on the device first or copied to the host layer by layer (large variables)."""
    import deltalab.store.runner

    monkeypatch.setattr(deltalab.store.runner, "STREAM_MIN_BYTES", stream_min_bytes)
    torch.manual_seed(2)
    ck = save_checkpoint(DeltaProductForCausalLM(tiny_config(hidden_size=64, head_dim=32)), tmp_path / "ck")
    out = tmp_path / "gpu.zarr"
    n, batch = 40, 4  # ten batches: the writer queue fills and the copies overlap the next forward
    store.capture(ck, f"S4:length=200,samples={n},seed=0", out, batch_size=batch, device="cuda",
                  dtype="float32", progress=False)
    ds = store.open(out)
    model = load_checkpoint(ck, device="cuda")
    seen: dict[str, list[torch.Tensor]] = {}
    for i, block in enumerate(model.layers):
        for name in ("q", "k", "v", "beta", "g", "state"):
            getattr(block.attn, f"hook_{name}").register_forward_hook(
                lambda m, a, o, key=f"{name}{i}": seen.setdefault(key, []).append(o.float().cpu()))
    x = torch.from_numpy(ds["tokens"].values.astype(np.int64)).cuda()
    with torch.no_grad():
        for a in range(0, n, batch):
            model(x[a:a + batch])
    for i in range(2):
        for name in ("q", "k", "v", "beta", "g", "state"):
            np.testing.assert_array_equal(ds[name].sel(layer=i).values, torch.cat(seen[f"{name}{i}"]).numpy(),
                                          err_msg=f"{name}, layer {i}")
    lay = store.select(ds, layer=0)
    args = [torch.from_numpy(lay[v].values).double() for v in ("q", "k", "v", "beta", "g")]
    _, _, bounds = naive_delta_product(*args, scale=32 ** -0.5)
    np.testing.assert_allclose(lay["state"].values, bounds.numpy(), rtol=1e-3, atol=1e-4)


def test_layers_dtype_and_ungated(tmp_path):
    torch.manual_seed(1)
    ck = save_checkpoint(DeltaProductForCausalLM(tiny_config(use_forget_gate=False, num_householder=1)),
                         tmp_path / "dn")
    (ck / "task.json").write_text(json.dumps({"name": "parity", "train_length": 16}))  # as the trainer saves it
    out = tmp_path / "s.zarr"
    store.capture(ck, "parity:length=20,samples=3,seed=0", out, layers="1", dtype="float16",
                  hooks="tokens,k,beta,g,state,o,resid_post", progress=False)
    ds = store.open(out)
    assert set(ds.data_vars) == {"tokens", "doc_start", "pad", "k", "beta", "state", "o", "resid_post", "complete"}
    assert ds["layer"].values.tolist() == [1] and ds["k"].dtype == np.float16 and ds.sizes["step"] == 1
    assert ds["resid_post"].dims == ("seq", "layer", "pos", "hidden") and ds.sizes["hidden"] == 32
    assert ds.attrs["hooks"] == ["tokens", "k", "beta", "g", "state", "o", "resid_post"]  # g: ungated, none
    assert ds.attrs["train_length"] == 16


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(ckpt, tmp_path):
    spec = "S4:length=130,samples=48,seed=1"
    killed, clean = tmp_path / "killed.zarr", tmp_path / "clean.zarr"
    cmd = [sys.executable, "-m", "deltalab.app.cli", "capture", str(ckpt), "--data", spec, "--out", str(killed),
           "--batch-size", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (killed / "complete" / "c" / "3").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ds = store.open(killed)
    n = ds.sizes["seq"]
    assert 8 <= n < 48, "the capture finished before the kill; make it longer"
    assert ds["complete"].values.all() and np.isfinite(ds["k"].values).all()
    resumed = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "skipped" in resumed.stdout
    store.capture(ckpt, spec, clean, batch_size=2, progress=False)
    assert tree_bytes(killed) == tree_bytes(clean)
    a = json.loads((killed / "zarr.json").read_text())["attributes"]
    b = json.loads((clean / "zarr.json").read_text())["attributes"]
    assert {k: v for k, v in a.items() if k not in ("created", "command_line")} == \
        {k: v for k, v in b.items() if k not in ("created", "command_line")}


def test_disk_full_during_capture_then_resume(ckpt, tmp_path, monkeypatch):
    out, clean = tmp_path / "s.zarr", tmp_path / "clean.zarr"
    with monkeypatch.context() as patch:
        fill_disk(patch, lambda key: key.startswith("k/c/2/"))
        with pytest.raises(store.StoreWriteError, match="disk full") as err:
            store.capture(ckpt, SPEC, out, batch_size=2, progress=False)
    assert "\n" not in str(err.value)
    assert store.open(out)["seq"].values.tolist() == [0, 1, 2, 3]
    store.capture(ckpt, SPEC, out, progress=False)
    store.capture(ckpt, SPEC, clean, batch_size=2, progress=False)
    assert tree_bytes(out) == tree_bytes(clean)


def test_cli_bad_input_exits_2_with_one_line(ckpt, tmp_path):
    runner = CliRunner()
    out = tmp_path / "s.zarr"
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ckpt, corrupt)
    (corrupt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:100])
    torch.manual_seed(5)
    other = save_checkpoint(DeltaProductForCausalLM(tiny_config()), tmp_path / "other")
    ok = runner.invoke(app, ["capture", str(ckpt), "--data", SPEC, "--out", str(out), "--no-progress"])
    assert ok.exit_code == 0, ok.output
    newer = tmp_path / "newer.zarr"
    shutil.copytree(out, newer)
    meta = json.loads((newer / "zarr.json").read_text())
    meta["attributes"]["deltalab_format"] = 99
    (newer / "zarr.json").write_text(json.dumps(meta))
    cases = [
        (["capture", str(tmp_path / "nope"), "--data", SPEC, "--out", str(out)], "does not exist"),
        (["capture", str(corrupt), "--data", SPEC, "--out", str(tmp_path / "c.zarr")], "corrupt"),
        (["capture", str(ckpt), "--data", "A5:length=8,samples=2,seed=0", "--out", str(tmp_path / "d.zarr")],
         "outside the model's vocabulary"),
        (["capture", str(ckpt), "--data", SPEC, "--out", str(tmp_path / "e.zarr"), "--layers", "0,2"],
         "layer 2 is out of range"),
        (["capture", str(other), "--data", SPEC, "--out", str(out)], "another checkpoint"),
        (["capture", str(ckpt), "--data", SPEC, "--out", str(newer)], "newer than this deltalab"),
        (["capture", str(ckpt), "--data", SPEC, "--out", str(out), "--hooks", "q,nope"], "unknown hook"),
        (["store", "info", str(tmp_path / "nope.zarr")], "does not exist"),
        (["store", "info", str(newer)], "upgrade deltalab"),
    ]
    for args, msg in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0], (args, res.output)
    assert store.open(out).sizes["seq"] == 10  # nothing written was lost
    info = runner.invoke(app, ["store", "info", str(out), "--json"])
    assert info.exit_code == 0 and json.loads(info.output)["complete"] == 10
    text = runner.invoke(app, ["store", "info", str(out)])
    assert text.exit_code == 0 and "10/10 complete" in text.output and "state" in text.output


@pytest.mark.slow
def test_torchrun_two_ranks_match_single_process(ckpt, tmp_path):
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo backend not available")
    spec = "S4:length=70,samples=14,seed=2"
    dist_out, single = tmp_path / "dist.zarr", tmp_path / "single.zarr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "deltalab.store.capture_dist", str(ckpt), "--data", spec, "--out", str(dist_out), "--batch-size", "2",
           "--no-progress"]
    res = subprocess.run(cmd, cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    ranks = sorted(json.loads(line)["rank"] for line in res.stdout.splitlines() if line.startswith("{"))
    assert ranks == [0, 1]
    store.capture(ckpt, spec, single, batch_size=2, progress=False)
    a, b = store.open(dist_out), store.open(single)
    assert a.sizes["seq"] == 14
    for name in b.data_vars:
        np.testing.assert_allclose(a[name].values, b[name].values, rtol=1e-6, atol=1e-7, err_msg=name)


def test_stored_layers_go_to_the_host_one_at_a_time_as_the_stack_would():
    """The CUDA path for stored variables no reduction reads: each layer converted and copied into one
    (layer, ...) host tensor, equal to stacking on the device and converting (what the other variables get)."""
    from deltalab.store.runner import _stack, _to_pinned

    per_layer = [torch.randn(2, 5, 3, dtype=torch.float32) for _ in range(4)]
    got = _to_pinned(per_layer, torch.float16, pin=False)
    assert got.shape == (4, 2, 5, 3) and got.dtype == torch.float16
    assert torch.equal(got, _stack(per_layer).to(torch.float16))


def test_resume_repairs_a_corrupt_complete_chunk(ckpt, tmp_path):
    """A `complete` chunk that still decodes but fails its crc32c: the resume names those sequences, recaptures
    them, and the store equals an uninterrupted capture (no codec message reaches the user)."""
    from tests.store.chunks import chunk_files, forge

    spec = "S4:length=40,samples=4,seed=0"
    out, clean = tmp_path / "s.zarr", tmp_path / "clean.zarr"
    store.capture(ckpt, spec, out, batch_size=2, progress=False)
    store.capture(ckpt, spec, clean, batch_size=2, progress=False)
    forge(chunk_files(out / "complete")[0], out / "complete")
    res = CliRunner().invoke(app, ["capture", str(ckpt), "--data", spec, "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "repaired damaged sequence(s) 0-1" in res.output and "4/4 complete" in res.output
    assert "stored and computed" not in res.output.lower()
    assert tree_bytes(out) == tree_bytes(clean)
