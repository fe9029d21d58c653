"""State surgery on one head of a delta-rule layer: erase or write an association, scale a decay, from token t on.

The model runs its recurrence inside a kernel, so an edit of the state H_t (after token t's writes, before its
read-out) is applied where it shows: in the head's outputs o_{t'} for t' >= t (the `hook_o` hook point).
- erase along a unit key k:   H_t <- (I - k k^T) H_t;      write:  H_t <- H_t + k v^T.
  Both add dH to H_t, and the recurrence is linear in (state, values): the change of every later output is
  scale dH^T Phi(t', t)^T q_{t'}, i.e. the output of the same recurrence over tokens t.. with zero values,
  token t's own transition skipped and dH as the initial state (`kernels.attention.chunk.chunk_recurrence`).
- scale_decay: multiply the head's forget factor a_t = exp(g_t) (or one dk channel of it, which makes the gate
  per-channel: H <- (I - b k k^T) diag(a) H + b k v^T) by `factor` from token t on; the head's outputs from t on
  are recomputed from H_{t-1}. factor 0 forgets everything before each token (taken as 1e-30).
The functions take the hook tensors of one layer (q [B,T,H,dk], k [B,T,n_h,H,dk], v [B,T,n_h,H,dv],
beta [B,T,n_h,H], g [B,T,H] or None, o [B,T,H,dv]) and return the edited o; `probes.intervene` calls them
inside an nnsight trace, and so can a notebook.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from deltalab.kernels.attention.chunk import chunk_recurrence

KINDS = ("erase", "write", "scale_decay")
MIN_FACTOR = 1e-30


@dataclass(frozen=True)
class StateEdit:
    """One edit of head `head`'s state at token `position`.

    erase/write: the key (and, to write, the value) of sub-step `step` (default the last) of token `source`
    (default `position`), unless `key` / `value` vectors are given. scale_decay: `factor`, on `channel` or the head.
    """

    kind: str
    head: int
    position: int
    step: int | None = None
    source: int | None = None
    channel: int | None = None
    factor: float = 0.0
    key: Any = field(default=None, compare=False)
    value: Any = field(default=None, compare=False)

    def check(self, T: int, H: int, n_h: int, dk: int) -> None:
        """Raise a one-line ValueError when the edit does not fit the layer's shapes."""
        if self.kind not in KINDS:
            raise ValueError(f"state edit kind {self.kind!r}: use one of {', '.join(KINDS)}")
        for name, val, size in (("head", self.head, H), ("position", self.position, T), ("source", self.source, T),
                                ("step", self.step, n_h), ("channel", self.channel, dk)):
            if val is not None and not 0 <= val < size:
                raise ValueError(f"state edit {name} {val} out of range [0, {size}): pick one the layer has")
        if self.kind == "scale_decay" and self.factor < 0:
            raise ValueError(f"scale_decay factor {self.factor} < 0: decays are scaled by factors >= 0")


def _head(x: torch.Tensor | None, h: int, dim: int) -> torch.Tensor | None:
    """Head h of a hook tensor, in float32 (float64 when given float64: a reference computation)."""
    if x is None:
        return None
    return x.narrow(dim, h, 1).to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def state_at(q, k, v, beta, g, h: int, t: int, scale: float) -> torch.Tensor:
    """H_t of head h, the state after token t's writes: [B, 1, dk, dv] (zeros for t < 0)."""
    B, _, _, dk = q.shape
    if t < 0:
        return q.new_zeros(B, 1, dk, v.shape[-1], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    sl = slice(0, t + 1)
    _, state = chunk_recurrence(_head(q, h, 2)[:, sl], _head(k, h, 3)[:, sl], _head(v, h, 3)[:, sl],
                                _head(beta, h, 3)[:, sl], None if g is None else _head(g, h, 2)[:, sl], scale=scale)
    return state


def edited_output(q, k, v, beta, g, o: torch.Tensor, edit: StateEdit, scale: float | None = None) -> torch.Tensor:
    """The layer's recurrence outputs o with `edit` applied to head edit.head's state (a new tensor, o's dtype)."""
    B, T, H, dk = q.shape
    n_h = k.shape[2]
    edit.check(T, H, n_h, dk)
    scale = dk**-0.5 if scale is None else scale
    h, t = edit.head, edit.position
    qh, kh, vh, bh = _head(q, h, 2), _head(k, h, 3), _head(v, h, 3), _head(beta, h, 3)
    gh = _head(g, h, 2)
    out = o.clone()
    if edit.kind == "scale_decay":
        base = torch.zeros(B, T, 1, dtype=qh.dtype, device=q.device) if gh is None else gh
        new = base[..., None].expand(B, T, 1, dk).clone() if edit.channel is not None else base.clone()
        log_f = math.log(max(edit.factor, MIN_FACTOR))
        if edit.channel is None:
            new[:, t:] += log_f
        else:
            new[:, t:, :, edit.channel] += log_f
        h0 = state_at(q, k, v, beta, g, h, t - 1, scale)
        o_new, _ = chunk_recurrence(qh[:, t:], kh[:, t:], vh[:, t:], bh[:, t:], new[:, t:], scale=scale,
                                    initial_state=h0)
        out[:, t:, h] = o_new[:, :, 0].to(o.dtype)
        return out
    src = t if edit.source is None else edit.source
    step = n_h - 1 if edit.step is None else edit.step
    key = kh[:, src, step, 0] if edit.key is None else torch.as_tensor(edit.key, dtype=qh.dtype, device=q.device)
    key = key.expand(B, dk)
    if edit.kind == "erase":
        unit = key / key.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        H_t = state_at(q, k, v, beta, g, h, t, scale)[:, 0]
        dH = -unit[:, :, None] * (unit[:, None, :] @ H_t)  # -(k k^T) H_t
    else:
        value = vh[:, src, step, 0]
        if edit.value is not None:
            value = torch.as_tensor(edit.value, dtype=qh.dtype, device=q.device)
        dH = key[:, :, None] * value.expand(B, -1)[:, None, :]
    # the change of o_{t'}, t' >= t: zero values, token t's own transition skipped, dH as the initial state
    b_skip, g_skip = bh[:, t:].clone(), None if gh is None else gh[:, t:].clone()
    b_skip[:, 0] = 0
    if g_skip is not None:
        g_skip[:, 0] = 0
    d_o, _ = chunk_recurrence(qh[:, t:], kh[:, t:], torch.zeros_like(vh[:, t:]), b_skip, g_skip, scale=scale,
                              initial_state=dH[:, None])
    out[:, t:, h] = (out[:, t:, h].to(d_o.dtype) + d_o[:, :, 0]).to(o.dtype)
    return out

