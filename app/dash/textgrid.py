"""A sequence as text: its tokens laid out in rows like the text they are (a new row at every newline and document
start, wrapped at a fixed width), each cell coloured by a per-token quantity. Pure numpy + plotly, no Streamlit.

Token strings come from the checkpoint's tokenizer.json for text stores (bytes when there is none) and are the
token ids for task stores (their names go in the hover text). Per-token quantities of one sequence and layer:
beta, fraction of betas above 1, rotation angle of the token's Householder product, effective rank, loss.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go

import deltalab.app.dash.figures  # noqa: F401  (sets the dashboard's default plotly template, plotly_white)
from deltalab.app.dash import traces as tr

SHOWN = {"\n": "↵", "\t": "→", "\r": "␍"}
"""Whitespace drawn visibly in a cell (a space stays blank)."""


# --- token strings -------------------------------------------------------------------------------

def is_text_store(attrs: dict[str, Any]) -> bool:
    """Whether the store's data is text (tokenised documents) rather than task tokens."""
    meta = attrs.get("data_meta") or {}
    return (isinstance(meta, dict) and meta.get("kind") == "text") or str(attrs.get("data_spec", "")).startswith(
        ("text:", "input:text"))


def tokenizer_file(checkpoint: Path | None) -> Path | None:
    """tokenizer.json beside the checkpoint, if any: a regular file within models.files.JSON_LIMIT (a larger one
    is not a tokenizer; the bytes fallback is used)."""
    if checkpoint is None:
        return None
    from deltalab.models.files import JSON_LIMIT

    f = Path(checkpoint) / "tokenizer.json"
    try:
        return f if f.is_file() and f.stat().st_size <= JSON_LIMIT else None
    except OSError:
        return None


def vocab_strings(tokenizer: Path | None, vocab_size: int) -> list[str]:
    """The text of every token id 0..vocab_size-1: decoded by tokenizer.json, else as bytes (ids >= 256 named
    after the tokenizer's special tokens or '<id>')."""
    specials: dict[int, str] = {}
    if tokenizer is not None:
        try:
            raw = json.loads(Path(tokenizer).read_text())
            specials = {int(t["id"]): str(t["content"]) for t in raw.get("added_tokens") or []}
        except (OSError, ValueError, KeyError, TypeError):
            specials = {}
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tokenizer))
            return [specials.get(i) or tok.decode([i], skip_special_tokens=False) for i in range(vocab_size)]
        except Exception:  # noqa: BLE001 - an unreadable tokenizer falls back to bytes
            pass
    out = []
    for i in range(vocab_size):
        if i in specials:
            out.append(specials[i])
        elif i < 256:
            out.append(bytes([i]).decode("latin-1") if i >= 0x80 else chr(i))
        else:
            out.append(f"<{i}>")
    return out


def cell_text(s: str, width: int = 3) -> str:
    """What a cell shows for token text `s` (whitespace made visible, long tokens cut)."""
    if s in SHOWN:
        return SHOWN[s]
    if s.startswith("<|") and s.endswith("|>"):
        return "␄"
    shown = "".join(SHOWN.get(c, c) for c in s)
    if not shown.isprintable():
        shown = "".join(c if c.isprintable() else "·" for c in shown)
    return shown if len(shown) <= width else shown[: width - 1] + "…"


# --- layout ----------------------------------------------------------------------------------------

@dataclass
class Layout:
    """Row and column of every token; `row_start[r]` is the position of row r's first token."""

    row: np.ndarray
    col: np.ndarray
    row_start: list[int]
    n_cols: int

    @property
    def n_rows(self) -> int:
        return len(self.row_start)


def layout(strings: Sequence[str], doc_start: np.ndarray | None, width: int) -> Layout:
    """Rows of at most `width` tokens; a row ends after a newline token and before a document start."""
    n = len(strings)
    row, col = np.zeros(n, np.int64), np.zeros(n, np.int64)
    r = c = 0
    starts = [0] if n else []
    for p in range(n):
        if p > 0 and (c >= width or (doc_start is not None and bool(doc_start[p]))):
            r, c = r + 1, 0
            starts.append(p)
        row[p], col[p] = r, c
        c += 1
        if strings[p].endswith("\n") and p + 1 < n:
            r, c = r + 1, 0
            starts.append(p + 1)
    return Layout(row, col, starts, int(min(width, max(1, int(col.max()) + 1 if n else 1))))


# --- per-token quantities ----------------------------------------------------------------------------

def rotation_angles(keys: np.ndarray, betas: np.ndarray) -> np.ndarray:
    """keys [T, n_h, dk], betas [T, n_h] -> [T] largest |arg| (degrees) of the non-trivial eigenvalues of each
    token's Householder product, from the n_h x n_h compact-WY matrix (as derive.transition, batched)."""
    k = np.asarray(keys, np.float64)
    b = np.asarray(betas, np.float64)
    T, n = b.shape
    gram = k @ k.transpose(0, 2, 1)  # [T, n, n]
    eye = np.broadcast_to(np.eye(n), (T, n, n))
    lower = b[:, :, None] * np.tril(gram, -1)
    upper = b[:, :, None] * np.triu(gram)
    ok = np.isfinite(lower).all((1, 2)) & np.isfinite(upper).all((1, 2))
    out = np.full(T, np.nan)
    if ok.any():
        c = np.linalg.solve(eye[ok] + lower[ok], eye[ok] - upper[ok])
        eig = np.linalg.eigvals(c)
        out[ok] = np.degrees(np.abs(np.angle(eig))).max(-1)
    return out


QUANTITIES = ("β", "fraction β > 1", "rotation angle", "effective rank", "loss")
"""What the text view colours tokens by (see `quantity_spec`)."""


@dataclass(frozen=True)
class Spec:
    """How a quantity is drawn: colour scale and range, and what the hover calls it."""

    label: str
    colorscale: str
    zmin: float
    zmax: float
    fmt: str = ".3f"


def quantity_spec(name: str, *, head: int, step: int, beta_max: float, rank_max: float,
                  loss_max: float = 8.0) -> Spec:
    """The Spec of one of QUANTITIES for the selected head and step."""
    if name == "β":
        return Spec(f"β (head {head}, step {step})", "Viridis", 0.0, beta_max)
    if name == "fraction β > 1":
        return Spec("fraction of β > 1 (all heads and steps)", "Reds", 0.0, 1.0, ".2f")
    if name == "rotation angle":
        return Spec(f"rotation angle ° (head {head})", "Plasma", 0.0, 180.0, ".1f")
    if name == "effective rank":
        return Spec(f"effective rank (head {head})", "Cividis", 0.0, rank_max, ".2f")
    if name == "loss":
        return Spec("loss (nats)", "YlOrRd", 0.0, loss_max)
    raise ValueError(f"unknown quantity {name!r}; choose one of {', '.join(QUANTITIES)}")


# --- the figure --------------------------------------------------------------------------------------

def _grid(lay: Layout, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """values at (row, col) of the tokens in `mask`, NaN elsewhere: [n_rows, n_cols]."""
    z = np.full((lay.n_rows, lay.n_cols), np.nan)
    z[lay.row[mask], lay.col[mask]] = values[mask]
    return z


def text_figure(strings: Sequence[str], hover_names: Sequence[str], values: np.ndarray, spec: Spec,
                lay: Layout, *, positions: np.ndarray, doc_start: np.ndarray | None, selected_pos: int | None,
                title: str, labels: Sequence[str] | None = None, row_height: int = 22) -> go.Figure:
    """Tokens as coloured cells at (col, row) with their text (a heatmap), under invisible points that carry the
    hover (position, token, value, label) and the click: customdata per point is [position, value]."""
    values = np.asarray(values, np.float64)
    n = len(strings)
    has = np.isfinite(values)
    texts = np.full((lay.n_rows, lay.n_cols), "", dtype=object)
    texts[lay.row, lay.col] = [cell_text(s) for s in strings]
    fig = go.Figure()
    if (~has).any():  # tokens without a value: light grey cells
        fig.add_trace(tr.Heatmap(z=_grid(lay, np.zeros(n), ~has), text=texts, texttemplate="%{text}",
                                 colorscale=[[0, "#ececec"], [1, "#ececec"]], showscale=False, hoverinfo="skip",
                                 xgap=1, ygap=2, name="no value", textfont=dict(family="monospace", color="#444")))
    fig.add_trace(tr.Heatmap(
        z=_grid(lay, values, has), text=texts, texttemplate="%{text}", colorscale=spec.colorscale, zmin=spec.zmin,
        zmax=spec.zmax, hoverinfo="skip", xgap=1, ygap=2, name=spec.label,
        textfont=dict(family="monospace"),
        colorbar=dict(title=dict(text=spec.label, side="right"), thickness=12, lenmode="pixels",
                      len=max(80, min(300, row_height * lay.n_rows)))))
    hover = [f"pos {int(p)} · token {h}" + (f"<br>next/label: {labels[i]}" if labels is not None else "")
             + (f"<br>{spec.label} = {format(values[i], spec.fmt)}" if has[i] else "<br>no value")
             for i, (p, h) in enumerate(zip(positions, hover_names))]
    fig.add_trace(tr.Scatter(
        x=lay.col, y=lay.row, mode="markers", name="tokens", showlegend=False,
        marker=dict(symbol="square", size=max(6, row_height - 6), opacity=0.0, color="black"),
        customdata=np.stack([np.asarray(positions, np.float64), values], 1), hovertext=hover,
        hovertemplate="%{hovertext}<extra></extra>", unselected=dict(marker=dict(opacity=0.0)),
        selected=dict(marker=dict(opacity=0.0))))
    if doc_start is not None:
        for i in np.flatnonzero(np.asarray(doc_start, bool)):
            x, y = lay.col[i] - 0.5, lay.row[i]
            fig.add_shape(type="line", x0=x, x1=x, y0=y - 0.5, y1=y + 0.5, line=dict(color="#2ca02c", width=4))
    if selected_pos is not None:
        hit = np.flatnonzero(np.asarray(positions) == selected_pos)
        if hit.size:
            i = int(hit[0])
            fig.add_shape(type="rect", x0=lay.col[i] - 0.5, x1=lay.col[i] + 0.5, y0=lay.row[i] - 0.5,
                          y1=lay.row[i] + 0.5, line=dict(color="black", width=3))
    fig.update_xaxes(range=[-0.5, lay.n_cols - 0.5], visible=False, fixedrange=True)
    tick_rows = list(range(0, lay.n_rows, max(1, lay.n_rows // 30)))
    first = int(positions[0]) if n else 0
    fig.update_yaxes(range=[lay.n_rows - 0.5, -0.5], tickvals=tick_rows,
                     ticktext=[str(lay.row_start[r] - lay.row_start[0] + first) for r in tick_rows],
                     title_text="position", showgrid=False, zeroline=False, fixedrange=True, tickfont=dict(size=10))
    fig.update_layout(title=dict(text=title, x=0.0, xanchor="left", font=dict(size=15)),
                      height=70 + 30 + row_height * lay.n_rows, margin=dict(l=60, r=20, t=60, b=30),
                      plot_bgcolor="white", hovermode="closest", dragmode=False)
    return fig
