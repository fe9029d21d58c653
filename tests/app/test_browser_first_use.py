"""A fresh server in a real headless Chromium (Debian's /usr/bin/chromium driven by playwright): the Input page runs
on the first click, while the model still warms up in the background, and a click on a cell of the Betas heatmap
selects its head. Each test starts its own server: "fresh" is the point.
Screenshots go to a temporary folder, or to $DELTALAB_SCREENSHOTS when set (to keep them)."""

from __future__ import annotations

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


def _server(store: Path, log_dir: Path):
    return dashboard([str(store)], {**os.environ, "PYTHONPATH": str(ROOT)}, log_dir, cwd=ROOT)


@pytest.fixture
def page(tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api")
    keep = os.environ.get("DELTALAB_SCREENSHOTS")
    out = Path(keep) if keep else tmp_path_factory.mktemp("shots")
    out.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b.new_page(viewport={"width": 1400, "height": 900}), out
        finally:
            b.close()


def _clean(pg, what: str) -> None:
    assert pg.get_by_test_id("stException").count() == 0, f"{what}: exception shown"
    errors = [e.inner_text() for e in pg.get_by_test_id("stAlertContentError").all()]
    assert not errors, f"{what}: {errors}"


def test_input_runs_on_the_first_click_of_a_fresh_server(page, tmp_path_factory):
    built = default_store(tmp_path_factory)
    pg, out = page
    with _server(built["store"], tmp_path_factory.mktemp("fresh_input")) as url:
        pg.goto(f"{url}/?page=Input")
        run = pg.get_by_role("button", name="Run the model on this input")
        run.wait_for(timeout=90000)
        run.click()  # at once: the model's background warm-up is still running
        _settle(pg)
        _clean(pg, "Input, first click")
        pg.get_by_test_id("stMetric").first.wait_for(timeout=60000)
        assert "256" in pg.get_by_test_id("stMetric").first.inner_text()  # the default random sequence ran
        _shot(pg, out / "input-first-click.png")


def test_a_click_on_a_betas_cell_selects_its_head(page, tmp_path_factory):
    built = default_store(tmp_path_factory)
    pg, out = page
    with _server(built["store"], tmp_path_factory.mktemp("fresh_betas")) as url:
        pg.goto(f"{url}/?page=Betas")
        _settle(pg)
        heat = pg.get_by_test_id("stPlotlyChart").first
        heat.locator("g.trace.scatter path.point").first.wait_for(state="attached", timeout=60000)
        assert "sel_head=1" not in pg.url
        heat.locator("g.trace.scatter").first.locator("path.point").nth(1).click(force=True)  # layer 0, head 1
        _settle(pg)
        _clean(pg, "Betas click")
        assert "sel_head=1" in pg.url, pg.url
        assert pg.get_by_test_id("stSidebar").get_by_role("spinbutton", name="Head").input_value() == "1"
        _shot(pg, out / "betas-click-head-1.png")
