"""The dashboard on a store captured with `--heads`: it opens, its head selector and head cards show the model's
head numbers, and a card opens the page of that head with the full store's numbers for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

from typer.testing import CliRunner  # noqa: E402

from deltalab.app.cli import app as cli_app  # noqa: E402
from tests.app.test_pages import assert_clean, goto, new_app  # noqa: E402

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "stdlib-gated-deltaproduct2"
HEADS = [1, 3]


@pytest.fixture(scope="module")
def heads_store(tmp_path_factory):
    """The gated DeltaProduct_2 captured with --heads 1,3 and probed (betas, spectra, erank, linear)."""
    out = tmp_path_factory.mktemp("dash_heads") / "s.zarr"
    res = CliRunner().invoke(cli_app, ["capture", str(ZOO), "--data", "S4:length=64,samples=6,seed=0", "--out",
                                       str(out), "--heads", "1,3", "--hooks", "tokens,labels,loss,q,k,v,beta,g,state,o",
                                       "--no-progress"])
    assert res.exit_code == 0, res.output
    for probe in ("betas", "spectra", "erank", "linear"):
        res = CliRunner().invoke(cli_app, ["probe", probe, "--store", str(out), "--json"])
        assert res.exit_code == 0, (probe, res.output)
        if probe == "linear":
            assert {r["head"] for r in json.loads(res.output[res.output.index("["):])} == {None, *HEADS}
    return out


@pytest.fixture(scope="module")
def dash(heads_store):
    mp = pytest.MonkeyPatch()
    at = new_app(mp, heads_store)
    at.run()
    assert_clean(at)
    yield at
    mp.undo()


def test_head_selector_lists_the_captured_heads_by_their_numbers(dash):
    box = dash.sidebar.selectbox(key="sel_head")
    assert box.options == [f"head {h}" for h in HEADS]
    at = goto(dash, "Overview")
    assert at.title[0].value == "Overview"


def test_head_cards_show_model_numbers_and_open_that_head(dash):
    at = goto(dash, "Heads")
    cards = " ".join(h.proto.body for h in at.get("html"))
    assert "· head 1" in cards and "· head 3" in cards and "· head 0" not in cards and "· head 2" not in cards
    layer = int(at.sidebar.selectbox(key="sel_layer").value)
    at.button(key=f"open_{layer}_1").click().run()  # the second captured head: the model's head 3
    assert_clean(at)
    assert at.session_state["page"] == "Head" and at.title[0].value == f"Head 3 · layer {layer}"
    assert at.sidebar.selectbox(key="sel_head").value == 1  # its position in the store
    goto(at, "Betas")


def test_own_input_keeps_the_stores_heads(heads_store):
    """The Input page's run of a store sequence gives the --heads store's own arrays (the same heads)."""
    import numpy as np

    from deltalab import store
    from deltalab.app.dash import own_input

    ds = store.open(heads_store)
    tokens = np.asarray(ds["tokens"].isel(seq=1).values)
    enc = own_input.encode(" ".join(map(str, tokens)), dict(ds.attrs))
    mine = own_input.run(own_input.get_model(ZOO), enc, dict(ds.attrs))
    assert mine.sizes["head"] == len(HEADS)
    for var in ("q", "beta", "k", "g", "state", "o"):
        np.testing.assert_allclose(mine[var].isel(seq=0).values, ds[var].isel(seq=1).values, rtol=1e-4, atol=1e-5,
                                   err_msg=var)
