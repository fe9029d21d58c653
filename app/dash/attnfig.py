"""Figures of the Attention page (pure plotly): the head grid of small signed maps. The token view itself is
`textgrid.text_figure` with `source_spec`'s diverging scale."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from deltalab.app.dash import figures
from deltalab.app.dash import traces as tr
from deltalab.app.dash.textgrid import Spec

SCALE = "RdBu"
"""Diverging: negative weights red, positive blue, zero white."""


def limit(values: np.ndarray) -> float:
    """Half-width of a colour scale centred at 0 that holds every finite value (1 when all are 0 or NaN)."""
    finite = np.abs(np.asarray(values, np.float64))
    finite = finite[np.isfinite(finite)]
    top = float(finite.max()) if finite.size else 0.0
    return top if top > 0 else 1.0


def source_spec(values: np.ndarray, mode: str) -> Spec:
    """How the token view colours sources: signed alpha on a diverging scale centred at 0."""
    lim = limit(values)
    return Spec(f"α ({'exact' if mode == 'exact' else 'GLA'})", SCALE, -lim, lim, ".4f")


def step_note(row: np.ndarray) -> list[str]:
    """Per source token, its weights by Householder sub-step (empty with one step): ' · steps 0.1 / -0.2'."""
    if row.ndim < 2 or row.shape[1] < 2:
        return [""] * len(row)
    return ["" if not np.isfinite(r).all() else " · by step " + " / ".join(f"{x:.4f}" for x in r) for r in row]


def head_grid_figure(maps: np.ndarray, lo: int, *, selected: int | None, layer: int, mode: str,
                     columns: int | None = None) -> go.Figure:
    """Small signed maps of every head ([head, query, source] over tokens lo..): one heatmap per head, each on its
    own scale centred at 0, under invisible points carrying the hover and the click (customdata [head, query,
    source, alpha]); the selected head framed in red."""
    H, n, _ = maps.shape
    cols = columns or min(H, 4 if H <= 8 else 8)
    rows = math.ceil(H / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"head {h}" for h in range(H)],
                        horizontal_spacing=0.03, vertical_spacing=min(0.12, 0.3 / rows))
    pos = np.arange(lo, lo + n)
    qi, si = np.tril_indices(n)
    template = "head %{customdata[0]} · query %{y} ← source %{x}<br>α = %{customdata[3]:.4f}<extra></extra>"
    for h in range(H):
        r, c = h // cols + 1, h % cols + 1
        lim = limit(maps[h])
        fig.add_trace(tr.Heatmap(z=maps[h], x=pos, y=pos, colorscale=SCALE, zmin=-lim, zmax=lim, showscale=False,
                                 hoverinfo="skip", name=f"head {h}"), row=r, col=c)
        vals = maps[h][qi, si]
        custom = np.stack([np.full(qi.size, h, np.float64), pos[qi], pos[si], vals], 1)
        fig.add_trace(tr.Scatter(
            x=pos[si], y=pos[qi], mode="markers", name=f"head {h} cells", showlegend=False,
            marker=dict(symbol="square", size=4, opacity=0.0, color="black"), customdata=custom,
            hovertemplate=template, unselected=dict(marker=dict(opacity=0.0)),
            selected=dict(marker=dict(opacity=0.0))), row=r, col=c)
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, fixedrange=True)
    fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False, fixedrange=True, autorange="reversed")
    if selected is not None and 0 <= selected < H:
        i = selected + 1
        ref = "" if i == 1 else str(i)
        fig.add_shape(type="rect", xref=f"x{ref} domain", yref=f"y{ref} domain", x0=-0.02, x1=1.02, y0=-0.02,
                      y1=1.02, line=dict(color="red", width=3))
    title = (f"Every head of layer {layer}: {mode} α over tokens {lo}–{lo + n - 1} (rows: queries, columns: "
             "sources; each map on its own scale). Click a map to select its head.")
    fig = figures._layout(fig, title, 90 + 190 * rows)
    fig.update_layout(hovermode="closest", dragmode=False, margin=dict(l=20, r=20, t=80, b=20),
                      title=dict(font=dict(size=14)))
    return fig
