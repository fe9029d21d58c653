"""Outputs after an edit of `hook_state`: the recurrence restarts from each patched chunk-start state.

Shared by the delta-rule layers (`models.attention`, the transformers adapter) and RWKV-7 (`models.rwkv7`). Only the
sequences that hold a patch are run again, each from its own first patched chunk: every other output is the
layer's own, bit for bit (a batch-wide replay recomputed them through other matrix shapes, which changes last bits
on some CPUs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltalab.kernels.constants import CHUNK_SIZE

ChunkStep = Callable[[torch.Tensor, slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(sequence rows, token slice of one chunk, state before it) -> (that chunk's outputs, the state after it)."""


def check_state_shape(states: torch.Tensor, hooked: torch.Tensor) -> None:
    if hooked.shape != states.shape:
        raise ValueError(f"hook_state must keep its shape {tuple(states.shape)}, got {tuple(hooked.shape)}")


def replay_patched(o: torch.Tensor, clean: torch.Tensor, hooked: torch.Tensor, T: int, step: ChunkStep,
                   with_final: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """o [B, T, ...] with each patched sequence's outputs from its first patched chunk on recomputed by `step`.

    clean, hooked [B, NC + 1, ...]: the chunk-start states as computed and as the intervention left them (the last
    entry, the final state, feeds no output). An entry that differs is a patch: the recurrence restarts from it, and
    later chunk starts carry the patched dynamics forward unless they are patched too.

    `with_final`: also return the state each sequence carries on [B, ...] (a decoding cache's): the replayed final
    state of a patched sequence, the hooked final entry where that entry itself was edited, else the clean one."""
    hooked = hooked.to(device=clean.device, dtype=clean.dtype)
    n_chunks = clean.shape[1] - 1
    patched = hooked[:, :n_chunks] != clean[:, :n_chunks]  # [B, NC, ...]
    chunk_patched = patched.flatten(2).any(-1)  # [B, NC]
    final = clean[:, -1].clone() if with_final else None
    if not bool(chunk_patched.any()):
        return (o, _final_edits(final, clean, hooked)) if with_final else o
    # each sequence's first patched chunk (-1: none); argmax finds the first True
    firsts = torch.where(chunk_patched.any(1), chunk_patched.int().argmax(1), -1)
    out = o.clone()
    for first in firsts[firsts >= 0].unique().tolist():
        rows = (firsts == first).nonzero().flatten()
        state = hooked[rows, first]
        for c in range(first, n_chunks):
            state = torch.where(patched[rows, c], hooked[rows, c], state)
            t = slice(c * CHUNK_SIZE, min((c + 1) * CHUNK_SIZE, T))
            o_c, state = step(rows, t, state)
            out[rows, t] = o_c.to(out.dtype)
        if final is not None:
            final[rows] = state.to(final.dtype)
    return (out, _final_edits(final, clean, hooked)) if with_final else out


def _final_edits(final: torch.Tensor, clean: torch.Tensor, hooked: torch.Tensor) -> torch.Tensor:
    """The carried states [B, ...], with the hooked final entry wherever an intervention edited that entry."""
    edited = (hooked[:, -1] != clean[:, -1]).flatten(1).any(-1)
    return torch.where(edited.view(-1, *[1] * (final.dim() - 1)), hooked[:, -1], final)
