"""The Lens dashboard page under AppTest: the layer x position grid holds the stored lens (colour = target
probability, text = top token), a chosen cell lists its top tokens, a store without lens results says what to run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from deltalab.app.cli import app as cli

pytest.importorskip("streamlit")
from tests.app.test_pages import arr, assert_clean, goto, new_app, specs  # noqa: E402

CKPT = Path(__file__).resolve().parents[1] / "fixtures" / "fla" / "gdn_hybrid_gva"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("lens_page")
    out = {}
    for name, hooks in (("lens", "tokens,labels,resid_post"), ("bare", "tokens,labels,q,k,v,beta,g,state")):
        path = root / f"{name}.zarr"
        res = CliRunner().invoke(cli, ["capture", str(CKPT), "--data", "S4:length=20,samples=2,seed=0", "--out",
                                       str(path), "--hooks", hooks, "--no-progress"])
        assert res.exit_code == 0, res.output
        out[name] = path
    res = CliRunner().invoke(cli, ["probe", "lens", "--store", str(out["lens"]), "--checkpoint", str(CKPT)])
    assert res.exit_code == 0, res.output
    return out


def test_grid_and_top_k(stores, monkeypatch):
    from deltalab.probes.results import read_results

    at = new_app(monkeypatch, stores["lens"])
    at.run()
    assert_clean(at)
    goto(at, "Lens")
    assert at.title[0].value == "Lens"
    heat = [d for s in specs(at) for d in s["data"] if d.get("type") == "heatmap"]
    assert len(heat) == 1
    res = read_results(stores["lens"], "lens")
    z = arr(heat[0]["z"]).reshape(res.sizes["layer"], -1)
    want = np.asarray(res["target_prob"].isel(seq=0).values, np.float64)
    np.testing.assert_allclose(z, want, rtol=1e-6, equal_nan=True)
    text = np.asarray(heat[0]["text"])
    assert text.shape == z.shape
    assert text[0, 0] == str(int(res["top_token"].values[0, 0, 0, 0]))
    # a chosen cell lists its top tokens with their probabilities
    at.session_state["lens_cell"] = (0, 3)
    at.run()
    assert_clean(at)
    table = at.dataframe[0].value
    np.testing.assert_array_equal(table["id"].values, res["top_token"].values[0, 0, 3])
    np.testing.assert_allclose(table["probability"].values, res["top_prob"].values[0, 0, 3], rtol=1e-6)
    assert "position 3" in at.subheader[0].value


def test_missing_results_name_the_command(stores, monkeypatch):
    at = new_app(monkeypatch, stores["bare"])
    at.run()
    goto(at, "Lens")
    assert any("deltalab probe lens --store" in i.value and "--run" in i.value for i in at.info)
