"""Time to first page of the dashboard on a multi-GB store: `python -m benchmarks.dashboard [--gb 4] [--out DIR]`.

Builds the store cheaply: one batch of sequences is captured-shaped random data written through
store.writer, and the chunk/shard files of every other batch are hard links to it. To every reader
the store is what a real capture of that size is (same metadata, same number and size of files, all
sequences complete); only the disk usage and the page cache see one batch. The dashboard is then run
with streamlit's AppTest: a warm-up on a tiny store loads the Python modules (as a running server has
them), then the first page (Overview) and the drill-down Token page are timed on the big store.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deltalab.kernels.constants import CHUNK_SIZE

DASHBOARD = Path(__file__).resolve().parents[1] / "app" / "dashboard.py"


def build(out: Path, gb: float, *, layers: int = 4, heads: int = 8, dk: int = 32, n_h: int = 2, length: int = 512,
          batch: int = 16, seed: int = 0) -> dict[str, float]:
    """Write a store of about `gb` GB (logical = on-disk file sizes) at `out`; returns its facts."""
    from datetime import datetime, timezone

    from deltalab.store import schema
    from deltalab.store.writer import StoreWriter

    rng = np.random.default_rng(seed)
    nc = schema.n_chunks(length)
    per_seq = (4 * layers * length * heads * (dk + 2 * n_h * dk + n_h + 1)  # q, k, v, beta, g
               + 4 * layers * nc * heads * dk * dk + 4 * 5 * length)  # state, per-token flags
    n_batches = max(2, int(round(gb * 1e9 / (per_seq * batch))))
    n_seq = n_batches * batch
    hooks = list(schema.DEFAULT_HOOKS)
    variables = schema.variables_for(hooks, gated=True)
    sizes = {"pos": length, "layer": layers, "head": heads, "step": n_h, "dk": dk, "dv": dk, "chunk": nc,
             "hidden": heads * dk}
    config = {"model_type": "gated_deltaproduct", "vocab_size": 24, "hidden_size": heads * dk,
              "num_hidden_layers": layers, "num_heads": heads, "head_dim": dk, "expand_v": 1.0, "num_householder": n_h,
              "use_forget_gate": True, "use_output_gate": False, "use_short_conv": False, "allow_neg_eigval": True}
    attrs = {"deltalab_format": schema.FORMAT_VERSION, "model_config": config, "checkpoint_digest": "sha256:bench",
             "deltalab_version": "bench", "command_line": ["python", "-m", "benchmarks.dashboard"],
             "chunk_size": CHUNK_SIZE, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "hooks": hooks, "variables": variables, "layers": list(range(layers)), "dtype": "float32",
             "batch_size": batch, "sizes": sizes, "train_length": length // 2}
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    writer, segment = StoreWriter.create_or_append(out, attrs, f"bench:seqs={n_seq},length={length}", n_seq)

    def unit(shape: tuple[int, ...]) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    b, L, T, H = batch, layers, length, heads
    arrays = {
        "tokens": rng.integers(0, 24, (b, T)).astype(np.int32), "labels": rng.integers(0, 24, (b, T)).astype(np.int32),
        "doc_start": np.zeros((b, T), bool), "pad": np.zeros((b, T), bool),
        "loss": rng.random((b, T), dtype=np.float32),
        "correct": rng.random((b, T)) < 0.9, "q": unit((b, L, T, H, dk)), "k": unit((b, L, T, n_h, H, dk)),
        "v": rng.standard_normal((b, L, T, n_h, H, dk), dtype=np.float32),
        "beta": 2 * rng.random((b, L, T, n_h, H), dtype=np.float32),
        "g": -rng.random((b, L, T, H), dtype=np.float32) * 0.1,
        "state": rng.standard_normal((b, L, nc, H, dk, dk), dtype=np.float32),
    }
    arrays["doc_start"][:, 0] = True
    writer.write_batch(0, arrays)
    for var in variables:
        if var == "complete":
            continue
        src = out / var / "c" / "0"
        files = [f for f in src.rglob("*") if f.is_file()] if src.is_dir() else [out / var / "c" / "0"]
        for i in range(1, n_batches):
            for f in files:
                rel = f.relative_to(out / var / "c" / "0") if src.is_dir() else None
                dst = out / var / "c" / str(i) / rel if rel is not None else out / var / "c" / str(i)
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(f, dst)
    writer.array("complete")[:] = True
    logical = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"sequences": n_seq, "bytes": logical, "files": sum(1 for f in out.rglob("*") if f.is_file()),
            "build_s": time.perf_counter() - t0}


RESULT_PROBES = ("betas", "keys", "spectra", "erank")


def add_results(store: Path, n_seqs: int) -> dict[str, float]:
    """Run the real probes (betas, keys, spectra, erank every 64 tokens) on the first `n_seqs` sequences of the
    big store and write their results groups into it, so pages read stored results instead of previews;
    returns each probe's seconds. The store's batches are hard links, so any subset is representative."""
    import subprocess

    seconds: dict[str, float] = {}
    for name in RESULT_PROBES:
        extra = ["--every", str(CHUNK_SIZE)] if name == "erank" else []
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", f"deltalab.probes.{name}", "--store", str(store),
                        "--max-seqs", str(n_seqs),
                        *extra], check=True, stdout=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
        seconds[name] = time.perf_counter() - t
    return seconds


def _tiny(out: Path) -> None:
    from deltalab.probes.synthetic import write_synthetic_store

    write_synthetic_store(out, n_seq=4, length=64, n_layers=1, n_heads=4, dk=4, dv=4)


def time_pages(store: Path, warm: Path, pages: list[str]) -> dict[str, float]:
    """Seconds of each AppTest script run on `store` (first run = Overview), after a warm-up on `warm`: the
    first visit of each page (on a store without probe results it computes that page's preview), then one
    interaction on it (the next head selected: `PAGE / next head`)."""
    import asyncio

    from streamlit.testing.v1 import AppTest

    from deltalab.app import serve

    async def lifespan() -> None:  # what `deltalab app` does before it serves (app.serve)
        async with serve.preload(None):
            pass

    asyncio.run(lifespan())
    os.environ["DELTALAB_STORE"] = str(warm)
    at = AppTest.from_file(str(DASHBOARD), default_timeout=300)
    at.run()
    out: dict[str, float] = {}
    os.environ["DELTALAB_STORE"] = str(store)
    import deltalab.store as store_mod

    n_heads = int(store_mod.open(store).sizes["head"])
    at = AppTest.from_file(str(DASHBOARD), default_timeout=300)
    t = time.perf_counter()
    at.run()
    out["Overview (first page)"] = time.perf_counter() - t
    _check(at, "Overview")
    for page in pages:
        t = time.perf_counter()
        at.sidebar.radio(key="page").set_value(page).run()
        out[page] = time.perf_counter() - t
        _check(at, page)
        toggle = next((w for w in at.toggle if w.key and w.key.startswith("preview_")), None)
        if toggle is not None and not toggle.value:  # a real-size store: the preview is computed on demand
            t = time.perf_counter()
            toggle.set_value(True).run()
            out[f"{page} / preview on demand"] = time.perf_counter() - t
            _check(at, page)
        head = next((w for w in at.sidebar.number_input if w.label == "Head"), None)
        if head is not None and page not in ("Overview",):
            t = time.perf_counter()
            head.set_value((int(head.value) + 1) % n_heads).run()
            out[f"{page} / next head"] = time.perf_counter() - t
            _check(at, page)
    return out


def bare_first_page(store: Path, warm: Path) -> float:
    """Seconds of the dashboard's own code for the first page (Streamlit bare mode: no server, no AppTest
    polling), after a warm-up on `warm`: what the store costs, apart from the harness."""
    import logging

    import streamlit as st

    logging.getLogger("streamlit").setLevel(logging.ERROR)
    import contextlib
    import io

    from deltalab.app import frame

    os.environ["DELTALAB_STORE"] = str(warm)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        frame.run()  # bare mode prints a "run it with streamlit run" hint once
    st.cache_resource.clear()
    st.cache_data.clear()
    os.environ["DELTALAB_STORE"] = str(store)
    t = time.perf_counter()
    frame.run()
    return time.perf_counter() - t


def cold_first_page(store: Path) -> float:
    """Seconds of the first AppTest run in a fresh Python process (imports included), as a cold server."""
    import subprocess

    code = ("import os, time; t = time.perf_counter(); from streamlit.testing.v1 import AppTest; "
            f"os.environ['DELTALAB_STORE'] = {str(store)!r}; "
            f"at = AppTest.from_file({str(DASHBOARD)!r}, default_timeout=300); at.run(); "
            "assert not at.exception and not at.error; print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


PEER_APP = """import plotly.graph_objects as go
import streamlit as st

st.title("Overview")
st.plotly_chart(go.Figure(go.Scatter(x=[0, 1], y=[0, 1])))
"""
"""The peer of the browser timing: a bare Streamlit page with a heading and one plotly chart, served the same way.
Its time is the floor any Streamlit + plotly page pays in this browser on this machine (loading Streamlit's
frontend and compiling plotly.js in a new tab)."""


def _serve_and_visit(argv: list[str], port: int, visits: int) -> tuple[float, list[float]]:
    """Start a server with `argv`, wait until it answers, open a fresh tab `visits` times: (seconds until it
    answered, seconds from opening the URL to the 'Overview' heading and the first plotly chart drawn, per visit)."""
    import subprocess
    import urllib.request

    from playwright.sync_api import sync_playwright

    t0 = time.perf_counter()
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"the server {argv[2:4]} exited before it answered") from None
                time.sleep(0.05)
        up = time.perf_counter() - t0
        times = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
            for _ in range(visits):
                page = browser.new_page()
                t = time.perf_counter()
                page.goto(f"http://127.0.0.1:{port}/")
                page.get_by_role("heading", name="Overview").wait_for(timeout=120_000)
                page.locator(".js-plotly-plot .main-svg").first.wait_for(state="attached", timeout=120_000)
                times.append(time.perf_counter() - t)
                page.close()
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return up, times


def browser_first_page(store: Path, port: int = 8599) -> dict[str, float]:
    """In a real server started as `deltalab app STORE` and a headless Chromium: seconds from the command to the
    server answering, from opening the URL to the Overview drawn with its charts (first and second visitor), and the
    same for the bare Streamlit + plotly peer page in the same run; `ratio` = ours / peer (second visits)."""
    import tempfile

    from deltalab.app.cmd_app import streamlit_argv

    up, (first, second) = _serve_and_visit(streamlit_argv(store, port, "127.0.0.1"), port, 2)
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "peer.py"
        peer.write_text(PEER_APP)
        argv = [sys.executable, "-m", "streamlit", "run", str(peer), "--server.port", str(port + 1),
                "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"]
        peer_up, (peer_first, peer_second) = _serve_and_visit(argv, port + 1, 2)
    return {"server_up_s": up, "first_visit_s": first, "second_visit_s": second, "peer_up_s": peer_up,
            "peer_first_visit_s": peer_first, "peer_second_visit_s": peer_second, "ratio": second / peer_second}


def _check(at, page: str) -> None:
    if at.exception or at.error:
        msgs = [e.message for e in at.exception] + [e.value for e in at.error]
        raise RuntimeError(f"{page}: {msgs[0][:300]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dashboard", description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=4.0, help="logical store size in GB (default 4)")
    p.add_argument("--out", type=Path, default=None, help="store folder (default: a temporary one, removed)")
    p.add_argument("--pages", default="Token", help="pages timed after the first (comma-separated)")
    p.add_argument("--layers", type=int, default=4, help="layers of the store's model (default 4)")
    p.add_argument("--heads", type=int, default=8, help="heads per layer (default 8)")
    p.add_argument("--dk", type=int, default=32, help="head dimension, dk = dv (default 32)")
    p.add_argument("--with-results", type=int, default=0, metavar="N",
                   help="first run the betas, keys, spectra and erank probes on the first N sequences, so pages "
                        "read stored results (default 0: no results, pages offer previews)")
    p.add_argument("--browser", action="store_true",
                   help="also time the first page in a real server (`deltalab app`) and headless Chromium")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.with_results < 0:
        p.error(f"--with-results {args.with_results}: pass a number of sequences >= 0")
    sys.argv = sys.argv[:1]  # the dashboard script reads a store path from argv: give it none (DELTALAB_STORE wins)
    tmp = Path(tempfile.mkdtemp(prefix="deltalab-bench-"))
    out = args.out or tmp / "big.zarr"
    try:
        os.environ.setdefault("TQDM_DISABLE", "1")
        facts = build(out, args.gb, layers=args.layers, heads=args.heads, dk=args.dk)
        if args.with_results:
            facts["probes_s"] = add_results(out, args.with_results)
        _tiny(tmp / "warm.zarr")
        facts["cold_first_page_s"] = cold_first_page(out)
        from deltalab import store

        store.open(tmp / "warm.zarr")  # imports (xarray, zarr, dask) out of the timing
        t = time.perf_counter()
        store.open(out)
        facts["store_open_s"] = time.perf_counter() - t
        facts["bare_first_page_s"] = bare_first_page(out, tmp / "warm.zarr")
        if args.browser:
            facts["browser"] = browser_first_page(out)
        facts["pages_s"] = time_pages(out, tmp / "warm.zarr", [x for x in args.pages.split(",") if x])
    finally:
        if args.out is None:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(facts, indent=1))
    else:
        print(f"store: {args.layers} layers x {args.heads} heads x dk {args.dk}, "
              f"{facts['sequences']} sequences, {facts['bytes'] / 1e9:.2f} GB in {facts['files']} files "
              f"(built in {facts['build_s']:.1f} s); store.open {facts['store_open_s']:.2f} s")
        if args.with_results:
            took = ", ".join(f"{k} {v:.0f} s" for k, v in facts["probes_s"].items())
            print(f"  probe results stored for the first {args.with_results} sequences ({took})")
        print(f"  first page in a fresh process (imports included): {facts['cold_first_page_s']:.2f} s")
        print("  dashboard code alone for the first page (bare mode, modules loaded): "
              f"{facts['bare_first_page_s']:.2f} s")
        if args.browser:
            b = facts["browser"]
            print(f"  real server + Chromium: `deltalab app` answers after {b['server_up_s']:.2f} s; the Overview with "
                  f"its charts is drawn {b['first_visit_s']:.2f} s after opening the URL, {b['second_visit_s']:.2f} s "
                  f"for a second visitor; a bare Streamlit page with one plotly chart (the floor, same run): "
                  f"{b['peer_first_visit_s']:.2f} / {b['peer_second_visit_s']:.2f} s; ours / peer = {b['ratio']:.2f}")
        print("  AppTest script runs in a running server (modules loaded, store not yet opened), vs target:")
        for page, s in facts["pages_s"].items():
            target = 2.0 if page.startswith("Overview") and "/" not in page else \
                float("inf") if page.endswith("on demand") else 0.3
            verdict = "computation asked for (no target)" if target == float("inf") else \
                f"target {target:.1f} s   {'met' if s <= target else 'MISSED'}"
            print(f"  {page:<36} {s:6.2f} s   {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
