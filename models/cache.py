"""The decoding cache of a deltalab model: what each layer carries from one token to the next, and its O(1) steps.

A delta-rule layer carries its recurrent state H [B, Hv, K, V] (float32, float64 for float64 models) and, where it
has short convolutions, the last `conv_size - 1` inputs of each ([B, W - 1, D]); an RWKV-7 layer carries its state
and the last normed input of its time mixer and channel mixer (token shift, [B, 1, D]); a softmax-attention layer
of a hybrid keeps its rotated keys and values ([B, S, Hkv, d]), which of them are real (`valid` [B, S], False for
the left padding of rows stacked from prompts of different lengths) and their positions. A model's forward takes
`cache=`: it starts from what the cache holds and leaves there what the next call needs, so a prefill over the
prompt followed by one-token calls gives the logits of one forward over the whole sequence.

The one-token steps run the token-by-token recurrences of `kernels.delta_rule.naive` and `kernels.dplr.naive` in
float32 (float64 for float64 inputs), or on CUDA their Triton steps (`kernels.delta_rule.triton_step`,
`kernels.dplr.triton_step`): O(1) work per token, and the same boundary layout as a full forward, so `hook_state`
of a step is [B, 2, Hv, K, V]: the state before the token, then after it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import torch

from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.kernels.dplr.naive import naive_dplr


@dataclass
class LayerCache:
    """One layer's carried values (each None or empty until the first forward fills it)."""

    state: torch.Tensor | None = None
    """[B, Hv, K, V]: the recurrent state after the tokens seen (delta-rule and RWKV-7 layers)."""
    conv: dict[str, torch.Tensor] = field(default_factory=dict)
    """'q', 'k', 'v' -> [B, W - 1, D]: each short convolution's last inputs."""
    shift: dict[str, torch.Tensor] = field(default_factory=dict)
    """'attn', 'ffn' -> [B, 1, D]: RWKV-7's last normed input of each mixer (its token shift)."""
    keys: torch.Tensor | None = None
    """[B, S, Hkv, d]: a softmax layer's keys after rotary."""
    values: torch.Tensor | None = None
    """[B, S, Hkv, d]: a softmax layer's values."""
    valid: torch.Tensor | None = None
    """[B, S] bool: which key slots hold a real token (False: left padding)."""
    key_pos: torch.Tensor | None = None
    """[B, S] long: each key's position in its own row."""
    next_pos: torch.Tensor | None = None
    """[B] long: the position of the next token of each row."""


class RecurrentCache:
    """Every layer's `LayerCache`, `cache.layers[i]` (a model's forward fills and updates them)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]

    def __len__(self) -> int:
        return len(self.layers)

    @classmethod
    def stack(cls, caches: list[RecurrentCache]) -> RecurrentCache:
        """One cache of the rows of `caches` in order (each from a prefill of its own length): states and
        conv/shift caches concatenate; softmax keys are left-padded to the longest, the padding marked invalid."""
        out = cls(len(caches[0]))
        for i, layer in enumerate(out.layers):
            parts = [c.layers[i] for c in caches]
            if parts[0].state is not None:
                layer.state = torch.cat([p.state for p in parts])
            for name in parts[0].conv:
                layer.conv[name] = torch.cat([p.conv[name] for p in parts])
            for name in parts[0].shift:
                layer.shift[name] = torch.cat([p.shift[name] for p in parts])
            if parts[0].keys is not None:
                S = max(p.keys.shape[1] for p in parts)
                layer.keys = torch.cat([_left_pad(p.keys, S) for p in parts])
                layer.values = torch.cat([_left_pad(p.values, S) for p in parts])
                layer.valid = torch.cat([_left_pad(p.valid, S) for p in parts])
                layer.key_pos = torch.cat([_left_pad(p.key_pos, S) for p in parts])
                layer.next_pos = torch.cat([p.next_pos for p in parts])
        return out


def _left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, S, ...] -> [B, length, ...] with zeros (False) before it."""
    pad = length - x.shape[1]
    if pad == 0:
        return x
    return torch.cat([x.new_zeros(x.shape[0], pad, *x.shape[2:]), x], 1)


def state_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision of a carried recurrent state: float64 for float64 models, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def delta_rule_step(q, k, v, beta, g, scale: float, state: torch.Tensor | None):
    """One token of the gated delta product (n_h Householder sub-steps, grouped heads, scalar or per-channel gate).

    q [B, 1, Hk, K], k [B, 1, n_h, Hk, K], v [B, 1, n_h, Hv, V], beta [B, 1, n_h, Hv], g [B, 1, Hv] or
    [B, 1, Hv, K] or None, state [B, Hv, K, V] or None (zero). Returns (o [B, 1, Hv, V] in q's dtype, the state
    after [B, Hv, K, V], boundaries [B, 2, Hv, K, V]: before and after), in float32 (float64 for float64 q).
    """
    fused = _triton_module(q)
    if fused is not None and fused.unsupported_reason(q, v, k.shape[2]) is None:
        return fused.triton_delta_rule_step(q, k, v, beta, g, scale, state)
    dt = state_dtype(q)
    cast = [x.to(dt) for x in (q, k, v, beta)]
    o, final, bounds = naive_delta_product(*cast, None if g is None else g.to(dt), scale=scale,
                                           initial_state=None if state is None else state.to(dt))
    return o.to(q.dtype), final, bounds


def _triton_module(q: torch.Tensor, op: str = "delta_rule"):
    """`kernels.{op}.triton_step` (op: delta_rule or dplr) where its decode step applies: CUDA inputs of float32 or
    half precision, no autograd graph, not DELTALAB_KERNEL=torch; else None (the PyTorch step)."""
    if not q.is_cuda or q.dtype == torch.float64 or torch.is_grad_enabled():
        return None
    if os.environ.get("DELTALAB_KERNEL", "auto") == "torch":
        return None
    try:
        return importlib.import_module(f"deltalab.kernels.{op}.triton_step")
    except ImportError:
        return None


def dplr_step(q, k, v, a, b, g, scale: float, state: torch.Tensor | None):
    """One token of the generalised delta rule H' = (diag(e^g) + b a^T) H + k v^T, o = scale H'^T q.

    q, k, a, b, g [B, 1, H, K], v [B, 1, H, V], state [B, H, K, V] or None; returns as `delta_rule_step`."""
    fused = _triton_module(q, "dplr")
    if fused is not None and q.shape[-1] <= 256:
        return fused.triton_dplr_step(q, k, v, a, b, g, scale, state)
    dt = state_dtype(q)
    o, final, bounds = naive_dplr(*(x.to(dt) for x in (q, k, v, a, b)), None if g is None else g.to(dt),
                                  scale=scale, initial_state=None if state is None else state.to(dt))
    return o.to(q.dtype), final, bounds
