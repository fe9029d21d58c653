"""The Streamlit dashboard under streamlit.testing.v1.AppTest: every page draws its plotly figures (checked in
the figure specs: trace types, the unit circle, markers), the views are linked, and bad input is a message."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from deltalab.app.dash.safe import markdown_text
from tests.app.stores import bare_store, default_store, probed_store

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

DASHBOARD = str(Path(__file__).resolve().parents[2] / "app" / "dashboard.py")
PAGES = ["Overview", "Betas", "Keys", "Spectra", "Effective rank", "Probes", "Token"]


def new_app(monkeypatch, store: Path | str | None, **env: str) -> AppTest:
    if store is None:
        monkeypatch.delenv("DELTALAB_STORE", raising=False)
    else:
        monkeypatch.setenv("DELTALAB_STORE", str(store))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    return AppTest.from_file(DASHBOARD, default_timeout=120)


def specs(at: AppTest) -> list[dict]:
    """The plotly figure specs (JSON) of the page, in order."""
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def arr(value) -> np.ndarray:
    """A plotly spec array: a list, or plotly's typed-array form {"dtype", "bdata"[, "shape"]}."""
    if isinstance(value, dict) and "bdata" in value:
        import base64

        out = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = value.get("shape")
        if shape:
            out = out.reshape([int(n) for n in str(shape).split(",")])
        return out
    return np.asarray(value, dtype=float)


def trace_types(at: AppTest) -> list[set[str]]:
    return [{d.get("type", "scatter") for d in s["data"]} for s in specs(at)]


def traces(at: AppTest, name: str | None = None, type_: str | None = None) -> list[dict]:
    return [d for s in specs(at) for d in s["data"]
            if (name is None or d.get("name") == name) and (type_ is None or d.get("type", "scatter") == type_)]


def assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def goto(at: AppTest, page: str) -> AppTest:
    at.sidebar.radio(key="page").set_value(page).run()
    assert_clean(at)
    return at


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """One running dashboard on the probed synthetic store, shared by the page tests (they switch pages)."""
    store = probed_store(tmp_path_factory)
    mp = pytest.MonkeyPatch()
    at = new_app(mp, store)
    at.run()
    assert_clean(at)
    yield at
    mp.undo()


# --- every page ------------------------------------------------------------------------------

def test_overview(app):
    at = goto(app, "Overview")
    assert at.title[0].value == "Overview"
    assert {"bar"} in trace_types(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Sequences complete"] == "8 / 8" and metrics["Heads × steps"] == "4 × 2"
    md = " ".join(m.value for m in at.markdown)
    assert markdown_text("gated_deltaproduct n_h=2") in md and "synthetic:seqs=8,length=128" in md  # shown as text


def test_betas_heatmaps_histogram_and_per_token_scatter(app):
    at = goto(app, "Betas")
    types = trace_types(at)
    heat = [d["type"] for d in specs(at)[0]["data"]]
    assert types[0] == {"heatmap", "scatter"} and heat.count("heatmap") == 2  # one heatmap per Householder step
    assert heat.count("scatter") == 2  # with the invisible points that carry each one's clicks
    assert {"histogram"} in types
    assert traces(at, "input tokens", "scatter"), "per-token beta_0 vs beta_1 scatter"
    # the planted rotation head: beta = 2 on both steps, flagged as a reflection head
    assert any("layer 0 head 0" in s.value for s in at.success)
    tok = traces(at, "input tokens")[0]
    np.testing.assert_allclose(arr(tok["x"]), 2.0, atol=1e-5)
    np.testing.assert_allclose(arr(tok["y"]), 2.0, atol=1e-5)
    assert traces(at, "reflection (β = 2, 2)")


def test_keys_explained_variance_scatter3d_and_angles(app):
    at = goto(app, "Keys")
    types = trace_types(at)
    assert types[0] == {"bar", "scatter"}  # explained variance: bars + cumulative lines
    assert "scatter3d" in types[1]
    assert sum(t == {"heatmap"} for t in types) == 2  # step-step and head-head principal angles
    # head 0 keys lie in a 3-D subspace: top-3 PCs hold all the variance
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Top-3 PCs, step 0"] == "100.0%"
    assert traces(at, "selected token", "scatter3d")


def test_spectra_unit_circle_angles_tokens_gate(app):
    at = goto(app, "Spectra")
    circle = traces(at, "unit circle")
    assert circle and np.allclose(np.hypot(arr(circle[0]["x"]), arr(circle[0]["y"])), 1.0)
    assert any("histogram" in t for t in trace_types(at))
    assert any("box" in t for t in trace_types(at)), "gate scaling (the store is gated)"
    # rotation head: every eigenvalue on the unit circle
    eig = [d for d in traces(at, type_="scatter") if d.get("name", "").isdigit() or d.get("name", "")[:1].isdigit()]
    pts = np.concatenate([np.hypot(arr(d["x"]), arr(d["y"])) for d in eig if d.get("mode") == "markers"])
    assert pts.size and np.allclose(pts, 1.0, atol=1e-3)
    rot = specs(at)[0]["data"][0]
    assert rot["type"] == "heatmap" and abs(arr(rot["z"])[0, 0] - 1.0) < 1e-9  # layer 0 head 0: all rotations


def test_effective_rank_lines_markers_and_measure_choice(app):
    at = goto(app, "Effective rank")
    lines = [d for d in traces(at, type_="scatter") if d.get("name", "").startswith("head ")]
    assert len(lines) == 4
    layout = specs(at)[0]["layout"]
    notes = [a.get("text", "") for a in layout.get("annotations", [])]
    assert "training length 64" in notes and "document start" in notes
    assert any(t == {"heatmap", "scatter"} for t in trace_types(at))  # a layer x head heatmap that takes clicks
    # head 1 is the planted low-rank head: rank <= 2
    assert np.nanmax(arr(lines[1]["y"])) <= 2.0 + 1e-4
    at.radio(key="rank_metric").set_value("stable rank").run()
    assert_clean(at)
    assert "Stable rank" in specs(at)[0]["layout"]["title"]["text"]
    at.radio(key="rank_metric").set_value("entropy effective rank").run()


def test_probes_linear_lengthgen_and_missing_interventions(app):
    at = goto(app, "Probes")
    assert any(t == {"heatmap"} for t in trace_types(at))  # probe inputs as columns: not heads, no click points
    names = {d.get("name") for d in traces(at)}
    assert {"token accuracy", "sequence accuracy (prefix)"} <= names
    heat = specs(at)[0]["data"][0]
    assert heat["x"][0] == "all heads" and arr(heat["z"])[0, 0] > 0.9  # layer 0 decodes the label (copy head)
    assert any("deltalab probe intervene" in i.value for i in at.info)


def test_token_drilldown(app):
    at = goto(app, "Token")
    assert at.title[0].value.startswith("Token")
    assert traces(at, "unit circle") and traces(at, "non-trivial eigenvalues of P_t")
    eig = traces(at, "non-trivial eigenvalues of P_t")[0]
    assert np.allclose(np.hypot(arr(eig["x"]), arr(eig["y"])), 1.0, atol=1e-4)  # layer 0 head 0 is a rotation
    assert sum(t == {"heatmap"} for t in trace_types(at)) >= 3  # keys, Gram, P_t


# --- linked views ------------------------------------------------------------------------------

def test_selection_carries_across_pages_and_drill_down(app):
    at = goto(app, "Betas")
    at.sidebar.number_input(key="sel_head").set_value(2).run()
    at.sidebar.number_input(key="sel_pos").set_value(5).run()
    assert_clean(at)
    shapes = specs(at)[0]["layout"]["shapes"]
    assert shapes and shapes[0]["x0"] == pytest.approx(1.5)  # head 2 outlined in the step heatmaps
    at.button(key="drill_betas").click().run()
    assert_clean(at)
    assert at.session_state["page"] == "Token"
    assert "pos 5" in at.title[0].value and "head 2" in at.caption[0].value
    goto(at, "Spectra")
    assert specs(at)[0]["layout"]["shapes"][0]["x0"] == pytest.approx(1.5)
    at.sidebar.number_input(key="sel_head").set_value(0).run()
    at.sidebar.number_input(key="sel_pos").set_value(0).run()


def test_transition_matches_dense_eigenvalues():
    from deltalab.app.dash.derive import transition

    rng = np.random.default_rng(1)
    for n_h, dk in ((1, 5), (2, 8), (3, 6)):
        k = rng.normal(size=(n_h, dk))
        k /= np.linalg.norm(k, axis=1, keepdims=True)
        b = rng.uniform(0, 2, n_h)
        tr = transition(k, b, g=-0.3)
        P = np.eye(dk)
        for j in range(n_h):
            P = (np.eye(dk) - b[j] * np.outer(k[j], k[j])) @ P
        np.testing.assert_allclose(tr.P, P, atol=1e-12)
        dense = np.sort_complex(np.linalg.eigvals(P))
        ours = np.sort_complex(np.concatenate([tr.eigenvalues, np.ones(dk - n_h)]))
        np.testing.assert_allclose(ours, dense, atol=1e-8)
        np.testing.assert_allclose(tr.eigenvalues_A, tr.eigenvalues * np.exp(-0.3))


# --- bad input -----------------------------------------------------------------------------------

def _page_text(at: AppTest) -> str:
    return " ".join([e.value for e in at.error] + [i.value for i in at.info] + [w.value for w in at.warning])


def test_missing_path(monkeypatch, tmp_path):
    at = new_app(monkeypatch, tmp_path / "nowhere.zarr")
    at.run()
    assert not at.exception
    text = _page_text(at)
    assert "No store at this path" in text and "deltalab capture" in text


def test_folder_that_is_not_a_store(monkeypatch, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    at = new_app(monkeypatch, tmp_path)
    at.run()
    assert not at.exception and "not a deltalab store" in _page_text(at)
    group = tmp_path / "plain.zarr"
    group.mkdir()
    (group / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    at = new_app(monkeypatch, group)
    at.run()
    assert not at.exception and "not a deltalab store" in _page_text(at)


def test_store_of_a_newer_format(monkeypatch, tmp_path, tmp_path_factory):
    src = bare_store(tmp_path_factory)
    newer = tmp_path / "newer.zarr"
    shutil.copytree(src, newer)
    meta = json.loads((newer / "zarr.json").read_text())
    meta["attributes"]["deltalab_format"] = 99
    (newer / "zarr.json").write_text(json.dumps(meta))
    at = new_app(monkeypatch, newer)
    at.run()
    assert not at.exception
    text = _page_text(at)
    assert "newer deltalab" in text and "Upgrade" in text


def test_store_without_complete_sequences(monkeypatch, tmp_path, tmp_path_factory):
    src = bare_store(tmp_path_factory)
    empty = tmp_path / "empty.zarr"
    shutil.copytree(src, empty)
    import zarr

    zarr.open_array(str(empty / "complete"), mode="r+")[:] = False
    at = new_app(monkeypatch, empty)
    at.run()
    assert not at.exception and "no complete sequences" in _page_text(at)


def test_store_with_a_corrupt_chunk_says_so_on_the_page(monkeypatch, tmp_path, tmp_path_factory):
    """A beta chunk whose crc32c no longer matches: the Betas page shows one message naming the store and the fix
    (not zarr's two checksums), and no exception."""
    src = bare_store(tmp_path_factory)
    bad = tmp_path / "bad.zarr"
    shutil.copytree(src, bad)
    for chunk in (p for p in (bad / "beta").rglob("*") if p.is_file() and "c" in p.relative_to(bad).parts):
        chunk.write_bytes(os.urandom(chunk.stat().st_size))
    at = new_app(monkeypatch, bad)
    at.run()
    at.sidebar.radio(key="page").set_value("Betas").run()
    assert not at.exception, [e.message for e in at.exception]
    assert f"store {bad} has a corrupt chunk" in _page_text(at) and "recapture" in _page_text(at)


def test_store_whose_complete_flags_fail_their_checksum_says_so(monkeypatch, tmp_path, tmp_path_factory):
    """`complete` is read when the store opens: a chunk of it that still decodes (a flag flipped, crc32c tail kept)
    is the one corrupt-chunk message in the store's problem box, not zarr's two checksums, and no exception."""
    from tests.store.chunks import chunk_files, forge

    bad = tmp_path / "bad.zarr"
    shutil.copytree(bare_store(tmp_path_factory), bad)
    forge(chunk_files(bad / "complete")[0], bad / "complete")
    at = new_app(monkeypatch, bad)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    errors = " ".join(e.value for e in at.error)
    assert f"store {bad} has a corrupt chunk (its checksum does not match its bytes)" in errors, errors
    assert "stored and computed" not in errors.lower()


@pytest.mark.parametrize("damage", ["garbage", "still_decodes"])
def test_corrupt_probe_results_say_so_on_the_page(monkeypatch, tmp_path, tmp_path_factory, damage):
    """The page-level path (not a preview): the Betas probe's result chunks fail their checksums (random bytes, or a
    valid zstd frame of other bytes that only the crc32c tells), so drawing the page itself fails; it shows one
    message naming the store and the fix (not zarr's two checksums), no exception, and the other pages still draw."""
    from tests.app.stores import probed_store
    from tests.store.chunks import chunk_files, forge, has_crc32c

    bad = tmp_path / "bad.zarr"
    shutil.copytree(probed_store(tmp_path_factory), bad)
    arrays = [a for a in (bad / "results" / "betas").iterdir() if a.is_dir() and chunk_files(a)]
    assert arrays and all(has_crc32c(a) for a in arrays)
    for array in arrays:
        for chunk in chunk_files(array):
            if damage == "garbage":
                chunk.write_bytes(os.urandom(chunk.stat().st_size))
            elif np.dtype(zarr.open_array(str(array), mode="r").dtype).kind == "f":  # a number off, still decodes
                forge(chunk, array)
    at = new_app(monkeypatch, bad)
    at.run()
    at.sidebar.radio(key="page").set_value("Betas").run()
    assert not at.exception, [e.message for e in at.exception]
    errors = " ".join(e.value for e in at.error)
    assert f"store {bad} has a corrupt chunk (its checksum does not match its bytes)" in errors, errors
    assert "recapture" in errors and "stored and computed" not in errors.lower()
    at.sidebar.radio(key="page").set_value("Keys").run()
    assert not at.exception and not at.error, [e.value for e in at.error]


@pytest.mark.parametrize("page,probe", [("Betas", "betas"), ("Keys", "keys"), ("Spectra", "spectra"),
                                        ("Effective rank", "erank"), ("Probes", "linear")])
def test_store_without_probe_results(monkeypatch, tmp_path_factory, page, probe):
    """Each page says which probe to run (the exact command) and shows a preview where one is cheap."""
    store = bare_store(tmp_path_factory)
    at = new_app(monkeypatch, store)
    at.run()
    goto(at, page)
    infos = " ".join(i.value for i in at.info)
    assert f"deltalab probe {probe} --store {store}" in infos
    if page != "Probes":
        assert at.get("plotly_chart"), "a preview from the first sequences"
        assert any("Preview" in c.value for c in at.caption)


def test_no_bundled_checkpoint_says_so(monkeypatch, tmp_path):
    at = new_app(monkeypatch, None, DELTALAB_CACHE=str(tmp_path / "cache"),
                 DELTALAB_DEFAULT_CHECKPOINT=str(tmp_path / "not-there"))
    at.run()
    assert not at.exception
    assert any("bundled S4 checkpoint is not installed" in w.value for w in at.warning)
    assert any("deltalab app STORE" in i.value for i in at.info)


def test_default_store_build_runs_apart_and_the_page_follows_it(monkeypatch, tmp_path_factory, tmp_path):
    """With no store, the dashboard starts the build in its own process (not the session's thread: closing the
    tab stops nothing) and shows its progress file; the first page opens once the capture exists, the probes'
    progress staying in the sidebar; any other session reads the same file."""
    import time

    import deltalab.app.build_job as job
    import deltalab.app.default_store as dflt

    target = probed_store(tmp_path_factory)
    out = tmp_path / "default.zarr"
    started: list[Path] = []

    def report(**info) -> None:
        job._write(out, {"fraction": 0.0, "message": "", "captured": False, "done": False, "error": None,
                         "pid": os.getpid(), "started": time.time(), "threads": 1, **info})

    def fake_start(path, checkpoint=None, spec=None):
        started.append(Path(path))
        report(fraction=0.06, message="capturing (step 1/8): capture 3/64 seq")

    monkeypatch.setattr(dflt, "is_built", lambda *a, **k: False)
    monkeypatch.setattr(dflt, "has_bundled_checkpoint", lambda *a, **k: True)
    monkeypatch.setattr(dflt, "default_store_path", lambda: out)
    monkeypatch.setattr(job, "start", fake_start)
    at = new_app(monkeypatch, None)
    at.run()
    assert_clean(at)
    assert started == [out] and not at.title[0].value == "Overview"
    bars = at.get("progress")
    assert bars and "capture 3/64 seq" in bars[0].proto.text and abs(bars[0].proto.value - 6) <= 1
    second = new_app(monkeypatch, None)  # another tab: the same progress, no second build
    second.run()
    assert started == [out] and "capture 3/64 seq" in second.get("progress")[0].proto.text
    shutil.copytree(target, out, dirs_exist_ok=True)
    report(fraction=0.5, message="probe erank (step 5/8): erank 2/4 block", captured=True)
    at.run()
    assert_clean(at)
    assert at.title[0].value == "Overview"  # the page opens while the probes run
    assert any("Probes are still running" in c.value for c in at.sidebar.caption)
    assert "erank 2/4 block" in at.sidebar.get("progress")[0].proto.text


def test_build_progress_moves_inside_each_step(monkeypatch, tmp_path):
    """The build job's progress bars (capture's sequences, a probe's blocks) move the progress file inside a step,
    not only between steps; torch threads stay within the free cores."""
    import tqdm.auto

    import deltalab.app.build_job as job

    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.auto.tqdm)  # restored after the test
    monkeypatch.setattr(job, "WRITE_EVERY_S", 0.0)
    out = tmp_path / "s.zarr"
    rep = job._Reporter(out, 1)
    job._count_progress_bars(rep)
    seen: list[tuple[float, str]] = []
    rep.step(0.0, "capturing x (step 1/4)")
    for _ in tqdm.auto.tqdm(range(8), desc="capture", unit="seq", disable=True):  # the build's bars are off
        time.sleep(0.001)
        info = job.read_progress(out)
        seen.append((info["fraction"], info["message"]))
    rep.step(0.25, "probe betas (step 2/4)")
    bar = tqdm.auto.tqdm(total=4, desc="blocks", unit="block", disable=True)
    bar.update(2)
    info = job.read_progress(out)
    assert info["captured"] and info["fraction"] == pytest.approx(0.25 + 0.25 * 2 / 4)
    assert "probe betas (step 2/4): blocks 2/4 block" == info["message"]
    inside = sorted({f for f, _ in seen if 0.0 < f < 0.25})
    assert len(inside) >= 3, seen  # moved several times within the capture step
    assert any("capture" in m and "/8 seq" in m for _, m in seen)
    assert job.build_threads(cpus=2, load=11.0) == 1 and job.build_threads(cpus=2, load=0.0) == 1
    assert job.build_threads(cpus=16, load=0.5) == 4 and job.build_threads(cpus=8, load=6.5) == 1


# --- the default store, end to end ----------------------------------------------------------------

def test_default_store_is_built_once_and_opens(monkeypatch, tmp_path_factory):
    from deltalab.app.default_store import ensure_default_store, is_built

    built = default_store(tmp_path_factory)
    fractions = [f for f, _ in built["progress"]]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert any("probe intervene" in m for _, m in built["progress"])
    assert is_built(built["store"], built["checkpoint"], 8)
    import deltalab.probes.base
    import deltalab.store as store_mod

    def refuse(*args, **kwargs):
        raise AssertionError("an up-to-date default store must not be captured or probed again")

    with pytest.MonkeyPatch.context() as mp:  # cached: no capture, no probe
        mp.setattr(store_mod, "capture", refuse)
        mp.setattr(deltalab.probes.base, "run_module", refuse)
        assert ensure_default_store(checkpoint=built["checkpoint"], out=built["store"], samples=8) == built["store"]
    at = new_app(monkeypatch, None, DELTALAB_CACHE=str(built["cache"]),
                 DELTALAB_DEFAULT_CHECKPOINT=str(built["checkpoint"]), DELTALAB_DEFAULT_SAMPLES="8")
    at.run()
    assert_clean(at)
    assert any("Tiny S4 stand-in" in t.value for t in at.text)  # the checkpoint's README as model card (text)
    goto(at, "Probes")
    at.tabs  # noqa: B018 - all tabs are rendered in one run
    names = [s["layout"]["title"]["text"] for s in specs(at)]
    assert any("ablate head: Δ accuracy" in n for n in names) and any("set beta" in n for n in names)
    goto(at, "Betas")
    assert "(1, 2, 3, 4)" in " ".join(d.get("hovertext", [""])[0] for d in traces(at, "input tokens"))


# --- the command line ------------------------------------------------------------------------------

def test_cli_app_rejects_bad_store_and_binds_localhost(tmp_path):
    from typer.testing import CliRunner

    from deltalab.app.cli import app as cli
    from deltalab.app.cmd_app import streamlit_argv

    result = CliRunner().invoke(cli, ["app", str(tmp_path / "missing.zarr")])
    assert result.exit_code == 2 and "does not exist" in result.output
    argv = streamlit_argv(Path("s.zarr"), 8600, "127.0.0.1")
    assert argv[1:] == ["-m", "deltalab.app.serve", "127.0.0.1", "8600", "s.zarr"]
    assert streamlit_argv(None, 8600, "127.0.0.1")[-2:] == ["127.0.0.1", "8600"]


def test_server_imports_the_first_pages_modules_before_it_serves(monkeypatch):
    """deltalab.app.serve hands st.App a lifespan that imports what every first page needs, and the server options keep
    it headless on the given address; a bad command line is one usage line."""
    import sys

    import streamlit as st

    from deltalab.app import serve

    started: dict = {}

    class FakeApp:
        def __init__(self, script, lifespan):
            started.update(script=script, lifespan=lifespan)

        def run(self, config):
            started["config"] = config

    monkeypatch.setattr(st, "App", FakeApp)
    monkeypatch.delenv("DELTALAB_STORE", raising=False)
    serve.main(["127.0.0.1", "8601", "some.zarr"])
    assert os.path.basename(started["script"]) == "dashboard.py" and started["lifespan"] is serve.preload
    assert started["config"]["server.address"] == "127.0.0.1" and started["config"]["server.port"] == 8601
    assert started["config"]["server.headless"] is True and os.environ["DELTALAB_STORE"] == "some.zarr"
    code = ("import asyncio, sys\nfrom app import serve\nbefore = [m for m in serve.PRELOAD if m in sys.modules]\n"
            "async def enter():\n    async with serve.preload(None):\n"
            "        print(before, all(m in sys.modules for m in serve.PRELOAD))\nasyncio.run(enter())")
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split()[-1] == "True" and "xarray" not in done.stdout  # imported by the lifespan itself
    with pytest.raises(SystemExit, match="usage: python -m deltalab.app.serve HOST PORT"):
        serve.main(["127.0.0.1", "port"])


def test_sidebar_opens_another_store_and_back(monkeypatch, tmp_path, tmp_path_factory):
    at = new_app(monkeypatch, bare_store(tmp_path_factory))
    at.run()
    at.sidebar.text_input(key="store_input").input(str(tmp_path / "typo.zarr")).run()
    assert not at.exception and "No store at this path" in _page_text(at)
    at.sidebar.text_input(key="store_input").input("").run()
    assert_clean(at)
    assert at.title[0].value == "Overview"


def test_large_store_first_page_reads_no_captured_arrays(monkeypatch, tmp_path, tmp_path_factory):
    """The first page of a ~1 GB store (benchmarks.dashboard: one real batch, the others hard links) draws from
    metadata and the small per-sequence arrays alone, so its time does not grow with the store: every chunk file of
    the big captured arrays is overwritten with garbage, and the page still draws cleanly (a read would fail to
    decode). Its time is measured by `python -m benchmarks.dashboard`, not here."""
    import streamlit as st

    from benchmarks.dashboard import build

    facts = build(tmp_path / "big.zarr", 1.0, layers=2, heads=8, dk=32, length=512, batch=16)
    assert facts["bytes"] > 0.9e9
    corrupted = 0
    for var in ("q", "k", "v", "beta", "g", "state"):
        for f in (tmp_path / "big.zarr" / var / "c").rglob("*"):
            if f.is_file():  # garbage of the same size: the store's cheap size check at open still passes
                size = f.stat().st_size
                f.write_bytes((b"not a zarr chunk" * (size // 16 + 1))[:size])  # hard links: every batch's file
                corrupted += 1
    assert corrupted
    warm = new_app(monkeypatch, bare_store(tmp_path_factory))
    warm.run()
    st.cache_resource.clear()
    st.cache_data.clear()
    at = new_app(monkeypatch, tmp_path / "big.zarr")
    at.run()
    assert_clean(at)
    assert at.title[0].value == "Overview"
    # the corruption is real: a page that reads the keys fails on it
    import deltalab.store as store_mod

    with pytest.raises(Exception):  # noqa: B017 - zarr's codec error type is not part of its API
        store_mod.open(tmp_path / "big.zarr")["k"].isel(seq=0, layer=0).load()


@pytest.mark.parametrize("page,probe,var", [("Keys", "keys", "explained_variance_ratio"),
                                            ("Spectra", "spectra", "frac_complex"),
                                            ("Effective rank", "erank", "erank_mean")])
def test_previews_cover_the_selected_layer_only(monkeypatch, tmp_path, page, probe, var):
    """A preview runs its probe on the selected layer (a real-size store has dozens; a page shows one): the
    values equal the probe's on that layer, and switching layer previews the new one."""
    import importlib

    import deltalab.store as store_mod
    from deltalab.app.dash import loading, previews
    from deltalab.probes.synthetic import write_synthetic_store

    path = write_synthetic_store(tmp_path / "s.zarr", gated=True)  # two layers, no probe results
    ds = store_mod.open(path)
    layers = [int(x) for x in ds["layer"].values]
    assert len(layers) >= 2
    at = new_app(monkeypatch, path)
    at.run()
    goto(at, page)
    next(w for w in at.selectbox if w.label == "Layer").set_value(layers[1]).run()
    assert_clean(at)
    assert any("Preview" in c.value for c in at.caption)
    n = loading.preview_n(ds, probe)
    got = loading._preview(str(path), loading._stamp(path), probe, n, layers[1])
    assert got["layer"].values.tolist() == [layers[1]]
    want = previews.compute(importlib.import_module(f"deltalab.probes.{probe}"), ds.isel(seq=slice(0, n)))
    np.testing.assert_allclose(np.asarray(got[var].values)[0], np.asarray(want[var].sel(layer=layers[1]).values),
                               rtol=1e-6, atol=1e-9)


def test_gallery_of_a_large_model_previews_betas_only(monkeypatch, tmp_path):
    """Above PREVIEW_HEADS (layer, head) pairs the gallery previews only betas and says which probes to run."""
    from deltalab.app.dash import headdata
    from deltalab.probes.synthetic import write_synthetic_store

    path = write_synthetic_store(tmp_path / "s.zarr", gated=True)  # 2 layers x 4 heads, no probe results
    monkeypatch.setattr(headdata, "PREVIEW_HEADS", 4)
    at = new_app(monkeypatch, path)
    at.run()
    goto(at, "Heads")
    infos = " ".join(i.value for i in at.info)
    assert "no preview of keys, spectra, erank for every head" in infos
    assert f"deltalab probe erank --store {path}" in infos
    assert any("Preview from the first sequences for: betas" in c.value for c in at.caption)


def test_compare_of_a_large_model_previews_only_its_two_layers(monkeypatch, tmp_path):
    """Compare on a real-size store builds its two rows from the previews of the two layers it shows; they equal
    the gallery's rows (the whole head table), and no other layer is previewed."""
    import pandas as pd

    from deltalab import store
    from deltalab.app.dash import headdata, loading
    from deltalab.probes.synthetic import write_synthetic_store

    path = write_synthetic_store(tmp_path / "s.zarr", gated=True, n_layers=3)
    monkeypatch.setattr(headdata, "PREVIEW_HEADS", 4)
    ds = store.open(path)
    seen: list = []
    real = loading.preview

    def spy(path, ds, probe, layer=None, n_seq=None):
        seen.append(layer)
        return real(path, ds, probe, layer=layer, n_seq=n_seq)

    monkeypatch.setattr(loading, "preview", spy)
    layers = [int(x) for x in ds["layer"].values]
    part, _, _ = headdata.table(path, ds, None, layers=[layers[2], layers[0]])
    assert set(seen) == {layers[0], layers[2]}  # (table and its cached builder both ask; the second is a hit)
    whole, _, _ = headdata.table(path, ds, None)
    assert sorted(set(part["layer"])) == [layers[0], layers[2]]
    cols = ["layer", "head", "beta_mean", "frac_beta_gt1"]
    mine = part[cols].sort_values(["layer", "head"]).reset_index(drop=True)
    ref = whole[whole["layer"].isin([layers[0], layers[2]])][cols].sort_values(["layer", "head"])
    pd.testing.assert_frame_equal(mine, ref.reset_index(drop=True), check_exact=False, rtol=1e-6)
    at = new_app(monkeypatch, path)
    at.run()
    goto(at, "Compare")
    assert not at.exception and any("Preview from the first sequences" in c.value for c in at.caption)


def test_previews_of_a_large_model_wait_for_their_toggle(monkeypatch, tmp_path):
    """Above AUTO_PREVIEW_HEADS (layer, head) pairs a page opens at once with its preview off; the toggle
    computes it on demand."""
    from deltalab.app.dash import loading
    from deltalab.probes.synthetic import write_synthetic_store

    path = write_synthetic_store(tmp_path / "s.zarr", gated=True)
    monkeypatch.setattr(loading, "AUTO_PREVIEW_HEADS", 4)
    at = new_app(monkeypatch, path)
    at.run()
    goto(at, "Keys")
    toggle = at.toggle(key="preview_keys")
    assert toggle.value is False and not at.get("plotly_chart")
    assert f"deltalab probe keys --store {path}" in " ".join(i.value for i in at.info)
    toggle.set_value(True).run()
    assert_clean(at)
    assert at.get("plotly_chart") and any("Preview" in c.value for c in at.caption)
