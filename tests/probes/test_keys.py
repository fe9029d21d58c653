"""keys probe: keys planted in a 3-D subspace give > 95% in 3 PCs; PCA, coordinates and angles are right."""

from __future__ import annotations

import numpy as np
import pytest

from deltalab.probes import data, keys
from deltalab.probes.synthetic import ROTATION_HEAD, synthetic_arrays, write_synthetic_store

KW = {"n_seq": 6, "length": 96, "dk": 8, "seed": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("keys") / "s.zarr", batch_size=2, **KW)


@pytest.fixture(scope="module")
def result(store):
    return keys.run(data.open_store(store))


def test_planted_3d_subspace(result):
    out = result.dataset
    evr = out["explained_variance_ratio"].values  # [layer, step, head, component]
    top3 = evr[..., :3].sum(-1)
    assert (top3[0, :, ROTATION_HEAD] > 0.95).all()
    assert out["explained_variance_ratio_joint"].values[0, ROTATION_HEAD, :3].sum() > 0.95
    others = np.delete(top3, ROTATION_HEAD, axis=2)
    assert (others < 0.7).all()  # random keys in 8 dims: about 3/8 + noise
    rec = next(r for r in result.records if r["layer"] == 0 and r["head"] == ROTATION_HEAD and r["joint"])
    assert rec["explained_variance_3"] > 0.95 and rec["n_components_95"] <= 3 and rec["step"] is None


def test_matches_sklearn_and_incremental(store, result):
    from sklearn.decomposition import PCA

    k = synthetic_arrays(**KW)["k"]
    x = k[:, 1, :, 0, 2].reshape(-1, KW["dk"]).astype(np.float64)  # layer 1, step 0, head 2
    ref = PCA().fit(x)
    evr = result.dataset["explained_variance_ratio"].values
    np.testing.assert_allclose(evr[1, 0, 2], ref.explained_variance_ratio_, atol=1e-6)
    inc = keys.run(data.open_store(store), force_incremental=True, budget=1 << 14).dataset
    assert inc.attrs["method"] == "incremental_pca"
    np.testing.assert_allclose(inc["explained_variance_ratio"].values, evr, atol=2e-3)


def test_coordinates_are_projections(result):
    out = result.dataset
    k = synthetic_arrays(**KW)["k"].astype(np.float64)
    layer, step, head = 0, 1, ROTATION_HEAD
    comps = out["components"].values[layer, step, head, :3]
    mean = out["mean"].values[layer, step, head]
    want = (k[:, layer, :, step, head] - mean) @ comps.T  # [seq, pos, 3]
    got = out["key_pc"].isel(layer=layer, step=step, head=head).values
    np.testing.assert_allclose(got, want, atol=1e-4)
    # the planted head's keys are reconstructed from 3 coordinates
    recon = got @ comps + mean
    np.testing.assert_allclose(recon, k[:, layer, :, step, head], atol=1e-4)


def test_principal_angles(result):
    out = result.dataset
    steps = out["step_angles"].values  # [layer, head, a, b, angle]
    np.testing.assert_allclose(steps[:, :, 0, 0], 0, atol=1e-3)  # a subspace with itself
    assert steps[0, ROTATION_HEAD, 0, 1].max() < 1.0  # both steps use the same planted 3-D subspace
    assert steps[0, 3, 0, 1].max() > 10.0  # random head: different top-3 subspaces
    heads = out["head_angles_joint"].values
    np.testing.assert_allclose(heads[0, 1, 1], 0, atol=1e-3)
    np.testing.assert_allclose(heads[0, 0, 1], heads[0, 1, 0], atol=1e-6)  # symmetric


def test_bad_subspace_dim(store):
    with pytest.raises(ValueError, match="subspace-dim"):
        keys.run(data.open_store(store), subspace_dim=99)
