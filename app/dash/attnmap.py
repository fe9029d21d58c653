"""Exact attention maps of one stored sequence for the Attention page: rows of a bounded window of query tokens
computed on demand in float64 (`kernels.attention.chunk.compare_attention`: the exact map and the gated-linear-attention
approximation in one walk; on rwkv7 stores `kernels.attention.dplr_chunk.compare_dplr_attention`, whose approximation
keeps only the diagonal decays), the small maps of every head for the head grid, and the attention probe's stored top-k
sources of one token. No Streamlit here (the page caches these).

Windows stay bounded: at most MAX_QUERIES query tokens [lo, hi) (aligned, so nearby clicks reuse a window) and at
most MAX_SOURCES source tokens [src0, hi). The inputs are cut at src0: alpha_{t,u} = scale b_u q_t^T Phi(t,u) k_u
depends only on the transitions after u, so the weights of the sources shown are exact; only the initial-state
term (every source before src0) is left out, and sequences up to MAX_SOURCES tokens have none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_QUERIES = 128
"""Query tokens whose full rows one window holds (aligned blocks: a click inside the block reuses it; 128 keeps the next
head of a real-size store at about 0.1 s, where 512 took 1-2 s)."""
MAX_SOURCES = 2048
"""Source tokens a window shows (the query window and the tokens before it)."""
GRID_TOKENS = 64
"""Largest side of a head-grid map (query and source tokens)."""
GRID_CELLS = 16384
"""Causal cells of all small maps together at most (fewer tokens per map for many heads)."""
MODES = ("exact", "GLA approximation")
NEEDS = ("q", "k", "v", "beta")


@dataclass(frozen=True)
class Window:
    """Query tokens [lo, hi) and the source tokens [src0, hi) they are shown against."""

    src0: int
    lo: int
    hi: int


def valid_length(ds: Any, seq: int) -> int:
    """Tokens of sequence `seq` before its padding (the whole length without a `pad` variable)."""
    T = int(ds.sizes["pos"])
    if "pad" not in ds:
        return T
    pad = np.asarray(ds["pad"].isel(seq=seq).values, bool)
    return int(np.argmax(pad)) if pad.any() else T


def window(pos: int, length: int, max_queries: int = MAX_QUERIES, max_sources: int = MAX_SOURCES) -> Window:
    """The aligned window of query tokens holding `pos` in a sequence of `length` tokens, with its sources."""
    if not 0 <= pos < length:
        raise ValueError(f"position {pos} is outside the sequence's {length} tokens: select 0..{length - 1}")
    if max_queries < 1 or max_sources < max_queries:
        raise ValueError(f"max_queries={max_queries}, max_sources={max_sources}: need 1 <= max_queries <= max_sources")
    lo = pos // max_queries * max_queries
    hi = min(length, lo + max_queries)
    return Window(max(0, hi - max_sources), lo, hi)


def grid_window(pos: int, length: int, n_heads: int) -> Window:
    """Tokens [lo, hi) of the head grid's small maps (queries and sources alike): about GRID_TOKENS, fewer for many
    heads, aligned to half a map so nearby clicks reuse it, holding `pos`."""
    n = int(min(GRID_TOKENS, length, max(8, math.isqrt(2 * GRID_CELLS // max(1, n_heads)))))
    half = max(1, n // 2)
    lo = max(0, min(pos // half * half - half, length - n))
    return Window(lo, lo, lo + n)


@dataclass(frozen=True)
class Inputs:
    """q, k, v, beta (and g) of every value head for tokens [start, stop) of one sequence and layer, as read from the
    store (numpy, the store's dtype, per value head): read once, then sliced per head and window."""

    start: int
    stop: int
    arrays: dict[str, np.ndarray]

    def covers(self, start: int, stop: int) -> bool:
        return self.start <= start and stop <= self.stop


def read_inputs(ds: Any, seq: int, li: int, start: int, stop: int) -> Inputs:
    """The stored inputs of tokens [start, stop) of sequence `seq`, layer index `li`, every value head (grouped
    stores: value head h reads key head key_head_of[h])."""
    from deltalab.store.reader import per_value_head

    missing = [v for v in NEEDS if v not in ds]
    if missing:
        raise ValueError(f"the store has no {', '.join(missing)}: recapture with --hooks including q,k,v,beta")
    names = [*NEEDS, *(["g"] if "g" in ds else []), *(["kappa"] if "kappa" in ds else [])]
    one = per_value_head(ds[names]).isel(seq=[seq], layer=li, pos=slice(start, stop)).compute()
    return Inputs(start, stop, {n: np.asarray(one[n].values) for n in names})


def pick(inp: Inputs, heads: list[int], start: int, stop: int) -> dict[str, Any]:
    """Value heads `heads` of tokens [start, stop) (inside `inp`) as float64 tensors in the kernels' layouts
    ([1, T, H, dk], [1, T, n_h, H, dk], ...); "g" is None for ungated stores; rwkv7 stores add "kappa"."""
    import torch

    if not inp.covers(start, stop):
        raise ValueError(f"tokens [{start}, {stop}) are outside the inputs read [{inp.start}, {inp.stop})")
    t = slice(start - inp.start, stop - inp.start)
    out: dict[str, Any] = {"g": None}
    for name, a in inp.arrays.items():
        head_axis = 3 if name in ("k", "v", "beta", "kappa") else 2  # [1, T, (n_h,) H, ...]
        sub = np.take(a[:, t], heads, axis=head_axis)
        out[name] = torch.as_tensor(np.ascontiguousarray(sub, dtype=np.float64))
    return out


def inputs(ds: Any, seq: int, li: int, heads: list[int], start: int, stop: int) -> dict[str, Any]:
    """q, k, v, beta (and g) of tokens [start, stop) of one sequence, layer index `li` and value heads `heads`, as
    float64 tensors in the kernels' layouts ([1, T, H, dk], [1, T, n_h, H, dk], ...)."""
    return pick(read_inputs(ds, seq, li, start, stop), list(heads), start, stop)


def compare(a: dict[str, Any], window: tuple[int, int] | None = None) -> Any:
    """The exact map and its approximation (kernels.attention.chunk.AttentionComparison) of `pick`'s inputs: the delta
    rule's (scale dk^-1/2), or on rwkv7 inputs (with "kappa") the DPLR map of diag(e^g) - (kappa * beta) kappa^T
    (scale 1, one step per token)."""
    if "kappa" not in a:
        from deltalab.kernels.attention.chunk import compare_attention

        return compare_attention(a["q"], a["k"], a["v"], a["beta"], a["g"], window=window)
    from deltalab.kernels.attention.dplr_chunk import compare_dplr_attention

    kap = a["kappa"][:, :, 0]
    return compare_dplr_attention(a["q"], a["k"][:, :, 0], a["v"][:, :, 0], -kap, kap * a["beta"][:, :, 0], a["g"],
                                  scale=1.0, window=window)


@dataclass
class Rows:
    """Full rows of one head for the query tokens of `win`, both maps: [query lo + i, source src0 + j, step]
    (zero for sources after the query), and per query the approximation's errors over the sources shown."""

    win: Window
    exact: np.ndarray
    gla: np.ndarray
    weight_error: np.ndarray
    output_error: np.ndarray
    output: np.ndarray  # [Tw, dv] o_t rebuilt from the exact map (initial-state term left out when src0 > 0)

    def row(self, pos: int, mode: str = MODES[0]) -> np.ndarray:
        """[source token, step] weights of query `pos` (NaN for sources after it), of the exact map or the GLA one."""
        if not self.win.lo <= pos < self.win.hi:
            raise ValueError(f"position {pos} is outside this window's queries [{self.win.lo}, {self.win.hi})")
        if mode not in MODES:
            raise ValueError(f"unknown map {mode!r}: choose one of {', '.join(MODES)}")
        w = (self.exact if mode == MODES[0] else self.gla)[pos - self.win.lo].copy()
        w[pos + 1 - self.win.src0:] = np.nan
        return w


def rows(ds: Any, seq: int, li: int, head: int, win: Window, read: Inputs | None = None) -> Rows:
    """The exact map and the GLA approximation of value head `head` for the queries of `win` (float64), from `read`
    when it covers the window (inputs read once for every head), else read from the store."""
    if read is None or not read.covers(win.src0, win.hi):
        read = read_inputs(ds, seq, li, win.src0, win.hi)
    a = pick(read, [head], win.src0, win.hi)
    cmp = compare(a, window=(win.lo - win.src0, win.hi - win.src0))

    def full(m) -> np.ndarray:  # [1, Tw, 1, S, n_h] -> [Tw, S, n_h]
        return m.weights[0, :, 0].numpy()

    return Rows(win, full(cmp.exact), full(cmp.approx), cmp.weight_error[0, :, 0].numpy(),
                cmp.output_error[0, :, 0].numpy(), cmp.exact.output[0, :, 0].numpy())


def grid(ds: Any, seq: int, li: int, win: Window, read: Inputs | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(exact, GLA) maps of every head over tokens [win.lo, win.hi): [head, query, source], summed over sub-steps
    (NaN above the diagonal: sources after the query); from `read` when it covers them."""
    H = int(ds.sizes.get("head", 1))
    if read is None or not read.covers(win.lo, win.hi):
        read = read_inputs(ds, seq, li, win.lo, win.hi)
    a = pick(read, list(range(H)), win.lo, win.hi)
    cmp = compare(a)
    n = win.hi - win.lo
    later = np.triu(np.ones((n, n), bool), 1)

    def maps(m) -> np.ndarray:  # [1, n, H, n, n_h] -> [H, n, n]
        w = m.weights[0].sum(-1).permute(1, 0, 2).numpy().copy()
        w[:, later] = np.nan
        return w

    return maps(cmp.exact), maps(cmp.approx)


def stored_top(res: Any, seq: int, layer: int, head: int) -> dict[str, np.ndarray] | None:
    """The attention probe's per-token results of one sequence, layer and head, read at once: "pos" (the query
    tokens its --window covered) and [pos(, rank)] arrays: top-k sources of the exact map and the GLA one
    (source position and step, signed weight, contribution norm) and the stored errors. None when the results do
    not cover them (probes keep results of the first sequences only; another layer; fewer heads)."""
    if not 0 <= seq < int(res.sizes.get("seq", 0)) or not 0 <= head < int(res.sizes.get("head", 0)):
        return None
    if layer not in set(np.asarray(res["layer"].values).tolist()):
        return None
    names = [n for n in res.data_vars if "pos" in res[n].dims and (n.startswith(("attn_", "gla_"))
                                                                    or n == "reconstruction_error")]
    one = res[names].isel(seq=seq, head=head).sel(layer=layer).compute()
    out = {n: np.asarray(one[n].values) for n in names}
    out["pos"] = np.asarray(one["pos"].values).astype(np.int64)
    return out


def top_of(stored: dict[str, np.ndarray], pos: int) -> dict[str, np.ndarray] | None:
    """One query token's row of `stored_top` (None outside the probe's window)."""
    hit = np.flatnonzero(stored["pos"] == pos)
    if not hit.size:
        return None
    return {n: a[int(hit[0])] for n, a in stored.items() if n != "pos"}
