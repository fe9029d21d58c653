"""spectra probe: reflections give unit-modulus complex pairs turning by twice the angle between the planes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probes import data, spectra
from probes.synthetic import ROTATION_HEAD, synthetic_arrays, write_synthetic_store

KW = {"n_seq": 4, "length": 80, "seed": 3}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("spectra") / "s.zarr", batch_size=2, **KW)


@pytest.fixture(scope="module")
def result(store):
    return spectra.run(data.open_store(store), window=4)


def test_rotation_head_is_unit_circle_pairs(result):
    eig = result.dataset["eig_P"].isel(layer=0, head=ROTATION_HEAD).values  # [seq, pos, 2]
    np.testing.assert_allclose(np.abs(eig), 1.0, atol=1e-5)
    np.testing.assert_allclose(eig[..., 0], np.conj(eig[..., 1]), atol=1e-5)  # conjugate pair
    assert (np.abs(eig.imag) > 1e-3).all()
    rots = result.dataset["rotation"].values
    assert rots[0, ROTATION_HEAD] and rots.sum() == 1
    rec = next(r for r in result.records if r["layer"] == 0 and r["head"] == ROTATION_HEAD)
    assert rec["rotation"] and rec["frac_unit_modulus"] == 1.0 and rec["window_frac_rotation"] == 1.0


def test_angle_is_twice_the_angle_between_planes(result):
    a = synthetic_arrays(**KW)
    k1, k2 = a["k"][:, 0, :, 0, ROTATION_HEAD], a["k"][:, 0, :, 1, ROTATION_HEAD]  # [seq, pos, dk]
    phi = np.arccos(np.clip(np.abs((k1 * k2).sum(-1)), 0, 1))
    eig = result.dataset["eig_P"].isel(layer=0, head=ROTATION_HEAD).values
    np.testing.assert_allclose(np.abs(np.angle(eig)).max(-1), 2 * phi, atol=1e-3)
    # per input token: one eigenvalue set per token (keys depend on the token only), spread ~ 0
    out = result.dataset
    assert (out["token_eig_spread"].values[0, :, ROTATION_HEAD] < 1e-5).all()
    tok = a["tokens"]
    for t in out["token"].values:
        first = np.argwhere(tok == t)[0]
        want = np.degrees(2 * phi[first[0], first[1]])
        assert out["token_angle_deg"].sel(token=t).values[0, ROTATION_HEAD] == pytest.approx(want, abs=1e-2)


def test_matches_dense_eigenvalues(store, result):
    from kernels.spectra_naive import naive_spectra

    a = synthetic_arrays(**KW)
    k = torch.from_numpy(a["k"][:2, 1, :6].astype(np.float64))  # layer 1: random heads
    beta = torch.from_numpy(a["beta"][:2, 1, :6].astype(np.float64))
    ref = naive_spectra(k, beta).numpy()  # [2, 6, H, n_h]
    got = result.dataset["eig_P"].isel(layer=1, seq=slice(0, 2), pos=slice(0, 6)).values
    np.testing.assert_allclose(got, ref, atol=1e-4)
    wref = naive_spectra(k, beta, window=2, stride=2).numpy()
    wout = spectra.run(data.open_store(store), window=2).dataset
    wgot = wout["window_eig_P"].isel(layer=1, seq=slice(0, 2), window=slice(0, 3)).values
    np.testing.assert_allclose(wgot, wref, atol=1e-4)


def test_gated_transition_scales_by_the_gate(tmp_path):
    path = write_synthetic_store(tmp_path / "g.zarr", gated=True, n_seq=2, length=64, seed=4)
    ds = data.open_store(path)
    out = spectra.run(ds, window=2).dataset
    g = synthetic_arrays(gated=True, n_seq=2, length=64, seed=4)["g"]  # [seq, layer, pos, head]
    np.testing.assert_allclose(out["eig_A"].values, out["eig_P"].values * np.exp(g)[..., None], rtol=1e-5, atol=1e-6)
    assert (np.abs(out["eig_A"].isel(layer=0, head=ROTATION_HEAD).values) < 1).all()
    assert "mean_modulus_A" in out


def test_window_longer_than_sequence_is_refused(store):
    with pytest.raises(ValueError, match="window"):
        spectra.run(data.open_store(store), window=1000)
