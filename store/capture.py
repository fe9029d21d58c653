"""Run a checkpoint over data under nnsight and stream its hook points into a deltalab store.

One batch = one chunk of the store along `seq`: the model runs the batch in an nnsight trace that
caches the requested hook points, their device-to-host copies are queued without waiting (pinned
memory on CUDA), a background thread writes the arrays and then the batch's `complete` flags, and
at most `QUEUE_DEPTH` batches wait in memory, whatever the data size.
Rerunning the same command skips complete batches (resume); a new data spec appends. Under
`torchrun` (WORLD_SIZE > 1) rank r takes batches r, r + N, ...; rank 0 creates the store first.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.store import schema
from deltalab.store.data import Data
from deltalab.store.errors import StoreError
from deltalab.store.lock import StoreLock, recover_results, remove_creating_leftovers
from deltalab.store.plan import CapturePlan, head_index, plan_capture
from deltalab.store.reducer import BackgroundReducer
from deltalab.store.runner import HookedRunner, HostBatch
from deltalab.store.schema import human_bytes
from deltalab.store.writer import Segment, StoreWriter

QUEUE_DEPTH = 2
"""Batches computed but not yet written; bounds memory (plus one being computed, one being written)."""

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


def capture(checkpoint: str | Path, data: str | Data, out: str | Path, *,
            hooks: str | Sequence[str] | None = None, layers: str | Sequence[int] | None = None,
            batch_size: int | None = None, device: str = "cpu",
            dtype: str = "float32", progress: bool = True, command_line: list[str] | None = None,
            model: Any = None, model_dtype: str = "float32", device_map: str | None = None,
            state_every: int = 1, reductions: Any = None,
            heads: str | Sequence[int] | None = None, allow_nonfinite: bool = False) -> dict[str, Any]:
    """Capture `checkpoint` over `data` (a spec string or Data) into store `out`; returns a summary dict.

    Weights holding NaN/Inf are refused at load unless `allow_nonfinite`; the store then names the tensors that
    hold them in its `nonfinite_tensors` attribute.

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

    Every argument is checked first (`store.plan.plan_capture`: a CaptureError before anything is written), then
    `execute` runs the plan.

    Returns:
        dict: `store`, `data_spec`, `segment` ([first, stop) sequences of this spec), `rank`, `world_size`,
        `written` / `skipped` / `complete` / `sequences` (counts of sequences), `seconds`, the pipeline's timings
        (`writer_busy_s`, `model_blocked_s`, `reduce_wait_s`, `steady_s_per_batch`), `reduced`,
        `reduced_from_store` and the size estimate (`estimated_bytes`, `estimated_bytes_per_token`).
    """
    t0 = time.perf_counter()
    plan = plan_capture(checkpoint, data, out, hooks=hooks, layers=layers, batch_size=batch_size, device=device,
                        dtype=dtype, progress=progress, command_line=command_line, model=model,
                        model_dtype=model_dtype, device_map=device_map, state_every=state_every,
                        reductions=reductions, heads=heads, allow_nonfinite=allow_nonfinite)
    return execute(plan, t0)


def execute(plan: CapturePlan, t0: float | None = None) -> dict[str, Any]:
    """Open (or create, or append to) the plan's store and run its batches: the model on one batch while the
    previous ones are copied and written; returns the summary dict. `t0`: perf_counter at the capture's start
    (the summary's `seconds` count from it; default now).

    One capture per store at a time: rank 0 holds the store's lock (for every rank under torchrun), and under it
    clears what interrupted captures and probes left beside the store before resuming."""
    lock = StoreLock(plan.out) if plan.rank == 0 else None
    if lock is not None:
        lock.acquire()
    try:
        if lock is not None:
            remove_creating_leftovers(plan.out)
            if (plan.out / "zarr.json").exists():
                recover_results(plan.out)
        return _run(plan, t0)
    finally:
        if lock is not None:
            lock.release()


def _run(plan: CapturePlan, t0: float | None) -> dict[str, Any]:
    """`execute` under the lock: the batches the store still needs, damaged ones included (`_repair`)."""
    t0 = time.perf_counter() if t0 is None else t0
    out, data, sizes, attrs, estimate = plan.out, plan.data, plan.sizes, plan.attrs, plan.estimate
    variables, captured, reductions = plan.variables, plan.captured, plan.reductions
    rank, world, progress, state_every = plan.rank, plan.world, plan.progress, plan.state_every
    writer, segment, own_group = _open_store(out, attrs, data, rank, world, plan.device)
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
             and (p := head_index(v, sizes, plan.head_sel)) is not None}
    runner = HookedRunner(plan.model, captured, plan.layers, plan.dtype, data.num_classes, state_every,
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
        "rank": rank, "world_size": world, "written": n_todo, "repaired": list(getattr(writer, "repaired", [])),
        "reduce_wait_s": round(reducer.wait_s, 3) if reducer is not None else 0.0,
        "skipped": sum(b - a for a, b in todo) - n_todo, "complete": writer.n_complete(),
        "sequences": writer.segments()[-1].stop, "seconds": round(time.perf_counter() - t0, 3),
        "writer_busy_s": round(bg.busy_s, 3), "model_blocked_s": round(bg.blocked_s, 3),
        "steady_s_per_batch": _steady(bg.put_times),
        "reduced": list(getattr(reductions, "names", [])), "reduced_from_store": reduced_from_store,
        "estimated_bytes": estimate["bytes"], "estimated_bytes_per_token": estimate["bytes_per_token"],
    }


def _open_store(out: Path, attrs: dict[str, Any], data: Data, rank: int, world: int,
                device: str) -> tuple[StoreWriter, Segment, bool]:
    """Rank 0 creates/opens the store; other ranks wait for it, then open it.

    Returns (writer, segment, whether this call initialised torch.distributed)."""
    if world <= 1:
        writer, segment = StoreWriter.create_or_append(out, attrs, data.spec, len(data), data.digest())
        writer.repaired = _repair(writer, segment)
        return writer, segment, False
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
            result[0].repaired = _repair(*result)
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
    writer.repaired = []  # rank 0 repaired before the barrier; the flags it cleared make those batches pending
    return writer, writer.segment(data.spec), own_group


def _repair(writer: StoreWriter, segment: Segment) -> list[int]:
    """Resume verifies: the damaged sequences of `segment` (and any of other segments sharing their chunks) are made
    pending again (StoreWriter.repair) and named on stderr; returns the damaged sequence indices."""
    from deltalab.store.verify import seq_spans

    damage = writer.repair(segment)
    if not damage:
        return []
    seqs = sorted({s for d in damage if d.seq is not None for s in range(*d.seq)})
    shown = "; ".join(d.describe() for d in damage[:4]) + (f"; and {len(damage) - 4} more" if len(damage) > 4 else "")
    print(f"capture: {writer.path}: recapturing damaged sequence(s) {seq_spans(seqs)} ({shown})",
          file=sys.stderr, flush=True)
    outside = [s for s in seqs if not segment.start <= s < segment.stop]
    if outside:
        specs = sorted({seg.data_spec for seg in writer.segments() for s in outside if seg.start <= s < seg.stop})
        print(f"capture: sequence(s) {seq_spans(outside)} share those chunks but belong to data spec(s) "
              f"{', '.join(specs)}: rerun their capture command(s) too", file=sys.stderr, flush=True)
    return seqs
