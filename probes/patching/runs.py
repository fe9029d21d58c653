"""A recorded run (logits, hook outputs, states) and many patched runs in one batched forward.

Each row of the batch is the base sequence with its own patches: activation patches (`hooks.ActPatch`) replace a
hook's output by the source run's, state patches (`states.StatePatch`) replace a head's state after a token and
let the recurrence run on. Rows never see each other's patches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from deltalab.probes.patching.hooks import (
    HOOKS,
    ActPatch,
    Cache,
    activation_patch_fns,
    hook_module,
    hooks_installed,
    is_delta_layer,
    mixer_name,
    run_with_cache,
)
from deltalab.probes.patching.metrics import PatchingError
from deltalab.probes.patching.states import StatePatch, patched_outputs, token_states

STATE_INPUTS = ("q", "k", "v", "beta", "g")


def layer_scale(model: nn.Module, layer: int) -> float:
    """The read-out scale of a delta-rule layer (dk^-1/2, the layer's own)."""
    return model.layers[layer].attn.head_k_dim ** -0.5


def key_heads(model: nn.Module) -> list[int] | None:
    """Value head -> the key head it reads (grouped value heads), None when they are the same."""
    cfg = model.config
    return list(cfg.key_head_of) if getattr(cfg, "grouped", False) else None


@dataclass
class Run:
    """One sequence's run: ids [T], logits [T, V], every hook's output (`cache`), states on demand."""

    model: nn.Module
    ids: torch.Tensor
    logits: torch.Tensor
    cache: Cache
    _states: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def record(cls, model: nn.Module, ids: torch.Tensor) -> Run:
        keys = [(h, layer) for layer in range(len(model.layers)) for h in HOOKS]
        logits, cache = run_with_cache(model, ids, keys)
        return cls(model, ids, logits[0], cache)

    def states(self, layer: int) -> torch.Tensor:
        """The state of every head after every token of delta-rule layer `layer`: [T, Hv, dk, dv]."""
        if layer not in self._states:
            if not is_delta_layer(self.model, layer):
                raise PatchingError(f"layer {layer} is a {mixer_name(self.model, layer)} layer "
                                    "without a delta-rule state: pick a delta-rule layer")
            c = self.cache
            self._states[layer] = token_states(c["q", layer], c["k", layer], c["v", layer], c["beta", layer],
                                               c.get(("g", layer)), layer_scale(self.model, layer))[0]
        return self._states[layer]


def check_state_patch(model: nn.Module, p: StatePatch, seq_len: int) -> None:
    """One-line PatchingError when the patch does not fit the model."""
    n = len(model.layers)
    if not 0 <= p.layer < n:
        raise PatchingError(f"layer {p.layer} is out of range (the model has layers 0..{n - 1})")
    if not is_delta_layer(model, p.layer):
        raise PatchingError(f"layer {p.layer} is a {mixer_name(model, p.layer)} layer without a "
                            "delta-rule state: pick a delta-rule layer")
    hv = model.layers[p.layer].attn.num_v_heads
    if not 0 <= p.head < hv:
        raise PatchingError(f"head {p.head} is out of range (layer {p.layer} has heads 0..{hv - 1})")
    if not 0 <= p.token < seq_len:
        raise PatchingError(f"token {p.token} is out of range (the sequence has tokens 0..{seq_len - 1})")


def patched_logits(model: nn.Module, base: torch.Tensor, source: Run, act: list[list[ActPatch]] | None = None,
                   state: list[list[StatePatch]] | None = None,
                   extra: dict[tuple[str, int], Callable[[torch.Tensor], torch.Tensor]] | None = None
                   ) -> torch.Tensor:
    """Logits [N, T, V] of N runs of `base` [T], row r with patches act[r] and state[r] from `source`.

    extra: further forward hooks ((hook, layer) -> fn), applied after the patches (used for gradients)."""
    n_rows = max(len(act or []), len(state or []))
    act = act or [[] for _ in range(n_rows)]
    state = state or [[] for _ in range(n_rows)]
    fns = activation_patch_fns(model, act, source.cache)
    by_layer: dict[int, list[tuple[int, int, int, object, object]]] = {}
    for r, row in enumerate(state):
        for p in row:
            check_state_patch(model, p, len(base))
            by_layer.setdefault(p.layer, []).append((r, p.head, p.token, p.part, p.value))
    seen: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in by_layer}
    for layer, items in by_layer.items():
        for name in STATE_INPUTS:
            if hook_module(model, name, layer) is None:
                continue
            fns[name, layer] = _then(fns.get((name, layer)), _keep(seen[layer], name))
        need_source = any(value is None for *_, value in items)
        fns["o", layer] = _then(_state_fn(model, layer, items, seen[layer], source if need_source else None),
                                fns.get(("o", layer)))
    for key, fn in (extra or {}).items():
        fns[key] = _then(fns.get(key), fn)
    with hooks_installed(model, fns):
        return model(base[None].expand(n_rows, -1)).logits


def _keep(store: dict[str, torch.Tensor], name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(out: torch.Tensor) -> torch.Tensor:
        store[name] = out
        return out
    return fn


def _then(first: Callable | None, second: Callable | None) -> Callable:
    """first, then second (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda out: second(first(out))


def _state_fn(model: nn.Module, layer: int, items: list, seen: dict[str, torch.Tensor], source: Run | None
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(o: torch.Tensor) -> torch.Tensor:
        return patched_outputs(seen["q"], seen["k"], seen["v"], seen["beta"], seen.get("g"), o,
                               layer_scale(model, layer), key_heads(model), items,
                               None if source is None else source.states(layer))
    return fn


def batches(items: list, size: int) -> Iterable[list]:
    for lo in range(0, len(items), size):
        yield items[lo:lo + size]
