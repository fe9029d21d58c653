"""Write probe results into the store as the zarr group `results/<name>` and read them back.

The first write goes through `store.write_results` (it guards the captured data and root
attributes); later parts of the same result (summaries computed from the per-token arrays just
written) are appended to that group. The group's `complete` attr turns True only when the probe
has finished, and its `records` attr holds the JSON records. A probe run from the command line writes into a
hidden `.partial-<name>` group that replaces `results/<name>` when it finishes (`ResultSink(staged=True)`).
Reading is `store.open_results`.
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import xarray as xr

from deltalab.models.run_files import clean_json
from deltalab.probes.core import ProbeError, ProbeResult
from deltalab.probes.data import clean_encoding, relabel_heads


def results_group(name: str) -> str:
    """zarr group path of a probe's results inside the store."""
    return f"results/{name}"


def _progress(ds: xr.Dataset):
    """A dask progress bar on stderr when writing lazy arrays (stdout is kept for --json)."""
    if any(v.chunks is not None for v in ds.data_vars.values()):
        from dask.diagnostics import ProgressBar

        return ProgressBar(minimum=2.0, out=sys.stderr)
    return nullcontext()


def write_results(path: str | Path, name: str, ds: xr.Dataset, attrs: dict[str, Any] | None = None) -> xr.Dataset:
    """Replace `results/<name>` with `ds` (lazy arrays are computed chunk by chunk); return it lazily reopened."""
    from deltalab.store import write_results as store_write

    ds = clean_encoding(ds)
    ds.attrs = clean_json({**ds.attrs, **(attrs or {})})
    with _progress(ds):
        store_write(path, name, ds, ds.attrs)
    return read_results(path, name)


def append_results(path: str | Path, name: str, ds: xr.Dataset) -> xr.Dataset:
    """Add variables to an existing `results/<name>` group (dims must agree with what is there)."""
    import zarr

    from deltalab.store.schema import checksummed

    ds = checksummed(clean_encoding(ds))  # new arrays get zstd + crc32c, as write_results' do
    group = zarr.open_group(str(path), path=results_group(name), mode="r", zarr_format=3)
    ds.attrs = dict(group.attrs)  # xarray rewrites the group's attrs on append: keep the provenance
    with _progress(ds):
        ds.to_zarr(str(path), group=results_group(name), mode="a", zarr_format=3, consolidated=False)
    return read_results(path, name)


def update_attrs(path: str | Path, name: str, attrs: dict[str, Any]) -> None:
    """Merge JSON attributes into `results/<name>`."""
    import zarr

    group = zarr.open_group(str(path), path=results_group(name), mode="r+", zarr_format=3)
    group.attrs.update(clean_json(attrs))


def read_results(path: str | Path, name: str, *, dask: bool = True) -> xr.Dataset:
    """The results of probe run `name` as a lazy xarray.Dataset (attrs: provenance, records, complete); `dask`
    as in store.open_results."""
    from deltalab.store import open_results

    if not (Path(path) / results_group(name) / "zarr.json").exists():
        have = list_results(path) if Path(path).exists() else []
        raise ProbeError(f"{path} has no results {name!r} (it has {', '.join(have) or 'none'}): "
                         f"run `deltalab probe {name.split('/')[0]} --store {path}`")
    return open_results(path, name, dask=dask)


def list_results(path: str | Path) -> list[str]:
    """Names of the result groups in a store."""
    from deltalab.store import list_results as store_list

    return store_list(path)


class ResultSink:
    """Where a probe run writes: one results group, filled in one or more parts, then marked complete.

    `name` is checked first (store.reader.check_results_name: a ValueError in one line for '..', an absolute
    path or other characters), so no file outside `STORE/results` is ever created, renamed or removed.
    `staged`: the run writes into a hidden sibling group (`.partial-<name>`, not listed) that replaces
    `results/<name>` only when the run finishes, so a run that fails keeps the earlier results whole (`abort`
    removes the partial group)."""

    def __init__(self, path: str | Path, name: str, attrs: dict[str, Any] | None = None,
                 heads: list[int] | None = None, staged: bool = False) -> None:
        from deltalab.store import partial_results_name
        from deltalab.store.reader import check_results_name

        check_results_name(name)  # before anything is created, renamed or deleted under the name
        self.path = Path(path)
        self.final = name
        self.name = partial_results_name(name) if staged else name
        if staged:  # a run that died between the two renames of _publish: finish or undo them first
            from deltalab.store.lock import recover_results

            recover_results(self.path)
        self.attrs = dict(attrs or {})
        self.started = False
        self.heads = heads  # capture --heads: the model's head numbers, the stored results' `head` coordinate

    def write(self, ds: xr.Dataset) -> xr.Dataset:
        """First part replaces the group; later parts are appended. Returns the group, lazily reopened (head
        coordinates dropped: the probe goes on with head positions)."""
        if self.heads is not None:
            ds = relabel_heads(ds, None, self.heads)[0]
            written = self._write(ds)
            return written.drop_vars([d for d in ("head", "probe_head") if d in written.coords])
        return self._write(ds)

    def _write(self, ds: xr.Dataset) -> xr.Dataset:
        if not self.started:
            self.started = True
            return write_results(self.path, self.name, ds, {**self.attrs, "complete": False})
        return append_results(self.path, self.name, ds)

    def finish(self, result: ProbeResult) -> None:
        """Write whatever of `result.dataset` is not stored yet, then the records and `complete=True` (the result
        already labelled with the model's head numbers: probes.data.relabel_heads)."""
        if not self.started:
            self._write(result.dataset)
        else:
            have = set(read_results(self.path, self.name).variables)
            rest = result.dataset.drop_vars([v for v in result.dataset.variables if v in have])
            rest = rest.drop_dims([d for d in rest.dims if not any(d in v.dims for v in rest.data_vars.values())])
            if rest.data_vars:
                append_results(self.path, self.name, rest)
        extra = {k: v for k, v in result.dataset.attrs.items() if k not in ("records", "complete")}
        update_attrs(self.path, self.name, {**extra, "records": result.records, "complete": True})
        if self.name != self.final:
            self._publish()

    def _publish(self) -> None:
        """The finished partial group takes the results' name; the earlier group is removed after the rename."""
        root = self.path / "results"
        final, partial = root / self.final, root / self.name
        old = final.with_name(f".old-{final.name}-{os.getpid()}") if final.exists() else None
        if old is not None:
            final.rename(old)
        partial.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.name = self.final

    def abort(self) -> None:
        """Remove a staged run's partial group (the earlier results stay as they were)."""
        if self.name != self.final:
            shutil.rmtree(self.path / "results" / self.name, ignore_errors=True)

