"""Head: the card of the selected (layer, head) — its numbers (RWKV-7: the strong-removal fraction a > threshold in
place of β > 1), small charts of β, key variance, rotation angles,
effective rank and probe accuracy, the tokens with the highest β — and links to every detailed page."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from deltalab.app.dash import export, figures, headdata, heads, state
from deltalab.app.dash import traces as tr
from deltalab.app.views.text import display_names

LINKS = ("Betas", "Keys", "Spectra", "Effective rank", "Probes", "Text", "Token")


def top_tokens_figure(top: list[tuple[str, float]], bmax: float, title: str) -> go.Figure:
    """Horizontal bars: the input tokens with the highest mean β (over steps) in this head."""
    names = [str(t) for t, _ in top][::-1]
    vals = [b for _, b in top][::-1]
    fig = go.Figure(tr.Bar(x=vals, y=names, orientation="h", marker_color="#440154",
                           hovertemplate="token %{y}: mean β %{x:.3f}<extra></extra>"))
    fig.update_xaxes(title_text="mean β over steps", range=[0, bmax * 1.02])
    fig.update_yaxes(type="category")
    return figures._layout(fig, title, 260)


def small(fig: go.Figure, height: int = 340) -> go.Figure:
    """A card-sized chart: legend below the plot, compact margins."""
    return fig.update_layout(height=height, legend=dict(orientation="h", x=0, y=-0.28, font=dict(size=10)),
                             margin=dict(l=50, r=10, t=50, b=40))


def render(ctx) -> None:
    sel = ctx.sel
    st.title(f"Head {sel.head_name} · layer {sel.layer}")
    df, src, previewed = headdata.table(ctx.path, ctx.ds, display_names(ctx))
    hit = df[(df["layer"] == sel.layer) & (df["head"] == sel.head)] if not df.empty else df
    if hit.empty:
        st.info("No probe results cover this head yet: run `deltalab probe betas --store STORE` (and keys, spectra, "
                "erank, linear), or pick another layer/head in the sidebar.")
        return
    row = hit.iloc[0]
    if previewed:
        st.caption(f"Preview from the first sequences for: {', '.join(previewed)}.")
    st.button("← All heads", on_click=state.go_to, args=("Heads",), key="head_back")
    f = heads.fmt
    m = st.columns(6)
    m[0].metric("mean β", f(row["beta_mean"]), help="per step: " + " / ".join(f"{v:.3f}" for v in row["beta_steps"]))
    removal, removal_label = heads.removal_metric(row)
    m[1].metric(removal_label, f(row[removal]),
                help=None if removal == "frac_beta_gt1" else "RWKV-7: the removal strength a lies in [0, 1] per key "
                "channel (β > 1 never happens); the fraction of this head's channel values above the threshold of "
                "`deltalab probe betas --strong`.")
    m[2].metric("key-subspace dim", f(row["key_dim"], ".0f"), help="Principal components reaching 95% of the "
                                                                   "variance of the keys (all steps jointly).")
    m[3].metric("rotation fraction", f(row["frac_rotation"]),
                help="dominant angles: " + (", ".join(f"{a:.0f}°" for a in row["dominant_angles"]) or "none"))
    m[4].metric("mean effective rank", f(row["erank_mean"]), f"{f(row['erank_trend'], '+.2f')} / 100 tokens",
                delta_color="off")
    m[5].metric("linear-probe accuracy", f(row["probe_accuracy"]))
    li = {p: (None if r is None or sel.layer not in [int(x) for x in r["layer"].values]
              else [int(x) for x in r["layer"].values].index(sel.layer)) for p, r in src.items()}
    c1, c2, c3 = st.columns(3)
    with c1:
        b = src["betas"]
        if b is not None and li["betas"] is not None:
            counts = np.asarray(b["beta_hist"].isel(layer=li["betas"], head=sel.head).values)
            export.chart(small(figures.beta_histogram(np.asarray(b["bin"].values), counts, ctx.beta_max,
                                                     "β distribution")), "card_beta_hist")
        if row["top_tokens"]:
            export.chart(top_tokens_figure(row["top_tokens"], ctx.beta_max, "Tokens with the highest β"),
                         "card_top_tokens")
    with c2:
        s = src["spectra"]
        if s is not None and li["spectra"] is not None:
            hist = np.asarray(s["angle_hist"].isel(layer=li["spectra"], head=sel.head).values)
            export.chart(small(figures.angle_histogram(np.asarray(s["angle_bin"].values), hist,
                                                      "Rotation angle per token")), "card_angles")
        k = src["keys"]
        if k is not None and li["keys"] is not None:
            evr = np.asarray(k["explained_variance_ratio"].isel(layer=li["keys"], head=sel.head).values)
            joint = np.asarray(k["explained_variance_ratio_joint"].isel(layer=li["keys"], head=sel.head).values)
            fig = figures.explained_variance(evr, joint, "Explained variance of the keys", max_components=8)
            export.chart(small(fig, 380), "card_evr")
    with c3:
        e = src["erank"]
        if e is not None and li["erank"] is not None:
            curve = np.asarray(e["erank_by_pos"].isel(layer=li["erank"]).values, np.float64)[:, sel.head: sel.head + 1]
            fig = figures.rank_lines(curve, "effective rank", train_length=ctx.train_length, doc_starts=[],
                                     selected_head=0, selected_pos=None, title="Effective rank over position")
            fig.data[0].name = f"head {sel.head_name}"
            export.chart(small(fig).update_layout(showlegend=False), "card_erank")
        lin = src["linear"]
        if lin is not None and li["linear"] is not None and sel.head_name in [int(h) for h in lin["probe_head"].values]:
            pi = [int(h) for h in lin["probe_head"].values].index(sel.head_name)  # the model's head numbers
            by_pos = np.asarray(lin["accuracy_by_pos"].isel(layer=li["linear"], probe_head=pi).values)
            export.chart(small(figures.accuracy_by_position({f"head {sel.head_name}": by_pos}, ctx.train_length,
                                                            "Linear-probe accuracy over position",
                                                            chance=float(lin["chance"].values[li["linear"], pi]))),
                         "card_probe")
    st.subheader("Open in")
    cols = st.columns(len(LINKS))
    for c, page in zip(cols, LINKS):
        c.button(f"{page} →", on_click=state.go_to, args=(page,), key=f"head_link_{page}", width="stretch")
