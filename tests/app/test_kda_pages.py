"""Every dashboard page on a Kimi Linear store (per-channel gates): the pages render, the Spectra page shows the
exact transition eigenvalues and the Probes page's Decays tab shows memory lengths per key channel."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("streamlit")

from tests.app.test_pages import PAGES, assert_clean, new_app, specs  # noqa: E402
from tests.models.kda_tiny import KDA_LINEAR, probed_kimi_store  # noqa: E402


@pytest.fixture(scope="module")
def kimi_store(tmp_path_factory):
    probes = {p: [] for p in ("betas", "keys", "spectra", "erank", "decays", "linear")}
    probes["lengthgen"] = ["--train-length", "40"]
    return probed_kimi_store(tmp_path_factory.mktemp("kimi_pages"), "S4:length=80,samples=8,seed=0", probes)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders(kimi_store, page, monkeypatch):
    at = new_app(monkeypatch, kimi_store)
    at.run()
    at.sidebar.radio(key="page").set_value(page).run()
    assert_clean(at)
    box = next(w for w in at.selectbox if w.label == "Layer")
    assert list(box.options) == [f"layer {i}" for i in KDA_LINEAR]
    if page not in ("Overview", "Probes"):
        assert specs(at), f"{page}: no chart"


def test_decays_tab_shows_memory_per_key_channel(kimi_store, monkeypatch):
    at = new_app(monkeypatch, kimi_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Probes").run()
    assert_clean(at)
    titles = [s["layout"]["title"]["text"] for s in specs(at)]
    assert any(t.startswith("Memory length of the mean decay, layer 0") for t in titles), titles
    assert any(t.startswith("Channels of head 0 by memory length") for t in titles), titles


def test_token_transition_with_a_per_channel_gate_is_exact():
    import numpy as np
    import torch

    from deltalab.app.dash.derive import transition
    from deltalab.kernels.spectra.naive import dplr_eigvals_dense

    rng = np.random.default_rng(0)
    k = rng.standard_normal(8)
    k /= np.linalg.norm(k)
    g = -rng.random(8)
    tr = transition(k[None], np.array([1.3]), g)
    dense = dplr_eigvals_dense(torch.tensor(np.exp(g)), torch.tensor(k), torch.tensor(1.3, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(np.sort(tr.eigenvalues_A.real), dense, atol=1e-13)
    np.testing.assert_allclose(tr.A, (np.eye(8) - 1.3 * np.outer(k, k)) @ np.diag(np.exp(g)), atol=1e-14)
