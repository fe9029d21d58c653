"""Lazy per-token results: apply a numpy function to (sequence block, layer) pieces of a store with dask.

`map_seq_layer` returns an xarray.Dataset of dask arrays: nothing is computed until the result is
written (`to_zarr` streams it chunk by chunk) or a part of it is selected and loaded. Each task
reads one block of sequences of one layer, so memory is bounded by the block size.

Padding (the store's `pad`, where the reader put NaN: `store.reader.mask_padded`): `fn` never sees a NaN.
Its inputs are zero-filled there (beta = 0, k = v = 0, g = 0: an identity step) and every output with a `pos`
dim is NaN at those tokens, so padding is neither analysed nor able to break a decomposition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dask.array as da
import numpy as np
import torch
import xarray as xr

from deltalab.probes import data

BlockFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def map_seq_layer(ds: xr.Dataset, names: Sequence[str], fn: BlockFn,
                  outputs: dict[str, tuple[tuple[str, ...], Any]], sizes: dict[str, int], *,
                  budget: int, factor: float = 4.0, coords: dict[str, Any] | None = None) -> xr.Dataset:
    """Lazily compute `fn` over every (seq block, layer) of `ds[names]`.

    fn receives {name: array with the layer dim removed} (e.g. k -> [s, pos, step, head, dk]) and
    returns {output name: array with the dims of `outputs[name]` minus `layer`}. `outputs` maps
    name -> (dims incl. seq and layer, dtype); `sizes` gives the length of every non seq/layer dim.
    """
    present = [n for n in names if n in ds]
    per_layer = max(1, ds.sizes.get("layer", 1))
    block = data.block_size(ds, present, budget * per_layer, factor)
    padded = "pad" in ds and bool(ds["pad"].any())  # the reader made those tokens NaN (store.reader.mask_padded)
    src = ds[present + (["pad"] if padded else [])]
    rechunk = {d: -1 for d in src.dims}
    rechunk.update({"seq": block, "layer": 1})
    src = src.chunk({d: c for d, c in rechunk.items() if d in src.dims})
    seq_chunks = src.chunks["seq"]
    n_layer = ds.sizes["layer"]
    template_vars = {}
    for name, (dims, dtype) in outputs.items():
        shape, chunks = [], []
        for d in dims:
            if d == "seq":
                shape.append(ds.sizes["seq"])
                chunks.append(seq_chunks)
            elif d == "layer":
                shape.append(n_layer)
                chunks.append((1,) * n_layer)
            else:
                shape.append(sizes[d])
                chunks.append((sizes[d],))
        template_vars[name] = (dims, da.empty(tuple(shape), chunks=tuple(chunks), dtype=dtype))
    base_coords = {c: ds[c] for c in ("seq", "layer") if c in ds.coords}
    template = xr.Dataset(template_vars, coords={**base_coords, **(coords or {})})

    def apply(block: xr.Dataset) -> xr.Dataset:
        arrays = {n: np.asarray(block[n].values)[:, 0] if "layer" in block[n].dims else np.asarray(block[n].values)
                  for n in present}
        missing = np.asarray(block["pad"].transpose("seq", "pos").values, dtype=bool) if padded else None
        if missing is not None:
            arrays = {n: np.nan_to_num(a, nan=0.0) if np.issubdtype(a.dtype, np.floating) else a
                      for n, a in arrays.items()}
        result = fn(arrays)
        out = {name: (dims, np.expand_dims(nan_at_padding(result[name], dims, dtype, missing), dims.index("layer")))
               for name, (dims, dtype) in outputs.items()}
        tmpl_coords = {c: block[c] for c in ("seq", "layer") if c in block.coords}
        return xr.Dataset(out, coords={**tmpl_coords, **(coords or {})})

    return xr.map_blocks(apply, src, template=template)


def nan_at_padding(value: Any, dims: tuple[str, ...], dtype: Any, missing: np.ndarray | None) -> np.ndarray:
    """One layer's output of `fn` as `dtype`, NaN at padded tokens when it has a `pos` dim (`missing` [seq, pos])."""
    value = np.asarray(value, dtype=dtype)
    if missing is not None and "pos" in dims and np.issubdtype(value.dtype, np.inexact):
        axis = [d for d in dims if d != "layer"].index("pos")
        where = missing.reshape(missing.shape + (1,) * (value.ndim - 2))
        value = np.where(np.moveaxis(where, 1, axis) if axis != 1 else where, np.nan, value)
    return value


def _stack_layers(parts: list[Any], dims: tuple[str, ...], dtype: Any, missing: np.ndarray | None) -> np.ndarray:
    """Per-layer outputs (numpy, or tensors left on the device) stacked along `layer` as `dtype`, NaN at padding.
    Tensors are stacked where they are and copied to the host once (one wait for the device, not one per layer)."""
    axis = dims.index("layer")
    if parts and isinstance(parts[0], torch.Tensor):
        target = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
        stacked = _to_host(torch.stack([p.to(target) for p in parts], dim=axis))
        if missing is None:
            return stacked
        parts = [stacked[(slice(None),) * axis + (i,)] for i in range(stacked.shape[axis])]
    return np.stack([nan_at_padding(p, dims, dtype, missing) for p in parts], axis=axis)


def _to_host(x: torch.Tensor) -> np.ndarray:
    """A device tensor as numpy through pinned memory: pageable copies of GPU results ran at 1-2 GB/s on a GPU host
    (16 copies of 100-200 MB outputs took 1.6 s), pinned ones at the link's speed."""
    if not x.is_cuda:
        return x.numpy()
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return out.numpy()


@dataclass
class LayerPlan:
    """What a probe computes per (sequences, layer): `fn` over `names` (numpy arrays, or torch tensors on the
    probe's device: capture-time reductions), its `outputs` (name -> (dims incl. seq and layer, dtype)), the
    length of every other dim (`sizes`), extra coordinates, working-memory `factor`, and attrs of the result."""

    names: list[str]
    fn: BlockFn
    outputs: dict[str, tuple[tuple[str, ...], Any]]
    sizes: dict[str, int]
    coords: dict[str, Any] | None = None
    factor: float = 4.0
    attrs: dict[str, Any] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    batch_layers: bool = False  # fn treats every (seq, layer) alike: a batch's layers may go through it at once

    def lazy(self, ds: xr.Dataset, budget: int) -> xr.Dataset:
        """The per-token results over every (seq block, layer) of the store `ds` (map_seq_layer)."""
        out = map_seq_layer(ds, self.names, self.fn, self.outputs, self.sizes, budget=budget, factor=self.factor,
                            coords=self.coords)
        return self._dress(out)

    def on_layers(self, layers: list[dict[str, Any]], seq: np.ndarray, layer: np.ndarray,
                  missing: np.ndarray | None, stacked: dict[str, torch.Tensor] | None = None) -> xr.Dataset:
        """The per-token results of one batch whose per-layer inputs are given (in memory), as `lazy` lays them
        out; `missing` [seq, pos] marks padding (inputs already zero there). `stacked`: the same inputs as tensors
        [layer, seq, ...] (`layers` are views of it); a `batch_layers` plan runs fn once on them (a launch of each
        kernel, not one a layer)."""
        if self.batch_layers and stacked is not None:
            values = self._on_stacked(stacked, len(layers))
        else:
            values = {name: [] for name in self.outputs}
            for inputs in layers:
                result = self.fn(inputs)
                for name in self.outputs:
                    values[name].append(result[name])
        data = {name: (dims, _stack_layers(values[name], dims, dtype, missing))
                for name, (dims, dtype) in self.outputs.items()}
        return self._dress(xr.Dataset(data, coords={"seq": seq, "layer": layer, **(self.coords or {})}))

    def _on_stacked(self, stacked: dict[str, torch.Tensor], n_layers: int) -> dict[str, list[Any]]:
        """fn once over [layer, seq, ...] inputs folded to [layer * seq, ...], its outputs cut back per layer."""
        result = self.fn({name: x.flatten(0, 1) for name, x in stacked.items() if name in self.names})
        return {name: list(torch.as_tensor(result[name]).unflatten(0, (n_layers, -1)).unbind(0))
                for name in self.outputs}

    def _dress(self, out: xr.Dataset) -> xr.Dataset:
        for name, text in self.descriptions.items():
            out[name].attrs["description"] = text
        out.attrs.update(self.attrs)
        return out

