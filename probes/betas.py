"""Beta distributions per layer/head/Householder step and per input token; negative-eigenvalue and reflection heads.

A sub-step with beta > 1 gives its Householder factor a negative eigenvalue (1 - beta); beta = 2 is an
exact reflection. A head is flagged `reflection` when the mean beta of every one of its steps exceeds
the threshold (default 1.8), as the DeltaProduct paper's S4 head (beta_0 = beta_1 = 2, Figure 7).
Streams the store in sequence blocks; quantiles come from a fine histogram (resolution beta_max/(16*bins)).
RWKV-7 stores hold one beta per key channel (the removal strength a_rwkv in (0, 1)): the per-head statistics pool
every channel's values (beta_max 1), `beta_channel_mean` / `frac_strong_channel` give each channel's mean and
fraction above `--strong` (default 0.9: that channel's component along kappa is mostly removed), and the
per-token means pool the channels.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import xarray as xr

from deltalab.probes import data
from deltalab.probes.base import ProbeError, ProbeResult, exit_main

NAME = "betas"
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
FINE = 16  # fine bins per reported bin (quantile resolution)
SUMMARY_KEYS = ["layer", "head", "step", "beta_mean", "beta_std", "beta_median", "frac_negative", "reflection"]


def run(ds: xr.Dataset, *, threshold: float = 1.8, bins: int = 64, max_tokens: int = 64, strong: float = 0.9,
        budget: int = 1 << 30) -> ProbeResult:
    """Beta statistics of `ds` (a store Dataset); see the module docstring.

    Args:
        ds: a store Dataset with `beta` [seq, layer, pos, step, head] (rwkv7: [..., head, dk]) and, for the
            per-token means, `tokens` [seq, pos].
        threshold: mean beta above which every step of a head marks it a `reflection` head.
        bins: histogram bins over [0, beta_max].
        max_tokens: the most frequent token ids given per-token means.
        strong: the removal strength (in (0, 1)) counted by `frac_strong` on rwkv7 stores.
        budget: bytes of store data read into memory at once (blocks of sequences).

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per (layer, step, head). The dataset holds
        beta_mean, beta_std, beta_min, beta_max, frac_negative, frac_strong, n_substeps [layer, step, head],
        beta_hist [layer, step, head, bin], beta_quantile [layer, step, head, quantile], frac_negative_head and
        reflection [layer, head], token_count [token], beta_token_mean / beta_token_std [layer, token, step, head].
    """
    data.require(ds, ["beta"], NAME)
    if not 0.0 < strong < 1.0:
        raise ProbeError(f"--strong {strong}: pass a removal strength inside (0, 1), e.g. 0.9")
    L, n_h, H = ds.sizes["layer"], ds.sizes["step"], ds.sizes["head"]
    channels = "dk" in ds["beta"].dims  # rwkv7: a_rwkv per key channel, pooled over channels per head
    C = ds.sizes["dk"] if channels else 1
    ch_n, ch_sum, ch_strong = np.zeros((L, H, C)), np.zeros((L, H, C)), np.zeros((L, H, C))
    bmax = data.beta_max(ds)
    nf = bins * FINE
    shape = (L, n_h, H)
    count = np.zeros(shape, np.int64)
    total, total_sq = np.zeros(shape), np.zeros(shape)
    lo, hi, neg = np.full(shape, np.inf), np.full(shape, -np.inf), np.zeros(shape, np.int64)
    fine = np.zeros((*shape, nf), np.int64)
    strong_n = np.zeros(shape, np.int64)
    has_tokens = "tokens" in ds
    tok_ids, tok_counts = (data.token_vocab(ds, max_tokens, budget) if has_tokens
                           else (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    n_tok = len(tok_ids)
    t_sum, t_sq, t_n = np.zeros((n_tok, L * n_h * H)), np.zeros((n_tok, L * n_h * H)), np.zeros(n_tok)

    for _, block in data.iter_blocks(ds, ["beta", "tokens"], budget, factor=3, desc="betas"):
        b = np.asarray(block["beta"].values, dtype=np.float64)  # [s, L, T, n_h, H(, C)]
        if channels:
            bc = b[:, :, :, 0]  # [s, L, T, H, C]: n_h = 1
            okc = np.isfinite(bc)
            ch_n += okc.sum((0, 2))
            ch_sum += np.where(okc, bc, 0.0).sum((0, 2))
            ch_strong += (okc & (bc > strong)).sum((0, 2))
        else:
            b = b[..., None]
        flat = np.moveaxis(b, (1, 3, 4), (0, 1, 2)).reshape(L * n_h * H, -1)  # [combo, s*T*C]
        strong_n += ((flat > strong) & np.isfinite(flat)).sum(1).reshape(shape)
        ok = np.isfinite(flat)
        count += ok.sum(1).reshape(shape)
        z = np.where(ok, flat, 0.0)
        total += z.sum(1).reshape(shape)
        total_sq += (z * z).sum(1).reshape(shape)
        lo = np.minimum(lo, np.where(ok, flat, np.inf).min(1).reshape(shape))
        hi = np.maximum(hi, np.where(ok, flat, -np.inf).max(1).reshape(shape))
        neg += ((flat > 1.0) & ok).sum(1).reshape(shape)
        idx = np.clip((z / bmax * nf).astype(np.int64), 0, nf - 1)
        combo = np.arange(flat.shape[0])[:, None] * nf + idx
        fine += np.bincount(combo[ok], minlength=flat.shape[0] * nf).reshape(*shape, nf)
        if n_tok:
            # tokens [s, T] line up with b's (seq, pos) = the column order of `flat`
            ti = data.token_index(np.repeat(np.asarray(block["tokens"].values).ravel(), C), tok_ids)
            keep = ti >= 0
            zt = np.where(ok, flat, 0.0)[:, keep].T  # [n, combo]
            from scipy.sparse import csr_matrix

            onehot = csr_matrix((np.ones(keep.sum()), (ti[keep], np.arange(keep.sum()))),
                                shape=(n_tok, int(keep.sum())))
            t_sum += onehot @ zt
            t_sq += onehot @ (zt * zt)
            t_n += np.bincount(ti[keep], minlength=n_tok)

    n = np.maximum(count, 1)
    mean = total / n
    std = np.sqrt(np.maximum(total_sq / n - mean**2, 0.0))
    quant = np.clip(_quantiles(fine, bmax), lo[..., None], hi[..., None])  # bins are coarser than the data
    frac_neg = neg / n
    mean = np.where(count > 0, mean, np.nan)
    reflection = np.all(mean > threshold, axis=1)  # every step of the head
    hist = fine.reshape(*shape, bins, FINE).sum(-1)
    edges = np.linspace(0.0, bmax, bins + 1)
    tn = np.maximum(t_n, 1)[:, None]
    tok_mean = (t_sum / tn).reshape(n_tok, L, n_h, H).transpose(1, 0, 2, 3)
    tok_std = np.sqrt(np.maximum(t_sq / tn - (t_sum / tn) ** 2, 0.0)).reshape(n_tok, L, n_h, H).transpose(1, 0, 2, 3)

    dims3 = ("layer", "step", "head")
    out = xr.Dataset(
        {
            "beta_hist": (dims3 + ("bin",), hist, {"description": "counts of beta per bin"}),
            "beta_mean": (dims3, mean),
            "beta_std": (dims3, std),
            "beta_min": (dims3, np.where(count > 0, lo, np.nan)),
            "beta_max": (dims3, np.where(count > 0, hi, np.nan)),
            "beta_quantile": (dims3 + ("quantile",), quant),
            "frac_negative": (dims3, frac_neg, {"description": "fraction of sub-steps with beta > 1 "
                                                               "(negative eigenvalue 1 - beta)"}),
            "frac_negative_head": (("layer", "head"), neg.sum(1) / np.maximum(count.sum(1), 1)),
            "reflection": (("layer", "head"), reflection,
                           {"description": f"mean beta of every step > {threshold}"}),
            "n_substeps": (dims3, count),
            "token_count": (("token",), tok_counts.astype(np.int64)),
            "beta_token_mean": (("layer", "token", "step", "head"), tok_mean),
            "beta_token_std": (("layer", "token", "step", "head"), tok_std),
        },
        coords={
            "layer": data.layer_values(ds), "step": np.arange(n_h), "head": np.arange(H),
            "bin": (edges[:-1] + edges[1:]) / 2, "bin_lo": ("bin", edges[:-1]), "bin_hi": ("bin", edges[1:]),
            "quantile": np.asarray(QUANTILES), "token": tok_ids.astype(np.int64),
        },
        attrs={"reflection_threshold": threshold, "beta_range": [0.0, bmax], "per_channel": channels,
               "strong_threshold": strong},
    )
    out["frac_strong"] = (dims3, strong_n / n, {"description": f"fraction of betas > {strong}"})
    if channels:
        cn = np.where(ch_n > 0, ch_n, np.nan)
        out = out.assign_coords(channel=np.arange(C))
        out["beta_channel_mean"] = (("layer", "head", "channel"), ch_sum / cn,
                                    {"description": "mean removal strength a_rwkv of each key channel"})
        out["frac_strong_channel"] = (("layer", "head", "channel"), ch_strong / cn,
                                      {"description": f"fraction of tokens whose a_rwkv > {strong}, per channel"})
    return ProbeResult(NAME, out, records(out), SUMMARY_KEYS)


def _quantiles(fine: np.ndarray, bmax: float) -> np.ndarray:
    """Quantiles [..., len(QUANTILES)] from fine histograms [..., nf] by linear interpolation within a bin."""
    nf = fine.shape[-1]
    cum = np.cumsum(fine, -1)
    total = cum[..., -1:]
    out = np.full((*fine.shape[:-1], len(QUANTILES)), np.nan)
    width = bmax / nf
    for qi, q in enumerate(QUANTILES):
        target = q * total
        idx = np.minimum((cum < target).sum(-1, keepdims=True), nf - 1)
        before = np.take_along_axis(np.concatenate([np.zeros_like(cum[..., :1]), cum], -1), idx, -1)
        inbin = np.take_along_axis(fine, idx, -1)
        frac = np.where(inbin > 0, (target - before) / np.maximum(inbin, 1), 0.5)
        val = (idx + np.clip(frac, 0, 1)) * width
        out[..., qi] = np.where(total > 0, val, np.nan)[..., 0]
    return out


def records(out: xr.Dataset) -> list[dict[str, Any]]:
    """One record per layer/head/step (the arrays are read once: a real-size model has thousands of records)."""
    recs = []
    tokens = out["token"].values
    per_token = len(tokens) <= 32
    names = ("n_substeps", "beta_mean", "beta_std", "beta_min", "beta_max", "beta_quantile", "frac_negative",
             "reflection", "frac_strong")
    a = {name: np.asarray(out[name].values) for name in names}
    tok_mean = np.asarray(out["beta_token_mean"].values) if per_token and len(tokens) else None
    tok_std = np.asarray(out["beta_token_std"].values) if tok_mean is not None else None
    for li, layer in enumerate(out["layer"].values.tolist()):
        for h in out["head"].values.tolist():
            head_means = a["beta_mean"][li, :, h].tolist()
            for s in out["step"].values.tolist():
                q = a["beta_quantile"][li, s, h].tolist()
                rec = {
                    "layer": int(layer), "head": int(h), "step": int(s),
                    "n": int(a["n_substeps"][li, s, h]),
                    "beta_mean": float(a["beta_mean"][li, s, h]),
                    "beta_std": float(a["beta_std"][li, s, h]),
                    "beta_min": float(a["beta_min"][li, s, h]),
                    "beta_max": float(a["beta_max"][li, s, h]),
                    "beta_q05": q[0], "beta_q25": q[1], "beta_median": q[2], "beta_q75": q[3], "beta_q95": q[4],
                    "frac_negative": float(a["frac_negative"][li, s, h]),
                    "frac_strong": float(a["frac_strong"][li, s, h]),
                    "reflection": bool(a["reflection"][li, h]),
                    "head_beta_means": [float(x) for x in head_means],
                }
                if "beta_channel_mean" in out:
                    rec["channel_means"] = [float(x) for x in np.asarray(out["beta_channel_mean"].values)[li, h]]
                if tok_mean is not None and tok_std is not None:
                    rec["per_token"] = {str(int(t)): [float(tok_mean[li, ti, s, h]), float(tok_std[li, ti, s, h])]
                                        for ti, t in enumerate(tokens)}
                recs.append(rec)
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=float, default=1.8, help="reflection flag: mean beta of every step above this")
    p.add_argument("--bins", type=int, default=64, help="histogram bins over [0, beta_max]")
    p.add_argument("--max-tokens", type=int, default=64, help="per-token statistics for the N most frequent tokens")
    p.add_argument("--strong", type=float, default=0.9,
                   help="rwkv7: count removal strengths a_rwkv above this (in (0, 1); default 0.9)")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    return run(ds, threshold=args.threshold, bins=args.bins, max_tokens=args.max_tokens, strong=args.strong,
               budget=args.memory_budget)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.betas --store STORE [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
