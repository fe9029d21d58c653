"""Keys: PCA of the keys per layer/head/step (explained variance, 3-D scatter coloured by input token or label)
and the overlap of key subspaces between steps and heads (principal angles).

The DeltaProduct paper's S4 rotation head keeps its keys in a 3-D subspace (3 PCs > 95% of the variance):
the keys span the axes of the cube rotations.
"""

from __future__ import annotations

import numpy as np
import streamlit as st

from deltalab.app.dash import export, figures, loading, state
from deltalab.app.dash.derive import name_of, seqs_for_points
from deltalab.app.dash.safe import markdown_text
from deltalab.models import IGNORE_INDEX


@st.cache_data(show_spinner=False, max_entries=64)
def _points(path: str, stamp: float, result: str | None, n_preview: tuple[int, int | None], li: int, head: int,
            step: int | None, seqs: tuple[int, ...]) -> dict[str, np.ndarray]:
    """PCA coordinates [n, 3] (+ seq, pos, token, label per point) of the sequences `seqs`."""
    res = loading.source(path, stamp, "keys", result, n_preview)
    var = "key_pc_joint" if step is None else "key_pc"
    idx = list(seqs)
    pc = res[var].isel(layer=li, head=head, step=0 if step is None else step).isel(seq=idx)
    xyz = np.asarray(pc.values, dtype=np.float32)  # [s, T, pc] (joint basis: the first step's keys)
    ds = loading._open(path, stamp).isel(seq=idx)
    s, T = xyz.shape[:2]
    tokens = np.asarray(ds["tokens"].values) if "tokens" in ds else np.zeros((s, T), np.int64)
    labels = np.asarray(ds["labels"].values) if "labels" in ds else np.full((s, T), IGNORE_INDEX)
    seq = np.repeat(np.asarray(idx), T)
    pos = np.tile(np.arange(T), s)
    return {"xyz": xyz.reshape(s * T, -1)[:, :3], "seq": seq, "pos": pos,
            "token": tokens.ravel(), "label": labels.ravel()}


def render(ctx) -> None:
    st.title("Keys")
    st.caption("PCA of the L2-normalised keys k_{t,j} of one head: how many directions the head writes along, "
               "and whether the keys cluster by input token.")
    res, preview = ctx.result_or_preview("keys", "The PCA, 3-D coordinates and principal angles come from it.")
    if res is None:
        return
    sel = ctx.sel
    li = ctx.layer_index(res)
    if li is None:
        return
    head = sel.head

    evr = np.asarray(res["explained_variance_ratio"].isel(layer=li, head=head).values)  # [step, comp]
    joint = np.asarray(res["explained_variance_ratio_joint"].isel(layer=li, head=head).values)
    cum3 = [float(np.nansum(e[:3])) for e in evr]
    c = st.columns(len(cum3) + 1)
    for s, v in enumerate(cum3):
        c[s].metric(f"Top-3 PCs, step {s}", f"{v:.1%}")
    c[-1].metric("Top-3 PCs, all steps", f"{float(np.nansum(joint[:3])):.1%}")
    export.chart(figures.explained_variance(evr, joint, f"Explained variance of the keys, layer {sel.layer} "
                                                        f"head {head}"), key="keys_evr")

    st.subheader("Keys in 3-D")
    c1, c2, c3 = st.columns(3)
    basis = c1.radio("Basis", ["selected step", "all steps jointly"], horizontal=True, key="keys_basis",
                     persist_state="session", bind="query-params")
    color_by = c2.radio("Colour by", ["input token", "label"], horizontal=True, key="keys_color",
                        persist_state="session", bind="query-params")
    max_points = c3.select_slider("Points", [500, 1000, 2000, 3000, 5000], value=2000, key="keys_points",
                                  persist_state="session", bind="query-params")
    step = None if basis == "all steps jointly" else sel.step
    result_name = None if preview else ctx.chosen.get("keys")
    n_avail = loading.preview_n(ctx.ds, "keys") if preview else ctx.ds.sizes["seq"]
    seqs = list(range(seqs_for_points(n_avail, ctx.length, max_points)))
    if sel.seq not in seqs and sel.seq < n_avail:  # always plot the selected token's sequence
        seqs[-1] = sel.seq
    pts = _points(str(ctx.path), loading._stamp(ctx.path), result_name, loading.preview_key(ctx.ds, "keys", sel.layer),
                  li, head,
                  step, tuple(seqs))
    keep = np.isfinite(pts["xyz"]).all(1)
    col = pts["token"] if color_by == "input token" else pts["label"]
    hover = [f"seq {s} pos {p}<br>token {name_of(ctx.names, t)}<br>label {name_of(ctx.names, lab) if lab >= 0 else '—'}"
             for s, p, t, lab in zip(pts["seq"], pts["pos"], pts["token"], pts["label"])]
    hi = (pts["seq"] == sel.seq) & (pts["pos"] == sel.pos)
    highlight = pts["xyz"][hi][0] if hi.any() else None
    e = joint if step is None else evr[step]
    title = (f"Keys of layer {sel.layer} head {head}, "
             + ("step " + str(step) if step is not None else "all steps (joint basis, step 0 keys)")
             + f" — {int(keep.sum())} tokens from {len(np.unique(pts['seq']))} sequences")
    fig = figures.pca_scatter3d(pts["xyz"][keep], col[keep], color_by, np.asarray(hover, dtype=object)[keep],
                                np.stack([pts["seq"], pts["pos"]], 1)[keep], ctx.names, highlight, title, e)
    export.chart(fig, key="keys_3d")
    if highlight is None:
        st.caption(f"The selected token (seq {sel.seq}, pos {sel.pos}) is outside the plotted sample.")

    st.subheader("Subspace overlap")
    st.caption(f"Principal angles between the top-{markdown_text(res.attrs.get('subspace_dim', 3))} PCA subspaces: "
               "0° = the same subspace, 90° = orthogonal.")
    c1, c2 = st.columns(2)
    with c1:
        ang = np.asarray(res["step_angles"].isel(layer=li, head=head).values)
        export.chart(figures.angles_heatmap(ang, [f"step {s}" for s in range(ang.shape[0])],
                                            f"Between the steps of head {head}", "Householder step"),
                     key="keys_step_angles")
    with c2:
        hang = np.asarray(res["head_angles"].isel(layer=li, step=sel.step).values)
        export.chart(figures.angles_heatmap(hang, [f"h{h}" for h in range(hang.shape[0])],
                                            f"Between the heads of layer {sel.layer}, step {sel.step}", "head"),
                     key="keys_head_angles")
    st.button("Drill down: this token's transition matrix →", on_click=state.go_to, args=("Token",), key="drill_keys")
