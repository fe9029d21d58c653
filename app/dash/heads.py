"""What each (layer, head) does, in a few numbers and small curves, from the probe results (pure numpy + pandas):
the table behind the head cards and the gallery, and the tiny SVG sparklines the cards draw.

Heads are indexed generically by (layer coordinate, head index) over whatever layers the results cover.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

METRICS: dict[str, str] = {
    "beta_mean": "mean β",
    "frac_beta_gt1": "fraction β > 1",
    "key_dim": "key-subspace dim (95%)",
    "frac_rotation": "rotation fraction",
    "erank_mean": "mean effective rank",
    "erank_trend": "effective-rank trend (per 100 tokens)",
    "probe_accuracy": "linear-probe accuracy",
}
"""Sortable columns of the head table and their names on screen (delta-rule stores; see `metrics`)."""

STRONG = "frac_strong"
"""RWKV-7 stores' column in place of `frac_beta_gt1`: the removal strength a lies in [0, 1] per key channel, so
β > 1 never happens; the betas probe stores the fraction of a above its `--strong` threshold instead."""


def strong_threshold(table: pd.DataFrame | pd.Series) -> float | None:
    """The betas probe's `--strong` threshold behind a head table (or one row) of an RWKV-7 store, else None."""
    if "strong_threshold" not in table:
        return None
    values = pd.Series(table["strong_threshold"], dtype=np.float64).dropna()
    return float(values.iloc[0]) if len(values) else None


def removal_metric(rows: pd.DataFrame | pd.Series, short: bool = False) -> tuple[str, str]:
    """(column, name on screen) of the removal number of a head table or one row: fraction β > 1, or on an RWKV-7
    store the fraction of removal strengths a above the probe's threshold ("a > 0.9" when `short`)."""
    threshold = strong_threshold(rows)
    if threshold is None:
        return "frac_beta_gt1", "β > 1" if short else METRICS["frac_beta_gt1"]
    return STRONG, f"a > {threshold:g}" if short else f"fraction a > {threshold:g}"


def metrics(table: pd.DataFrame) -> dict[str, str]:
    """METRICS of this head table, the removal number (`removal_metric`) in the place of `frac_beta_gt1`."""
    removal = removal_metric(table)
    return dict(removal if k == "frac_beta_gt1" else (k, v) for k, v in METRICS.items())

SPARK_POINTS = 48


def _layers(res: xr.Dataset | None) -> list[int]:
    return [int(x) for x in res["layer"].values] if res is not None and "layer" in res.coords else []


def key_dim(evr: np.ndarray, level: float = 0.95) -> np.ndarray:
    """evr [..., comp] -> number of leading components reaching `level` of the variance (NaN if none does)."""
    cum = np.nancumsum(np.nan_to_num(evr), -1)
    reached = cum >= level - 1e-9
    out = np.where(reached.any(-1), reached.argmax(-1) + 1, np.nan)
    return out.astype(np.float64)


def dominant_angles(hist: np.ndarray, centers: np.ndarray, k: int = 2, min_frac: float = 0.05) -> list[float]:
    """Centres of the k most populated angle bins holding at least `min_frac` of the tokens (local maxima)."""
    h = np.asarray(hist, np.float64)
    total = h.sum()
    if total <= 0:
        return []
    frac = h / total
    padded = np.concatenate([[-1.0], frac, [-1.0]])
    peaks = [i for i in range(len(frac)) if padded[i + 1] >= padded[i] and padded[i + 1] >= padded[i + 2]
             and frac[i] >= min_frac]
    peaks.sort(key=lambda i: -frac[i])
    return [float(centers[i]) for i in peaks[:k]]


def trend(curve: np.ndarray) -> float:
    """Least-squares slope of a curve over position, per 100 positions (NaN with fewer than 2 finite values)."""
    y = np.asarray(curve, np.float64)
    x = np.arange(len(y), dtype=np.float64)
    ok = np.isfinite(y)
    if ok.sum() < 2:
        return float("nan")
    return float(np.polyfit(x[ok], y[ok], 1)[0] * 100.0)


def downsample(curve: np.ndarray, n: int = SPARK_POINTS) -> np.ndarray:
    """Mean-pool a curve to at most n points."""
    y = np.asarray(curve, np.float64)
    if len(y) <= n:
        return y
    edges = np.linspace(0, len(y), n + 1).astype(int)
    ok = np.isfinite(y)
    sums = np.add.reduceat(np.where(ok, y, 0.0), edges[:-1])  # one pass: sums and counts per bin
    counts = np.add.reduceat(ok.astype(np.int64), edges[:-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def head_table(betas: xr.Dataset | None = None, keys: xr.Dataset | None = None, spectra: xr.Dataset | None = None,
               erank: xr.Dataset | None = None, linear: xr.Dataset | None = None,
               token_names: Sequence[str] | None = None, head_numbers: Sequence[int] | None = None) -> pd.DataFrame:
    """One row per (layer, head) found in any result: METRICS columns (NaN where a probe has not run), plus
    `frac_strong` and `strong_threshold` (RWKV-7 betas: the fraction of removal strengths a above the probe's
    `--strong` threshold, and that threshold; `frac_beta_gt1` is NaN there; both NaN on delta-rule stores),
    `beta_steps` (mean β per step), `dominant_angles`, `top_tokens` ([(token, mean β)] highest first), and curves
    for sparklines: `beta_hist`, `angle_hist`, `erank_curve`, `evr`. `head` is the head's position in the store,
    `head_id` its number in the model (`head_numbers`: a store captured with --heads; else the same)."""
    sources = [r for r in (betas, keys, spectra, erank, linear) if r is not None]
    layers = sorted({layer for r in sources for layer in _layers(r)})
    n_heads = max([int(r.sizes["head"]) for r in sources if "head" in r.sizes] or [0])
    rows: dict[tuple[int, int], dict[str, Any]] = {
        (layer, h): {"layer": layer, "head": h,
                     "head_id": int(head_numbers[h]) if head_numbers is not None and h < len(head_numbers) else h,
                     **{m: np.nan for m in METRICS}, STRONG: np.nan, "strong_threshold": np.nan, "beta_steps": [],
                     "dominant_angles": [], "top_tokens": [], "beta_hist": [], "angle_hist": [], "erank_curve": [],
                     "evr": []}
        for layer in layers for h in range(n_heads)}

    if betas is not None:
        mean = np.asarray(betas["beta_mean"].values, np.float64)  # [L, step, H]
        frac = np.asarray(betas["frac_negative_head"].values, np.float64)  # [L, H]
        channels = bool(betas.attrs.get("per_channel"))  # rwkv7: a in [0, 1] per key channel, never > 1
        threshold = float(betas.attrs.get("strong_threshold", 0.9))  # the probe's default, as on the Betas page
        strong = (np.asarray(betas[STRONG].values, np.float64).mean(1) if channels and STRONG in betas
                  else np.full_like(frac, np.nan))  # [L, H] (rwkv7: one step)
        hist = np.asarray(betas["beta_hist"].values, np.float64).sum(1)  # [L, H, bin]
        tmean = np.asarray(betas["beta_token_mean"].values, np.float64) if "beta_token_mean" in betas else None
        tokens = np.asarray(betas["token"].values).astype(np.int64) if "token" in betas.coords else np.zeros(0, int)
        for li, layer in enumerate(_layers(betas)):
            for h in range(mean.shape[-1]):
                r = rows[(layer, h)]
                r["beta_mean"] = float(np.nanmean(mean[li, :, h]))
                r["beta_steps"] = [float(v) for v in mean[li, :, h]]
                if channels:
                    r[STRONG], r["strong_threshold"] = float(strong[li, h]), threshold
                else:
                    r["frac_beta_gt1"] = float(frac[li, h])
                r["beta_hist"] = downsample(hist[li, h], 32).tolist()
                if tmean is not None and tokens.size:
                    per_tok = np.nanmean(tmean[li, :, :, h], -1)  # [tok]
                    order = np.argsort(-np.nan_to_num(per_tok, nan=-np.inf))[:5]
                    r["top_tokens"] = [(_name(token_names, int(tokens[i])), float(per_tok[i])) for i in order
                                       if np.isfinite(per_tok[i])]
    if keys is not None:
        evr = np.asarray(keys["explained_variance_ratio_joint"].values, np.float64)  # [L, H, comp]
        dims = key_dim(evr)
        for li, layer in enumerate(_layers(keys)):
            for h in range(evr.shape[1]):
                rows[(layer, h)]["key_dim"] = float(dims[li, h])
                rows[(layer, h)]["evr"] = [float(v) for v in np.nan_to_num(evr[li, h, :16])]
    if spectra is not None:
        rot = np.asarray(spectra["frac_rotation"].values, np.float64)
        ahist = np.asarray(spectra["angle_hist"].values, np.float64)  # [L, H, bin]
        centers = np.asarray(spectra["angle_bin"].values, np.float64)
        for li, layer in enumerate(_layers(spectra)):
            for h in range(rot.shape[1]):
                rows[(layer, h)]["frac_rotation"] = float(rot[li, h])
                rows[(layer, h)]["dominant_angles"] = dominant_angles(ahist[li, h], centers)
                rows[(layer, h)]["angle_hist"] = ahist[li, h].tolist()
    if erank is not None:
        em = np.asarray(erank["erank_mean"].values, np.float64)
        by_pos = np.asarray(erank["erank_by_pos"].values, np.float64)  # [L, pos, H]
        for li, layer in enumerate(_layers(erank)):
            for h in range(em.shape[1]):
                rows[(layer, h)]["erank_mean"] = float(em[li, h])
                rows[(layer, h)]["erank_trend"] = trend(by_pos[li, :, h])
                rows[(layer, h)]["erank_curve"] = downsample(by_pos[li, :, h]).tolist()
    if linear is not None:
        acc = np.asarray(linear["accuracy"].values, np.float64)  # [L, probe_head]
        heads = [int(x) for x in linear["probe_head"].values]  # the model's numbers (-1: all heads)
        if head_numbers is not None:
            where = {int(n): i for i, n in enumerate(head_numbers)}
            heads = [where.get(h, -2) if h >= 0 else h for h in heads]
        for li, layer in enumerate(_layers(linear)):
            for pi, h in enumerate(heads):
                if h >= 0 and (layer, h) in rows:
                    rows[(layer, h)]["probe_accuracy"] = float(acc[li, pi])
    df = pd.DataFrame(list(rows.values()))
    if df.empty:
        return pd.DataFrame(columns=["layer", "head", *METRICS])
    return df


def _name(names: Sequence[str] | None, token: int) -> str:
    return f"{token} {names[token]}" if names is not None and 0 <= token < len(names) else str(token)


def sort_heads(df: pd.DataFrame, metric: str, descending: bool = True) -> pd.DataFrame:
    """Rows sorted by a METRICS column or `frac_strong` (NaN last), ties by layer then head."""
    if metric not in METRICS and metric != STRONG:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join([*METRICS, STRONG])}")
    key = df[metric].astype(np.float64)
    key = key if not descending else -key
    return df.assign(_k=key).sort_values(["_k", "layer", "head"], na_position="last").drop(columns="_k")


# --- sparklines ------------------------------------------------------------------------------------------

def sparkline(values: Sequence[float], *, kind: str = "line", width: int = 80, height: int = 30,
              color: str = "#4c78a8", lo: float | None = None, hi: float | None = None, title: str = "") -> str:
    """A tiny inline SVG: a line (e.g. erank over position) or bars (a histogram); '' when there is nothing."""
    y = np.asarray(list(values), np.float64)
    if y.size == 0 or not np.isfinite(y).any():
        return ""
    lo = float(np.nanmin(y)) if lo is None else lo
    hi = float(np.nanmax(y)) if hi is None else hi
    span = hi - lo if hi > lo else 1.0
    t = np.clip((np.nan_to_num(y, nan=lo) - lo) / span, 0, 1)
    pad = 2
    inner_h = height - 2 * pad
    body = ""
    if kind == "bars":
        w = (width - 2 * pad) / len(t)
        body = "".join(f'<rect x="{pad + i * w:.1f}" y="{pad + inner_h * (1 - v):.1f}" width="{max(w - 0.5, 0.5):.1f}" '
                       f'height="{inner_h * v:.1f}" fill="{color}"/>' for i, v in enumerate(t))
    else:
        xs = np.linspace(pad, width - pad, len(t))
        pts = " ".join(f"{x:.1f},{pad + inner_h * (1 - v):.1f}" for x, v in zip(xs, t))
        body = f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.6"/>'
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" preserveAspectRatio="none">'
           f'<rect width="{width}" height="{height}" rx="3" fill="#f4f4f7"/>'
           f'{body}</svg>')
    data = base64.b64encode(svg.encode()).decode()
    return (f'<img src="data:image/svg+xml;base64,{data}" style="width:100%;height:{height}px" '
            f'alt="{html.escape(title)}" title="{html.escape(title)}"/>')


def fmt(value: Any, spec: str = ".2f") -> str:
    """A number for a card ('—' when missing)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "—"
    return "—" if not np.isfinite(v) else format(v, spec)
