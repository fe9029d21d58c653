"""Forget-gate decays per layer, head and key channel: how long each channel remembers.

A token's gate multiplies a state row by d = exp(g) <= 1 (one d per head for Gated DeltaNet, one per key channel
for Kimi Delta Attention). A channel that keeps d near 1 carries information over long spans: its memory length
1 / (1 - d) is the number of tokens after which a write has decayed by 1/e (for d close to 1). This probe
reports, per (layer, head, channel): the mean log decay, the mean decay, the memory length of the mean decay, the
median of the per-token memory lengths and the fraction of tokens whose memory exceeds `--long` tokens; per
(layer, head): a histogram of log10 memory lengths over channels and tokens and the channels that remember
longest. Padded tokens are skipped. Scalar gates are one channel.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import xarray as xr

from deltalab.probes import data
from deltalab.probes.base import ProbeError, ProbeResult, exit_main

NAME = "decays"
SUMMARY_KEYS = ["layer", "head", "channels", "memory_mean_decay", "memory_median", "frac_long", "longest_channels"]
MAX_LOG10 = 6.0  # histogram range of log10 memory length: 1 to 1e6 tokens
BINS = 48


def memory_length(decay: np.ndarray) -> np.ndarray:
    """1 / (1 - d): tokens until a write decays by about 1/e; inf where d == 1 (no decay)."""
    with np.errstate(divide="ignore"):
        return 1.0 / np.maximum(1.0 - decay, 0.0)


def run(ds: xr.Dataset, *, long: float = 100.0, top: int = 4, budget: int = 1 << 30) -> ProbeResult:
    """Decay statistics of the store's `g` (see the module docstring).

    Args:
        ds: a store Dataset with `g` [seq, layer, pos, head] (scalar gates) or [seq, layer, pos, head, dk]
            (per-channel gates).
        long: memory length (tokens) above which a token counts in `frac_long`.
        top: the longest-remembering channels listed in each record.
        budget: bytes of store data read into memory at once (blocks of sequences).

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per (layer, head). The dataset holds
        mean_log_decay, mean_decay, memory_of_mean_decay, memory_median, frac_long, n_tokens [layer, head,
        channel] (channel has size 1 for scalar gates) and memory_hist [layer, head, channel, log10_bin].
    """
    if "g" not in ds:
        raise ProbeError("the store has no g: the model has no forget gate (capture a gated model with --hooks g)")
    channel = "dk" in ds["g"].dims
    L, H = ds.sizes["layer"], ds.sizes["head"]
    C = ds.sizes["dk"] if channel else 1
    shape = (L, H, C)
    n = np.zeros(shape)
    sum_g, sum_d, n_long = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    edges = np.linspace(0.0, MAX_LOG10, BINS + 1)
    hist = np.zeros((L, H, C, BINS + 1), np.int64)  # the last bin counts memory beyond 10^MAX_LOG10 (or no decay)
    for _, block in data.iter_blocks(ds, ["g"], budget, factor=4, desc="decays"):
        g = np.asarray(block["g"].values, dtype=np.float64)  # [s, L, T, H(, C)]
        if not channel:
            g = g[..., None]
        g = np.moveaxis(g, 2, 3).reshape(g.shape[0], L, H, -1, C)  # [s, L, H, T, C]
        ok = np.isfinite(g)
        gz = np.where(ok, g, 0.0)
        d = np.exp(gz)
        mem = memory_length(d)
        n += ok.sum((0, 3))
        sum_g += gz.sum((0, 3))
        sum_d += np.where(ok, d, 0.0).sum((0, 3))
        n_long += (ok & (mem > long)).sum((0, 3))
        with np.errstate(divide="ignore"):
            logm = np.log10(np.maximum(mem, 1.0))
        idx = np.where(np.isfinite(logm), np.clip(np.searchsorted(edges, logm, side="right") - 1, 0, BINS - 1), BINS)
        idx = np.where(logm > MAX_LOG10, BINS, idx)
        combo = (np.arange(L * H * C).reshape(1, L, H, 1, C) * (BINS + 1) + idx)[np.broadcast_to(ok, idx.shape)]
        hist += np.bincount(combo.ravel(), minlength=L * H * C * (BINS + 1)).reshape(L, H, C, BINS + 1)
    count = np.maximum(n, 1)
    mean_g, mean_d = np.where(n > 0, sum_g / count, np.nan), np.where(n > 0, sum_d / count, np.nan)
    median = _median_from_hist(hist, edges)
    dims = ("layer", "head", "channel")
    out = xr.Dataset(
        {
            "mean_log_decay": (dims, mean_g, {"description": "mean g (log decay) over tokens"}),
            "mean_decay": (dims, mean_d, {"description": "mean exp(g) over tokens"}),
            "memory_of_mean_decay": (dims, memory_length(mean_d), {"description": "1 / (1 - mean decay), tokens"}),
            "memory_median": (dims, median, {"description": "median over tokens of 1 / (1 - exp(g)), tokens"}),
            "frac_long": (dims, n_long / count, {"description": f"tokens whose memory exceeds {long:g} tokens"}),
            "memory_hist": (dims + ("log10_bin",), hist,
                            {"description": "tokens per log10 memory-length bin (last bin: beyond the range)"}),
            "n_tokens": (dims, n.astype(np.int64)),
        },
        coords={"layer": data.layer_values(ds), "head": np.arange(H), "channel": np.arange(C),
                "log10_bin": np.append((edges[:-1] + edges[1:]) / 2, np.inf)},
        attrs={"channel_gate": channel, "long": long, "top": top},
    )
    return ProbeResult(NAME, out, records(out, top), SUMMARY_KEYS)


def _median_from_hist(hist: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Median memory length per (layer, head, channel) from the log10 histogram (bin centre, tokens)."""
    cum = np.cumsum(hist, -1)
    total = cum[..., -1:]
    at = np.argmax(cum >= np.maximum(total, 1) / 2, axis=-1)
    centres = np.append((edges[:-1] + edges[1:]) / 2, np.inf)
    return np.where(total[..., 0] > 0, 10.0 ** centres[at], np.nan)


def records(out: xr.Dataset, top: int = 4) -> list[dict[str, Any]]:
    """One record per layer and head: memory statistics over its channels, the longest-remembering channels."""
    recs = []
    for li, layer in enumerate(out["layer"].values):
        for h in out["head"].values:
            mem = out["memory_of_mean_decay"].values[li, h]
            order = np.argsort(-np.nan_to_num(mem, nan=-1.0))[:top]
            recs.append({
                "layer": int(layer), "head": int(h), "channels": int(mem.size),
                "memory_mean_decay": float(np.nanmean(mem)) if np.isfinite(mem).any() else float("nan"),
                "memory_median": float(np.nanmedian(out["memory_median"].values[li, h])),
                "frac_long": float(np.mean(out["frac_long"].values[li, h])),
                "longest_channels": [int(c) for c in order],
                "longest_memory": [float(mem[c]) for c in order],
            })
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long", type=float, default=100.0, help="memory length (tokens) that counts as long")
    p.add_argument("--top", type=int, default=4, help="longest-remembering channels listed per head")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    if args.long <= 1 or args.top < 1:
        raise ProbeError(f"--long must be > 1 token and --top >= 1 (got {args.long}, {args.top})")
    return run(ds, long=args.long, top=args.top, budget=args.memory_budget)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.decays --store STORE [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
