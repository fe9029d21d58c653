"""The dashboard's researcher views: the text view, head cards and gallery, chart export — their pure logic, and
the pages under streamlit.testing.v1.AppTest on the planted synthetic store (layer 0 head 0 rotates with β = 2
and keys in a 3-D subspace; head 1 is low-rank)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.app.stores import probed_store
from tests.app.test_pages import arr, assert_clean, goto, new_app, specs, traces

ZOO_TEXT = Path(__file__).resolve().parents[2] / "models" / "zoo" / "stdlib-gated-deltaproduct2"


# --- text view: layout, tokens, rotation angles -----------------------------------------------------

def test_layout_breaks_rows_at_newlines_document_starts_and_width():
    from deltalab.app.dash.textgrid import layout

    strings = list("ab\ncdefg") + ["h", "i"]
    doc = np.zeros(len(strings), bool)
    doc[8] = True  # "h" starts a new document
    lay = layout(strings, doc, width=3)
    assert lay.row_start == [0, 3, 6, 8]  # newline ends row 0; width 3 wraps "cdefg"; the document start breaks
    assert (lay.row[:3] == 0).all() and list(lay.col[3:6]) == [0, 1, 2] and lay.n_cols == 3


def test_rotation_angles_match_the_single_token_transition():
    from deltalab.app.dash.derive import transition
    from deltalab.app.dash.textgrid import rotation_angles

    rng = np.random.default_rng(0)
    k = rng.normal(size=(20, 2, 6))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    b = rng.uniform(0, 2, (20, 2))
    ours = rotation_angles(k, b)
    ref = [transition(k[t], b[t]).rotation_deg for t in range(20)]
    np.testing.assert_allclose(ours, ref, atol=1e-9)
    # two exact reflections whose planes meet at 60 degrees rotate by 120 degrees
    a = np.array([[1.0, 0, 0], [np.cos(np.pi / 3), np.sin(np.pi / 3), 0]])
    assert rotation_angles(a[None], np.array([[2.0, 2.0]]))[0] == pytest.approx(120.0)


def test_vocab_strings_through_the_bundled_tokenizer_and_bytes():
    from deltalab.app.dash.textgrid import cell_text, vocab_strings

    tok = ZOO_TEXT / "tokenizer.json"
    names = vocab_strings(tok if tok.is_file() else None, 257)
    assert names[ord("a")] == "a" and names[10] == "\n" and names[256] == "<|endoftext|>"
    assert cell_text("\n") == "↵" and cell_text("<|endoftext|>") == "␄" and cell_text("abcdef") == "ab…"
    assert vocab_strings(None, 3) == ["\x00", "\x01", "\x02"]


# --- head table -------------------------------------------------------------------------------------

def test_head_metrics_helpers():
    from deltalab.app.dash import heads

    evr = np.array([[0.5, 0.3, 0.16, 0.04], [0.25, 0.25, 0.25, 0.25]])
    assert list(heads.key_dim(evr)) == [3.0, 4.0]
    hist = np.zeros(36)
    hist[[23, 35]] = [70, 30]  # 120 and 180 degrees (5-degree bins centred at 2.5, 7.5, ...)
    centers = np.arange(36) * 5 + 2.5
    assert heads.dominant_angles(hist, centers) == [117.5, 177.5]
    assert heads.trend(np.arange(50) * 0.02) == pytest.approx(2.0)
    df = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0], **{m: [np.nan, 2.0, 1.0] for m in heads.METRICS}})
    assert list(heads.sort_heads(df, "beta_mean")["head"]) == [1, 0, 0]  # NaN last
    assert list(heads.sort_heads(df, "beta_mean", descending=False)["layer"]) == [1, 0, 0]
    with pytest.raises(ValueError, match="unknown metric"):
        heads.sort_heads(df, "nope")
    svg = heads.sparkline([0, 1, 2], kind="bars")
    assert svg.startswith("<img") and "data:image/svg+xml;base64," in svg and heads.sparkline([]) == ""


def test_head_table_finds_the_planted_rotation_head(tmp_path_factory):
    from deltalab.app.dash import heads
    from deltalab.probes.results import read_results

    store = probed_store(tmp_path_factory)
    res = {p: read_results(store, p) for p in ("betas", "keys", "spectra", "erank", "linear")}
    df = heads.head_table(**res)
    assert len(df) == 2 * 4 and set(heads.METRICS) <= set(df.columns)
    h0 = df[(df.layer == 0) & (df["head"] == 0)].iloc[0]
    assert h0.beta_mean == pytest.approx(2.0, abs=1e-4) and h0.frac_beta_gt1 == pytest.approx(1.0)
    assert h0.key_dim <= 3 and h0.frac_rotation == pytest.approx(1.0)
    assert h0.dominant_angles and len(h0.erank_curve) == heads.SPARK_POINTS
    top = heads.sort_heads(df, "frac_rotation").iloc[0]
    assert (top.layer, top["head"]) == (0, 0)
    low = df[(df.layer == 0) & (df["head"] == 1)].iloc[0]
    assert low.erank_mean <= 2.0 + 1e-4


# --- export -----------------------------------------------------------------------------------------

def test_figure_table_and_payloads():
    import plotly.graph_objects as go

    from deltalab.app.dash import export

    fig = go.Figure([go.Heatmap(z=[[1, 2], [3, 4]], x=["h0", "h1"], y=["layer 0", "layer 1"]),
                     go.Scatter(x=[1, 2, 3], y=[4, 5, 6], name="line", customdata=[[7, 8], [9, 10], [11, 12]])])
    df = export.figure_table(fig)
    heat = df[df.trace == "trace 0"]
    assert list(heat.z) == [1, 2, 3, 4] and list(heat.y) == ["layer 0", "layer 0", "layer 1", "layer 1"]
    line = df[df.trace == "line"]
    assert list(line.y) == [4, 5, 6] and list(line.customdata_1) == [8, 10, 12]
    csv = export.payload(fig, "csv")
    assert pd.read_csv(io.StringIO(csv)).shape[0] == 7
    assert pd.read_parquet(io.BytesIO(export.payload(fig, "parquet"))).shape[0] == 7
    html = export.payload(fig, "html")
    assert "<html>" in html[:100] and "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js inside
    with pytest.raises(ValueError, match="unknown export format"):
        export.payload(fig, "bmp")


# --- pages ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    store = probed_store(tmp_path_factory)
    mp = pytest.MonkeyPatch()
    at = new_app(mp, store)
    at.run()
    assert_clean(at)
    yield at
    mp.undo()


def test_text_page_colours_tokens_and_hovers_values(app):
    at = goto(app, "Text")
    assert at.title[0].value == "Text"
    data = specs(at)[0]["data"]
    heat = [d for d in data if d["type"] == "heatmap"]
    points = [d for d in data if d["type"] == "scatter"][0]
    pos = arr(points["customdata"])[:, 0]
    assert list(pos) == list(range(128))  # every token of the sequence, clickable
    assert "β (head 0, step 0) = 2.000" in points["hovertext"][5]  # the rotation head's β = 2 on hover
    z = arr(heat[-1]["z"])
    assert np.nanmax(z) == pytest.approx(2.0, abs=1e-3)
    at.segmented_control(key="text_quantity").set_value("rotation angle").run()
    assert_clean(at)
    values = arr(traces(at, "tokens")[0]["customdata"])[:, 1]
    assert np.all((values >= 0) & (values <= 180)) and np.nanmax(values) > 1
    at.segmented_control(key="text_quantity").set_value("effective rank").run()
    assert_clean(at)
    at.segmented_control(key="text_quantity").set_value("β").run()


def test_heads_gallery_sorts_and_opens_a_card(app):
    at = goto(app, "Heads")
    assert at.title[0].value == "Heads"
    first = [b for b in at.button if b.key and b.key.startswith("open_")][0]
    at.selectbox(key="heads_sort").set_value("rotation fraction").run()
    assert_clean(at)
    buttons = [b.key for b in at.button if b.key and b.key.startswith("open_")]
    assert buttons[0] == "open_0_0" and len(buttons) == 8  # the rotation head first
    assert first.key
    at.toggle(key="heads_desc").set_value(False).run()
    assert [b.key for b in at.button if b.key and b.key.startswith("open_")][-1] == "open_0_0"
    at.toggle(key="heads_desc").set_value(True).run()
    at.button(key="open_0_0").click().run()
    assert_clean(at)
    assert at.session_state["page"] == "Head" and at.title[0].value == "Head 0 · layer 0"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["mean β"] == "2.00" and metrics["rotation fraction"] == "1.00"
    assert len(at.get("plotly_chart")) >= 5
    at.button(key="head_link_Spectra").click().run()
    assert at.session_state["page"] == "Spectra"


def test_delta_rule_heads_keep_the_beta_above_one_fraction(app, tmp_path_factory):
    """On a delta-rule store the cards, sort, table and Head page show the fraction β > 1 the betas probe stored
    (RWKV-7 stores show the strong-removal fraction instead: tests/app/test_rwkv7_pages.py)."""
    from deltalab.probes.results import read_results
    from tests.app.test_rwkv7_pages import _card_values

    res = read_results(probed_store(tmp_path_factory), "betas")  # the store `app` shows (built once)
    frac = np.asarray(res["frac_negative_head"].values, np.float64)  # [L, H]
    at = goto(app, "Heads")
    assert "fraction β > 1" in at.selectbox(key="heads_sort").options
    shown = _card_values(at, "β > 1")
    assert shown and all(v == f"{frac[layer, h]:.2f}" for (layer, h), v in shown.items())
    assert "a &gt;" not in " ".join(h.proto.body for h in at.get("html"))  # no strong-removal line
    at.button(key="open_0_0").click().run()
    assert_clean(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["fraction β > 1"] == f"{frac[0, 0]:.2f}" == "1.00"
    assert not any(k.startswith("fraction a >") for k in metrics)


def test_compare_metrics_of_a_delta_rule_and_an_rwkv7_head():
    """Two stores of different families: each side's removal number under its own name, NaN on the other side."""
    from deltalab.app.dash import compare, heads

    base = {m: 0.5 for m in heads.METRICS}
    delta = pd.Series({**base, "frac_beta_gt1": 0.25, heads.STRONG: np.nan, "strong_threshold": np.nan})
    rwkv = pd.Series({**base, "frac_beta_gt1": np.nan, heads.STRONG: 0.75, "strong_threshold": 0.9})
    table = compare.metrics_table(compare.Side("A", delta), compare.Side("B", rwkv)).set_index("metric")
    assert list(table.index[:3]) == ["mean β", "fraction β > 1", "fraction a > 0.9"]
    assert table.loc["fraction β > 1", "A"] == 0.25 and np.isnan(table.loc["fraction β > 1", "B"])
    assert table.loc["fraction a > 0.9", "B"] == 0.75 and np.isnan(table.loc["fraction a > 0.9", "A"])
    same = compare.metrics_table(compare.Side("A", rwkv), compare.Side("B", rwkv))
    assert "fraction β > 1" not in set(same["metric"]) and len(same) == len(heads.METRICS)


def test_heads_table_view(app):
    at = goto(app, "Heads")
    at.segmented_control(key="heads_view").set_value("table").run()
    assert_clean(at)
    df = at.dataframe[0].value
    assert len(df) == 8 and {"frac_rotation", "erank_curve"} <= set(df.columns)
    at.segmented_control(key="heads_view").set_value("cards").run()


# --- your own input ---------------------------------------------------------------------------------

def test_encode_task_and_text_inputs():
    from deltalab.app.dash import own_input

    s4 = {"model_config": {"vocab_size": 24}, "data_meta": {"kind": "task", "task": {"name": "S4"}}}
    enc = own_input.encode("3, 17 5 0", s4)
    assert list(enc.tokens) == [3, 17, 5, 0] and enc.kind == "task" and enc.doc_start[0] and enc.num_classes == 24
    from deltalab.tasks.state_tracking import get_task

    assert list(enc.labels) == list(get_task("S4").group.scan(np.array([[3, 17, 5, 0]]))[0])
    with pytest.raises(own_input.InputError, match="outside the model's vocabulary"):
        own_input.encode("3 24", s4)
    with pytest.raises(own_input.InputError, match="neither a token id"):
        own_input.encode("3 x", s4)
    with pytest.raises(own_input.InputError, match="empty"):
        own_input.encode("  ", s4)
    text = {"model_config": {"vocab_size": 257}, "data_meta": {"kind": "text"}}
    tok = ZOO_TEXT / "tokenizer.json"
    enc = own_input.encode("ab\nc", text, tok if tok.is_file() else None)
    assert list(enc.tokens) == [97, 98, 10, 99] and list(enc.labels) == [98, 10, 99, -100] and enc.kind == "text"


def test_own_input_matches_the_capture_of_the_same_tokens(tmp_path_factory):
    """Running a store's sequence through the Input path gives the store's own arrays."""
    from deltalab import store
    from deltalab.app.dash import own_input
    from tests.app.stores import default_store

    built = default_store(tmp_path_factory)
    ds = store.open(built["store"])
    tokens = np.asarray(ds["tokens"].isel(seq=1).values)
    enc = own_input.encode(" ".join(map(str, tokens)), dict(ds.attrs))
    mine = own_input.run(own_input.get_model(built["checkpoint"]), enc, dict(ds.attrs))
    assert dict(mine.sizes) == {**{d: ds.sizes[d] for d in mine.sizes if d != "seq"}, "seq": 1}
    assert set(mine.data_vars) == set(ds.data_vars) and mine.attrs["data_spec"] == "input:task"
    for var in ("beta", "k", "state", "loss"):
        np.testing.assert_allclose(mine[var].isel(seq=0).values, ds[var].isel(seq=1).values, rtol=1e-4, atol=1e-5)


def test_input_page_runs_the_model_and_every_page_shows_it(monkeypatch, tmp_path_factory):
    from tests.app.stores import default_store

    built = default_store(tmp_path_factory)
    at = new_app(monkeypatch, built["store"])
    at.run()
    goto(at, "Input")
    assert at.text_input(key="input_checkpoint").value == str(built["checkpoint"])
    at.text_area(key="input_text").set_value("1 2 3 4 5 6 7 8 9 10 11 12").run()
    at.button(key="input_run").click().run()
    assert_clean(at)
    assert {m.label: m.value for m in at.metric}["Tokens"] == "12"
    assert at.session_state["source"] == "your input"
    at.button(key="input_go_Text").click().run()
    assert_clean(at)
    pos = arr(traces(at, "tokens")[0]["customdata"])[:, 0]
    assert list(pos) == list(range(12))  # the typed sequence, not the store's (length 128)
    assert any("your input" in c.value for c in at.sidebar.caption)
    goto(at, "Spectra")
    assert traces(at, "unit circle")
    at.sidebar.segmented_control(key="source").set_value("store").run()
    goto(at, "Text")
    assert len(arr(traces(at, "tokens")[0]["customdata"])) == 128
    goto(at, "Input")
    at.text_area(key="input_text").set_value("1 2 99").run()
    at.button(key="input_run").click().run()
    assert any("outside the model's vocabulary" in e.value for e in at.error)


def test_input_page_draws_the_exact_attention_map(monkeypatch, tmp_path_factory):
    """The typed sequence's signed attention map for the selected layer and head, equal to the exact kernel's."""
    import torch

    from deltalab.app.dash import loading
    from deltalab.app.views.input import input_attention
    from deltalab.kernels.attention.naive import naive_attention
    from tests.app.stores import default_store

    built = default_store(tmp_path_factory)
    at = new_app(monkeypatch, built["store"])
    at.run()
    goto(at, "Input")
    at.text_area(key="input_text").set_value("1 2 3 4 5 6 7 8 9 10 11 12 13").run()
    at.button(key="input_run").click().run()
    assert_clean(at)
    spec = next(s for s in specs(at) if s["layout"]["title"]["text"].startswith("Exact attention"))
    z = np.asarray(arr(spec["data"][0]["z"]), dtype=np.float64).reshape(13, 13)
    ds = loading._open(at.session_state["input_key"], loading._stamp(at.session_state["input_key"]))
    head = int(at.session_state.get("sel_head", 0) or 0)
    np.testing.assert_allclose(z, input_attention(ds, 0, head), rtol=1e-5, atol=1e-7)
    assert np.abs(np.triu(z, 1)).max() == 0  # causal: no token reads a later one
    one = ds.isel(seq=[0], layer=0, head=[head])
    t = {n: torch.as_tensor(np.asarray(one[n].values, dtype=np.float64)) for n in ("q", "k", "v", "beta")}
    g = torch.as_tensor(np.asarray(one["g"].values, dtype=np.float64)) if "g" in one else None
    ref = naive_attention(t["q"], t["k"], t["v"], t["beta"], g, scale=t["q"].shape[-1] ** -0.5)
    np.testing.assert_allclose(z, ref[0][0, :, 0].sum(-1).numpy(), rtol=1e-5, atol=1e-7)


def test_a_url_with_typed_input_reproduces_the_view(monkeypatch, tmp_path_factory):
    """The typed input travels in the URL; opening that URL fills it in and waits for Run (a link runs no model
    by itself), which then shows the same view."""
    from tests.app.stores import default_store

    built = default_store(tmp_path_factory)
    at = new_app(monkeypatch, built["store"])
    at.query_params["page"] = "Input"
    at.query_params["input_text"] = "3 1 4 1 5 9 2 6"
    at.run()
    assert_clean(at)
    assert at.text_area(key="input_text").value == "3 1 4 1 5 9 2 6"
    assert any("This link carries an input" in i.value for i in at.info) and not specs(at)
    at.button(key="input_run").click().run()
    assert_clean(at)
    assert {m.label: m.value for m in at.metric}["Tokens"] == "8"
    assert any(s["layout"]["title"]["text"].startswith("Exact attention") for s in specs(at))
    assert at.session_state["source"] == "your input"  # every page shows it, as after pressing Run


# --- export and URLs ---------------------------------------------------------------------------------

def test_every_chart_has_its_downloads(app):
    at = goto(app, "Betas")
    charts = at.get("plotly_chart")
    buttons = at.get("download_button")
    assert len(charts) >= 4 and len(buttons) == 5 * len(charts), (len(charts), len(buttons))
    labels = sorted({b.proto.label for b in buttons})
    assert labels == sorted(["PNG", "SVG", "HTML (interactive)", "data (CSV)", "data (Parquet)"])


def test_url_names_the_store_and_page_controls(monkeypatch, tmp_path_factory):
    from tests.app.stores import bare_store

    probed, bare = probed_store(tmp_path_factory), bare_store(tmp_path_factory)
    at = new_app(monkeypatch, bare, DELTALAB_ROOTS=str(probed.parent))  # links open stores under --root
    at.query_params["store"] = str(probed)
    at.query_params["page"] = "Text"
    at.query_params["text_quantity"] = "loss"
    at.run()
    assert_clean(at)
    assert any(str(probed) in c.value for c in at.sidebar.caption)
    assert at.title[0].value == "Text" and "loss" in specs(at)[0]["layout"]["title"]["text"]


# --- comparison -------------------------------------------------------------------------------------

def test_compare_two_heads_and_two_layers(app):
    at = goto(app, "Compare")
    at.number_input(key="cmp_head").set_value(3).run()
    assert_clean(at)
    table = at.dataframe[0].value
    rot = table[table.metric == "rotation fraction"].iloc[0]
    assert rot["A: layer 0 head 0"] == pytest.approx(1.0) and rot["B − A"] < 0  # head 0 is the rotation head
    names = {d.get("name") for s in specs(at) for d in s["data"]}
    assert {"A: layer 0 head 0", "B: layer 0 head 3"} <= names and len(specs(at)) == 5
    at.segmented_control(key="cmp_mode").set_value("two layers").run()
    assert_clean(at)
    assert "B: layer 1 head 0" in {d.get("name") for s in specs(at) for d in s["data"]}
    at.segmented_control(key="cmp_mode").set_value("two heads").run()


def test_compare_two_stores(monkeypatch, tmp_path_factory):
    from tests.app.stores import default_store, other_checkpoint_store

    built, other = default_store(tmp_path_factory), other_checkpoint_store(tmp_path_factory)
    at = new_app(monkeypatch, built["store"], DELTALAB_ROOTS=str(other.parent))  # links open stores under --root
    at.query_params["page"] = "Compare"
    at.query_params["cmp_mode"] = "two stores"
    at.query_params["cmp_store"] = str(other)
    at.run()
    assert_clean(at)
    assert any("Same input tokens" in c.value for c in at.caption)
    pos = [s for s in specs(at) if "over sequence" in s["layout"]["title"]["text"]][0]
    a, b = (arr(d["y"]) for d in pos["data"])
    assert len(a) == len(b) and not np.allclose(a, b)  # two checkpoints, same tokens, different betas
    assert {d["name"][:2] for d in pos["data"]} == {"A:", "B:"}
