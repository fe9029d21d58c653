"""Capture and probes on a tiny Kimi Linear model (per-channel gates): g is stored per key channel, the spectra
probe's eig_A are the exact eigenvalues of A_t = (I - b k k^T) diag(exp g_t), and the state ranks replay the
per-channel decay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")

from deltalab import store  # noqa: E402
from deltalab.app.cli import app  # noqa: E402
from deltalab.kernels.delta_rule.naive import naive_delta_product  # noqa: E402
from deltalab.kernels.spectra.naive import dplr_eigvals_dense  # noqa: E402
from deltalab.store import schema  # noqa: E402
from deltalab.store.reader import open_results  # noqa: E402
from tests.models.kda_tiny import KDA_DIM, KDA_HEADS, KDA_LINEAR, probed_kimi_store  # noqa: E402


@pytest.fixture(scope="module")
def kimi_store(tmp_path_factory):
    return probed_kimi_store(tmp_path_factory.mktemp("kimi"), "S4:length=70,samples=4,seed=0",
                             {p: [] for p in ("betas", "keys", "spectra", "erank", "attention")})


def test_gate_is_stored_per_key_channel(kimi_store):
    ds = store.open(kimi_store)
    assert ds["g"].dims == ("seq", "layer", "pos", "head", "dk") and ds.sizes["dk"] == KDA_DIM
    assert ds["layer"].values.tolist() == list(KDA_LINEAR) and ds.sizes["head"] == KDA_HEADS
    assert ds.attrs["model_config"]["gate"] == "channel"
    assert ds.attrs["deltalab_format"] == schema.CHECKSUM_FORMAT  # a version-1 reader would misread g: it refuses
    g = np.asarray(ds["g"].values)
    assert (g <= 0).all() and g.std(-1).mean() > 0  # channels decay differently


def test_spectra_probe_gives_exact_channel_gate_eigenvalues(kimi_store):
    ds = store.open(kimi_store)
    spec = open_results(kimi_store, "spectra")
    assert spec["eig_A"].dims == ("seq", "layer", "pos", "head", "aeig")
    sub = dict(seq=slice(0, 2), pos=slice(0, 20))
    k = torch.from_numpy(np.asarray(ds["k"].isel(step=0, **sub).values)).double()
    beta = torch.from_numpy(np.asarray(ds["beta"].isel(step=0, **sub).values)).double()
    g = torch.from_numpy(np.asarray(ds["g"].isel(**sub).values)).double()
    dense = dplr_eigvals_dense(g.exp(), k, beta).numpy()  # [s, L, T, H, dk]
    got = np.asarray(spec["eig_A"].isel(**sub).values)
    assert np.abs(got.imag).max() == 0
    np.testing.assert_allclose(got.real, dense, rtol=0, atol=1e-6)  # stored as complex64


def test_state_ranks_replay_the_channel_decay(kimi_store):
    ds = store.open(kimi_store)
    erank = open_results(kimi_store, "erank")
    li = 1
    k, v, beta, g = (torch.from_numpy(np.asarray(ds[n].isel(layer=li).values)).double()
                     for n in ("k", "v", "beta", "g"))
    _, final, _ = naive_delta_product(torch.zeros(k.shape[0], k.shape[1], KDA_HEADS, KDA_DIM, dtype=torch.float64),
                                      k, v, beta, g)
    norm = np.asarray(erank["state_norm"].isel(layer=li, pos=-1).values)  # [seq, head]
    np.testing.assert_allclose(norm, final.norm(dim=(-2, -1)).numpy(), rtol=1e-4)


def test_decays_probe_reports_memory_per_key_channel(kimi_store):
    import json

    res = CliRunner().invoke(app, ["probe", "decays", "--store", str(kimi_store), "--json", "--long", "5"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert sorted((r["layer"], r["head"]) for r in rows) == [(i, h) for i in KDA_LINEAR for h in range(KDA_HEADS)]
    out = open_results(kimi_store, "decays")
    ds = store.open(kimi_store)
    g = np.asarray(ds["g"].isel(layer=0, head=1).values, dtype=np.float64).reshape(-1, KDA_DIM)  # [tokens, dk]
    np.testing.assert_allclose(out["mean_decay"].isel(layer=0, head=1).values, np.exp(g).mean(0), rtol=1e-6)
    np.testing.assert_allclose(out["frac_long"].isel(layer=0, head=1).values,
                               (1 / (1 - np.exp(g)) > 5).mean(0), rtol=1e-12)
    mem = out["memory_of_mean_decay"].isel(layer=0, head=1).values
    row = next(r for r in rows if (r["layer"], r["head"]) == (0, 1))
    assert row["longest_channels"][0] == int(np.argmax(mem)) and row["channels"] == KDA_DIM
    assert int(out["memory_hist"].isel(layer=0, head=1).sum()) == g.size


def test_decays_probe_without_a_gate_says_so(tmp_path):
    from deltalab.probes.synthetic import write_synthetic_store

    path = write_synthetic_store(tmp_path / "s.zarr", gated=False)
    res = CliRunner().invoke(app, ["probe", "decays", "--store", str(path)])
    assert res.exit_code == 2 and "the store has no g" in res.output


def test_decays_probe_on_a_scalar_gate_has_one_channel(tmp_path):
    from deltalab.probes.decays import run
    from deltalab.probes.synthetic import write_synthetic_store

    ds = store.open(write_synthetic_store(tmp_path / "s.zarr", gated=True))
    out = run(ds).dataset
    assert out.sizes["channel"] == 1
    g = np.asarray(ds["g"].values, dtype=np.float64)  # [seq, layer, pos, head]
    np.testing.assert_allclose(out["mean_log_decay"].values[..., 0], g.mean((0, 2)), rtol=1e-6)


def test_reductions_during_capture_equal_the_probes_on_per_channel_gates(kimi_store, tmp_path):
    from tests.store.test_reduce import _assert_same

    out = tmp_path / "r.zarr"
    res = CliRunner().invoke(app, ["capture", str(kimi_store.parent / "kimi"), "--data",
                                   "S4:length=70,samples=4,seed=0", "--out", str(out),
                                   "--reduce", "ranks,spectra,attention", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "state" not in store.open(out)
    for name in ("erank", "spectra", "attention"):  # the probes ran on the store with states and o
        probe = open_results(kimi_store, name)
        reduced = open_results(out, name)
        _assert_same(reduced, probe, rtol=1e-4, skip="reconstruction_error")  # needs o, which reductions skip


def test_float32_spectra_during_capture_equal_the_probe_in_float32(kimi_store, tmp_path):
    """--reduce spectra --spectra-precision float32 writes what `deltalab probe spectra --precision float32` gives
    on the store, and records the precision with the result."""
    from deltalab.probes import spectra

    out = tmp_path / "r.zarr"
    res = CliRunner().invoke(app, ["capture", str(kimi_store.parent / "kimi"), "--data",
                                   "S4:length=70,samples=4,seed=0", "--out", str(out), "--reduce", "spectra",
                                   "--spectra-precision", "float32", "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    reduced = open_results(out, "spectra")
    probe = spectra.run(store.open(kimi_store), window=4, precision="float32").dataset
    assert reduced.attrs["precision"] == "float32" and reduced.attrs["complete"]
    assert "eig_A" in probe and set(probe.data_vars) <= set(reduced.data_vars)
    for v in probe.data_vars:
        np.testing.assert_allclose(np.asarray(reduced[v].values), np.asarray(probe[v].values), rtol=1e-4, atol=1e-6,
                                   equal_nan=True, err_msg=v)
