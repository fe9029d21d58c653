"""The whole flow on a tiny OLMo-Hybrid folder (transformers, 2 key / 4 value heads, attention layer 2): S4
tokens through `deltalab capture`, every probe through `deltalab probe`, every dashboard page (AppTest), and a
notebook executed against the store. Layers are the model's real numbers (0, 1, 3) everywhere."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("streamlit")

from streamlit.testing.v1 import AppTest  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from deltalab import store  # noqa: E402
from deltalab.app.cli import app as cli_app  # noqa: E402
from tests.app.test_pages import DASHBOARD, PAGES, assert_clean, specs  # noqa: E402
from tests.models.hf_tiny import LINEAR_LAYERS, save_tiny  # noqa: E402

PROBE_ARGS = {
    "betas": [], "keys": [], "spectra": [], "erank": [], "linear": [], "lengthgen": ["--train-length", "40"],
    "intervene": ["--set-beta", "1:3:0=0", "--ablate-head", "3:0", "--project-keys", "0:2=2", "--erase", "1:2@10",
                  "--scale-decay", "3:1@20=0.5"],
}


def cli(*args: str):
    res = CliRunner().invoke(cli_app, list(args))
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    """Folder, store and each probe's JSON records."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    base = tmp_path_factory.mktemp("olmo_flow")
    folder = save_tiny("olmo_hybrid", base / "olmo")
    out = base / "s.zarr"
    cli("capture", str(folder), "--data", "S4:length=80,samples=8,seed=0", "--out", str(out), "--batch-size", "4",
        "--hooks", "tokens,labels,loss,q,k,v,beta,g,state,o", "--no-progress")
    records = {}
    for name, extra in PROBE_ARGS.items():
        more = ["--checkpoint", str(folder)] if name == "intervene" else []
        records[name] = json.loads(cli("probe", name, "--store", str(out), "--json", *more, *extra).stdout)
    return folder, out, records


def test_every_probe_on_real_layer_numbers(flow):
    _, out, rec = flow
    for name in ("betas", "keys", "spectra", "erank", "linear"):
        assert sorted({r["layer"] for r in rec[name] if r.get("layer") is not None}) == list(LINEAR_LAYERS), name
    betas = {(r["layer"], r["head"]): r for r in rec["betas"]}
    assert len(betas) == 3 * 4 and all(r["frac_negative"] > 0 for r in betas.values())  # OLMo-Hybrid: beta in (0, 2)
    keys = {(r["layer"], r["head"]): r["explained_variance_ratio"] for r in rec["keys"] if r["step"] == 0}
    assert keys[0, 0] == keys[0, 1] and keys[0, 2] == keys[0, 3] and keys[0, 0] != keys[0, 2]  # shared key heads
    assert {r["intervention"] for r in rec["intervene"]} == {"baseline", "set_beta", "ablate_head", "project_keys",
                                                             "erase", "scale_decay"}
    assert all(r["delta_loss"] != 0 for r in rec["intervene"] if r["intervention"] != "baseline")
    assert {"erank", "spectra", "keys", "betas"} <= set(store.list_results(out))


@pytest.mark.parametrize("page", PAGES)
def test_every_dashboard_page(flow, page, monkeypatch):
    _, out, _ = flow
    monkeypatch.setenv("DELTALAB_STORE", str(out))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    at = AppTest.from_file(DASHBOARD, default_timeout=120)
    at.run()
    assert_clean(at)
    at.sidebar.radio(key="page").set_value(page).run()
    assert_clean(at)
    box = next(w for w in at.selectbox if w.label == "Layer")
    assert list(box.options) == [f"layer {i}" for i in LINEAR_LAYERS]  # real numbers; attention layer 2 absent
    box.set_value(3).run()  # the layer after the attention layer: index 2 in the store
    assert_clean(at)
    if page not in ("Overview", "Probes"):
        assert specs(at), f"{page}: no chart"


def test_typed_input_on_grouped_heads_matches_the_store(flow, monkeypatch):
    """Typing the store's first sequence on the Input page runs the grouped model (2 key / 4 value heads): q, k, v and
    beta of the in-memory input equal the captured ones per value head (value head j reading key head j // 2), and
    every page draws it."""
    import numpy as np

    from deltalab.app.dash import loading

    folder, out, _ = flow
    monkeypatch.setenv("DELTALAB_STORE", str(out))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    ds = store.open(out)
    tokens = [int(t) for t in np.asarray(ds["tokens"].isel(seq=0).values)]
    at = AppTest.from_file(DASHBOARD, default_timeout=120)
    at.run()
    at.sidebar.radio(key="page").set_value("Input").run()
    at.text_input(key="input_checkpoint").set_value(str(folder)).run()
    at.text_area(key="input_text").set_value(" ".join(map(str, tokens))).run()
    at.button(key="input_run").click().run()
    assert_clean(at)
    mem = loading._open(at.session_state["input_key"], loading._stamp(at.session_state["input_key"]))
    assert mem.sizes["head"] == ds.sizes["head"] == 4 and "key_head" not in mem.dims
    for var in ("q", "k", "v", "beta"):
        got = np.asarray(mem[var].isel(seq=0).values, np.float64)
        want = np.asarray(ds[var].isel(seq=0).values, np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=var)
    for page in ("Betas", "Keys", "Spectra", "Token", "Attention"):
        at.sidebar.radio(key="page").set_value(page).run()
        assert_clean(at)


def test_notebook_on_the_store(flow, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    import nbformat
    from ipykernel.kernelspec import install

    from tests.notebooks.test_notebooks import KERNEL, NOTEBOOKS

    _, out, _ = flow
    prefix = tmp_path / "jupyter"
    install(kernel_name=KERNEL, display_name="deltalab tests", prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    for var in ("DELTALAB_CHECKPOINT", "DELTALAB_PRUNE_JSON", "DELTALAB_DEFAULT_CHECKPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DELTALAB_STORE", str(out))
    monkeypatch.setenv("DELTALAB_CACHE", str(tmp_path / "cache"))
    nb = nbformat.read(NOTEBOOKS / "02_effective_rank_over_time.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name=KERNEL,
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    cell = next(c for c in nb.cells if "summary" in c.get("metadata", {}).get("tags", []))
    summary = json.loads("".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream"))
    assert summary["source"] == "state-tracking" and summary["sequence_length"] == 80
    overall = next(n for n in summary["notes"] if n.startswith("Over all tokens"))
    erank = float(overall.split("mean erank is ")[1].split(" ")[0])
    assert 1.0 <= erank <= 8.0 and "min(dk, dv) = 8" in overall  # between rank 1 and min(dk, dv)
