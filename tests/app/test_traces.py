"""The dashboard's unvalidated plotly traces serialise exactly as plotly's validated ones, and its line marks draw
one shape (and one label) each."""

from __future__ import annotations

import json

import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.utils import PlotlyJSONEncoder

from deltalab.app.dash import figures
from deltalab.app.dash import traces as tr


def _json(fig: go.Figure) -> str:
    return json.dumps(fig.to_plotly_json(), cls=PlotlyJSONEncoder, sort_keys=True)


@pytest.mark.parametrize("name,kwargs", [
    ("Scatter", dict(x=np.arange(5), y=np.linspace(0, 1, 5), mode="markers+text", text=list("abcde"),
                     marker=dict(size=6, color=["red"] * 5, line=dict(width=1, color="white")),
                     customdata=np.ones((5, 2)), hovertemplate="%{x}<extra></extra>")),
    ("Heatmap", dict(z=np.eye(3), x=["a", "b", "c"], zmin=-1, zmax=1, colorscale="RdBu", xgap=1,
                     colorbar=dict(title="z"))),
    ("Bar", dict(x=[1, 2, 3], y=[0.2, 0.3, 0.5], marker_color="#4c78a8", opacity=0.7)),
    ("Histogram", dict(x=np.arange(4), y=np.ones(4), histfunc="sum", xbins=dict(start=0, end=4, size=1))),
    ("Box", dict(y=np.random.default_rng(0).standard_normal(20), name="b", boxpoints=False)),
])
def test_unvalidated_trace_serialises_like_plotlys(name: str, kwargs: dict) -> None:
    ours = go.Figure(getattr(tr, name)(**kwargs))
    theirs = go.Figure(getattr(go, name)(**kwargs))
    assert _json(ours) == _json(theirs)
    assert ours.data[0].type == name.lower()


def test_unvalidated_trace_still_takes_figure_updates() -> None:
    fig = go.Figure(tr.Histogram(x=[1, 2], marker_color="red"))
    fig.update_traces(marker_line_width=2)
    assert fig.to_plotly_json()["data"][0]["marker"] == {"color": "red", "line": {"width": 2}}


def test_vline_and_hline_draw_one_shape_and_label_each() -> None:
    fig = go.Figure(tr.Scatter(x=[0, 10], y=[0, 1]))
    figures.vline(fig, 3.0, "mark", "crimson", where="top left")
    figures.vline(fig, 5.0, None, "black", dash="solid", width=1)
    figures.hline(fig, 0.5, "half", "#999")
    shapes = fig.layout.shapes
    assert [(s.x0, s.x1, s.xref, s.yref) for s in shapes] == [(3.0, 3.0, "x", "paper"), (5.0, 5.0, "x", "paper"),
                                                              (0, 1, "paper", "y")]
    assert [a.text for a in fig.layout.annotations] == ["mark", "half"]
    assert fig.layout.annotations[0].xanchor == "right" and fig.layout.shapes[0].line.color == "crimson"


def test_rank_lines_draw_ranks_taken_every_nth_token():
    """`--rank-every N` leaves NaN between ranked tokens: a plain line through them draws nothing, so the lines join
    the ranked tokens (with markers); every-token ranks keep plain lines over every position."""
    T, H, every = 64, 3, 16
    values = np.full((T, H), np.nan)
    values[every - 1::every] = np.arange(1, 1 + H)[None, :] + np.arange(T // every)[:, None]
    fig = figures.rank_lines(values, "erank", train_length=None, doc_starts=[], selected_head=0, selected_pos=None,
                             title="t")
    for h, trace in enumerate(fig.data):
        assert list(trace.x) == [15, 31, 47, 63] and "markers" in trace.mode
        assert np.isfinite(np.asarray(trace.y, dtype=float)).all() and trace.y[0] == 1 + h
        assert [int(c[0]) for c in trace.customdata] == list(trace.x)  # a click still names the real position
    dense = figures.rank_lines(np.ones((T, H)), "erank", train_length=None, doc_starts=[], selected_head=0,
                               selected_pos=None, title="t")
    assert len(dense.data[0].x) == T and dense.data[0].mode == "lines"


def test_compare_curves_join_strided_ranks():
    import pandas as pd

    from deltalab.app.dash import compare

    curve = np.full(64, np.nan)
    curve[15::16] = [1.0, 2.0, 3.0, 4.0]
    fig = compare.erank_figure([compare.Side("a", pd.Series({"erank_curve": list(curve)})),
                                compare.Side("b", pd.Series({"erank_curve": list(np.ones(64))}))])
    strided, dense = fig.data
    assert list(strided.x) == [15, 31, 47, 63] and list(strided.y) == [1.0, 2.0, 3.0, 4.0]
    assert "markers" in strided.mode and dense.mode == "lines" and len(dense.x) == 64
