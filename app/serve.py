"""Serve the dashboard with its modules imported before the first browser connects: `python -m deltalab.app.serve HOST
PORT [STORE]` (what `deltalab app` runs).

Under `streamlit run`, the first page of a new server paid for importing xarray, zarr, dask, plotly and the page
modules (1.5-2 s on a laptop CPU) inside the visitor's first script run. Here streamlit's `st.App` runs the same
script, and its lifespan hook imports those modules while the server starts, so the first page costs what any later
one does.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "dashboard.py"
PRELOAD = ("xarray", "zarr", "dask.array", "plotly.graph_objects", "deltalab.store", "deltalab.app.frame",
           "deltalab.app.dash.figures", "deltalab.app.dash.export", "deltalab.app.views.overview")
"""Modules every first page imports (Overview and the frame); the heavier ones other pages need (torch,
scikit-learn) are still imported in the background after the first page (app.frame._prewarm)."""
SERVER_OPTIONS = {"server.headless": True, "browser.gatherUsageStats": False, "server.fileWatcherType": "none",
                  "theme.base": "light", "client.toolbarMode": "minimal"}


@contextlib.asynccontextmanager
async def preload(app: object) -> AsyncIterator[None]:
    """st.App lifespan: import PRELOAD and warm plotly up before the server accepts connections."""
    for name in PRELOAD:
        importlib.import_module(name)
    importlib.import_module("deltalab.app.dash.figures").warm_up()  # plotly's validators, built once per process
    yield


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or not args[1].isdigit():
        sys.exit("usage: python -m deltalab.app.serve HOST PORT [STORE]")
    host, port = args[0], int(args[1])
    if len(args) == 3:
        os.environ["DELTALAB_STORE"] = args[2]  # the dashboard's store (app.frame.cli_store)
    import streamlit as st

    app = st.App(str(DASHBOARD), lifespan=preload)
    app.run(config={"server.address": host, "server.port": port, **SERVER_OPTIONS})


if __name__ == "__main__":
    main()
