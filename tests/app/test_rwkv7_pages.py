"""Every dashboard page on an RWKV-7 store (per-channel betas a_rwkv, removal key kappa, per-channel decays): the pages
render, the Spectra and Token pages show each token's exact DPLR eigenvalues, the Betas page per-channel a_rwkv, the
Attention page the dense float64 oracle's DPLR map."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("streamlit")

from tests.app.test_pages import arr, assert_clean, new_app, specs  # noqa: E402
from tests.models.rwkv7_tiny import probed_rwkv7_store  # noqa: E402

ALL_PAGES = ["Overview", "Input", "Betas", "Keys", "Spectra", "Effective rank", "Probes", "Token", "Text", "Attention",
             "Heads", "Head", "Lens", "Patching", "Compare"]


STRONG = 0.6
"""The betas probe's --strong threshold on this store."""


@pytest.fixture(scope="module")
def rwkv_store(tmp_path_factory):
    probes = {p: [] for p in ("betas", "keys", "spectra", "erank", "decays", "linear")}
    probes["attention"] = ["--top-k", "4"]
    probes["betas"] = ["--strong", str(STRONG)]  # not the default: the pages must show the recorded threshold
    return probed_rwkv7_store(tmp_path_factory.mktemp("rwkv7_pages"), "S4:length=70,samples=4,seed=0", probes)


@pytest.mark.parametrize("page", ALL_PAGES)
def test_every_page_renders(rwkv_store, page, monkeypatch):
    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value(page).run()
    assert_clean(at)


def test_page_list_is_the_dashboard_s():
    from deltalab.app.frame import _pages

    assert list(_pages()) == ALL_PAGES


def _stored_transition(store_path, seq: int, layer_index: int, pos: int, head: int) -> np.ndarray:
    """The dense float64 A_t = diag(e^g) - (kappa * a) kappa^T of one stored token."""
    from deltalab import store

    ds = store.open(store_path)
    one = ds.isel(seq=seq, layer=layer_index, pos=pos, head=head)
    kap = np.asarray(one["kappa"].values, np.float64)[0]
    a = np.asarray(one["beta"].values, np.float64)[0]
    g = np.asarray(one["g"].values, np.float64)
    return np.diag(np.exp(g)) - np.outer(kap * a, kap)


def _trace(spec: dict, name_start: str) -> dict:
    found = [t for t in spec["data"] if str(t.get("name", "")).startswith(name_start)]
    assert found, [t.get("name") for t in spec["data"]]
    return found[0]


def test_token_page_shows_the_exact_dplr_eigenvalues(rwkv_store, monkeypatch):
    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Token").run()
    assert_clean(at)
    eig_fig = next(s for s in specs(at) if s["layout"]["title"]["text"].startswith("Eigenvalues of this token"))
    got = np.sort(arr(_trace(eig_fig, "A_t: all dk")["x"]))
    seq, layer_index, pos, head = 0, 0, 0, 0  # the default selection
    dense = np.linalg.eigvals(_stored_transition(rwkv_store, seq, layer_index, pos, head))
    assert np.abs(dense.imag).max() < 1e-9 and len(got) == len(dense)
    np.testing.assert_allclose(got, np.sort(dense.real), atol=1e-6)
    titles = [s["layout"]["title"]["text"] for s in specs(at)]
    assert any(t.startswith("κ, a and w per key channel") for t in titles), titles


def test_spectra_page_shows_the_exact_dplr_eigenvalues(rwkv_store, monkeypatch):
    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Spectra").run()
    assert_clean(at)
    radio = at.radio(key="spec_matrix")
    a_option = next(o for o in radio.options if o.startswith("A_t"))
    radio.set_value(a_option).run()
    assert_clean(at)
    plane = next(s for s in specs(at) if s["layout"]["title"]["text"].startswith("Non-trivial eigenvalues of A_t"))
    xs = np.concatenate([arr(t["x"]) for t in plane["data"] if t.get("x") is not None])
    dense = np.sort(np.linalg.eigvals(_stored_transition(rwkv_store, 0, 0, 0, 0)).real)
    for lam in dense:  # the selected token's dk exact eigenvalues are among the plotted points
        assert np.abs(xs - lam).min() < 1e-6, lam


def test_betas_page_shows_per_channel_removal_strengths(rwkv_store, monkeypatch):
    from deltalab import store
    from deltalab.store.reader import open_results

    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Betas").run()
    assert_clean(at)
    fig = next(s for s in specs(at) if s["layout"]["title"]["text"].startswith("Mean a per head and key channel"))
    z = np.asarray(fig["data"][0]["z"], dtype=np.float64) if isinstance(fig["data"][0]["z"], list) \
        else arr(fig["data"][0]["z"])
    beta = np.asarray(store.open(rwkv_store)["beta"].isel(layer=0).values, np.float64)[:, :, 0]  # [s, T, H, dk]
    np.testing.assert_allclose(z.reshape(beta.shape[2:]), beta.mean((0, 1)), rtol=1e-5)
    assert open_results(rwkv_store, "betas").attrs["per_channel"]


@pytest.mark.parametrize("page", [p for p in ALL_PAGES if p not in ("Input",)])
def test_your_own_input_on_every_page(rwkv_store, page, monkeypatch):
    """A typed sequence runs through the rwkv7 checkpoint with the hooks, and every page shows it."""
    from tests.models.rwkv7_tiny import FIXTURE

    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Input").run()
    at.text_input(key="input_checkpoint").set_value(str(FIXTURE)).run()
    at.text_area(key="input_text").set_value("1 2 3 4 5 6 7 8 9 10 11 12").run()
    at.button(key="input_run").click().run()
    assert_clean(at)
    assert at.session_state["source"] == "your input"
    at.sidebar.radio(key="page").set_value(page).run()
    assert_clean(at)


def test_own_input_attention_map_rebuilds_the_recurrence_output(rwkv_store):
    """On a short typed rwkv7 input the Input page's map (kernels.attention.dplr_chunk) is the float64 oracle's, and
    sum_s alpha_ts v_s = o_t."""
    from deltalab import store
    from deltalab.app.dash import own_input
    from deltalab.app.views.input import input_attention
    from tests.models.rwkv7_tiny import FIXTURE

    attrs = dict(store.open(rwkv_store).attrs)
    enc = own_input.encode("1 2 3 4 5 6 7 8 9 10 11 12", attrs)
    ds = own_input.run(own_input.get_model(FIXTURE), enc, attrs)
    assert ds["beta"].dims[-1] == "dk" and "kappa" in ds
    for li, head in ((0, 1), (1, 3)):
        alpha = input_attention(ds, li, head)
        v = np.asarray(ds["v"].isel(seq=0, layer=li, step=0, head=head).values, np.float64)  # [T, dv]
        o = np.asarray(ds["o"].isel(seq=0, layer=li, head=head).values, np.float64)
        assert np.abs(np.triu(alpha, 1)).max() == 0
        np.testing.assert_allclose(alpha, _dplr_oracle(ds, 0, li, head), rtol=0, atol=1e-10)
        np.testing.assert_allclose(alpha @ v, o, atol=1e-4 * np.abs(o).max())


def test_text_page_colours_by_the_effective_beta(rwkv_store, monkeypatch):
    from deltalab import store
    from tests.app.test_pages import arr, traces

    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Text").run()
    assert_clean(at)
    heat = next(t for t in traces(at, "effective β = Σκ²a (head 0)"))
    ds = store.open(rwkv_store).isel(seq=0, layer=0, step=0, head=0)
    kap, a = (np.asarray(ds[n].values, np.float64) for n in ("kappa", "beta"))
    want = (kap * kap * a).sum(-1)  # [T]
    z = np.asarray(arr(heat["z"]), np.float64).ravel()
    got = z[np.isfinite(z)]
    np.testing.assert_allclose(np.sort(got), np.sort(want), rtol=1e-5)


def test_text_page_colours_by_the_strong_removal_fraction(rwkv_store, monkeypatch):
    """'fraction β > 1' (never on RWKV-7: a in [0, 1]) is shown as the fraction of a above the probe's threshold."""
    from deltalab import store
    from tests.app.test_pages import arr, traces

    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Text").run()
    at.segmented_control(key="text_quantity").set_value("fraction β > 1").run()
    assert_clean(at)
    heat = next(t for t in traces(at, f"fraction of a > {STRONG:g} (all heads and key channels)"))
    a = np.asarray(store.open(rwkv_store)["beta"].isel(seq=0, layer=0).values, np.float64)  # [T, step, head, dk]
    want = (a > STRONG).reshape(a.shape[0], -1).mean(1)
    assert 0 < want.mean() < 1  # the threshold splits this store's strengths
    z = np.asarray(arr(heat["z"]), np.float64).ravel()
    np.testing.assert_allclose(np.sort(z[np.isfinite(z)]), np.sort(want), rtol=1e-6)


def _dplr_oracle(ds, seq: int, li: int, head: int, removal: bool = True) -> np.ndarray:
    """[query, source] alpha of one head from the dense float64 oracle on the stored inputs (removal False: the
    decay-only approximation, a = b = 0)."""
    import torch

    from deltalab.kernels.attention.dplr_naive import naive_dplr_attention

    one = ds.isel(seq=[seq], layer=li, head=[head])

    def t(name: str) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(one[name].values, np.float64))
        return x[:, :, 0] if "step" in one[name].dims else x

    kap = t("kappa") * (1.0 if removal else 0.0)
    alpha, _ = naive_dplr_attention(t("q"), t("k"), t("v"), -kap, kap * t("beta"), t("g"), scale=1.0)
    return alpha[0, :, 0].numpy()


def test_attention_page_shows_the_dense_oracle_s_map(rwkv_store, monkeypatch):
    """The Attention page's weights are the float64 DPLR oracle's (exact and, switched, the decay-only map), rows
    of a window cut at src0 > 0 stay exact, the stored o is rebuilt, the head grid has a map per head."""
    from deltalab import store
    from deltalab.app.dash import attnmap
    from tests.app.test_attention_view import _select, _shown

    ds = store.open(rwkv_store)
    exact = _dplr_oracle(ds, 1, 1, 2)
    win = attnmap.window(60, 70, max_queries=16, max_sources=40)
    assert win.src0 == 24
    rows = attnmap.rows(ds, 1, 1, 2, win)
    np.testing.assert_allclose(rows.exact[..., 0], exact[win.lo:win.hi, win.src0:win.hi], rtol=0, atol=1e-12)

    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Attention").run()
    assert_clean(at)
    _select(at, layer=1, head=2, seq=1)
    for pos in (0, 33, 69):
        _select(at, pos=pos)
        where, got = _shown(at)
        assert where.tolist() == list(range(70))
        np.testing.assert_allclose(got[: pos + 1], exact[pos, : pos + 1], rtol=0, atol=1e-6)
        assert np.isnan(got[pos + 1:]).all()
    rebuilt = [c.value for c in at.caption if "rebuilt from the exact map to" in c.value]
    assert rebuilt and float(rebuilt[0].split("map to ")[1].split(" ")[0]) < 1e-4
    assert any("RWKV-7" in c.value for c in at.caption)
    assert any("Stored top-4 sources" in m.value for m in at.markdown)  # the attention probe's results beside
    at.segmented_control(key="attn_mode").set_value("GLA approximation").run()
    assert_clean(at)
    _, approx = _shown(at)
    np.testing.assert_allclose(approx, _dplr_oracle(ds, 1, 1, 2, removal=False)[69], rtol=0, atol=1e-6)
    assert np.abs(approx - exact[69]).max() > 1e-3
    grid = [d for d in specs(at)[1]["data"] if d.get("type") == "heatmap"]
    assert [d["name"] for d in grid] == [f"head {h}" for h in range(4)]


def _card_values(at, label: str) -> dict[tuple[int, int], str]:
    """{(layer, head position): the number beside `label` (as text or HTML-escaped)} of every head card on the page."""
    import html
    import re

    out = {}
    names = "|".join(re.escape(n) for n in {label, html.escape(label)})
    for body in (h.proto.body for h in at.get("html")):
        head = re.search(r'data-head="(\d+)-(\d+)"', body)
        value = re.search(rf">(?:{names})</td><td[^>]*>([^<]+)</td>", body)
        if head and value:
            out[int(head[1]), int(head[2])] = value[1]
    return out


def test_heads_and_head_pages_show_the_strong_removal_fraction(rwkv_store, monkeypatch):
    """RWKV-7's removal strength a lies in [0, 1], so β > 1 never happens: the cards, sort, table, Head page and
    Compare show the betas probe's fraction of a above its recorded --strong threshold instead."""
    from deltalab.store.reader import open_results

    res = open_results(rwkv_store, "betas")
    assert float(res.attrs["strong_threshold"]) == STRONG
    frac = np.asarray(res["frac_strong"].values, np.float64)[:, 0]  # [L, H]: one step
    layers = [int(x) for x in res["layer"].values]
    assert 0 < frac.max() and frac.min() < 1  # a number worth showing
    stored = {(layer, h): frac[li, h] for li, layer in enumerate(layers) for h in range(frac.shape[1])}
    label, short = f"fraction a > {STRONG:g}", f"a > {STRONG:g}"

    at = new_app(monkeypatch, rwkv_store)
    at.run()
    at.sidebar.radio(key="page").set_value("Heads").run()
    assert_clean(at)
    sort = at.selectbox(key="heads_sort")
    assert label in sort.options and "fraction β > 1" not in sort.options
    sort.set_value(label).run()
    assert_clean(at)
    cards = " ".join(h.proto.body for h in at.get("html"))
    assert "β &gt; 1" not in cards and "β > 1" not in cards
    shown = _card_values(at, short)
    assert len(shown) == min(len(stored), 12)
    for key, value in shown.items():
        assert value == f"{stored[key]:.2f}", (key, value)
    from deltalab.app.views.heads import COLUMNS

    order = [b.key for b in at.button if b.key and b.key.startswith("open_")]  # column by column
    want = sorted(stored, key=lambda k: (-stored[k], k))[: len(order)]  # highest first, row by row
    by_column = sorted(range(len(want)), key=lambda i: (i % COLUMNS, i))
    assert order == [f"open_{want[i][0]}_{want[i][1]}" for i in by_column], order

    at.segmented_control(key="heads_view").set_value("table").run()
    assert_clean(at)
    table = at.dataframe[0].value
    assert "frac_strong" in table.columns and "frac_beta_gt1" not in table.columns
    for _, row in table.iterrows():
        assert row["frac_strong"] == pytest.approx(stored[int(row["layer"]), int(row["head"])], abs=1e-12)
    at.segmented_control(key="heads_view").set_value("cards").run()

    layer, head = want[0]
    at.button(key=f"open_{layer}_{head}").click().run()
    assert_clean(at)
    assert at.session_state["page"] == "Head"
    metrics = {m.label: m.value for m in at.metric}
    assert "fraction β > 1" not in metrics and metrics[label] == f"{stored[layer, head]:.2f}"

    at.sidebar.radio(key="page").set_value("Compare").run()
    assert_clean(at)
    names = list(at.dataframe[0].value["metric"])
    assert label in names and "fraction β > 1" not in names
