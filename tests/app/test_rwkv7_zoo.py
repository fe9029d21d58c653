"""The bundled RWKV-7 (models/zoo/parity-rwkv7, trained by deltalab on running parity): captured, every probe
run (the exact attention map included), the spectra exact on the trained transitions, and every dashboard page drawn."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("streamlit")

from tests.app.test_pages import assert_clean, new_app  # noqa: E402
from tests.app.test_rwkv7_pages import ALL_PAGES  # noqa: E402
from tests.models.rwkv7_tiny import probed_rwkv7_store  # noqa: E402

ZOO_RWKV7 = Path(__file__).resolve().parents[2] / "models" / "zoo" / "parity-rwkv7"
PROBES = ("betas", "keys", "spectra", "erank", "decays", "linear", "lengthgen", "intervene", "attention")



@pytest.fixture(scope="module")
def zoo_store(tmp_path_factory):
    task = json.loads((ZOO_RWKV7 / "task.json").read_text())
    length = 2 * int(task["train_length"])
    spec = f"{task['name']}:length={length},samples=8,seed=0"
    probes = {p: (["--checkpoint", str(ZOO_RWKV7)] if p in ("intervene", "lengthgen") else []) for p in PROBES}
    probes["attention"] = ["--top-k", "4"]
    return probed_rwkv7_store(tmp_path_factory.mktemp("rwkv7_zoo"), spec, probes, checkpoint=ZOO_RWKV7)


def test_every_probe_ran_and_the_attention_map_rebuilds_the_outputs(zoo_store):
    """Every probe completes on the trained model; the exact attention map of the generalised delta rule (RWKV-7)
    rebuilds each stored layer output o_t from its sources (float32 store)."""
    from deltalab.store.reader import open_results

    for name in PROBES:
        assert open_results(zoo_store, name).attrs["complete"], name
    res = open_results(zoo_store, "attention")
    err = np.asarray(res["reconstruction_error"].values, np.float64)
    assert np.isfinite(err).any() and np.nanmax(err) < 1e-3, np.nanmax(err)


def test_trained_spectra_are_the_dense_eigvals(zoo_store):
    from deltalab import store
    from deltalab.store.reader import open_results

    ds = store.open(zoo_store).isel(seq=slice(0, 2))
    res = open_results(zoo_store, "spectra").isel(seq=slice(0, 2))
    for li in range(ds.sizes["layer"]):
        kap = np.asarray(ds["kappa"].isel(layer=li, step=0).values, np.float64)  # [s, T, H, dk]
        a = np.asarray(ds["beta"].isel(layer=li, step=0).values, np.float64)
        g = np.asarray(ds["g"].isel(layer=li).values, np.float64)
        A = np.einsum("...i,ij->...ij", np.exp(g), np.eye(g.shape[-1])) - (kap * a)[..., :, None] * kap[..., None, :]
        dense = np.sort(np.linalg.eigvals(A).real, -1)
        got = np.asarray(res["eig_A"].isel(layer=li).values).real
        assert np.abs(got - dense).max() < 1e-5


@pytest.mark.parametrize("page", ALL_PAGES)
def test_every_page_renders(zoo_store, page, monkeypatch):
    at = new_app(monkeypatch, zoo_store)
    at.run()
    at.sidebar.radio(key="page").set_value(page).run()
    assert_clean(at)
