"""Capture-time reductions on their own thread and CUDA stream, one batch behind the forward.

The forward of batch i+1 runs while batch i's reductions run beside it: the GPU overlaps the two, and the host
work of the reductions (their syncs, numpy, xarray) no longer holds up the kernel launches of the forward. At
most one batch is reduced at a time, so the reduction inputs of at most two batches are alive at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any


class BackgroundReducer:
    """`submit(tensors, host)` returns a Future of `fn(tensors, host)`; the tensors must not be changed after."""

    def __init__(self, fn: Callable[[dict[str, Any], dict[str, Any]], Any]) -> None:
        self.fn = fn
        self.wait_s = 0.0  # the forward's time waiting for the previous batch's reductions
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltalab-reduce")
        self._pending: Future | None = None
        self._streams: dict[Any, Any] = {}

    def submit(self, tensors: dict[str, Any], host: dict[str, Any]) -> Future:
        import torch

        if self._pending is not None:  # one batch in flight: bounds memory (a failure reaches the writer)
            t0 = time.perf_counter()
            wait([self._pending])
            self.wait_s += time.perf_counter() - t0
        device = next((t.device for t in tensors.values() if isinstance(t, torch.Tensor)), None)
        ready = None
        if device is not None and device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # the forward's work that produced the tensors
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
        self._pending = self._pool.submit(self._run, tensors, host, ready, self._streams.get(device))
        return self._pending

    def _run(self, tensors: dict[str, Any], host: dict[str, Any], ready: Any, stream: Any) -> Any:
        import torch

        with torch.no_grad():
            if stream is None:
                return self.fn(tensors, host)
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                try:
                    return self.fn(tensors, host)
                finally:  # the inputs (allocated by the forward's stream) are freed only once nothing reads them
                    stream.synchronize()

    def close(self) -> None:
        """Finish the batch in flight and end the thread."""
        self._pool.shutdown(wait=True)
