"""Check every chunk of a store against its checksum and name what is damaged, with the command that repairs it.

A chunk is damaged when a complete sequence's chunk file is missing, when a whole-shard file has another size than
its layout gives (a truncated write), or when it does not decode: its crc32c (format 3: every chunk of every
captured array; older formats: the shard indexes and the small arrays only) does not match its bytes, or zstd
cannot decode it. Chunks are decoded through zarr's own codec pipeline, so what passes here is what readers read.

    report = verify("runs/s4.zarr")
    report.clean, report.damaged_sequences(), report.lines()
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Damage:
    """One damaged chunk: the array (`v`, an added variable, or `results/NAME/VAR`), its chunk key, the global
    sequences [start, stop) it holds (None: an array without a `seq` dim) and why it is damaged."""

    array: str
    key: str
    seq: tuple[int, int] | None
    reason: str
    captured: bool = True  # an array capture writes (capture repairs it); else a probe's (re-run the probe)

    def describe(self) -> str:
        where = f"seq {_span(*self.seq)}, " if self.seq is not None else ""
        return f"{self.array}/{self.key} ({where}{self.reason})"


@dataclass
class Report:
    """What `verify` found: chunks checked, the damaged ones, and arrays whose chunks carry no checksum (their
    sizes and decoding were checked, their values cannot be)."""

    path: Path
    format: int
    checked: int = 0
    damage: list[Damage] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.damage

    def damaged_sequences(self, captured_only: bool = True) -> list[int]:
        """Global indices of the sequences in damaged chunks (of captured arrays only, by default), sorted."""
        seqs = {s for d in self.damage if d.seq is not None and (d.captured or not captured_only)
                for s in range(*d.seq)}
        return sorted(seqs)

    def repairs(self, attrs: dict[str, Any]) -> list[str]:
        """The commands that repair the damage: the capture of each damaged segment, and each damaged probe's."""
        out: list[str] = []
        for seg in attrs.get("segments") or []:
            lo, hi = int(seg["start"]), int(seg["start"]) + int(seg["count"])
            if any(lo <= s < hi for s in self.damaged_sequences()):
                out.append(capture_command(self.path, attrs, str(seg["data_spec"]), first=not out and lo == 0))
        for d in self.damage:
            if not d.captured:
                cmd = probe_command(self.path, d.array)
                if cmd not in out:
                    out.append(cmd)
        return out


def _span(lo: int, hi: int) -> str:
    return str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}"


def seq_spans(seqs: list[int]) -> str:
    """[0, 1, 2, 8, 9] -> '0-2, 8-9'."""
    if not seqs:
        return "none"
    runs = np.split(np.asarray(seqs), np.flatnonzero(np.diff(seqs) != 1) + 1)
    return ", ".join(_span(int(r[0]), int(r[-1]) + 1) for r in runs)


def _printable(text: str) -> str:
    """`text` with control characters dropped: store metadata is data, shown as text (never as terminal codes)."""
    return "".join(ch for ch in text if ch.isprintable())


def capture_command(path: Path, attrs: dict[str, Any], data_spec: str, first: bool = False) -> str:
    """The capture command that resumes (and so repairs) segment `data_spec` of the store at `path`: the recorded
    command line of the store's first capture when it is that segment's (its --out set to `path`), else one naming
    its spec."""
    recorded = attrs.get("command_line")
    if first and isinstance(recorded, list) and recorded[:2] == ["deltalab", "capture"] and \
            all(isinstance(a, str) for a in recorded):
        args = list(recorded)
        for i, arg in enumerate(args):  # the store may have moved since: name it where it is now
            if arg in ("--out", "-o") and i + 1 < len(args):
                args[i + 1] = str(path)
            elif arg.startswith("--out="):
                args[i] = f"--out={path}"
        return _printable(shlex.join(args))
    return _printable(f"deltalab capture CHECKPOINT --data {shlex.quote(data_spec)} --out {shlex.quote(str(path))}")


def probe_command(path: Path, array: str) -> str:
    """The probe run that rewrites damaged probe output `array` (`results/NAME/...` or an added root variable)."""
    parts = array.split("/")
    if parts[0] == "results" and len(parts) > 2:
        name = "/".join(parts[1:-1])
        meta = _json(path / "results" / name / "zarr.json") or {}
        probe = (meta.get("attributes") or {}).get("probe") or name.split("/")[0]
        suffix = f" --name {shlex.quote(name)}" if name != probe else ""
        return _printable(f"deltalab probe {probe} --store {shlex.quote(str(path))}{suffix}")
    return _printable(f"deltalab probe PROBE --store {shlex.quote(str(path))} (the probe that added {array})")


def summary_line(report: Report, attrs: dict[str, Any], limit: int = 4) -> str:
    """One line naming the damaged arrays and sequences and the command(s) that repair them."""
    shown = "; ".join(d.describe() for d in report.damage[:limit])
    more = f"; and {len(report.damage) - limit} more chunk(s)" if len(report.damage) > limit else ""
    seqs = report.damaged_sequences()
    repairs = report.repairs(attrs)
    fix = " and ".join(f"`{c}`" for c in repairs)
    what = f"damaged sequence(s) {seq_spans(seqs)}: " if seqs else ""
    why = ("it recaptures only the damaged sequences" if all(c.startswith("deltalab capture") for c in repairs)
           else "a capture recaptures only the damaged sequences, a probe rewrites its results")
    hint = f"rerun {fix} ({why})" if fix else "recapture into a new --out"
    return f"{what}{shown}{more}; repair: {hint}; `deltalab store verify {report.path}` lists every damaged chunk"


# --- the checks -----------------------------------------------------------------------------------------------

def _json(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def has_checksums(meta: dict[str, Any]) -> bool:
    """Whether every chunk of the array with zarr.json `meta` ends in a crc32c (for sharded arrays: its inner
    chunks, not only its index)."""
    codecs = meta.get("codecs") or []
    if codecs and codecs[0].get("name") == "sharding_indexed":
        codecs = (codecs[0].get("configuration") or {}).get("codecs") or []
    return any(c.get("name") == "crc32c" for c in codecs)


def _reason(err: BaseException) -> str:
    text = str(err).lower()
    if "checksum" in text:
        return "checksum mismatch"
    if "decompress" in text:
        return "does not decode"
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"unreadable ({type(err).__name__}: {first[:120]})"


@dataclass(frozen=True)
class _Array:
    """One array to check: its name in reports, its folder, whether capture writes it."""

    name: str
    folder: Path
    captured: bool


def _arrays(path: Path, attrs: dict[str, Any], results: bool) -> list[_Array]:
    captured = set(attrs.get("variables") or [])
    out = []
    for folder in sorted(p.parent for p in path.glob("*/zarr.json")):
        if folder.name != "results" and (_json(folder / "zarr.json") or {}).get("node_type") == "array":
            out.append(_Array(folder.name, folder, folder.name in captured))
    if results and (path / "results").is_dir():
        for meta in sorted((path / "results").rglob("zarr.json")):
            rel = meta.parent.relative_to(path).as_posix()
            if any(part.startswith(".") for part in rel.split("/")):
                continue  # a probe run still writing, or the leftover of an interrupted one: not results
            if (_json(meta) or {}).get("node_type") == "array":
                out.append(_Array(rel, meta.parent, False))
    return out


def _chunk_grid(arr: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(chunk shape along the grid of stored files, files per dim): shards for sharded arrays."""
    grid = tuple(int(c) for c in (arr.shards or arr.chunks))
    return grid, tuple(max(1, math.ceil(s / g)) for s, g in zip(arr.shape, grid, strict=True))


def _complete_flags(path: Path, n_seq: int, batch: int, report: Report) -> np.ndarray:
    """Per sequence: -1 flag unreadable (its `complete` chunk is damaged), 0 not complete, 1 complete."""
    import zarr

    flags = np.zeros(n_seq, dtype=np.int8)
    arr = zarr.open_array(str(path / "complete"), mode="r")
    n_chunks = math.ceil(n_seq / batch)
    try:  # one read; only when it fails, chunk by chunk to name the damaged ones
        flags[:] = np.asarray(arr[:n_seq], dtype=bool)
        report.checked += n_chunks
        return flags
    except Exception:  # noqa: BLE001 - located below
        pass
    for i in range(n_chunks):
        lo, hi = i * batch, min(n_seq, (i + 1) * batch)
        try:
            flags[lo:hi] = np.asarray(arr[lo:hi], dtype=bool)
        except Exception as err:  # noqa: BLE001 - any failure to decode a chunk is damage, reported below
            flags[lo:hi] = -1
            report.damage.append(Damage("complete", f"c/{i}", (lo, hi), _reason(err)))
        report.checked += 1
    return flags


BLOCK_BYTES = 64 << 20
"""Bytes decoded per read: runs of intact-looking chunks along seq are read together (one zarr call per block, not
per chunk), and a block that fails is read again one chunk at a time to name the damaged ones."""


def _check_array(item: _Array, flags: np.ndarray | None, seq_range: tuple[int, int] | None,
                 report: Report) -> Iterator[int]:
    """Check every stored chunk of one array: existence and size by stat, then decoding (yields chunk counts as
    it goes, for progress)."""
    import zarr

    from deltalab.store.shards import ShardLayout

    meta = _json(item.folder / "zarr.json") or {}
    if not has_checksums(meta):
        report.unchecked.append(item.name)
    arr = zarr.open_array(str(item.folder), mode="r")
    dims = list(meta.get("dimension_names") or [])
    seq_axis = dims.index("seq") if "seq" in dims else None
    grid, counts = _chunk_grid(arr)
    layout = ShardLayout.of(arr)
    separator = ((meta.get("chunk_key_encoding") or {}).get("configuration") or {}).get("separator", "/")
    intact: list[tuple[tuple[int, ...], str, tuple[int, int] | None]] = []
    seen = 0
    for coords in itertools.product(*(range(n) for n in counts)):
        seq = None
        if seq_axis is not None:
            lo = coords[seq_axis] * grid[seq_axis]
            seq = (lo, min(int(arr.shape[seq_axis]), lo + grid[seq_axis]))
            if seq_range is not None and (seq[1] <= seq_range[0] or seq[0] >= seq_range[1]):
                continue
        key = separator.join(["c", *map(str, coords)])
        report.checked += 1
        seen += 1
        try:
            size = (item.folder / key).stat().st_size
        except FileNotFoundError:
            if item.captured and flags is not None and seq is not None and (flags[seq[0]:seq[1]] != 0).any():
                report.damage.append(Damage(item.name, key, seq, "missing", item.captured))
            continue  # absent chunks of incomplete sequences, or of probe outputs, read as the fill value
        if layout is not None and size != layout.file_size:
            report.damage.append(Damage(item.name, key, seq, f"truncated ({size} of {layout.file_size} bytes)"
                                        if size < layout.file_size else f"{size} bytes, a shard has "
                                        f"{layout.file_size}", item.captured))
            continue
        intact.append((coords, key, seq))
    yield seen - len(intact)  # missing or of the wrong size: done; the rest count as they are decoded

    def region(first: tuple[int, ...], last: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(a * g, min(n, (b + 1) * g)) for a, b, g, n in zip(first, last, grid, arr.shape, strict=True))

    chunk_bytes = int(np.prod(grid)) * np.dtype(arr.dtype).itemsize
    along = seq_axis if seq_axis is not None and sum(c > 1 for c in counts) <= 1 else None
    per_block = max(1, BLOCK_BYTES // max(1, chunk_bytes)) if along is not None else 1
    i = 0
    while i < len(intact):
        block = [intact[i]]
        while (len(block) < per_block and i + len(block) < len(intact)
               and intact[i + len(block)][0][along] == block[-1][0][along] + 1):
            block.append(intact[i + len(block)])
        try:
            arr[region(block[0][0], block[-1][0])]
        except Exception:  # noqa: BLE001 - which chunk: read them one by one
            for coords, key, seq in block:
                try:
                    arr[region(coords, coords)]
                except Exception as err:  # noqa: BLE001 - any failure to decode a chunk is damage
                    report.damage.append(Damage(item.name, key, seq, _reason(err), item.captured))
        i += len(block)
        yield len(block)


def verify(path: str | Path, *, seq_range: tuple[int, int] | None = None, results: bool = True,
           captured_only: bool = False, progress: bool = False) -> Report:
    """Check every chunk of the store at `path` (or of the sequences in `seq_range` = [start, stop) only, and the
    arrays without a seq dim); returns the Report (never raises for damage: StoreError only when the store cannot
    be opened at all, as store.check_store). `results`: the probe results under results/ too; `captured_only`: the
    arrays capture writes only (what a resume repairs). `progress`: a bar on stderr."""
    from tqdm.auto import tqdm

    from deltalab.store.reader import check_store

    path = Path(path)
    attrs = check_store(path)
    report = Report(path, int(attrs["deltalab_format"]))
    n_seq = sum(int(s["count"]) for s in attrs["segments"])
    batch = int(attrs["batch_size"])
    flags = _complete_flags(path, n_seq, batch, report) if (path / "complete" / "zarr.json").is_file() else None
    items = [a for a in _arrays(path, attrs, results and not captured_only)
             if a.name != "complete" and (a.captured or not captured_only)]
    total = sum(int(np.prod(_chunk_grid(_open(a.folder))[1])) for a in items)
    with tqdm(total=total, unit="chunk", desc=f"verify {path.name}", disable=not progress, leave=False,
              file=sys.stderr) as bar:
        for item in items:
            for n in _check_array(item, flags, seq_range, report):
                bar.update(n)
    return report


def _open(folder: Path) -> Any:
    import zarr

    return zarr.open_array(str(folder), mode="r")


def damage_line(path: str | Path) -> str | None:
    """The one line naming a store's damaged chunks and the repair (None when it verifies clean or cannot be
    checked): what readers say instead of a codec's message once a read has failed."""
    from deltalab.store.errors import StoreError
    from deltalab.store.reader import check_store

    try:
        attrs = check_store(path)
        report = verify(path)
    except (StoreError, OSError, ValueError):
        return None
    return None if report.clean else summary_line(report, attrs)
