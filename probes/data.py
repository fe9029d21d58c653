"""Reading a store for probes: open lazily, select, check variables, and stream it in sequence blocks.

Everything here keeps the store lazy (dask); `iter_blocks` loads one block of sequences at a
time, sized so that the variables a probe needs stay under a memory budget.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.models.run_files import training_length
from deltalab.probes.core import ProbeError


def open_store(path: str | Path) -> xr.Dataset:
    """The store as a lazy xarray.Dataset of its complete sequences (`store.open` when available)."""
    path = Path(path)
    if not path.exists():
        raise ProbeError(f"store {path} does not exist: capture one with `deltalab capture CHECKPOINT --out {path}`")
    opener = _store_opener()
    if opener is not None:
        ds = opener(path)
    else:  # reader not there yet: plain xarray
        try:
            ds = xr.open_zarr(str(path), consolidated=False)
        except Exception as err:  # noqa: BLE001 - any zarr failure means "not a store"
            raise ProbeError(f"{path} is not a readable zarr store ({type(err).__name__}): "
                             "pass the folder written by `deltalab capture`") from None
    if "complete" in ds:
        keep = np.flatnonzero(np.asarray(ds["complete"].values, dtype=bool))
        if len(keep) < ds.sizes.get("seq", 0):
            ds = ds.isel(seq=keep)
    if ds.sizes.get("seq", 0) == 0:
        raise ProbeError(f"store {path} has no complete sequences: run or resume `deltalab capture` first")
    return ds


def _store_opener():
    """`store.open` (or `store.reader.open`) when the store layer provides it."""
    from deltalab import store

    opener = getattr(store, "open", None)
    if opener is None:
        try:
            from deltalab.store.reader import open as opener
        except ImportError:
            return None
    return opener


def select(ds: xr.Dataset, layers: Sequence[int] | None = None, max_seqs: int | None = None) -> xr.Dataset:
    """Restrict to some layers (by the `layer` coordinate) and to the first `max_seqs` sequences."""
    if layers is not None and "layer" in ds.dims:
        have = [int(x) for x in layer_values(ds)]
        missing = [x for x in layers if x not in have]
        if missing:
            raise ProbeError(f"layer(s) {missing} not in the store (it has {have}): pick from those with --layers")
        ds = ds.isel(layer=[have.index(x) for x in layers])
    if max_seqs is not None:
        if max_seqs < 1:
            raise ProbeError(f"--max-seqs must be >= 1, got {max_seqs}")
        ds = ds.isel(seq=slice(0, max_seqs))
    return ds


def layer_values(ds: xr.Dataset) -> np.ndarray:
    """Model layer index of each entry along `layer` (the coordinate, else 0..n-1)."""
    if "layer" in ds.coords:
        return np.asarray(ds["layer"].values)
    return np.arange(ds.sizes.get("layer", 0))


def require(ds: xr.Dataset, names: Sequence[str], probe: str) -> None:
    """Raise a one-line ProbeError naming the variables the probe needs and the capture flag."""
    missing = [n for n in names if n not in ds]
    if missing:
        raise ProbeError(
            f"probe {probe} needs variable(s) {', '.join(missing)} which the store lacks: "
            f"re-capture with `deltalab capture ... --hooks {','.join(sorted(set(missing) | {'tokens'}))}`"
        )


def dplr_store(ds: xr.Dataset) -> bool:
    """True for stores of the generalised delta rule (rwkv7): beta per key channel, or a removal key kappa."""
    return "kappa" in ds or ("beta" in ds and "dk" in ds["beta"].dims) or bool(
        (ds.attrs.get("sizes") or {}).get("beta_channels"))


def model_config(ds: xr.Dataset) -> dict[str, Any]:
    """The capture's model config (dict; JSON string accepted)."""
    cfg = ds.attrs.get("model_config", {})
    if isinstance(cfg, str):
        cfg = json.loads(cfg)
    return dict(cfg or {})


def beta_max(ds: xr.Dataset) -> float:
    """Largest possible beta: 2 with allow_neg_eigval, else 1 (taken from the data if the config is silent)."""
    cfg = model_config(ds)
    if cfg.get("model_type") == "rwkv7" or dplr_store(ds):  # a_rwkv = sigmoid(.) in (0, 1)
        return 1.0
    if "allow_neg_eigval" in cfg:
        return 2.0 if cfg["allow_neg_eigval"] else 1.0
    return 2.0


def train_length(ds: xr.Dataset, override: int | None = None, checkpoint: str | Path | None = None) -> int | None:
    """Training context length: the --train-length flag, else the store's `train_length` attr, else what the
    checkpoint's run files record (`models.run_files.training_length`), else None."""
    if override is not None:
        return int(override)
    value = ds.attrs.get("train_length")
    if value is not None:
        return int(value)
    return training_length(checkpoint) if checkpoint is not None else None


def chunk_size(ds: xr.Dataset) -> int:
    """Tokens per recurrence chunk (the store's `chunk_size` attr, else CHUNK_SIZE)."""
    return int(ds.attrs.get("chunk_size", CHUNK_SIZE))


def bytes_per_seq(ds: xr.Dataset, names: Sequence[str]) -> int:
    """Bytes one sequence of these variables occupies when loaded."""
    total = 0
    n_seq = max(1, ds.sizes.get("seq", 1))
    for n in names:
        if n in ds:
            total += ds[n].nbytes // (n_seq if "seq" in ds[n].dims else 1)
    return max(1, int(total))


def block_size(ds: xr.Dataset, names: Sequence[str], budget: int, factor: float = 1.0) -> int:
    """Sequences per block: as many as fit `budget` bytes (with a `factor` for working memory).

    Rounded to a multiple of the store's chunk along seq when a chunk fits, so reads stay aligned.
    """
    per_seq = bytes_per_seq(ds, names) * max(1.0, factor)
    n = max(1, int(budget // per_seq))
    stored = _seq_chunk(ds, names)
    if stored and n >= stored:
        n = (n // stored) * stored
    return min(n, max(1, ds.sizes.get("seq", 1)))


def _seq_chunk(ds: xr.Dataset, names: Sequence[str]) -> int | None:
    for n in names:
        if n in ds and ds[n].chunks is not None and "seq" in ds[n].dims:
            return int(ds[n].chunks[ds[n].dims.index("seq")][0])
    return None


def iter_blocks(ds: xr.Dataset, names: Sequence[str], budget: int, *, factor: float = 1.0,
                desc: str | None = None) -> Iterator[tuple[slice, xr.Dataset]]:
    """Yield (seq slice, loaded Dataset of `names`) one block of sequences at a time, with a progress bar."""
    from tqdm.auto import tqdm

    present = [n for n in names if n in ds]
    n_seq = ds.sizes["seq"]
    step = block_size(ds, present, budget, factor)
    starts = range(0, n_seq, step)
    for lo in tqdm(starts, desc=desc, unit="block", disable=desc is None or len(starts) < 2, leave=False):
        sl = slice(lo, min(lo + step, n_seq))
        yield sl, ds[present].isel(seq=sl).load()


def map_blocks(ds: xr.Dataset, names: Sequence[str], budget: int, fn: Any, *, factor: float = 1.0,
               desc: str | None = None, workers: int | None = None) -> Iterator[Any]:
    """fn(loaded block of sequences) over the blocks of `iter_blocks`, on a few threads (numpy's array loops and
    zarr's reads release the GIL), yielded in block order as they finish; `budget` is shared by the workers, so
    memory stays bounded as in `iter_blocks`. For summaries whose per-block parts add up."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    workers = max(1, workers or min(8, os.cpu_count() or 1))
    present = [n for n in names if n in ds]
    n_seq = ds.sizes["seq"]
    step = block_size(ds, present, max(1, budget // workers), factor)
    starts = range(0, n_seq, step)
    part = ds[present]

    def one(lo: int) -> Any:
        return fn(part.isel(seq=slice(lo, min(lo + step, n_seq))).load())

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deltalab-summary") as pool:
        yield from tqdm(pool.map(one, starts), total=len(starts), desc=desc, unit="block",
                        disable=desc is None or len(starts) < 2, leave=False)


def token_vocab(ds: xr.Dataset, max_tokens: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The `max_tokens` most frequent token ids (sorted by id) and their counts, streamed."""
    counts: np.ndarray = np.zeros(0, dtype=np.int64)
    for _, block in iter_blocks(ds, ["tokens"], budget):
        tok = np.asarray(block["tokens"].values).ravel()
        tok = tok[tok >= 0]
        c = np.bincount(tok)
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[: len(c)] += c
    ids = np.flatnonzero(counts)
    if len(ids) > max_tokens:
        ids = np.sort(ids[np.argsort(-counts[ids], kind="stable")[:max_tokens]])
    return ids, counts[ids]


def token_index(tokens: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Position of each token in `ids` (sorted), or -1 for tokens not in it."""
    pos = np.searchsorted(ids, tokens)
    pos = np.clip(pos, 0, max(0, len(ids) - 1))
    ok = (len(ids) > 0) & (ids[pos] == tokens) if len(ids) else np.zeros_like(tokens, dtype=bool)
    return np.where(ok, pos, -1)


def pick_device(name: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is present, else 'cpu'."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ProbeError("--device cuda asked for but no CUDA GPU is visible: use --device cpu")
    if name.startswith("cuda"):
        from deltalab.probes.linalg import warm_up

        warm_up(name)  # before dask's threads call the kernels
    return name


def clean_encoding(ds: xr.Dataset) -> xr.Dataset:
    """Drop encodings inherited from the source store (chunks, shards, codecs) before writing elsewhere."""
    ds = ds.copy()
    for v in ds.variables.values():
        v.encoding = {}
    return ds


HEAD_DIMS = ("head", "probe_head")
"""Result dims indexed by (value) head: `probe_head` is the linear probe's, with ALL (-1) for all heads together."""


def head_numbers(ds: xr.Dataset) -> list[int] | None:
    """The model's number of each entry along `head` when the store keeps only some heads (`capture --heads`: the
    `head` coordinate); None when it keeps them all (entry i is head i)."""
    if "head" not in ds.coords or "heads" not in ds.attrs:
        return None
    return [int(h) for h in ds["head"].values]


def positional_heads(ds: xr.Dataset) -> xr.Dataset:
    """`ds` without its head coordinates: probes work on head positions 0..H-1 (their results are labelled with
    the model's numbers afterwards by `relabel_heads`)."""
    return ds.drop_vars([c for c in ("head", "key_head") if c in ds.coords])


def relabel_heads(ds: xr.Dataset, records: list[dict[str, Any]] | None, heads: Sequence[int] | None
                  ) -> tuple[xr.Dataset, list[dict[str, Any]] | None]:
    """A probe's result (computed on head positions) with the model's head numbers: the `head` coordinate, the
    linear probe's `probe_head` (its all-heads entry kept) and each record's `head`. Results without a head dim
    (intervene: its heads are the model's already) and stores of every head are returned as they are."""
    dims = [d for d in HEAD_DIMS if d in ds.dims]
    if heads is None or not dims:
        return ds, records
    heads = [int(h) for h in heads]

    def real(h: Any) -> Any:
        return heads[int(h)] if h is not None and 0 <= int(h) < len(heads) else h

    coords: dict[str, Any] = {}
    for d in dims:
        old = np.asarray(ds[d].values) if d in ds.coords else np.arange(ds.sizes[d])
        coords[d] = np.asarray([real(h) for h in old], dtype=np.int64)
    out = ds.assign_coords(coords)
    if records is not None:
        records = [{**r, "head": real(r["head"])} if isinstance(r.get("head"), int | np.integer) else r
                   for r in records]
    return out, records
