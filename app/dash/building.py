"""The first-use build as the dashboard shows it: the job runs in its own process (app.build_job), every tab reads
its progress file, so closing a tab stops nothing and a second tab shows the same bar. The page opens as soon as
the capture exists; the probes fill in while the sidebar shows their progress."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import streamlit as st

from deltalab.app import build_job

POLL_S = 1.5


def _elapsed(info: dict[str, Any]) -> str:
    return f"{time.time() - float(info.get('started') or time.time()):.0f} s"


def _bar(info: dict[str, Any]) -> None:
    fraction = min(1.0, max(0.0, float(info.get("fraction") or 0.0)))
    st.progress(fraction, text=f"{info.get('message') or ''} ({_elapsed(info)}, "
                               f"{info.get('threads', '?')} torch thread(s))")


def show(out: Path, what: str) -> bool:
    """Draw the build of `out` (`what` names it for the reader); True when the store can be opened now (the
    capture is complete), False while the page has to wait (drawn again every POLL_S seconds)."""
    info = build_job.read_progress(out)
    if info is None:
        return True
    if info.get("error"):
        st.error(f"Building {what} failed: {info['error']}")
        st.button("Start the build again", on_click=build_job.restart, args=(out,), key="build_restart")
        return bool(info.get("captured"))
    if info.get("done"):
        return True
    captured = bool(info.get("captured"))

    @st.fragment(run_every=POLL_S)
    def poll() -> None:
        now = build_job.read_progress(out) or {}
        if now.get("done") or now.get("error") or bool(now.get("captured")) != captured:
            st.cache_data.clear()  # probe results written meanwhile
            st.cache_resource.clear()
            st.rerun(scope="app")
        _bar(now)

    if captured:
        with st.sidebar:
            st.caption(f"Probes are still running on {what}; their pages fill in as they finish.")
            poll()
        return True
    st.title("deltalab")
    with st.container(border=True):
        st.markdown(f"**Building {what} (first use only)**")
        st.caption(f"Capturing and probing into `{out}` in a process of its own: closing this tab does not stop it, "
                   "another tab shows the same progress. The first page opens as soon as the capture exists.")
        poll()
    return False
