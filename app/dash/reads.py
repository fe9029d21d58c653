"""Small cached reads of the raw capture: one token's keys, betas and gate (-> its transition matrix)."""

from __future__ import annotations

import numpy as np
import streamlit as st

from deltalab.app.dash import loading
from deltalab.app.dash.derive import Transition, dplr_transition, transition


@st.cache_data(show_spinner=False, max_entries=256)
def _token_inputs(path: str, stamp: float, seq: int, li: int, pos: int, head: int) -> dict[str, np.ndarray]:
    ds = loading._open(path, stamp)
    one = ds[[v for v in ("k", "beta", "g", "kappa") if v in ds]].isel(seq=seq, layer=li, pos=pos, head=head).compute()
    out = {"k": np.asarray(one["k"].values, np.float64), "beta": np.asarray(one["beta"].values, np.float64)}
    for v in ("g", "kappa"):
        if v in one:
            out[v] = np.asarray(one[v].values, np.float64)
    return out


def token_transition(path, seq: int, li: int, pos: int, head: int) -> Transition | None:
    """The selected token's transition (None when the store lacks k or beta, or an rwkv7 store kappa or g)."""
    ds = loading._open(str(path), loading._stamp(path))
    if "k" not in ds or "beta" not in ds:
        return None
    a = _token_inputs(str(path), loading._stamp(path), int(seq), int(li), int(pos), int(head))
    g = a.get("g")
    if a["beta"].ndim == 2:  # rwkv7: beta [1, dk] per key channel, with kappa [1, dk] and g [dk]
        if "kappa" not in a or g is None:
            return None
        return dplr_transition(a["kappa"][0], a["beta"][0], g)
    return transition(a["k"], a["beta"], None if g is None else (float(g) if np.ndim(g) == 0 else g))
