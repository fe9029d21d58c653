"""The linked selection: layer, head, Householder step, sequence and position live in st.session_state,
are drawn once in the sidebar, mirrored in the URL, and every page reads and highlights them.

Pages change the selection through `select(...)`, called from widget/chart callbacks (which run before
the sidebar widgets are drawn, as Streamlit requires), so a token picked in one view is the selected
token of every other view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import streamlit as st

from deltalab.models import IGNORE_INDEX

KEYS = {"layer": "sel_layer", "head": "sel_head", "step": "sel_step", "seq": "sel_seq", "pos": "sel_pos"}
PAGE_KEY = "page"
STORE_KEY = "open_store"  # the store path the page was opened on (own input is run through its checkpoint)
INPUT_KEY = "input_key"  # the registered in-memory dataset of the researcher's own input
SOURCE_KEY = "source"
SOURCES = ("store", "your input")


@dataclass(frozen=True)
class Selection:
    """The current selection. `layer` is the model layer index (coordinate), `li` its index in the store;
    `seq` is the index among the store's complete sequences; `token`/`label` are read from the store."""

    layer: int
    li: int
    head: int
    step: int
    seq: int
    pos: int
    token: int
    label: int
    head_id: int = -1  # the model's number of head `head` (capture --heads keeps some heads); -1: same as head

    @property
    def head_name(self) -> int:
        """The head as the model numbers it (what the dashboard shows)."""
        return self.head if self.head_id < 0 else self.head_id


def head_numbers(attrs: dict) -> list[int] | None:
    """The model's number of each head position of a store captured with --heads (its `heads` attr); None when
    the store keeps every head (position = number)."""
    heads = attrs.get("heads")
    return [int(h) for h in heads] if heads is not None else None


def head_number(attrs: dict, h: int) -> int:
    """The model's number of head position `h`."""
    numbers = head_numbers(attrs)
    return numbers[h] if numbers is not None and 0 <= h < len(numbers) else int(h)


def _clamp(key: str, lo: int, hi: int, default: int = 0) -> None:
    value = st.session_state.get(key, default)
    try:
        value = int(value)
    except (TypeError, ValueError):
        value = default
    st.session_state[key] = int(min(max(value, lo), hi))


DEFERRED_KEY = "_deferred_state"


def defer(**values: object) -> None:
    """Session-state writes for widget keys, applied at the start of the next script run (`apply_deferred`):
    for code that runs while the page draws (widgets already exist), followed by st.rerun()."""
    st.session_state.setdefault(DEFERRED_KEY, {}).update(values)


def apply_deferred() -> None:
    """Apply `defer`'s writes; the dashboard calls it before any widget is drawn."""
    for key, value in (st.session_state.pop(DEFERRED_KEY, None) or {}).items():
        st.session_state[key] = value


def select(**values: int) -> None:
    """Set parts of the selection (layer=, head=, step=, seq=, pos=); call from callbacks only."""
    for name, value in values.items():
        if value is not None:
            st.session_state[KEYS[name]] = int(value)


def select_cell(chart_key: str) -> None:
    """on_select callback of a layer x head chart: the clicked cell's customdata (layer, head[, step]) becomes
    the selection."""
    cd = clicked(chart_key)
    if cd is None or len(cd) < 2:
        return
    select(layer=int(cd[0]), head=int(cd[1]), step=int(cd[2]) if len(cd) > 2 else None)


def cell_clicks(chart_key: str) -> dict[str, Any]:
    """export.chart / st.plotly_chart keywords that make a layer x head chart select its cell on click."""
    from functools import partial

    return {"on_select": partial(select_cell, chart_key), "selection_mode": "points"}


def clicked(chart_key: str) -> list | None:
    """customdata of the first point selected (clicked) in plotly chart `chart_key`, or None.

    Plotly sends a point's customdata row as a list, or as {"0": .., "1": ..} when the figure held it as a
    typed array; both come back as a list.
    """
    try:
        points = st.session_state[chart_key]["selection"]["points"]
    except (KeyError, TypeError, AttributeError):
        return None
    for point in points or []:
        cd = point.get("customdata") if isinstance(point, dict) else None
        if isinstance(cd, dict):
            try:
                cd = [cd[k] for k in sorted(cd, key=int)]
            except ValueError:
                cd = list(cd.values())
        if isinstance(cd, (list, tuple)) and cd:
            return list(cd)
    return None


def go_to(page: str, **values: int) -> None:
    """Switch page (and selection) from a button callback: the drill-down links."""
    select(**values)
    st.session_state[PAGE_KEY] = page


@st.cache_data(show_spinner=False, max_entries=256)
def _token_row(path: str, stamp: float, seq: int, var: str) -> np.ndarray:
    from deltalab.app.dash.loading import _open

    ds = _open(path, stamp)
    if var not in ds:  # captured without --hooks tokens/labels: no ids, no labels
        return np.full(ds.sizes["pos"], 0 if var == "tokens" else IGNORE_INDEX, np.int64)
    return np.asarray(ds[var].isel(seq=seq).values).astype(np.int64)


def token_row(path: Any, seq: int, var: str = "tokens") -> np.ndarray:
    """Input tokens (or labels) of one sequence (one small read, cached)."""
    from deltalab.app.dash.loading import _stamp

    return _token_row(str(path), _stamp(path), int(seq), var)


def sidebar_selection(ds: Any, path: Any, names: list[str] | None) -> Selection:
    """Draw the selection widgets in the sidebar (after clamping stored values to this store) and return it."""
    layers = [int(x) for x in ds["layer"].values] if "layer" in ds.coords else [0]
    H, n_h = int(ds.sizes.get("head", 1)), int(ds.sizes.get("step", 1))
    n_seq, T = int(ds.sizes["seq"]), int(ds.sizes["pos"])
    if st.session_state.get(KEYS["layer"]) not in layers:
        st.session_state[KEYS["layer"]] = layers[0]
    _clamp(KEYS["head"], 0, H - 1)
    _clamp(KEYS["step"], 0, n_h - 1)
    _clamp(KEYS["seq"], 0, n_seq - 1)
    _clamp(KEYS["pos"], 0, T - 1)
    side = st.sidebar
    side.markdown("#### Selection")
    side.caption("Shared by every page; charts highlight it. Click a point in a chart to select its token.")
    c1, c2 = side.columns(2)
    c1.selectbox("Layer", layers, key=KEYS["layer"], bind="query-params", format_func=lambda x: f"layer {x}")
    numbers = head_numbers(ds.attrs)
    if numbers is None:
        c2.number_input("Head", 0, H - 1, step=1, key=KEYS["head"], bind="query-params")
    else:  # capture --heads: pick among the captured heads, shown with the model's numbers
        c2.selectbox("Head", list(range(H)), key=KEYS["head"], bind="query-params",
                     format_func=lambda h: f"head {numbers[h]}", help="The heads this store captured (--heads).")
    c1.number_input("Sequence", 0, n_seq - 1, step=1, key=KEYS["seq"], bind="query-params",
                    help="Index among the store's complete sequences.")
    c2.number_input("Position", 0, T - 1, step=1, key=KEYS["pos"], bind="query-params")
    if n_h > 1:
        side.segmented_control("Householder step", list(range(n_h)), key=KEYS["step"], bind="query-params",
                               format_func=lambda s: f"step {s}", required=True)
    layer = int(st.session_state[KEYS["layer"]])
    seq, pos = int(st.session_state[KEYS["seq"]]), int(st.session_state[KEYS["pos"]])
    tokens = token_row(path, seq)
    labels = token_row(path, seq, "labels")
    token, label = int(tokens[pos]), int(labels[pos])
    from deltalab.app.dash.derive import name_of
    from deltalab.app.dash.safe import markdown_text

    label_text = "none" if label < 0 else markdown_text(name_of(names, label))  # tokenizer strings: shown as text
    side.markdown(f"Selected token: **{markdown_text(name_of(names, token))}** at seq {seq}, pos {pos}  \n"
                  f"label: {label_text}")
    head = int(st.session_state[KEYS["head"]])
    return Selection(layer, layers.index(layer), head, int(st.session_state.get(KEYS["step"]) or 0), seq, pos, token,
                     label, head_number(ds.attrs, head) if numbers is not None else -1)


def first_occurrence(path: Any, seq: int, token: int, after: int = 0) -> int | None:
    """Position of the first `token` in sequence `seq` (at or after `after`, else from the start)."""
    row = token_row(path, seq)
    hits = np.flatnonzero(row == token)
    if not hits.size:
        return None
    later = hits[hits >= after]
    return int(later[0] if later.size else hits[0])
