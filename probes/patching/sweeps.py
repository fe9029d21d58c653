"""Patching sweeps: every hook x layer x head x position (activation patching), every layer x head x token (state
patching), each a batch of patched runs, normalised 0 = corrupted, 1 = clean. Results are xarray Datasets.

Denoising runs the corrupted sequence with the clean run's activations patched in (which activations restore
the behaviour?); noising runs the clean sequence with the corrupted run's (which ones break it?). Both are
reported on the same scale: (metric - corrupted) / (clean - corrupted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import nn

from deltalab.probes.patching.hooks import (
    RESID_HOOKS,
    ActPatch,
    head_axis,
    hook_module,
    hook_name,
    is_delta_layer,
    mixer_name,
)
from deltalab.probes.patching.metrics import Metric, PatchingError, normalise
from deltalab.probes.patching.runs import Run, batches, patched_logits
from deltalab.probes.patching.states import StatePart, StatePatch

DIRECTIONS = ("denoise", "noise")


def prepare(model: nn.Module, clean: Any, corrupted: Any, metric: Metric, direction: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean ids [T], corrupted ids [T]) on the model's device, checked; PatchingError (one line) otherwise."""
    if direction not in DIRECTIONS:
        raise PatchingError(f"direction {direction!r}: use denoise (clean into corrupted) or noise (the reverse)")
    device = next(model.parameters()).device
    ids = []
    for name, x in (("clean", clean), ("corrupted", corrupted)):
        t = torch.as_tensor(np.asarray(x), dtype=torch.long, device=device).reshape(-1)
        if t.numel() == 0:
            raise PatchingError(f"the {name} sequence is empty: give at least one token")
        vocab = model.config.vocab_size
        if int(t.min()) < 0 or int(t.max()) >= vocab:
            raise PatchingError(f"the {name} sequence has token id {int(t.max() if t.max() >= vocab else t.min())}"
                                f" outside the vocabulary 0..{vocab - 1}")
        ids.append(t)
    if len(ids[0]) != len(ids[1]):
        raise PatchingError(f"clean ({len(ids[0])} tokens) and corrupted ({len(ids[1])} tokens) differ in length: "
                            "patching aligns them position by position, so give sequences of one length")
    metric.check(model.config.vocab_size, len(ids[0]))
    return ids[0], ids[1]


class _Experiment:
    """The clean and corrupted runs, their metrics, and which run is patched from which."""

    def __init__(self, model: nn.Module, clean: Any, corrupted: Any, metric: Metric, direction: str) -> None:
        self.model, self.metric, self.direction = model, metric, direction
        clean_ids, corrupted_ids = prepare(model, clean, corrupted, metric, direction)
        self.clean, self.corrupted = Run.record(model, clean_ids), Run.record(model, corrupted_ids)
        self.clean_metric = float(self.score(self.clean.logits[None]))
        self.corrupted_metric = float(self.score(self.corrupted.logits[None]))
        self.base, self.source = ((self.corrupted, self.clean) if direction == "denoise"
                                  else (self.clean, self.corrupted))

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        return self.metric(logits, self.clean.ids, self.clean.logits)

    def attrs(self) -> dict[str, Any]:
        return {"metric": self.metric.label, "direction": self.direction, "clean_metric": self.clean_metric,
                "corrupted_metric": self.corrupted_metric, "metric_positions": self.metric.resolve_positions(
                    len(self.clean.ids)), "normalised": "0 = corrupted run's metric, 1 = clean run's"}

    def run_rows(self, rows: list, batch_size: int, kind: str, desc: str) -> np.ndarray:
        """The metric of every row (a list of patches), batch_size rows per forward."""
        from tqdm.auto import tqdm

        out = []
        with torch.no_grad():
            chunks = list(batches(rows, batch_size))
            for chunk in tqdm(chunks, desc=desc, leave=False, disable=len(chunks) < 4):
                kw = {"act": chunk} if kind == "act" else {"state": chunk}
                logits = patched_logits(self.model, self.base.ids, self.source, **kw)
                out.append(self.score(logits).double().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0)


def sweep_cells(model: nn.Module, hooks: Sequence[str], layers: Sequence[int], seq_len: int, per_head: bool,
                per_position: bool, positions: Sequence[int] | None = None) -> list[ActPatch]:
    """Every (hook, layer, head, position) cell an activation sweep runs (head/position None: all at once)."""
    cells = []
    pos: list[int | None] = list(positions if positions is not None else range(seq_len)) if per_position else [None]
    for hook in hooks:
        for layer in layers:
            if hook_module(model, hook, layer) is None:
                continue
            heads: list[int | None] = [None]
            if per_head and hook not in RESID_HOOKS:
                heads = list(range(_n_heads(model, hook, layer)))
            cells += [ActPatch(hook, layer, h, p) for h in heads for p in pos]
    return cells


def _n_heads(model: nn.Module, hook: str, layer: int) -> int:
    attn = getattr(model.layers[layer], "attn", None)
    if attn is None or hook_module(model, hook, layer) is None:
        return 0
    if is_delta_layer(model, layer):
        key_heads = getattr(attn, "num_k_heads", None) or attn.num_heads
        return key_heads if hook in ("q", "k") else attn.num_v_heads
    return int(getattr(attn, "num_heads", 1))


def _check_layers(model: nn.Module, layers: Sequence[int] | None) -> list[int]:
    n = len(model.layers)
    layers = list(range(n)) if layers is None else [int(x) for x in layers]
    for layer in layers:
        if not 0 <= layer < n:
            raise PatchingError(f"layer {layer} is out of range (the model has layers 0..{n - 1})")
    return layers


def _check_positions(positions: Sequence[int] | None, seq_len: int, what: str = "position") -> list[int] | None:
    if positions is None:
        return None
    for p in positions:
        if not 0 <= p < seq_len:
            raise PatchingError(f"{what} {p} is out of range (the sequence has {seq_len} tokens: 0..{seq_len - 1})")
    return [int(p) for p in positions]


def activation_patching(model: nn.Module, clean: Any, corrupted: Any, metric: Metric | str, *,
                        hooks: Sequence[str] = ("resid_pre",), layers: Sequence[int] | None = None,
                        per_head: bool = True, per_position: bool = True, positions: Sequence[int] | None = None,
                        direction: str = "denoise", batch_size: int = 32) -> xr.Dataset:
    """Patch each hook output of one run into the other, one cell per patched run, batch_size runs per forward.

    clean, corrupted: token ids [T] (one length). metric: a Metric or its spelling ('logit-diff:3,5').
    hooks: names from `hooks.HOOKS`; per_head: head hooks one head at a time (else every head at once, head -1);
    per_position: one position at a time (else every position at once, position -1), `positions` limiting them.
    Returns a Dataset with `patched` (normalised) and `metric` over (hook, layer, head, position); cells that
    do not exist (a residual hook's heads, a hook a layer lacks) are NaN."""
    metric = Metric.parse(metric) if isinstance(metric, str) else metric
    exp = _Experiment(model, clean, corrupted, metric, direction)
    T = len(exp.clean.ids)
    hooks = [hook_name(h) for h in hooks]
    layers = _check_layers(model, layers)
    positions = _check_positions(positions, T)
    cells = sweep_cells(model, hooks, layers, T, per_head, per_position, positions)
    values = exp.run_rows([[c] for c in cells], batch_size, "act", "activation patching")
    n_heads = max([_n_heads(model, h, layer) for h in hooks for layer in layers if h not in RESID_HOOKS] or [0])
    head_coord = [-1] + (list(range(n_heads)) if per_head else [])
    pos_coord = (positions if positions is not None else list(range(T))) if per_position else [-1]
    raw = np.full((len(hooks), len(layers), len(head_coord), len(pos_coord)), np.nan)
    for c, v in zip(cells, values):
        raw[hooks.index(c.hook), layers.index(c.layer), head_coord.index(-1 if c.head is None else c.head),
            pos_coord.index(-1 if c.position is None else c.position)] = v
    dims = ("hook", "layer", "head", "position")
    ds = xr.Dataset(
        {"patched": (dims, normalise(raw, exp.clean_metric, exp.corrupted_metric),
                     {"description": "normalised metric of the patched run: 0 = corrupted, 1 = clean"}),
         "metric": (dims, raw, {"description": f"{metric.label} of the patched run"})},
        coords={"hook": hooks, "layer": layers, "head": head_coord, "position": pos_coord},
        attrs={**exp.attrs(), "experiment": "activation patching", "all_index": -1},
    )
    return ds


def state_patching(model: nn.Module, clean: Any, corrupted: Any, metric: Metric | str, *,
                   layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                   tokens: Sequence[int] | None = None, parts: Sequence[StatePart] = (StatePart(),),
                   direction: str = "denoise", batch_size: int = 32) -> xr.Dataset:
    """Patch each head's state after each token from one run into the other and let the recurrence run on.

    layers: delta-rule layers (default all of them); heads: value heads (default all); tokens (default all);
    parts: which part of the source state (`StatePart`: full, rank r, top r key directions, a key direction).
    Returns `patched` (normalised) and `metric` over (part, layer, head, token)."""
    metric = Metric.parse(metric) if isinstance(metric, str) else metric
    exp = _Experiment(model, clean, corrupted, metric, direction)
    T = len(exp.clean.ids)
    if layers is None:
        layers = [i for i in range(len(model.layers)) if is_delta_layer(model, i)]
    layers = _check_layers(model, layers)
    if not layers:
        raise PatchingError("the model has no delta-rule layer (RWKV-7 and softmax attention keep other states): "
                            "state patching runs on DeltaNet, Gated DeltaNet, DeltaProduct and KDA layers")
    for layer in layers:
        if not is_delta_layer(model, layer):
            raise PatchingError(f"layer {layer} is a {mixer_name(model, layer)} layer without a delta-rule state: "
                                "pick delta-rule layers")
    tokens = _check_positions(tokens, T, "token") or list(range(T))
    hv = max([model.layers[i].attn.num_v_heads for i in layers] or [0])
    heads = list(range(hv)) if heads is None else [int(h) for h in heads]
    cells = [(pi, StatePatch(layer, h, t, part)) for pi, part in enumerate(parts) for layer in layers
             for h in heads for t in tokens]
    values = exp.run_rows([[c] for _, c in cells], batch_size, "state", "state patching")
    raw = np.full((len(parts), len(layers), len(heads), len(tokens)), np.nan)
    for (pi, c), v in zip(cells, values):
        raw[pi, layers.index(c.layer), heads.index(c.head), tokens.index(c.token)] = v
    dims = ("part", "layer", "head", "token")
    return xr.Dataset(
        {"patched": (dims, normalise(raw, exp.clean_metric, exp.corrupted_metric),
                     {"description": "normalised metric after the state patch: 0 = corrupted, 1 = clean"}),
         "metric": (dims, raw, {"description": f"{metric.label} after the state patch"})},
        coords={"part": [p.label for p in parts], "layer": layers, "head": heads, "token": tokens},
        attrs={**exp.attrs(), "experiment": "state patching"},
    )


__all__ = ["activation_patching", "state_patching", "head_axis"]
