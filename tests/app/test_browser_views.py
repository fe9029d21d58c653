"""The researcher views in a real headless Chromium (Debian's /usr/bin/chromium driven by playwright): typing your own
input and seeing its charts, the text view's hover values and click selection, the head gallery sorted by a metric
with one card opened, a comparison of two stores, and one download of each kind (the files are read and checked).

The server is this checkout's `python -m deltalab.app.cli app STORE` on the tiny S4 stand-in store
(tests/app/stores.py). Screenshots go to a temporary folder, or to $DELTALAB_SCREENSHOTS when set (to keep them)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from tests.app.stores import default_store
from tests.app.test_browser import ARGS, CHROMIUM, _settle, _shot, dashboard

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """This checkout's dashboard on the tiny S4 store, on a free localhost port; yields (base URL, built)."""
    built = default_store(tmp_path_factory)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # --root: links may open the other stores these tests build (the comparison's second store)
    args = [str(built["store"]), "--root", str(tmp_path_factory.getbasetemp())]
    with dashboard(args, env, tmp_path_factory.mktemp("server_views"), cwd=ROOT) as url:
        yield url, built


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    """One Chromium page for the module's tests, and the screenshot folder."""
    sync_api = pytest.importorskip("playwright.sync_api")
    keep = os.environ.get("DELTALAB_SCREENSHOTS")
    out = Path(keep) if keep else tmp_path_factory.mktemp("shots")
    out.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = b.new_page(viewport={"width": 1400, "height": 900}, accept_downloads=True)
            yield page, out
        finally:
            b.close()


def _open(page, url: str) -> None:
    page.goto(url)
    _settle(page)
    assert page.get_by_test_id("stException").count() == 0, "exception shown"


def _clean(page, what: str) -> None:
    assert page.get_by_test_id("stException").count() == 0, f"{what}: exception shown"
    assert page.get_by_test_id("stAlertContentError").count() == 0, f"{what}: error shown"


def _chart_data(page, index: int = 0) -> list[dict]:
    """The plotly traces drawn by the index-th chart of the page, read from the browser."""
    return json.loads(page.evaluate(
        "(i) => JSON.stringify(document.querySelectorAll('.js-plotly-plot')[i]._fullData.map(t => ({type: t.type, "
        "name: t.name, n: t._length})))", index))


def _cell_center(page, row: int, col: int, index: int = 0) -> tuple[float, float]:
    """Screen position of text-view cell (row, col), from the plot area and the axis ranges."""
    box = page.locator(".js-plotly-plot").nth(index).locator(".nsewdrag").first.bounding_box()
    rng = json.loads(page.evaluate(
        "(i) => { const l = document.querySelectorAll('.js-plotly-plot')[i]._fullLayout; "
        "return JSON.stringify([l.xaxis.range, l.yaxis.range]); }", index))
    (x0, x1), (bottom, top) = rng  # y reversed: the first row (top of the plot) is the range's end
    x = box["x"] + (col - x0) / (x1 - x0) * box["width"]
    y = box["y"] + (row - top) / (bottom - top) * box["height"]
    return x, y


def test_text_view_hover_values_and_click_selects(server, browser):
    url, _ = server
    page, out = browser
    _open(page, f"{url}/?page=Text")
    assert page.locator("h1").first.inner_text() == "Text"
    traces = _chart_data(page)
    assert {"heatmap", "scatter"} <= {t["type"] for t in traces}
    tokens = next(t for t in traces if t["name"] == "tokens")
    assert tokens["n"] == 128  # every token of the stored sequence
    page.mouse.move(*_cell_center(page, 0, 3))
    hover = page.locator(".hoverlayer .hovertext").first
    hover.wait_for(timeout=10000)
    text = hover.text_content()
    assert "pos 3" in text and "β (head 0, step 0) = " in text, text
    _shot(page, out / "text-view.png")
    page.mouse.click(*_cell_center(page, 0, 7))
    _settle(page)
    sidebar = page.get_by_test_id("stSidebar").inner_text()
    assert "pos 7" in sidebar and "sel_pos=7" in page.url, (sidebar[-200:], page.url)
    _clean(page, "Text")


def test_head_gallery_sorted_and_a_card_opened(server, browser):
    url, _ = server
    page, out = browser
    _open(page, f"{url}/?page=Heads")
    assert page.locator("h1").first.inner_text() == "Heads"
    page.get_by_test_id("stSelectbox").filter(has_text="Sort by").click()
    page.get_by_role("option", name="fraction β > 1").click()
    _settle(page)
    assert "heads_sort=fraction" in page.url
    cards = page.locator("[data-head]")
    assert cards.count() == 2  # the tiny model: 1 layer x 2 heads
    first = cards.first.inner_text()
    values = [float(c.inner_text().split("β > 1")[1].split()[0]) for c in cards.all()]
    assert values == sorted(values, reverse=True), values
    _shot(page, out / "heads-gallery.png")
    head = int(cards.first.get_attribute("data-head").split("-")[1])
    page.get_by_role("button", name="Open card →").first.click()
    _settle(page)
    assert page.locator("h1").first.inner_text() == f"Head {head} · layer 0", first
    page.locator(".js-plotly-plot").first.wait_for()
    assert page.locator(".js-plotly-plot").count() >= 4
    _clean(page, "Head")
    _shot(page, out / "head-card.png")


def test_typing_an_input_shows_it_on_every_page(server, browser):
    url, _ = server
    page, out = browser
    _open(page, f"{url}/?page=Input")
    box = page.get_by_test_id("stTextArea").locator("textarea")
    box.fill("0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20")
    box.press("Control+Enter")
    _settle(page)
    page.get_by_role("button", name="Run the model on this input").click()
    _settle(page)
    _clean(page, "Input")
    assert "21" in page.get_by_test_id("stMetric").first.inner_text()
    page.locator(".js-plotly-plot").first.wait_for()
    _shot(page, out / "input.png")
    assert "input_text=" in page.url  # the URL carries the typed input: opening it reproduces the view on a click
    other = page.context.browser.new_page(viewport={"width": 1400, "height": 900})  # a new session
    try:
        other.goto(page.url)
        _settle(other)
        other.get_by_text("This link carries an input").first.wait_for(timeout=60000)  # nothing ran by itself
        assert other.get_by_text("Exact attention").count() == 0
        other.get_by_role("button", name="Run the model on this input").click()
        _settle(other)
        other.get_by_text("Exact attention").first.wait_for(timeout=60000)
        _clean(other, "Input from its URL")
        assert "21" in other.get_by_test_id("stMetric").first.inner_text()
        _shot(other, out / "input-from-url-attention.png")
        other.get_by_text("Exact attention").first.scroll_into_view_if_needed()
        other.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 2",
                                timeout=60000)
        _settle(other)
        index = other.locator(".js-plotly-plot").count() - 1  # the page's last chart: the attention map
        kinds = {t["type"] for t in _chart_data(other, index)}
        assert {"heatmap"} < kinds, kinds  # the map and the invisible points that carry the clicks
        other.locator(".js-plotly-plot").nth(index).scroll_into_view_if_needed()  # the click lands on the map itself
        _settle(other)
        other.mouse.click(*_cell_center(other, 10, 4, index))  # query token 10 <- source token 4
        _settle(other)
        _clean(other, "Input attention click")
        assert "pos 4" in other.get_by_test_id("stSidebar").inner_text() and "sel_pos=4" in other.url, other.url
    finally:
        other.close()
    page.get_by_role("button", name="Text →").click()
    _settle(page)
    tokens = next(t for t in _chart_data(page) if t["name"] == "tokens")
    assert tokens["n"] == 21 and "your input" in page.get_by_test_id("stSidebar").inner_text()
    for name in ("Keys", "Effective rank"):
        page.get_by_test_id("stSidebar").get_by_text(name, exact=True).click()
        _settle(page)
        page.locator(".js-plotly-plot").first.wait_for(timeout=60000)
        _settle(page)
        _clean(page, name)
        assert "computed from your input" in page.get_by_test_id("stMain").inner_text()
    _shot(page, out / "input-keys-effective-rank.png")
    page.get_by_test_id("stSidebar").get_by_text("store", exact=True).click()
    _settle(page)


def test_comparison_of_two_stores(server, browser, tmp_path_factory):
    from urllib.parse import quote

    from tests.app.stores import other_checkpoint_store

    url, _ = server
    page, out = browser
    other = other_checkpoint_store(tmp_path_factory)
    _open(page, f"{url}/?page=Compare&cmp_mode=two+stores&cmp_store={quote(str(other))}")
    page.locator(".js-plotly-plot").nth(4).wait_for(timeout=60000)
    _settle(page)
    _clean(page, "Compare")
    main = page.get_by_test_id("stMain").inner_text()
    assert "Same input tokens in both stores" in main
    names = {t["name"] for i in range(5) for t in _chart_data(page, i)}
    assert any(n.startswith("A: default-s4.zarr") for n in names) and any(n.startswith("B: other.zarr") for n in names)
    _shot(page, out / "compare-two-stores.png")


def _download(page, sync_api, label: str) -> bytes:
    page.get_by_test_id("stPopover").first.locator("button").first.click()
    button = page.get_by_test_id("stDownloadButton").filter(has_text=label).first
    button.wait_for()
    with page.expect_download(timeout=60000) as info:
        button.click()
    data = Path(info.value.path()).read_bytes()
    page.keyboard.press("Escape")
    return data


def test_one_download_of_each_kind(server, browser):
    sync_api = pytest.importorskip("playwright.sync_api")
    import pandas as pd

    url, _ = server
    page, out = browser
    _open(page, f"{url}/?page=Text")
    png = _download(page, sync_api, "PNG")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    svg = _download(page, sync_api, "SVG").decode()
    assert svg.lstrip().startswith("<svg") and "β (head 0, step 0)" in svg
    html = _download(page, sync_api, "HTML").decode()
    assert "Plotly.newPlot" in html and "(head 0, step 0)" in html
    csv = pd.read_csv(io.BytesIO(_download(page, sync_api, "CSV")))
    assert list(csv.columns) == ["positions", "token", "text", "value"] and len(csv) == 128
    pq = pd.read_parquet(io.BytesIO(_download(page, sync_api, "Parquet")))
    assert len(pq) == 128 and (pq["value"].round(4) == csv["value"].round(4)).all()
    (out / "download.png").write_bytes(png)


def _shaded(page, index: int = 0) -> int:
    """Cells of the attention view that carry a weight (finite values of its signed α heatmap)."""
    return int(page.evaluate(
        "(i) => { const t = document.querySelectorAll('.js-plotly-plot')[i]._fullData.find(d => d.type === 'heatmap'"
        " && d.name.startsWith('α')); return Array.from(t.z).flatMap(r => Array.from(r))"
        ".filter(v => v !== null && Number.isFinite(v)).length; }",
        index))


def test_attention_view_click_shades_sources_with_hover_values(server, browser):
    url, _ = server
    page, out = browser
    _open(page, f"{url}/?page=Attention&sel_pos=2&sel_head=0")
    assert page.locator("h1").first.inner_text() == "Attention"
    page.locator(".js-plotly-plot").nth(1).wait_for(timeout=60000)
    _clean(page, "Attention")
    assert _shaded(page) == 3  # query 2 reads tokens 0, 1, 2
    page.mouse.click(*_cell_center(page, 0, 9))  # make token 9 the query
    _settle(page)
    assert "sel_pos=9" in page.url and "pos 9" in page.get_by_test_id("stSidebar").inner_text()
    assert _shaded(page) == 10  # its sources: tokens 0..9, shaded by signed weight
    page.mouse.move(*_cell_center(page, 0, 4))
    hover = page.locator(".hoverlayer .hovertext").first
    hover.wait_for(timeout=10000)
    text = hover.text_content()
    assert "pos 4" in text and "α (exact) = " in text and "by step" in text, text
    value = float(text.split("α (exact) = ")[1].split()[0].replace("−", "-"))
    assert value != 0.0
    page.mouse.move(*_cell_center(page, 0, 20))  # after the query: no weight
    page.wait_for_timeout(300)
    assert "no value" in page.locator(".hoverlayer .hovertext").first.text_content()
    _shot(page, out / "attention-view.png")
    grid = page.locator(".js-plotly-plot").nth(1)
    grid.scroll_into_view_if_needed()
    maps = json.loads(page.evaluate("() => JSON.stringify(document.querySelectorAll('.js-plotly-plot')[1]._fullData"
                                    ".filter(t => t.type === 'heatmap').map(t => t.name))"))
    assert maps == ["head 0", "head 1"]  # the tiny model's two heads
    box = grid.locator(".nsewdrag").nth(1).bounding_box()  # head 1's map: click in its lower triangle
    page.mouse.click(box["x"] + 0.3 * box["width"], box["y"] + 0.7 * box["height"])
    _settle(page)
    assert "sel_head=1" in page.url, page.url
    _clean(page, "Attention, head 1")
    _shot(page, out / "attention-head-1.png")
