"""Charts answer clicks: the layer x head heatmaps (Betas, Spectra, Effective rank) carry invisible points over
their cells whose customdata is the cell's (layer, head[, step]); Streamlit's on_select callback makes it the
selection. Streamlit reports no selection for a click on a heatmap itself, so without the points a click on head 3
left the selected head where it was."""

from __future__ import annotations

import numpy as np

from deltalab.app.dash import export, figures, state


def _cells(fig):
    return [t for t in fig.data if t.type == "scatter" and t.name == "cells"]


def test_beta_heatmap_cells_carry_layer_head_and_step():
    values = np.random.default_rng(0).random((2, 2, 4))  # [layer, step, head]
    fig = figures.beta_step_heatmaps(values, [0, 5], 2.0, "mean β", highlight=(0, 0))
    cells = _cells(fig)
    assert len(cells) == 2  # one per Householder step's subplot
    for s, t in enumerate(cells):
        cd = np.asarray(t.customdata)
        assert cd.shape == (8, 3)
        for (x, y), (layer, head, step) in zip(zip(t.x, t.y), cd.tolist()):
            assert x == f"h{head}" and y == f"layer {layer}" and step == s  # each point sits on its own cell
        assert t.xaxis == ("x" if s == 0 else f"x{s + 1}")
    assert "cells" not in set(export.figure_table(fig)["trace"])  # exports show the data, not the click carriers


def test_layer_head_heatmap_cells_only_when_columns_are_heads():
    fig = figures.layer_head_heatmap(np.zeros((2, 3)), [1, 4], "t", "z")
    cd = np.asarray(_cells(fig)[0].customdata).tolist()
    assert cd == [[1, 0], [1, 1], [1, 2], [4, 0], [4, 1], [4, 2]]
    other = figures.layer_head_heatmap(np.zeros((2, 2)), [0, 1], "t", "z", col_labels=["all heads", "h0·s1"])
    assert not _cells(other)  # columns that are not heads select nothing


def test_a_click_on_a_cell_selects_its_layer_head_and_step(monkeypatch):
    session = {"beta_heat": {"selection": {"points": [{"customdata": {"0": 1, "1": 3, "2": 1}}]}},
               "rank_heat": {"selection": {"points": [{"customdata": [4, 2]}]}}, state.KEYS["step"]: 0}
    monkeypatch.setattr(state.st, "session_state", session)
    kw = state.cell_clicks("beta_heat")
    assert kw["selection_mode"] == "points"
    kw["on_select"]()
    assert (session[state.KEYS["layer"]], session[state.KEYS["head"]], session[state.KEYS["step"]]) == (1, 3, 1)
    state.cell_clicks("rank_heat")["on_select"]()
    assert (session[state.KEYS["layer"]], session[state.KEYS["head"]], session[state.KEYS["step"]]) == (4, 2, 1)


def test_the_points_carry_the_hover_that_the_heatmap_gave_up():
    """plotly sends no click for a trace whose hover is skipped: the points hover (with the cell's value) and the
    heatmap does not."""
    fig = figures.layer_head_heatmap(np.array([[0.25, 0.5]]), [2], "t", "fraction", fmt=".2f")
    heat, cells = fig.data[0], _cells(fig)[0]
    assert heat.hoverinfo == "skip" and cells.hoverinfo != "skip"
    assert list(cells.text) == ["layer 2, head 0<br>fraction = 0.25", "layer 2, head 1<br>fraction = 0.50"]
