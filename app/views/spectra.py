"""Spectra: eigenvalues of each token's Householder product P_t on the complex plane (unit circle drawn),
the rotation-angle histogram, the eigenvalue set of every input token, and the gate scaling A_t = exp(g_t) P_t.

P_t has dk - n_h eigenvalues equal to 1; the n_h others come from an n_h x n_h matrix. A unit-modulus
complex pair e^{±iθ} is a rotation by θ: two reflections whose planes meet at φ rotate by 2φ.
"""

from __future__ import annotations

import numpy as np
import streamlit as st

from deltalab.app.dash import export, figures, loading, reads, state
from deltalab.app.dash.derive import name_of, seqs_for_points


@st.cache_data(show_spinner=False, max_entries=64)
def _eigs(path: str, stamp: float, result: str | None, n_preview: tuple[int, int | None], var: str, li: int, head: int,
          seqs: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Eigenvalues [n_points] of the sequences `seqs` with seq, pos, token per eigenvalue."""
    res = loading.source(path, stamp, "spectra", result, n_preview)
    idx = list(seqs)
    eig = np.asarray(res[var].isel(layer=li, head=head).isel(seq=idx).values)  # [s, T, n]
    s, T, n = eig.shape
    ds = loading._open(path, stamp).isel(seq=idx)
    tokens = np.asarray(ds["tokens"].values) if "tokens" in ds else np.zeros((s, T), np.int64)
    seq = np.repeat(np.asarray(idx), T * n)
    pos = np.tile(np.repeat(np.arange(T), n), s)
    return {"eig": eig.ravel(), "seq": seq, "pos": pos, "token": np.repeat(tokens.ravel(), n)}


@st.cache_data(show_spinner=False, max_entries=16)
def _gates(path: str, stamp: float, li: int, n_seq: int) -> np.ndarray:
    """exp(g) [tokens (x key channels), H] of the first n_seq sequences of layer li (an index of the store's layers)."""
    ds = loading._open(path, stamp)
    g = np.asarray(ds["g"].isel(layer=li, seq=slice(0, n_seq)).values, dtype=np.float64)  # [s, T, H(, dk)]
    if g.ndim == 4:  # per-channel gate: every channel's decay counts for its head
        g = np.moveaxis(g, 2, -1)
    return np.exp(g.reshape(-1, g.shape[-1]))


def _on_click(chart_key: str) -> None:
    """A click on an eigenvalue selects its token (sequence and position)."""
    cd = state.clicked(chart_key)
    if cd is not None and len(cd) >= 2:
        state.select(seq=int(cd[0]), pos=int(cd[1]))


def _single_step(ctx, layers: list[int], li: int, head: int) -> None:
    """One Householder step (Gated DeltaNet: OLMo-Hybrid, Qwen3-Next): P_t = I − β k kᵀ is never a rotation, its one
    non-trivial eigenvalue is 1 − β (negative when β > 1). Show that eigenvalue and how often it is negative, per
    layer and head, from the betas probe; the gate follows below."""
    st.caption("One step per token: P_t = I − β_t k_t k_tᵀ has the single non-trivial eigenvalue 1 − β_t (a "
               "rotation needs two steps). Below 0 it flips the key direction; the gate exp(g_t) scales all of them.")
    betas = ctx.result("betas")
    if betas is None or "beta_mean" not in betas:
        st.info(f"Run `deltalab probe betas --store {ctx.path}` for the eigenvalue 1 − β per layer and head.")
        return
    c1, c2 = st.columns(2)
    with c1:
        eig = 1.0 - np.asarray(betas["beta_mean"].values)[:, 0, :]  # [layer, head]: the mean of 1 - beta
        export.chart(figures.layer_head_heatmap(eig, layers, "Mean eigenvalue 1 − β of P_t per head", "1 − β",
                                                zmin=-1, zmax=1, zmid=0.0, colorscale="RdBu",
                                                highlight=(li, head)), key="spec_eig1",
                     **state.cell_clicks("spec_eig1"))
    with c2:
        frac = np.asarray(betas["frac_negative_head"].values)
        export.chart(figures.layer_head_heatmap(frac, layers, "Fraction of tokens with 1 − β < 0 (β > 1)",
                                                "fraction negative", zmin=0, zmax=1, colorscale="Reds",
                                                highlight=(li, head)), key="spec_neg1",
                     **state.cell_clicks("spec_neg1"))


def render(ctx) -> None:
    st.title("Spectra")
    if "kappa" in ctx.ds:
        st.caption("RWKV-7: each token's transition A_t = diag(w_t) − (κ_t ⊙ a_t) κ_tᵀ has dk real eigenvalues that "
                   "interlace the decays w (exact, secular equation: choose A_t). P_t = I − (κ ⊙ a) κᵀ, the removal "
                   "alone, has one non-trivial eigenvalue 1 − Σ κᵢ² aᵢ; products of a few P_t can turn (windows).")
    else:
        st.caption("Eigenvalues of each token's transition. P_t = (I − β_n k_n k_nᵀ)…(I − β_1 k_1 k_1ᵀ) has dk − n_h "
                   "eigenvalues 1 and n_h non-trivial ones (shown). On the unit circle: rotations and reflections; "
                   "inside: contraction (forgetting).")
    res, preview = ctx.result_or_preview("spectra", "Eigenvalues, rotation angles and per-token sets come from it.")
    if res is None:
        return
    sel = ctx.sel
    li = ctx.layer_index(res)
    if li is None:
        return
    layers = [int(x) for x in res["layer"].values]
    head = sel.head

    if ctx.n_h == 1 and "kappa" not in ctx.ds:
        _single_step(ctx, layers, li, head)
    else:
        export.chart(figures.layer_head_heatmap(
            np.asarray(res["frac_rotation"].values), layers, "Fraction of tokens whose P_t is a rotation",
            "fraction rotation", zmin=0, zmax=1, colorscale="Purples", highlight=(li, head)), key="spec_rot",
                     **state.cell_clicks("spec_rot"))

    tr = reads.token_transition(ctx.path, sel.seq, sel.li, sel.pos, head)
    c1, c2, c3 = st.columns(3)
    p_name = "P_t (removal I − (κ⊙a) κᵀ)" if "kappa" in ctx.ds else "P_t (Householder product)"
    a_name = ("A_t = diag(w) − (κ⊙a) κᵀ" if "kappa" in ctx.ds else "A_t = P_t diag(exp g_t)" if res.attrs.get(
        "channel_gate") else "A_t = exp(g_t) P_t")
    which = c1.radio("Matrix", [p_name, a_name] if "eig_A" in res else [p_name], horizontal=True,
                     key="spec_matrix",
                     persist_state="session", bind="query-params")
    color_by = c2.radio("Colour by", ["input token", "position"], horizontal=True, key="spec_color",
                        persist_state="session", bind="query-params")
    max_points = c3.select_slider("Tokens", [500, 1000, 2000, 4000], value=1000, key="spec_points",
                                  persist_state="session", bind="query-params")
    var = "eig_A" if which.startswith("A_t") else "eig_P"
    n_avail = loading.preview_n(ctx.ds, "spectra") if preview else ctx.ds.sizes["seq"]
    seqs = list(range(seqs_for_points(n_avail, ctx.length, max_points)))
    if sel.seq not in seqs and sel.seq < n_avail:
        seqs[-1] = sel.seq
    pts = _eigs(str(ctx.path), loading._stamp(ctx.path), None if preview else ctx.chosen.get("spectra"),
                loading.preview_key(ctx.ds, "spectra", sel.layer), var, li, head, tuple(seqs))
    hover = [f"seq {s} pos {p}<br>token {name_of(ctx.names, t)}" for s, p, t in zip(pts["seq"], pts["pos"],
                                                                                       pts["token"])]
    color = pts["token"] if color_by == "input token" else pts["pos"]
    highlight = None
    if tr is not None:
        highlight = tr.eigenvalues_A if var == "eig_A" else tr.eigenvalues
    fig = figures.complex_plane(pts["eig"], color, color_by, hover, np.stack([pts["seq"], pts["pos"]], 1),
                                ctx.names, highlight,
                                f"Non-trivial eigenvalues of {which.split(' ')[0]}, layer {sel.layer} head {head} "
                                f"({len(pts['eig'])} from {len(seqs)} sequences)")
    left, right = st.columns([3, 2])
    with left:
        export.chart(fig, key="spec_plane", on_select=lambda: _on_click("spec_plane"), selection_mode="points")
        st.caption("Click an eigenvalue to select its token; the selected token's eigenvalues are the black diamonds.")
    with right:
        hist = np.asarray(res["angle_hist"].isel(layer=li, head=head).values)
        export.chart(figures.angle_histogram(np.asarray(res["angle_bin"].values), hist,
                                             f"Rotation angle per token, layer {sel.layer} head {head}",
                                             tr.rotation_deg if tr is not None else None), key="spec_angles")
        m = st.columns(3)
        m[0].metric("complex pair", f"{float(res['frac_complex'].values[li, head]):.0%}")
        m[1].metric("|λ| ≈ 1", f"{float(res['frac_unit_modulus'].values[li, head]):.0%}")
        m[2].metric("rotation", f"{float(res['frac_rotation'].values[li, head]):.0%}")
        if tr is not None:
            st.markdown(f"Selected token **{ctx.token_name(sel.token)}** (seq {sel.seq}, pos {sel.pos}): "
                        + ", ".join(f"`{e.real:+.3f}{e.imag:+.3f}i`" for e in tr.eigenvalues)
                        + f", rotation {tr.rotation_deg:.1f}°")

    tokens = np.asarray(res["token"].values).astype(np.int64)
    if tokens.size and "token_eig_P" in res:
        st.subheader("Eigenvalue set of each input token")
        st.caption("Mean (angle-sorted) eigenvalues of P_t over every occurrence of the token; for a group task, "
                   "a head that implements the group maps each element to a fixed rotation.")
        labels = ctx.token_labels(tokens)
        c1, c2 = st.columns([3, 2])
        with c1:
            teig = np.asarray(res["token_eig_P"].isel(layer=li, head=head).values)  # [tok, n]
            spread = np.asarray(res["token_eig_spread"].isel(layer=li, head=head).values)
            export.chart(figures.token_eigenvalue_sets(teig, tokens, labels, spread, sel.token,
                                                       f"Per-token eigenvalues, layer {sel.layer} head {head}"),
                         key="spec_tokens")
        with c2:
            ang = np.asarray(res["token_angle_deg"].isel(layer=li).values)  # [tok, H]
            export.chart(figures.token_head_heatmap(ang, tokens, labels, "Rotation angle per token and head",
                                                    "angle (°)", zmin=0, zmax=180, colorscale="Plasma",
                                                    selected_head=head, selected_token=sel.token),
                         key="spec_token_heads")

    st.subheader("Gate scaling")
    if ctx.gated and "kappa" in ctx.ds:
        st.caption("RWKV-7: the decays w = exp(g) ∈ (0.545, 1) per key channel bound A_t's eigenvalues (they interlace "
                   "them).")
    elif ctx.gated:
        st.caption("A_t = exp(g_t) · P_t: the forget gate shrinks every eigenvalue by exp(g_t) ∈ (0, 1].")
        n = min(ctx.ds.sizes["seq"], max(1, 8192 // max(1, ctx.length)))
        gates = _gates(str(ctx.path), loading._stamp(ctx.path), ctx.layers.index(sel.layer), n)
        c1, c2 = st.columns(2)
        with c1:
            export.chart(figures.gate_box(gates, head, f"Gate exp(g_t) per head, layer {sel.layer} "
                                                       f"({gates.shape[0]} tokens)"), key="spec_gate")
        with c2:
            if "mean_modulus_A" in res:
                mods = np.stack([np.asarray(res["mean_modulus"].values), np.asarray(res["mean_modulus_A"].values)])
                export.chart(figures.layer_head_heatmap(
                    mods[1] / np.where(mods[0] > 0, mods[0], 1), layers, "Mean |λ(A_t)| / mean |λ(P_t)| per head",
                    "scaling", zmin=0, zmax=1, colorscale="Greens", highlight=(li, head)), key="spec_gate_ratio",
                 **state.cell_clicks("spec_gate_ratio"))
    else:
        st.info("This model has no forget gate: A_t = P_t (every eigenvalue scaling is 1).")
    st.button("Drill down: this token's transition matrix →", on_click=state.go_to, args=("Token",),
              key="drill_spectra")
