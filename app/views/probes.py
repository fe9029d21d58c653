"""Probes: linear probes (what the read-out encodes), length generalisation (accuracy against position) and
intervention results (what changes when a beta is set, a head ablated or keys projected)."""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import streamlit as st
import xarray as xr

from deltalab.app.dash import export, figures, loading


def render(ctx) -> None:
    st.title("Probes")
    tabs = st.tabs(["Linear probes", "Length generalisation", "Interventions", "Decays"], key="probe_tab",
                   bind="query-params")
    with tabs[0]:
        _linear(ctx)
    with tabs[1]:
        _lengthgen(ctx)
    with tabs[2]:
        _intervene(ctx)
    with tabs[3]:
        _decays(ctx)


def _decays(ctx) -> None:
    st.caption("How long each key channel remembers: memory length 1 / (1 - exp g) in tokens, from the forget "
               "gate (one channel per head for Gated DeltaNet, one per key channel for Kimi Delta Attention). "
               "Long-memory channels carry information over long spans.")
    if "g" not in ctx.ds:
        st.info("This store has no forget gate `g` (the model has none, or it was not captured).")
        return
    res = ctx.result("decays")
    if res is None:
        loading.missing_results("decays", ctx.path, "The memory lengths per channel come from it.")
        return
    import plotly.graph_objects as go

    from deltalab.app.dash import traces as tr

    layers = [int(x) for x in res["layer"].values]
    li = layers.index(ctx.sel.layer) if ctx.sel.layer in layers else 0
    mem = np.asarray(res["memory_of_mean_decay"].isel(layer=li).values, dtype=np.float64)  # [head, channel]
    logm = np.log10(np.clip(mem, 1.0, 10.0 ** 6))
    heat = go.Figure(tr.Heatmap(z=logm, x=np.arange(mem.shape[1]), y=np.arange(mem.shape[0]), colorscale="Viridis",
                                colorbar={"title": "log10 tokens"},
                                customdata=mem, hovertemplate="head %{y}, channel %{x}: %{customdata:.1f} tokens"
                                                              "<extra></extra>"))
    heat.update_layout(title=f"Memory length of the mean decay, layer {layers[li]} (head x key channel)",
                       xaxis_title="key channel", yaxis_title="head", height=320)
    export.chart(heat, key="decay_heat", data=res["memory_of_mean_decay"].isel(layer=li).to_dataframe().reset_index())
    h = ctx.sel.head if 0 <= ctx.sel.head < mem.shape[0] else 0
    order = np.argsort(-mem[h])
    bars = go.Figure(tr.Bar(x=[str(c) for c in order], y=mem[h][order],
                            hovertemplate="channel %{x}: %{y:.1f} tokens<extra></extra>"))
    bars.update_layout(title=f"Channels of head {h} by memory length", xaxis_title="key channel",
                       yaxis_title="tokens (1 / (1 - mean decay))", yaxis_type="log", height=300)
    export.chart(bars, key="decay_bars")


def _linear(ctx) -> None:
    st.caption("Logistic regression from each head's read-out (or a stored variable) to the labels, trained and "
               "tested on disjoint sequences. High accuracy = the label is linearly decodable at that layer/head.")
    res = ctx.result("linear")
    if res is None:
        loading.missing_results("linear", ctx.path, "The probe accuracies come from it.")
        return
    sel = ctx.sel
    layers = [int(x) for x in res["layer"].values]
    heads = [int(h) for h in res["probe_head"].values]
    acc, chance = np.asarray(res["accuracy"].values), np.asarray(res["chance"].values)
    li = layers.index(sel.layer) if sel.layer in layers else 0
    col = heads.index(sel.head_name) if sel.head_name in heads else None  # probe_head: the model's numbers
    export.chart(figures.probe_accuracy_heatmap(
        acc, chance, layers, heads, (li, col) if col is not None else None,
        f"Test accuracy of linear probes on {html.escape(str(res.attrs.get('features', '?')))[:200]} "
        f"({html.escape(str(res.attrs.get('n_classes', '?')))[:20]} classes)"), key="lin_heat")
    by_pos = np.asarray(res["accuracy_by_pos"].isel(layer=li).values)  # [probe_head, pos]
    series = {"all heads": by_pos[heads.index(-1)]} if -1 in heads else {}
    if col is not None:
        series[f"head {sel.head_name}"] = by_pos[col]
    window = max(1, by_pos.shape[-1] // 64)
    smooth = {k: _smooth(v, window) for k, v in series.items()}
    export.chart(figures.accuracy_by_position(
        smooth, ctx.train_length, f"Probe test accuracy over position, layer {sel.layer}"
        + (f" (moving mean over {window} positions)" if window > 1 else ""),
        chance=float(np.nanmean(chance[li])), selected_pos=sel.pos), key="lin_pos")


def _smooth(x: np.ndarray, w: int) -> np.ndarray:
    if w <= 1:
        return x
    ok = np.isfinite(x)
    num = np.convolve(np.where(ok, x, 0), np.ones(w), "same")
    den = np.convolve(ok.astype(float), np.ones(w), "same")
    return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def _lengthgen(ctx) -> None:
    st.caption("Token accuracy and sequence accuracy (all labelled tokens right up to p) against position, within "
               "and beyond the training length.")
    res = ctx.result("lengthgen")
    if res is None:
        loading.missing_results("lengthgen", ctx.path, "The accuracy-against-position curves come from it.")
        return
    a = res.attrs
    tl = a.get("train_length")
    tl = int(tl) if isinstance(tl, int) and tl > 0 else ctx.train_length
    c = st.columns(3)
    c[0].metric("Accuracy within training length", _pct(a.get("accuracy_within_train")))
    c[1].metric("Accuracy beyond training length", _pct(a.get("accuracy_beyond_train")))
    fail = a.get("first_failure_pos", -1)
    c[2].metric(f"First position below {a.get('threshold', 0.9):.0%}", "never" if fail in (-1, None) else str(fail))
    series = {"token accuracy": np.asarray(res["accuracy"].values),
              "sequence accuracy (prefix)": np.asarray(res["sequence_accuracy"].values)}
    loss = np.asarray(res["loss"].values) if "loss" in res else None
    export.chart(figures.accuracy_by_position(series, tl, "Accuracy against position", loss=loss,
                                              selected_pos=ctx.sel.pos), key="lg_curve")
    if tl is None:
        st.caption("The store records no training length: pass `--train-length` to `deltalab probe lengthgen`.")


def _pct(v: Any) -> str:
    return "—" if v is None or not np.isfinite(v) else f"{float(v):.1%}"


def _intervene(ctx) -> None:
    st.caption("nnsight interventions on the model (set a beta, ablate a head, project keys), one at a time, and the "
               "change in token accuracy and loss against the unmodified model on the same sequences.")
    res = ctx.result("intervene")
    if res is None:
        loading.missing_results("intervene", ctx.path, "It needs the checkpoint the store was captured from.",
                                ctx.checkpoint)
        return
    records = list(res.attrs.get("records") or [])
    if all(v in res for v in ("delta_accuracy", "kind", "layer", "head", "step")):
        _intervention_views(ctx, res)
    elif not _intervention_chart(res, records):
        st.info("These intervention results hold no numeric summary.")
    if records:
        with st.expander(f"All {len(records)} records"):
            st.dataframe(records, hide_index=True)


def _intervention_views(ctx, res: xr.Dataset) -> None:
    """Baseline metrics, a layer x head(·step) heatmap of the accuracy change per kind, and accuracy by position."""
    kinds = {int(v): k for k, v in (res.attrs.get("kinds") or {}).items()}
    kind = np.asarray(res["kind"].values)
    layer, head, step = (np.asarray(res[c].values).astype(int) for c in ("layer", "head", "step"))
    d_acc, d_loss = np.asarray(res["delta_accuracy"].values), np.asarray(res["delta_loss"].values)
    labels = list(res.attrs.get("labels") or [str(i) for i in range(len(kind))])
    base = int(np.flatnonzero(kind == 0)[0]) if (kind == 0).any() else None
    c = st.columns(3)
    if base is not None:
        c[0].metric("Baseline accuracy", _pct(float(res["accuracy"].values[base])))
        c[1].metric("Baseline loss", f"{float(res['loss'].values[base]):.3f}")
    worst = int(np.nanargmin(d_acc)) if np.isfinite(d_acc).any() else None
    if worst is not None:
        c[2].metric("Largest accuracy drop", labels[worst], f"{d_acc[worst]:+.1%}")
    layers = sorted({int(x) for x in layer[kind != 0]})
    lim = max(1e-6, float(np.nanmax(np.abs(d_acc)))) if np.isfinite(d_acc).any() else 1.0
    for k, name in sorted((k, v) for k, v in kinds.items() if k != 0):
        m = kind == k
        if not m.any():
            continue
        steps = sorted({int(s) for s in step[m]})
        heads = sorted({int(h) for h in head[m]})
        col_keys = [(h, s) for h in heads for s in steps]
        grid = np.full((len(layers), len(col_keys)), np.nan)
        for i in np.flatnonzero(m):
            grid[layers.index(int(layer[i])), col_keys.index((int(head[i]), int(step[i])))] = d_acc[i]
        names = [("all heads" if h < 0 else f"h{h}") + ("" if s < 0 or len(steps) == 1 else f"·s{s}")
                 for h, s in col_keys]
        fig = figures.layer_head_heatmap(grid, layers, f"{name.replace('_', ' ')}: Δ accuracy", "Δ accuracy",
                                         zmin=-lim, zmax=lim, zmid=0.0, colorscale="RdBu", col_labels=names,
                                         fmt="+.1%")
        fig.update_traces(colorbar=dict(tickformat="+.1%"))
        fig.update_xaxes(title_text="head · step" if len(steps) > 1 else "head")
        export.chart(fig, key=f"int_heat_{name}")
    options = [i for i in range(len(labels)) if i != base]
    if not options or "accuracy_by_pos" not in res:
        return
    default = options.index(worst) if worst in options else 0
    pick = st.selectbox("Accuracy over position for", options, index=default, format_func=lambda i: labels[i],
                        key="int_pick")
    by_pos = np.asarray(res["accuracy_by_pos"].values)
    window = max(1, by_pos.shape[-1] // 64)
    series = {}
    if base is not None:
        series["baseline"] = _smooth(by_pos[base], window)
    series[labels[pick]] = _smooth(by_pos[pick], window)
    export.chart(figures.accuracy_by_position(series, ctx.train_length,
                                              f"Token accuracy over position: baseline vs {labels[pick]} "
                                              f"(Δ loss {d_loss[pick]:+.3f})", selected_pos=ctx.sel.pos),
                 key="int_pos")


def _intervention_chart(res: xr.Dataset, records: list[dict[str, Any]]) -> bool:
    """A bar chart of the change in accuracy/loss per intervention, from the records (whatever their keys)."""
    import plotly.graph_objects as go

    from deltalab.app.dash import traces as tr

    metric = next((k for k in ("delta_accuracy", "accuracy_change", "delta_loss", "loss_change", "accuracy", "loss")
                   if records and all(isinstance(r.get(k), (int, float)) for r in records)), None)
    if metric is None:
        for name, da in res.data_vars.items():  # any 1-D or 2-D numeric summary
            if da.ndim in (1, 2) and np.issubdtype(da.dtype, np.number) and da.size <= 4096:
                z = np.asarray(da.values, dtype=np.float64)
                fig = go.Figure(tr.Heatmap(z=z[None] if z.ndim == 1 else z, colorscale="RdBu", zmid=0,
                                           colorbar=dict(title=str(name))))
                fig.update_xaxes(title_text=str(da.dims[-1]))
                fig.update_yaxes(title_text=str(da.dims[0]) if da.ndim == 2 else "")
                export.chart(figures._layout(fig, f"{name}", 360), key=f"int_{name}")
                return True
        return False
    label_keys = [k for k in records[0] if k not in (metric,) and not isinstance(records[0][k], (list, dict))][:4]
    labels = [", ".join(f"{k}={r.get(k)}" for k in label_keys if r.get(k) is not None) for r in records]
    values = [float(r[metric]) for r in records]
    fig = go.Figure(tr.Bar(x=values, y=labels, orientation="h",
                           marker_color=["crimson" if v < 0 else "#4c78a8" for v in values],
                           hovertemplate="%{y}<br>" + metric + " = %{x:.4f}<extra></extra>"))
    fig.update_xaxes(title_text=metric)
    fig.update_yaxes(autorange="reversed")
    export.chart(figures._layout(fig, f"Interventions: {metric}", max(300, 80 + 24 * len(records))), key="int_bar")
    return True
