"""Hook points by name, the cache of a run, and a forward with activation patches applied row by row.

Names follow TransformerLens: `resid_pre`, `resid_mid`, `resid_post` (the block's residual stream, [B, T, D]) and
the token mixer's `q`, `k`, `v`, `beta`, `g`, `o` (`hook_q` ... also accepted). A head hook's head axis is where
the layer keeps its heads: q [B,T,Hk,dk], k [B,T,n_h,Hk,dk], v [B,T,n_h,Hv,dv], beta [B,T,n_h,Hv],
g [B,T,Hv] (or [B,T,Hv,dk]), o [B,T,Hv,dv] in a delta-rule layer; axis 2 elsewhere (RWKV-7, softmax attention).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from deltalab.probes.patching.metrics import PatchingError

RESID_HOOKS = ("resid_pre", "resid_mid", "resid_post")
HEAD_HOOKS = ("q", "k", "v", "beta", "g", "o")
HOOKS = RESID_HOOKS + HEAD_HOOKS
_DELTA_HEAD_AXIS = {"q": 2, "k": 3, "v": 3, "beta": 3, "g": 2, "o": 2}
DELTA_MIXERS = ("DeltaProductAttention", "DeltaRuleHooks")
"""The token mixers with a delta-rule state: deltalab's own layer and a transformers hybrid's linear layer hooks."""


def hook_name(name: str) -> str:
    """'hook_resid_pre' / 'resid_pre' / 'hook_o' / 'o' -> the short name; PatchingError for an unknown one."""
    short = name.strip().removeprefix("hook_")
    if short not in HOOKS:
        raise PatchingError(f"unknown hook {name!r}: use one of {', '.join(HOOKS)}")
    return short


def hook_module(model: nn.Module, hook: str, layer: int) -> nn.Module | None:
    """The HookPoint of `hook` in layer `layer` (None where that layer has none, e.g. `beta` in softmax attention)."""
    block = model.layers[layer]
    where = block if hook in RESID_HOOKS else getattr(block, "attn", None)
    return getattr(where, f"hook_{hook}", None)


def head_axis(model: nn.Module, hook: str, layer: int) -> int | None:
    """The axis that holds heads in `hook`'s output (None for the residual stream)."""
    if hook in RESID_HOOKS:
        return None
    return _DELTA_HEAD_AXIS[hook] if is_delta_layer(model, layer) else 2


def is_delta_layer(model: nn.Module, layer: int) -> bool:
    """Whether layer `layer` runs the delta-rule recurrence deltalab can patch and differentiate state by state."""
    return type(getattr(model.layers[layer], "attn", None)).__name__ in DELTA_MIXERS


def mixer_name(model: nn.Module, layer: int) -> str:
    """The class name of layer `layer`'s token mixer, for messages ('softmax attention' where no hooks show it)."""
    attn = getattr(model.layers[layer], "attn", None)
    return "softmax attention" if attn is None else type(attn).__name__


@dataclass(frozen=True)
class ActPatch:
    """Replace `hook`'s output in `layer` by the source run's, at `position` (None: every position) and `head`
    (None: every head; the residual stream has none)."""

    hook: str
    layer: int
    head: int | None = None
    position: int | None = None


Cache = dict[tuple[str, int], torch.Tensor]
"""(hook, layer) -> that hook's output in one run, [1, T, ...] (detached)."""


@contextmanager
def hooks_installed(model: nn.Module, fns: dict[tuple[str, int], Callable[[torch.Tensor], torch.Tensor]]
                    ) -> Iterator[None]:
    """Register `fns[(hook, layer)]` (output -> new output) as forward hooks for the duration of the block."""
    handles = []
    try:
        for (hook, layer), fn in fns.items():
            module = hook_module(model, hook, layer)
            if module is None:
                raise PatchingError(f"layer {layer} has no hook {hook!r} (a {mixer_name(model, layer)} layer): "
                                    "pick hooks that layer has")
            handles.append(module.register_forward_hook(lambda _m, _i, out, fn=fn: fn(out)))
        yield
    finally:
        for h in handles:
            h.remove()


def run_with_cache(model: nn.Module, ids: torch.Tensor, keys: Iterable[tuple[str, int]]) -> tuple[torch.Tensor, Cache]:
    """(logits [1, T, V], cache of the hooks `keys`) for one sequence ids [T]."""
    cache: Cache = {}

    def keep(key: tuple[str, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(out: torch.Tensor) -> torch.Tensor:
            cache[key] = out.detach()
            return out
        return fn

    present = [k for k in dict.fromkeys(keys) if hook_module(model, *k) is not None]
    with torch.no_grad(), hooks_installed(model, {k: keep(k) for k in present}):
        logits = model(ids[None]).logits
    return logits, cache


def patch_mask(model: nn.Module, key: tuple[str, int], out: torch.Tensor,
               rows: list[tuple[int, ActPatch]]) -> torch.Tensor:
    """Boolean mask broadcastable to out [N, T, ...]: True where row r's patches replace the output."""
    hook, layer = key
    axis = head_axis(model, hook, layer)
    N, T = out.shape[:2]
    n_heads = 1 if axis is None else out.shape[axis]
    mask = torch.zeros(N, T, n_heads, dtype=torch.bool, device=out.device)
    for r, p in rows:
        if p.head is not None and axis is None:
            raise PatchingError(f"hook {hook} is the residual stream and has no heads: leave the head out")
        if p.head is not None and not 0 <= p.head < n_heads:
            raise PatchingError(f"head {p.head} is out of range for hook {hook} in layer {layer} "
                                f"(0..{n_heads - 1})")
        if p.position is not None and not 0 <= p.position < T:
            raise PatchingError(f"position {p.position} is out of range (0..{T - 1})")
        mask[r, slice(None) if p.position is None else p.position, slice(None) if p.head is None else p.head] = True
    if axis is None:
        return mask.view(N, T, *([1] * (out.dim() - 2)))
    return mask.view(N, T, *([1] * (axis - 2)), n_heads, *([1] * (out.dim() - axis - 1)))


def activation_patch_fns(model: nn.Module, patches: list[list[ActPatch]], source: Cache
                         ) -> dict[tuple[str, int], Callable[[torch.Tensor], torch.Tensor]]:
    """Forward hooks that apply each row's activation patches (patches[r]: row r's) from the source run."""
    by_key: dict[tuple[str, int], list[tuple[int, ActPatch]]] = {}
    for r, row in enumerate(patches):
        for p in row:
            by_key.setdefault((p.hook, p.layer), []).append((r, p))
    fns = {}
    for key, rows in by_key.items():
        if key not in source:
            raise PatchingError(f"layer {key[1]} has no hook {key[0]!r} to patch: pick hooks that layer has")

        def fn(out: torch.Tensor, key=key, rows=rows) -> torch.Tensor:
            mask = patch_mask(model, key, out, rows)
            return torch.where(mask, source[key].to(out.dtype), out)
        fns[key] = fn
    return fns
