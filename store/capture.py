"""Run a checkpoint over data under nnsight and stream its hook points into a deltalab store.

One batch = one chunk of the store along `seq`: the model runs the batch in an nnsight trace that
caches the requested hook points, their device-to-host copies are queued without waiting (pinned
memory on CUDA), a background thread writes the arrays and then the batch's `complete` flags, and
at most `QUEUE_DEPTH` batches wait in memory, whatever the data size.
Rerunning the same command skips complete batches (resume); a new data spec appends. Under
`torchrun` (WORLD_SIZE > 1) rank r takes batches r, r + N, ...; rank 0 creates the store first.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.models.run_files import deltalab_version, training_length
from deltalab.store import schema
from deltalab.store.data import Data, load_data
from deltalab.store.errors import StoreError, StoreMismatchError
from deltalab.store.reducer import BackgroundReducer
from deltalab.store.runner import HookedRunner, HostBatch
from deltalab.store.schema import human_bytes
from deltalab.store.writer import Segment, StoreWriter

QUEUE_DEPTH = 2
"""Batches computed but not yet written; bounds memory (plus one being computed, one being written)."""

DEFAULT_BATCH_SIZE = 8


class CaptureError(StoreError):
    """Bad capture arguments (layers, hooks, batch size, device)."""


# --- provenance --------------------------------------------------------------------------

def checkpoint_digest(folder: str | Path) -> str:
    """`sha256:<hex>` of the checkpoint's weights file (model.safetensors, else pytorch_model.bin), or of
    its shards in order (model.safetensors.index.json)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file() and not (folder / "model.safetensors").is_file():
        import json

        h = hashlib.sha256()
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            with open(folder / shard, "rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 22), b""):
                    h.update(block)
        return "sha256:" + h.hexdigest()
    for name in ("model.safetensors", "pytorch_model.bin"):
        f = folder / name
        if f.is_file():
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            return "sha256:" + h.hexdigest()
    return "sha256:unknown"


# --- arguments ---------------------------------------------------------------------------

def parse_list(text: str | Sequence | None) -> list[str] | None:
    """"a,b" -> ["a", "b"]; lists pass through; None stays None."""
    if text is None:
        return None
    if isinstance(text, str):
        return [t.strip() for t in text.split(",") if t.strip()]
    return [str(t) for t in text]


def resolve_layers(layers: str | Sequence[int] | None, num_layers: int,
                   delta_layers: Sequence[int] | None = None) -> list[int]:
    """Captured layer indices (sorted, unique); CaptureError if one is outside 0..num_layers-1.

    `delta_layers` (hybrids: the real indices of the delta-rule layers) is the default and the only
    layers allowed; softmax-attention layers have no hooks to capture.
    """
    if layers is None:
        return list(range(num_layers)) if delta_layers is None else sorted(delta_layers)
    out = []
    for item in parse_list(layers) or []:
        try:
            i = int(item)
        except ValueError:
            raise CaptureError(f"--layers {item!r} is not an integer; pass e.g. --layers 0,1") from None
        if not 0 <= i < num_layers:
            raise CaptureError(f"layer {i} is out of range: the model has {num_layers} layer(s) "
                               f"(0..{num_layers - 1})")
        if delta_layers is not None and i not in delta_layers:
            raise CaptureError(f"layer {i} is a softmax-attention layer: the delta-rule layers are "
                               f"{','.join(map(str, delta_layers))}; pass --layers among them or omit it")
        out.append(i)
    if not out:
        raise CaptureError("--layers is empty; pass e.g. --layers 0 or omit it for all layers")
    return sorted(set(out))


def _int_ranges(text: str, flag: str, example: str) -> list[int]:
    """"0,3-5" -> [0, 3, 4, 5]; CaptureError (one line) for anything else."""
    out: list[int] = []
    for part in parse_list(text) or []:
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise CaptureError(f"{flag} {part!r} is not an integer or a range; pass e.g. {flag} {example}") from None
        if b < a:
            raise CaptureError(f"{flag} {part!r} is an empty range; write it low-high, e.g. {flag} {example}")
        out.extend(range(a, b + 1))
    return out


def resolve_heads(heads: str | Sequence[int] | None, num_heads: int,
                  key_head_of: Sequence[int] | None = None) -> tuple[list[int], list[int] | None] | None:
    """(value heads, key heads or None) that `--heads` captures (sorted, unique, model numbers); None = all.

    `--heads 0,3-5` names value heads (the `head` dim of every per-head variable). On grouped models
    (`key_head_of`: value head -> key head) q and k are kept for the key heads those value heads read, and
    `--heads key:0,1` names key heads instead (every value head reading them is captured).
    CaptureError (one line, with the fix) for a bad, empty or out-of-range selection."""
    if heads is None:
        return None
    text = heads if isinstance(heads, str) else ",".join(map(str, heads))
    by_key = text.strip().startswith("key:")
    grouped = key_head_of is not None
    n_key = len(set(key_head_of)) if grouped else num_heads
    if by_key and not grouped:
        raise CaptureError(f"--heads {text}: this model does not group its heads (each of its {num_heads} heads has "
                           f"its own keys); drop key: and pass e.g. --heads 0,1")
    picked = _int_ranges(text.strip()[4:] if by_key else text, "--heads", "key:0,1" if by_key else "0,3-5")
    if not picked:
        raise CaptureError("--heads is empty; pass e.g. --heads 0 or omit it for all heads")
    limit, what = (n_key, "key head") if by_key else (num_heads, "value head" if grouped else "head")
    for h in picked:
        if not 0 <= h < limit:
            msg = f"{what} {h} is out of range: the model has {limit} {what}s (0..{limit - 1})"
            if grouped and by_key:
                msg += f" and {num_heads} value heads; drop key: to name value heads (--heads 0,{num_heads - 1})"
            elif grouped:
                msg += (f" and {n_key} key heads; --heads names value heads (q, k are kept for the key heads they "
                        f"read), --heads key:0,{n_key - 1} names key heads")
            raise CaptureError(msg)
    if not grouped:
        return sorted(set(picked)), None
    if by_key:
        values = [j for j, kh in enumerate(key_head_of) if kh in set(picked)]
    else:
        values = sorted(set(picked))
    return values, sorted({int(key_head_of[j]) for j in values})


def head_index(var: str, sizes: dict[str, int], heads: tuple[list[int], list[int] | None] | None
               ) -> tuple[int, list[int]] | None:
    """(axis, model head numbers) to keep of per-layer variable `var` laid out [layer, seq, ...] (the store's dims
    with seq and layer swapped); None when `var` has no head axis or every head is captured."""
    if heads is None:
        return None
    dims = schema.dims_of(var, sizes)
    if "key_head" in dims:
        return dims.index("key_head"), list(heads[1] or [])
    if "head" in dims:
        return dims.index("head"), list(heads[0])
    return None


def _dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


# --- background writing --------------------------------------------------------------------

class BackgroundWriter:
    """Writes batches on a thread so the model never waits on disk; errors resurface on the caller.

    `busy_s` is the thread's time waiting for copies and writing; `blocked_s` the producer's time
    waiting for queue space (the model waiting on the disk); `put_times` when each batch was handed over (after
    its forward): their spacing is capture's pace once the pipeline is full, without the drain at the end."""

    def __init__(self, writer: StoreWriter, depth: int = QUEUE_DEPTH, on_done: Any = None,
                 after_write: Any = None) -> None:
        self.writer = writer
        self.on_done = on_done
        self.after_write = after_write
        self.error: BaseException | None = None
        self.busy_s = self.blocked_s = 0.0
        self.put_times: list[float] = []
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="deltalab-store-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain, so a producer blocked on put() wakes up
            start, batch = item
            t0 = time.perf_counter()
            try:
                from torch.profiler import record_function

                with record_function("deltalab.writer.arrays"):
                    arrays = batch.arrays()
                with record_function("deltalab.writer.write_batch"):
                    self.writer.write_batch(start, arrays)
                if self.after_write is not None:  # the batch's reductions (probes.reduce)
                    with record_function("deltalab.writer.reduced"):
                        self.after_write(start, batch.reduced)
                if self.on_done is not None:
                    self.on_done(len(next(iter(arrays.values()))))
            except BaseException as err:  # noqa: BLE001 - handed to the producer thread
                self.error = err
            self.busy_s += time.perf_counter() - t0

    def put(self, start: int, batch: HostBatch) -> None:
        self.raise_error()
        t0 = time.perf_counter()
        self._queue.put((start, batch))
        self.put_times.append(time.perf_counter())
        self.blocked_s += self.put_times[-1] - t0

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Finish the queued batches; re-raise a write error."""
        self.stop()
        self.raise_error()

    def stop(self) -> None:
        """Finish the queued batches (they are valid data) and end the thread; idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


# --- capture ---------------------------------------------------------------------------------

def _steady(put_times: list[float]) -> float | None:
    """Seconds per batch between the first and the last batch handed to the writer (the pace of a long capture:
    the first batch's start-up and the last batch's reductions and writes after the forward are left out); None
    under three batches."""
    if len(put_times) < 3:
        return None
    return round((put_times[-1] - put_times[0]) / (len(put_times) - 1), 4)


def _store_batch_size(out: Path) -> int | None:
    """batch_size of an existing store at `out` (None if there is none)."""
    if not (out / "zarr.json").exists():
        return None
    from deltalab.store.reader import check_store

    return int(check_store(out)["batch_size"])


def capture(checkpoint: str | Path, data: str | Data, out: str | Path, *,
            hooks: str | Sequence[str] | None = None, layers: str | Sequence[int] | None = None,
            batch_size: int | None = None, device: str = "cpu",
            dtype: str = "float32", progress: bool = True, command_line: list[str] | None = None,
            model: Any = None, model_dtype: str = "float32", device_map: str | None = None,
            state_every: int = 1, reductions: Any = None,
            heads: str | Sequence[int] | None = None) -> dict[str, Any]:
    """Capture `checkpoint` over `data` (a spec string or Data) into store `out`; returns a summary dict.

    Creates the store, resumes the same data spec (skipping complete sequences), or appends a new
    spec. Runs data-parallel when launched by torchrun. `model` may pass the already-loaded model.
    `model_dtype` (float32, bfloat16, float16) is the dtype the model runs in; `dtype` the stored one.
    `device_map="auto"` spreads a transformers model over the visible GPUs (accelerate).
    `state_every=N` keeps every N-th chunk-boundary state (chunks of N * CHUNK_SIZE tokens).
    `heads` ("0,3-5", or "key:0,1" on grouped models; see resolve_heads) keeps only those heads of every per-head
    variable; the store's `head` coordinate then holds the model's head numbers (root attr `heads`).
    `reductions` (probes.reduce.CaptureReductions: the `hooks()` it reads, captured even where `hooks` leaves them
    out and then neither copied to the host nor stored; `compute(attrs, tensors, host)` on each batch's tensors
    where the model left them; `write(path, attrs, start, reduced, n_seq)` after the batch is written;
    `finish(path)` at the end) computes analyses while the batch is on the GPU.
    """
    import torch

    t0 = time.perf_counter()
    checkpoint, out = Path(checkpoint), Path(out)
    rank, world, local_rank = _dist_env()
    if dtype not in schema.FLOAT_DTYPES:
        raise CaptureError(f"--dtype {dtype!r} is not supported; use one of {', '.join(schema.FLOAT_DTYPES)}")
    if state_every < 1:
        raise CaptureError(f"--state-every must be >= 1, got {state_every}")
    if reductions is not None and world > 1:
        raise CaptureError("--reduce under torchrun is not supported: capture, then run `deltalab probe` on the store")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CaptureError("--device cuda but no CUDA GPU is visible; use --device cpu")
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
    data = data if isinstance(data, Data) else load_data(data, checkpoint)  # bad data fails before the model loads
    if model is None:
        from deltalab.models import load_checkpoint

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if model_dtype not in dtypes:
            raise CaptureError(f"--model-dtype {model_dtype!r} is not supported; use one of {', '.join(dtypes)}")
        model = load_checkpoint(checkpoint, device=device, dtype=dtypes[model_dtype], device_map=device_map)
    cfg = model.config
    rwkv7 = getattr(cfg, "model_type", None) == "rwkv7"  # beta per key channel, and a removal key kappa
    hook_list = list(parse_list(hooks) or schema.DEFAULT_HOOKS)
    if getattr(cfg, "removal", True) is False:  # Mamba-2 (SSD): no removal, so no beta to capture
        defaults = set(schema.DEFAULT_HOOKS) <= set(hook_list)  # the default list (the CLI spells it out): drop beta
        if "beta" in hook_list and not defaults:
            raise CaptureError(f"--hooks beta: {cfg.family}'s Mamba-2 layers have no removal and no beta "
                               "(every write is whole); drop beta")
        hook_list = [h for h in hook_list if h != "beta"]
    if rwkv7 and "beta" in hook_list and "kappa" not in hook_list:  # beta alone does not give the transition
        hook_list.append("kappa")
    layer_list = resolve_layers(layers, cfg.num_hidden_layers, getattr(cfg, "delta_layers", None))
    head_sel = resolve_heads(heads, cfg.num_value_heads, list(cfg.key_head_of) if cfg.grouped else None)
    try:
        variables = schema.variables_for(hook_list, gated=bool(cfg.use_forget_gate), removal_key=rwkv7)
        read = [h for h in reductions.hooks() if h not in hook_list] if reductions is not None else []
        if "beta" in read and getattr(cfg, "removal", True) is False:
            raise ValueError(f"--reduce reads beta, which {cfg.family}'s Mamba-2 layers do not have (no removal): "
                             "drop the reductions that read it (their transitions reduce to the decay exp(g))")
        if rwkv7 and "beta" in read and "kappa" not in hook_list:  # the reductions' transitions need kappa too
            read.append("kappa")
        captured = schema.variables_for(hook_list + read, gated=bool(cfg.use_forget_gate), removal_key=rwkv7)
    except ValueError as err:
        raise CaptureError(str(err)) from None
    if state_every > 1 and "state" not in variables:
        raise CaptureError(f"--state-every {state_every} but no states are captured; drop --state-every "
                           "or add state to --hooks")
    resid = [h for h in hook_list if h.startswith("resid_")]
    if resid and not getattr(cfg, "single_residual", True):
        raise CaptureError(f"--hooks {','.join(resid)}: {cfg.model_type} keeps several residual streams "
                           "(hyper-connections), so it has no resid hooks; drop them")
    data.check_vocab(cfg.vocab_size)

    stored_batch = _store_batch_size(out)
    if batch_size is not None and batch_size < 1:
        raise CaptureError(f"--batch-size must be >= 1, got {batch_size}")
    if stored_batch is not None and batch_size is not None and batch_size != stored_batch:
        raise StoreMismatchError(f"{out} is chunked by {stored_batch} sequences: "
                                 f"pass --batch-size {stored_batch} or omit it")
    batch = stored_batch or batch_size or DEFAULT_BATCH_SIZE

    model_config = cfg.to_dict()
    sizes = {"pos": data.length, "layer": len(layer_list), "head": cfg.num_value_heads, "step": cfg.num_householder,
             "dk": cfg.head_k_dim, "dv": cfg.head_v_dim,
             "chunk": schema.n_chunks(data.length, CHUNK_SIZE * state_every),
             "hidden": cfg.hidden_size}
    if cfg.grouped:  # grouped heads: q, k per key head (schema.dims_of)
        sizes["key_head"] = cfg.num_key_heads
    if head_sel is not None:  # --heads: the head dims hold the chosen heads only
        sizes["head"] = len(head_sel[0])
        if cfg.grouped:
            sizes["key_head"] = len(head_sel[1] or [])
    if getattr(cfg, "gate", "scalar") == "channel":  # Kimi Delta Attention: g [.., head, dk]
        sizes[schema.GATE_CHANNELS] = cfg.head_k_dim
    if rwkv7:
        sizes[schema.BETA_CHANNELS] = cfg.head_k_dim
    attrs = {
        "model_config": model_config,
        "checkpoint_digest": checkpoint_digest(checkpoint), "deltalab_version": deltalab_version(),
        "command_line": list(command_line if command_line is not None else sys.argv),
        "chunk_size": CHUNK_SIZE * state_every,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hooks": hook_list, "variables": variables, "layers": layer_list, "dtype": dtype,
        "batch_size": batch, "sizes": sizes, "data_meta": data.meta, "world_size": world,
    }
    if "key_head" in sizes:
        attrs["key_head_of"] = list(cfg.key_head_of) if head_sel is None else \
            [int(cfg.key_head_of[j]) for j in head_sel[0]]
    if head_sel is not None:
        attrs["heads"] = head_sel[0]
        if cfg.grouped:
            attrs["key_heads"] = head_sel[1]
    train_length = training_length(checkpoint)
    if train_length is not None:
        attrs["train_length"] = train_length
    attrs["deltalab_format"] = schema.format_version(attrs)  # from the layout above: 1 unless a v1 reader misreads

    if reductions is not None:  # a reduction this model cannot have fails before the store is touched
        try:
            reductions.check(attrs, captured)
        except ValueError as err:
            raise CaptureError(str(err)) from None
    extra = reductions.bytes_per_sequence(attrs, captured) if reductions is not None else 0
    estimate = size_estimate(out, variables, sizes, dtype, len(data), batch, extra)
    check_disk(out, estimate)
    writer, segment, own_group = _open_store(out, attrs, data, rank, world, device)
    if progress and rank == 0:  # once the store is known to accept this capture, before any batch runs
        print(f"capture: about {human_bytes(estimate['bytes_per_token'])} per token, "
              f"{human_bytes(estimate['bytes'])} for {len(data)} sequence(s) of {data.length} tokens "
              f"(uncompressed); {human_bytes(estimate['free'])} free at {estimate['disk']}",
              file=sys.stderr, flush=True)
    todo = [b for i, b in enumerate(writer.batches(segment)) if i % world == rank]
    pending = set(writer.pending(segment))
    todo_pending = [b for b in todo if b in pending]
    n_todo = sum(b - a for a, b in todo_pending)
    reducer = after = state_pick = None
    if reductions is not None:
        n_seq, root = writer.segments()[-1].stop, writer.attrs
        state_pick = reductions.state_boundaries(int(sizes["pos"]), CHUNK_SIZE) if "state" not in variables \
            and state_every == 1 else None
        reductions.states_picked = state_pick

        def reduce(tensors: dict[str, Any], host: dict[str, np.ndarray]) -> Any:
            return reductions.compute(root, tensors, host)

        reducer = BackgroundReducer(reduce)

        def after(start: int, reduced: Any) -> None:
            reductions.write(out, root, start, reduced.result(), n_seq)  # the reducer's Future
    picks = {v: p for v in captured if v in schema.MODEL_HOOK_POINTS
             and (p := head_index(v, sizes, head_sel)) is not None}
    runner = HookedRunner(model, captured, layer_list, dtype, data.num_classes, state_every,
                          reducer.submit if reducer is not None else None, variables, picks,
                          state_pick, reductions.hooks() if reductions is not None else None) if todo_pending else None
    from tqdm.auto import tqdm

    desc = f"capture -> {out.name}" + (f" [rank {rank}]" if world > 1 else "")
    bar = tqdm(total=n_todo, unit="seq", desc=desc,
               disable=not progress or (world > 1 and rank != 0), position=0, leave=False)
    bg = BackgroundWriter(writer, on_done=bar.update, after_write=after)
    try:
        for a, b in todo_pending:
            s, e = a - segment.start, b - segment.start
            bg.put(a, runner(data.tokens[s:e], data.labels[s:e], data.doc_start[s:e], data.pad[s:e]))
        bg.close()
        reduced_from_store = reductions.finish(out) if reductions is not None else {}
    finally:
        bg.stop()
        if reducer is not None:
            reducer.close()
        bar.close()
        if own_group:
            import torch.distributed as dist

            dist.destroy_process_group()
    return {
        "store": str(out), "data_spec": segment.data_spec, "segment": [segment.start, segment.stop],
        "rank": rank, "world_size": world, "written": n_todo,
        "reduce_wait_s": round(reducer.wait_s, 3) if reducer is not None else 0.0,
        "skipped": sum(b - a for a, b in todo) - n_todo, "complete": writer.n_complete(),
        "sequences": writer.segments()[-1].stop, "seconds": round(time.perf_counter() - t0, 3),
        "writer_busy_s": round(bg.busy_s, 3), "model_blocked_s": round(bg.blocked_s, 3),
        "steady_s_per_batch": _steady(bg.put_times),
        "reduced": list(getattr(reductions, "names", [])), "reduced_from_store": reduced_from_store,
        "estimated_bytes": estimate["bytes"], "estimated_bytes_per_token": estimate["bytes_per_token"],
    }


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def size_estimate(out: Path, variables: list[str], sizes: dict[str, int], dtype: str, n_seq: int,
                  batch: int = 1, extra_per_seq: int = 0) -> dict[str, Any]:
    """What the capture will write (uncompressed, an upper bound: chunks hold `batch` sequences, so the last one
    is counted whole; `extra_per_seq`: the reductions' results) and what the disk of `out` has free. Bytes already
    in a store at `out` count as written."""
    import shutil

    per_seq = schema.bytes_per_sequence(variables, sizes, dtype) + extra_per_seq
    existing = 0
    if out.exists():
        existing = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    disk = _existing_parent(out)
    chunks = -(-n_seq // max(1, batch))
    return {"bytes": per_seq * chunks * max(1, batch), "bytes_per_token": per_seq / max(1, sizes["pos"]),
            "already": existing, "free": shutil.disk_usage(disk).free, "disk": str(disk)}


def check_disk(out: Path, estimate: dict[str, Any]) -> None:
    """CaptureError (one line, nothing written) when the store would not fit on the disk of `out`."""
    need = estimate["bytes"] - estimate["already"]
    if need > estimate["free"]:
        raise CaptureError(
            f"--out {out}: the store needs about {human_bytes(need)} but {estimate['disk']} has "
            f"{human_bytes(estimate['free'])} free; capture less (--layers, --heads, --hooks, --dtype float16, "
            "a shorter --data) or pick another --out")


def _open_store(out: Path, attrs: dict[str, Any], data: Data, rank: int, world: int,
                device: str) -> tuple[StoreWriter, Segment, bool]:
    """Rank 0 creates/opens the store; other ranks wait for it, then open it.

    Returns (writer, segment, whether this call initialised torch.distributed)."""
    if world <= 1:
        return (*StoreWriter.create_or_append(out, attrs, data.spec, len(data), data.digest()), False)
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        if device.startswith("cuda"):
            import torch

            # NCCL's collectives run on the current device: without this every rank sits on cuda:0
            torch.cuda.set_device(torch.device(device))
            dist.init_process_group(backend="nccl", device_id=torch.device(device))
        else:
            dist.init_process_group(backend="gloo")
    error: list[str] = [""]
    result = None
    if rank == 0:
        try:
            result = StoreWriter.create_or_append(out, attrs, data.spec, len(data), data.digest())
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, or they wait forever
            error[0] = str(err) if isinstance(err, StoreError) else f"creating {out} failed ({err})"
    dist.broadcast_object_list(error, src=0)  # also the barrier: the store exists after it
    if error[0]:
        if own_group:
            dist.destroy_process_group()
        raise StoreError(error[0])
    if result is not None:
        return (*result, own_group)
    writer = StoreWriter(out)
    writer.check_identity(attrs)
    return writer, writer.segment(data.spec), own_group
