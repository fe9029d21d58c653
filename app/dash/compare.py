"""Side-by-side comparison on the same charts: two heads, two layers, or two stores (two checkpoints on the same
inputs). Each side is a (label, results, layer, head) picked from head tables; figures overlay the two sides in
fixed colours. Pure numpy + pandas + plotly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from deltalab.app.dash import heads
from deltalab.app.dash import traces as tr
from deltalab.app.dash.figures import _layout, hline, strided, vline

COLORS = ("#1f77b4", "#d62728")


@dataclass
class Side:
    """One side of a comparison: a label and that head's row of the head table (None when it has no results)."""

    label: str
    row: pd.Series | None


INSIDE_LEGEND = dict(x=0.99, xanchor="right", y=0.03, yanchor="bottom", bgcolor="rgba(255,255,255,0.8)")
"""Legends of the side-by-side charts sit inside the plot's lower right (above the plot they ran into the title)."""

def metrics_table(a: Side, b: Side) -> pd.DataFrame:
    """Every METRICS value of both sides and their difference B − A (an RWKV-7 side's strong-removal fraction
    a > threshold in place of β > 1: one row each when the sides differ)."""
    named: dict[str, str] = {}
    for key, name in heads.METRICS.items():
        if key != "frac_beta_gt1":
            named[key] = name
            continue
        removal = dict(heads.removal_metric(s.row) for s in (a, b) if s.row is not None)
        named.update(removal or {key: name})
    out = []
    for key, name in named.items():
        va = float(a.row[key]) if a.row is not None and key in a.row else np.nan
        vb = float(b.row[key]) if b.row is not None and key in b.row else np.nan
        out.append({"metric": name, a.label: va, b.label: vb, "B − A": vb - va})
    return pd.DataFrame(out)


def _curve_figure(sides: Sequence[Side], column: str, title: str, xlabel: str, ylabel: str, *, bars: bool = False,
                  x: np.ndarray | None = None, normalise: bool = False) -> go.Figure:
    fig = go.Figure()
    for i, s in enumerate(sides):
        if s.row is None or not len(s.row[column]):
            continue
        y = np.asarray(s.row[column], np.float64)
        if normalise and np.nansum(y) > 0:
            y = y / np.nansum(y)
        xs = x if x is not None and len(x) == len(y) else np.arange(len(y))
        if bars:
            fig.add_trace(tr.Bar(x=xs, y=y, name=s.label, marker_color=COLORS[i % 2], opacity=0.6,
                                 hovertemplate="%{x}: %{y:.3f}<extra>" + s.label + "</extra>"))
        else:
            ok = np.isfinite(y)
            sparse = strided(ok)
            xs, y = (np.asarray(xs)[ok], y[ok]) if sparse else (xs, y)
            fig.add_trace(tr.Scatter(x=xs, y=y, mode="lines+markers" if sparse else "lines", name=s.label,
                                     line=dict(color=COLORS[i % 2], width=2),
                                     hovertemplate="%{x}: %{y:.3f}<extra>" + s.label + "</extra>"))
    fig.update_layout(barmode="overlay", legend=dict(orientation="h", x=1, xanchor="right", y=1.0, yanchor="bottom"))
    fig.update_xaxes(title_text=xlabel)
    fig.update_yaxes(title_text=ylabel)
    return _layout(fig, title, 340)


def beta_hist_figure(sides: Sequence[Side], bmax: float) -> go.Figure:
    """β distributions (all steps) of both sides, as fractions of sub-steps."""
    n = max((len(s.row["beta_hist"]) for s in sides if s.row is not None), default=0)
    x = (np.arange(n) + 0.5) * bmax / max(n, 1)
    return _curve_figure(sides, "beta_hist", "β distribution (all steps)", "β", "fraction of sub-steps", bars=True,
                         x=x, normalise=True)


def angle_hist_figure(sides: Sequence[Side]) -> go.Figure:
    """Rotation-angle distributions of both sides."""
    n = max((len(s.row["angle_hist"]) for s in sides if s.row is not None), default=0)
    x = (np.arange(n) + 0.5) * 180.0 / max(n, 1)
    return _curve_figure(sides, "angle_hist", "Rotation angle per token", "max |arg λ| (degrees)",
                         "fraction of tokens", bars=True, x=x, normalise=True)


def erank_figure(sides: Sequence[Side], length: int | None = None) -> go.Figure:
    """Effective rank over position (mean over sequences, pooled to the sparkline resolution) of both sides."""
    fig = _curve_figure(sides, "erank_curve", "Effective rank over position (mean over sequences)",
                        "position (pooled)", "effective rank")
    if length:
        for t in fig.data:
            t.x = np.linspace(0, length, len(t.y), endpoint=False)
        fig.update_xaxes(title_text="position")
    return fig


def evr_figure(sides: Sequence[Side]) -> go.Figure:
    """Cumulative explained variance of the keys (all steps jointly) of both sides, the 95% level marked."""
    fig = go.Figure()
    for i, s in enumerate(sides):
        if s.row is None or not len(s.row["evr"]):
            continue
        y = np.cumsum(np.asarray(s.row["evr"], np.float64))
        fig.add_trace(tr.Scatter(x=np.arange(1, len(y) + 1), y=y, mode="lines+markers", name=s.label,
                                 line=dict(color=COLORS[i % 2]),
                                 hovertemplate="first %{x} PCs: %{y:.3f}<extra>" + s.label + "</extra>"))
    hline(fig, 0.95, "95%", "#999")
    fig.update_xaxes(title_text="principal components", dtick=1)
    fig.update_yaxes(title_text="cumulative explained variance", range=[0, 1.02])
    fig.update_layout(legend=INSIDE_LEGEND)
    return _layout(fig, "Key subspace: cumulative explained variance", 340)


def per_position_figure(series: dict[str, np.ndarray], title: str, ylabel: str,
                        selected_pos: int | None = None) -> go.Figure:
    """One per-token quantity over position for both sides of the same input (e.g. β of two checkpoints)."""
    fig = go.Figure()
    for i, (name, y) in enumerate(series.items()):
        fig.add_trace(tr.Scatter(x=np.arange(len(y)), y=y, mode="lines", name=name,
                                 line=dict(color=COLORS[i % 2], width=1.5),
                                 customdata=np.arange(len(y)),
                                 hovertemplate="pos %{x}: %{y:.3f}<extra>" + name + "</extra>"))
    if selected_pos is not None:
        vline(fig, selected_pos, None, "black", dash="solid", width=1)
    fig.update_xaxes(title_text="position")
    fig.update_yaxes(title_text=ylabel)
    fig.update_layout(legend=INSIDE_LEGEND)
    return _layout(fig, title, 340, hovermode="x unified")
