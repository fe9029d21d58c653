"""Compare: two heads, two layers, or two stores (two checkpoints on the same inputs) side by side on the same
charts — the head-card numbers and their difference, β and rotation-angle distributions, key variance, effective
rank over position, and β over the selected sequence. Side A is the sidebar's selection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from deltalab.app.dash import compare, export, headdata, loading, roots
from deltalab.app.dash.state import head_number, head_numbers
from deltalab.app.views.text import display_names

MODES = ("two heads", "two layers", "two stores")


def _row(df: pd.DataFrame, layer: int, head: int) -> pd.Series | None:
    hit = df[(df["layer"] == layer) & (df["head"] == head)] if not df.empty else df
    return None if hit.empty else hit.iloc[0]


@st.cache_data(show_spinner=False, max_entries=64)
def _beta_row(path: str, stamp: float, seq: int, layer: int, head: int, step: int) -> np.ndarray | None:
    ds = loading._open(path, stamp)
    layers = [int(x) for x in ds["layer"].values] if "layer" in ds.coords else [0]
    if "beta" not in ds or layer not in layers or seq >= ds.sizes["seq"] or head >= ds.sizes["head"]:
        return None
    return np.asarray(ds["beta"].isel(seq=seq, layer=layers.index(layer), head=head,
                                      step=min(step, ds.sizes["step"] - 1)).values, np.float64)


def render(ctx) -> None:
    st.title("Compare")
    sel = ctx.sel
    mode = st.segmented_control("Compare", list(MODES), default=MODES[0], key="cmp_mode", bind="query-params",
                                required=True) or MODES[0]
    a_label = f"A: layer {sel.layer} head {sel.head_name}"
    other_path, other_ds = ctx.path, ctx.ds
    c1, c2 = st.columns(2)
    if mode == "two stores":
        if "cmp_store" not in st.session_state and st.query_params.get("cmp_store") and \
                not roots.store_permitted(st.query_params["cmp_store"]):
            st.query_params.pop("cmp_store", None)  # a link names a store outside the dashboard's roots
            st.session_state["cmp_store_unbound"] = True  # else the URL's value wins on the first run
            st.warning(roots.REFUSED_STORE)
        st.session_state.setdefault("cmp_store", "")
        path_text = c1.text_input("Second store (same inputs, another checkpoint)", key="cmp_store",
                                  bind=None if st.session_state.get("cmp_store_unbound") else "query-params",
                                  placeholder="path/to/other.zarr")
        if not path_text.strip():
            st.info("Type the path of a second store captured on the same inputs (e.g. another checkpoint: "
                    "`deltalab capture OTHER_CKPT --data SAME_SPEC --out other.zarr`).")
            return
        other_path = Path(path_text.strip()).expanduser()
        other_ds, problem = loading.open_store(other_path)
        if problem is not None:
            loading.show_problem(problem, other_path)
            return
        b_layer, b_head = sel.layer, sel.head
        other_df, _, _ = headdata.table(other_path, other_ds, display_names(ctx), layers=[b_layer])
        a_label = f"A: {Path(str(ctx.path)).name} · L{sel.layer} H{sel.head_name}"
        b_label = f"B: {other_path.name} · L{b_layer} H{b_head}"
        same = _same_inputs(ctx, other_ds)
        c2.caption(("Same input tokens in both stores." if same else
                    "**The stores hold different input tokens**: distributions compare, positions do not.")
                   + " Side B uses the sidebar's layer and head.")
    else:
        layers = ctx.layers
        if mode == "two heads":
            default_head = (sel.head + 1) % max(1, ctx.n_heads)
            b_layer = c1.selectbox("Layer of B", layers, index=layers.index(sel.layer), key="cmp_head_layer",
                                   bind="query-params")
            b_head = int(c2.number_input("Head of B", 0, ctx.n_heads - 1, default_head, key="cmp_head",
                                         bind="query-params",
                                         help=None if head_numbers(ctx.attrs) is None else
                                         "Head position in the store; this store keeps heads "
                                         + ",".join(map(str, head_numbers(ctx.attrs)))))
        else:
            others = [x for x in layers if x != sel.layer] or layers
            b_layer = c1.selectbox("Layer of B", layers, index=layers.index(others[0]), key="cmp_other_layer",
                                   bind="query-params")
            b_head = sel.head
            c2.caption(f"Both sides use head {sel.head_name}.")
        b_label = f"B: layer {b_layer} head {head_number(ctx.attrs, b_head)}"
    both = [sel.layer] if mode == "two stores" else [sel.layer, int(b_layer)]
    df, _, previewed = headdata.table(ctx.path, ctx.ds, display_names(ctx), layers=both)
    if mode != "two stores":
        other_df = df
    a = compare.Side(a_label, _row(df, sel.layer, sel.head))
    b = compare.Side(b_label, _row(other_df, int(b_layer), int(b_head)))
    if a.row is None or b.row is None:
        st.info("No probe results (or preview) cover one of the two sides: run the probes on both stores.")
        return
    if previewed:
        st.caption(f"Preview from the first sequences for: {', '.join(previewed)}.")
    table = compare.metrics_table(a, b)
    st.dataframe(table, hide_index=True, column_config={
        c: st.column_config.NumberColumn(c, format="%.3f") for c in table.columns if c != "metric"})
    left, right = st.columns(2)
    with left:
        export.chart(compare.beta_hist_figure([a, b], ctx.beta_max), "cmp_beta")
        export.chart(compare.evr_figure([a, b]), "cmp_evr")
    with right:
        export.chart(compare.angle_hist_figure([a, b]), "cmp_angles")
        export.chart(compare.erank_figure([a, b], ctx.length), "cmp_erank")
    series = {}
    for label, path, layer, head in ((a_label, ctx.path, sel.layer, sel.head),
                                     (b_label, other_path, int(b_layer), int(b_head))):
        row = _beta_row(str(path), loading._stamp(Path(str(path))), sel.seq, layer, head, sel.step)
        if row is not None:
            series[label] = row
    if series:
        export.chart(compare.per_position_figure(series, f"β of step {sel.step} over sequence {sel.seq}", "β",
                                                 sel.pos), "cmp_beta_pos")


def _same_inputs(ctx, other) -> bool:
    """Whether the first sequences of both stores hold the same tokens."""
    if "tokens" not in ctx.ds or "tokens" not in other or ctx.ds.sizes["pos"] != other.sizes["pos"]:
        return False
    n = min(4, ctx.ds.sizes["seq"], other.sizes["seq"])
    return bool(np.array_equal(np.asarray(ctx.ds["tokens"].isel(seq=slice(0, n)).values),
                               np.asarray(other["tokens"].isel(seq=slice(0, n)).values)))
