"""The traced forward of one capture batch: the model under nnsight, its hook points stacked per variable on the
device, the stored ones copied to pinned host memory without waiting, and the reductions handed their tensors.

`HookedRunner` is what `store.capture` (and the dashboard's typed input) calls per batch; `HostBatch` is what it
returns to the writer thread.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from deltalab.models import IGNORE_INDEX
from deltalab.store import schema


class HostBatch:
    """One batch's captured arrays on their way to host memory; `arrays()` waits for the copies.

    On CUDA the device-to-host copies are queued asynchronously into pinned memory, so the next
    batch's forward starts at once and the writer thread waits (on an event) instead of the model.
    Per-layer variables arrive as (layer, seq, ...) buffers and leave as (seq, layer, ...) views:
    each layer's block is contiguous, so the store writes a shard's inner chunks without a copy.
    """

    def __init__(self, tensors: dict[str, Any], host: dict[str, np.ndarray], layer_major: set[str],
                 ready: Any = None, reduced: Any = None) -> None:
        self._tensors, self._host, self._layer_major, self._ready = tensors, host, layer_major, ready
        self.reduced = reduced  # what `reduce` returned (capture: a Future of the reductions), written after

    def arrays(self) -> dict[str, np.ndarray]:
        if self._ready is not None:
            self._ready.synchronize()
        out = dict(self._host)
        for var, tensor in self._tensors.items():
            arr = tensor.numpy()
            out[var] = arr.swapaxes(0, 1) if var in self._layer_major else arr
        return out


STREAM_MIN_BYTES = 1 << 30  # a stored variable this large (all layers, model dtype) skips the device stack


class HookedRunner:
    """Run batches through `model` under nnsight, returning the store's variables as a HostBatch."""

    def __init__(self, model: Any, variables: list[str], layers: list[int], dtype: str,
                 num_classes: int | None = None, state_every: int = 1, reduce: Any = None,
                 stored: list[str] | None = None, heads: dict[str, tuple[int, list[int]]] | None = None,
                 state_pick: list[int] | None = None, reduce_reads: list[str] | None = None) -> None:
        import torch
        from nnsight import NNsight

        self.model = model
        self.nn = NNsight(model)
        self.layers = layers
        self.variables = variables
        self.torch_dtype = {"float16": torch.float16, "float32": torch.float32}[dtype]
        self.num_classes = num_classes
        self.state_every = state_every
        self.reduce = reduce  # (device tensors, host arrays) -> reductions (or their Future), before the host copy
        self.stored = set(stored if stored is not None else variables)  # copied to the host; the rest: reduce only
        # what the reductions read (None: everything captured); stored variables outside it go to the host layer by
        # layer on CUDA, never stacked on the device (every state of a 7B hybrid at 8 x 4096 is 29 GB in float32)
        self.reduce_reads = set() if reduce is None else set(variables if reduce_reads is None else reduce_reads)
        self.heads = dict(heads or {})  # var -> (axis in [layer, seq, ...], heads kept): --heads
        self._head_index: dict[tuple[str, Any], Any] = {}
        self.per_layer = [v for v in variables if v in schema.MODEL_HOOK_POINTS]
        # RWKV-7's hooks have no Householder sub-step axis: the store's k, v, beta, kappa get one of length 1
        self.stepless = getattr(getattr(model, "config", None), "model_type", None) == "rwkv7"
        self.envoys: dict[str, list[Any]] = {}
        for var in self.per_layer:
            self.envoys[var] = []
            for i in layers:
                env = self.nn.layers[i]
                for part in schema.MODEL_HOOK_POINTS[var].split("."):
                    env = getattr(env, part)
                self.envoys[var].append(env)
        # states read only by the reductions, at a few chunk boundaries, or stored every N-th chunk: each layer's
        # are cut down as the layer runs (a forward hook), so the whole batch's states are never held (26 GB in
        # float32 at 8 x 4096 on a 7B hybrid)
        self.state_pick: Any = None
        if "state" in self.envoys and "state" not in self.stored:
            self.state_pick = state_pick
        elif "state" in self.envoys and state_every > 1:
            self.state_pick = partial(kept_states, every=state_every)
        self.layer_major = set(self.envoys)  # (layer, seq, ...) on the device, (seq, layer, ...) in the store
        self._state_modules: list[Any] = []
        if self.state_pick is not None:
            self.envoys.pop("state")
            for i in layers:
                mod = model.layers[i]
                for part in schema.MODEL_HOOK_POINTS["state"].split("."):
                    mod = getattr(mod, part)
                self._state_modules.append(mod)

    def __call__(self, tokens: np.ndarray, labels: np.ndarray, doc_start: np.ndarray,
                 pad: np.ndarray | None = None) -> HostBatch:
        import torch

        device = next(self.model.parameters()).device
        cuda = device.type == "cuda"
        ids = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).to(device, non_blocking=cuda)
        on_device: dict[str, Any] = {}
        picked: list[Any] = []
        handles = [m.register_forward_hook(partial(_pick_states, picked, self.state_pick, {}))
                   for m in self._state_modules]
        try:
            with torch.no_grad():
                flat = [e for envs in self.envoys.values() for e in envs]
                if flat:
                    with torch.profiler.record_function("deltalab.capture.trace"), self.nn.trace(ids) as tracer:
                        # device=None: keep captures on the model's device (nnsight's default, CPU, copies
                        # each hook synchronously in the middle of the forward); one copy per variable below
                        cache = tracer.cache(modules=flat, device=None)  # model dtype: stored ones convert below
                        out = self.nn.output.save()
                    logits = out.logits
                else:
                    cache, logits = None, self.model(ids).logits
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            per_layer = {var: [cache[e.path].output for e in envs] for var, envs in self.envoys.items()}
            if picked:
                per_layer["state"] = picked
            streamed: dict[str, Any] = {}
            for var, outputs in per_layer.items():  # (layer, seq, ...): one contiguous block per layer
                if cuda and self._streams(var, outputs, device):
                    streamed[var] = _to_pinned(outputs, self.torch_dtype)
                    continue
                on_device[var] = _stack(outputs)
                if var in self.stored:  # the reductions read stored inputs as the store has them (probes agree);
                    on_device[var] = on_device[var].to(self.torch_dtype)  # the others stay as the model made them
                if self.stepless and var in ("k", "v", "beta", "kappa"):
                    on_device[var] = on_device[var].unsqueeze(3)  # (layer, seq, pos, step = 1, head, ...)
                if var in self.heads:  # --heads: only these heads leave the device (and reach the reductions)
                    axis, keep = self.heads[var]
                    t = on_device[var]
                    key = (var, t.device)
                    if key not in self._head_index:
                        self._head_index[key] = torch.as_tensor(keep, dtype=torch.long, device=t.device)
                    on_device[var] = t.index_select(axis, self._head_index[key])
            if "loss" in self.variables or "correct" in self.variables:
                lab = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)).to(logits.device,
                                                                                         non_blocking=cuda)
                on_device.update({k: t.to(device) for k, t in _token_loss(logits, lab, self.num_classes).items()})
            to_host = {var: t for var, t in on_device.items() if var in self.stored}
            tensors, ready = to_host, None
            if cuda:
                tensors = {var: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for var, t in to_host.items()}
                for var, t in to_host.items():
                    tensors[var].copy_(t, non_blocking=True)
                tensors.update(streamed)
                ready = torch.cuda.Event(blocking=True)  # the writer sleeps on it instead of spinning
                ready.record()
        host: dict[str, np.ndarray] = {}
        if "tokens" in self.variables:
            host["tokens"] = np.asarray(tokens, dtype=np.int32)
        if "doc_start" in self.variables:
            host["doc_start"] = np.asarray(doc_start, dtype=bool)
        if "pad" in self.variables:
            host["pad"] = np.zeros(np.shape(tokens), dtype=bool) if pad is None else np.asarray(pad, dtype=bool)
        if "labels" in self.variables:
            host["labels"] = np.asarray(labels, dtype=np.int32)
        reduced = None
        if self.reduce is not None:
            with torch.no_grad(), torch.profiler.record_function("deltalab.capture.reduce"):
                reduced = self.reduce(on_device, host)
        return HostBatch(tensors, host, self.layer_major, ready, reduced)

    def _streams(self, var: str, outputs: list[Any], device: Any) -> bool:
        """Whether `var` goes to the host layer by layer: stored, read by no reduction, no head or step axis to
        change on the device, every layer on the model's first device (the host copies' event is recorded there),
        and at least STREAM_MIN_BYTES in all (smaller ones keep the stacked path)."""
        if (var not in self.stored or var in self.reduce_reads or var in self.heads
                or (self.stepless and var in ("k", "v", "beta", "kappa"))):
            return False
        if any(t.device != device for t in outputs):
            return False
        return sum(t.numel() * t.element_size() for t in outputs) >= STREAM_MIN_BYTES


def _to_pinned(per_layer: list[Any], dtype: Any, pin: bool = True) -> Any:
    """Per-layer device tensors copied (asynchronously, converted to dtype one layer at a time) into one pinned
    (layer, ...) host tensor: the device never holds the stacked copy."""
    import torch

    out = torch.empty((len(per_layer), *per_layer[0].shape), dtype=dtype, pin_memory=pin)
    for i, t in enumerate(per_layer):
        out[i].copy_(t.to(dtype), non_blocking=True)
    return out


def _stack(per_layer: list[Any]) -> Any:
    """Per-layer tensors as one (layer, ...) tensor on the first layer's device (a model spread over GPUs)."""
    import torch

    first = per_layer[0].device
    return torch.stack([t.to(first, non_blocking=True) for t in per_layer], dim=0)


def _pick_states(out: list[Any], pick: Any, index: dict[Any, Any], _module: Any, _args: Any, states: Any) -> None:
    """Forward hook on a layer's hook_state [B, boundaries, ...]: keep only the boundaries `pick` (a list, or a
    function of the number of boundaries)."""
    import torch

    key = (states.device, states.shape[1])
    if key not in index:
        chosen = pick(states.shape[1]) if callable(pick) else pick
        index[key] = torch.as_tensor(chosen, dtype=torch.long, device=states.device)
    out.append(states.index_select(1, index[key]))


def kept_states(n_boundaries: int, every: int) -> list[int]:
    """Indices of the chunk-boundary states `--state-every N` keeps: every N-th chunk start, and the final
    state. They are the boundaries of chunks N * CHUNK_SIZE long (the store's `chunk_size` attr)."""
    return [*range(0, n_boundaries - 1, every), n_boundaries - 1]


def _token_loss(logits: Any, labels: Any, num_classes: int | None) -> dict[str, Any]:
    """Per-token cross-entropy (NaN where no label) and argmax correctness (over the first num_classes)."""
    import torch
    import torch.nn.functional as F

    logits = logits.float()
    has = labels != IGNORE_INDEX
    ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    ce = ce.view(labels.shape)
    ce = torch.where(has, ce, torch.full_like(ce, float("nan")))
    pred = (logits[..., :num_classes] if num_classes else logits).argmax(-1)
    correct = (pred == labels) & has
    return {"loss": ce, "correct": correct}
