"""`probes.data.map_blocks`: blocks of sequences on threads, yielded in order, covering every sequence once; the
summaries built on it give the same numbers on one thread and on several."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from deltalab.probes import data, erank, spectra


def _ds(n_seq: int = 37, T: int = 50) -> xr.Dataset:
    x = np.arange(n_seq * T, dtype=np.float64).reshape(n_seq, T)
    return xr.Dataset({"x": (("seq", "pos"), x)}, coords={"seq": np.arange(n_seq)})


def test_blocks_come_back_in_order_and_cover_every_sequence_once():
    ds = _ds()
    seen = list(data.map_blocks(ds, ["x"], budget=2_000, fn=lambda b: b["seq"].values.tolist(), workers=4))
    assert len(seen) > 4  # the budget, shared by 4 workers, makes many small blocks
    assert [s for block in seen for s in block] == list(range(37))


def test_an_error_in_a_block_reaches_the_caller():
    def fail(block):
        if 20 in block["seq"].values:
            raise RuntimeError("block failed")
        return 0

    with pytest.raises(RuntimeError, match="block failed"):
        list(data.map_blocks(_ds(), ["x"], budget=2_000, fn=fail, workers=3))


def _tokens(rng, s, L, T, H):
    eig = (rng.uniform(-1, 1, (s, L, T, H, 1)) + 1j * rng.uniform(-1, 1, (s, L, T, H, 1))
           * (rng.random((s, L, T, H, 1)) < 0.3)).astype(np.complex64)
    eig[1, :, 40:] = np.nan  # a padded sequence
    weig = (rng.uniform(-1, 1, (s, L, T // 4, H, 4)) + 0j).astype(np.complex64)
    tok = xr.Dataset({"eig_P": (("seq", "layer", "pos", "head", "eig"), eig),
                      "window_eig_P": (("seq", "layer", "window", "head", "weig"), weig),
                      "eig_A": (("seq", "layer", "pos", "head", "eig"), eig * 0.9)},
                     coords={"seq": np.arange(s), "layer": np.arange(L)})
    ds = xr.Dataset({"tokens": (("seq", "pos"), rng.integers(0, 20, (s, T)).astype(np.int32))},
                    coords={"seq": np.arange(s)})
    er = rng.uniform(1, 10, (s, L, T, H)).astype(np.float32)
    er[1, :, 40:] = np.nan
    ranks = xr.Dataset({f: (("seq", "layer", "pos", "head"), er * (i + 1)) for i, f in
                        enumerate(("erank", "stable_rank", "rank_utilisation", "state_norm"))},
                       coords={"seq": np.arange(s), "layer": np.arange(L)})
    doc = np.zeros((s, T), bool)
    doc[:, [0, 17]] = True
    ds = ds.assign(doc_start=(("seq", "pos"), doc))
    ds.attrs["sizes"] = {"dk": 8, "dv": 8}
    return tok, ds, ranks


@pytest.mark.parametrize("workers", [2, 8])
def test_summaries_on_threads_equal_one_thread(monkeypatch, workers):
    tok, ds, ranks = _tokens(np.random.default_rng(0), s=13, L=3, T=64, H=4)
    monkeypatch.setattr(data.os, "cpu_count", lambda: 1)
    one_s = spectra.summarize(tok, ds, budget=60_000)
    one_e = erank.summarize(ranks, ds, train_length=32, budget=60_000)
    monkeypatch.setattr(data.os, "cpu_count", lambda: workers)
    many_s = spectra.summarize(tok, ds, budget=60_000)
    many_e = erank.summarize(ranks, ds, train_length=32, budget=60_000)
    for one, many in ((one_s, many_s), (one_e, many_e)):
        for v in one.data_vars:
            np.testing.assert_allclose(many[v].values, one[v].values, rtol=1e-12, atol=1e-12, equal_nan=True,
                                       err_msg=v)
    assert int(one_s["token_count"].sum()) > 0 and np.isfinite(one_e["erank_final"].values).all()
