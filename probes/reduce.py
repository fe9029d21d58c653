"""Probe results computed during capture: `deltalab capture ... --reduce ranks,spectra,attention`.

Each captured batch is reduced where the model left it (the GPU), before anything is copied to the host: the
probe's own per-layer function (its `plan`, probes.lazy.LayerPlan) runs on the batch's tensors laid out as
`store.open` would show them (q/k per value head, zero inputs and NaN outputs at padding), and the per-token
arrays are written into `results/<probe>` at the batch's sequences by capture's writer thread. When capture ends,
sequences no batch reduced (a resumed capture, an earlier segment) are computed from the store, and the probe's
own summary (`from_tokens`) completes the group. So the variables, names and records are the probe's, and the
dashboard and notebooks read them as probe results; the inputs need not be stored at all (`--hooks`, `--keep`).
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import xarray as xr

from deltalab.models.run_files import deltalab_version
from deltalab.probes import attention, erank, spectra
from deltalab.probes.base import clean_json
from deltalab.probes.data import clean_encoding, head_numbers, positional_heads, relabel_heads
from deltalab.probes.lazy import LayerPlan
from deltalab.probes.linalg import warm_up
from deltalab.probes.results import ResultSink, read_results, results_group

REDUCTIONS: dict[str, ModuleType] = {"ranks": erank, "spectra": spectra, "attention": attention}
"""`--reduce` names -> the probe whose results they write."""

NEEDS = {"ranks": ("tokens", "k", "v", "beta", "g", "state"), "spectra": ("tokens", "k", "beta", "g"),
         "attention": ("tokens", "q", "k", "v", "beta", "g")}
"""Hook points each reduction reads (tokens for the padding mask and document starts; g where the model has it;
the ranks start each chunk from the kernel's own chunk-boundary state instead of recomputing it). Capture runs
them whatever --hooks says and stores only --hooks. On rwkv7 models beta brings its removal key kappa along
(store.capture)."""

KEEPABLE = ("states",)
WRITE_THREADS = 4
"""Result arrays of one batch written at once (each array's chunks are encoded concurrently by zarr as well)."""


RANKED_PER_TOKEN = 0.5
"""`auto_rank_every`'s budget: ranked states (head x layer) per captured token. On one GPU, OLMo-Hybrid 7.4B at
B x T = 8 x 4096 (768 delta-rule heads) ranks every 1024 tokens (0.75 a token) took 0.15 s of GPU per 1.38 s batch,
through cuSOLVER's batched float64 eigensolver (`python -m benchmarks.reduce_capture --stages`); at 0.5 a token
they are at most a twentieth of a 7B forward."""


def auto_rank_every(heads: int, length: int, chunk: int = 64) -> int:
    """The `--rank-every` of a GPU capture of `heads` delta-rule heads (layers x heads) over sequences of `length`:
    the smallest power of two (at least a chunk) that ranks at most RANKED_PER_TOKEN states per token, and at most
    the longest multiple of the chunk in a sequence, so that every sequence gets a rank (its last chunk boundary)."""
    every = max(chunk, 1 << max(0, math.ceil(math.log2(max(1.0, heads / RANKED_PER_TOKEN)))))
    return max(chunk, min(every, length // chunk * chunk))


def parse_reductions(text: str | None) -> list[str]:
    """"ranks,spectra" -> ["ranks", "spectra"]; ValueError (one line) for an unknown name."""
    names = [t.strip() for t in (text or "").split(",") if t.strip()]
    bad = [n for n in names if n not in REDUCTIONS]
    if bad:
        raise ValueError(f"--reduce {','.join(bad)}: unknown; choose among {','.join(REDUCTIONS)}")
    return list(dict.fromkeys(names))


def stored_hooks(hooks: list[str], reductions: list[str], keep: str | None) -> list[str]:
    """The hook points to store: `hooks`, without the states when reductions are asked for, unless
    `--keep states`. ValueError (one line) for a bad --keep."""
    kept = [t.strip() for t in (keep or "").split(",") if t.strip()]
    bad = [k for k in kept if k not in KEEPABLE]
    if bad:
        raise ValueError(f"--keep {','.join(bad)}: unknown; choose among {','.join(KEEPABLE)}")
    if kept and not reductions:
        raise ValueError("--keep only applies with --reduce (without it every hook in --hooks is stored)")
    out = list(hooks)
    if reductions and "states" not in kept:
        out = [h for h in out if h != "state"]
    return out


INPUTS = ("q", "k", "v", "beta", "kappa", "g", "state", "o")
"""Captured variables a reduction's LayerPlan may read."""


def _template(attrs: dict[str, Any], n: int, names: list[str]) -> xr.Dataset:
    """A data-free Dataset with the dims, sizes and attrs `store.open` gives `n` sequences of these variables
    (q/k per value head): what a probe's `plan` reads to decide what it computes."""
    import dask.array as da

    from deltalab.store import schema

    sizes = {d: s for d, s in attrs["sizes"].items() if d != "key_head"}
    data_vars = {}
    for var in names:
        dims = schema.dims_of(var, sizes)
        data_vars[var] = (dims, da.empty(tuple(n if d == "seq" else sizes[d] for d in dims), dtype=np.float32,
                                         chunks=-1))
    return xr.Dataset(data_vars, coords={"seq": np.arange(n), "layer": np.asarray(attrs["layers"])}, attrs=attrs)


def _layer_inputs(attrs: dict[str, Any], tensors: dict[str, torch.Tensor], missing: np.ndarray | None,
                  state_chunks: list[int] | None = None) -> dict[str, torch.Tensor]:
    """{var: tensor [layer, seq, ...]} laid out as probes.lazy hands a layer to a plan: q and k per value head
    (`key_head_of`), float inputs zero at padding, states zero past a sequence's first padded token
    (`state_chunks`: the boundaries the states are, when the capture kept only those)."""
    from deltalab.store import schema

    sizes = attrs["sizes"]
    stacked: dict[str, torch.Tensor] = {}
    for var, x in tensors.items():
        if var not in INPUTS:
            continue
        dims = [d for d in schema.dims_of(var, sizes) if d != "layer"]
        if "key_head" in dims:
            index = torch.as_tensor(schema.key_head_positions(attrs), device=x.device)
            x = x.index_select(1 + dims.index("key_head"), index)
        if missing is not None and "pos" in dims:  # x is [layer, seq, ...]: dims[i] is axis 1 + i
            shape = [1] * x.dim()
            shape[1], shape[1 + dims.index("pos")] = missing.shape
            x = x.masked_fill(torch.as_tensor(missing, device=x.device).reshape(shape), 0)
        if missing is not None and var == "state":
            length = int(sizes["pos"])
            first = np.where(missing.any(1), missing.argmax(1), length)  # [seq]
            chunks = np.arange(x.shape[2]) if state_chunks is None else np.asarray(state_chunks)
            chunk_pos = np.minimum(chunks * int(attrs["chunk_size"]), length)
            past = torch.as_tensor(chunk_pos[None, :] > first[:, None], device=x.device)  # [seq, chunk]
            x = x.masked_fill(past[None, :, :, None, None, None], 0)
        stacked[var] = x
    return stacked


def _fill(dtype: np.dtype) -> Any:
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        return np.nan
    return False if dtype == np.bool_ else -1


class CaptureReductions:
    """The reductions of one capture: `compute` on each batch's tensors, `write` once the batch is stored,
    `finish` once at the end."""

    def __init__(self, names: list[str], *, device: str = "cpu", command_line: list[str] | None = None,
                 budget: int = 1 << 30, rank_every: int | None = 1, spectra_precision: str = "float64") -> None:
        if rank_every is not None and rank_every < 1:
            raise ValueError(f"--rank-every {rank_every}: pass a positive number of tokens")
        if spectra_precision not in spectra.PRECISIONS:
            raise ValueError(f"--spectra-precision {spectra_precision}: pass one of {', '.join(spectra.PRECISIONS)}")
        self.spectra_precision = spectra_precision  # of per-channel gates' secular solves
        self.names = list(names)
        self.rank_every = rank_every  # None: `auto_rank_every` of the captured model, set by `check`
        warm_up(device)  # before capture's writer thread or dask's threads call the kernels
        self.device = device
        self.command_line = list(command_line or [])
        self.budget = budget
        self.states_picked: list[int] | None = None  # set by capture: the chunk boundaries its states are
        self._open: dict[str, set[int]] = {}  # probe name -> sequences reduced (this run and earlier runs)
        self._groups: dict[str, Any] = {}  # probe name -> its open zarr group (per-batch writes)
        self.seconds = {"compute": 0.0, "batches": 0.0, "finish": 0.0}  # in compute(), write(), finish()

    def hooks(self) -> list[str]:
        """The hook points the reductions read (captured, stored only if --hooks names them)."""
        return list(dict.fromkeys(h for name in self.names for h in NEEDS[name]))

    def state_boundaries(self, length: int, chunk_size: int) -> list[int] | None:
        """The chunk-boundary states these reductions read (the ranks every `rank_every` tokens, a multiple of the
        chunk size), or None when they need every one: capture keeps no others of a batch."""
        if "ranks" not in self.names:
            return None
        from deltalab.kernels.ranks.chunk import ranked_boundaries

        return ranked_boundaries(length, chunk_size, self.rank_every)

    def bytes_per_sequence(self, attrs: dict[str, Any], variables: list[str]) -> int:
        """Bytes of per-token results one sequence adds (uncompressed, as the plans declare their outputs): the
        disk estimate counts them beside the stored hooks (at 7B they are 5x what `--hooks tokens,beta` stores)."""
        template = _template(attrs, 1, [v for v in variables if v in INPUTS])
        n_layers = len(attrs["layers"])
        total = 0
        for name in self.names:
            plan = self._plan(name, template, picked=self.states_picked is not None)
            for dims, dtype in plan.outputs.values():
                size = np.dtype(dtype).itemsize * (n_layers if "layer" in dims else 1)
                for d in dims:
                    if d not in ("seq", "layer"):
                        size *= int(plan.sizes[d])
                total += size
            if REDUCTIONS[name] is erank:
                total += int(attrs["sizes"]["pos"])  # doc_start
        return total

    def check(self, attrs: dict[str, Any], variables: list[str]) -> None:
        """Build every reduction's plan on a data-free template of the capture (root `attrs`, captured `variables`)
        before anything is written: a reduction the model cannot have is a one-line ValueError."""
        from deltalab.probes.base import ProbeError

        if self.rank_every is None:
            sizes = attrs["sizes"]
            self.rank_every = auto_rank_every(len(attrs["layers"]) * int(sizes["head"]), int(sizes["pos"]))
        template = _template(attrs, 1, [v for v in variables if v in INPUTS])
        for name in self.names:
            try:
                self._plan(name, template)
            except ProbeError as err:
                raise ValueError(f"--reduce {name}: {err}") from None

    # --- during capture -----------------------------------------------------------------------------

    def compute(self, attrs: dict[str, Any], tensors: dict[str, torch.Tensor],
                host: dict[str, np.ndarray]) -> dict[str, xr.Dataset]:
        """Every reduction of one batch, from its captured tensors where they are (the GPU: nothing makes a round
        trip through host memory) and laid out as `store.open` would show them to the probe: (layer, seq, ...)
        tensors in the store's dtype, q/k per value head, inputs zero and outputs NaN at padding. Runs on capture's
        reducer thread (store.reducer), beside the next batch's forward; {reduction: per-token Dataset} with seq
        numbered from 0."""
        from torch.profiler import record_function

        t0 = time.perf_counter()
        n = int(host["tokens"].shape[0])
        pad = np.asarray(host["pad"], dtype=bool)
        missing = pad if pad.any() else None
        with record_function("deltalab.reduce.inputs"):
            template = _template(attrs, n, [v for v in tensors if v in INPUTS])
            stacked = _layer_inputs(attrs, tensors, missing, self.states_picked)
        out = {}
        for name in self.names:
            with record_function(f"deltalab.reduce.{name}"):
                plan = self._plan(name, template, picked=self.states_picked is not None)
                inputs = [{k: x[i] for k, x in stacked.items() if k in plan.names} for i in range(len(attrs["layers"]))]
                tok = plan.on_layers(inputs, np.arange(n, dtype=np.int64), np.asarray(attrs["layers"], np.int64),
                                     missing, stacked)
            if REDUCTIONS[name] is erank and "doc_start" in host:
                tok["doc_start"] = (("seq", "pos"), np.asarray(host["doc_start"], dtype=bool))
            out[name] = tok
        self.seconds["compute"] += time.perf_counter() - t0
        return out

    def write(self, path: Path, attrs: dict[str, Any], start: int, reduced: dict[str, xr.Dataset], n_seq: int) -> None:
        """Write one batch's reductions (from `compute`) at sequences start.. (capture's writer thread)."""
        t0 = time.perf_counter()
        for name, tok in reduced.items():
            tok = tok.assign_coords(seq=np.arange(start, start + tok.sizes["seq"], dtype=np.int64))
            self._write(path, name, tok, start, n_seq, attrs)
        self.seconds["batches"] += time.perf_counter() - t0

    def _plan(self, name: str, ds: xr.Dataset, picked: bool = False) -> LayerPlan:
        module = REDUCTIONS[name]
        if module is erank:
            return erank.plan(ds, device=self.device, every=self.rank_every, picked=picked)
        if module is spectra:
            return spectra.plan(ds, device=self.device, precision=self.spectra_precision)
        return module.plan(ds, device=self.device)

    def _per_token(self, name: str, ds: xr.Dataset) -> xr.Dataset:
        """The probe's lazy per-token results over store data (sequences no batch reduced)."""
        tok = self._plan(name, ds).lazy(ds, self.budget)
        if REDUCTIONS[name] is erank and "doc_start" in ds:
            tok["doc_start"] = ds["doc_start"]
        return tok

    def _write(self, path: Path, name: str, tok: xr.Dataset, start: int, n_seq: int, attrs: dict[str, Any]) -> None:
        import zarr

        probe = REDUCTIONS[name].NAME
        if name not in self._open:
            self._open[name] = self._prepare(path, probe, tok, n_seq, attrs)
            self._groups.pop(name, None)
        if name not in self._groups:
            self._groups[name] = zarr.open_group(str(path), path=results_group(probe), mode="r+", zarr_format=3)
        group = self._groups[name]
        stop = start + tok.sizes["seq"]
        # straight into the arrays `_prepare` laid out (plain numbers: nothing for xarray to encode); each write
        # covers whole chunks along seq, so zarr encodes them concurrently, and the arrays are written at once
        def put(v: str) -> None:
            arr = tok[v]
            names = tuple(group[v].metadata.dimension_names or ())
            if names and names != arr.dims:  # an earlier run's arrays (a resume) keep their own order
                arr = arr.transpose(*names)
            where = tuple(slice(start, stop) if d == "seq" else slice(None) for d in arr.dims)
            group[v][where] = np.asarray(arr.values)

        names = [v for v, arr in tok.data_vars.items() if "seq" in arr.dims]
        with ThreadPoolExecutor(max_workers=WRITE_THREADS, thread_name_prefix="deltalab-reduce-write") as pool:
            list(pool.map(put, names))  # the first error propagates
        done = self._open[name]
        done.update(range(start, stop))
        group.attrs.update({"reduced_seqs": _runs(done)})

    def _prepare(self, path: Path, probe: str, tok: xr.Dataset, n_seq: int, attrs: dict[str, Any]) -> set[int]:
        """Open `results/<probe>` for this capture (kept when it already covers the store's sequences, as on a
        resume) or create it with every sequence empty; the set of sequences already reduced."""
        import dask.array as da

        group = Path(path) / results_group(probe)
        old = _existing(path, probe)
        if old is not None and old.sizes.get("seq", n_seq + 1) <= n_seq and set(tok.data_vars) <= set(old.data_vars) \
                and all(old[v].shape[1:] == tok[v].shape[1:] for v in tok.data_vars):
            _reuse(path, probe, set(tok.variables), n_seq)  # a resume or an append: keep what was reduced
            return _from_runs(old.attrs.get("reduced_seqs", []))
        template = {}
        batch = tok.sizes["seq"]
        for v, arr in tok.data_vars.items():
            shape = (n_seq, *arr.shape[1:])
            chunks = tuple(batch if d == "seq" else 1 if d == "layer" else s for d, s in zip(arr.dims, shape))
            template[v] = (arr.dims, da.full(shape, _fill(arr.dtype), dtype=arr.dtype, chunks=chunks), arr.attrs)
        coords = {c: tok.coords[c] for c in tok.coords if "seq" not in tok.coords[c].dims}
        coords["seq"] = np.arange(n_seq, dtype=np.int64)
        empty = clean_encoding(xr.Dataset(template, coords=coords))
        empty.attrs = clean_json({**tok.attrs, **self._provenance(probe, attrs, n_seq), "complete": False,
                                  "reduced_seqs": []})
        if group.exists():
            import shutil

            shutil.rmtree(group)
        from deltalab.store.schema import checksummed

        empty = checksummed(empty, level=1)  # zstd level 1: ~2x zstd's default speed; crc32c: see write_results
        empty.to_zarr(str(path), group=results_group(probe), mode="w", zarr_format=3, consolidated=False,
                      compute=False)
        return set()

    def _provenance(self, probe: str, attrs: dict[str, Any], n_seq: int) -> dict[str, Any]:
        source = {k: attrs.get(k) for k in ("checkpoint_digest", "data_spec", "deltalab_format", "model_config",
                                             "train_length") if k in attrs}
        params = {"reduced_during_capture": True, "device": self.device}
        if probe == erank.NAME:
            params["every"] = self.rank_every
        if probe == spectra.NAME:
            params["precision"] = self.spectra_precision
        return {"probe": probe, "params": params,
                "deltalab_version": deltalab_version(),
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "command_line": self.command_line, "source": source, "n_seq": n_seq,
                "layers": [int(x) for x in attrs.get("layers", [])]}

    # --- at the end -------------------------------------------------------------------------------

    def finish(self, path: Path) -> dict[str, int]:
        """Reduce the store's sequences no batch reduced, then summarise each probe and mark it complete;
        {probe: sequences computed from the store here}."""
        from deltalab import store

        t0 = time.perf_counter()
        ds = store.open(path)
        heads = head_numbers(ds)  # capture --heads: the summaries are labelled with the model's head numbers
        pos_ds = positional_heads(ds)
        attrs = dict(ds.attrs)
        n_seq = int(attrs["segments"][-1]["start"] + attrs["segments"][-1]["count"])
        from_store: dict[str, int] = {}
        for name in self.names:
            probe = REDUCTIONS[name].NAME
            have = self._open.get(name)
            if have is None:
                old = _existing(path, probe)
                have = _from_runs(old.attrs.get("reduced_seqs", [])) if old is not None else set()
            todo = [int(s) for s in ds["seq"].values if int(s) not in have]
            lacking = [v for v in NEEDS[name] if v in ("q", "k", "v", "beta") and v not in ds]
            if todo and lacking:
                raise ValueError(
                    f"sequences {_describe(todo)} of {path} were captured without --reduce and the store lacks "
                    f"{','.join(lacking)}: their {probe} results are missing; recapture them into a new --out with "
                    f"--reduce {name}, or with those hooks and then `deltalab probe {probe}`")
            batch = int(attrs["batch_size"])
            for a in range(0, len(todo), batch):
                part = ds.sel(seq=todo[a:a + batch])
                for run in _runs(set(int(s) for s in part["seq"].values)):
                    piece = part.sel(seq=slice(run[0], run[1] - 1))
                    self._write(path, name, self._per_token(name, positional_heads(piece)).compute(), run[0], n_seq,
                                attrs)
            from_store[probe] = len(todo)
            tok = read_results(path, probe).sel(seq=ds["seq"].values)
            result = _from_tokens(name, tok, pos_ds)
            result.dataset, result.records = relabel_heads(result.dataset, result.records, heads)
            sink = ResultSink(path, probe)
            sink.started = True
            sink.finish(result)
        self.seconds["finish"] += time.perf_counter() - t0
        return from_store


def _from_tokens(name: str, tok: xr.Dataset, ds: xr.Dataset) -> Any:
    """The probe's own summary of the per-token arrays, without the group's bookkeeping attrs."""
    tok = positional_heads(tok)  # a finished earlier run labelled its heads: the summary works on positions
    tok.attrs = {k: v for k, v in tok.attrs.items() if k not in ("records", "complete", "reduced_seqs")}
    return REDUCTIONS[name].from_tokens(tok, ds)


def _reuse(path: Path, probe: str, per_token: set[str], n_seq: int) -> None:
    """Make an earlier run's `results/<probe>` take this capture's batches: grow its per-token arrays to `n_seq`
    sequences (the new ones empty), drop its summaries (rewritten at the end) and mark it incomplete."""
    import zarr

    group = zarr.open_group(str(path), path=results_group(probe), mode="r+", zarr_format=3)
    group.attrs.update({"complete": False})
    for name in list(group.array_keys()):
        if name not in per_token:
            del group[name]
            continue
        arr = group[name]
        dims = list(arr.metadata.dimension_names or ())
        if "seq" not in dims or arr.shape[dims.index("seq")] == n_seq:
            continue
        axis, before = dims.index("seq"), arr.shape[dims.index("seq")]
        arr.resize(tuple(n_seq if i == axis else s for i, s in enumerate(arr.shape)))
        where = tuple(slice(before, n_seq) if i == axis else slice(None) for i in range(arr.ndim))
        arr[where] = np.arange(before, n_seq) if name == "seq" else _fill(arr.dtype)


def _existing(path: Path, probe: str) -> xr.Dataset | None:
    if not (Path(path) / results_group(probe) / "zarr.json").exists():
        return None
    try:
        return read_results(path, probe)
    except Exception:  # noqa: BLE001 - an unreadable old group is replaced
        return None


def _runs(seqs: set[int]) -> list[list[int]]:
    """Sorted sequence indices as [start, stop) runs (a short JSON attr however many sequences)."""
    out: list[list[int]] = []
    for s in sorted(seqs):
        if out and out[-1][1] == s:
            out[-1][1] = s + 1
        else:
            out.append([s, s + 1])
    return out


def _describe(seqs: list[int]) -> str:
    return ", ".join(f"{a}..{b - 1}" if b - a > 1 else str(a) for a, b in _runs(set(seqs))[:4])


def _from_runs(runs: list[list[int]]) -> set[int]:
    return {s for a, b in runs for s in range(int(a), int(b))}
