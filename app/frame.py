"""The dashboard's frame: which store to open (argument, sidebar, default), the page menu, the selection,
and the dispatch to one page module. Bad input becomes a message in the page, never a traceback.

It sits above both halves of the dashboard: it imports the pages (app/views/) and the building blocks they share
(app/dash/), and app/dash imports neither it nor the pages.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import streamlit as st

from deltalab.app.dash import loading, roots, state
from deltalab.app.dash.safe import code_text

ENV_STORE = roots.ENV_STORE
STORE_PARAM = "store"
"""URL query parameter naming the store a view shows (set when another store is opened in the sidebar)."""


def _pages() -> dict[str, object]:
    from deltalab.app.views import (
        attention,
        betas,
        compare,
        erank,
        head,
        heads,
        keys,
        lens,
        overview,
        patching,
        probes,
        spectra,
        text,
        token,
    )
    from deltalab.app.views import input as input_view

    return {"Overview": overview, "Input": input_view, "Betas": betas, "Keys": keys, "Spectra": spectra,
            "Effective rank": erank, "Probes": probes, "Token": token, "Text": text, "Attention": attention,
            "Heads": heads, "Head": head, "Lens": lens, "Patching": patching, "Compare": compare}


def cli_store() -> str | None:
    """STORE from `streamlit run app/dashboard.py -- STORE` or $DELTALAB_STORE (app.dash.roots.started_store)."""
    return roots.started_store()


def _open_other() -> None:
    value = (st.session_state.get("store_input") or "").strip()
    st.session_state["store_path"] = value or None
    if value:
        st.query_params[STORE_PARAM] = value
    else:
        st.query_params.pop(STORE_PARAM, None)


def _reload() -> None:
    st.cache_resource.clear()
    st.cache_data.clear()


def _default_store() -> Path | None:
    """The bundled default store, built on first use with a progress indicator; None (with a message) if
    the bundled checkpoint is not there."""
    from deltalab.app import default_store as dflt

    if dflt.is_built():
        return dflt.default_store_path()
    if not dflt.has_bundled_checkpoint():
        st.warning(f"**The bundled S4 checkpoint is not installed yet** (`{dflt.bundled_checkpoint()}` holds no "
                   "config.json + model.safetensors), so there is no default store to open.")
        st.info("**What to do:** open a store you captured: `deltalab app STORE` or type its path in the sidebar. "
                "To make one: `deltalab capture CHECKPOINT --data S4:length=256,samples=128 --out runs/s4.zarr`, "
                "then `deltalab probe betas --store runs/s4.zarr` (and keys, spectra, erank, linear, lengthgen).")
        return None
    from deltalab.app import build_job
    from deltalab.app.dash import building

    out = dflt.default_store_path()
    info = build_job.read_progress(out)
    if info is None or (info.get("done") and not dflt.is_built()):
        build_job.start(out)  # in its own process: closing the tab does not stop it
    return out if building.show(out, "the default store") else None


@st.cache_resource(show_spinner=False, max_entries=8)
def _token_names(meta: str, vocab: int | None) -> list[str] | None:
    from deltalab.app.dash.derive import token_names

    return token_names(json.loads(meta), vocab)


def _text_names(attrs: dict) -> list[str] | None:
    """For text stores: each token id's text (repr), through the checkpoint's tokenizer.json when it is found."""
    from deltalab.app.dash.textgrid import is_text_store

    if not is_text_store(attrs):
        return None
    from deltalab.app.dash.derive import find_checkpoint
    from deltalab.app.views.text import vocab_names

    return vocab_names(find_checkpoint(attrs), int((attrs.get("model_config") or {}).get("vocab_size") or 256))


def run() -> None:
    """One script run of the dashboard."""
    state.apply_deferred()
    pages = _pages()
    side = st.sidebar
    side.markdown("## Δ deltalab")
    if st.session_state.get(state.PAGE_KEY) not in pages:
        st.session_state[state.PAGE_KEY] = "Overview"
    side.radio("Page", list(pages), key=state.PAGE_KEY, bind="query-params", label_visibility="collapsed")

    if not st.session_state.get("store_path") and st.query_params.get(STORE_PARAM):
        _store_from_url(st.query_params[STORE_PARAM])  # a shared URL reopens its store, if the server allows it
    chosen = st.session_state.get("store_path") or cli_store()
    side.text_input("Open another store", key="store_input", on_change=_open_other,
                    placeholder="path/to/store.zarr", help="A folder written by `deltalab capture --out`.")
    side.button("Reload", on_click=_reload, help="Re-read the store and its probe results (after a probe ran).")
    if chosen:
        path = Path(chosen).expanduser()
        from deltalab.app.dash import building

        if not building.show(path, f"`{path.name}`"):  # `deltalab app CHECKPOINT`: its store is being built
            return
    else:
        default = _default_store()
        if default is None:
            return
        path = default
    side.caption(f"Store: {code_text(path)}")
    if st.session_state.pop("store_refused", False):
        st.warning(roots.REFUSED_STORE)
    ds, problem = loading.open_store(path)
    if problem is not None:
        st.title("deltalab")
        loading.show_problem(problem, path)
        return

    st.session_state[state.STORE_KEY] = str(path)
    path, ds = _input_source(path, ds)
    attrs = ds.attrs
    meta = json.dumps({k: attrs.get(k) for k in ("data_meta", "data_spec")}, sort_keys=True, default=str)
    # token names import tasks.state_tracking (and torch): not on the first page, unless already loaded
    needs_names = st.session_state[state.PAGE_KEY] != "Overview" or "deltalab.tasks.state_tracking" in sys.modules
    names = _token_names(meta, (attrs.get("model_config") or {}).get("vocab_size")) if needs_names else None
    if names is None:
        names = _text_names(dict(attrs))
    sel = state.sidebar_selection(ds, path, names)

    from deltalab.app.dash.context import Context

    ctx = Context(path, ds, sel, names)
    page = pages[st.session_state[state.PAGE_KEY]]
    _render(page, ctx)
    _prewarm()


def _store_from_url(value: str) -> None:
    """Open the URL's `?store=` when it is one the server was started with or under its roots
    (app.dash.roots); otherwise drop it and say so, in words that do not tell whether the path exists."""
    if roots.store_permitted(value, cli_store()):
        st.session_state["store_path"] = value
        return
    st.query_params.pop(STORE_PARAM, None)
    st.session_state["store_refused"] = True


def _input_source(path: Path, ds: object) -> tuple[Path, object]:
    """The store, or the researcher's own input run through its checkpoint when the sidebar says so."""
    key = st.session_state.get(state.INPUT_KEY)
    if not key or not str(key).startswith(f"{path}#") or not loading.in_memory(key):
        return path, ds
    if st.session_state.get(state.SOURCE_KEY) not in state.SOURCES:
        st.session_state[state.SOURCE_KEY] = state.SOURCES[0]
    st.sidebar.segmented_control("Show", list(state.SOURCES), key=state.SOURCE_KEY, required=True,
                                 help="Every page shows the store, or your own input (page Input).")
    if st.session_state.get(state.SOURCE_KEY) != state.SOURCES[1]:
        return path, ds
    mem = loading._open(str(key), loading._stamp(key))
    st.sidebar.caption(f"Showing **your input** ({mem.sizes['pos']} tokens), run through the store's checkpoint.")
    return Path(str(key)), mem


_PREWARMED: list[bool] = []
PREWARM_DELAY_S = 1.0


def _prewarm() -> None:
    """After the first page is drawn, import the heavy modules other pages need (torch via tasks.state_tracking for
    token names, scikit-learn) in a background thread, so the first visit to those pages is quick."""
    if _PREWARMED:
        return
    _PREWARMED.append(True)
    import importlib
    import threading

    def work() -> None:
        for name in ("deltalab.tasks.state_tracking", "deltalab.kernels.spectra.householder", "sklearn.decomposition"):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a missing optional module only costs time later
                pass

    # a moment later: importing torch holds the GIL for a second, which would slow the first page's delivery
    timer = threading.Timer(PREWARM_DELAY_S, work)
    timer.name, timer.daemon = "deltalab-prewarm", True
    timer.start()


def _render(page: object, ctx: object) -> None:
    """Run one page; errors a user can fix (bad store content, missing variables) become one message."""
    from deltalab.probes.base import ProbeError
    from deltalab.store import StoreError
    from deltalab.store.errors import corrupt_chunk_line

    try:
        page.render(ctx)  # type: ignore[attr-defined]
    except (StoreError, ProbeError) as err:
        st.error(str(err).splitlines()[0] if str(err) else type(err).__name__)
    except (OSError, KeyError, ValueError, RuntimeError) as err:  # RuntimeError: only a codec's, on a corrupt chunk
        corrupt = corrupt_chunk_line(err, getattr(ctx, "path", ""))
        if isinstance(err, RuntimeError) and corrupt is None:
            raise
        if corrupt is not None:  # say so and how to fix it, not zarr's two checksums
            st.error(corrupt)
            return
        first = str(err).splitlines()[0] if str(err) else ""
        st.error(f"This page cannot be drawn for this store ({type(err).__name__}: {first}). "
                 "If the store is being written, wait and press Reload; otherwise recapture it.")
