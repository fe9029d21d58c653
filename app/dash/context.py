"""What every page receives: the store (lazy), the linked selection, token names and access to probe results."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import streamlit as st
import xarray as xr

from deltalab.app.dash import loading
from deltalab.app.dash.derive import name_of
from deltalab.app.dash.state import Selection


@dataclass
class Context:
    """The open store and the selection; `result(probe)` finds that probe's results (or offers a preview)."""

    path: Path
    ds: xr.Dataset
    sel: Selection
    names: list[str] | None
    chosen: dict[str, str] = field(default_factory=dict)  # probe -> result group shown
    _checkpoint: Any = field(default=False, repr=False)

    # --- store facts ---------------------------------------------------------------------------
    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.ds.attrs)

    @property
    def cfg(self) -> dict[str, Any]:
        return dict(self.attrs.get("model_config") or {})

    @property
    def layers(self) -> list[int]:
        return [int(x) for x in self.ds["layer"].values] if "layer" in self.ds.coords else [0]

    @property
    def n_heads(self) -> int:
        return int(self.ds.sizes.get("head", 1))

    @property
    def n_h(self) -> int:
        return int(self.ds.sizes.get("step", 1))

    @property
    def length(self) -> int:
        return int(self.ds.sizes["pos"])

    @property
    def beta_max(self) -> float:
        return 2.0 if self.cfg.get("allow_neg_eigval", True) else 1.0

    @property
    def gated(self) -> bool:
        return "g" in self.ds

    @property
    def train_length(self) -> int | None:
        value = self.attrs.get("train_length")
        return int(value) if isinstance(value, int) and value > 0 else None

    @property
    def checkpoint(self) -> Path | None:
        if self._checkpoint is False:
            from deltalab.app.dash.derive import find_checkpoint

            self._checkpoint = find_checkpoint(self.attrs)
        return self._checkpoint

    def token_name(self, token: int) -> str:
        return name_of(self.names, int(token))

    def token_labels(self, tokens: np.ndarray) -> list[str]:
        return [name_of(self.names, int(t)) for t in tokens]

    # --- results --------------------------------------------------------------------------------
    def result(self, probe: str) -> xr.Dataset | None:
        """The probe's complete results (its default group, else the first other one), or None."""
        names = loading.result_names(self.path, probe)
        if not names:
            return None
        if len(names) > 1:
            name = st.selectbox(f"`{probe}` results", names, key=f"result_{probe}",
                                help="This store holds several result groups of this probe (--name).")
        else:
            name = names[0]
        self.chosen[probe] = name
        return loading.read_result(self.path, name)

    def layer_index(self, res: xr.Dataset) -> int | None:
        """Index of the selected layer in a probe's results; a warning (and None) if they do not cover it."""
        layers = [int(x) for x in res["layer"].values]
        if self.sel.layer not in layers:
            st.warning(f"Layer {self.sel.layer} is not in these results (they cover layers {layers}).")
            return None
        return layers.index(self.sel.layer)

    def result_or_preview(self, probe: str, what: str, preview: bool = True) -> tuple[xr.Dataset | None, bool]:
        """(results, is_preview): the stored results, else an info box with the command and, if `preview`,
        an in-memory run of the probe on the first few sequences."""
        res = self.result(probe)
        if res is not None:
            return res, False
        if loading.in_memory(self.path):  # your own input: computed from it, nothing to run
            res, _ = loading.preview(self.path, self.ds, probe, self.sel.layer)
            st.caption(f"Preview: `{probe}` computed from your input ({self.length} tokens).")
            return res, True
        loading.missing_results(probe, self.path, what, self.checkpoint if probe == "intervene" else None)
        if not preview:
            return None, False
        big = self.ds.sizes.get("layer", 1) * self.ds.sizes.get("head", 1) > loading.AUTO_PREVIEW_HEADS
        on = st.toggle("Show a preview computed from the first sequences (not saved)", value=not big,
                       key=f"preview_{probe}", persist_state="session",
                       help="Off by default on real-size models: a preview computes the analysis on the spot "
                            "(about a second per layer on a CPU); the probe's stored results load at once.")
        if not on:
            return None, False
        try:
            res, n = loading.preview(self.path, self.ds, probe, self.sel.layer)
        except (ValueError, KeyError, RuntimeError) as err:
            from deltalab.probes.base import error_line  # a corrupt chunk: the store and the fix
            from deltalab.store.errors import reraise_unless_input_error

            reraise_unless_input_error(err)

            st.warning(f"The preview could not be computed: {error_line(err, self.path)}")
            return None, False
        st.caption(f"Preview: `{probe}` computed in memory from the first {n} of {self.ds.sizes['seq']} sequences.")
        return res, True
