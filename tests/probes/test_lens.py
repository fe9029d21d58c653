"""Logit lens: the last layer is the model's prediction, every layer is the final norm and unembedding run on
that layer's residual (brute force, on stored resid_post too), for deltalab's models (fla fixtures, hybrids,
RWKV-7) and transformers hybrids; tied embeddings; bad input one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.models import load_checkpoint
from deltalab.probes.core import ProbeError
from deltalab.probes.lens import logit_lens
from deltalab.probes.results import read_results

FLA = Path(__file__).resolve().parents[1] / "fixtures" / "fla"
OWN = ("gdn_hybrid_gva", "rwkv7_fused", "kda_gva", "gdp_nh3_gate")
HF = ("olmo_hybrid", "qwen3_next")


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.models.hf_tiny import save_tiny

    root = tmp_path_factory.mktemp("lens_hf")
    return {f: save_tiny(f, root / f) for f in HF}


def _resid_posts(model, ids):
    """resid_post of every layer by plain forward hooks on layers.{i}.hook_resid_post (the independent route)."""
    got, handles = {}, []
    for i, layer in enumerate(model.layers):
        handles.append(layer.hook_resid_post.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o)))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return logits, [got[i] for i in range(len(model.layers))]


def _final_norm_and_head(model):
    hf = getattr(model, "hf", None)
    if hf is None:
        return model.norm, model.lm_head
    base = getattr(hf, "model", hf)
    return (getattr(base, "norm", None) or base.language_model.norm), hf.lm_head


def _check_lens(model, vocab):
    ids = torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(3))
    ds = logit_lens(model, ids, top_k=4)
    logits, posts = _resid_posts(model, ids)
    norm, head = _final_norm_and_head(model)
    assert list(ds["layer"].values) == [-1, *range(len(model.layers))]
    last = ds.sel(layer=len(model.layers) - 1)
    # the last layer's lens is the model's own prediction
    np.testing.assert_array_equal(last["top_token"].values[..., 0], logits.argmax(-1).numpy())
    tgt = ids[:, 1:]
    want = logits[:, :-1].gather(-1, tgt[..., None])[..., 0].numpy()
    np.testing.assert_allclose(last["target_logit"].values[:, :-1], want, rtol=1e-5, atol=1e-6)
    assert np.isnan(last["target_prob"].values[:, -1]).all() and (last["target_rank"].values[:, -1] == -1).all()
    # every layer: the final norm and unembedding on that layer's residual, target's rank and probability
    for i, post in enumerate(posts):
        with torch.no_grad():
            lg = head(norm(post)).float()
        p = lg.softmax(-1)[:, :-1].gather(-1, tgt[..., None])[..., 0]
        rank = (lg[:, :-1] > lg[:, :-1].gather(-1, tgt[..., None])).sum(-1)
        np.testing.assert_allclose(ds["target_prob"].sel(layer=i).values[:, :-1], p.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(ds["target_rank"].sel(layer=i).values[:, :-1], rank.numpy())
        np.testing.assert_allclose(ds["top_prob"].sel(layer=i).values, lg.softmax(-1).topk(4).values.numpy(),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", OWN)
def test_lens_equals_brute_force_deltalab_models(name):
    model = load_checkpoint(FLA / name)
    _check_lens(model, model.config.vocab_size)


@pytest.mark.parametrize("family", HF)
def test_lens_equals_brute_force_transformers_hybrids(hf_folders, family):
    _check_lens(load_checkpoint(hf_folders[family]), 64)


def test_tied_embeddings_read_as_the_unembedding():
    from deltalab.models import DeltaProductForCausalLM, ModelConfig
    from deltalab.probes.stream import layout_of

    cfg = ModelConfig(model_type="gated_deltanet", vocab_size=16, hidden_size=32, num_hidden_layers=2, num_heads=2,
                      head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = DeltaProductForCausalLM(cfg).eval()
    assert layout_of(model).tied
    _check_lens(model, 16)


def test_chosen_target_and_bad_target():
    model = load_checkpoint(FLA / "delta_net")
    ids = torch.randint(0, 64, (1, 12))
    ds = logit_lens(model, ids, target=5, embed=False)
    assert (ds["target"].values == 5).all() and not np.isnan(ds["target_prob"].values).any()
    assert list(ds["layer"].values) == list(range(len(model.layers)))
    with pytest.raises(ProbeError, match="outside the vocabulary"):
        logit_lens(model, ids, target=64)
    with pytest.raises(ProbeError, match="vocabulary has 64"):
        logit_lens(model, torch.tensor([[1, 70]]))


def test_no_output_head_is_one_line():
    model = load_checkpoint(FLA / "delta_net")
    model.lm_head = None
    with pytest.raises(ProbeError, match="no output head"):
        logit_lens(model, torch.tensor([[1, 2, 3]]))


def _capture(tmp_path, hooks):
    out = tmp_path / f"{hooks.replace(',', '_')}.zarr"
    res = CliRunner().invoke(app, ["capture", str(FLA / "gdn_hybrid_gva"), "--data", "S4:length=20,samples=3,seed=0",
                                   "--out", str(out), "--hooks", hooks, "--no-progress"])
    assert res.exit_code == 0, res.output
    return out


def test_store_lens_reads_stored_resid_post(tmp_path):
    import xarray as xr

    from deltalab.probes.data import open_store

    store = _capture(tmp_path, "tokens,labels,resid_post")
    res = CliRunner().invoke(app, ["probe", "lens", "--store", str(store), "--checkpoint", str(FLA / "gdn_hybrid_gva"),
                                   "--json"])
    assert res.exit_code == 0, res.output
    recs = json.loads(res.output)
    out = read_results(store, "lens")
    src = open_store(store)
    assert [r["layer"] for r in recs] == [int(x) for x in src["layer"].values] == list(out["layer"].values)
    model = load_checkpoint(FLA / "gdn_hybrid_gva")
    resid = torch.as_tensor(np.asarray(src["resid_post"].values))
    with torch.no_grad():
        lg = model.lm_head(model.norm(resid))  # [seq, layer, pos, V]
    lab = torch.as_tensor(np.asarray(src["labels"].values, np.int64))
    ok = lab >= 0
    want = lg.gather(-1, lab.clamp(min=0)[:, None, :, None].expand(-1, lg.shape[1], -1, 1))[..., 0]
    got = torch.as_tensor(np.asarray(out["target_logit"].values))
    okl = ok[:, None].expand_as(got)
    torch.testing.assert_close(got[okl], want[okl].float(), rtol=1e-5, atol=1e-6)
    # --run recomputes the stream from the store's tokens: same numbers
    res = CliRunner().invoke(app, ["probe", "lens", "--store", str(store), "--checkpoint", str(FLA / "gdn_hybrid_gva"),
                                   "--run", "--no-write", "--json"])
    assert res.exit_code == 0, res.output
    ran = {r["layer"]: r for r in json.loads(res.output)}
    for r in recs:
        assert ran[r["layer"]]["target_prob_mean"] == pytest.approx(r["target_prob_mean"], rel=1e-5)
    assert isinstance(out, xr.Dataset)
    res = CliRunner().invoke(app, ["probe", "lens", "--store", str(store), "--checkpoint", str(FLA / "gdn_hybrid_gva"),
                                   "--run", "--no-write", "--json", "--layers", "2"])
    assert res.exit_code == 0, res.output
    assert [r["layer"] for r in json.loads(res.output)] == [2]


def test_store_without_residuals_names_the_hooks(tmp_path):
    store = _capture(tmp_path, "tokens,labels")
    res = CliRunner().invoke(app, ["probe", "lens", "--store", str(store), "--checkpoint", str(FLA / "gdn_hybrid_gva")])
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line and "--hooks tokens,resid_post" in line and "--run" in line


def test_typed_input_cli_and_bad_input():
    ckpt = str(FLA / "gdn_hybrid_gva")
    res = CliRunner().invoke(app, ["probe", "lens", "--checkpoint", ckpt, "--tokens", "1,5,9,3", "--json"])
    assert res.exit_code == 0, res.output
    recs = json.loads(res.output)
    assert len(recs) == 5 * 4 and recs[0]["token"] == "1" and recs[0]["target"] == "5"
    for argv, needle in ((["--tokens", "1,99"], "token 99 is outside the vocabulary"),
                         (["--tokens", "1,2", "--target", "64"], "--target 64 is outside the vocabulary"),
                         (["--text", "hello"], "cannot hold bytes"),
                         ([], "exactly one of --text")):
        res = CliRunner().invoke(app, ["probe", "lens", "--checkpoint", ckpt, *argv])
        assert res.exit_code == 2, (argv, res.output)
        assert needle in res.output and res.output.strip().count("\n") == 0, res.output
