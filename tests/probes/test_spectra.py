"""spectra probe: reflections give unit-modulus complex pairs turning by twice the angle between the planes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltalab.probes import data, spectra
from deltalab.probes.synthetic import ROTATION_HEAD, synthetic_arrays, write_synthetic_store

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
    from deltalab.kernels.spectra.naive import naive_spectra

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


def _channel_gated(store):
    """The synthetic store (n_h = 2) with a per-channel gate [seq, layer, pos, head, dk] in place of g."""
    import xarray as xr

    ds = data.open_store(store)
    rng = np.random.default_rng(0)
    g = -rng.uniform(0, 2, size=(*ds["k"].isel(step=0).shape,)).astype(np.float32)
    return ds.assign(g=xr.DataArray(g, dims=("seq", "layer", "pos", "head", "dk")))


def test_per_channel_gate_windows_are_the_recurrence_products(store):
    """--channel-windows: window_eig_A has all dk eigenvalues of each window's transitions, A_t = P_t diag(e^g_t),
    here with n_h = 2; they equal the dense eigenvalues of the reference recurrence run from the identity."""
    from deltalab.kernels.delta_rule.naive import naive_delta_product

    ds = _channel_gated(store)
    out = spectra.run(ds, window=4, channel_windows=True).dataset
    dk = ds.sizes["dk"]
    assert out["window_eig_A"].dims == ("seq", "layer", "window", "head", "aeig") and out.sizes["aeig"] == dk
    assert out["eig_A"].sizes["aeig"] == dk and out.attrs["channel_windows"]
    li, wi = 1, [0, 5]
    sub = dict(seq=slice(0, 2), layer=li)
    k = torch.from_numpy(np.asarray(ds["k"].isel(**sub).values, dtype=np.float64))  # [s, T, n_h, H, dk]
    beta = torch.from_numpy(np.asarray(ds["beta"].isel(**sub).values, dtype=np.float64))
    g = torch.from_numpy(np.asarray(ds["g"].isel(**sub).values, dtype=np.float64))
    S, _, n_h, H, _ = k.shape
    eye = torch.eye(dk, dtype=torch.float64).expand(S, H, dk, dk)
    for w in wi:
        sl = slice(4 * w, 4 * w + 4)
        q0, v0 = torch.zeros(S, 4, H, dk, dtype=torch.float64), torch.zeros(S, 4, n_h, H, dk, dtype=torch.float64)
        _, prod, _ = naive_delta_product(q0, k[:, sl], v0, beta[:, sl], g[:, sl], initial_state=eye.clone())
        want = torch.linalg.eigvals(prod).numpy()  # [s, H, dk]
        got = np.asarray(out["window_eig_A"].isel(**sub, window=w).values)  # [s, H, dk]
        dist = np.abs(got[..., :, None] - want[..., None, :])
        assert max(dist.min(-1).max(), dist.min(-2).max()) < 1e-5  # complex64 storage
    plain = spectra.run(ds, window=4).dataset
    assert "window_eig_A" not in plain and not plain.attrs["channel_windows"]
    np.testing.assert_array_equal(plain["eig_A"].values, out["eig_A"].values)


def test_float32_precision_of_per_channel_gates(store):
    """--precision float32 (one token, n_h = 1): eig_A within the float32 solver's bound of the float64 values,
    the choice kept in the result's attributes; an unknown precision is one ProbeError line."""
    from deltalab.probes.base import ProbeError

    ds = _channel_gated(store).isel(step=slice(0, 1))
    exact = spectra.run(ds, window=2).dataset
    fast = spectra.run(ds, window=2, precision="float32").dataset
    assert exact.attrs["precision"] == "float64" and fast.attrs["precision"] == "float32"
    got, want = fast["eig_A"].values, exact["eig_A"].values
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 32 * np.finfo(np.float32).eps * scale
    assert got.shape == want.shape and got.dtype == want.dtype == np.complex64
    with pytest.raises(ProbeError, match="--precision 'float16' is not one of float64, float32"):
        spectra.run(ds, window=2, precision="float16")


@pytest.mark.parametrize("gated", [False, True])
def test_a_batch_of_layers_at_once_equals_layer_by_layer(store, tmp_path, gated):
    """Capture hands a batch's layers to the spectra plan at once (`LayerPlan.batch_layers`: one launch of each kernel
    instead of one a layer): the same per-token results as layer by layer, gates and windows included."""
    if gated:
        store = write_synthetic_store(tmp_path / "g.zarr", gated=True, n_seq=3, length=70, seed=5)
    ds = data.open_store(store)
    assert ds.sizes["layer"] > 1 and ("g" in ds) == gated
    plan = spectra.plan(ds, window=4)
    assert plan.batch_layers
    stacked = {v: torch.from_numpy(np.moveaxis(ds[v].values, 1, 0).copy()) for v in plan.names if v in ds}
    layers = [{v: x[i] for v, x in stacked.items()} for i in range(ds.sizes["layer"])]
    seq, layer = np.arange(ds.sizes["seq"]), np.arange(ds.sizes["layer"])
    calls = []
    fn = plan.fn
    plan.fn = lambda a: calls.append(a["k"].shape[0]) or fn(a)
    one = plan.on_layers(layers, seq, layer, None)
    assert calls == [ds.sizes["seq"]] * ds.sizes["layer"]
    calls.clear()
    both = plan.on_layers(layers, seq, layer, None, stacked)
    assert calls == [ds.sizes["seq"] * ds.sizes["layer"]]
    assert set(one.data_vars) == set(both.data_vars)
    for v in one.data_vars:
        assert one[v].dims == both[v].dims
        np.testing.assert_array_equal(one[v].values, both[v].values, err_msg=v)
