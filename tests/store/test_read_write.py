"""Store schema, writer and reader on synthetic arrays: layout, visibility, resume, append, errors, probes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from deltalab import store
from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.store import schema
from deltalab.store.writer import StoreWriter
from tests.conftest import fill_disk

SIZES = {"pos": 70, "layer": 2, "head": 3, "step": 2, "dk": 4, "dv": 5, "chunk": schema.n_chunks(70),
         "hidden": 8}
VARS = schema.variables_for(schema.DEFAULT_HOOKS, gated=True)


def make_attrs(**over):
    attrs = {
        "deltalab_format": schema.FORMAT_VERSION,
        "model_config": {"model_type": "gated_deltaproduct", "h": 3},
        "checkpoint_digest": "sha256:" + "ab" * 32, "deltalab_version": "test", "command_line": ["test"],
        "chunk_size": CHUNK_SIZE, "created": "2026-01-01T00:00:00+00:00",
        "hooks": list(schema.DEFAULT_HOOKS),
        "variables": VARS, "layers": [0, 3], "dtype": "float16", "batch_size": 4, "sizes": SIZES,
    }
    attrs.update(over)
    return attrs


def batch_arrays(start: int, stop: int, dtype: str = "float16") -> dict[str, np.ndarray]:
    """Deterministic synthetic batch: values depend on the global sequence index only."""
    out = {}
    for var in VARS:
        if var == "complete":
            continue
        shape = schema.shape_of(var, {**SIZES, "seq": stop - start})
        rows = []
        for s in range(start, stop):
            rng = np.random.default_rng([s, len(var)])
            rows.append(rng.integers(0, 20, shape[1:]) if var in ("tokens", "labels")
                        else np.zeros(shape[1:], bool) if var == "pad"
                        else rng.random(shape[1:]) > 0.5 if var in ("doc_start", "correct")
                        else rng.standard_normal(shape[1:]))
        out[var] = np.stack(rows).astype(schema.storage_dtype(var, dtype))
    return out


SPEC = "S4:length=70,samples=10,seed=0"


def write_all(path: Path, n: int, spec: str = SPEC, stop_after: int | None = None):
    w, seg = StoreWriter.create_or_append(path, make_attrs(), spec, n, "sha256:data")
    for i, (a, b) in enumerate(w.pending(seg)):
        if stop_after is not None and i >= stop_after:
            break
        w.write_batch(a, batch_arrays(a, b))
    return w, seg


def tree_bytes(path: Path, skip_root: bool = False) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and not (skip_root and p.relative_to(path).as_posix() == "zarr.json")}


def test_schema_layout_and_lazy_open(tmp_path):
    path = tmp_path / "s.zarr"
    write_all(path, 10)
    g = zarr.open_group(str(path), mode="r")
    k = g["k"]
    assert k.metadata.dimension_names == ("seq", "layer", "pos", "step", "head", "dk")
    assert k.chunks == (4, 1, 70, 2, 3, 4) and k.shards == (4, 2, 70, 2, 3, 4)
    assert k.dtype == np.float16 and g["loss"].dtype == np.float32 and g["labels"].dtype == np.int32
    ds = store.open(path)
    assert set(ds.data_vars) == set(VARS)
    assert ds["q"].dims == ("seq", "layer", "pos", "head", "dk")
    assert ds["state"].dims == ("seq", "layer", "chunk", "head", "dk", "dv")
    assert ds["beta"].dims == ("seq", "layer", "pos", "step", "head")
    assert hasattr(ds["k"].data, "dask") and ds["k"].chunks[0] == (4, 4, 2)
    assert ds["layer"].values.tolist() == [0, 3] and ds["chunk_pos"].values.tolist() == [0, 64, 70]
    assert ds.attrs["deltalab_format"] == schema.FORMAT_VERSION and ds.attrs["batch_size"] == 4
    expect = batch_arrays(4, 8)
    np.testing.assert_array_equal(ds["k"].isel(seq=slice(4, 8)).values, expect["k"])
    np.testing.assert_array_equal(ds["labels"].isel(seq=slice(4, 8)).values, expect["labels"])
    sub = store.select(ds, layer=3, head=1, step=0, seq=[5, 6])
    np.testing.assert_array_equal(sub["k"].values, expect["k"][1:3, 1, :, 0, 1])
    assert sub["tokens"].dims == ("seq", "pos")
    with pytest.raises(ValueError, match="out of range"):
        store.select(ds, layer=7)


def test_only_complete_sequences_visible_and_resume_is_bit_identical(tmp_path):
    full, part = tmp_path / "full.zarr", tmp_path / "part.zarr"
    write_all(full, 10)
    w, seg = write_all(part, 10, stop_after=1)
    # a batch written without its complete flag (as if killed between the data and the flags)
    w.array("q")[4:8] = batch_arrays(4, 8)["q"]
    ds = store.open(part)
    assert ds["seq"].values.tolist() == [0, 1, 2, 3]
    assert store.open(part, complete_only=False).sizes["seq"] == 10
    assert store.info(part)["complete"] == 4
    w2, seg2 = StoreWriter.create_or_append(part, make_attrs(created="later"), SPEC, 10, "sha256:data")
    assert seg2 == seg and w2.pending(seg2) == [(4, 8), (8, 10)]
    for a, b in w2.pending(seg2):
        w2.write_batch(a, batch_arrays(a, b))
    assert tree_bytes(part) == tree_bytes(full)  # root attrs too: a resume never rewrites them


def test_append_and_mismatch_refused(tmp_path):
    path = tmp_path / "s.zarr"
    write_all(path, 6)
    w, seg = StoreWriter.create_or_append(path, make_attrs(), "S4:length=70,samples=5,seed=1", 5, "sha256:d2")
    assert (seg.start, seg.stop) == (6, 11)
    assert w.pending(seg) == [(6, 8), (8, 11)]  # the first batch shares a chunk with the old segment
    for a, b in w.pending(seg):
        w.write_batch(a, batch_arrays(a, b))
    ds = store.open(path)
    assert ds.sizes["seq"] == 11
    expect = np.concatenate([batch_arrays(0, 6)["v"], batch_arrays(6, 11)["v"]])
    np.testing.assert_array_equal(ds["v"].values, expect)
    cases = [
        (make_attrs(checkpoint_digest="sha256:" + "cd" * 32), "another checkpoint"),
        (make_attrs(model_config={"model_type": "gated_deltaproduct", "h": 4}), "another model config"),
        (make_attrs(dtype="float32"), "other dtype"),
        (make_attrs(sizes={**SIZES, "pos": 80}), "other sizes"),
        (make_attrs(batch_size=8), "--batch-size 4"),
    ]
    for attrs, msg in cases:
        with pytest.raises(store.StoreMismatchError, match=msg) as err:
            StoreWriter.create_or_append(path, attrs, "S4:length=70,samples=9,seed=9", 9)
        assert "\n" not in str(err.value)
    with pytest.raises(store.StoreMismatchError, match="changed"):
        StoreWriter.create_or_append(path, make_attrs(), "S4:length=70,samples=5,seed=1", 5, "sha256:other")
    assert store.open(path).sizes["seq"] == 11  # nothing lost


def test_shard_writer_and_zarr_write_identical_stores(tmp_path):
    """Whole batches go through store.shards, the partial last batch and appended segments through zarr."""
    trees = []
    for fast in (True, False):
        path = tmp_path / f"{fast}.zarr"
        for spec, n in ((SPEC, 10), ("S4:length=70,samples=7,seed=1", 7)):  # 4 + 4 + 2; then 2 + 4 + 1
            w, seg = StoreWriter.create_or_append(path, make_attrs(), spec, n, "sha256:data")
            w.fast_shards = fast
            assert (w._layout("k") is not None) == fast
            for a, b in w.pending(seg):
                w.write_batch(a, batch_arrays(a, b))
        trees.append(tree_bytes(path, skip_root=True))
    assert trees[0] == trees[1]
    np.testing.assert_array_equal(store.open(tmp_path / "True.zarr")["v"].values, batch_arrays(0, 17)["v"])


@pytest.mark.parametrize("fast_shards", [True, False], ids=["shard-writer", "zarr-writer"])
def test_disk_full_keeps_complete_sequences(tmp_path, monkeypatch, fast_shards):
    full, path = tmp_path / "full.zarr", tmp_path / "s.zarr"
    write_all(full, 10)
    w, seg = StoreWriter.create_or_append(path, make_attrs(), SPEC, 10, "sha256:data")
    w.fast_shards = fast_shards
    w.write_batch(0, batch_arrays(0, 4))
    with monkeypatch.context() as patch:
        fill_disk(patch, lambda key: key.startswith("v/c/1/"))  # k of batch 1 lands, v does not
        with pytest.raises(store.StoreWriteError) as err:
            w.write_batch(4, batch_arrays(4, 8))
    msg = str(err.value)
    assert "disk full" in msg and "4 complete" in msg and "\n" not in msg
    assert any(p.is_file() for p in (path / "k" / "c" / "1").rglob("*"))  # k's shard landed
    assert not list(path.rglob("*.partial"))  # the failed write left no temp file
    ds = store.open(path)
    assert ds["seq"].values.tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(ds["k"].values, batch_arrays(0, 4)["k"])
    w2, seg2 = StoreWriter.create_or_append(path, make_attrs(), seg.data_spec, 10, "sha256:data")
    for a, b in w2.pending(seg2):
        w2.write_batch(a, batch_arrays(a, b))
    assert tree_bytes(path) == tree_bytes(full)


def test_open_errors_are_one_line(tmp_path):
    cases = []
    with pytest.raises(store.NotAStoreError, match="does not exist") as e:
        store.open(tmp_path / "missing.zarr")
    cases.append(e)
    (tmp_path / "plain").mkdir()
    with pytest.raises(store.NotAStoreError, match="not a deltalab store") as e:
        store.open(tmp_path / "plain")
    cases.append(e)
    zarr.open_group(str(tmp_path / "other.zarr"), mode="w", zarr_format=3)
    with pytest.raises(store.NotAStoreError, match="not a deltalab store") as e:
        store.open(tmp_path / "other.zarr")
    cases.append(e)
    path = tmp_path / "s.zarr"
    write_all(path, 6)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["deltalab_format"] = schema.FORMAT_VERSION + 1
    (tmp_path / "newer.zarr").mkdir()
    (tmp_path / "newer.zarr" / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(store.FormatVersionError, match="upgrade deltalab") as e:
        store.open(tmp_path / "newer.zarr")
    cases.append(e)
    (path / "k" / "c" / "1").rename(tmp_path / "moved")  # a shard file gone
    with pytest.raises(store.TruncatedStoreError, match="k/c/1") as e:
        store.open(path)
    cases.append(e)
    (path / "beta" / "zarr.json").write_text('{"zarr_format": 3, "node_ty')  # metadata cut short
    with pytest.raises(store.TruncatedStoreError, match="beta") as e:
        store.open(path)
    cases.append(e)
    assert all("\n" not in str(c.value) for c in cases)


def test_probe_outputs_never_touch_captured_arrays(tmp_path):
    path = tmp_path / "s.zarr"
    write_all(path, 10, stop_after=2)  # sequences 0..7 complete
    before = {k: v for k, v in tree_bytes(path).items() if not k.startswith(("erank/", "results/"))}
    ds = store.open(path)
    erank = xr.DataArray(np.arange(8 * 70 * 3, dtype=np.float32).reshape(8, 1, 70, 3),
                         dims=("seq", "layer", "pos", "head"),
                         coords={"seq": ds["seq"].values, "layer": [3]}, attrs={"probe": "erank"})
    assert store.add_variables(path, xr.Dataset({"erank": erank})) == ["erank"]
    again = store.open(path)
    got = again["erank"].sel(layer=3).values
    np.testing.assert_array_equal(got, erank.isel(layer=0).values)
    assert np.isnan(again["erank"].sel(layer=0).values).all()
    with pytest.raises(ValueError, match="captured variable"):
        store.add_variables(path, xr.Dataset({"q": erank}))
    with pytest.raises(ValueError, match="overwrite"):
        store.add_variables(path, xr.Dataset({"erank": erank}))
    res = xr.Dataset({"components": (("layer", "comp", "dk"), np.ones((2, 3, 4)))})
    store.write_results(path, "pca", res, {"n_components": 3})
    store.write_results(path, "spectra/window2", res)
    assert store.list_results(path) == ["pca", "spectra/window2"]
    out = store.open_results(path, "pca")
    assert out.attrs["n_components"] == 3 and out["components"].shape == (2, 3, 4)
    after = {k: v for k, v in tree_bytes(path).items() if k in before}
    assert after == before
    summary = store.info(path)
    assert summary["variables"]["erank"]["captured"] is False
    assert summary["results"] == ["pca", "spectra/window2"]
    assert store.open(path).sizes["seq"] == 8


def test_new_arrays_end_in_a_crc32c_and_older_ones_still_read(tmp_path):
    """Every unsharded array written now (small per-sequence arrays, loss, probe variables, results written or
    appended) ends in a crc32c; activations stay raw in shards whose index has one. Arrays written before (zstd
    only) read the same values."""
    from deltalab.probes.results import append_results
    from tests.store.chunks import zstd_only

    path = tmp_path / "s.zarr"
    write_all(path, 10)

    def codecs(array: str) -> list[str]:
        return [c["name"] for c in json.loads((path / array / "zarr.json").read_text())["codecs"]]

    for var in ("tokens", "labels", "complete"):
        assert codecs(var) == ["bytes", "zstd", "crc32c"], var
    assert codecs("loss") == ["bytes", "crc32c"] and codecs("k") == ["sharding_indexed"]
    ds = store.open(path)
    erank = xr.DataArray(np.ones((10, 2, 70, 3), np.float32), dims=("seq", "layer", "pos", "head"))
    store.add_variables(path, xr.Dataset({"erank": erank}))
    res = xr.Dataset({"components": (("layer", "comp", "dk"), np.arange(24.0).reshape(2, 3, 4))},
                     coords={"layer": [0, 3]})
    store.write_results(path, "pca", res)
    append_results(path, "pca", xr.Dataset({"total": ("layer", np.array([1.5, 2.5]))}, coords={"layer": [0, 3]}))
    for array in ("erank", "results/pca/components", "results/pca/layer", "results/pca/total"):
        assert codecs(array) == ["bytes", "zstd", "crc32c"], array
    before = {v: ds[v].values for v in ("tokens", "labels", "loss", "k")}
    for array in ("tokens", "labels", "loss", "complete", "results/pca/components", "results/pca/total"):
        zstd_only(path / array)
    again = store.open(path)
    for v, values in before.items():
        np.testing.assert_array_equal(again[v].values, values)
    out = store.open_results(path, "pca")
    np.testing.assert_array_equal(out["components"].values, res["components"].values)
    np.testing.assert_array_equal(out["total"].values, [1.5, 2.5])


def test_info_reports_sizes_completeness_provenance(tmp_path):
    path = tmp_path / "s.zarr"
    write_all(path, 10, stop_after=2)
    info = store.info(path)
    assert info["sequences"] == 10 and info["complete"] == 8
    assert info["segments"][0]["complete"] == 8
    assert info["variables"]["k"]["shape"] == [10, 2, 70, 2, 3, 4]
    assert info["variables"]["k"]["stored_bytes"] > 0
    assert info["provenance"]["checkpoint_digest"].startswith("sha256:")
    assert info["provenance"]["layers"] == [0, 3]
    json.dumps(info)  # JSON-able
    digest = hashlib.sha256((path / "zarr.json").read_bytes()).hexdigest()
    store.info(path)
    assert hashlib.sha256((path / "zarr.json").read_bytes()).hexdigest() == digest  # read-only


def test_lazy_dataset_runs_on_dask_distributed(tmp_path):
    distributed = pytest.importorskip("distributed")
    import pickle

    path = tmp_path / "s.zarr"
    write_all(path, 10, stop_after=2)
    ds = store.open(path)
    graph = pickle.loads(pickle.dumps(ds["k"].data))  # what a cluster ships to its workers
    expect = np.concatenate([batch_arrays(0, 4)["k"], batch_arrays(4, 8)["k"]]).astype(np.float64)
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None):
        total = float(graph.astype(np.float64).sum().compute())
        per_layer = ds["k"].astype(np.float64).mean(dim=("seq", "pos", "step", "head", "dk")).compute()
    assert total == pytest.approx(expect.sum(), rel=1e-9)
    np.testing.assert_allclose(per_layer.values, expect.mean(axis=(0, 2, 3, 4, 5)), rtol=1e-9)


def test_metadata_reads_attrs_without_opening_the_store(tmp_path):
    """read_attrs / result_attrs / metadata_mtime read one small file each: what the dashboard polls."""
    path = tmp_path / "s.zarr"
    write_all(path, 10, stop_after=2)
    assert store.read_attrs(path) == store.open(path).attrs
    assert store.read_attrs(path, "results/pca") is None and store.metadata_mtime(path, "results/pca") == 0
    assert store.read_attrs(path, "k") is None  # an array, not a group
    assert store.read_attrs(tmp_path / "nothing") is None and store.metadata_mtime(tmp_path / "nothing") == 0
    res = xr.Dataset({"components": (("layer", "comp", "dk"), np.ones((2, 3, 4)))})
    store.write_results(path, "pca", res, {"probe": "keys", "complete": True})
    store.write_results(path, "spectra/window2", res, {"probe": "spectra"})
    got = store.result_attrs(path)
    assert list(got) == ["pca", "spectra", "spectra/window2"] and got["spectra"] == {}  # the parent group too
    assert got["pca"]["probe"] == "keys" and got["pca"]["complete"] is True and "complete" not in got["spectra/window2"]
    assert store.read_attrs(path, "results/pca") == got["pca"]
    assert store.metadata_mtime(path, "results/pca") > 0 and store.metadata_mtime(path) > 0
    (path / "beta" / "zarr.json").write_text('{"zarr_format": 3, "node_ty')  # a damaged variable: open refuses,
    with pytest.raises(store.TruncatedStoreError):
        store.open(path)
    assert store.read_attrs(path)["checkpoint_digest"] == make_attrs()["checkpoint_digest"]  # the attrs still read
    (path / "results" / "pca" / "zarr.json").write_text("{oops")
    assert store.read_attrs(path, "results/pca") is None
    assert list(store.result_attrs(path)) == ["spectra", "spectra/window2"]
