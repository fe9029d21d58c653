"""Betas: layer x head heatmaps per Householder step, histograms, and per-input-token betas (DeltaProduct Fig. 7).

beta > 1 gives a Householder factor a negative eigenvalue 1 - beta; beta = 2 is an exact reflection, and
two reflections compose to a rotation (the S4 head of the paper has beta_0 = beta_1 = 2 for every token).
"""

from __future__ import annotations

import numpy as np
import streamlit as st

from deltalab.app.dash import export, figures, state
from deltalab.app.dash.safe import markdown_text

STATS = {"mean β": "beta_mean", "median β": "median", "fraction β > 1 (negative eigenvalue)": "frac_negative"}


def _on_token_click(chart_key: str, path: str, seq: int) -> None:
    """A click on a token in the per-token chart selects its next occurrence in the current sequence."""
    cd = state.clicked(chart_key)
    if cd is None:
        return
    pos = state.first_occurrence(path, seq, int(cd[0]), after=int(st.session_state.get(state.KEYS["pos"], 0)) + 1)
    if pos is not None:
        state.select(pos=pos)


def render(ctx) -> None:
    st.title("Betas")
    res, preview = ctx.result_or_preview("betas", "The heatmaps, histograms and per-token betas come from it.")
    if res is not None and res.attrs.get("per_channel"):
        st.caption("RWKV-7: β is the removal strength a ∈ (0, 1) of every key channel; the transition "
                   "diag(w) − (κ ⊙ a) κᵀ removes a fraction Σ κᵢ² aᵢ of the state along κ. Per head, the statistics "
                   "pool all channels; below, each channel's mean and how often it removes strongly.")
    else:
        st.caption("β ∈ [0, 2] with negative eigenvalues allowed: β > 1 flips the key direction (eigenvalue 1 − β "
                   "< 0), β = 2 is a reflection, and two reflections compose to a rotation.")
    if res is None:
        return
    sel, bmax = ctx.sel, ctx.beta_max
    head = sel.head
    li = ctx.layer_index(res)
    if li is None:
        return
    layers = [int(x) for x in res["layer"].values]

    stat = st.segmented_control("Statistic", list(STATS), default="mean β", key="beta_stat",
                                persist_state="session", bind="query-params", required=True) or "mean β"
    if STATS[stat] == "median":
        q = list(np.asarray(res["quantile"].values))
        values = np.asarray(res["beta_quantile"].isel(quantile=q.index(0.5) if 0.5 in q else 2).values)
    else:
        values = np.asarray(res[STATS[stat]].values)
    export.chart(figures.beta_step_heatmaps(values, layers, bmax, stat, highlight=(li, head)), key="beta_heat",
                 **state.cell_clicks("beta_heat"))
    refl = np.asarray(res["reflection"].values) if "reflection" in res else None
    if refl is not None and refl.any():
        heads = [f"layer {layers[i]} head {h}" for i, h in zip(*np.nonzero(refl))]
        threshold = markdown_text(res.attrs.get("reflection_threshold", 1.8))
        st.success(f"**Reflection heads** (mean β of every step > {threshold}): " + ", ".join(heads))

    c1, c2 = st.columns(2)
    with c1:
        counts = np.asarray(res["beta_hist"].isel(layer=li, head=head).values)  # [step, bin]
        export.chart(figures.beta_histogram(np.asarray(res["bin"].values), counts, bmax,
                                            f"β distribution, layer {sel.layer} head {head}"), key="beta_hist")
    with c2:
        frac = np.asarray(res["frac_negative_head"].values)
        export.chart(figures.layer_head_heatmap(
            frac, layers, "Fraction of sub-steps with β > 1, per head", "fraction β > 1", zmin=0, zmax=1,
            colorscale="Reds", highlight=(li, head)), key="beta_neg",
                 **state.cell_clicks("beta_neg"))

    if "beta_channel_mean" in res:
        _per_channel(res, li, head, sel.layer)
    tokens = np.asarray(res["token"].values).astype(np.int64)
    if tokens.size == 0 or "beta_token_mean" not in res:
        st.info("No per-token betas (the store has no `tokens`).")
        return
    st.subheader("β per input token")
    st.caption("Each point is one input token (for a group task: one group element), at its mean β over all "
               "occurrences, with ± 1 std bars. Click a token to jump to its next occurrence in the current sequence.")
    means = np.asarray(res["beta_token_mean"].isel(layer=li, head=head).values)  # [tok, step]
    stds = np.asarray(res["beta_token_std"].isel(layer=li, head=head).values)
    labels = ctx.token_labels(tokens)
    title = f"Mean β per input token, layer {sel.layer} head {head}"
    if ctx.n_h >= 2:
        cx, cy = st.columns(2)
        sx = cx.selectbox("x axis step", list(range(ctx.n_h)), index=0, key="beta_sx",
                          persist_state="session", bind="query-params")
        sy = cy.selectbox("y axis step", list(range(ctx.n_h)), index=1, key="beta_sy",
                          persist_state="session", bind="query-params")
        fig = figures.beta_token_scatter(means, stds, tokens, labels, bmax, sx, sy, sel.token, title)
    else:
        fig = figures.beta_token_strip(means, stds, tokens, labels, bmax, sel.token, title)
    export.chart(fig, key="beta_tok", on_select=lambda: _on_token_click("beta_tok", str(ctx.path), sel.seq),
                 selection_mode="points")
    all_means = np.asarray(res["beta_token_mean"].isel(layer=li).values)  # [tok, step, head]
    export.chart(figures.beta_token_grid(all_means, tokens, labels, bmax, sel.token, head), key="beta_grid")
    if preview:
        st.caption("Preview only: per-token statistics cover the first sequences.")
    st.button("Drill down: this token's transition matrix →", on_click=state.go_to, args=("Token",), key="drill_betas")


def _per_channel(res, li: int, head: int, layer: int) -> None:
    """RWKV-7: mean a and the fraction of tokens with a above the threshold, per head and key channel."""
    strong = float(res.attrs.get("strong_threshold", 0.9))
    st.subheader("Removal strength a per key channel")
    mean = np.asarray(res["beta_channel_mean"].isel(layer=li).values)  # [H, dk]
    frac = np.asarray(res["frac_strong_channel"].isel(layer=li).values)
    c1, c2 = st.columns(2)
    with c1:
        export.chart(figures.head_channel_heatmap(mean, f"Mean a per head and key channel, layer {layer}", "mean a",
                                                  zmin=0, zmax=1, colorscale="Viridis", selected_head=head),
                     key="beta_channels")
    with c2:
        export.chart(figures.head_channel_heatmap(frac, f"Fraction of tokens with a > {strong:g}, layer {layer}",
                                                  f"fraction a > {strong:g}", zmin=0, zmax=1, colorscale="Reds",
                                                  selected_head=head), key="beta_channels_strong")
    head_frac = float(np.asarray(res["frac_strong"].isel(layer=li, step=0, head=head).values))
    st.caption(f"Head {head}: {head_frac:.0%} of its channel values exceed {strong:g} "
               "(`deltalab probe betas --strong`).")
