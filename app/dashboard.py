"""Streamlit entry point: `streamlit run app/dashboard.py -- [STORE]` (what `deltalab app` launches).

Pages live in app/views/, the frame (store choice, menu, linked selection) in app/frame.py,
the pieces the pages share in app/dash/.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# the script runner puts this folder on sys.path, where its modules (cli, errors, serve, ...) would shadow
# third-party names: deltalab's own modules are imported as `deltalab.app....`
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != _HERE]

import streamlit as st  # noqa: E402

st.set_page_config(page_title="deltalab", page_icon="Δ", layout="wide", initial_sidebar_state="expanded")

from deltalab.app.frame import run  # noqa: E402

run()
