"""Attention: which earlier tokens each output reads from, exactly (CircuitsVis style). The selected sequence as
text; the selected token's sources shaded by their signed weight alpha (delta rule's key removal included) for the
selected layer and head, the value on hover; a click on a token makes it the query. Exact or the gated-linear-
attention approximation, with the approximation's error; the attention probe's stored top-k when the store has
it; and a grid of every head's small map (a click selects the head). Weights are computed on demand in float64
from the stored q, k, v, beta, g (app/dash/attnmap.py), for a bounded window of query tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from deltalab.app.dash import attnfig, attnmap, export, loading, state, textgrid
from deltalab.app.views.text import _doc_start, token_strings


@st.cache_data(show_spinner=False, max_entries=64)
def _valid_length(path: str, stamp: float, seq: int) -> int:
    return attnmap.valid_length(loading._open(path, stamp), seq)


@st.cache_resource(show_spinner=False, max_entries=4)
def _inputs(path: str, stamp: float, seq: int, li: int, start: int, stop: int) -> attnmap.Inputs:
    """The stored q, k, v, beta, g of every head of one window, read once: the next head, the head grid and the
    exact/GLA switch slice it instead of reading the store again (the read was most of an interaction)."""
    return attnmap.read_inputs(loading._open(path, stamp), seq, li, start, stop)


@st.cache_resource(show_spinner=False, max_entries=8)
def _rows(path: str, stamp: float, seq: int, li: int, head: int, src0: int, lo: int, hi: int) -> attnmap.Rows:
    """Full rows of one head's window (read-only: shared by every session). At most 128 x 2048 x n_h float64 per
    map, two maps: 4 MB per sub-step an entry on real sizes, small ones for short sequences."""
    return attnmap.rows(loading._open(path, stamp), seq, li, head, attnmap.Window(src0, lo, hi),
                        _inputs(path, stamp, seq, li, src0, hi))


@st.cache_resource(show_spinner=False, max_entries=16)
def _grid(path: str, stamp: float, seq: int, li: int, lo: int, hi: int, src0: int, stop: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """Every head's small maps over [lo, hi), sliced from the query window's inputs [src0, stop) when they hold it."""
    read = _inputs(path, stamp, seq, li, src0, stop) if src0 <= lo and hi <= stop else None
    return attnmap.grid(loading._open(path, stamp), seq, li, attnmap.Window(lo, lo, hi), read)


@st.cache_resource(show_spinner=False, max_entries=16)
def _grid_figure(path: str, stamp: float, seq: int, li: int, lo: int, hi: int, mode: str, head: int, layer: int,
                 src0: int, stop: int):
    """The head grid's figure (building it takes longer than the maps: clicks within one grid reuse it)."""
    exact, gla = _grid(path, stamp, seq, li, lo, hi, src0, stop)
    maps = exact if mode == attnmap.MODES[0] else gla
    return attnfig.head_grid_figure(maps, lo, selected=head, layer=layer, mode=mode)


@st.cache_data(show_spinner=False, max_entries=64)
def _stored_o(path: str, stamp: float, seq: int, li: int, head: int, lo: int, hi: int) -> np.ndarray | None:
    ds = loading._open(path, stamp)
    if "o" not in ds:
        return None
    return np.asarray(ds["o"].isel(seq=seq, layer=li, head=head, pos=slice(lo, hi)).values, np.float64)


@st.cache_resource(show_spinner=False, max_entries=32)
def _stored_top(path: str, name: str, rstamp: float, seq: int, layer: int, head: int) -> dict | None:
    """The probe's results of one sequence, layer and head (read-only: shared by every session)."""
    return attnmap.stored_top(loading.read_result(Path(path), name), seq, layer, head)


def _on_token(chart_key: str) -> None:
    """A click on a token makes it the query (selected on every page)."""
    cd = state.clicked(chart_key)
    if cd is not None:
        state.select(pos=int(cd[0]))


def _on_head(chart_key: str) -> None:
    """A click on a small map selects its head."""
    cd = state.clicked(chart_key)
    if cd is not None:
        state.select(head=int(cd[0]))


DEFAULTED_KEY = "attn_query_defaulted"


def _default_query(pos: int, T: int) -> None:
    """On the first visit, with no token chosen yet (position 0, none in the URL), open on the sequence's last
    token: token 0 reads only itself, the last one reads the whole sequence."""
    if st.session_state.get(DEFAULTED_KEY):
        return
    st.session_state[DEFAULTED_KEY] = True
    if pos == 0 and T > 1 and state.KEYS["pos"] not in st.query_params:
        state.defer(**{state.KEYS["pos"]: T - 1})
        st.rerun()


def render(ctx) -> None:
    sel = ctx.sel
    st.title("Attention")
    st.caption("Which earlier tokens the selected token's output reads from: o_t = Σ α_t,s v_s (+ the initial "
               "state), exactly, with the delta rule's key removal (α is signed: reflections flip signs). Sources "
               "are shaded by α for the selected layer and head (red negative, blue positive, grey: after the "
               "query); hover a token for its weight, click it to make it the query.")
    if "kappa" in ctx.ds:
        st.caption("RWKV-7: Φ(t, s) is the product of the transitions diag(e^g) − (κ ⊙ a) κ^T after token s "
                   "(`kernels.attention.dplr_chunk`, one step per token); the GLA approximation keeps only the decays.")
    missing = [v for v in attnmap.NEEDS if v not in ctx.ds]
    if missing:
        st.info(f"**This store has no {', '.join(missing)}**, which the exact map is computed from. Recapture with "
                "`--hooks tokens,labels,loss,q,k,v,beta,g,state` (the default hooks include them).")
        return
    c1, c2 = st.columns([3, 1])
    mode = c1.segmented_control("Weights", list(attnmap.MODES), default=attnmap.MODES[0], key="attn_mode",
                                bind="query-params", required=True,
                                help="Exact: Φ(t, u) multiplied out. GLA approximation: Φ replaced by the product "
                                     "of the gates (the heuristic that drops the key removal).") or attnmap.MODES[0]
    text = textgrid.is_text_store(ctx.attrs)
    width = c2.select_slider("Tokens per row", [16, 24, 32, 48, 64, 80, 100, 120], value=64 if text else 32,
                             key="attn_width", persist_state="session", bind="query-params")
    path, stamp = str(ctx.path), loading._stamp(ctx.path)
    T = _valid_length(path, stamp, sel.seq)
    _default_query(sel.pos, T)
    if sel.pos >= T:
        st.info(f"Position {sel.pos} is padding after sequence {sel.seq}'s end: select a token before {T}.")
        return
    win = attnmap.window(sel.pos, T)
    with st.spinner(f"Computing the exact map of layer {sel.layer}, head {sel.head_name} (float64)…"):
        rows = _rows(path, stamp, sel.seq, sel.li, sel.head, win.src0, win.lo, win.hi)
    row = rows.row(sel.pos, mode)  # [source, step]
    values = row.sum(-1)
    ids = state.token_row(ctx.path, sel.seq)
    labels = state.token_row(ctx.path, sel.seq, "labels")
    strings, hover = token_strings(ctx, ids)
    label_strings, label_hover = token_strings(ctx, np.maximum(labels, 0))
    label_names = ["—" if int(v) < 0 else (repr(s) if text else h)
                   for v, s, h in zip(labels, label_strings, label_hover)]
    part = slice(win.src0, win.hi)
    notes = attnfig.step_note(row)
    doc = _doc_start(path, stamp, sel.seq)
    spec = attnfig.source_spec(values, mode)
    lay = textgrid.layout(strings[part], doc[part] if doc is not None else None, int(width))
    shown = "" if (win.src0, win.hi) == (0, T) else f", tokens {win.src0}–{win.hi - 1} of {T}"
    fig = textgrid.text_figure(strings[part], [h + n for h, n in zip(hover[part], notes)], values, spec, lay,
                               positions=np.arange(win.src0, win.hi), doc_start=doc[part] if doc is not None else None,
                               selected_pos=sel.pos, labels=label_names[part],
                               title=f"Sources of token {sel.pos} ({hover[sel.pos]}): {mode} α, layer {sel.layer}, "
                                     f"head {sel.head_name}{shown}")
    export.chart(fig, "attn_text", on_select=lambda: _on_token("attn_text"), selection_mode="points",
                 data=export.table(position=np.arange(win.src0, win.hi), token=ids[part], text=strings[part],
                                   alpha=values))
    _metrics(ctx, rows, values, win, mode)
    if "key_head_of" in ctx.ds.coords:
        kh = int(np.asarray(ctx.ds["key_head_of"].values)[sel.head])
        st.caption(f"Grouped heads: value head {sel.head_name} reads key head {kh} (its queries and keys).")
    _stored(ctx, rows, strings)
    _head_grid(ctx, T, mode, strings)


def _metrics(ctx, rows: attnmap.Rows, values: np.ndarray, win: attnmap.Window, mode: str) -> None:
    sel = ctx.sel
    i = sel.pos - win.lo
    m = st.columns(4)
    ok = np.isfinite(values)
    top = int(np.nanargmax(np.where(ok, np.abs(values), -np.inf)))
    m[0].metric("Largest |α| from", f"pos {win.src0 + top}", f"α = {values[top]:.4f}", delta_color="off",
                delta_arrow="off")
    m[1].metric("‖α_t‖ over the sources", f"{float(np.sqrt(np.nansum(values ** 2))):.4f}",
                help="Of the token-summed weights shown (sub-steps of one token added).")
    m[2].metric("GLA weight error here", f"{rows.weight_error[i]:.3g}",
                help="‖α − α_GLA‖ / ‖α‖ over every source sub-step shown.")
    m[3].metric("GLA output error here", f"{rows.output_error[i]:.3g}",
                help="‖o_GLA − o‖ / ‖o‖, both rebuilt from their maps.")
    scope = "every source" if win.src0 == 0 else f"the sources shown (tokens {win.src0}..; earlier ones left out)"
    mean_w = float(np.nanmean(rows.weight_error[: min(win.hi, sel.pos + 1) - win.lo]))
    note = (f"GLA approximation's error over {scope}: mean weight error {mean_w:.3g} over query tokens "
            f"{win.lo}–{sel.pos}.")
    o = _stored_o(str(ctx.path), loading._stamp(ctx.path), sel.seq, sel.li, sel.head, win.lo, win.hi)
    if o is not None and win.src0 == 0 and np.isfinite(o[i]).all():
        err = float(np.linalg.norm(rows.output[i] - o[i]) / max(np.linalg.norm(o[i]), 1e-30))
        note += f" The stored output o_t is rebuilt from the exact map to {err:.1e} (relative)."
    st.caption(note + ("" if mode == attnmap.MODES[0] else " The view shows the approximation."))


def _stored(ctx, rows: attnmap.Rows, strings: list[str]) -> None:
    """The attention probe's stored top-k of the selected token beside the weights computed here."""
    names = loading.result_names(ctx.path, "attention")
    if not names:
        if not loading.in_memory(ctx.path):
            st.caption("Stored top-k sources: none yet (run "
                       f"`{loading.probe_command('attention', ctx.path)} --top-k 8` to keep them for every token).")
        return
    sel = ctx.sel
    name = names[0]
    stored = _stored_top(str(ctx.path), name, loading._result_stamp(ctx.path, name), sel.seq, sel.layer, sel.head)
    top = None if stored is None else attnmap.top_of(stored, sel.pos)
    if top is None:
        st.caption(f"Stored top-k (`results/{name}`): they do not cover sequence {sel.seq}, layer {sel.layer}, "
                   f"position {sel.pos}.")
        return
    spos, sstep = top["attn_source_pos"].astype(int), top["attn_source_step"].astype(int)
    keep = spos >= 0
    exact = rows.row(sel.pos, attnmap.MODES[0])
    here = [float(exact[p - rows.win.src0, j]) if rows.win.src0 <= p < rows.win.hi else np.nan
            for p, j in zip(spos[keep], sstep[keep])]
    df = pd.DataFrame({"rank": np.arange(keep.sum()), "source pos": spos[keep], "step": sstep[keep],
                       "token": [strings[p] for p in spos[keep]], "α stored": top["attn_weight"][keep],
                       "α computed here": here, "|α|·‖v‖ stored": top["attn_norm"][keep]})
    st.markdown(f"**Stored top-{len(spos)} sources** of token {sel.pos} (`results/{name}`, the attention probe; "
                f"sub-steps separate): GLA weight error {float(top['gla_weight_error']):.3g}, output error "
                f"{float(top['gla_output_error']):.3g} over all sources.")
    st.dataframe(df, hide_index=True, key="attn_stored", height=min(36 * (len(df) + 1) + 3, 360),
                 column_config={c: st.column_config.NumberColumn(format="%.5f")
                                for c in ("α stored", "α computed here", "|α|·‖v‖ stored")})


def _head_grid(ctx, T: int, mode: str, strings: list[str]) -> None:
    sel = ctx.sel
    gw = attnmap.grid_window(sel.pos, T, ctx.n_heads)
    win = attnmap.window(sel.pos, T)  # the query window's inputs, already read for the rows
    with st.spinner(f"Computing every head of layer {sel.layer}…"):
        fig = _grid_figure(str(ctx.path), loading._stamp(ctx.path), sel.seq, sel.li, gw.lo, gw.hi, mode, sel.head,
                           sel.layer, win.src0, win.hi)
    export.chart(fig, "attn_heads", on_select=lambda: _on_head("attn_heads"), selection_mode="points")
