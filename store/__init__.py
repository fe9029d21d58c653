"""Capture hook points into zarr v3 stores and read them back as lazy xarray Datasets.

    from deltalab import store
    ds = store.open("runs/s4.zarr")                 # complete sequences only, dask-backed
    ds_l0 = store.select(ds, layer=0, head=3, step=1)
    store.info("runs/s4.zarr")                      # sizes, completeness, provenance
    store.read_attrs("runs/s4.zarr")                # root attrs from the metadata alone (cheap)
    store.capture("ckpt/", "S4:length=128,samples=512,seed=0", "runs/s4.zarr")
    store.add_variables(path, xr.Dataset({"erank": da}))   # probe outputs beside the capture
    store.write_results(path, "pca", xr.Dataset(...), {"k": 3})

The schema (dims, variables, chunking, format version) is store.schema.
"""

from __future__ import annotations

from deltalab.store.capture import capture  # imports torch/nnsight lazily, inside the function
from deltalab.store.errors import (
    DataError,
    FormatVersionError,
    NotAStoreError,
    StoreError,
    StoreMismatchError,
    StoreWriteError,
    TruncatedStoreError,
)
from deltalab.store.reader import (  # noqa: A004
    check_store,
    info,
    list_results,
    metadata_mtime,
    open,
    open_results,
    partial_results_name,
    per_value_head,
    read_attrs,
    result_attrs,
    select,
)
from deltalab.store.schema import FORMAT_VERSION
from deltalab.store.writer import StoreWriter, add_variables, write_results

__all__ = [
    "FORMAT_VERSION",
    "DataError",
    "FormatVersionError",
    "NotAStoreError",
    "StoreError",
    "StoreMismatchError",
    "StoreWriteError",
    "StoreWriter",
    "TruncatedStoreError",
    "add_variables",
    "capture",
    "check_store",
    "info",
    "list_results",
    "partial_results_name",
    "metadata_mtime",
    "open",
    "open_results",
    "per_value_head",
    "read_attrs",
    "result_attrs",
    "select",
    "write_results",
]
