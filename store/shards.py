"""Write whole zarr v3 shards of uncompressed arrays straight from memory: one writev, no copies.

zarr-python builds a shard by filling a new buffer, copying every inner chunk into it, and
concatenating the encoded chunks with the index: three passes over the data before the file
write. For a capture batch that fills a shard exactly, the shard file is only the inner chunks
back to back (each followed by its crc32c in stores of format 3), then their (offset, nbytes)
index and its crc32c. `ShardLayout.of` accepts only the codec chains deltalab creates (raw
little-endian chunks, with or without a crc32c, split along one axis, index at the end with
bytes + crc32c); anything else is left to zarr. The tests check the files are byte-identical to
the ones zarr writes.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np
import zarr

_IOV_MAX = 512
"""Buffers per writev call (Linux allows 1024)."""


@dataclass(frozen=True)
class ShardLayout:
    """Where and how one sharded array stores a shard: folder, inner chunk shape, split axis."""

    folder: Path
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    axis: int  # the one axis along which inner chunks tile the shard (-1: one inner chunk per shard)
    dtype: np.dtype
    separator: str
    checksummed: bool = False  # each inner chunk followed by its crc32c (zarr's crc32c codec after bytes)

    @classmethod
    def of(cls, arr: zarr.Array) -> ShardLayout | None:
        """The layout of `arr` if it is a local, sharded, uncompressed array this module can write; else None.

        Decided on the array's JSON metadata (the zarr v3 spec), which is the same in every zarr version.
        """
        from zarr.storage import LocalStore

        store = arr.store_path.store
        meta = json.loads(json.dumps(arr.metadata.to_dict(), default=str))  # tuples -> lists, as on disk
        codecs = meta.get("codecs") or []
        if not isinstance(store, LocalStore) or len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
            return None
        dtype = np.dtype(arr.dtype)
        config = codecs[0].get("configuration", {})
        raw = {"name": "bytes", "configuration": {"endian": "little"}}
        inner = config.get("codecs") or []
        checksummed = inner[-1:] == [{"name": "crc32c"}]
        body = inner[:-1] if checksummed else inner
        inner_ok = body == [raw] or (dtype.itemsize == 1 and body == [{"name": "bytes"}])
        if (not inner_ok or config.get("index_location", "end") != "end"
                or config.get("index_codecs") != [raw, {"name": "crc32c"}]):
            return None
        encoding = meta.get("chunk_key_encoding") or {}
        separator = (encoding.get("configuration") or {}).get("separator", "/")
        if encoding.get("name") != "default" or dtype.byteorder == ">" or dtype.hasobject:
            return None
        try:
            shard = tuple(int(s) for s in meta["chunk_grid"]["configuration"]["chunk_shape"])
            chunk = tuple(int(c) for c in config["chunk_shape"])
        except (KeyError, TypeError, ValueError):
            return None  # a chunk grid other than zarr's regular one
        split = [i for i, (s, c) in enumerate(zip(shard, chunk, strict=True)) if s != c]
        if len(split) > 1 or any(s % c for s, c in zip(shard, chunk, strict=True)):
            return None  # several split axes would need zarr's Morton order of inner chunks
        folder = Path(store.root) / arr.store_path.path
        return cls(folder, shard, chunk, split[0] if split else -1, dtype, separator, checksummed)

    def key(self, shard_coords: tuple[int, ...]) -> Path:
        return self.folder / self.separator.join(["c", *map(str, shard_coords)])

    @property
    def n_inner(self) -> int:
        """Inner chunks per shard."""
        return self.shard_shape[self.axis] // self.chunk_shape[self.axis] if self.axis >= 0 else 1

    @property
    def file_size(self) -> int:
        """Bytes of every shard file of this layout (inner chunks, their crc32c, the index and its crc32c): the
        size a complete shard has on disk, which store.verify checks with one stat."""
        chunk = int(np.prod(self.chunk_shape)) * self.dtype.itemsize + (4 if self.checksummed else 0)
        return self.n_inner * (chunk + 16) + 4

    def inner_chunks(self, shard: np.ndarray) -> list[np.ndarray]:
        """The shard's inner chunks in order along the split axis (views, no copy)."""
        if self.axis < 0:
            return [shard]
        step = self.chunk_shape[self.axis]
        lead = (slice(None),) * self.axis
        return [shard[(*lead, slice(i, i + step))] for i in range(0, shard.shape[self.axis], step)]

    def write(self, shard_coords: tuple[int, ...], shard: np.ndarray) -> int:
        """Write `shard` (the shard's full shape and the array's dtype) at `shard_coords`; returns the bytes.

        Inner chunks that are C-contiguous (e.g. layer blocks of a layer-major buffer seen as
        (seq, layer, ...)) are written without a copy. The file appears atomically (temp file, then
        rename), as zarr's do.
        """
        if shard.shape != self.shard_shape or shard.dtype != self.dtype:
            raise ValueError(f"shard {shard.shape} {shard.dtype} != {self.shard_shape} {self.dtype}")
        parts = [np.ascontiguousarray(part) for part in self.inner_chunks(shard)]
        views = [memoryview(part).cast("B") for part in parts]
        if self.checksummed:  # chunk, crc32c, chunk, crc32c, ...: zarr's bytes -> crc32c chain, still one writev
            crcs = [memoryview(np.array([google_crc32c.value(p)], dtype="<u4").tobytes()) for p in parts]
            views = [b for pair in zip(views, crcs, strict=True) for b in pair]
            sizes = np.array([a.nbytes + b.nbytes for a, b in zip(views[::2], views[1::2], strict=True)],
                             dtype=np.uint64)
        else:
            sizes = np.array([v.nbytes for v in views], dtype=np.uint64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        index_shape = tuple(len(sizes) if i == self.axis else 1 for i in range(len(self.shard_shape)))
        index = np.stack([offsets, sizes], axis=-1).reshape(*index_shape, 2).astype("<u8").tobytes()
        tail = index + np.array([google_crc32c.value(index)], dtype="<u4").tobytes()
        return _atomic_writev(self.key(shard_coords), [*views, memoryview(tail)])


def _atomic_writev(path: Path, buffers: list[memoryview]) -> int:
    """Write `buffers` to `path` through a `*.partial` temp file renamed into place (zarr's own scheme)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
    total = sum(b.nbytes for b in buffers)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies, as to zarr's
    try:
        try:
            pending = list(buffers)
            while pending:
                done = os.writev(fd, pending[:_IOV_MAX])
                while pending and done >= pending[0].nbytes:  # drop what was written, keep the rest
                    done -= pending[0].nbytes
                    pending.pop(0)
                if done:
                    pending[0] = pending[0][done:]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return total
