"""The probe results behind the head cards and gallery: each probe's stored results (default group), else an
in-memory preview from the first sequences for the store-only probes, and the cached head table built from them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st
import xarray as xr

from deltalab.app.dash import heads, loading

PROBES = ("betas", "keys", "spectra", "erank", "linear")
PREVIEWABLE = ("betas", "keys", "spectra", "erank")
CHEAP = ("betas",)
"""Previewed for every head of any store (it reads one float per token and head)."""
PREVIEW_HEADS = 64
"""Above this many (layer, head) pairs, the gallery previews only CHEAP probes: keys, spectra and ranks of every
head of a real-size model take minutes on a CPU, and come from `deltalab probe` (run on the GPU) instead."""


def skipped_previews(path: Path, ds: xr.Dataset) -> list[str]:
    """Probes the gallery shows no preview for on this store (too many heads) and that have no results."""
    if ds.sizes.get("layer", 1) * ds.sizes.get("head", 1) <= PREVIEW_HEADS:
        return []
    return [p for p in PREVIEWABLE if p not in CHEAP and not loading.result_names(path, p)]


def sources(path: Path, ds: xr.Dataset, preview: bool = True,
            layers: tuple[int, ...] | None = None) -> tuple[dict[str, xr.Dataset | None], list[str]]:
    """({probe: results or None}, probes shown from a preview). `layers`: a real-size store previews only these
    (Compare needs two rows, not the whole gallery)."""
    out: dict[str, xr.Dataset | None] = {}
    previewed: list[str] = []
    for probe in PROBES:
        names = loading.result_names(path, probe)
        if names:
            out[probe] = loading.read_result(path, names[0])
        elif preview and probe in PREVIEWABLE and all(v in ds for v in ("k", "beta")) \
                and probe not in skipped_previews(path, ds):
            try:
                big = ds.sizes.get("layer", 1) * ds.sizes.get("head", 1) > PREVIEW_HEADS
                if big and layers:
                    out[probe] = _layer_previews(path, ds, probe, layers)
                else:
                    out[probe], _ = loading.preview(path, ds, probe, n_seq=2 if big else None)
                previewed.append(probe)
            except (ValueError, KeyError):
                out[probe] = None
        else:
            out[probe] = None
    return out, previewed


def _layer_previews(path: Path, ds: xr.Dataset, probe: str, layers: tuple[int, ...]) -> xr.Dataset:
    """The probe's two-sequence preview of each of `layers` (each cached on its own), as one result."""
    parts = [loading.preview(path, ds, probe, layer=layer, n_seq=2)[0] for layer in sorted(set(layers))]
    if len(parts) == 1:
        return parts[0]
    return xr.concat(parts, dim="layer", data_vars="minimal", coords="minimal", compat="override",
                     combine_attrs="override")


@st.cache_data(show_spinner=False, max_entries=16)
def _table(path: str, stamp: float, key: tuple, names: tuple[str, ...] | None,
           layers: tuple[int, ...] | None = None) -> pd.DataFrame:
    ds = loading._open(path, stamp)
    src, _ = sources(Path(path), ds, layers=layers)
    from deltalab.app.dash.state import head_numbers

    return heads.head_table(**src, token_names=list(names) if names else None, head_numbers=head_numbers(ds.attrs))


def table(path: Path, ds: xr.Dataset, names: list[str] | None, layers: list[int] | None = None
          ) -> tuple[pd.DataFrame, dict[str, xr.Dataset | None], list[str]]:
    """(head table, the sources it was built from, probes previewed); with `layers`, a real-size store's previews
    cover only those layers (their rows are the same as in the whole table)."""
    wanted = tuple(sorted(set(layers))) if layers else None
    src, previewed = sources(path, ds, layers=wanted)
    key = tuple((p, None if src[p] is None else str(src[p].attrs.get("created", "preview"))) for p in PROBES)
    df = _table(str(path), loading._stamp(path), key, tuple(names) if names else None, wanted)
    return df, src, previewed
