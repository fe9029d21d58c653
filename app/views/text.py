"""Text: one sequence rendered as its tokens (rows follow the text's own lines), each token coloured by a per-token
quantity of the selected layer and head (β of a step, fraction of β > 1, rotation angle, effective rank, loss),
document starts marked, the value on hover; a click on a token selects it on every page."""

from __future__ import annotations

import numpy as np
import streamlit as st

from deltalab.app.dash import export, loading, state, textgrid
from deltalab.app.dash.derive import name_of

MAX_TOKENS = 2048
"""Tokens drawn at once; longer sequences show the window around the selected position."""


@st.cache_resource(show_spinner=False, max_entries=8)
def _vocab(tokenizer: str | None, vocab_size: int) -> list[str]:
    from pathlib import Path

    return textgrid.vocab_strings(Path(tokenizer) if tokenizer else None, vocab_size)


@st.cache_data(show_spinner=False, max_entries=128)
def _values(path: str, stamp: float, seq: int, li: int, quantity: str, head: int, step: int,
            strong: float = 0.9) -> np.ndarray:
    """[T] the quantity for every position of sequence `seq`, layer index `li` (NaN where it has no value).
    On RWKV-7 stores "fraction β > 1" (never: a lies in [0, 1]) is the fraction of a above `strong`."""
    ds = loading._open(path, stamp)
    one = ds.isel(seq=seq)
    T = ds.sizes["pos"]
    if quantity == "loss":
        return np.asarray(one["loss"].values, np.float64) if "loss" in ds else np.full(T, np.nan)
    if "beta" not in ds:
        return np.full(T, np.nan)
    dplr = "kappa" in ds  # rwkv7: beta per key channel; a token's beta is the effective sum_i kappa_i^2 a_i
    if quantity == "β":
        if dplr:
            return _effective_beta(one, li, head)[:, 0]
        return np.asarray(one["beta"].isel(layer=li, step=step, head=head).values, np.float64)
    if quantity == "fraction β > 1":
        b = np.asarray(one["beta"].isel(layer=li).values, np.float64)  # [T, step, head(, dk)]
        return (b > (strong if dplr else 1.0)).reshape(T, -1).mean(1)
    if quantity == "rotation angle":
        if "k" not in ds:
            return np.full(T, np.nan)
        if dplr:  # P_t = I - (kappa * a) kappa^T: eigenvalue 1 - sum kappa^2 a, a Householder step of |kappa| = 1
            k = np.asarray(one["kappa"].isel(layer=li, head=head).values, np.float64)  # [T, 1, dk]
            return textgrid.rotation_angles(k, _effective_beta(one, li, head))
        k = np.asarray(one["k"].isel(layer=li, head=head).values, np.float64)  # [T, step, dk]
        b = np.asarray(one["beta"].isel(layer=li, head=head).values, np.float64)  # [T, step]
        return textgrid.rotation_angles(k, b)
    if quantity == "effective rank":
        if not all(v in ds for v in ("k", "v")):
            return np.full(T, np.nan)
        from deltalab.probes import erank

        sub = ds.isel(seq=slice(seq, seq + 1), layer=slice(li, li + 1), head=slice(head, head + 1))
        return np.asarray(erank.per_token(sub)["erank"].values, np.float64).reshape(-1)
    raise ValueError(f"unknown quantity {quantity!r}")


def _strong_threshold(path) -> float:
    """The betas probe's recorded `--strong` threshold (its default 0.9 before the probe has run)."""
    names = loading.result_names(path, "betas")
    return float(loading.read_result(path, names[0]).attrs.get("strong_threshold", 0.9)) if names else 0.9


def _effective_beta(one, li: int, head: int) -> np.ndarray:
    """rwkv7: [T, 1] effective removal strength sum_i kappa_i^2 a_i of one head (P_t's eigenvalue is 1 minus it)."""
    kap = np.asarray(one["kappa"].isel(layer=li, head=head).values, np.float64)  # [T, 1, dk]
    a = np.asarray(one["beta"].isel(layer=li, head=head).values, np.float64)
    return (kap * kap * a).sum(-1)


def _on_click(chart_key: str) -> None:
    """A click on a token selects its position."""
    cd = state.clicked(chart_key)
    if cd is not None:
        state.select(pos=int(cd[0]))


def token_strings(ctx, ids: np.ndarray) -> tuple[list[str], list[str]]:
    """(cell strings, hover names) of token ids: text through the tokenizer, task tokens as ids (names on hover)."""
    if textgrid.is_text_store(ctx.attrs):
        tok = textgrid.tokenizer_file(ctx.checkpoint)
        vocab = _vocab(str(tok) if tok else None, int(ctx.cfg.get("vocab_size") or int(ids.max()) + 1))
        strings = [vocab[int(i)] if 0 <= int(i) < len(vocab) else f"<{int(i)}>" for i in ids]
        return strings, [f"{int(i)} {s!r}" for i, s in zip(ids, strings)]
    return [str(int(i)) for i in ids], [name_of(ctx.names, int(i)) for i in ids]


def vocab_names(checkpoint, vocab_size: int) -> list[str]:
    """Every token id's text as a repr ('a', '\\n'), through the checkpoint's tokenizer.json (bytes without one)."""
    tok = textgrid.tokenizer_file(checkpoint)
    return [repr(s) for s in _vocab(str(tok) if tok else None, int(vocab_size))]


def display_names(ctx) -> list[str] | None:
    """Names of every token id for cards and tables: the token's text (repr) for text stores, task names else."""
    if not textgrid.is_text_store(ctx.attrs):
        return ctx.names
    return vocab_names(ctx.checkpoint, int(ctx.cfg.get("vocab_size") or 256))


def render(ctx) -> None:
    sel = ctx.sel
    st.title("Text")
    st.caption("The selected sequence as its tokens, coloured by a per-token quantity of the selected layer and "
               "head. Hover a token for its value; click it to select it on every page. Green bars: document "
               "starts.")
    c1, c2 = st.columns([3, 1])
    dplr = "kappa" in ctx.ds  # rwkv7: a in [0, 1] per key channel, so β > 1 becomes "a above the strong threshold"
    strong = _strong_threshold(ctx.path) if dplr else 1.0
    shown = {"fraction β > 1": f"fraction a > {strong:g}"} if dplr else {}
    quantity = c1.segmented_control("Colour by", list(textgrid.QUANTITIES), default="β", key="text_quantity",
                                    format_func=lambda q: shown.get(q, q), bind="query-params",
                                    required=True) or "β"
    text = textgrid.is_text_store(ctx.attrs)
    width = c2.select_slider("Tokens per row", [16, 24, 32, 48, 64, 80, 100, 120], value=64 if text else 32,
                             key="text_width", persist_state="session", bind="query-params")
    ids = state.token_row(ctx.path, sel.seq)
    labels = state.token_row(ctx.path, sel.seq, "labels")
    T = len(ids)
    lo = 0 if T <= MAX_TOKENS else int(min(max(0, sel.pos - MAX_TOKENS // 2), T - MAX_TOKENS))
    hi = min(T, lo + MAX_TOKENS)
    stamp = loading._stamp(ctx.path)
    with st.spinner(f"Computing {quantity} for sequence {sel.seq}…"):
        values = _values(str(ctx.path), stamp, sel.seq, sel.li, quantity, sel.head, sel.step, strong)
    doc = _doc_start(str(ctx.path), stamp, sel.seq)
    strings, hover = token_strings(ctx, ids)
    label_strings, label_hover = token_strings(ctx, np.maximum(labels, 0))
    label_names = ["—" if int(v) < 0 else (repr(s) if text else h)
                   for v, s, h in zip(labels, label_strings, label_hover)]
    dmin = min(int(ctx.ds.sizes.get("dk", 1)), int(ctx.ds.sizes.get("dv", 1)))
    finite_loss = values[np.isfinite(values)] if quantity == "loss" else np.zeros(0)
    if quantity == "effective rank" and np.isfinite(values).any():  # the colours span the ranks reached
        dmin = min(dmin, int(np.ceil(np.nanmax(values))))
    spec = textgrid.quantity_spec(quantity, head=sel.head, step=sel.step, beta_max=ctx.beta_max, rank_max=dmin,
                                  loss_max=float(np.quantile(finite_loss, 0.99)) if finite_loss.size else 8.0)
    if quantity == "β" and "kappa" in ctx.ds:  # rwkv7: the effective removal strength of the head
        import dataclasses

        spec = dataclasses.replace(spec, label=f"effective β = Σκ²a (head {sel.head_name})")
    if quantity == "fraction β > 1" and dplr:
        import dataclasses

        spec = dataclasses.replace(spec, label=f"fraction of a > {strong:g} (all heads and key channels)")
    part = slice(lo, hi)
    lay = textgrid.layout(strings[part], doc[part] if doc is not None else None, int(width))
    window = "" if (lo, hi) == (0, T) else f", positions {lo}–{hi - 1} of {T}"
    fig = textgrid.text_figure(strings[part], hover[part], values[part], spec, lay,
                               positions=np.arange(lo, hi), doc_start=doc[part] if doc is not None else None,
                               selected_pos=sel.pos, labels=label_names[part],
                               title=f"Sequence {sel.seq}{window}: {spec.label}, layer {sel.layer}")
    export.chart(fig, "text_grid", on_select=lambda: _on_click("text_grid"),
                 selection_mode="points", data=export.table(positions=np.arange(lo, hi), token=ids[part],
                                                            text=strings[part], value=values[part]))
    ok = np.isfinite(values)
    m = st.columns(4)
    m[0].metric("Selected token", f"pos {sel.pos}", help=hover[sel.pos] if sel.pos < T else None)
    m[1].metric(spec.label.split(" (")[0] + " here", "—" if not np.isfinite(values[sel.pos])
                else format(float(values[sel.pos]), spec.fmt))
    m[2].metric("Mean over the sequence", "—" if not ok.any() else format(float(values[ok].mean()), spec.fmt))
    if ok.any():
        top = int(np.nanargmax(np.where(ok, values, -np.inf)))
        m[3].metric("Highest at", f"pos {top}", format(float(values[top]), spec.fmt), delta_color="off")
    if quantity == "effective rank":
        st.caption("Entropy effective rank of the state after each token, rebuilt from the chunk-start states.")
    d1, d2 = st.columns(2)
    d1.button("Drill down: this token's transition matrix →", on_click=state.go_to, args=("Token",), key="drill_text")
    d2.button("Which tokens it reads: exact attention →", on_click=state.go_to, args=("Attention",),
              key="drill_text_attention")


@st.cache_data(show_spinner=False, max_entries=64)
def _doc_start(path: str, stamp: float, seq: int) -> np.ndarray | None:
    ds = loading._open(path, stamp)
    if "doc_start" not in ds:
        return None
    return np.asarray(ds["doc_start"].isel(seq=seq).values, bool)
