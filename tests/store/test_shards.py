"""deltalab.store.shards writes whole shards byte-identical to zarr's, from strided views, and refuses layouts it
cannot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from deltalab.store.shards import ShardLayout


def files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def sharded(path: Path, shape, chunks, shards, dtype, crc: bool = False, **kw) -> zarr.Array:
    """A sharded raw array as capture creates it: with a crc32c per inner chunk (`crc`, format 3) or without."""
    compressors = [zarr.codecs.Crc32cCodec()] if crc else None
    return zarr.create_array(str(path), shape=shape, chunks=chunks, shards=shards, dtype=dtype,
                             compressors=compressors, fill_value=0, config={"write_empty_chunks": True}, **kw)


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int32", "bool"])
@pytest.mark.parametrize("layers", [1, 3])
def test_shard_files_equal_zarrs(tmp_path, dtype, layers, crc):
    rng = np.random.default_rng([layers, len(dtype)])
    shape, batch = (6, layers, 5, 2, 7), 3  # (seq, layer, pos, head, dk); two shards along seq
    values = (rng.standard_normal(shape) * 5).astype(dtype)
    chunks, shards = (batch, 1, 5, 2, 7), (batch, layers, 5, 2, 7)
    ours, theirs = sharded(tmp_path / "ours", shape, chunks, shards, dtype, crc), \
        sharded(tmp_path / "theirs", shape, chunks, shards, dtype, crc)
    theirs[:] = values
    layout = ShardLayout.of(ours)
    assert layout is not None and layout.axis == (1 if layers > 1 else -1) and layout.checksummed == crc
    for i in range(2):
        written = layout.write((i, 0, 0, 0, 0), values[i * batch:(i + 1) * batch])
        assert written == (tmp_path / "ours" / "c" / str(i) / "0" / "0" / "0" / "0").stat().st_size
        assert written == layout.file_size
    assert files(tmp_path / "ours") == files(tmp_path / "theirs")
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "ours"))[:], values)


def test_layer_major_buffer_is_written_without_reordering(tmp_path):
    """The capture hands (layer, seq, ...) buffers as seq-major views: each inner chunk is contiguous."""
    rng = np.random.default_rng(1)
    layer_major = rng.standard_normal((4, 2, 9)).astype(np.float32)  # (layer, seq, pos)
    view = layer_major.transpose(1, 0, 2)  # (seq, layer, pos), no copy
    arr = sharded(tmp_path / "a", (2, 4, 9), (2, 1, 9), (2, 4, 9), "float32")
    layout = ShardLayout.of(arr)
    assert all(p.flags.c_contiguous for p in layout.inner_chunks(view))
    layout.write((0, 0, 0), view)
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "a"))[:], view)


def test_layouts_it_cannot_write_go_to_zarr(tmp_path):
    from zarr.codecs import ZstdCodec

    plain = zarr.create_array(str(tmp_path / "plain"), shape=(4, 2), chunks=(2, 2), dtype="float32")
    packed = zarr.create_array(str(tmp_path / "packed"), shape=(4, 2), chunks=(2, 1), shards=(2, 2),
                               dtype="float32", compressors=[ZstdCodec(level=1)])
    grid = zarr.create_array(str(tmp_path / "grid"), shape=(4, 4), chunks=(1, 2), shards=(2, 4),
                             dtype="float32", compressors=None)
    assert ShardLayout.of(plain) is None  # not sharded
    assert ShardLayout.of(packed) is None  # compressed inner chunks
    assert ShardLayout.of(grid) is None  # split along two axes (Morton order)
    assert ShardLayout.of(zarr.create_array(zarr.storage.MemoryStore(), shape=(4, 2), chunks=(2, 1),
                                            shards=(2, 2), dtype="float32", compressors=None)) is None


def test_wrong_shards_are_refused_before_anything_is_written(tmp_path):
    arr = sharded(tmp_path / "a", (2, 2, 3), (2, 1, 3), (2, 2, 3), "float32")
    layout = ShardLayout.of(arr)
    with pytest.raises(ValueError, match=r"shard \(2, 1, 3\) float32 != \(2, 2, 3\)"):
        layout.write((0, 0, 0), np.zeros((2, 1, 3), np.float32))
    with pytest.raises(ValueError, match="float64 != "):
        layout.write((0, 0, 0), np.zeros((2, 2, 3), np.float64))
    assert not (tmp_path / "a" / "c").exists()


@pytest.mark.parametrize("crc", [False, True])
def test_long_writes_span_several_writev_calls(tmp_path, monkeypatch, crc):
    """More inner chunks than one writev takes (600 > 512), and short writes, still give zarr's file."""
    import os

    original = os.writev
    calls = {"n": 0, "most": 0}

    def short_writev(fd, buffers):  # the kernel may write less than asked: at most 100 bytes here
        calls["n"] += 1
        calls["most"] = max(calls["most"], len(buffers))
        return original(fd, [bytes(buffers[0][:100])])

    monkeypatch.setattr(os, "writev", short_writev)
    values = np.arange(2 * 600 * 3, dtype=np.float32).reshape(2, 600, 3)
    ours = sharded(tmp_path / "ours", (2, 600, 3), (2, 1, 3), (2, 600, 3), "float32", crc)
    ShardLayout.of(ours).write((0, 0, 0), values)
    monkeypatch.setattr(os, "writev", original)
    assert calls["most"] == 512 and calls["n"] > 600
    theirs = sharded(tmp_path / "theirs", (2, 600, 3), (2, 1, 3), (2, 600, 3), "float32", crc)
    theirs[:] = values
    assert files(tmp_path / "ours") == files(tmp_path / "theirs")
