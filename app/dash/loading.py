"""Cached, lazy access to a store and its probe results for the dashboard, and readable messages for bad input.

Open stores and result groups are held with `st.cache_resource` (one lazy xarray.Dataset per path,
keyed by the metadata's modification time so a rerun of capture or a probe is picked up); derived
numpy arrays are cached by the pages with `st.cache_data`. Nothing here loads a bulk array.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st
import xarray as xr

from deltalab.app.dash.safe import code_text, markdown_text

AUTO_PREVIEW_HEADS = 64
"""Above this many (layer, head) pairs a page's preview waits for its toggle (on demand): pages stay instant."""

PREVIEW_TOKENS = {"erank": 1024, "keys": 4096, "spectra": 4096}
"""Tokens (of the selected layer) a preview computes from, when a store has no results of a probe yet (default
8192; erank rebuilds and decomposes every token's state, keys and spectra run per head: they take fewer)."""


@dataclass
class Problem:
    """Why a store cannot be shown: a title, the one-line reason and what to do."""

    kind: str  # "missing" | "not_a_store" | "newer" | "truncated" | "empty" | "other"
    title: str
    detail: str
    fix: str


_MEMORY: dict[str, tuple[float, xr.Dataset]] = {}
"""In-memory datasets (your own input) opened like stores: name -> (stamp, dataset); the newest MEMORY_MAX kept."""
MEMORY_MAX = 16


def register_memory(name: str, ds: xr.Dataset) -> Path:
    """Make `ds` openable under `name` by every page (as if it were a store folder); returns that path."""
    import time

    _MEMORY.pop(name, None)
    _MEMORY[name] = (float(time.time_ns()), ds)
    while len(_MEMORY) > MEMORY_MAX:
        _MEMORY.pop(next(iter(_MEMORY)))
    return Path(name)


def in_memory(path: Path | str | None) -> bool:
    """Whether `path` names a registered in-memory dataset."""
    return path is not None and str(path) in _MEMORY


def _stamp(path: Path) -> float:
    """Cache key of an open store: changes when capture rewrites its root or `complete` metadata."""
    if str(path) in _MEMORY:
        return _MEMORY[str(path)][0]
    from deltalab.store import metadata_mtime

    return metadata_mtime(path) + metadata_mtime(path, "complete")


@st.cache_resource(show_spinner=False, max_entries=8)
def _open(path: str, stamp: float) -> xr.Dataset:
    if path in _MEMORY:
        return _MEMORY[path][1]
    from deltalab import store
    from deltalab.probes.data import positional_heads

    # capture --heads: the dashboard indexes heads by position (as it does layers, by `li`); it shows the model's
    # numbers from the store's `heads` attr (state.head_number)
    return positional_heads(store.open(path))


def open_store(path: Path) -> tuple[xr.Dataset | None, Problem | None]:
    """The store as a lazy Dataset, or the Problem that stops it from opening (never raises for bad input)."""
    from deltalab import store

    try:
        ds = _open(str(path), _stamp(path))
    except store.FormatVersionError as err:
        return None, Problem("newer", "This store was written by a newer deltalab", str(err),
                             "Upgrade deltalab (`pip install -U deltalab`, or pull and reinstall the clone), "
                             "or open a store written by this version.")
    except store.NotAStoreError as err:
        if not path.exists():
            return None, Problem("missing", "No store at this path", str(err),
                                 f"Capture one: `deltalab capture CHECKPOINT --data S4:length=256,samples=128 "
                                 f"--out {path}`, or open an existing store with `deltalab app STORE`.")
        return None, Problem("not_a_store", "This folder is not a deltalab store", str(err),
                             "Pass the folder that `deltalab capture --out` wrote (it holds a zarr.json "
                             "with a `deltalab_format` attribute).")
    except store.TruncatedStoreError as err:
        return None, Problem("truncated", "This store is incomplete or damaged", str(err),
                             "Rerun the capture command that wrote it: it resumes, and recaptures only the damaged "
                             f"sequences (`deltalab store verify {path}` lists them).")
    except store.StoreError as err:
        return None, Problem("other", "This store cannot be opened", str(err), "See the message above.")
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, MemoryError,
            RuntimeError, RecursionError) as err:  # attributes of the wrong type, a corrupt chunk, a full disk
        from deltalab.store.errors import corrupt_chunk_line

        line = corrupt_chunk_line(err, path) or f"{type(err).__name__}: {err}".strip().splitlines()[0][:300]
        return None, Problem("other", "This store cannot be read", line,
                             "Check the path and permissions, or recapture it.")
    if ds.sizes.get("seq", 0) == 0:
        return None, Problem("empty", "This store has no complete sequences yet",
                             f"{path} was created but no sequence has finished capturing.",
                             "Run (or resume) the capture command that created it: "
                             + code_text(' '.join(map(str, ds.attrs.get('command_line') or
                                                      ['deltalab', 'capture', '...']))) + ".")
    return ds, None


def show_problem(problem: Problem, path: Path) -> None:
    """Render a Problem as an error box with the fix."""
    st.error(f"**{problem.title}:** {code_text(path)}\n\n{markdown_text(problem.detail)}")
    st.info(f"**What to do:** {problem.fix}")


# --- probe results -----------------------------------------------------------------------------

def _result_stamp(path: Path, name: str) -> float:
    from deltalab.store import metadata_mtime

    return metadata_mtime(path, f"results/{name}")


@st.cache_data(show_spinner=False, ttl=5)
def result_index(path: str) -> dict[str, dict[str, Any]]:
    """{group name: {probe, complete, created, n_seq}} of the result groups in the store (attrs only)."""
    from deltalab.store import result_attrs

    return {name: {"probe": attrs.get("probe"), "complete": bool(attrs.get("complete")),
                   "created": attrs.get("created"), "n_seq": attrs.get("n_seq"),
                   "n_records": len(attrs.get("records") or [])}
            for name, attrs in result_attrs(path).items() if "probe" in attrs}


@st.cache_resource(show_spinner=False, max_entries=64)
def _read_result(path: str, name: str, stamp: float) -> xr.Dataset:
    from deltalab.probes.results import read_results

    return read_results(path, name, dask=False)  # a page reads a few slices: no task graph per read


def result_names(path: Path, probe: str) -> list[str]:
    """Complete result groups written by `probe` (its default name first)."""
    index = result_index(str(path))
    names = [n for n, r in index.items() if r["probe"] == probe and r["complete"]]
    return sorted(names, key=lambda n: (n != probe, n))


def read_result(path: Path, name: str) -> xr.Dataset:
    """A result group as a lazy Dataset (attrs: provenance, records)."""
    return _read_result(str(path), name, _result_stamp(path, name))


def source(path: str, stamp: float, probe: str, result: str | None,
           n_preview: int | tuple[int, int | None]) -> xr.Dataset:
    """Inside cached functions: the result group `result`, or the preview of `probe` when it is None
    (`n_preview`: sequences, or `preview_key`'s (sequences, layer))."""
    if result is None:
        n, layer = n_preview if isinstance(n_preview, tuple) else (n_preview, None)
        return _preview(path, stamp, probe, n, layer)
    return _read_result(path, result, _result_stamp(Path(path), result))


def incomplete_results(path: Path, probe: str) -> list[str]:
    index = result_index(str(path))
    return [n for n, r in index.items() if r["probe"] == probe and not r["complete"]]


def probe_command(probe: str, path: Path, checkpoint: Path | None = None) -> str:
    """The exact command that writes a probe's results into the store."""
    cmd = f"deltalab probe {probe} --store {path}"
    if probe == "intervene":
        cmd += f" --checkpoint {checkpoint or 'CHECKPOINT'}"
    return cmd


def missing_results(probe: str, path: Path, what: str, checkpoint: Path | None = None) -> None:
    """The info box of a page whose probe has not been run on this store."""
    partial = incomplete_results(path, probe)
    note = (f" (results/{partial[0]} exists but is incomplete: the probe was interrupted)" if partial else "")
    st.info(f"**No `{probe}` results in this store yet**{note}. {what} Run:\n\n"
            f"```\n{probe_command(probe, path, checkpoint)}\n```\n"
            "then press **Reload** in the sidebar.")


@st.cache_resource(show_spinner=False, max_entries=16)
def _preview(path: str, stamp: float, probe: str, n_seq: int, layer: int | None = None) -> xr.Dataset:
    """The probe on the first `n_seq` sequences: of one layer (the page's selection; a real-size store has
    dozens, and a page shows one) or of every layer (`layer` None: the head gallery)."""
    import importlib

    from deltalab.app.dash import previews

    ds = _open(path, stamp).isel(seq=slice(0, n_seq))
    if layer is not None and "layer" in ds.dims and layer in ds["layer"].values:
        ds = ds.sel(layer=[layer])
    from deltalab.probes.data import relabel_heads

    out = previews.compute(importlib.import_module(f"deltalab.probes.{probe}"), ds)
    return relabel_heads(out, None, ds.attrs.get("heads"))[0]  # labelled like stored results (capture --heads)


def preview_n(ds: xr.Dataset, probe: str) -> int:
    """Sequences a preview of `probe` covers: about PREVIEW_TOKENS tokens, at least 2 (probes split by sequence)."""
    n = max(2, PREVIEW_TOKENS.get(probe, 8192) // max(1, ds.sizes.get("pos", 1)))
    return int(min(n, ds.sizes["seq"]))


def preview_key(ds: xr.Dataset, probe: str, layer: int | None) -> tuple[int, int | None]:
    """What identifies a page's preview in `source`: (sequences, the selected layer)."""
    return preview_n(ds, probe), layer


def preview(path: Path, ds: xr.Dataset, probe: str, layer: int | None = None,
            n_seq: int | None = None) -> tuple[xr.Dataset, int]:
    """An in-memory run of `probe` on the first few sequences (`n_seq`, default `preview_n`; nothing is written),
    of layer `layer` only when given: (dataset, n_seq)."""
    n = min(n_seq, ds.sizes["seq"]) if n_seq else preview_n(ds, probe)
    where = f" of layer {layer}" if layer is not None else ""
    with st.spinner(f"Computing a `{probe}` preview from the first {n} sequence(s){where}…"):
        return _preview(str(path), _stamp(path), probe, n, layer), n
