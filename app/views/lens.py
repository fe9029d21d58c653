"""Lens: the logit lens of one sequence as a layer x position grid.

Each cell is the residual after that layer read through the model's final norm and unembedding: its text is the
lens' top token, its colour the probability of the target (the actual next token, or the token `--target`
chose), the hover its rank. A click selects the position and shows that cell's top-k list. Results come from
`deltalab probe lens --store STORE --checkpoint CKPT` (results/lens).
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from deltalab.app.dash import export, state

COLOURS = {"target probability": "target_prob", "top-token probability": "top_prob"}
CELL_KEY = "lens_cell"
"""session_state: the (layer index, position) whose top-k list is shown."""


def lens_grid(values: np.ndarray, top_names: list[list[str]], ranks: np.ndarray, layers: list[int],
              positions: np.ndarray, tokens: list[str], targets: list[str], colour: str,
              selected: tuple[int, int] | None) -> go.Figure:
    """Heatmap [layer, pos] of `values` (probabilities) with the top token written in each cell."""
    L, T = values.shape
    custom = np.stack([np.broadcast_to(positions[None, :], (L, T)), np.broadcast_to(np.arange(L)[:, None], (L, T)),
                       ranks], -1)
    hover = [[f"layer {layers[i]}, pos {positions[t]} ({tokens[t]} → {targets[t]})<br>top: {top_names[i][t]}"
              for t in range(T)] for i in range(L)]
    fig = go.Figure(go.Heatmap(
        z=values, x=[str(p) for p in positions], y=[str(x) if x >= 0 else "embed" for x in layers],
        text=top_names, texttemplate="%{text}", textfont={"size": 10}, customdata=custom, hovertext=hover,
        hovertemplate="%{hovertext}<br>" + colour + ": %{z:.3f}<br>target rank: %{customdata[2]}<extra></extra>",
        colorscale="Viridis", zmin=0, zmax=1, colorbar={"title": colour}))
    fig.update_layout(title="Logit lens: top token per layer and position, coloured by " + colour,
                      xaxis_title="position (token → next)", yaxis_title="layer", height=120 + 34 * L,
                      margin=dict(l=60, r=20, t=50, b=40))
    fig.update_xaxes(tickvals=[str(p) for p in positions], ticktext=[f"{p}<br>{tokens[t]}" for t, p in
                                                                       enumerate(positions)], type="category")
    fig.update_yaxes(type="category")
    if selected is not None:
        i, t = selected
        fig.add_shape(type="rect", x0=t - 0.5, x1=t + 0.5, y0=i - 0.5, y1=i + 0.5, line=dict(color="red", width=3))
    return fig


def _on_click() -> None:
    cd = state.clicked("lens_grid")
    if cd is not None and len(cd) >= 2:
        st.session_state[CELL_KEY] = (int(cd[1]), int(cd[0]))
        state.select(pos=int(cd[0]))


def render(ctx) -> None:
    st.title("Lens")
    st.caption("The residual stream after every layer read through the model's final norm and unembedding "
               "(the logit lens): where in depth the next token becomes predictable.")
    res = ctx.result("lens")
    if res is None:
        ckpt = ctx.checkpoint or "CHECKPOINT"
        st.info(f"**No `lens` results in this store yet.** The grid comes from them. Run:\n\n"
                f"```\ndeltalab probe lens --store {ctx.path} --checkpoint {ckpt}\n```\n"
                "(add `--run` when the store has no `resid_post`), then press **Reload** in the sidebar.")
        return
    sel = ctx.sel
    seq = min(sel.seq, res.sizes["seq"] - 1)
    T = res.sizes["pos"]
    width = 48
    start = max(0, min(sel.pos - width // 2, T - width))
    window = slice(start, min(T, start + width))
    colour = st.segmented_control("Colour", list(COLOURS), default="target probability", key="lens_colour",
                                  persist_state="session", required=True) or "target probability"
    one = res.isel(seq=seq, pos=window)
    layers = [int(x) for x in one["layer"].values]
    positions = np.asarray(one["pos"].values)
    top = np.asarray(one["top_token"].values)  # [L, T, k]
    values = np.asarray(one[COLOURS[colour]].values, dtype=np.float64)
    if values.ndim == 3:
        values = values[..., 0]
    tokens = [ctx.token_name(t) for t in np.asarray(one["tokens"].values)] if "tokens" in one else \
        [str(p) for p in positions]
    targets = [ctx.token_name(t) if t >= 0 else "·" for t in np.asarray(one["target"].values)]
    names = [[ctx.token_name(t) for t in row] for row in top[..., 0]]
    ranks = np.asarray(one["target_rank"].values)
    cell = st.session_state.get(CELL_KEY)
    if cell is None or not (0 <= cell[0] < len(layers)) or not (positions[0] <= cell[1] <= positions[-1]):
        cell = (len(layers) - 1, int(sel.pos) if positions[0] <= sel.pos <= positions[-1] else int(positions[0]))
    selected = (cell[0], int(cell[1] - positions[0]))
    fig = lens_grid(values, names, ranks, layers, positions, tokens, targets, colour, selected)
    table = export.table(layer=np.repeat(layers, len(positions)), pos=np.tile(positions, len(layers)),
                         top_token=top[..., 0].ravel(), value=values.ravel(), target_rank=ranks.ravel())
    export.chart(fig, key="lens_grid", data=table, on_select=_on_click, selection_mode="points")
    st.caption(f"Sequence {seq}, positions {positions[0]}–{positions[-1]} of {T} (around the selected position). "
               "Click a cell for its top tokens.")
    li, pos = cell
    t = int(pos - positions[0])
    layer_name = "embeddings" if layers[li] < 0 else f"layer {layers[li]}"
    st.subheader(f"Top tokens after {layer_name} at position {pos} ({tokens[t]} → {targets[t]})")
    k_tokens = top[li, t]
    probs = np.asarray(one["top_prob"].values)[li, t]
    st.dataframe(export.table(rank=np.arange(len(k_tokens)), token=[ctx.token_name(x) for x in k_tokens],
                              id=k_tokens, probability=probs), hide_index=True)
    rank = int(ranks[li, t])
    if rank >= 0:
        st.caption(f"Target {targets[t]}: rank {rank}, probability {float(one['target_prob'].values[li, t]):.3g}.")
