"""Single-step Gated DeltaNet models (OLMo-Hybrid, Qwen3-Next: one Householder step per token): P_t = I − β k kᵀ is
never a rotation, so the Spectra page shows the eigenvalue 1 − β and how often it is negative, per layer and head,
instead of a "fraction rotation" panel that is 0 everywhere."""

from __future__ import annotations

import numpy as np

from deltalab import store
from tests.app.test_pages import assert_clean, goto, new_app, specs


def test_single_step_store_shows_the_eigenvalue_not_rotations(monkeypatch, tmp_path):
    from deltalab.app.default_store import run_probe
    from deltalab.probes.results import read_results
    from deltalab.probes.synthetic import write_synthetic_store

    path = write_synthetic_store(tmp_path / "gdn.zarr", n_seq=4, length=64, n_layers=2, n_heads=3, n_h=1, gated=True)
    assert store.open(path).sizes["step"] == 1
    for name in ("betas", "spectra"):
        run_probe(path, name)
    at = new_app(monkeypatch, path)
    at.run()
    goto(at, "Spectra")
    assert_clean(at)
    figs = {s["layout"]["title"]["text"]: s for s in specs(at)}
    assert not any("rotation" in t for t in figs), list(figs)
    eig = next(s for t, s in figs.items() if t.startswith("Mean eigenvalue 1 − β"))
    betas = read_results(path, "betas")
    want = 1.0 - np.asarray(betas["beta_mean"].values)[:, 0, :]
    z = np.asarray(eig["data"][0]["z"], dtype=np.float64) if isinstance(eig["data"][0]["z"], list) else None
    if z is None:  # typed array from plotly's JSON encoder
        from tests.app.test_pages import arr

        z = arr(eig["data"][0]["z"]).reshape(want.shape)
    np.testing.assert_allclose(z, want, rtol=0, atol=1e-6)
    assert any(t.startswith("Fraction of tokens with 1 − β < 0") for t in figs)
