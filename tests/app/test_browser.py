"""`deltalab app` in a real headless Chromium (Debian's /usr/bin/chromium driven by playwright): start the server
on a free port with no STORE (the default store: a tiny stand-in for the bundled checkpoint, built once per
session), visit every page, check that plotly drew its charts without an exception, and save a screenshot.
Screenshots go to a temporary folder, or to $DELTALAB_SCREENSHOTS when set (to keep them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.app.stores import default_store

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--enable-unsafe-swiftshader"]
PAGES = ["Overview", "Betas", "Keys", "Spectra", "Effective rank", "Probes", "Token"]
PROBE_TABS = ["Length generalisation", "Interventions"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def dashboard(args: list[str], env: dict[str, str], log_dir: Path, cwd: Path | None = None) -> Iterator[str]:
    """`deltalab app ARGS --port P` on a free localhost port, in its own process group; yields its base URL once
    its health check answers, and stops it (SIGTERM, then SIGKILL) afterwards."""
    port = _free_port()
    exe = Path(sys.executable).parent / "deltalab"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "deltalab.app.cli"]
    env = {**env, "TQDM_DISABLE": "1"}
    env.pop("DELTALAB_STORE", None)
    log = open(log_dir / "server.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([*cmd, "app", *args, "--port", str(port)], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                pytest.fail(f"`deltalab app` did not start: {log.read()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`deltalab app` (no STORE) on a free localhost port; yields its base URL."""
    built = default_store(tmp_path_factory)
    env = {**os.environ, "DELTALAB_CACHE": str(built["cache"]), "DELTALAB_DEFAULT_CHECKPOINT": str(built["checkpoint"]),
           "DELTALAB_DEFAULT_SAMPLES": "8"}
    with dashboard([], env, tmp_path_factory.mktemp("server")) as url:
        yield url


def _settle(page, timeout: float = 90.0) -> None:
    """Wait until the script has finished (stable 'notRunning') and every plotly chart is drawn."""
    quiet, deadline = 0, time.time() + timeout
    while quiet < 4:
        state = page.evaluate("() => document.querySelector('[data-testid=stApp]')"
                              "?.getAttribute('data-test-script-state')")
        quiet = quiet + 1 if state == "notRunning" else 0
        if time.time() > deadline:
            raise AssertionError(f"the dashboard did not finish running (state {state})")
        time.sleep(0.25)
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= "
                           "document.querySelectorAll('[data-testid=stPlotlyChart]').length", timeout=30000)


def _first_chart(page, sync_api, timeout_ms: int = 60000) -> None:
    """On a loaded machine the script can pause before its first chart (CI's 2 cores): wait for one, then
    settle again. Absent after the timeout, the caller's assertion names the page."""
    try:
        page.locator(".js-plotly-plot").first.wait_for(state="attached", timeout=timeout_ms)
    except sync_api.TimeoutError:
        return
    _settle(page)


def _shot(page, path: Path) -> None:
    """Screenshot the whole page: grow the viewport to the main area's scroll height (it scrolls inside)."""
    height = page.evaluate("() => document.querySelector('[data-testid=stMain]')?.scrollHeight || 1000")
    page.set_viewport_size({"width": 1400, "height": min(int(height) + 40, 5000)})
    page.wait_for_timeout(600)  # plotly relayout to the new size
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": 1400, "height": 900})


def _selected(page) -> str:
    text = page.get_by_test_id("stSidebar").inner_text()
    return next(line for line in text.splitlines() if line.startswith("Selected token"))


def _click_an_eigenvalue(page) -> None:
    """Linked views: clicking a point on the complex plane selects its token in the sidebar (and the URL)."""
    before = _selected(page)
    plane = page.get_by_test_id("stPlotlyChart").nth(1)
    plane.locator("g.trace.scatter path.point").nth(40).click(force=True)
    _settle(page)
    after = _selected(page)
    assert after != before and "sel_pos=" in page.url, (before, after, page.url)


def test_every_page_in_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    keep = os.environ.get("DELTALAB_SCREENSHOTS")
    out = Path(keep) if keep else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    saved = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(server)
            _settle(page)
            for i, name in enumerate(PAGES):
                if name != "Overview":
                    page.get_by_test_id("stSidebar").get_by_text(name, exact=True).click()
                    _settle(page)
                heading = page.locator("h1").first.inner_text()
                assert heading.startswith(name), heading
                _first_chart(page, sync_api)
                assert page.get_by_test_id("stException").count() == 0, f"{name}: exception shown"
                assert page.get_by_test_id("stAlertContentError").count() == 0, f"{name}: error shown"
                assert page.locator(".js-plotly-plot").count() > 0, f"{name}: no chart drawn"
                shot = out / f"{i + 1:02d}-{name.lower().replace(' ', '-')}.png"
                _shot(page, shot)
                saved.append(shot)
                if name == "Spectra":
                    _click_an_eigenvalue(page)
                if name == "Probes":
                    for tab in PROBE_TABS:
                        page.get_by_role("tab", name=tab).click()
                        _settle(page)
                        shot = out / f"{i + 1:02d}-probes-{tab.lower().replace(' ', '-')}.png"
                        _shot(page, shot)
                        saved.append(shot)
        finally:
            browser.close()
    assert len(saved) == len(PAGES) + len(PROBE_TABS) and all(p.stat().st_size > 10_000 for p in saved)
