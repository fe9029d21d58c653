"""Eigenvalues of every token's Householder product P_t and transition A_t = exp(g_t) P_t; rotations; windows.

Exact and cheap through the n_h x n_h reduction (`kernels.spectra.householder`): the n_h non-trivial eigenvalues
per token and head (the other dk - n_h are 1, times exp(g_t) for A_t). A token's transition is a
*rotation* when its non-trivial eigenvalues lie on the unit circle and multiply to +1 (a conjugate
pair e^{+-i theta} turns by theta; two reflections whose planes meet at phi turn by 2 phi).
Per-input-token summaries give each token's (e.g. group element's) eigenvalue set; products over
windows of w tokens give the eigenvalues of P_{t+w-1} ... P_t. Per-token arrays are lazy and are
written chunk by chunk; summaries are streamed from them.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
import xarray as xr

from deltalab.kernels.constants import SECULAR_PRECISIONS
from deltalab.probes import data, linalg
from deltalab.probes.base import ProbeError, ProbeResult, exit_main
from deltalab.probes.lazy import LayerPlan

NAME = "spectra"
PRECISIONS = SECULAR_PRECISIONS  # of the per-channel-gate secular solves
ANGLE_BINS = 36  # 5 degree bins over [0, 180]
SUMMARY_KEYS = ["layer", "head", "frac_complex", "frac_unit_modulus", "frac_rotation", "rotation",
                "median_angle_deg", "mean_modulus"]


def per_token(ds: xr.Dataset, *, window: int = 4, stride: int | None = None, budget: int = 1 << 30,
              device: str = "cpu", channel_windows: bool = False, precision: str = "float64") -> xr.Dataset:
    """Lazy per-token eigenvalues: eig_P [seq,layer,pos,head,eig] (and eig_A if gated), window_eig_P
    [seq,layer,window,head,weig] (and window_eig_A; for per-channel gates only with `channel_windows`)."""
    return plan(ds, window=window, stride=stride, device=device, channel_windows=channel_windows,
                precision=precision).lazy(ds, budget)


def plan(ds: xr.Dataset, *, window: int = 4, stride: int | None = None, device: str = "cpu",
         channel_windows: bool = False, precision: str = "float64") -> LayerPlan:
    """What per_token computes for one (sequences, layer) piece of `ds` (probes.lazy.LayerPlan).

    Per-channel gates (Kimi Delta Attention): eig_A has all dk eigenvalues of each token's transition (`aeig`),
    exact by the secular equation for n_h = 1, dense float64 for n_h > 1. window_eig_A [seq,layer,window,head,aeig]
    multiplies each window's transitions out densely (`kernels.spectra.channel`; milliseconds per window and head
    at dk = 128), so it is computed only with `channel_windows`. `precision` "float32" solves eig_A's secular
    equations in float32 (`kernels.spectra.dplr`: about 7x faster on a GPU, within ~20 eps32 of each matrix's
    spectral scale; the values are stored as complex64 either way)."""
    if precision not in PRECISIONS:
        raise ProbeError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}: pick one of them")
    data.require(ds, ["k", "beta"], NAME)
    T, n_h, H = ds.sizes["pos"], ds.sizes["step"], ds.sizes["head"]
    stride = stride or window
    if window < 1 or stride < 1:
        raise ProbeError(f"--window ({window}) and --stride ({stride}) must be >= 1")
    if window > T:
        raise ProbeError(f"--window {window} is longer than the sequences ({T} tokens): pick a window <= {T}")
    if data.dplr_store(ds):
        return _dplr_plan(ds, window=window, stride=stride, device=device)
    gated = "g" in ds
    channel = gated and "dk" in ds["g"].dims  # Kimi Delta Attention: A_t = (I - b k k^T) diag(exp g_t)
    n_win = (T - window) // stride + 1
    outputs: dict[str, tuple[tuple[str, ...], Any]] = {
        "eig_P": (("seq", "layer", "pos", "head", "eig"), np.complex64),
        "window_eig_P": (("seq", "layer", "window", "head", "weig"), np.complex64),
    }
    if channel:  # all dk eigenvalues of A_t are non-trivial (real for n_h = 1: the secular equation, exactly)
        outputs["eig_A"] = (("seq", "layer", "pos", "head", "aeig"), np.complex64)
        if channel_windows:
            outputs["window_eig_A"] = (("seq", "layer", "window", "head", "aeig"), np.complex64)
    elif gated:
        outputs["eig_A"] = (("seq", "layer", "pos", "head", "eig"), np.complex64)
        outputs["window_eig_A"] = (("seq", "layer", "window", "head", "weig"), np.complex64)

    def fn(a: dict[str, Any]) -> dict[str, np.ndarray]:
        k, beta = a["k"], a["beta"]
        # a capture's CUDA tensors with one key per token: eig_P (and a scalar gate's eig_A) in one Triton pass
        fused = isinstance(k, torch.Tensor) and k.shape[2] == 1 and torch.device(device).type == "cuda"
        if fused:
            from deltalab.kernels.spectra.triton_token import token_eigenvalues

            with torch.profiler.record_function("deltalab.linalg.spectra_w1_fused"):
                gate = a["g"].to(device) if gated and not channel else None
                eig_p, eig_a = token_eigenvalues(k.to(device), beta.to(device), gate)
        else:
            eig_p = linalg.token_spectra(k, beta, device=device)
        out = {"eig_P": eig_p,
               "window_eig_P": linalg.token_spectra(k, beta, window=window, stride=stride, device=device)}
        if channel:
            out["eig_A"] = linalg.channel_gate_spectra(k, beta, a["g"], device=device, precision=precision)
            if channel_windows:
                out["window_eig_A"] = linalg.channel_gate_spectra(k, beta, a["g"], window=window, stride=stride,
                                                                  device=device)
        elif gated and isinstance(k, torch.Tensor):  # a capture's tensors: stay on their device
            g = a["g"].to(torch.float64)
            out["eig_A"] = eig_a if fused else out["eig_P"].to(torch.complex128) * g.exp()[..., None]
            gw = g.unfold(1, window, stride).sum(-1)  # [B, n_win, H]
            out["window_eig_A"] = out["window_eig_P"].to(torch.complex128) * gw.exp()[..., None]
        elif gated:
            g = linalg.host(a["g"]).astype(np.float64)
            out["eig_A"] = out["eig_P"] * np.exp(g)[..., None]
            gw = np.lib.stride_tricks.sliding_window_view(g, window, axis=1)[:, ::stride].sum(-1)
            out["window_eig_A"] = out["window_eig_P"] * np.exp(gw)[..., None]
        return out

    sizes = {"pos": T, "head": H, "eig": n_h, "window": n_win, "weig": window * n_h, "aeig": ds.sizes["dk"]}
    coords = {"window_start": ("window", np.arange(n_win) * stride)}
    # every (seq, layer) alike: capture may pass all a batch's layers at once (one launch of each kernel instead of one
    # a layer); not per-channel gates, whose float64 decays [seq, pos, head, dk] would then be held for every layer
    return LayerPlan(["k", "beta", "g"], fn, outputs, sizes, coords=coords, batch_layers=not channel,
                     attrs={"window": window, "stride": stride, "gated": gated, "channel_gate": channel,
                            "channel_windows": channel and channel_windows, "precision": precision})


def _dplr_plan(ds: xr.Dataset, *, window: int, stride: int, device: str) -> LayerPlan:
    """RWKV-7 (per-channel beta, removal key kappa): eig_A holds every token's dk exact eigenvalues of
    A_t = diag(e^g_t) - (kappa_t * beta_t) kappa_t^T (secular equation); eig_P the one non-trivial eigenvalue of the
    undecayed removal factor P_t = I - (kappa_t * beta_t) kappa_t^T, 1 - sum_i kappa_i^2 beta_i, and window_eig_P
    the w non-trivial eigenvalues of products of w of them (`linalg.removal_spectra`)."""
    data.require(ds, ["kappa", "beta", "g"], NAME)
    T, H = ds.sizes["pos"], ds.sizes["head"]
    n_win = (T - window) // stride + 1
    outputs: dict[str, tuple[tuple[str, ...], Any]] = {
        "eig_P": (("seq", "layer", "pos", "head", "eig"), np.complex64),
        "window_eig_P": (("seq", "layer", "window", "head", "weig"), np.complex64),
        "eig_A": (("seq", "layer", "pos", "head", "aeig"), np.complex64),
    }

    def fn(a: dict[str, Any]) -> dict[str, np.ndarray]:
        kappa, beta = a["kappa"][:, :, 0], a["beta"][:, :, 0]  # [s, T, H, dk]: the step axis has length 1
        return {"eig_P": linalg.removal_spectra(kappa, beta, device=device),
                "window_eig_P": linalg.removal_spectra(kappa, beta, window=window, stride=stride, device=device),
                "eig_A": linalg.dplr_spectra(a["g"], kappa, beta, device=device)}

    sizes = {"pos": T, "head": H, "eig": 1, "window": n_win, "weig": window, "aeig": ds.sizes["dk"]}
    coords = {"window_start": ("window", np.arange(n_win) * stride)}
    return LayerPlan(["kappa", "beta", "g"], fn, outputs, sizes, coords=coords,
                     attrs={"window": window, "stride": stride, "gated": True, "channel_gate": True, "dplr": True})


def summarize(tok: xr.Dataset, ds: xr.Dataset, *, max_tokens: int = 64, unit_tol: float = 0.05,
              budget: int = 1 << 30) -> xr.Dataset:
    """Per layer/head fractions (complex, unit modulus, rotation), angle histograms, per-token eigenvalue sets."""
    L, H, n = tok.sizes["layer"], tok.sizes["head"], tok.sizes["eig"]
    has_tokens = "tokens" in ds
    tok_ids, tok_counts = (data.token_vocab(ds, max_tokens, budget) if has_tokens
                           else (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    nt = len(tok_ids)
    acc = {k: np.zeros((L, H)) for k in ("n", "complex", "unit", "rotation", "modulus", "w_n", "w_complex",
                                          "w_unit", "w_rotation", "modulus_A")}
    angle_hist = np.zeros((L, H, ANGLE_BINS), np.int64)
    t_sum = np.zeros((L, nt, H, n), np.complex128)
    t_sq = np.zeros((L, nt, H))
    t_n = np.zeros(nt)
    names = ["eig_P", "window_eig_P"] + (["eig_A"] if "eig_A" in tok else [])
    merged = tok[names]
    if has_tokens:
        merged = merged.assign(tokens=ds["tokens"])
    def part(block: xr.Dataset) -> dict[str, Any]:
        """One block's additive contributions (run on several threads by data.map_blocks)."""
        p: dict[str, Any] = {}
        eig = np.asarray(block["eig_P"].values).astype(np.complex128)  # [s, L, T, H, n]; NaN at padding
        real = np.isfinite(eig).all((1, 3, 4))  # [s, T]
        keep = real[:, None, :, None]
        eig = np.where(keep[..., None], eig, 1.0)
        stats = _token_stats(eig, unit_tol)
        for key in ("complex", "unit", "rotation"):
            p[key] = (stats[key] & keep).sum((0, 2))
        p["n"] = real.sum()
        p["modulus"] = np.where(keep, np.abs(eig).mean(-1), 0.0).sum((0, 2))
        angle = np.degrees(np.abs(np.angle(eig))).max(-1)  # the token's rotation angle
        bins = np.clip((angle / 180 * ANGLE_BINS).astype(np.int64), 0, ANGLE_BINS - 1)
        combo = (np.arange(L)[None, :, None, None] * H + np.arange(H)[None, None, None, :]) * ANGLE_BINS + bins
        combo = combo[np.broadcast_to(keep, combo.shape)]
        p["angle_hist"] = np.bincount(combo.ravel(), minlength=L * H * ANGLE_BINS).reshape(L, H, ANGLE_BINS)
        if "eig_A" in block:
            eig_a = np.abs(np.asarray(block["eig_A"].values)).astype(np.float64).mean(-1)  # sums in float64
            p["modulus_A"] = np.where(keep, np.nan_to_num(eig_a), 0.0).sum((0, 2))
        weig = np.asarray(block["window_eig_P"].values).astype(np.complex128)
        wreal = np.isfinite(weig).all((1, 3, 4))
        wkeep = wreal[:, None, :, None]
        wstats = _token_stats(np.where(wkeep[..., None], weig, 1.0), unit_tol)
        for key in ("complex", "unit", "rotation"):
            p["w_" + key] = (wstats[key] & wkeep).sum((0, 2))
        p["w_n"] = wreal.sum()
        if nt:  # per input token: its occurrences' sums, all tokens at once
            ti = data.token_index(np.asarray(block["tokens"].values), tok_ids)  # [s, T]
            sel = (ti >= 0) & real
            idx = ti[sel]
            e = eig.transpose(0, 2, 1, 3, 4)[sel]  # [m, L, H, n]
            p["t_sum"] = np.zeros((nt, L, H, n), np.complex128)
            np.add.at(p["t_sum"], idx, e)
            p["t_sq"] = np.zeros((nt, L, H))
            np.add.at(p["t_sq"], idx, (np.abs(e) ** 2).sum(-1))
            p["t_n"] = np.bincount(idx, minlength=nt)
        return p

    for p in data.map_blocks(merged, [*names, "tokens"], budget, part, factor=4, desc="spectra summary"):
        for key, value in p.items():
            if key in acc:
                acc[key] += value
        angle_hist += p["angle_hist"]
        if nt:
            t_sum += p["t_sum"].transpose(1, 0, 2, 3)
            t_sq += p["t_sq"].transpose(1, 0, 2)
            t_n += p["t_n"]
    n_tok = np.maximum(acc["n"], 1)
    n_win = np.maximum(acc["w_n"], 1)
    tn = np.maximum(t_n, 1)[None, :, None]
    t_mean = t_sum / tn[..., None]
    t_spread = np.sqrt(np.maximum(t_sq / tn - (np.abs(t_mean) ** 2).sum(-1), 0.0) / max(n, 1))
    centers = (np.arange(ANGLE_BINS) + 0.5) * 180 / ANGLE_BINS
    dims = ("layer", "head")
    out = xr.Dataset(
        {
            "frac_complex": (dims, acc["complex"] / n_tok, {"description": "tokens with a complex eigenvalue pair"}),
            "frac_unit_modulus": (dims, acc["unit"] / n_tok,
                                  {"description": f"tokens whose non-trivial |eig| are within {unit_tol} of 1"}),
            "frac_rotation": (dims, acc["rotation"] / n_tok,
                              {"description": "tokens whose P_t is a rotation (unit modulus, product +1)"}),
            "mean_modulus": (dims, acc["modulus"] / n_tok),
            "angle_hist": (dims + ("angle_bin",), angle_hist,
                           {"description": "per-token rotation angle max|arg eig| (degrees)"}),
            "window_frac_complex": (dims, acc["w_complex"] / n_win),
            "window_frac_unit_modulus": (dims, acc["w_unit"] / n_win),
            "window_frac_rotation": (dims, acc["w_rotation"] / n_win),
            "token_count": (("token",), t_n.astype(np.int64)),
            "token_eig_P": (("layer", "token", "head", "eig"), t_mean.astype(np.complex64),
                            {"description": "mean (sorted) eigenvalue set of each input token"}),
            "token_eig_spread": (("layer", "token", "head"), t_spread,
                                 {"description": "rms distance of a token's eigenvalues from its mean set"}),
            "token_angle_deg": (("layer", "token", "head"), np.degrees(np.abs(np.angle(t_mean))).max(-1)),
        },
        coords={"layer": tok["layer"].values, "head": np.arange(H), "angle_bin": centers,
                "token": tok_ids.astype(np.int64)},
        attrs={"unit_tol": unit_tol},
    )
    if "eig_A" in tok:
        out["mean_modulus_A"] = (dims, acc["modulus_A"] / n_tok)
    return out


def _token_stats(eig: np.ndarray, tol: float) -> dict[str, np.ndarray]:
    """Per token/window booleans over [..., n] eigenvalue sets: complex pair, unit modulus, rotation."""
    mod = np.abs(eig)
    complex_ = (np.abs(eig.imag) > 1e-4).any(-1)
    unit = (np.abs(mod - 1) < tol).all(-1)
    rotation = unit & (np.abs(np.prod(eig, -1) - 1) < 2 * tol)
    return {"complex": complex_, "unit": unit, "rotation": rotation}


def median_from_hist(hist: np.ndarray, centers: np.ndarray) -> float:
    total = hist.sum()
    if total == 0:
        return float("nan")
    return float(centers[np.searchsorted(np.cumsum(hist), total / 2)])


def run(ds: xr.Dataset, *, window: int = 4, stride: int | None = None, max_tokens: int = 64,
        unit_tol: float = 0.05, rotation_frac: float = 0.9, budget: int = 1 << 30, device: str = "cpu",
        sink: Any = None, channel_windows: bool = False, precision: str = "float64") -> ProbeResult:
    """Spectra of `ds`. With a `sink` (results.ResultSink) the per-token arrays are written first and the
    summaries read them back; without one they are computed in memory (small stores).

    Args:
        ds: a store Dataset with `k` [seq, layer, pos, step, head, dk] and `beta` [seq, layer, pos, step, head]
            (and `g` for gated models, `tokens` for the per-token tables).
        window: tokens per window product (`window_eig_*`); stride: windows start every `stride` tokens
            (None: `window`).
        max_tokens: the most frequent token ids given per-token tables.
        unit_tol: |modulus - 1| counted as unit modulus; rotation_frac: the share of complex unit-modulus
            eigenvalues that marks a head `rotation`.
        budget: bytes of store data read into memory at once (blocks of sequences).
        device: where the eigenvalue kernels run ("cpu", "cuda").
        channel_windows: per-channel-gated models: window spectra of the full gated products.
        precision: "float64" (exact) or "float32" for the secular solves of DPLR transitions.

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per (layer, head). The dataset holds
        eig_P / eig_A [seq, layer, pos, head, eig] (complex eigenvalues of each token's Householder product and
        full transition), window_eig_P / window_eig_A [seq, layer, window, head, weig], the fractions
        frac_complex, frac_unit_modulus, frac_rotation, mean_modulus(_A), rotation [layer, head], angle_hist
        [layer, head, angle_bin] and per-token tables token_eig_P [layer, token, head, eig], token_count [token].
    """
    tok = per_token(ds, window=window, stride=stride, budget=budget, device=device, channel_windows=channel_windows,
                    precision=precision)
    attrs = dict(tok.attrs)
    tok = sink.write(tok) if sink is not None else tok.compute()
    tok.attrs.update(attrs)
    return from_tokens(tok, ds, max_tokens=max_tokens, unit_tol=unit_tol, rotation_frac=rotation_frac, budget=budget)


def from_tokens(tok: xr.Dataset, ds: xr.Dataset, *, max_tokens: int = 64, unit_tol: float = 0.05,
                rotation_frac: float = 0.9, budget: int = 1 << 30) -> ProbeResult:
    """The result from per-token arrays already computed (by `run`, or batch by batch during capture);
    `tok.attrs` carries per_token's (window, stride, gated, channel_gate)."""
    attrs = {k: tok.attrs[k] for k in ("window", "stride", "gated", "channel_gate", "channel_windows", "dplr",
                                       "precision")
             if k in tok.attrs}
    summary = summarize(tok, ds, max_tokens=max_tokens, unit_tol=unit_tol, budget=budget)
    summary["rotation"] = (("layer", "head"), (summary["frac_rotation"].values >= rotation_frac)
                           & (summary["frac_complex"].values > 0))
    out = xr.merge([tok, summary], combine_attrs="drop")
    out.attrs.update({**attrs, "unit_tol": unit_tol, "rotation_frac": rotation_frac})
    return ProbeResult(NAME, out, records(out), SUMMARY_KEYS)


def records(out: xr.Dataset) -> list[dict[str, Any]]:
    """One record per layer/head."""
    recs = []
    tokens = out["token"].values
    centers = out["angle_bin"].values
    for li, layer in enumerate(out["layer"].values):
        for h in out["head"].values:
            def v(name: str, li: int = li, h: int = h) -> float:
                return float(out[name].values[li, h])
            rec = {
                "layer": int(layer), "head": int(h),
                "frac_complex": v("frac_complex"), "frac_unit_modulus": v("frac_unit_modulus"),
                "frac_rotation": v("frac_rotation"), "rotation": bool(out["rotation"].values[li, h]),
                "mean_modulus": v("mean_modulus"),
                "median_angle_deg": median_from_hist(out["angle_hist"].values[li, h], centers),
                "window": int(out.attrs.get("window", 1)),
                "window_frac_complex": v("window_frac_complex"),
                "window_frac_rotation": v("window_frac_rotation"),
            }
            if "mean_modulus_A" in out:
                rec["mean_modulus_A"] = v("mean_modulus_A")
            if 0 < len(tokens) <= 32:
                rec["token_angle_deg"] = {str(int(t)): float(out["token_angle_deg"].values[li, ti, h])
                                          for ti, t in enumerate(tokens)}
                rec["token_eigenvalues"] = {
                    str(int(t)): [[float(e.real), float(e.imag)] for e in out["token_eig_P"].values[li, ti, h]]
                    for ti, t in enumerate(tokens)}
            recs.append(rec)
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=4, help="also the spectrum of products over w tokens (default 4)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: the window)")
    p.add_argument("--max-tokens", type=int, default=64, help="per-token summaries for the N most frequent tokens")
    p.add_argument("--unit-tol", type=float, default=0.05, help="|eig| within this of 1 counts as unit modulus")
    p.add_argument("--rotation-frac", type=float, default=0.9,
                   help="flag a head `rotation` when this fraction of its tokens are rotations")
    p.add_argument("--channel-windows", action="store_true",
                   help="per-channel gates: also window_eig_A, all dk eigenvalues of each window's transitions "
                        "(dense float64 eig, milliseconds per window and head at dk = 128)")
    p.add_argument("--precision", choices=PRECISIONS, default="float64",
                   help="per-channel gates: solve each token's dk eigenvalues in float64 (default) or float32 "
                        "(about 7x faster on a GPU, within ~20 eps32 of the spectral scale)")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    return run(ds, window=args.window, stride=args.stride, max_tokens=args.max_tokens, unit_tol=args.unit_tol,
               rotation_frac=args.rotation_frac, budget=args.memory_budget,
               device=data.pick_device(args.device), sink=sink, channel_windows=args.channel_windows,
               precision=args.precision)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.spectra --store STORE [--window W] [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
