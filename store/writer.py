"""Create, append to and resume deltalab stores; write batches, then their `complete` flags.

Crash safety rests on three facts: zarr's LocalStore (and store.shards, for whole shards) writes
every chunk/shard atomically (temp file + rename), each batch of sequences owns whole chunks
along `seq`, and a batch's `complete` flags are written only after all its arrays. A killed
capture therefore leaves a store whose complete sequences are intact; rerunning the same command
rewrites the rest.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from deltalab.store import schema
from deltalab.store.errors import StoreMismatchError, StoreWriteError
from deltalab.store.shards import ShardLayout

IDENTITY_KEYS = ("checkpoint_digest", "model_config", "variables", "layers", "heads", "dtype", "chunk_size",
                 "sizes", "batch_size")
"""Root attrs that must agree for a capture to append to / resume an existing store."""


@dataclass(frozen=True)
class Segment:
    """The sequences one data spec contributed: global seq indices [start, start + count)."""

    data_spec: str
    start: int
    count: int
    data_digest: str = ""  # sha256 of the segment's tokens and labels (a resume must see the same data)

    @property
    def stop(self) -> int:
        return self.start + self.count


def _json_clean(attrs: dict[str, Any]) -> dict[str, Any]:
    """Round-trip through JSON: attributes are data (no NaN, no objects), and must compare equal on reload."""
    try:
        return json.loads(json.dumps(attrs, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"store attributes must be plain JSON data ({err})") from None


def _write_error(path: Path, err: OSError, done: int) -> StoreWriteError:
    """One-line error for an OSError while writing (disk full, permissions ...)."""
    what = "disk full" if err.errno == errno.ENOSPC else (err.strerror or str(err))
    return StoreWriteError(
        f"writing {path} failed ({what}); the {done} complete sequence(s) are kept: "
        "free space (or fix the cause) and rerun the same command to resume"
    )


def _describe_mismatch(key: str, old: Any, new: Any) -> str:
    if key == "checkpoint_digest":
        return f"another checkpoint ({str(old)[:19]}..., this one {str(new)[:19]}...)"
    if key == "model_config":
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        shown = ", ".join(f"{k} {old.get(k)!r} vs {new.get(k)!r}" for k in diff[:3])
        return f"another model config ({shown})"
    if key == "batch_size":
        return f"batch size {old} (this capture {new}; pass --batch-size {old} or omit it)"
    if key == "sizes":
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return "other sizes (" + ", ".join(f"{k} {old.get(k)} vs {new.get(k)}" for k in diff) + ")"
    if key == "chunk_size":
        return (f"states every {old} tokens (this capture every {new}; pass --state-every "
                f"{int(old) // schema.CHUNK_SIZE} or omit it)")
    if key == "heads":
        def show(h: Any) -> str:
            return "all heads" if h is None else "heads " + ",".join(map(str, h))
        fix = f"pass --heads {','.join(map(str, old))}" if old is not None else "omit --heads"
        return f"{show(old)} (this capture {show(new)}; {fix} or write to a new --out)"
    return f"other {key} ({old} vs {new})"


class StoreWriter:
    """Write access to one deltalab store (a zarr v3 group on the local file system)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.group = zarr.open_group(str(self.path), mode="r+", zarr_format=3)
        self.attrs: dict[str, Any] = dict(self.group.attrs)
        self._arrays: dict[str, zarr.Array] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._layouts: dict[str, ShardLayout | None] = {}
        self.fast_shards = True  # write whole shards with store.shards (False: always through zarr)
        self.repaired: list[int] = []  # sequences a resume found damaged and recaptures (store.capture)

    # --- opening ------------------------------------------------------------------------

    @classmethod
    def create_or_append(cls, path: str | Path, attrs: dict[str, Any], data_spec: str,
                         count: int, data_digest: str = "") -> tuple[StoreWriter, Segment]:
        """Open `path` for this capture, creating the store if needed.

        `attrs` are the root attributes of a new store (schema.REQUIRED_ATTRS except `segments`
        and `data_spec`, which are managed here). An existing store must agree on IDENTITY_KEYS
        (else StoreMismatchError); a data spec it already holds resumes that segment, a new one
        is appended after the existing sequences.
        """
        from deltalab.store.reader import check_store  # the reader owns "is this a readable store?"

        path = Path(path)
        attrs = _json_clean(attrs)
        if not (path / "zarr.json").exists():
            if path.exists() and any(path.iterdir()):
                raise StoreMismatchError(f"{path} exists and is not a deltalab store: choose a new --out")
            segment = Segment(data_spec, 0, count, data_digest)
            cls._create(path, {**attrs, "data_spec": data_spec,
                               "segments": [segment.__dict__]}, count)
            return cls(path), segment
        check_store(path)
        writer = cls(path)
        writer.check_identity(attrs)
        writer.remove_partial_files()
        for seg in writer.segments():
            if seg.data_spec == data_spec:
                if seg.count != count:
                    raise StoreMismatchError(
                        f"{path} already holds {seg.count} sequences of data spec {data_spec!r}, "
                        f"the data now gives {count}: use the same data or a new --out")
                if seg.data_digest and data_digest and seg.data_digest != data_digest:
                    raise StoreMismatchError(
                        f"the data of spec {data_spec!r} changed since {path} captured it (digest "
                        f"{seg.data_digest[:19]}... vs {data_digest[:19]}...): "
                        "restore the data or use a new --out")
                return writer, seg
        return writer, writer._append_segment(data_spec, count, data_digest)

    @classmethod
    def _create(cls, path: Path, attrs: dict[str, Any], n_seq: int) -> None:
        """Build the empty store beside `path`, then rename it into place: a crash leaves no half store."""
        from deltalab.store.lock import remove_creating_leftovers

        remove_creating_leftovers(path)
        tmp = path.parent / f".{path.name}.creating-{os.getpid()}"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        sizes = {**attrs["sizes"], "seq": n_seq}
        batch = int(attrs["batch_size"])
        group = zarr.open_group(str(tmp), mode="w-", zarr_format=3)
        for var in attrs["variables"]:
            spec = schema.VARIABLES[var]
            chunks, shards = schema.chunking(var, sizes, batch)
            group.create_array(
                var, shape=schema.shape_of(var, sizes), chunks=chunks, shards=shards,
                dtype=schema.storage_dtype(var, attrs["dtype"]), fill_value=spec.fill,
                dimension_names=schema.dims_of(var, sizes), compressors=schema.compressors_for(var),
                attributes={"description": spec.doc},
            )
        group.attrs.update(attrs)
        os.replace(tmp, path)  # onto nothing or an empty folder (checked by the caller)

    def check_identity(self, attrs: dict[str, Any]) -> None:
        """Refuse (one line) a capture that differs from the store on an IDENTITY_KEYS attribute."""
        for key in IDENTITY_KEYS:
            if key == "heads" and self.attrs.get(key) != attrs.get(key):  # absent = all heads, on either side
                raise StoreMismatchError(f"{self.path} holds a capture of "
                                         f"{_describe_mismatch(key, self.attrs.get(key), attrs.get(key))}")
            if key in attrs and self.attrs.get(key) != attrs[key]:
                what = _describe_mismatch(key, self.attrs.get(key), attrs[key])
                raise StoreMismatchError(
                    f"{self.path} holds a capture of {what}: appending would mix them; write to a new --out")

    def _append_segment(self, data_spec: str, count: int, data_digest: str = "") -> Segment:
        """Grow every captured array along seq and record the segment (attrs last: a crash re-appends)."""
        segs = self.segments()
        start = segs[-1].stop if segs else 0
        segment = Segment(data_spec, start, count, data_digest)
        for var in self.attrs["variables"]:
            arr = self.array(var)
            arr.resize((segment.stop, *arr.shape[1:]))
        self.attrs["segments"] = [*self.attrs["segments"], segment.__dict__]
        self.group.attrs.update({"segments": self.attrs["segments"]})
        return segment

    def repair(self, segment: Segment, progress: bool = False) -> list[Any]:
        """Verify the chunks of `segment`'s sequences (their sizes and checksums: store.verify) and make the damaged
        ones pending again: their `complete` flags are cleared first (readers stop seeing them), then the damaged
        files are removed, so the capture rewrites those batches as an uninterrupted one would have. Returns the
        damage found (store.verify.Damage); a crash in between leaves flags cleared, which the next run rewrites."""
        from deltalab.store.verify import verify

        report = verify(self.path, seq_range=(segment.start, segment.stop), captured_only=True, progress=progress)
        if report.clean:
            return []
        n_seq = int(self.array("complete").shape[0])
        batch = self.batch_size
        for d in report.damage:  # a damaged flag chunk first: clearing flags around it would read it
            if d.array == "complete":
                (self.path / d.array / d.key).unlink(missing_ok=True)
        seq_chunks = sorted({s // batch for s in report.damaged_sequences()})
        for i in seq_chunks:
            lo, hi = i * batch, min(n_seq, (i + 1) * batch)
            self.array("complete")[lo:hi] = False
        for d in report.damage:
            if d.array != "complete":
                (self.path / d.array / d.key).unlink(missing_ok=True)
        return report.damage

    def remove_partial_files(self) -> None:
        """Delete temp files (`*.partial`) a killed writer left behind; they were never part of the store."""
        for tmp in self.path.rglob("*.partial"):
            tmp.unlink(missing_ok=True)

    # --- state --------------------------------------------------------------------------

    def segments(self) -> list[Segment]:
        return [Segment(**s) for s in self.attrs.get("segments", [])]

    def segment(self, data_spec: str) -> Segment:
        for seg in self.segments():
            if seg.data_spec == data_spec:
                return seg
        raise StoreMismatchError(f"{self.path} holds no capture of data spec {data_spec!r}")

    def array(self, var: str) -> zarr.Array:
        if var not in self._arrays:
            # write_empty_chunks: every written chunk exists on disk, so the reader can verify them
            self._arrays[var] = self.group[var].with_config({"write_empty_chunks": True})
        return self._arrays[var]

    @property
    def batch_size(self) -> int:
        return int(self.attrs["batch_size"])

    def batches(self, segment: Segment) -> Iterator[tuple[int, int]]:
        """[start, stop) ranges of `segment`, cut at the store's seq-chunk boundaries."""
        b = self.batch_size
        start = segment.start
        while start < segment.stop:
            stop = min(segment.stop, (start // b + 1) * b)
            yield start, stop
            start = stop

    def pending(self, segment: Segment) -> list[tuple[int, int]]:
        """Batches of `segment` not yet complete (all of a batch's flags are set at once)."""
        done = self.array("complete")[segment.start:segment.stop]
        s0 = segment.start
        return [(a, b) for a, b in self.batches(segment) if not done[a - s0:b - s0].all()]

    def n_complete(self) -> int:
        return int(np.count_nonzero(self.array("complete")[:]))

    # --- writing ------------------------------------------------------------------------

    def write_batch(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Write sequences [start, start + n) of every captured variable, then set their complete flags."""
        wanted = [v for v in self.attrs["variables"] if v != "complete"]
        missing = sorted(set(wanted) - set(arrays))
        if missing:
            raise ValueError(f"batch lacks variable(s) {', '.join(missing)}")
        n = len(next(iter(arrays.values())))
        for var in wanted:
            shape = (n, *self.array(var).shape[1:])
            if np.shape(arrays[var]) != shape:
                raise ValueError(f"{var}: batch shape {np.shape(arrays[var])} != store shape {shape}")

        def write(var: str) -> None:
            arr = self.array(var)
            values = np.asarray(arrays[var]).astype(arr.dtype, copy=False)
            layout = self._layout(var)
            if layout is not None and start % self.batch_size == 0 and n == layout.shard_shape[0]:
                layout.write((start // n, *([0] * (values.ndim - 1))), values)
            else:  # partial or unshardable chunk: zarr merges it into the stored shard
                arr[start:start + n] = values

        try:
            # variables go to separate files: write them concurrently (page-cache copies run in parallel)
            futures = [self._pool().submit(write, var) for var in wanted]
            wait(futures)  # all of them, so nothing is still writing when an error is raised
            for future in futures:
                future.result()
            self.array("complete")[start:start + n] = True  # only after every array of the batch
        except OSError as err:
            raise _write_error(self.path, err, self._safe_n_complete()) from None

    def _layout(self, var: str) -> ShardLayout | None:
        """Whole-shard fast path of `var` (None: zarr writes it)."""
        if var not in self._layouts:
            self._layouts[var] = ShardLayout.of(self.array(var)) if self.fast_shards else None
        return self._layouts[var]

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="deltalab-write")
        return self._executor

    def _safe_n_complete(self) -> int:
        try:
            return self.n_complete()
        except OSError:
            return -1

    def update_attrs(self, attrs: dict[str, Any]) -> None:
        """Add provenance attributes (never IDENTITY_KEYS or segments)."""
        attrs = _json_clean(attrs)
        bad = sorted(set(attrs) & {*IDENTITY_KEYS, "segments", "deltalab_format"})
        if bad:
            raise ValueError(f"attribute(s) {', '.join(bad)} are managed by the store and cannot be set")
        self.attrs.update(attrs)
        self.group.attrs.update(attrs)


# --- probe outputs -----------------------------------------------------------------------

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*(/[A-Za-z][A-Za-z0-9_.-]*)*$")


def add_variables(path: str | Path, ds: Any, *, overwrite: bool = False) -> list[str]:
    """Add the variables of xarray Dataset `ds` to the store root (e.g. `erank[seq,layer,pos,head]`).

    `seq` and `layer` are matched by coordinate (as `store.open` gives them), so a subset of
    sequences or layers may be written; the rest stay NaN/fill. Other dims shared with the store
    must have the store's sizes. Captured variables are never touched. Returns the names written.
    """
    from deltalab.store.reader import check_store

    path = Path(path)
    check_store(path)
    w = StoreWriter(path)
    sizes = {**w.attrs["sizes"], "seq": int(w.array("complete").shape[0])}
    existing = {name: dict(zip(a.metadata.dimension_names or (), a.shape, strict=False))
                for name, a in w.group.arrays()}
    layer_index = {int(layer): i for i, layer in enumerate(w.attrs["layers"])}
    written = []
    for name, da in ds.data_vars.items():
        name = str(name)
        if not _NAME.match(name) or "/" in name:
            raise ValueError(f"variable name {name!r} is not a plain identifier")
        if name in schema.VARIABLES:
            raise ValueError(f"{name!r} is a captured variable name; probes must use another name")
        if name in existing and not overwrite:
            raise ValueError(f"{path} already has variable {name!r}; pass overwrite=True to replace it")
        full = {}
        for d, n in zip(da.dims, da.shape, strict=True):
            d = str(d)
            if d in ("seq", "layer"):
                full[d] = sizes[d]
                continue
            other = next((dims[d] for v, dims in existing.items() if d in dims and v != name), sizes.get(d))
            if other is not None and other != n:
                raise ValueError(f"{name}: dim {d} has length {n} but the store's is {other}")
            full[d] = n
        dims = tuple(str(d) for d in da.dims)
        shape = tuple(full[d] for d in dims)
        seq_chunk = w.batch_size
        chunks = tuple(seq_chunk if d == "seq" else max(1, full[d]) for d in dims)
        dtype = np.dtype(da.dtype)
        fill = float("nan") if dtype.kind == "f" else (False if dtype.kind == "b" else 0)
        attrs = _json_clean(dict(da.attrs))
        arr = w.group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=fill,
                                   dimension_names=dims, attributes=attrs, overwrite=overwrite,
                                   compressors=schema.checked_compressors())
        index = []
        for d in dims:
            if d == "seq":
                coord = da["seq"].values if "seq" in da.coords else np.arange(da.sizes["seq"])
                index.append(np.asarray(coord, dtype=np.int64))
            elif d == "layer":
                coord = da["layer"].values if "layer" in da.coords else np.asarray(w.attrs["layers"])
                try:
                    index.append(np.asarray([layer_index[int(c)] for c in coord], dtype=np.int64))
                except KeyError as err:
                    raise ValueError(f"{name}: layer {err.args[0]} was not captured in {path}") from None
            else:
                index.append(np.arange(full[d]))
        _write_blocks(arr, da, dims, index, seq_chunk)
        written.append(name)
    return written


def _write_blocks(arr: zarr.Array, da: Any, dims: tuple[str, ...], index: list[np.ndarray],
                  block: int) -> None:
    """Write `da` into `arr` at orthogonal `index`, `block` sequences at a time (bounded memory)."""
    if "seq" not in dims:
        arr.set_orthogonal_selection(tuple(index), np.asarray(da.values))
        return
    axis = dims.index("seq")
    n = len(index[axis])
    for lo in range(0, n, block):
        part = da.isel(seq=slice(lo, lo + block))
        sel = list(index)
        sel[axis] = index[axis][lo:lo + block]
        order = np.argsort(sel[axis], kind="stable")
        sel[axis] = sel[axis][order]
        values = np.take(np.asarray(part.values), order, axis=axis)
        arr.set_orthogonal_selection(tuple(sel), values)


def write_results(path: str | Path, name: str, ds: Any, attrs: dict[str, Any] | None = None,
                  *, overwrite: bool = True) -> str:
    """Write xarray Dataset `ds` as sub-group `results/<name>` of the store (probe outputs).

    Captured arrays and root attributes are untouched. Returns the group path.
    """
    import xarray as xr  # noqa: F401 - ds is an xarray.Dataset

    from deltalab.store.reader import PARTIAL_PREFIX, check_store

    path = Path(path)
    check_store(path)
    parent, _, leaf = name.rpartition("/")
    plain = f"{parent}/{leaf.removeprefix(PARTIAL_PREFIX)}" if parent else leaf.removeprefix(PARTIAL_PREFIX)
    if not _NAME.match(plain):
        raise ValueError(f"results name {name!r} must be letters, digits, _ . - (and / for nesting)")
    group = f"results/{name}"
    if (path / group / "zarr.json").exists() and not overwrite:
        raise ValueError(f"{path} already has results {name!r}; pass overwrite=True to replace them")
    out = schema.checksummed(ds)  # zstd + crc32c: a corrupt chunk fails its checksum even if it decodes
    out.attrs = {**_json_clean(dict(ds.attrs)), **_json_clean(attrs or {})}
    root_meta = (path / "zarr.json").read_bytes()
    out.to_zarr(str(path), group=group, mode="w", zarr_format=3, consolidated=False)
    if (path / "zarr.json").read_bytes() != root_meta:  # never expected; guard the captured provenance
        (path / "zarr.json").write_bytes(root_meta)
    return group
