"""Every chart of the dashboard with its downloads: PNG and SVG (rendered by kaleido in a headless Chromium kept
running after the first export), interactive HTML (plotly.js embedded, works offline) and the chart's data as
CSV or Parquet. Files are made only when their button is clicked (Streamlit's deferred downloads).

`chart(fig, key, data=...)` replaces `st.plotly_chart(fig, key=...)`; without `data` the table is read from the
figure's traces (`figure_table`).
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

FORMATS = ("png", "svg", "html", "csv", "parquet")
_KALEIDO = threading.Lock()
_SERVER: list[bool] = []


class ExportError(RuntimeError):
    """An image cannot be rendered (kaleido or Chromium missing): one line with the fix."""


def table(**columns: Any) -> pd.DataFrame:
    """A data table from equal-length columns (numpy arrays or lists)."""
    return pd.DataFrame({k: np.asarray(v).tolist() if np.asarray(v).dtype == object else np.asarray(v)
                         for k, v in columns.items()})


def figure_table(fig: go.Figure) -> pd.DataFrame:
    """The data drawn by a figure, one row per point (heatmaps: one row per cell), with the trace name."""
    frames = []
    for i, trace in enumerate(fig.data):
        name = trace.name if getattr(trace, "name", None) else f"trace {i}"
        if trace.type in ("scatter", "scattergl") and name == "cells" and trace.marker.opacity == 0:
            continue  # the invisible points that carry a heatmap's clicks (figures.clickable_cells)
        z = getattr(trace, "z", None)
        if trace.type == "heatmap" and z is not None:
            zz = np.asarray(z, dtype=np.float64)
            rows, cols = zz.shape
            x = list(trace.x) if trace.x is not None else list(range(cols))
            y = list(trace.y) if trace.y is not None else list(range(rows))
            frames.append(pd.DataFrame({"trace": name, "y": np.repeat(np.asarray(y, dtype=object), cols),
                                        "x": np.tile(np.asarray(x, dtype=object), rows), "z": zz.ravel()}))
            continue
        cols: dict[str, Any] = {}
        for axis in ("x", "y", "z"):
            v = getattr(trace, axis, None)
            if v is not None:
                cols[axis] = np.asarray(v).ravel()
        if not cols:
            continue
        n = max(len(v) for v in cols.values())
        if any(len(v) != n for v in cols.values()):  # e.g. a histogram's pre-binned x with a scalar y
            continue
        cd = getattr(trace, "customdata", None)
        if cd is not None:
            cd = np.asarray(cd)
            if cd.ndim == 2 and cd.shape[0] == n:
                for j in range(cd.shape[1]):
                    cols[f"customdata_{j}"] = cd[:, j]
            elif cd.ndim == 1 and cd.shape[0] == n:
                cols["customdata"] = cd
        text = getattr(trace, "hovertext", None)
        if text is not None and not isinstance(text, str) and len(text) == n:
            cols["hovertext"] = [re.sub(r"<br>", "; ", str(t)) for t in text]
        frames.append(pd.DataFrame({"trace": [name] * n, **cols}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"trace": []})


def to_image(fig: go.Figure, fmt: str, scale: float = 2.0) -> bytes:
    """PNG or SVG bytes of `fig` through kaleido (one headless Chromium, started on first use and kept)."""
    try:
        import kaleido
    except ImportError:
        raise ExportError("PNG/SVG export needs kaleido: pip install 'kaleido>=1' (and Debian's chromium)") from None
    with _KALEIDO:
        if not _SERVER:
            try:
                kaleido.start_sync_server(silence_warnings=True)
            except Exception:  # noqa: BLE001 - already running in this process
                pass
            _SERVER.append(True)
        import warnings

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fig.to_image(format=fmt, scale=scale if fmt == "png" else 1.0,
                                    width=fig.layout.width or 1100, height=fig.layout.height or 450)
        except Exception as err:  # noqa: BLE001 - no Chromium, a crashed browser: one line
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ExportError(f"the image could not be rendered ({first}); install Chromium "
                              "(apt-get install chromium) or set BROWSER_PATH") from None


def to_html(fig: go.Figure) -> str:
    """A standalone interactive HTML page of `fig` (plotly.js embedded, so it opens offline)."""
    return fig.to_html(include_plotlyjs=True, full_html=True, config={"displaylogo": False})


def to_parquet(df: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    df.astype({c: str for c in df.columns if df[c].dtype == object}).to_parquet(buf, index=False)
    return buf.getvalue()


def payload(fig: go.Figure, fmt: str, data: pd.DataFrame | None = None) -> bytes | str:
    """The file of one download format."""
    if fmt in ("png", "svg"):
        return to_image(fig, fmt)
    if fmt == "html":
        return to_html(fig)
    df = data if data is not None else figure_table(fig)
    if fmt == "csv":
        return df.to_csv(index=False)
    if fmt == "parquet":
        return to_parquet(df)
    raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


MIME = {"png": "image/png", "svg": "image/svg+xml", "html": "text/html", "csv": "text/csv",
        "parquet": "application/vnd.apache.parquet"}
LABELS = {"png": "PNG", "svg": "SVG", "html": "HTML (interactive)", "csv": "data (CSV)", "parquet": "data (Parquet)"}


def _deferred(fig: go.Figure, fmt: str, data: pd.DataFrame | None) -> Callable[[], bytes | str]:
    def make() -> bytes | str:
        try:
            return payload(fig, fmt, data)
        except ExportError as err:
            return f"deltalab export failed: {err}\n"

    return make


def downloads(fig: go.Figure, key: str, data: pd.DataFrame | None = None) -> None:
    """The download buttons of one chart, in a small popover under it."""
    with st.popover("⤓ Export", help="Download this chart (PNG, SVG, interactive HTML) or its data (CSV, Parquet)."):
        for fmt in FORMATS:
            st.download_button(LABELS[fmt], data=_deferred(fig, fmt, data), file_name=f"{key}.{fmt}",
                               mime=MIME[fmt], key=f"dl_{key}_{fmt}", on_click="ignore", width="stretch")


def chart(fig: go.Figure, key: str, *, data: pd.DataFrame | None = None, **kwargs: Any) -> Any:
    """st.plotly_chart(fig, key=key, **kwargs) followed by its export popover; returns what plotly_chart returns."""
    config = {"displaylogo": False, "toImageButtonOptions": {"filename": key, "scale": 2}}
    config.update(kwargs.pop("config", None) or {})
    out = st.plotly_chart(fig, key=key, config=config, **kwargs)
    downloads(fig, key, data)
    return out
