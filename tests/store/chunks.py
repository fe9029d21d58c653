"""Chunk-level damage for the corrupt-chunk tests: forge a chunk that still decodes, or write an array as stores
written before the crc32c were (zstd only)."""

from __future__ import annotations

import json
from pathlib import Path

import numcodecs
import zarr


def chunk_files(array: Path) -> list[Path]:
    """The chunk files of the zarr array at `array` (its `c/...` keys)."""
    return sorted(p for p in array.rglob("*") if p.is_file() and "c" in p.relative_to(array).parts)


def has_crc32c(array: Path) -> bool:
    """Whether the array's chunks end in a crc32c (its last codec)."""
    return json.loads((array / "zarr.json").read_text())["codecs"][-1]["name"] == "crc32c"


def forge(chunk: Path, array: Path) -> None:
    """Rewrite `chunk` of `array` as a valid zstd frame of other bytes (its first byte flipped), keeping the 4-byte
    crc32c tail where the array has one: zstd still decodes it, so only the checksum can tell."""
    data = chunk.read_bytes()
    frame, tail = (data[:-4], data[-4:]) if has_crc32c(array) else (data, b"")
    raw = bytearray(numcodecs.Zstd().decode(frame))
    raw[0] ^= 1
    chunk.write_bytes(numcodecs.Zstd(level=1).encode(bytes(raw)) + tail)


def zstd_only(array: Path) -> None:
    """Rewrite the zarr array at `array` with zstd only (no crc32c), as before, keeping its values and metadata."""
    old = zarr.open_array(str(array), mode="r")
    values = old[...]
    new = zarr.create_array(str(array), shape=old.shape, chunks=old.chunks, dtype=old.dtype,
                            fill_value=old.fill_value, dimension_names=old.metadata.dimension_names,
                            attributes=dict(old.attrs), compressors=[zarr.codecs.ZstdCodec(level=1)],
                            overwrite=True, config={"write_empty_chunks": True})
    new[...] = values
    assert not has_crc32c(array)
