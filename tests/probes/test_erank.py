"""erank probe: planted low-rank states, agreement with a float64 SVD of every token's state, markers."""

from __future__ import annotations

import numpy as np
import pytest

from deltalab.probes import data, erank
from deltalab.probes.synthetic import LOW_RANK_HEAD, ROTATION_HEAD, synthetic_arrays, write_synthetic_store

KW = {"n_seq": 4, "length": 100, "seed": 5}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("erank") / "s.zarr", batch_size=2, train_length=64, **KW)


@pytest.fixture(scope="module")
def result(store):
    return erank.run(data.open_store(store))


def _reference(a: dict, layer: int) -> dict[str, np.ndarray]:
    """float64 token loop over the synthetic arrays, SVD of every state: erank/stable rank [seq, pos, head]."""
    k, v, beta = (a[n][:, layer].astype(np.float64) for n in ("k", "v", "beta"))
    S, T, n_h, H, K = k.shape
    state = np.zeros((S, H, K, v.shape[-1]))
    er, sr = np.zeros((S, T, H)), np.zeros((S, T, H))
    for t in range(T):
        for j in range(n_h):
            kk, vv, bb = k[:, t, j], v[:, t, j], beta[:, t, j]
            resid = vv - np.einsum("shkv,shk->shv", state, kk)
            state = state + bb[..., None, None] * kk[..., :, None] * resid[..., None, :]
        sig = np.linalg.svd(state, compute_uv=False)
        p = sig / sig.sum(-1, keepdims=True)
        er[:, t] = np.exp(-(p * np.log(np.where(p > 0, p, 1))).sum(-1))
        sr[:, t] = (sig**2).sum(-1) / sig[..., 0] ** 2
    return {"erank": er, "stable_rank": sr}


def test_matches_float64_svd(result):
    a = synthetic_arrays(train_length=64, **KW)
    for layer in (0, 1):
        ref = _reference(a, layer)
        for name in ("erank", "stable_rank"):
            got = result.dataset[name].isel(layer=layer).values
            np.testing.assert_allclose(got, ref[name], rtol=1e-3, err_msg=f"{name} layer {layer}")


def test_planted_low_rank(result):
    out = result.dataset
    er = out["erank"].isel(layer=0).values
    sr = out["stable_rank"].isel(layer=0).values
    assert er[..., LOW_RANK_HEAD].max() <= 2 + 1e-3  # values in a 2-D subspace
    assert sr[..., LOW_RANK_HEAD].max() <= 2 + 1e-3
    assert er[..., ROTATION_HEAD].max() <= 3 + 1e-3  # keys in a 3-D subspace
    assert er[..., 3].max() > 4  # a random head fills more of the 8 dims
    np.testing.assert_allclose(out["rank_utilisation"].values, out["stable_rank"].values / 8, rtol=1e-6)


def test_without_stored_states_gives_the_same(store, result):
    again = erank.run(data.open_store(store).drop_vars("state")).dataset
    np.testing.assert_allclose(again["erank"].values, result.dataset["erank"].values, rtol=1e-4, atol=1e-5)


def test_markers_and_summary(result):
    out = result.dataset
    assert out.attrs["train_length"] == 64
    assert out["beyond_train"].values.sum() == 100 - 64 and not out["beyond_train"].values[:64].any()
    assert "doc_start" in out and out["doc_start"].values[:, 50].all()
    er = out["erank"].values  # [seq, layer, pos, head]
    np.testing.assert_allclose(out["erank_within_train"].values, er[:, :, :64].mean((0, 2)), rtol=1e-5)
    np.testing.assert_allclose(out["erank_beyond_train"].values, er[:, :, 64:].mean((0, 2)), rtol=1e-5)
    np.testing.assert_allclose(out["erank_drop_at_doc_start"].values, (er[:, :, 49] - er[:, :, 50]).mean(0),
                               rtol=1e-5, atol=1e-6)
    recs = result.records
    assert len(recs) == 2 * 4 and recs[0]["train_length"] == 64
    assert {"erank_mean", "stable_rank_mean", "rank_utilisation_mean", "erank_beyond_train"} <= set(recs[0])


def test_streams_in_small_blocks(store, result):
    small = erank.run(data.open_store(store), budget=1).dataset
    np.testing.assert_allclose(small["erank"].values, result.dataset["erank"].values, rtol=1e-6)


def test_doc_start_drop_needs_a_ranked_token_before_it():
    """Ranks every 4th token (NaN between): a document starting at a ranked token has no ranked predecessor, so it
    adds no drop (it used to add -erank(t), its NaN predecessor counted as 0); one with both ranked counts."""
    import xarray as xr

    from deltalab.probes.erank import summarize

    rng = np.random.default_rng(0)
    S, L, T, H = 2, 1, 12, 2
    fields = {}
    for f in ("erank", "stable_rank", "rank_utilisation", "state_norm"):
        a = np.full((S, L, T, H), np.nan, np.float32)
        a[:, :, 3::4] = rng.uniform(1, 5, (S, L, T // 4, H))
        fields[f] = (("seq", "layer", "pos", "head"), a)
    tok = xr.Dataset(fields, coords={"layer": [0]})
    starts = np.zeros((S, T), bool)
    starts[0, 7] = True  # token 7 is ranked, token 6 is not
    ds = xr.Dataset({"doc_start": (("seq", "pos"), starts)}, attrs={"sizes": {"dk": 4, "dv": 4}})
    out = summarize(tok, ds, None)
    assert out.attrs["n_doc_starts"] == 0 and np.isnan(out["erank_drop_at_doc_start"].values).all()
    every = fields["erank"][1].copy()
    every[:, :, :] = rng.uniform(1, 5, (S, L, T, H))  # every token ranked: the drop is erank(6) - erank(7)
    tok["erank"] = (("seq", "layer", "pos", "head"), every)
    for f in ("stable_rank", "rank_utilisation", "state_norm"):
        tok[f] = tok["erank"]
    out = summarize(tok, ds, None)
    assert out.attrs["n_doc_starts"] == 1
    np.testing.assert_allclose(out["erank_drop_at_doc_start"].values, every[0, :, 6] - every[0, :, 7], rtol=1e-6)
