"""Streamlit entry point: `streamlit run app/dashboard.py -- [STORE]` (what `deltalab app` launches).

Pages live in app/views/, the frame (store choice, menu, linked selection) in app/dash/main.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = str(_HERE.parent)
# `streamlit run` puts app/ on sys.path, where app/dash would shadow top-level names: use the repository root
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

st.set_page_config(page_title="deltalab", page_icon="Δ", layout="wide", initial_sidebar_state="expanded")

from app.dash.main import run  # noqa: E402

run()
