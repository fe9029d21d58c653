"""betas probe on a synthetic store: the planted reflection head is flagged, statistics match numpy."""

from __future__ import annotations

import numpy as np
import pytest

from deltalab.probes import betas, data
from deltalab.probes.synthetic import ROTATION_HEAD, synthetic_arrays, write_synthetic_store

KW = {"n_seq": 6, "length": 96, "seed": 1}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("betas") / "s.zarr", batch_size=2, **KW)


@pytest.fixture(scope="module")
def arrays():
    return synthetic_arrays(**KW)


def test_reflection_head_flagged_and_only_it(store):
    out = betas.run(data.open_store(store)).dataset
    flags = out["reflection"].values
    assert flags[0, ROTATION_HEAD]
    assert flags.sum() == 1
    np.testing.assert_allclose(out["beta_mean"].values[0, :, ROTATION_HEAD], 2.0, atol=1e-6)
    np.testing.assert_allclose(out["frac_negative"].values[0, :, ROTATION_HEAD], 1.0)


def test_statistics_match_numpy(store, arrays):
    out = betas.run(data.open_store(store)).dataset
    b = arrays["beta"].astype(np.float64)  # [seq, layer, pos, step, head]
    np.testing.assert_allclose(out["beta_mean"].values, b.mean((0, 2)), rtol=1e-6)
    np.testing.assert_allclose(out["beta_std"].values, b.std((0, 2)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["frac_negative"].values, (b > 1).mean((0, 2)))
    assert (out["beta_hist"].sum("bin").values == b.shape[0] * b.shape[2]).all()
    # quantiles from the fine histogram: between the neighbouring order statistics, up to one fine bin
    resolution = 2.0 / (64 * betas.FINE)
    srt = np.sort(b.transpose(1, 3, 4, 0, 2).reshape(*b.shape[1:2], *b.shape[3:], -1), -1)  # [layer, step, head, n]
    n = srt.shape[-1]
    for qi, q in enumerate(betas.QUANTILES):
        lo = srt[..., max(0, int(np.floor(q * n)) - 2)] - resolution
        hi = srt[..., min(n - 1, int(np.ceil(q * n)) + 1)] + resolution
        got = out["beta_quantile"].values[..., qi]
        assert ((got >= lo) & (got <= hi)).all(), (q, got, lo, hi)


def test_per_token_means(store, arrays):
    out = betas.run(data.open_store(store)).dataset
    tok, b = arrays["tokens"], arrays["beta"].astype(np.float64)
    for t in out["token"].values:
        mask = tok == t
        want = b.transpose(0, 2, 1, 3, 4)[mask].mean(0)  # [layer, step, head]
        np.testing.assert_allclose(out["beta_token_mean"].sel(token=t).values, want, rtol=1e-6)
        assert out["token_count"].sel(token=t).item() == mask.sum()


def test_streaming_in_small_blocks_gives_the_same(store):
    ds = data.open_store(store)
    big = betas.run(ds).dataset
    small = betas.run(ds, budget=1).dataset  # one sequence per block
    for name in ("beta_mean", "beta_std", "beta_hist", "beta_quantile", "beta_token_mean"):
        np.testing.assert_allclose(small[name].values, big[name].values, rtol=1e-9)


def test_records_one_per_layer_head_step(store):
    recs = betas.run(data.open_store(store)).records
    assert len(recs) == 2 * 4 * 2
    rec = next(r for r in recs if r["layer"] == 0 and r["head"] == ROTATION_HEAD and r["step"] == 1)
    assert rec["reflection"] is True and rec["beta_mean"] == pytest.approx(2.0)
    assert {"beta_std", "beta_median", "frac_negative", "per_token"} <= set(rec)
