"""Plotly figures of the dashboard, as pure functions of numpy arrays (no Streamlit, no store access).

Conventions: layers on the y axis and heads on the x axis of every layer x head heatmap; the selected
layer/head is outlined; the selected token is drawn as a large black-edged diamond; colour scales are
fixed per quantity (beta: 0..beta_max, angles: 0..90 degrees, accuracy: 0..1) so pages compare.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from deltalab.app.dash import traces as tr

TOKEN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#8c6d31", "#843c39", "#7b4173",
                "#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#9c9ede", "#e7ba52", "#de9ed6")
SELECTED = dict(symbol="diamond", size=16, color="rgba(0,0,0,0)", line=dict(color="black", width=3))
HEAD_COLORS = TOKEN_COLORS
BETA_SCALE = "Viridis"
ANGLE_SCALE = "Magma"
ACC_SCALE = "Blues"


pio.templates.default = "plotly_white"
"""The dashboard's figures start from plotly_white: set once here, because naming the template in each figure's
layout makes plotly validate and copy it again (about 20 ms a figure, most of a page's redraw)."""


def _layout(fig: go.Figure, title: str, height: int = 420, **kw) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0.0, xanchor="left", font=dict(size=16)), height=height,
                      margin=dict(l=60, r=20, t=60, b=50), legend=dict(orientation="v"), **kw)
    return fig


def warm_up() -> None:
    """Build one small figure of every kind the pages draw, so plotly creates its property validators (about 0.3 s
    the first time a process builds a kind of figure) before a visitor's first page does."""
    x = np.arange(3.0)
    fig = go.Figure([tr.Scatter(x=x, y=x), tr.Heatmap(z=np.eye(3)), tr.Bar(x=x, y=x), tr.Histogram(x=x, y=x),
                     tr.Box(y=x)])
    fig.update_xaxes(title_text="x", range=[0, 2], dtick=1, zeroline=True)
    fig.update_yaxes(title_text="y", range=[0, 2], scaleanchor="x", scaleratio=1, autorange="reversed")
    fig.add_vrect(x0=0, x1=1, fillcolor="rgba(0,0,0,0.1)", line_width=0)
    fig.add_hrect(y0=0, y1=1, line=dict(color="black", width=1))
    vline(fig, 1.0, "mark", "crimson")
    hline(fig, 1.0, "mark", "#999")
    _highlight_cell(fig, 0, 0)
    _layout(fig, "warm-up", barmode="overlay", hovermode="closest")
    fig.update_layout(legend=dict(title=dict(text="t"), itemsizing="constant", orientation="h", x=1, y=1,
                                  xanchor="right", yanchor="bottom", bgcolor="white", font=dict(size=10)))
    fig.to_dict()


def _class_name(names: Sequence[str] | None, c: int) -> str:
    """Legend entry of a token/label class: '3: (1, 2, 4, 3)', or '3' without names (-100 = no label)."""
    if c < 0:
        return "no label"
    return f"{c}: {names[c]}" if names is not None and c < len(names) else str(c)


def token_color(i: int) -> str:
    return TOKEN_COLORS[i % len(TOKEN_COLORS)]


def _highlight_cell(fig: go.Figure, r: int | None, c: int | None, **kw) -> None:
    """Outline heatmap cell (row r, column c) in red: the selected layer/head."""
    if r is None or c is None:
        return
    fig.add_shape(type="rect", x0=c - 0.5, x1=c + 0.5, y0=r - 0.5, y1=r + 0.5,
                  line=dict(color="red", width=3), fillcolor="rgba(0,0,0,0)", **kw)


def clickable_cells(fig: go.Figure, xs: Sequence[str], ys: Sequence[str], customdata: np.ndarray,
                    hovertext: Sequence[str], **where: int) -> None:
    """Invisible points over a heatmap's cells (x categories `xs`, y categories `ys`; customdata [len(ys), len(xs),
    k]; hovertext one per cell, row-major) that carry the hover and the click: Streamlit reports no selection for a
    click on a heatmap itself. The caller turns the heatmap's own hover off."""
    gx, gy = np.meshgrid(np.arange(len(xs)), np.arange(len(ys)))
    cd = np.asarray(customdata).reshape(len(ys) * len(xs), -1)
    fig.add_trace(go.Scatter(x=[xs[i] for i in gx.ravel()], y=[ys[j] for j in gy.ravel()], mode="markers",
                             customdata=cd, text=list(hovertext), hovertemplate="%{text}<extra></extra>",
                             showlegend=False, name="cells",
                             marker=dict(symbol="square", size=max(8, min(80, 800 // max(len(xs), len(ys)))),
                                         opacity=0.0, color="black"),
                             unselected=dict(marker=dict(opacity=0.0)), selected=dict(marker=dict(opacity=0.0))),
                  **where)


def _cell_text(values: np.ndarray, xs: Sequence[str], ys: Sequence[str], head: str, label: str, fmt: str) -> list[str]:
    return [f"{head}{y}, {x}<br>{label} = " + ("n/a" if not np.isfinite(values[j, i]) else format(values[j, i], fmt))
            for j, y in enumerate(ys) for i, x in enumerate(xs)]


def layer_head_heatmap(values: np.ndarray, layers: Sequence[int], title: str, zlabel: str, *,
                       zmin: float | None = None, zmax: float | None = None, colorscale: str = "Viridis",
                       highlight: tuple[int, int] | None = None, fmt: str = ".2f",
                       col_labels: Sequence[str] | None = None, height: int | None = None,
                       zmid: float | None = None) -> go.Figure:
    """values [L, H] as a heatmap (rows = layers, bottom = layer 0), numbers written in the cells when small."""
    L, H = values.shape
    cols = list(col_labels) if col_labels is not None else [f"head {h}" for h in range(H)]
    text = [[("" if not np.isfinite(v) else format(v, fmt)) for v in row] for row in values] if L * H <= 400 else None
    fig = go.Figure(tr.Heatmap(
        z=values, x=cols, y=[f"layer {int(x)}" for x in layers], colorscale=colorscale, zmin=zmin, zmax=zmax,
        zmid=zmid, text=text, texttemplate="%{text}" if text else None, colorbar=dict(title=dict(text=zlabel)),
        hovertemplate="%{y}, %{x}<br>" + zlabel + " = %{z:" + fmt + "}<extra></extra>", xgap=1, ygap=1))
    if col_labels is None:  # columns are heads: a click selects the cell's layer and head
        cd = np.stack(np.meshgrid(np.arange(H), np.asarray(layers, dtype=np.int64))[::-1], -1)  # [L, H, (layer, head)]
        ys = [f"layer {int(x)}" for x in layers]
        clickable_cells(fig, cols, ys, cd, _cell_text(values, cols, ys, "", zlabel, fmt))
        fig.data[0].hoverinfo, fig.data[0].hovertemplate = "skip", None
    if highlight is not None:
        _highlight_cell(fig, highlight[0], highlight[1])
    fig.update_xaxes(title_text="head", side="bottom")
    fig.update_yaxes(title_text="layer", autorange=True)
    return _layout(fig, title, height or max(260, 80 + 45 * L))


def beta_step_heatmaps(values: np.ndarray, layers: Sequence[int], bmax: float, stat: str,
                       highlight: tuple[int, int] | None = None) -> go.Figure:
    """values [L, n_h, H]: one layer x head heatmap per Householder step, one shared colour bar."""
    L, n_h, H = values.shape
    fig = make_subplots(rows=1, cols=n_h, subplot_titles=[f"step {s} (β<sub>{s}</sub>)" for s in range(n_h)],
                        horizontal_spacing=0.06, shared_yaxes=True)
    frac = stat.startswith("fraction")
    zmax = 1.0 if frac else bmax
    for s in range(n_h):
        z = values[:, s, :]
        text = [[format(v, ".2f") if np.isfinite(v) else "" for v in row] for row in z] if L * H <= 200 else None
        fig.add_trace(tr.Heatmap(
            z=z, x=[f"h{h}" for h in range(H)], y=[f"layer {int(x)}" for x in layers], coloraxis="coloraxis",
            text=text, texttemplate="%{text}" if text else None, xgap=1, ygap=1,
            hovertemplate=f"step {s}, " + "%{y}, %{x}<br>" + stat + " = %{z:.3f}<extra></extra>"), 1, s + 1)
        lay, hd = np.meshgrid(np.asarray(layers, dtype=np.int64), np.arange(H), indexing="ij")
        xs, ys = [f"h{h}" for h in range(H)], [f"layer {int(x)}" for x in layers]
        fig.data[-1].hoverinfo, fig.data[-1].hovertemplate = "skip", None
        clickable_cells(fig, xs, ys, np.stack([lay, hd, np.full_like(lay, s)], -1),  # (layer, head, step)
                        _cell_text(z, xs, ys, f"step {s}, ", stat, ".3f"), row=1, col=s + 1)
        if highlight is not None:
            _highlight_cell(fig, highlight[0], highlight[1], row=1, col=s + 1)
        fig.update_xaxes(title_text="head", row=1, col=s + 1)
    fig.update_yaxes(title_text="layer", row=1, col=1)
    fig.update_layout(coloraxis=dict(colorscale=BETA_SCALE, cmin=0.0, cmax=zmax, colorbar=dict(title=stat)))
    return _layout(fig, f"{stat} per layer and head, for each Householder step", max(280, 110 + 45 * L))


def beta_histogram(centers: np.ndarray, counts: np.ndarray, bmax: float, title: str) -> go.Figure:
    """counts [n_h, bins] over bin centres: one histogram trace per step, with the beta = 1 and 2 marks."""
    fig = go.Figure()
    width = float(centers[1] - centers[0]) if len(centers) > 1 else bmax
    for s, c in enumerate(counts):
        total = max(1, int(np.sum(c)))
        fig.add_trace(tr.Histogram(x=centers, y=c / total, histfunc="sum", name=f"step {s} (β{s})",
                                   xbins=dict(start=0.0, end=bmax, size=width), opacity=0.65,
                                   marker_color=token_color(s),
                                   hovertemplate="β ≈ %{x:.3f}<br>fraction %{y:.3f}<extra>step " + str(s) + "</extra>"))
    fig.update_layout(barmode="overlay")
    vline(fig, 1.0, "β = 1 (eigenvalue 0)", "gray")
    if bmax >= 2:
        vline(fig, 2.0, "β = 2 (reflection)", "crimson")
    fig.update_xaxes(title_text="β", range=[0, bmax * 1.02])
    fig.update_yaxes(title_text="fraction of tokens")
    return _layout(fig, title, 360)


def vline(fig: go.Figure, x: float, label: str | None, color: str, dash: str = "dash", width: float = 1.5,
           where: str = "top") -> None:
    """A vertical line across the plot with an optional label (`where`: top, top left, bottom right, ...), drawn as
    a paper-height shape and an annotation: plotly's add_vline looks through every subplot first, about 40 ms a
    line, and text stores mark every document start."""
    fig.add_shape(type="line", x0=x, x1=x, xref="x", y0=0, y1=1, yref="paper",
                  line=dict(color=color, dash=dash, width=width))
    if label:
        top = where.startswith("top")
        xanchor = "right" if where.endswith("left") else "left" if where.endswith("right") else "center"
        fig.add_annotation(x=x, y=1 if top else 0, xref="x", yref="paper", text=label, showarrow=False,
                           yanchor="bottom", xanchor=xanchor, font=dict(size=11, color=color))


def hline(fig: go.Figure, y: float, label: str | None, color: str, dash: str = "dash", width: float = 1.0) -> None:
    """A horizontal line across the plot, labelled at its right end (see _vline)."""
    fig.add_shape(type="line", x0=0, x1=1, xref="paper", y0=y, y1=y, yref="y",
                  line=dict(color=color, dash=dash, width=width))
    if label:
        fig.add_annotation(x=1, y=y, xref="paper", yref="y", text=label, showarrow=False, xanchor="right",
                           yanchor="top", font=dict(size=11, color=color))


def beta_token_scatter(means: np.ndarray, stds: np.ndarray, tokens: np.ndarray, labels: Sequence[str],
                       bmax: float, sx: int, sy: int, selected_token: int | None, title: str) -> go.Figure:
    """Per input token: mean beta of step sx against step sy with std error bars (DeltaProduct Figure 7)."""
    fig = go.Figure()
    fig.add_trace(tr.Scatter(
        x=means[:, sx], y=means[:, sy], mode="markers+text", text=[str(int(t)) for t in tokens],
        textposition="top center", textfont=dict(size=10), name="input tokens",
        error_x=dict(type="data", array=stds[:, sx], thickness=1, color="rgba(80,80,80,0.4)"),
        error_y=dict(type="data", array=stds[:, sy], thickness=1, color="rgba(80,80,80,0.4)"),
        marker=dict(size=10, color=[token_color(int(t)) for t in tokens], line=dict(width=1, color="white")),
        customdata=np.stack([tokens, np.arange(len(tokens))], 1), hovertext=list(labels),
        hovertemplate=f"token %{{hovertext}}<br>β{sx} = %{{x:.3f}}<br>β{sy} = %{{y:.3f}}<extra></extra>"))
    if selected_token is not None and selected_token in set(tokens.tolist()):
        i = int(np.flatnonzero(tokens == selected_token)[0])
        fig.add_trace(tr.Scatter(x=[means[i, sx]], y=[means[i, sy]], mode="markers", marker=SELECTED,
                                 name=f"selected token {labels[i]}", hoverinfo="skip"))
    if bmax >= 2:
        fig.add_trace(tr.Scatter(x=[2], y=[2], mode="markers", name="reflection (β = 2, 2)",
                                 marker=dict(symbol="x-thin", size=18, line=dict(width=2, color="crimson")),
                                 hoverinfo="skip"))
    lim = [-0.05 * bmax, bmax * 1.05]
    fig.update_xaxes(title_text=f"mean β{sx} (step {sx})", range=lim, zeroline=False, constrain="domain")
    fig.update_yaxes(title_text=f"mean β{sy} (step {sy})", range=lim, scaleanchor="x", scaleratio=1, zeroline=False,
                     constrain="domain")
    return _layout(fig, title, 460)


def beta_token_strip(means: np.ndarray, stds: np.ndarray, tokens: np.ndarray, labels: Sequence[str],
                     bmax: float, selected_token: int | None, title: str) -> go.Figure:
    """Per input token (x) the mean beta of every step (one trace per step); used when n_h = 1 and as an overview."""
    fig = go.Figure()
    x = [str(int(t)) for t in tokens]
    for s in range(means.shape[1]):
        fig.add_trace(tr.Scatter(x=x, y=means[:, s], mode="markers", name=f"step {s} (β{s})",
                                 error_y=dict(type="data", array=stds[:, s], thickness=1),
                                 marker=dict(size=9, color=token_color(s)), hovertext=list(labels),
                                 customdata=np.stack([tokens, np.arange(len(tokens))], 1),
                                 hovertemplate="token %{hovertext}<br>β = %{y:.3f}<extra>step " + str(s) + "</extra>"))
    if selected_token is not None and selected_token in set(tokens.tolist()):
        fig.add_vrect(x0=str(selected_token), x1=str(selected_token), line=dict(color="black", width=2))
    fig.update_xaxes(title_text="input token id", type="category")
    fig.update_yaxes(title_text="mean β", range=[0, bmax * 1.05])
    return _layout(fig, title, 360)


def beta_token_grid(means: np.ndarray, tokens: np.ndarray, labels: Sequence[str], bmax: float,
                    selected_token: int | None, selected_head: int | None) -> go.Figure:
    """means [tok, n_h, H] as a heatmap: rows = input tokens, columns = (head, step); finds the reflection heads."""
    n_tok, n_h, H = means.shape
    z = means.transpose(0, 2, 1).reshape(n_tok, H * n_h)
    cols = [f"h{h}·β{s}" for h in range(H) for s in range(n_h)]
    fig = go.Figure(tr.Heatmap(z=z, x=cols, y=[str(int(t)) for t in tokens], colorscale=BETA_SCALE, zmin=0,
                               zmax=bmax, colorbar=dict(title="mean β"), xgap=1, ygap=1,
                               customdata=np.repeat(np.asarray(labels, dtype=object)[:, None], H * n_h, 1),
                               hovertemplate="token %{customdata}<br>%{x}: β = %{z:.3f}<extra></extra>"))
    if selected_head is not None:
        fig.add_vrect(x0=selected_head * n_h - 0.5, x1=selected_head * n_h + n_h - 0.5,
                      line=dict(color="red", width=2))
    if selected_token is not None and selected_token in set(tokens.tolist()):
        r = int(np.flatnonzero(tokens == selected_token)[0])
        fig.add_hrect(y0=r - 0.5, y1=r + 0.5, line=dict(color="black", width=2))
    fig.update_xaxes(title_text="head · step", tickangle=-60)
    fig.update_yaxes(title_text="input token id", type="category")
    return _layout(fig, "Mean β of every head and step, per input token", max(320, 120 + 16 * n_tok))


def explained_variance(evr: np.ndarray, joint: np.ndarray | None, title: str, max_components: int = 16) -> go.Figure:
    """evr [n_h, dk] (+ joint [dk]): bars of the ratio per component and cumulative lines, 95% marked."""
    m = min(max_components, evr.shape[-1])
    comps = np.arange(1, m + 1)
    fig = go.Figure()
    series = [(f"step {s}", evr[s, :m], token_color(s)) for s in range(evr.shape[0])]
    if joint is not None:
        series.append(("all steps jointly", joint[:m], "#444444"))
    for name, e, color in series:
        fig.add_trace(tr.Bar(x=comps, y=e, name=f"{name}", marker_color=color, opacity=0.75,
                             hovertemplate="PC %{x}: %{y:.3f}<extra>" + name + "</extra>"))
        fig.add_trace(tr.Scatter(x=comps, y=np.nancumsum(e), mode="lines+markers", name=f"{name} (cumulative)",
                                 line=dict(color=color, dash="dot"), showlegend=True,
                                 hovertemplate="first %{x} PCs: %{y:.3f}<extra>" + name + "</extra>"))
    hline(fig, 0.95, "95%", "crimson")
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="principal component", dtick=1)
    fig.update_yaxes(title_text="explained variance ratio", range=[0, 1.02])
    return _layout(fig, title, 400)


def pca_scatter3d(xyz: np.ndarray, color: np.ndarray, color_name: str, hover: Sequence[str],
                  customdata: np.ndarray, names: Sequence[str] | None, highlight: np.ndarray | None,
                  title: str, evr: np.ndarray | None = None) -> go.Figure:
    """Keys on their top 3 principal components, one trace per colour class (token or label) when there are few."""
    fig = go.Figure()
    classes = np.unique(color)
    pcs = [f"PC{i + 1}" + (f" ({evr[i]:.0%})" if evr is not None and np.isfinite(evr[i]) else "") for i in range(3)]
    hover = np.asarray(hover, dtype=object)
    if len(classes) <= 32:
        for c in classes:
            m = color == c
            fig.add_trace(go.Scatter3d(
                x=xyz[m, 0], y=xyz[m, 1], z=xyz[m, 2], mode="markers", name=_class_name(names, int(c)),
                marker=dict(size=3, color=token_color(int(c)), opacity=0.8), hovertext=hover[m],
                customdata=customdata[m], hovertemplate="%{hovertext}<extra></extra>"))
    else:
        fig.add_trace(go.Scatter3d(x=xyz[:, 0], y=xyz[:, 1], z=xyz[:, 2], mode="markers", name="keys",
                                   marker=dict(size=3, color=color, colorscale="Turbo", opacity=0.8,
                                               colorbar=dict(title=color_name)),
                                   hovertext=hover, customdata=customdata, hovertemplate="%{hovertext}<extra></extra>"))
    if highlight is not None and np.isfinite(highlight).all():
        fig.add_trace(go.Scatter3d(x=[highlight[0]], y=[highlight[1]], z=[highlight[2]], mode="markers",
                                   name="selected token", marker=dict(size=9, color="black", symbol="diamond"),
                                   hoverinfo="skip"))
    fig.update_layout(scene=dict(xaxis_title=pcs[0], yaxis_title=pcs[1], zaxis_title=pcs[2], aspectmode="cube",
                                 camera=dict(eye=dict(x=1.5, y=1.5, z=1.1))),
                      legend=dict(title=dict(text=color_name), itemsizing="constant"))
    _layout(fig, title, 640)
    fig.update_layout(margin=dict(l=0, r=0, t=50, b=0))
    return fig


def angles_heatmap(angles: np.ndarray, labels: Sequence[str], title: str, axis: str) -> go.Figure:
    """angles [n, n, d] principal angles (degrees): cell = mean angle (0 = same subspace, 90 = orthogonal)."""
    mean = np.nanmean(angles, -1) if np.isfinite(angles).any() else np.full(angles.shape[:2], np.nan)
    hover = [[", ".join(f"{a:.1f}°" for a in angles[i, j]) for j in range(angles.shape[1])]
             for i in range(angles.shape[0])]
    text = [[f"{v:.0f}°" if np.isfinite(v) else "" for v in row] for row in mean] if mean.size <= 400 else None
    fig = go.Figure(tr.Heatmap(z=mean, x=list(labels), y=list(labels), zmin=0, zmax=90, colorscale=ANGLE_SCALE,
                               reversescale=True, text=text, texttemplate="%{text}" if text else None,
                               customdata=hover, xgap=1, ygap=1, colorbar=dict(title="mean angle (°)"),
                               hovertemplate="%{y} vs %{x}<br>principal angles: %{customdata}<extra></extra>"))
    fig.update_xaxes(title_text=axis)
    fig.update_yaxes(title_text=axis, autorange="reversed")
    return _layout(fig, title, max(300, 120 + 30 * len(labels)))


def unit_circle() -> go.Scatter:
    """The unit circle |z| = 1 (eigenvalues on it are rotations/reflections, inside contractions)."""
    t = np.linspace(0, 2 * np.pi, 361)
    return tr.Scatter(x=np.cos(t), y=np.sin(t), mode="lines", name="unit circle", hoverinfo="skip",
                      line=dict(color="rgba(60,60,60,0.6)", width=1.5, dash="dot"))


def _complex_axes(fig: go.Figure, lim: float = 1.15) -> None:
    fig.update_xaxes(title_text="Re λ", range=[-lim, lim], zeroline=True, zerolinecolor="#bbb")
    fig.update_yaxes(title_text="Im λ", range=[-lim, lim], scaleanchor="x", scaleratio=1, zeroline=True,
                     zerolinecolor="#bbb")


def complex_plane(eig: np.ndarray, color: np.ndarray, color_name: str, hover: Sequence[str],
                  customdata: np.ndarray, names: Sequence[str] | None, highlight: np.ndarray | None,
                  title: str) -> go.Figure:
    """Eigenvalues [N] on the complex plane with the unit circle; coloured by input token (or position)."""
    fig = go.Figure([unit_circle()])
    hover = np.asarray(hover, dtype=object)
    classes = np.unique(color)
    if color_name == "input token" and len(classes) <= 32:
        for c in classes:
            m = color == c
            fig.add_trace(tr.Scatter(x=eig[m].real, y=eig[m].imag, mode="markers", name=_class_name(names, int(c)),
                                     marker=dict(size=6, color=token_color(int(c)), opacity=0.7),
                                     hovertext=hover[m], customdata=customdata[m],
                                     hovertemplate="%{hovertext}<br>λ = %{x:.3f} %{y:+.3f}i<extra></extra>"))
    else:
        fig.add_trace(tr.Scatter(x=eig.real, y=eig.imag, mode="markers", name="eigenvalues",
                                 marker=dict(size=5, color=color, colorscale="Viridis", opacity=0.6,
                                             colorbar=dict(title=color_name)),
                                 hovertext=hover, customdata=customdata,
                                 hovertemplate="%{hovertext}<br>λ = %{x:.3f} %{y:+.3f}i<extra></extra>"))
    if highlight is not None and highlight.size:
        fig.add_trace(tr.Scatter(x=highlight.real, y=highlight.imag, mode="markers", name="selected token",
                                 marker=SELECTED, hoverinfo="skip"))
    lim = max(1.15, float(np.nanmax(np.abs(eig))) * 1.05 if eig.size else 1.15)
    _complex_axes(fig, lim)
    fig.update_layout(legend=dict(title=dict(text=color_name), itemsizing="constant"))
    return _layout(fig, title, 520)


def angle_histogram(centers: np.ndarray, counts: np.ndarray, title: str, selected: float | None = None) -> go.Figure:
    """Rotation angle per token (max |arg λ|, degrees) as a histogram of pre-binned counts."""
    width = float(centers[1] - centers[0]) if len(centers) > 1 else 5.0
    total = max(1, int(np.sum(counts)))
    fig = go.Figure(tr.Histogram(x=centers, y=counts / total, histfunc="sum", name="tokens",
                                 xbins=dict(start=0, end=180, size=width), marker_color="#4c78a8",
                                 hovertemplate="%{x:.0f}°: fraction %{y:.3f}<extra></extra>"))
    for a in (90, 120, 180):
        vline(fig, a, f"{a}°", "#999", dash="dot")
    if selected is not None and np.isfinite(selected):
        vline(fig, selected, "selected token", "black", dash="solid")
    fig.update_xaxes(title_text="rotation angle max |arg λ| (degrees)", range=[0, 182], dtick=30)
    fig.update_yaxes(title_text="fraction of tokens")
    return _layout(fig, title, 360)


def token_eigenvalue_sets(eig: np.ndarray, tokens: np.ndarray, labels: Sequence[str], spread: np.ndarray,
                          selected_token: int | None, title: str) -> go.Figure:
    """eig [tok, n] mean eigenvalue set of each input token on the complex plane, labelled by token id."""
    fig = go.Figure([unit_circle()])
    for i, t in enumerate(tokens):
        e = eig[i]
        fig.add_trace(tr.Scatter(
            x=e.real, y=e.imag, mode="markers+text", text=[str(int(t))] * len(e), textposition="top center",
            textfont=dict(size=9, color=token_color(int(t))), name=str(labels[i]),
            marker=dict(size=9, color=token_color(int(t)), line=dict(width=1, color="white")),
            customdata=[[int(t), float(spread[i])]] * len(e),
            hovertemplate="token " + str(labels[i]).replace("%", "%%") +
                          "<br>λ = %{x:.3f} %{y:+.3f}i<br>spread %{customdata[1]:.3f}<extra></extra>"))
    if selected_token is not None and selected_token in set(tokens.tolist()):
        i = int(np.flatnonzero(tokens == selected_token)[0])
        fig.add_trace(tr.Scatter(x=eig[i].real, y=eig[i].imag, mode="markers", marker=SELECTED,
                                 name="selected token", hoverinfo="skip"))
    _complex_axes(fig, max(1.15, float(np.nanmax(np.abs(eig))) * 1.05 if eig.size else 1.15))
    fig.update_layout(legend=dict(title=dict(text="input token"), itemsizing="constant", font=dict(size=10)))
    return _layout(fig, title, 520)


def token_head_heatmap(values: np.ndarray, tokens: np.ndarray, labels: Sequence[str], title: str, zlabel: str,
                       *, zmin: float, zmax: float, colorscale: str, selected_head: int | None,
                       selected_token: int | None) -> go.Figure:
    """values [tok, H] (e.g. each token's rotation angle in each head)."""
    n_tok, H = values.shape
    fig = go.Figure(tr.Heatmap(z=values, x=[f"h{h}" for h in range(H)], y=[str(int(t)) for t in tokens],
                               zmin=zmin, zmax=zmax, colorscale=colorscale, xgap=1, ygap=1,
                               colorbar=dict(title=zlabel),
                               customdata=np.repeat(np.asarray(labels, dtype=object)[:, None], H, 1),
                               hovertemplate="token %{customdata}, %{x}<br>" + zlabel + " = %{z:.1f}<extra></extra>"))
    if selected_head is not None:
        fig.add_vrect(x0=selected_head - 0.5, x1=selected_head + 0.5, line=dict(color="red", width=2))
    if selected_token is not None and selected_token in set(tokens.tolist()):
        r = int(np.flatnonzero(tokens == selected_token)[0])
        fig.add_hrect(y0=r - 0.5, y1=r + 0.5, line=dict(color="black", width=2))
    fig.update_xaxes(title_text="head")
    fig.update_yaxes(title_text="input token id", type="category")
    return _layout(fig, title, max(320, 120 + 16 * n_tok))


def gate_box(gates: np.ndarray, selected_head: int | None, title: str) -> go.Figure:
    """gates [N, H] = exp(g_t) per head as box plots (1 = no decay, 0 = forget everything)."""
    fig = go.Figure()
    for h in range(gates.shape[1]):
        fig.add_trace(tr.Box(y=gates[:, h], name=f"h{h}", boxpoints=False,
                             marker_color="crimson" if h == selected_head else "#4c78a8",
                             hovertemplate="%{y:.3f}<extra>head " + str(h) + "</extra>"))
    fig.update_xaxes(title_text="head")
    fig.update_yaxes(title_text="gate exp(g_t) = |λ(A_t)| / |λ(P_t)|", range=[0, 1.05])
    fig.update_layout(showlegend=False)
    return _layout(fig, title, 360)


def strided(finite: np.ndarray) -> bool:
    """Whether a curve's values (finite [T] or [T, H]) were taken at a stride (ranks every N-th token, NaN between):
    then they are drawn as points joined across the gaps, since a plain line through NaNs shows nothing."""
    counts = finite.reshape(len(finite), -1).sum(0)
    return bool(counts.any()) and int(counts.max()) <= len(finite) // 2


def rank_lines(values: np.ndarray, metric: str, *, train_length: int | None, doc_starts: Sequence[int],
               selected_head: int | None, selected_pos: int | None, title: str,
               chunk_size: int | None = None) -> go.Figure:
    """values [T, H]: one line per head over position, training length and document boundaries marked. Ranks
    computed every N-th token (`--rank-every N`, NaN between) are drawn as points joined across the gaps: a plain
    line through NaNs would show nothing."""
    T, H = values.shape
    pos = np.arange(T)
    finite = np.isfinite(values)
    sparse = strided(finite)
    fig = go.Figure()
    for h in range(H):
        sel = h == selected_head
        x = pos[finite[:, h]] if sparse else pos
        fig.add_trace(tr.Scatter(x=x, y=values[x, h], mode="lines+markers" if sparse else "lines", name=f"head {h}",
                                 line=dict(color=HEAD_COLORS[h % len(HEAD_COLORS)], width=3.5 if sel else 1.5),
                                 opacity=1.0 if sel or selected_head is None else 0.55,
                                 customdata=np.stack([x, np.full(len(x), h)], 1),
                                 hovertemplate=f"pos %{{x}}<br>{metric} = %{{y:.3f}}<extra>head {h}</extra>"))
    if train_length is not None and 0 < train_length < T:
        fig.add_vrect(x0=train_length, x1=T - 1, fillcolor="rgba(200,0,0,0.05)", line_width=0)
        vline(fig, train_length, f"training length {train_length}", "crimson")
    for i, d in enumerate(doc_starts):
        if 0 < d < T:
            vline(fig, d, "document start" if i == 0 else None, "#2ca02c", dash="dot", where="bottom right")
    if selected_pos is not None:
        vline(fig, selected_pos, f"pos {selected_pos}", "black", dash="solid", where="top left")
    fig.update_xaxes(title_text="position (token index)")
    fig.update_yaxes(title_text=metric, rangemode="tozero")
    return _layout(fig, title, 440, hovermode="closest")


def probe_accuracy_heatmap(acc: np.ndarray, chance: np.ndarray, layers: Sequence[int], heads: Sequence[int],
                           highlight: tuple[int, int] | None, title: str) -> go.Figure:
    """acc [L, P] test accuracy of the linear probes (column 'all' = all heads concatenated)."""
    cols = ["all heads" if h < 0 else f"head {h}" for h in heads]
    fig = layer_head_heatmap(acc, layers, title, "test accuracy", zmin=0, zmax=1, colorscale=ACC_SCALE,
                             highlight=highlight, col_labels=cols)
    fig.data[0].customdata = chance
    fig.data[0].hovertemplate = "%{y}, %{x}<br>test accuracy %{z:.3f}<br>chance %{customdata:.3f}<extra></extra>"
    fig.update_xaxes(title_text="probe input")
    return fig


def accuracy_by_position(series: dict[str, np.ndarray], train_length: int | None, title: str,
                         chance: float | None = None, loss: np.ndarray | None = None,
                         selected_pos: int | None = None) -> go.Figure:
    """Accuracy curves over position (and the loss on a second axis), with the training length marked."""
    fig = make_subplots(specs=[[{"secondary_y": loss is not None}]])
    T = max((len(v) for v in series.values()), default=0)
    for i, (name, values) in enumerate(series.items()):
        fig.add_trace(tr.Scatter(x=np.arange(len(values)), y=values, mode="lines", name=name,
                                 line=dict(color=token_color(i), width=2),
                                 hovertemplate="pos %{x}: %{y:.3f}<extra>" + name + "</extra>"), secondary_y=False)
    if loss is not None:
        fig.add_trace(tr.Scatter(x=np.arange(len(loss)), y=loss, mode="lines", name="loss (right axis)",
                                 line=dict(color="#888", width=1, dash="dot"),
                                 hovertemplate="pos %{x}: loss %{y:.3f}<extra></extra>"), secondary_y=True)
        fig.update_yaxes(title_text="cross-entropy loss", secondary_y=True, rangemode="tozero", showgrid=False)
    if chance is not None and np.isfinite(chance):
        hline(fig, chance, "chance", "#999")
    if train_length is not None and 0 < train_length < T:
        fig.add_vrect(x0=train_length, x1=T - 1, fillcolor="rgba(200,0,0,0.05)", line_width=0)
        vline(fig, train_length, f"training length {train_length}", "crimson")
    if selected_pos is not None:
        vline(fig, selected_pos, None, "black", dash="solid", width=1)
    fig.update_xaxes(title_text="position (token index)")
    fig.update_yaxes(title_text="accuracy", range=[0, 1.03], secondary_y=False)
    return _layout(fig, title, 400, hovermode="x unified")


def variable_sizes(names: Sequence[str], logical: Sequence[int], stored: Sequence[int]) -> go.Figure:
    """Bytes per variable: in memory when loaded vs on disk."""
    fig = go.Figure([
        tr.Bar(y=list(names), x=[max(1, v) for v in logical], orientation="h", name="in memory (loaded)",
               marker_color="#9ecae1", hovertemplate="%{y}: %{x:.3s}B<extra>in memory</extra>"),
        tr.Bar(y=list(names), x=[max(1, v) for v in stored], orientation="h", name="on disk",
               marker_color="#3182bd", hovertemplate="%{y}: %{x:.3s}B<extra>on disk</extra>"),
    ])
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="bytes (log scale)", type="log", tickformat="~s", ticksuffix="B")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, "Size of each variable", max(260, 60 + 28 * len(names)))


# --- one token ---------------------------------------------------------------------------------

def keys_heatmap(keys: np.ndarray, betas: np.ndarray) -> go.Figure:
    """keys [n_h, dk]: the token's Householder keys, one row per step (labelled with its beta)."""
    n_h, dk = keys.shape
    lim = float(np.nanmax(np.abs(keys))) or 1.0
    fig = go.Figure(tr.Heatmap(z=keys, x=list(range(dk)), y=[f"k{j} (β={betas[j]:.2f})" for j in range(n_h)],
                               colorscale="RdBu", zmid=0, zmin=-lim, zmax=lim, xgap=1, ygap=2,
                               colorbar=dict(title="k"), hovertemplate="%{y}<br>dk %{x}: %{z:.3f}<extra></extra>"))
    fig.update_xaxes(title_text="key dimension")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, "Householder keys k_{t,j}", max(200, 120 + 40 * n_h))


def channel_rows_heatmap(rows: np.ndarray, labels: Sequence[str], title: str) -> go.Figure:
    """rows [n, dk]: one token's per-key-channel vectors (RWKV-7: kappa, a, w), one labelled row each."""
    n, dk = rows.shape
    lim = float(np.nanmax(np.abs(rows))) or 1.0
    fig = go.Figure(tr.Heatmap(z=rows, x=list(range(dk)), y=list(labels), colorscale="RdBu", zmid=0, zmin=-lim,
                               zmax=lim, xgap=1, ygap=2, colorbar=dict(title="value"),
                               hovertemplate="%{y}<br>channel %{x}: %{z:.4f}<extra></extra>"))
    fig.update_xaxes(title_text="key channel")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, title, max(200, 120 + 40 * n))


def head_channel_heatmap(values: np.ndarray, title: str, colorbar: str, *, zmin: float, zmax: float,
                         colorscale: str, selected_head: int | None = None) -> go.Figure:
    """values [H, channels]: one number per head and key channel (RWKV-7's per-channel betas), the head outlined."""
    H, C = values.shape
    fig = go.Figure(tr.Heatmap(z=values, x=list(range(C)), y=[f"head {h}" for h in range(H)], colorscale=colorscale,
                               zmin=zmin, zmax=zmax, xgap=1, ygap=1, colorbar=dict(title=colorbar),
                               hovertemplate="%{y}, channel %{x}: %{z:.3f}<extra></extra>"))
    if selected_head is not None and 0 <= selected_head < H:
        fig.add_shape(type="rect", x0=-0.5, x1=C - 0.5, y0=selected_head - 0.5, y1=selected_head + 0.5,
                      line=dict(color="black", width=2))
    fig.update_xaxes(title_text="key channel")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, title, max(220, 120 + 24 * H))


def matrix_heatmap(M: np.ndarray, title: str, labels: Sequence[str] | None = None, height: int = 420,
                   axis: str = "dimension") -> go.Figure:
    """A square matrix (transition, Gram) on a diverging scale centred at 0, square cells."""
    lim = max(1.0, float(np.nanmax(np.abs(M))))
    ticks = list(labels) if labels is not None else list(range(M.shape[0]))
    fig = go.Figure(tr.Heatmap(z=M, x=ticks, y=ticks, colorscale="RdBu", zmid=0, zmin=-lim, zmax=lim,
                               colorbar=dict(title="entry"),
                               hovertemplate="row %{y}, column %{x}: %{z:.3f}<extra></extra>"))
    fig.update_xaxes(title_text=axis, constrain="domain", type="category" if labels is not None else None)
    fig.update_yaxes(title_text=axis, autorange="reversed", scaleanchor="x", scaleratio=1, constrain="domain",
                     type="category" if labels is not None else None)
    return _layout(fig, title, height)


def transition_eigenvalues(eig: np.ndarray, eig_A: np.ndarray | None, dk: int, gate: float, title: str,
                           label_A: str | None = None) -> go.Figure:
    """One token's eigenvalues: the n_h non-trivial ones of P_t, the dk - n_h trivial ones at 1, and A_t's
    (`label_A` names them when they are not P_t's times a scalar gate: per-channel decays, RWKV-7)."""
    fig = go.Figure([unit_circle()])
    n_triv = dk - len(eig)
    fig.add_trace(tr.Scatter(x=[1.0], y=[0.0], mode="markers+text", name=f"trivial eigenvalue 1 (× {n_triv})",
                             text=[f"1 (×{n_triv})"], textposition="bottom right",
                             marker=dict(size=10, color="#bbb", symbol="circle-open", line=dict(width=2)),
                             hoverinfo="skip"))
    fig.add_trace(tr.Scatter(x=eig.real, y=eig.imag, mode="markers", name="non-trivial eigenvalues of P_t",
                             marker=dict(size=13, color="#1f77b4", line=dict(width=1, color="white")),
                             hovertemplate="λ = %{x:.4f} %{y:+.4f}i<extra>P_t</extra>"))
    if eig_A is not None and (gate != 1.0 or label_A):
        fig.add_trace(tr.Scatter(x=eig_A.real, y=eig_A.imag, mode="markers", name=label_A or f"A_t = {gate:.3f} · P_t",
                                 marker=dict(size=11, color="#d62728", symbol="x"),
                                 hovertemplate="λ = %{x:.4f} %{y:+.4f}i<extra>A_t</extra>"))
    _complex_axes(fig, max(1.15, float(np.abs(eig).max()) * 1.05 if eig.size else 1.15))
    return _layout(fig, title, 420)
