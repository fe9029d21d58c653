"""The recurrent state at every token, and a state patch that propagates through the rest of the sequence.

A delta-rule layer's head keeps a state S_t [dk, dv] after token t's writes, read out as o_t = scale S_t^T q_t.
Patching S_t replaces it by another state (the source run's, or part of it) and lets the recurrence run on:
o_t is read from the new state and tokens t+1.. run from it as their initial state (the kernels take one), so
every later output, and every later layer, sees the patched dynamics. t may be any token, not only a chunk start.

Tensors of one layer, as its hook points hold them: q [B,T,Hk,dk], k [B,T,n_h,Hk,dk], v [B,T,n_h,Hv,dv],
beta [B,T,n_h,Hv], g [B,T,Hv] or [B,T,Hv,dk] or None; states [B, T, Hv, dk, dv].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.kernels.delta_rule.dispatch import delta_product_forward
from deltalab.kernels.delta_rule.naive import naive_delta_product
from deltalab.probes.patching.metrics import PatchingError

PARTS = ("full", "rank", "top", "key")


@dataclass(frozen=True)
class StatePart:
    """Which part of the source state a patch takes (S: the run's own state, S': the source's):
    full: S'; rank (r): the best rank-r approximation of S'; top (r): S + U_r U_r^T (S' - S), U_r the top r
    left singular vectors (key directions) of S'; key (direction u [dk]): S + u u^T (S' - S) / |u|^2."""

    kind: str = "full"
    rank: int = 1
    direction: Any = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return {"full": "full", "rank": f"rank:{self.rank}", "top": f"top:{self.rank}", "key": "key"}[self.kind]

    def apply(self, own: torch.Tensor | None, source: torch.Tensor) -> torch.Tensor:
        """The patched state from own, source [n, dk, dv] (own unused by full and rank)."""
        if self.kind == "full":
            return source
        if self.kind == "rank":
            U, s, Vh = torch.linalg.svd(source, full_matrices=False)
            r = self.rank
            return (U[..., :r] * s[..., None, :r]) @ Vh[..., :r, :]
        if self.kind == "top":
            U = torch.linalg.svd(source, full_matrices=False)[0][..., : self.rank]
            return own + U @ (U.transpose(-1, -2) @ (source - own))
        u = torch.as_tensor(self.direction, dtype=source.dtype, device=source.device).reshape(-1)
        u = u / u.norm()
        return own + u[:, None] * (u @ (source - own))[..., None, :]

    @property
    def needs_own(self) -> bool:
        return self.kind in ("top", "key")


@dataclass(frozen=True)
class StatePatch:
    """Replace head `head`'s state after token `token` in delta-rule layer `layer` (a part of it, or `value`
    [dk, dv] when given) and run the recurrence on from it."""

    layer: int
    head: int
    token: int
    part: StatePart = StatePart()
    value: Any = field(default=None, compare=False)


def token_states(q, k, v, beta, g, scale: float) -> torch.Tensor:
    """The state after every token, [B, T, Hv, dk, dv], in q's dtype (float32 for lower precisions).

    The chunk-start states come from the layer's kernel; inside each chunk of CHUNK_SIZE tokens the plain
    recurrence runs, all chunks at once."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    g = None if g is None else g.to(dtype)
    B, T = q.shape[:2]
    _, _, bounds = delta_product_forward(q, k, v, beta, g, scale=scale)
    nc = -(-T // CHUNK_SIZE)
    size = CHUNK_SIZE if nc > 1 else T  # one short chunk: no padding
    pad = nc * size - T

    def chunked(x: torch.Tensor | None) -> torch.Tensor | None:  # zero padding: beta = 0, g = 0 leave S as it is
        if x is None:
            return None
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
        return x.reshape(B * nc, size, *x.shape[2:])

    _, _, per_token = naive_delta_product(chunked(q), chunked(k), chunked(v), chunked(beta), chunked(g), scale=scale,
                                          initial_state=bounds[:, :nc].to(dtype).flatten(0, 1), chunk_size=1)
    after = per_token[:, 1:]  # entry t + 1 is the state after token t
    return after.reshape(B, nc * size, *after.shape[2:])[:, :T]


def _select_heads(x: torch.Tensor | None, rows: torch.Tensor, heads: torch.Tensor, axis: int) -> torch.Tensor | None:
    """x [B, T, ...] -> row rows[i]'s head heads[i], the head axis kept with size 1."""
    if x is None:
        return None
    picked = x[rows].movedim(axis, 1)[torch.arange(len(rows), device=x.device), heads]  # [n, T, ...]
    return picked.unsqueeze(axis)


def patched_outputs(q, k, v, beta, g, o: torch.Tensor, scale: float, key_head_of: list[int] | None,
                    items: list[tuple[int, int, int, StatePart, Any]], source_states: torch.Tensor | None
                    ) -> torch.Tensor:
    """o [B, T, Hv, dv] with each item's state patch applied and propagated (a new tensor, o's dtype).

    items: (row, value head, token, part, value [dk, dv] or None); at most one per (row, head).
    source_states [T, Hv, dk, dv]: the source run's states (needed unless every item brings its value)."""
    seen = set()
    for r, h, _t, _, _ in items:
        if (r, h) in seen:
            raise PatchingError(f"two state patches of head {h} in one run: patch one token per head and run")
        seen.add((r, h))
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = o.clone()
    T = q.shape[1]
    for t in sorted({it[2] for it in items}):
        group = [it for it in items if it[2] == t]
        rows = torch.tensor([it[0] for it in group], device=q.device)
        heads = torch.tensor([it[1] for it in group], device=q.device)
        kheads = heads if key_head_of is None else torch.tensor([key_head_of[h] for h in heads.tolist()],
                                                                device=q.device)
        qs, ks = _select_heads(q, rows, kheads, 2).to(dtype), _select_heads(k, rows, kheads, 3).to(dtype)
        vs, bs = _select_heads(v, rows, heads, 3).to(dtype), _select_heads(beta, rows, heads, 3).to(dtype)
        gs = None if g is None else _select_heads(g, rows, heads, 2).to(dtype)
        own = None
        if any(it[3].needs_own and it[4] is None for it in group):
            _, own, _ = delta_product_forward(qs[:, : t + 1], ks[:, : t + 1], vs[:, : t + 1], bs[:, : t + 1],
                                              None if gs is None else gs[:, : t + 1], scale=scale)
            own = own[:, 0].to(dtype)  # [n, dk, dv]
        new = []
        for i, (_, h, _, part, value) in enumerate(group):
            if value is not None:
                new.append(torch.as_tensor(value, dtype=dtype, device=q.device))
                continue
            src = source_states[t, h].to(dtype)
            new.append(part.apply(None if own is None else own[i:i + 1], src[None])[0])
        state = torch.stack(new)  # [n, dk, dv]
        o_t = scale * torch.einsum("nkv,nk->nv", state, qs[:, t, 0])
        out[rows, t, heads] = o_t.to(out.dtype)
        if t + 1 < T:
            o_rest, _, _ = delta_product_forward(qs[:, t + 1:], ks[:, t + 1:], vs[:, t + 1:], bs[:, t + 1:],
                                                 None if gs is None else gs[:, t + 1:], scale=scale,
                                                 initial_state=state[:, None])
            out[rows[:, None], torch.arange(t + 1, T, device=q.device)[None], heads[:, None]] = \
                o_rest[:, :, 0].to(out.dtype)
    return out
