"""Effective rank of the state over time: per-head lines over position (document boundaries and the training
length marked), and a layer x head heatmap of the summary. Two measures, named for what they are:
entropy effective rank exp(H(σ/Σσ)) (DeltaProduct paper) and stable rank ||H||_F² / ||H||_2² (or rank
utilisation = stable rank / min(dk, dv), state-reduction paper).
"""

from __future__ import annotations

import numpy as np
import streamlit as st

from deltalab.app.dash import export, figures, loading, state

METRICS = {
    "entropy effective rank": ("erank", "erank_by_pos", "erank_mean"),
    "stable rank": ("stable_rank", "stable_rank_by_pos", "stable_rank_mean"),
    "rank utilisation": ("rank_utilisation", "rank_utilisation_by_pos", "rank_utilisation_mean"),
}
REGIONS = {"all positions": "mean", "within the training length": "within_train",
           "beyond the training length": "beyond_train"}


@st.cache_data(show_spinner=False, max_entries=64)
def _one_sequence(path: str, stamp: float, result: str | None, n_preview: tuple[int, int | None], var: str, seq: int,
                  li: int) -> np.ndarray:
    res = loading.source(path, stamp, "erank", result, n_preview)
    return np.asarray(res[var].isel(seq=seq, layer=li).values, dtype=np.float64)  # [T, H]


@st.cache_data(show_spinner=False, max_entries=64)
def _doc_starts(path: str, stamp: float, seq: int | None) -> list[int]:
    """Document starts of one sequence, or positions where most sequences start a document (seq None)."""
    ds = loading._open(path, stamp)
    if "doc_start" not in ds:
        return []
    if seq is not None:
        return [int(p) for p in np.flatnonzero(np.asarray(ds["doc_start"].isel(seq=seq).values)) if p > 0]
    n = min(ds.sizes["seq"], 64)
    frac = np.asarray(ds["doc_start"].isel(seq=slice(0, n)).values, dtype=np.float64).mean(0)
    return [int(p) for p in np.flatnonzero(frac >= 0.5) if p > 0]


def _on_click(chart_key: str) -> None:
    """A click on a line selects that head and position."""
    cd = state.clicked(chart_key)
    if cd is not None and len(cd) >= 2:
        state.select(pos=int(cd[0]), head=int(cd[1]))


def render(ctx) -> None:
    st.title("Effective rank of the state")
    st.caption("How many directions the state H_t ∈ R^{dk×dv} uses, token by token (rebuilt from the chunk-start "
               "states, never stored per token).")
    res, preview = ctx.result_or_preview("erank", "The per-token ranks and their summaries come from it.")
    if res is None:
        return
    sel = ctx.sel
    li = ctx.layer_index(res)
    if li is None:
        return
    layers = [int(x) for x in res["layer"].values]
    c1, c2 = st.columns(2)
    metric = c1.radio("Measure", list(METRICS), horizontal=True, key="rank_metric",
                      persist_state="session", bind="query-params",
                      help="entropy effective rank = exp(−Σ p log p), p = σ/Σσ; stable rank = ‖H‖_F²/‖H‖₂²; "
                           "rank utilisation = stable rank / min(dk, dv).")
    mode = c2.radio("Lines", ["mean over sequences", "selected sequence"], horizontal=True, key="rank_mode",
                    persist_state="session", bind="query-params")
    per_token, by_pos, summary = METRICS[metric]
    n_seq = int(res.sizes.get("seq", 0))
    stamp = loading._stamp(ctx.path)
    if mode == "selected sequence" and per_token in res and sel.seq < n_seq:
        values = _one_sequence(str(ctx.path), stamp, None if preview else ctx.chosen.get("erank"),
                               loading.preview_key(ctx.ds, "erank", sel.layer), per_token, sel.seq, li)
        docs = _doc_starts(str(ctx.path), stamp, sel.seq)
        what = f"sequence {sel.seq}"
    else:
        if mode == "selected sequence":
            st.caption(f"Sequence {sel.seq} is not in these results: showing the mean.")
        values = np.asarray(res[by_pos].isel(layer=li).values, dtype=np.float64)  # [T, H]
        docs = _doc_starts(str(ctx.path), stamp, None)
        what = f"mean over {n_seq or '?'} sequences"
    dmin = min(int(res.attrs.get("dk", ctx.ds.sizes.get("dk", 0))), int(res.attrs.get("dv", ctx.ds.sizes.get("dv", 0))))
    fig = figures.rank_lines(values, metric, train_length=ctx.train_length, doc_starts=docs,
                             selected_head=sel.head, selected_pos=sel.pos,
                             title=f"{metric.capitalize()} over position, layer {sel.layer} ({what}; max {dmin})")
    export.chart(fig, key="rank_lines", on_select=lambda: _on_click("rank_lines"), selection_mode="points")
    st.caption("Click a line to select that head and position. Green dotted: document starts; red: the training "
               "length (the shaded part was never seen in training).")

    region = st.radio("Summary over", list(REGIONS), horizontal=True, key="rank_region",
                      persist_state="session", bind="query-params")
    base = per_token if per_token != "rank_utilisation" else "rank_utilisation"
    name = f"{base}_{REGIONS[region]}"
    if name not in res:
        name = summary
        if region != "all positions":
            st.caption(f"No {region} summary of {metric} in these results; showing all positions.")
    z = np.asarray(res[name].values, dtype=np.float64)
    zmax = 1.0 if per_token == "rank_utilisation" else float(dmin or np.nanmax(z))
    export.chart(figures.layer_head_heatmap(z, layers, f"{metric.capitalize()} per layer and head ({region})",
                                            metric, zmin=0, zmax=zmax, colorscale="Cividis",
                                            highlight=(li, sel.head)), key="rank_heat",
                 **state.cell_clicks("rank_heat"))
    if "erank_drop_at_doc_start" in res and int(res.attrs.get("n_doc_starts", 0)) > 0:
        export.chart(figures.layer_head_heatmap(
            np.asarray(res["erank_drop_at_doc_start"].values), layers,
            "Drop of the entropy effective rank at document starts (erank(t−1) − erank(t))", "drop",
            colorscale="RdBu", highlight=(li, sel.head)), key="rank_drop",
                 **state.cell_clicks("rank_drop"))
