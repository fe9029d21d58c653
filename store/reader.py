"""Open a deltalab store as a lazy, dask-backed xarray.Dataset; select layers/heads/steps; summarise.

Only sequences whose `complete` flag is set are visible by default, so a store a killed capture
left behind reads correctly. Every failure to open is a one-line StoreError naming the fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from deltalab.store import schema
from deltalab.store.errors import FormatVersionError, NotAStoreError, TruncatedStoreError, corrupt_chunk_line


def _read_json(path: Path, store: Path, what: str) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise TruncatedStoreError(
            f"{store} is truncated: {what} metadata ({path.relative_to(store)}) is missing or unreadable; "
            "recapture it (rerun the capture command into a new --out)") from None
    if not isinstance(meta, dict):
        raise TruncatedStoreError(f"{store} is truncated: {path.relative_to(store)} is not a JSON object")
    return meta


def check_store(path: str | Path) -> dict[str, Any]:
    """Validate `path` as a readable deltalab store of a supported format; return its root attrs."""
    path = Path(path)
    if not path.exists():
        raise NotAStoreError(f"store {path} does not exist: create it with `deltalab capture CHECKPOINT "
                             f"--data SPEC --out {path}`")
    root = path / "zarr.json"
    if not path.is_dir() or not root.exists():
        raise NotAStoreError(f"{path} is not a deltalab store (no zarr.json): pass the folder "
                             "`deltalab capture --out` wrote")
    meta = _read_json(root, path, "root")
    attrs = meta.get("attributes") or {}
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "group" or "deltalab_format" not in attrs:
        raise NotAStoreError(f"{path} is a zarr store but not a deltalab store (no deltalab_format "
                             "attribute): pass a store written by `deltalab capture`")
    version = attrs["deltalab_format"]
    if not isinstance(version, int) or version < 1:
        raise NotAStoreError(f"{path} has an invalid deltalab_format {version!r}: recapture it")
    if version > schema.FORMAT_VERSION:
        raise FormatVersionError(f"{path} has store format {version}, newer than this deltalab reads "
                                 f"(<= {schema.FORMAT_VERSION}): upgrade deltalab")
    missing = [k for k in schema.REQUIRED_ATTRS if k not in attrs]
    if missing:
        raise TruncatedStoreError(f"{path} is truncated: root attribute(s) {', '.join(missing)} missing; "
                                  "recapture it")
    problem = schema.attr_problem(attrs)  # types and ranges first: nothing below trusts a value it did not check
    if problem:
        raise TruncatedStoreError(f"{path}: {problem}; the store's metadata is damaged or was edited: recapture it")
    n_seq = sum(int(s["count"]) for s in attrs["segments"])
    for var in attrs["variables"]:
        vmeta = _read_json(path / var / "zarr.json", path, f"variable {var!r}")
        problem = schema.array_problem(var, vmeta, attrs)
        if problem:
            raise TruncatedStoreError(f"{path}: {problem}; the store's metadata is damaged or was edited: "
                                      "recapture it")
        shape = vmeta.get("shape") or [0]
        if vmeta.get("node_type") != "array" or int(shape[0]) < n_seq:
            raise TruncatedStoreError(f"{path} is truncated: variable {var!r} holds {shape[0]} of {n_seq} "
                                      "sequences; rerun the capture command to resume it")
    return attrs


def _missing_chunk(path: Path, attrs: dict[str, Any], complete: np.ndarray) -> str | None:
    """The line naming the captured chunk/shard files that are absent, or of another size than their layout gives
    (a truncated whole-shard file), for complete sequences, and the repair; None when every file is there (cheap:
    one stat per file; the bytes themselves are checked by their crc32c on read, and by `deltalab store verify`)."""
    import zarr

    from deltalab.store.shards import ShardLayout
    from deltalab.store.verify import Damage, Report, summary_line

    batch = int(attrs["batch_size"])
    chunk_ids = np.unique(np.flatnonzero(complete) // batch)
    report = Report(path, int(attrs["deltalab_format"]))
    for var in attrs["variables"]:
        tail = "/".join("0" for _ in schema.dims_of(var, attrs.get("sizes") or {})[1:])
        layout = ShardLayout.of(zarr.open_array(str(path / var), mode="r")) if tail else None
        for i in chunk_ids:
            key = f"c/{i}/{tail}" if tail else f"c/{i}"
            seq = (int(i) * batch, min(complete.size, (int(i) + 1) * batch))
            file = path / var / key
            if not file.is_file():
                report.damage.append(Damage(var, key, seq, "missing"))
            elif layout is not None and file.stat().st_size != layout.file_size:
                report.damage.append(Damage(var, key, seq, f"{file.stat().st_size} of {layout.file_size} bytes"))
    return None if report.clean else summary_line(report, attrs)


def open(path: str | Path, *, complete_only: bool = True, verify: bool = True,  # noqa: A001
         key_heads: str = "value", mask_padding: bool = True) -> Any:
    """Open store `path` as a lazy xarray.Dataset (dask arrays, one dask chunk per stored chunk).

    Coordinates: `seq` (global sequence index), `layer` (model layer index), `chunk_pos`
    (first token of each chunk boundary; the final state's is the sequence length).
    Root attributes (provenance) become `ds.attrs`. With `complete_only` (default), sequences
    whose capture did not finish are dropped. `verify` checks each complete sequence's chunk
    files exist with their layout's size (a stat per file) and raises TruncatedStoreError otherwise, naming the
    damaged sequences and the capture command that repairs them; the bytes are checked by their crc32c on read.
    Grouped heads (a `key_head` dim on disk): `key_heads="value"` (default) shows q and k per value
    head like every other variable (lazily, see per_value_head); `"key"` shows them as stored.
    Padded sequences (a `pad` variable): with `mask_padding` (default) every float variable is NaN at padded
    positions, and states whose chunk start lies past a sequence's first padded token are NaN, so no analysis
    reads padding (see mask_padding).

    Returns:
        xarray.Dataset: one lazy variable per captured hook with named dims, e.g. `beta` [seq, layer, pos, step,
        head], `k` [seq, layer, pos, step, head, dk], `state` [seq, layer, chunk, head, dk, dv], `tokens`
        [seq, pos] (store.schema lists every variable's dims), plus the probes' variables added beside them.

    Raises:
        StoreError (NotAStoreError, FormatVersionError, TruncatedStoreError, ...): one line naming the problem.
    """
    if key_heads not in ("value", "key"):
        raise ValueError(f"key_heads={key_heads!r}: use 'value' (q, k per value head) or 'key' (as stored)")
    import xarray as xr

    path = Path(path)
    attrs = check_store(path)
    try:
        ds = xr.open_zarr(str(path), consolidated=False, zarr_format=3, chunks={}, mask_and_scale=False,
                          use_zarr_fill_value_as_mask=False, decode_times=False)
        complete = np.asarray(ds["complete"].values, dtype=bool)
    except (OSError, ValueError, KeyError) as err:
        corrupt = corrupt_chunk_line(err, path)  # `complete` fails its crc32c: that line, not zarr's two checksums
        first = str(err).splitlines()[0] if str(err) else ""
        raise TruncatedStoreError(corrupt or f"{path} cannot be read ({type(err).__name__}: {first}); "
                                  "recapture it") from None
    if verify:
        missing = _missing_chunk(path, attrs, complete)
        if missing:
            raise TruncatedStoreError(f"{path} is damaged: {missing}")
    ds = _with_coords(ds, attrs, start=0)
    if complete_only and not complete.all():
        ds = _take_seq(ds, np.flatnonzero(complete))
    if mask_padding:
        ds = mask_padded(ds)
    return per_value_head(ds) if key_heads == "value" else ds


def _with_coords(ds: Any, attrs: dict[str, Any], start: int) -> Any:
    """The coordinates `open` gives (seq from `start`, real layer numbers, chunk_pos, key_head_of; with --heads the
    real head and key head numbers) and the root attributes as ds.attrs."""
    coords: dict[str, Any] = {"seq": np.arange(start, start + ds.sizes["seq"], dtype=np.int64)}
    if "layer" in ds.dims:
        coords["layer"] = np.asarray(attrs["layers"], dtype=np.int64)
    if "chunk" in ds.dims:
        length = int(attrs["sizes"]["pos"])
        starts = np.arange(ds.sizes["chunk"]) * int(attrs["chunk_size"])
        coords["chunk_pos"] = ("chunk", np.minimum(starts, length))
    if "head" in ds.dims and "heads" in attrs:  # --heads: the model's head numbers (as `layer`)
        coords["head"] = np.asarray(attrs["heads"], dtype=np.int64)
    if "key_head" in ds.dims:
        coords["key_head_of"] = ("head", np.asarray(attrs["key_head_of"], dtype=np.int64))
        if "key_heads" in attrs:
            coords["key_head"] = np.asarray(attrs["key_heads"], dtype=np.int64)
    ds = ds.assign_coords(coords)
    ds.attrs = dict(attrs)
    return ds


def mask_padded(ds: Any) -> Any:
    """NaN at padding (lazily): float variables with a `pos` dim where `pad`, and chunk-boundary states whose
    chunk start lies past the sequence's first padded token (they include padded tokens). No-op without pad."""
    if "pad" not in ds or not bool(ds["pad"].any()):
        return ds
    pad = ds["pad"].astype(bool)
    out = ds.copy()
    for name, var in ds.data_vars.items():
        if name != "pad" and "pos" in var.dims and np.issubdtype(var.dtype, np.floating):
            out[name] = var.where(~pad)
    if "state" in ds and "chunk_pos" in ds.coords:
        length = ds.sizes["pos"]
        first_pad = _first_padded(pad, length)
        out["state"] = ds["state"].where(ds["chunk_pos"] <= first_pad)
    out.attrs = ds.attrs
    return out


def _first_padded(pad: Any, length: int) -> Any:
    """Per sequence: the first padded position (`length` when none)."""
    has = pad.any("pos")
    return pad.argmax("pos").where(has, length)


def per_value_head(ds: Any) -> Any:
    """q and k of a grouped store indexed by value head (value head j reads key head `key_head_of[j]`).

    Lazy: dask takes the key heads when a block is computed; nothing is copied on disk. A store
    without a `key_head` dim is returned as it is. (With --heads, `key_head_of` holds model numbers and the
    stored key heads are `key_heads`: schema.key_head_positions maps one to the other.)
    """
    import xarray as xr

    if "key_head" not in ds.dims:
        return ds
    if "key_heads" in ds.attrs:
        positions = schema.key_head_positions(ds.attrs)
    else:
        positions = np.asarray(ds["key_head_of"].values, dtype=np.int64)
    index = xr.DataArray(np.asarray(positions, dtype=np.int64), dims="head")
    out = ds.copy()
    for var in [v for v in ds.data_vars if "key_head" in ds[v].dims]:
        out[var] = ds[var].isel(key_head=index).drop_vars(["key_head_of", "key_head"], errors="ignore")
    return out.drop_dims("key_head", errors="ignore")


def _take_seq(ds: Any, idx: np.ndarray) -> Any:
    """ds.isel(seq=idx) that keeps the stored seq chunks (dask's fancy indexing would rebalance them)."""
    import xarray as xr

    runs = np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1) if idx.size else []
    if len(runs) == 0 or len(runs) > 256:
        return ds.isel(seq=idx)
    parts = [ds.isel(seq=slice(int(r[0]), int(r[-1]) + 1)) for r in runs]
    if len(parts) == 1:
        return parts[0]
    return xr.concat(parts, dim="seq", data_vars="minimal", coords="minimal", compat="override",
                     join="override", combine_attrs="override")


def select(ds: Any, *, layer: Any = None, head: Any = None, step: Any = None, seq: Any = None) -> Any:
    """Narrow `ds` (Dataset or DataArray). `layer` and `seq` are coordinate values (model layer index,
    global sequence index); `head` and `step` are 0-based indices. Each accepts an int, a list or a
    slice; an int drops the dim. Variables without a dim are left as they are."""
    by_value = {k: v for k, v in (("layer", layer), ("seq", seq)) if v is not None}
    by_index = {k: v for k, v in (("head", head), ("step", step)) if v is not None}
    for dim in (*by_value, *by_index):
        if dim not in ds.dims:
            raise ValueError(f"cannot select {dim}: the data has no {dim!r} dimension "
                             f"(dims: {', '.join(map(str, ds.dims))})")
    try:
        if by_value:
            ds = ds.sel(by_value)
        if by_index:
            ds = ds.isel(by_index)
    except (KeyError, IndexError) as err:
        have = {d: (ds[d].values.tolist() if d in ds.coords else f"0..{ds.sizes[d] - 1}")
                for d in (*by_value, *by_index)}
        raise ValueError(f"selection out of range ({err}); available: {have}") from None
    return ds


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _metadata(meta: Path) -> dict[str, Any] | None:
    """A node's zarr.json as a dict; None when it is missing, unreadable or not a JSON object."""
    try:
        raw = json.loads(meta.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def _node_type(meta: Path) -> str | None:
    return (_metadata(meta) or {}).get("node_type")


def read_attrs(path: str | Path, group: str | None = None) -> dict[str, Any] | None:
    """Attributes of the store's root group, or of sub-group `group` ("results/pca"), from its metadata alone.

    Cheap (one small file read; no dataset is opened, nothing is validated), for callers that poll a store
    such as the dashboard; None when the group is missing or its metadata is unreadable.
    """
    folder = Path(path) / group if group else Path(path)
    meta = _metadata(folder / "zarr.json")
    if meta is None or meta.get("node_type") != "group":
        return None
    attrs = meta.get("attributes")
    return dict(attrs) if isinstance(attrs, dict) else {}


def metadata_mtime(path: str | Path, node: str | None = None) -> int:
    """Modification time (ns) of the metadata of the store's root, or of `node` (a variable or results group);
    0 when absent. It changes whenever capture or a probe rewrites that node, so it keys caches."""
    folder = Path(path) / node if node else Path(path)
    try:
        return (folder / "zarr.json").stat().st_mtime_ns
    except OSError:
        return 0


PARTIAL_PREFIX = ".partial-"  # a probe run's staging group, `<parent>/.partial-<leaf>`: hidden until renamed


RESULTS_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*(/[A-Za-z][A-Za-z0-9_.-]*)*$")
"""A results group name: '/'-separated parts, each a letter then letters, digits, `_ . -` (no '..', no '/' first)."""


def check_results_name(name: object) -> str:
    """`name` when it names a group inside `STORE/results`; else ValueError in one line. Called before any
    file is created, renamed or deleted for a probe run, so a hostile `--name ../../x` or `/abs/path` reaches
    no path outside the store."""
    if not isinstance(name, str) or not RESULTS_NAME.fullmatch(name) or len(name) > 200:
        raise ValueError(f"--name {str(name)[:80]!r} is not a results name: use letters, digits, _ . - "
                         "(and / between parts), starting with a letter, e.g. --name erank-run2")
    return name


def partial_results_name(name: str) -> str:
    """The hidden group a staged probe run writes before it takes `name` (probes.results.ResultSink); `name` is
    checked first (check_results_name)."""
    parent, _, leaf = check_results_name(name).rpartition("/")
    return f"{parent}/{PARTIAL_PREFIX}{leaf}" if parent else f"{PARTIAL_PREFIX}{leaf}"


def result_attrs(path: str | Path) -> dict[str, dict[str, Any]]:
    """{name: attributes} of every group under `results/`, sorted by name (nested names use '/'; a parent
    group of nested results is listed too), from metadata alone; hidden groups (a probe run still writing,
    `.partial-<leaf>`, or an interrupted run's `.old-<leaf>-<pid>`) are left out."""
    root = Path(path) / "results"
    if not root.is_dir():
        return {}
    names = sorted(meta.parent.relative_to(root).as_posix() for meta in root.rglob("zarr.json") if meta.parent != root)
    # hidden groups are never results: a probe run still writing (`.partial-<leaf>`), or the earlier group of a run
    # that died between its two renames (`.old-<leaf>-<pid>`, store.lock.recover_results puts it right)
    names = [n for n in names if not any(part.startswith(".") for part in n.split("/"))]
    attrs = {name: read_attrs(root, name) for name in names}
    return {name: a for name, a in attrs.items() if a is not None}


def list_results(path: str | Path) -> list[str]:
    """Names of the `results/<name>` sub-groups probes wrote: groups holding arrays (nested names use '/')."""
    root = Path(path) / "results"
    return [name for name in result_attrs(path)
            if any(_node_type(child / "zarr.json") == "array" for child in (root / name).iterdir() if child.is_dir())]


def open_results(path: str | Path, name: str, *, dask: bool = True) -> Any:
    """Open results sub-group `name` (written by store.write_results) as a lazy xarray.Dataset: dask-backed, or
    with `dask=False` lazily indexed arrays that read just the selected chunks on `.values` (no task graph: the
    dashboard reads a few small slices per page, where dask's scheduling cost more than the reads)."""
    import xarray as xr

    path = Path(path)
    check_store(path)
    if not (path / "results" / name / "zarr.json").exists():
        have = ", ".join(list_results(path)) or "none"
        raise NotAStoreError(f"{path} has no results {name!r} (has: {have})")
    return xr.open_zarr(str(path), group=f"results/{name}", consolidated=False, zarr_format=3,
                        chunks={} if dask else None)


def info(path: str | Path) -> dict[str, Any]:
    """Summary of a store: sizes, variables (dims, shape, dtype, bytes on disk), completeness, provenance."""
    path = Path(path)
    attrs = check_store(path)
    ds = open(path, complete_only=False, verify=False)
    complete = np.asarray(ds["complete"].values, dtype=bool)
    variables = {}
    order = list(schema.VARIABLES)
    names = sorted(map(str, ds.data_vars), key=lambda n: (order.index(n) if n in order else len(order), n))
    for name in names:
        da = ds[name]
        enc = da.encoding
        variables[str(name)] = {
            "dims": list(da.dims), "shape": list(da.shape), "dtype": str(da.dtype),
            "chunks": list(enc.get("chunks") or []), "shards": list(enc.get("shards") or []),
            "bytes": int(da.size * da.dtype.itemsize), "stored_bytes": _dir_bytes(path / str(name)),
            "captured": str(name) in attrs["variables"],
        }
    segments = []
    for seg in attrs["segments"]:
        start, count = int(seg["start"]), int(seg["count"])
        segments.append({**seg, "complete": int(complete[start:start + count].sum())})
    provenance = {k: v for k, v in attrs.items() if k not in ("segments", "variables", "sizes")}
    return {
        "path": str(path),
        "format": attrs["deltalab_format"],
        "sequences": int(sum(s["count"] for s in segments)),
        "complete": int(complete.sum()),
        "sizes": {"seq": int(complete.size), **attrs["sizes"]},
        "variables": variables,
        "segments": segments,
        "results": list_results(path),
        "stored_bytes": _dir_bytes(path),
        "provenance": provenance,
    }
