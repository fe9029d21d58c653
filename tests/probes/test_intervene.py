"""intervene probe: nnsight edits agree with plain PyTorch forward hooks; a full-rank key projection is a no-op."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deltalab.models import IGNORE_INDEX
from deltalab.probes import data, intervene
from deltalab.probes.base import ProbeError
from deltalab.probes.synthetic import write_synthetic_store


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from deltalab.models import DeltaProductForCausalLM, ModelConfig, save_checkpoint

    root = tmp_path_factory.mktemp("intervene")
    store = write_synthetic_store(root / "s.zarr", n_seq=4, length=40, seed=7)
    cfg = ModelConfig(model_type="gated_deltaproduct", vocab_size=8, hidden_size=32, num_hidden_layers=2,
                      num_heads=4, head_dim=8, expand_v=1.0, num_householder=2, use_forget_gate=False,
                      use_output_gate=False, use_short_conv=False, allow_neg_eigval=True)
    torch.manual_seed(0)
    model = DeltaProductForCausalLM(cfg).eval()
    save_checkpoint(model, root / "ckpt")
    return store, model, root / "ckpt"


def _hooked_metrics(model, tokens, labels, module, edit):
    """Accuracy and loss with `edit(output)` applied through a plain forward hook (the independent route)."""
    handle = module.register_forward_hook(lambda mod, inp, out: edit(out.clone()))
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float()
    finally:
        handle.remove()
    lab = torch.as_tensor(labels, dtype=torch.long)
    valid = lab != IGNORE_INDEX
    loss = F.cross_entropy(logits[valid], lab[valid]).item()
    acc = (logits.argmax(-1)[valid] == lab[valid]).float().mean().item()
    return acc, loss


def test_set_beta_and_ablation_match_forward_hooks(setup):
    store, model, _ = setup
    ds = data.open_store(store)
    tokens, labels = ds["tokens"].values, ds["labels"].values
    edits = [intervene.parse_edit("set_beta", "1:2:0=0"), intervene.parse_edit("ablate_head", "0:1")]
    res = intervene.run(ds, model, edits=edits, batch_size=4)
    recs = {r["intervention"]: r for r in res.records}

    def set_beta(out):
        out[..., 0, 2] = 0.0
        return out

    def ablate(out):
        out[:, :, 1] = 0
        return out

    acc, loss = _hooked_metrics(model, tokens, labels, model.layers[1].attn.hook_beta, set_beta)
    assert recs["set_beta"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert recs["set_beta"]["accuracy"] == pytest.approx(acc)
    acc, loss = _hooked_metrics(model, tokens, labels, model.layers[0].attn.hook_o, ablate)
    assert recs["ablate_head"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert recs["ablate_head"]["loss"] != pytest.approx(recs["baseline"]["loss"], rel=1e-6)


def test_full_rank_key_projection_is_a_no_op(setup):
    store, model, _ = setup
    ds = data.open_store(store)
    edits = [intervene.parse_edit("project_keys", "0:1=8"), intervene.parse_edit("project_keys", "0:1:0=1")]
    recs = intervene.run(ds, model, edits=edits).records
    assert abs(recs[1]["delta_loss"]) < 1e-5  # all 8 components of 8-dim keys: the keys themselves
    assert abs(recs[2]["delta_loss"]) > 1e-4  # one component: a real change


def test_parse_and_range_errors(setup):
    store, model, _ = setup
    assert intervene.parse_edit("set_beta", "0:*:1=2") == intervene.Edit("set_beta", 0, None, 1, 2.0)
    for kind, text in [("set_beta", "0:1=2"), ("ablate_head", "0:1:1"), ("project_keys", "0:1=1.5"),
                       ("set_beta", "x")]:
        with pytest.raises(ProbeError):
            intervene.parse_edit(kind, text)
    with pytest.raises(ProbeError, match="layer 5"):
        intervene.run(data.open_store(store), model, edits=[intervene.Edit("ablate_head", 5, 0)])


def test_default_sweep_covers_every_head_and_step(setup):
    store, _, _ = setup
    edits = intervene.sweep(data.open_store(store))
    assert len(edits) == 2 * 4 * (2 + 2)
    assert {e.kind for e in edits} == {"set_beta", "ablate_head", "project_keys"}


def test_cli_writes_results(setup):
    from deltalab.probes.base import run_module
    from deltalab.probes.results import read_results

    store, _, ckpt = setup
    code = run_module("intervene", ["--store", str(store), "--checkpoint", str(ckpt), "--set-beta", "0:0:1=2"])
    assert code == 0
    out = read_results(store, "intervene")
    assert out.attrs["complete"] and out.attrs["probe"] == "intervene"
    assert out.sizes["intervention"] == 2 and int(out["kind"].values[1]) == intervene.KINDS["set_beta"]
    assert np.isfinite(out["loss"].values).all()
    assert run_module("intervene", ["--store", str(store)]) == 2  # --checkpoint is required


def test_corrupt_keys_results_that_still_decode_are_one_line(setup, tmp_path, capsys):
    """--project-keys reads results/keys: its chunks rewritten as valid zstd frames of other bytes (crc32c tails kept)
    decode fine, so only their checksums tell; the probe prints the one corrupt-chunk line, exits 2 and leaves every
    file of the store as it was (no partial results group left behind)."""
    import shutil

    from deltalab.probes.base import run_module
    from tests.store.chunks import chunk_files, forge, has_crc32c

    store, _, ckpt = setup
    copy = tmp_path / "s.zarr"
    shutil.copytree(store, copy)
    assert run_module("keys", ["--store", str(copy)]) == 0
    for name in ("mean_joint", "components_joint"):
        array = copy / "results" / "keys" / name
        assert has_crc32c(array)
        for chunk in chunk_files(array):
            forge(chunk, array)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = run_module("intervene", ["--store", str(copy), "--checkpoint", str(ckpt), "--project-keys", "0:1=2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and f"store {copy} has a corrupt chunk (its checksum does not match its bytes)" in lines[0]
    assert f"rerun `deltalab probe keys --store {copy}`" in lines[0]  # the probe run that rewrites its results
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
