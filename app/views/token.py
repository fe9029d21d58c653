"""Token: drill down from a layer and head to one token's transition matrix A_t = exp(g_t) P_t — its n_h
Householder keys and betas, the dk x dk matrix, its eigenvalues, and where it sits in the sequence."""

from __future__ import annotations

import html

import numpy as np
import streamlit as st

from deltalab.app.dash import export, figures, reads, state
from deltalab.app.dash.derive import name_of
from deltalab.app.dash.safe import markdown_text

CONTEXT = 12


def _sequence_strip(ctx) -> None:
    """The tokens around the selected position, the selected one highlighted; each a link-like button."""
    sel = ctx.sel
    row = state.token_row(ctx.path, sel.seq)
    labels = state.token_row(ctx.path, sel.seq, "labels")
    lo, hi = max(0, sel.pos - CONTEXT), min(len(row), sel.pos + CONTEXT + 1)
    cells = []
    for p in range(lo, hi):
        name = html.escape(name_of(ctx.names, int(row[p])))
        style = ("background:#d62728;color:white;font-weight:bold;" if p == sel.pos else "background:#f0f2f6;")
        title = f"pos {p}, label {name_of(ctx.names, int(labels[p])) if labels[p] >= 0 else '—'}"
        cells.append(f'<span title="{html.escape(title)}" style="{style}padding:2px 6px;margin:2px;'
                     f'border-radius:4px;display:inline-block;font-family:monospace;font-size:0.85em">'
                     f'<span style="opacity:0.6;font-size:0.8em">{p}</span> {name}</span>')
    st.markdown(("… " if lo > 0 else "") + "".join(cells) + (" …" if hi < len(row) else ""), unsafe_allow_html=True)
    c = st.columns(4)
    c[0].button("◀ previous token", on_click=state.select, kwargs={"pos": max(0, sel.pos - 1)}, key="tok_prev")
    c[1].button("next token ▶", on_click=state.select, kwargs={"pos": min(len(row) - 1, sel.pos + 1)}, key="tok_next")
    same = np.flatnonzero(row == sel.token)
    later = same[same > sel.pos]
    if later.size:
        c[2].button(f"next '{name_of(ctx.names, sel.token)}' ▶", on_click=state.select, kwargs={"pos": int(later[0])},
                    key="tok_same")


def render(ctx) -> None:
    sel = ctx.sel
    st.title(f"Token {markdown_text(name_of(ctx.names, sel.token))} · seq {sel.seq}, pos {sel.pos}")
    if "kappa" not in ctx.ds:
        st.caption(f"Layer {sel.layer}, head {sel.head_name}: the transition A_t = a_t · P_t, "
                   "P_t = (I − β_n k_n k_nᵀ) … (I − β_1 k_1 k_1ᵀ), that this token applies to the state. "
                   "Change layer, head, sequence or position in the sidebar.")
    _sequence_strip(ctx)
    tr = reads.token_transition(ctx.path, sel.seq, sel.li, sel.pos, sel.head)
    if tr is None:
        st.info("This store has no keys or betas (captured without `--hooks k,beta`): recapture with the default "
                "hooks to see transition matrices.")
        return
    if tr.dplr:
        _render_dplr(ctx, tr)
        return
    n_h = len(tr.betas)
    c = st.columns(4)
    c[0].metric("β per step", " / ".join(f"{b:.3f}" for b in tr.betas))
    if tr.channel_decays is not None:
        c[1].metric("gate exp(g_t) per key channel", f"{tr.channel_decays.min():.3f} … {tr.channel_decays.max():.3f}",
                    help="Kimi Delta Attention: each key channel decays by its own factor before the Householder step.")
    else:
        c[1].metric("gate a_t = exp(g_t)", f"{tr.gate:.4f}" if ctx.gated else "none (1)")
    unit = bool(np.all(np.abs(np.abs(tr.eigenvalues) - 1) < 0.05))
    c[2].metric("max |arg λ|" + (" (a rotation)" if unit else ""), f"{tr.rotation_deg:.1f}°",
                help="The rotation angle when the non-trivial eigenvalues lie on the unit circle.")
    c[3].metric("det P_t", f"{float(np.prod(tr.eigenvalues).real):+.4f}")
    if n_h >= 2:
        phi = float(tr.key_angles_deg[0, 1])
        measured = f" (this token: {tr.rotation_deg:.1f}°)" if unit else ""
        st.caption(f"The planes of k₀ and k₁ meet at φ = {phi:.1f}°: two exact reflections (β = 2) would rotate by "
                   f"2φ = {2 * phi:.1f}° in that plane{measured}.")

    left, right = st.columns([1, 1])
    with left:
        export.chart(figures.keys_heatmap(tr.keys, tr.betas), key="tok_keys")
        export.chart(figures.matrix_heatmap(tr.gram, "Gram matrix of the keys (cosines k_i · k_j)",
                                            [f"k{j}" for j in range(n_h)], height=300, axis="key"),
                     key="tok_gram")
    with right:
        export.chart(figures.transition_eigenvalues(tr.eigenvalues, tr.eigenvalues_A if ctx.gated else None,
                                                    tr.dk, tr.gate,
                                                    f"Eigenvalues of this token's transition (dk = {tr.dk})"),
                     key="tok_eigs")
        scalar_gate = ctx.gated and tr.channel_decays is None
        rows = [{"λ": f"{e.real:+.4f} {e.imag:+.4f}i", "|λ|": f"{abs(e):.4f}",
                 "angle (°)": f"{np.degrees(np.angle(e)):+.1f}",
                 **({"λ of A_t": f"{(e * tr.gate).real:+.4f} {(e * tr.gate).imag:+.4f}i"} if scalar_gate else {})}
                for e in tr.eigenvalues]
        st.dataframe(rows, hide_index=True)
        st.caption(f"The other {tr.dk - n_h} eigenvalues of P_t equal 1 (directions orthogonal to every key).")
    c1, c2 = st.columns(2)
    with c1:
        title = ("A_t = P_t · diag(exp g_t)" if tr.channel_decays is not None
                 else "A_t = exp(g_t) · P_t" if ctx.gated else "P_t")
        export.chart(figures.matrix_heatmap(tr.A, title
                                            + f" ({tr.dk} × {tr.dk})"), key="tok_matrix")
    with c2:
        export.chart(figures.matrix_heatmap(tr.P - np.eye(tr.dk), f"P_t − I: rank ≤ {n_h}, supported on the "
                                                                   "span of the keys"), key="tok_update")


def _render_dplr(ctx, tr) -> None:
    """RWKV-7: A_t = diag(w_t) − (κ_t ⊙ a_t) κ_tᵀ, its dk exact eigenvalues, κ, a and w per key channel."""
    assert tr.kappa is not None and tr.channel_betas is not None and tr.channel_decays is not None
    sel = ctx.sel
    st.caption("RWKV-7: this token applies A_t = diag(w_t) − (κ_t ⊙ a_t) κ_tᵀ (w = exp(g) the per-channel decay, "
               "κ the unit removal key, a ∈ (0, 1) the removal strength per key channel). Its dk eigenvalues are real "
               "and interlace the decays (secular equation, exact); P_t = I − (κ ⊙ a) κᵀ is the removal alone.")
    c = st.columns(4)
    c[0].metric("effective β = Σ κᵢ² aᵢ", f"{float(tr.betas[0]):.4f}",
                help="P_t's non-trivial eigenvalue is 1 − Σ κᵢ² aᵢ: how much of the state along κ is removed.")
    c[1].metric("a per key channel", f"{tr.channel_betas.min():.3f} … {tr.channel_betas.max():.3f}")
    c[2].metric("decay w per key channel", f"{tr.channel_decays.min():.3f} … {tr.channel_decays.max():.3f}")
    eig_a = tr.eigenvalues_A
    c[3].metric("det A_t", f"{float(np.prod(eig_a).real):+.3e}")
    left, right = st.columns([1, 1])
    with left:
        rows = np.stack([tr.kappa, tr.channel_betas, tr.channel_decays])
        title = f"κ, a and w per key channel, layer {sel.layer} head {sel.head_name}"
        export.chart(figures.channel_rows_heatmap(rows, ["κ (removal key)", "a (removal strength)", "w = exp(g)"],
                                                  title),
                     key="tok_keys")
    with right:
        export.chart(figures.transition_eigenvalues(tr.eigenvalues, eig_a, tr.dk, 1.0,
                                                    f"Eigenvalues of this token's transition (dk = {tr.dk})",
                                                    label_A="A_t: all dk eigenvalues (exact)"), key="tok_eigs")
        st.dataframe([{"λ of A_t": f"{e.real:+.5f}", "decay w (sorted)": f"{w:.5f}"}
                      for e, w in zip(eig_a, np.sort(tr.channel_decays))], hide_index=True)
        st.caption("Each eigenvalue lies between consecutive sorted decays (the smallest may drop below the smallest "
                   "decay): the removal only pulls eigenvalues down.")
    c1, c2 = st.columns(2)
    with c1:
        export.chart(figures.matrix_heatmap(tr.A, f"A_t = diag(w) − (κ ⊙ a) κᵀ ({tr.dk} × {tr.dk})"), key="tok_matrix")
    with c2:
        export.chart(figures.matrix_heatmap(tr.P - np.eye(tr.dk), "P_t − I = −(κ ⊙ a) κᵀ: rank one"),
                     key="tok_update")
