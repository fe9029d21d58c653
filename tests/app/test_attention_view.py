"""The Attention page (CircuitsVis-style exact maps on store pages): its weights are the dense float64 oracle's
(kernels.attention.naive) and causal, the exact/GLA switch shows gla_attention's weights, the head grid has one map
per head, the attention probe's stored top-k agree with the weights computed on the page; on a synthetic store
with scalar gates, a grouped hybrid (OLMo-Hybrid: 2 key / 4 value heads, attention layer 2) and Kimi Linear
(per-channel gates, attention layer 2). The click in a real browser is in test_browser_views.py."""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch

from tests.app.test_pages import arr, assert_clean, goto, new_app, specs, traces

pytest.importorskip("streamlit")


def _alpha(ds, seq: int, li: int, head: int, gla: bool = False) -> np.ndarray:
    """[query, source] token-summed weights of value head `head`, from the dense float64 oracle on the stored
    inputs (q, k per key head where the store groups them: the oracle expands them itself)."""
    from deltalab.kernels.attention.naive import naive_attention, naive_gla_attention
    from deltalab.store.reader import per_value_head

    kh = int(np.asarray(ds["key_head_of"].values)[head]) if "key_head" in ds.dims else head
    one = ds.isel(seq=[seq], layer=li)

    def t(name: str, h: int) -> torch.Tensor:
        return torch.as_tensor(np.asarray(one[name].isel({"key_head" if "key_head" in one[name].dims else "head":
                                                          [h]}).values, np.float64))

    if "key_head" not in ds.dims:
        one = per_value_head(one)
    g = t("g", head) if "g" in one else None
    fn = naive_gla_attention if gla else naive_attention
    alpha, _ = fn(t("q", kh), t("k", kh), t("v", head), t("beta", head), g)
    return alpha[0, :, 0].sum(-1).numpy()


def _shown(at) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of the token view: the customdata [position, alpha] of its points."""
    tokens = traces(at, "tokens")[0]
    cd = arr(tokens["customdata"]).reshape(-1, 2)
    return cd[:, 0].astype(int), cd[:, 1]


def _select(at, **values: int):
    for name, value in values.items():
        if name == "layer":
            next(w for w in at.selectbox if w.label == "Layer").set_value(value)
        else:
            at.sidebar.number_input(key=f"sel_{name}").set_value(value)
    at.run()
    assert_clean(at)
    return at


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A gated synthetic store (96 tokens: two chunks) with the attention probe's results."""
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    from deltalab.app.default_store import run_probe
    from deltalab.probes.synthetic import write_synthetic_store

    path = write_synthetic_store(tmp_path_factory.mktemp("attn_view") / "s.zarr", n_seq=3, length=96, n_layers=2,
                                 n_heads=4, gated=True)
    run_probe(path, "attention", ["--top-k", "6"])
    return path


def test_window_cut_at_the_first_source_keeps_the_weights_exact(synthetic):
    """Rows of a window whose inputs start at src0 > 0 equal the oracle's over the whole sequence, entry by
    entry (alpha depends only on the transitions after its source), sub-steps separate."""
    from deltalab import store
    from deltalab.app.dash import attnmap
    from deltalab.kernels.attention.naive import naive_attention

    ds = store.open(synthetic)
    win = attnmap.window(70, 96, max_queries=16, max_sources=40)
    assert (win.src0, win.lo, win.hi) == (40, 64, 80)
    rows = attnmap.rows(ds, 1, 1, 2, win)
    a = attnmap.inputs(ds, 1, 1, [2], 0, 96)
    full, _ = naive_attention(a["q"], a["k"], a["v"], a["beta"], a["g"])
    want = full[0, win.lo:win.hi, 0, win.src0:win.hi].numpy()
    np.testing.assert_allclose(rows.exact, want, rtol=0, atol=1e-12)
    row = rows.row(70)
    assert np.isnan(row[70 + 1 - win.src0:]).all() and np.isfinite(row[: 70 + 1 - win.src0]).all()
    with pytest.raises(ValueError, match="outside this window"):
        rows.row(10)
    with pytest.raises(ValueError, match="outside the sequence"):
        attnmap.window(96, 96)
    gw = attnmap.grid_window(70, 96, 4)
    assert gw.lo <= 70 < gw.hi and gw.hi - gw.lo == 64


def test_view_weights_are_the_oracle_causal_gla_switch_and_head_grid(synthetic, monkeypatch):
    from deltalab import store
    from deltalab.kernels.attention.chunk import gla_attention

    ds = store.open(synthetic)
    at = new_app(monkeypatch, synthetic)
    at.run()
    goto(at, "Text")
    _select(at, layer=1, head=2, seq=1)
    at.button(key="drill_text_attention").click().run()  # the Text page's link: the same token's sources
    assert_clean(at)
    assert at.session_state["page"] == "Attention" and at.title[0].value == "Attention"
    exact = _alpha(ds, 1, 1, 2)
    for pos in (0, 40, 95):
        _select(at, pos=pos)
        where, got = _shown(at)
        assert where.tolist() == list(range(96))
        np.testing.assert_allclose(got[: pos + 1], exact[pos, : pos + 1], rtol=0, atol=1e-6)
        assert np.isnan(got[pos + 1:]).all()  # causal: nothing after the query
        assert f"Sources of token {pos}" in specs(at)[0]["layout"]["title"]["text"]
    assert any("rebuilt from the exact map to" in c.value for c in at.caption)  # o_t = sum alpha v (stored o)

    at.segmented_control(key="attn_mode").set_value("GLA approximation").run()
    assert_clean(at)
    _, approx = _shown(at)
    from deltalab.app.dash import attnmap

    a = attnmap.inputs(ds, 1, 1, [2], 0, 96)
    want = gla_attention(a["q"], a["k"], a["v"], a["beta"], a["g"]).weights[0, 95, 0].sum(-1).numpy()
    np.testing.assert_allclose(approx, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(approx, _alpha(ds, 1, 1, 2, gla=True)[95], rtol=0, atol=1e-6)
    assert np.abs(approx - exact[95]).max() > 1e-2  # the switch changed the weights
    metrics = {m.label: float(m.value) for m in at.metric if m.label.startswith("GLA")}
    assert metrics["GLA weight error here"] > 0.01

    grid = [d for d in specs(at)[1]["data"] if d.get("type") == "heatmap"]
    assert [d["name"] for d in grid] == [f"head {h}" for h in range(4)]  # one map per head
    lo = int(arr(grid[2]["x"])[0])
    n = len(arr(grid[2]["x"]))
    gla_map = _alpha(ds, 1, 1, 2, gla=True)[lo:lo + n, lo:lo + n]
    z = arr(grid[2]["z"]).reshape(n, n)
    low = np.tril(np.ones((n, n), bool))
    np.testing.assert_allclose(z[low], gla_map[low], rtol=0, atol=1e-6)  # the grid follows the switch
    assert np.isnan(z[~low]).all()
    at.segmented_control(key="attn_mode").set_value("exact").run()


def test_stored_top_k_beside_the_weights_and_fast_clicks(synthetic, monkeypatch):
    at = new_app(monkeypatch, synthetic)
    at.run()
    goto(at, "Attention")
    _select(at, layer=0, head=1, seq=2, pos=50)
    table = at.dataframe[0].value
    assert len(table) == 6 and (table["source pos"] <= 50).all()
    np.testing.assert_allclose(table["α stored"], table["α computed here"], rtol=0, atol=1e-5)
    assert np.all(np.diff(np.abs(table["α stored"])) <= 1e-7)  # ranked by |alpha|
    assert any("Stored top-6 sources" in m.value for m in at.markdown)
    from deltalab.app.dash import attnfig, attnmap

    calls: list[str] = []
    for module, name in ((attnmap, "rows"), (attnmap, "grid"), (attnfig, "head_grid_figure")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    times = []
    for pos in (51, 60, 33, 12):  # after the first computation: clicks within the window and the grid's tokens
        t = time.perf_counter()
        _select(at, pos=pos)
        times.append(time.perf_counter() - t)
        assert f"Sources of token {pos}" in specs(at)[0]["layout"]["title"]["text"]
    assert calls == []  # nothing recomputed or rebuilt: the maps and the grid figure come from the caches
    print("attention page interactions (s):", [round(x, 3) for x in times], "median", statistics.median(times))


def test_grouped_hybrid_store(tmp_path_factory, monkeypatch):
    """OLMo-Hybrid: value head 3 reads key head 1; layers are the real numbers 0, 1, 3 (2 is softmax attention)."""
    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from deltalab import store
    from deltalab.app.cli import app as cli
    from tests.models.hf_tiny import save_tiny

    base = tmp_path_factory.mktemp("attn_grouped")
    folder = save_tiny("olmo_hybrid", base / "olmo")
    out = base / "s.zarr"
    res = CliRunner().invoke(cli, ["capture", str(folder), "--data", "S4:length=40,samples=2,seed=0", "--out",
                                   str(out), "--hooks", "tokens,labels,loss,q,k,v,beta,g,state,o", "--no-progress"])
    assert res.exit_code == 0, res.output
    at = new_app(monkeypatch, out)
    at.run()
    goto(at, "Attention")
    _select(at, layer=3, head=3, pos=30)
    exact = _alpha(store.open(out, key_heads="key"), 0, 2, 3)  # q, k as stored: per key head
    _, got = _shown(at)
    np.testing.assert_allclose(got[:31], exact[30, :31], rtol=0, atol=1e-6)
    assert any("value head 3 reads key head 1" in c.value for c in at.caption)
    assert "layer 3" in specs(at)[0]["layout"]["title"]["text"]
    assert len([d for d in specs(at)[1]["data"] if d.get("type") == "heatmap"]) == 4  # value heads


def test_per_channel_gates_kimi(tmp_path_factory, monkeypatch):
    pytest.importorskip("transformers")
    from deltalab import store
    from tests.models.kda_tiny import probed_kimi_store

    out = probed_kimi_store(tmp_path_factory.mktemp("attn_kimi"), "S4:length=40,samples=2,seed=0",
                            {"attention": ["--top-k", "4"]})
    ds = store.open(out)
    assert ds["g"].dims[-1] == "dk"  # one log-decay per key channel
    at = new_app(monkeypatch, out)
    at.run()
    goto(at, "Attention")
    _select(at, layer=3, head=1, pos=25)
    _, got = _shown(at)
    np.testing.assert_allclose(got[:26], _alpha(ds, 0, 2, 1)[25, :26], rtol=0, atol=1e-6)
    table = at.dataframe[0].value
    np.testing.assert_allclose(table["α stored"], table["α computed here"], rtol=0, atol=1e-5)
    assert len([d for d in specs(at)[1]["data"] if d.get("type") == "heatmap"]) == 2


def test_your_own_input(monkeypatch, tmp_path_factory):
    """A typed sequence (page Input, run through the store's checkpoint) on the Attention page: its weights are
    the Input page's exact map, row by row."""
    from deltalab.app.dash import loading
    from deltalab.app.views.input import input_attention
    from tests.app.stores import default_store

    built = default_store(tmp_path_factory)
    at = new_app(monkeypatch, built["store"])
    at.run()
    goto(at, "Input")
    at.text_area(key="input_text").set_value("1 2 3 4 5 6 7 8 9 10 11 12 13").run()
    at.button(key="input_run").click().run()
    at.button(key="input_go_Attention").click().run()
    assert_clean(at)
    assert at.title[0].value == "Attention" and at.session_state["source"] == "your input"
    _select(at, pos=9, head=1)
    where, got = _shown(at)
    assert where.tolist() == list(range(13))
    ds = loading._open(at.session_state["input_key"], loading._stamp(at.session_state["input_key"]))
    np.testing.assert_allclose(got[:10], input_attention(ds, 0, 1)[9, :10], rtol=0, atol=1e-6)
    assert np.isnan(got[10:]).all()
    assert not any("Stored top-k" in c.value for c in at.caption)  # nothing to run for a typed input


def test_opens_on_the_last_token_not_token_0(synthetic, monkeypatch):
    """Token 0 reads only itself: a first visit with no token chosen opens on the sequence's last token, whose
    sources span the sequence; a token chosen afterwards is kept."""
    at = new_app(monkeypatch, synthetic)
    at.run()
    goto(at, "Attention")
    assert_clean(at)
    assert "Sources of token 95" in specs(at)[0]["layout"]["title"]["text"]
    _select(at, pos=0)
    assert "Sources of token 0" in specs(at)[0]["layout"]["title"]["text"]
