"""attention probe: the planted copy head, agreement with the float64 kernel, --context, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.kernels.attention.chunk import delta_attention
from deltalab.probes import attention, data
from deltalab.probes.results import read_results
from deltalab.probes.synthetic import COPY_HEAD, synthetic_arrays, write_synthetic_store

KW = {"n_seq": 2, "length": 80, "seed": 4, "gated": True}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("attention") / "s.zarr", batch_size=2, **KW)


@pytest.fixture(scope="module")
def result(store):
    return attention.run(data.open_store(store), window=(10, 80), top_k=4)


def test_copy_head_reads_only_its_own_last_write(result):
    """Head 2 writes v = E[label] at key k with beta = 1 and reads at q = k: o_t = scale v_{t, last} exactly."""
    out = result.dataset.isel(layer=0, head=COPY_HEAD)
    pos = out["pos"].values
    assert (out["attn_source_pos"].values[..., 0] == pos[None, :]).all()
    assert (out["attn_source_step"].values[..., 0] == 1).all()  # n_h = 2: the last step
    np.testing.assert_allclose(out["attn_weight"].values[..., 0], 8**-0.5, rtol=1e-5)
    assert np.abs(out["attn_weight"].values[..., 1:]).max() < 1e-5  # the write erased everything along k
    assert float(out["gla_weight_error"].min()) > 0.5  # the approximation keeps all older writes
    rec = next(r for r in result.records if r["layer"] == 0 and r["head"] == COPY_HEAD)
    assert rec["top1_share_mean"] > 0.999 and rec["top1_lag_mean"] == 0


def test_matches_the_float64_kernel(result):
    a = synthetic_arrays(**KW)
    layer = 1
    x = [torch.from_numpy(a[n][:, layer]).double() for n in ("q", "k", "v", "beta", "g")]
    full = delta_attention(*x, window=(10, 80)).weights.numpy()  # [s, Tw, H, T, n_h]
    out = result.dataset.isel(layer=layer)
    src, step = out["attn_source_pos"].values, out["attn_source_step"].values
    got = out["attn_weight"].values
    s, t, h, r = np.indices(got.shape)
    np.testing.assert_allclose(got, full[s, t, h, src, step], atol=1e-5)
    best = np.sort(np.abs(full.reshape(*full.shape[:3], -1)), -1)[..., ::-1][..., :4]
    np.testing.assert_allclose(np.abs(got), best, atol=1e-5)
    assert float(result.dataset["reconstruction_error"].max()) < 1e-4  # o from the store rebuilt from the map


def test_context_folds_early_sources_into_the_initial_state(store, result):
    """--context 4 at window 70:80 keeps tokens >= 64 as sources; the stored state at token 64 brings the rest."""
    short = attention.run(data.open_store(store), window=(70, 80), top_k=4, context=4)
    assert short.dataset.attrs["first_source"] == 64
    sp = short.dataset["attn_source_pos"].values
    assert sp.min() >= 64 and float(short.dataset["reconstruction_error"].max()) < 1e-4
    long = result.dataset.sel(pos=slice(70, 79))
    same = (long["attn_source_pos"].values >= 64).all(-1)  # rows whose top sources all lie after the fold
    assert same.mean() > 0.2
    np.testing.assert_allclose(short.dataset["attn_weight"].values[same], long["attn_weight"].values[same], atol=1e-5)
    # (the copy head's query is orthogonal to everything before its own write: no initial term there either)
    assert float(short.dataset["attn_initial_norm"].isel(layer=1).min()) > 1e-3
    assert float(long["attn_initial_norm"].max()) == 0  # sources from token 0, zero initial state


def test_cli_json_results_and_errors(store):
    res = CliRunner().invoke(app, ["probe", "attention", "--store", str(store), "--window", "60:80", "--top-k", "3",
                                   "--json", "--name", "attn_cli"])
    assert res.exit_code == 0, res.output
    recs = json.loads(res.stdout)
    assert len(recs) == 2 * 4 and {"gla_weight_error_mean", "top1_share_mean", "window_start"} <= set(recs[0])
    out = read_results(store, "attn_cli")
    assert out.attrs["complete"] is True and out["attn_weight"].shape == (2, 2, 20, 4, 3)
    for argv, needle in ((["--window", "80:60"], "--window"), (["--top-k", "0"], "--top-k")):
        res = CliRunner().invoke(app, ["probe", "attention", "--store", str(store), *argv])
        assert res.exit_code == 2 and needle in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
