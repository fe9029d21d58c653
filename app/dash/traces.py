"""plotly traces built without plotly's per-property validation.

Every dashboard trace is built from arrays the dashboard made itself, and validating them cost about five times
the construction (0.50 s against 0.09 s for 24 scatter traces of 500 points), most of a page switch on a real-size
store. The serialised figure is the same (tested). Figures and layouts stay validated: their magic-underscore
updates (`title_text=`) need it.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go


def Scatter(*args: Any, **kw: Any) -> go.Scatter:  # noqa: N802 - named like the plotly class it builds
    return go.Scatter(*args, _validate=False, **kw)


def Heatmap(*args: Any, **kw: Any) -> go.Heatmap:  # noqa: N802
    return go.Heatmap(*args, _validate=False, **kw)


def Bar(*args: Any, **kw: Any) -> go.Bar:  # noqa: N802
    return go.Bar(*args, _validate=False, **kw)


def Histogram(*args: Any, **kw: Any) -> go.Histogram:  # noqa: N802
    return go.Histogram(*args, _validate=False, **kw)


def Box(*args: Any, **kw: Any) -> go.Box:  # noqa: N802
    return go.Box(*args, _validate=False, **kw)
