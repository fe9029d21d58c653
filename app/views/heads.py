"""Heads: a gallery of every (layer, head) as a card — mean β and fraction above 1 (RWKV-7: the fraction of removal
strengths a above the betas probe's --strong threshold), key-subspace dimension, rotation fraction and dominant
angles, effective rank and its trend, linear-probe accuracy, the tokens with the highest β, and sparklines — sortable
by any of these; each card opens the head's own page. A table view sorts the same."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import streamlit as st

from deltalab.app.dash import headdata, heads, loading, state
from deltalab.app.views.text import display_names

PER_PAGE = 12
COLUMNS = 4


def _badges(row: pd.Series, beta_max: float) -> list[str]:
    out = []
    steps = [v for v in row["beta_steps"] if np.isfinite(v)]
    if steps and beta_max >= 2 and min(steps) > 1.8:
        out.append(("reflections", "#d62728"))
    if np.isfinite(row["frac_rotation"]) and row["frac_rotation"] >= 0.9:
        out.append(("rotation", "#7b4173"))
    if np.isfinite(row["key_dim"]) and row["key_dim"] <= 3:
        out.append((f"{int(row['key_dim'])}-D keys", "#31a354"))
    return [f'<span style="background:{c};color:white;border-radius:8px;padding:0 6px;font-size:0.75em;'
            f'margin-right:4px;white-space:nowrap">{html.escape(t)}</span>' for t, c in out]


def card_html(row: pd.Series, beta_max: float, selected: bool = False) -> str:
    """The body of one head card: title, badges, numbers and three sparklines."""
    f = heads.fmt
    angles = ", ".join(f"{a:.0f}°" for a in row["dominant_angles"]) or "—"
    tokens = ", ".join(f"{html.escape(str(t))} ({b:.2f})" for t, b in row["top_tokens"][:3]) or "—"
    steps = " / ".join(f"{v:.2f}" for v in row["beta_steps"]) or "—"
    trend = row["erank_trend"]
    arrow = "" if not np.isfinite(trend) else ("↗" if trend > 0.05 else "↘" if trend < -0.05 else "→")
    removal, removal_label = heads.removal_metric(row, short=True)
    lines = [
        ("mean β", f"{f(row['beta_mean'])} <span style='color:#888'>({steps})</span>"),
        (html.escape(removal_label), f(row[removal])),
        ("key dim", f(row["key_dim"], ".0f")),
        ("rotation", f"{f(row['frac_rotation'])} <span style='color:#888'>at {angles}</span>"),
        ("eff. rank", f"{f(row['erank_mean'])} {arrow} <span style='color:#888'>{f(trend, '+.2f')}/100</span>"),
        ("probe acc.", f(row["probe_accuracy"])),
        ("top β", tokens),
    ]
    table = "".join(f'<tr><td style="color:#666;padding:0 6px 0 0;white-space:nowrap;border:none">{k}</td>'
                    f'<td style="border:none">{v}</td></tr>' for k, v in lines)
    sparks = [heads.sparkline(row["beta_hist"], kind="bars", color="#440154", title="β histogram (0..β max)"),
              heads.sparkline(row["angle_hist"], kind="bars", color="#7b4173", title="rotation angles 0..180°"),
              heads.sparkline(row["erank_curve"], color="#e6550d", lo=0, title="effective rank over position")]
    spark_row = "".join(f'<div style="flex:1;min-width:0;text-align:center;font-size:0.7em;color:#666">{s}<br>{c}</div>'
                        for s, c in zip(sparks, ("β", "angle", "eff. rank")) if s)
    border = "border-left:4px solid #d62728;padding-left:6px;" if selected else ""
    number = int(row.get("head_id", row["head"]))  # the model's head number (capture --heads)
    return (f'<div style="{border}font-size:0.85em" data-head="{int(row["layer"])}-{int(row["head"])}">'
            f'<div style="font-weight:600;font-size:1.1em;white-space:nowrap">'
            f'Layer {int(row["layer"])} · head {number}</div>'
            f'<div style="min-height:1.2em">{"".join(_badges(row, beta_max))}</div>'
            f'<table style="border:none;margin:4px 0">{table}</table>'
            f'<div style="display:flex;gap:4px">{spark_row}</div></div>')


def _open_from_table(key: str, order: list[tuple[int, int]]) -> None:
    try:
        rows = st.session_state[key]["selection"]["rows"]
    except (KeyError, TypeError):
        return
    if rows:
        layer, head = order[int(rows[0])]
        state.go_to("Head", layer=layer, head=head)


def render(ctx) -> None:
    st.title("Heads")
    st.caption("Every head of the store at a glance, from the probe results. Sort by any number; **Open** shows the "
               "head's card with its charts and links to the detailed pages.")
    df, src, previewed = headdata.table(ctx.path, ctx.ds, display_names(ctx))
    if df.empty:
        st.info("No probe results and no keys/betas to preview: run `deltalab probe betas --store STORE` "
                "(and keys, spectra, erank, linear).")
        return
    if previewed:
        st.caption(f"Preview from the first sequences for: {', '.join(previewed)} (no stored results yet).")
    skipped = headdata.skipped_previews(ctx.path, ctx.ds)
    if skipped:
        st.info(f"**{len(ctx.layers)} layers x {ctx.ds.sizes['head']} heads: no preview of "
                f"{', '.join(skipped)} for every head** (minutes on a CPU). Their columns fill in once the probes "
                "have run: " + "; ".join(f"`{loading.probe_command(p, ctx.path)}`" for p in skipped) + ".")
    missing = [p for p, r in src.items() if r is None]
    if missing and loading.in_memory(ctx.path):
        st.caption(f"Not available for your own input: {', '.join(missing)} (it needs many labelled sequences).")
    elif missing:
        st.caption(f"Not available: {', '.join(missing)} — run `deltalab probe NAME --store {ctx.path}`.")
    labels = {v: k for k, v in heads.metrics(df).items()}
    c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
    metric_label = c1.selectbox("Sort by", list(labels), key="heads_sort", bind="query-params")
    metric = labels[metric_label]
    descending = c2.toggle("Highest first", value=True, key="heads_desc", bind="query-params")
    view = c3.segmented_control("View", ["cards", "table"], default="cards", key="heads_view",
                                bind="query-params", required=True) or "cards"
    ordered = heads.sort_heads(df, metric, descending).reset_index(drop=True)
    n_pages = max(1, int(np.ceil(len(ordered) / PER_PAGE)))
    page = c4.number_input("Page", 1, n_pages, 1, key="heads_page", help=f"{len(ordered)} heads, {PER_PAGE} a page")
    if view == "table":
        _table(ordered, ctx)
        return
    shown = ordered.iloc[(int(page) - 1) * PER_PAGE: int(page) * PER_PAGE]
    cols = st.columns(COLUMNS)
    for i, (_, row) in enumerate(shown.iterrows()):
        layer, head = int(row["layer"]), int(row["head"])
        with cols[i % COLUMNS].container(border=True):
            st.html(card_html(row, ctx.beta_max, selected=(layer, head) == (ctx.sel.layer, ctx.sel.head)))
            st.button("Open card →", key=f"open_{layer}_{head}", on_click=state.go_to, args=("Head",),
                      kwargs={"layer": layer, "head": head}, width="stretch")


def _table(ordered: pd.DataFrame, ctx) -> None:
    """All heads in one sortable table (click a header to sort; select a row to open its card)."""
    metrics = heads.metrics(ordered)
    removal, _ = heads.removal_metric(ordered)
    show = ordered[["layer", "head", *metrics, "erank_curve", "angle_hist"]].copy()
    show["dominant angles"] = [", ".join(f"{a:.0f}°" for a in v) for v in ordered["dominant_angles"]]
    show["highest β tokens"] = [", ".join(str(t) for t, _ in v[:3]) for v in ordered["top_tokens"]]
    cc = st.column_config
    config = {m: cc.NumberColumn(label, format="%.3f") for m, label in metrics.items()}
    config.update({
        removal: cc.ProgressColumn(metrics[removal], min_value=0.0, max_value=1.0, format="%.2f"),
        "frac_rotation": cc.ProgressColumn(heads.METRICS["frac_rotation"], min_value=0.0, max_value=1.0, format="%.2f"),
        "probe_accuracy": cc.ProgressColumn(heads.METRICS["probe_accuracy"], min_value=0.0, max_value=1.0,
                                            format="%.2f"),
        "key_dim": cc.NumberColumn(heads.METRICS["key_dim"], format="%d"),
        "erank_curve": cc.LineChartColumn("effective rank over position", y_min=0),
        "angle_hist": cc.BarChartColumn("rotation angles 0..180°", y_min=0),
    })
    order = [(int(a), int(b)) for a, b in zip(ordered["layer"], ordered["head"])]
    st.dataframe(show, hide_index=True, column_config=config, key="heads_table", on_select=lambda: _open_from_table(
        "heads_table", order), selection_mode="single-row", height=min(36 * (len(show) + 1) + 3, 720))
    st.caption("Select a row to open that head's card.")
