"""Exact attention maps of delta-rule layers: top-k sources of every token and the GLA approximation's error.

o_t = (initial-state term) + sum_u alpha_{t,u} v_u exactly, alpha_{t,u} = scale b_u q_t^T Phi(t, u) k_u over the
Householder sub-steps u = (s, j) (`kernels.attention.chunk`). Per sequence, layer, query token and head this stores the
top-k sources (token s and step j) with their signed weights alpha and contribution norms |alpha| ||v_u||, the
norm of the initial-state term, the same for the gated-linear-attention approximation (Phi replaced by the
product of the gates, i.e. the delta rule's key removal dropped), the approximation's error over all sources,
and, where the store has the read-out `o`, how well o is rebuilt from the map (a check of the whole chain).
On rwkv7 stores (diagonal-plus-rank-one transitions diag(e^g) - (kappa * beta) kappa^T, scale 1) the sources are
tokens (step 0) and the maps come from `kernels.attention.dplr_chunk`; the approximation keeps only the diagonal decays.
With --context N only the N tokens before the window (rounded down to a chunk start) are separate sources;
earlier ones are folded into the initial-state term through the stored chunk-start state.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import xarray as xr

from deltalab.probes import data, linalg
from deltalab.probes.base import ProbeError, ProbeResult, exit_main
from deltalab.probes.lazy import LayerPlan

NAME = "attention"
SUMMARY_KEYS = ["layer", "head", "gla_weight_error_mean", "gla_output_error_mean", "top1_share_mean",
                "top1_lag_mean", "initial_share_mean", "reconstruction_error_max"]
MAPS = {"attn": True, "gla": False}  # variable prefix -> exact


def parse_window(text: str | None, T: int) -> tuple[int, int]:
    """'START:STOP' (either side may be empty) -> (start, stop) query tokens inside [0, T)."""
    if text is None:
        return 0, T
    try:
        lo, hi = str(text).split(":")
        start, stop = int(lo) if lo.strip() else 0, int(hi) if hi.strip() else T
    except ValueError:
        raise ProbeError(f"--window {text!r}: write START:STOP in tokens, e.g. 0:256") from None
    if not 0 <= start < stop <= T:
        raise ProbeError(f"--window {text} is not inside the {T}-token sequences: pick 0 <= START < STOP <= {T}")
    return start, stop


def per_token(ds: xr.Dataset, *, window: tuple[int, int] | None = None, top_k: int = 8, rank_by: str = "weight",
              context: int | None = None, budget: int = 1 << 30, device: str = "cpu") -> xr.Dataset:
    """Lazy [seq, layer, pos, head(, rank)] arrays of the maps of query tokens in `window`."""
    return plan(ds, window=window, top_k=top_k, rank_by=rank_by, context=context, device=device).lazy(ds, budget)


def plan(ds: xr.Dataset, *, window: tuple[int, int] | None = None, top_k: int = 8, rank_by: str = "weight",
         context: int | None = None, device: str = "cpu") -> LayerPlan:
    """What per_token computes for one (sequences, layer) piece of `ds` (probes.lazy.LayerPlan)."""
    data.require(ds, ["q", "k", "v", "beta"], NAME)
    dplr = data.dplr_store(ds)  # RWKV-7: transitions diag(e^g) - (kappa * beta) kappa^T, scale 1
    if dplr:
        data.require(ds, ["kappa"], NAME)
    T, H, n_h = ds.sizes["pos"], ds.sizes["head"], ds.sizes["step"]
    start, stop = window or (0, T)
    if top_k < 1:
        raise ProbeError(f"--top-k {top_k}: pass a positive number of sources per token")
    if context is not None and context < 0:
        raise ProbeError(f"--context {context}: pass a number of tokens >= 0, or leave it out for all")
    C = data.chunk_size(ds)
    first = 0 if context is None else max(0, start - context) // C * C  # first token kept as a separate source
    if first > 0:
        data.require(ds, ["state"], NAME + " --context")
    has_o, gated = "o" in ds, "g" in ds
    Tw = stop - start

    def fn(a: dict[str, Any]) -> dict[str, np.ndarray]:
        import torch

        from deltalab.kernels.attention.chunk import compare_attention
        from deltalab.kernels.attention.dplr_chunk import compare_dplr_attention

        def t(x: Any) -> torch.Tensor:
            return linalg.as_tensor(x[:, first:stop], device)

        s0 = linalg.as_tensor(a["state"][:, first // C], device) if "state" in a else None
        g = t(a["g"]) if gated else None
        args = dict(initial_state=s0, window=(start - first, stop - first), top_k=top_k, rank_by=rank_by)
        if dplr:  # the step axis of k, v, kappa, beta has length 1
            kap = t(a["kappa"])[:, :, 0]
            cmp = compare_dplr_attention(t(a["q"]), t(a["k"])[:, :, 0], t(a["v"])[:, :, 0], -kap,
                                         kap * t(a["beta"])[:, :, 0], g, scale=1.0, **args)
        else:
            cmp = compare_attention(t(a["q"]), t(a["k"]), t(a["v"]), t(a["beta"]), g, **args)
        out: dict[str, np.ndarray] = {}
        for prefix, m in (("attn", cmp.exact), ("gla", cmp.approx)):
            idx = m.top_index.cpu().numpy()
            out[f"{prefix}_source_pos"] = np.where(idx >= 0, idx // n_h + first, -1)
            out[f"{prefix}_source_step"] = np.where(idx >= 0, idx % n_h, -1)
            out[f"{prefix}_weight"] = m.top_weight.cpu().numpy()
            out[f"{prefix}_norm"] = m.top_norm.cpu().numpy()
            out[f"{prefix}_initial_norm"] = m.initial.norm(dim=-1).cpu().numpy()
        out["attn_row_norm"] = cmp.exact.row_norm.cpu().numpy()
        out["gla_weight_error"] = cmp.weight_error.cpu().numpy()
        out["gla_output_error"] = cmp.output_error.cpu().numpy()
        out["output_norm"] = cmp.exact.output.norm(dim=-1).cpu().numpy()
        if has_o:
            o = linalg.as_tensor(a["o"][:, start:stop], "cpu", torch.float64)
            rebuilt = cmp.exact.output.double().cpu()
            out["reconstruction_error"] = ((rebuilt - o).norm(dim=-1) / o.norm(dim=-1).clamp(min=1e-30)).numpy()
        return out

    tok, ranked = ("seq", "layer", "pos", "head"), ("seq", "layer", "pos", "head", "rank")
    outputs: dict[str, tuple[tuple[str, ...], Any]] = {}
    for prefix in MAPS:
        outputs.update({f"{prefix}_source_pos": (ranked, np.int32), f"{prefix}_source_step": (ranked, np.int8),
                        f"{prefix}_weight": (ranked, np.float32), f"{prefix}_norm": (ranked, np.float32),
                        f"{prefix}_initial_norm": (tok, np.float32)})
    outputs.update({n: (tok, np.float32) for n in ("attn_row_norm", "gla_weight_error", "gla_output_error",
                                                    "output_norm")})
    if has_o:
        outputs["reconstruction_error"] = (tok, np.float32)
    # working memory: the carried queries, a chunk's factors and the running top-k, beside the inputs
    per_seq = data.bytes_per_seq(ds, ["q", "k", "v", "beta", "g", "state"]) / max(1, ds.sizes["layer"])
    work = H * (Tw * (ds.sizes["dk"] + 4 * top_k + 2 * C * n_h) + (C * n_h) ** 2 * 4) * 4 * 3
    if dplr:  # sub-block decay factors of kernels.attention.dplr_chunk (about 8 of [C, dk] x (C / 16 + 16))
        work += H * 8 * C * ds.sizes["dk"] * (C // 16 + 16) * 4
    names = ["q", "k", "v", "beta", "g", *(["kappa"] if dplr else []), *(["state"] if "state" in ds else []),
             *(["o"] if has_o else [])]
    descriptions = {
        "attn_weight": "signed alpha_{t,u} = scale b_u q_t^T Phi(t,u) k_u of the top sources (rwkv7: "
                       "scale q_t^T Phi(t,s) k_s, Phi the product of the DPLR transitions)",
        "attn_norm": "|alpha_{t,u}| ||v_u||: norm of the source's contribution to o_t",
        "gla_weight": "the same with Phi replaced by the product of the gates (GLA; rwkv7: of the diagonal decays, "
                      "the rank-one removal dropped)",
        "gla_weight_error": "||alpha - alpha_gla|| / ||alpha|| over all sources",
        "gla_output_error": "||o_gla - o|| / ||o||, o_gla rebuilt from the approximation",
    }
    return LayerPlan(names, fn, outputs, {"pos": Tw, "head": H, "rank": top_k}, factor=1 + work / max(1.0, per_seq),
                     coords={"pos": np.arange(start, stop), "rank": np.arange(top_k)}, descriptions=descriptions,
                     attrs={"window_start": start, "window_stop": stop, "first_source": first, "top_k": top_k,
                            "rank_by": rank_by, "chunk_size": C})


def summarize(tok: xr.Dataset) -> xr.Dataset:
    """Per layer/head means over sequences and window tokens."""
    w = np.abs(np.asarray(tok["attn_norm"].values, dtype=np.float64))  # [s, L, T, H, k]
    share = w[..., 0] / np.maximum(w.sum(-1), 1e-30)
    lag = tok["pos"].values[None, None, :, None] - np.asarray(tok["attn_source_pos"].values)[..., 0]
    init = np.asarray(tok["attn_initial_norm"].values, dtype=np.float64)
    init_share = init / np.maximum(init + w.sum(-1), 1e-30)
    dims = ("layer", "head")
    out = {
        "gla_weight_error_mean": (dims, np.nanmean(tok["gla_weight_error"].values, axis=(0, 2))),
        "gla_output_error_mean": (dims, np.nanmean(tok["gla_output_error"].values, axis=(0, 2))),
        "top1_share_mean": (dims, share.mean((0, 2)), {"description": "top source's norm / sum of the top-k norms"}),
        "top1_lag_mean": (dims, lag.mean((0, 2)), {"description": "tokens from the query back to its top source"}),
        "initial_share_mean": (dims, init_share.mean((0, 2))),
    }
    if "reconstruction_error" in tok:
        out["reconstruction_error_max"] = (dims, np.nanmax(tok["reconstruction_error"].values, axis=(0, 2)))
    return xr.Dataset(out, coords={"layer": tok["layer"].values, "head": tok["head"].values if "head" in tok.coords
                                   else np.arange(tok.sizes["head"])})


def run(ds: xr.Dataset, *, window: tuple[int, int] | None = None, top_k: int = 8, rank_by: str = "weight",
        context: int | None = None, budget: int = 1 << 30, device: str = "cpu", sink: Any = None) -> ProbeResult:
    """Attention maps of `ds` (see the module docstring); per-token arrays are written first when `sink` is given.

    Args:
        ds: a store Dataset with `q` [seq, layer, pos, head, dk], `k`, `v` [seq, layer, pos, step, head, dk|dv],
            `beta` (and `g`).
        window: (start, stop) positions whose rows are computed (None: every position).
        top_k: sources kept per row (`rank` dim); rank_by: "weight" or "norm" (|weight| times |v|).
        context: sources looked back at most (None: the whole sequence).
        budget: bytes of store data read into memory at once (blocks of sequences).
        device: where the maps are computed; sink: a results.ResultSink for the per-token arrays.

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per (layer, head).
        The dataset holds the top sources
        attn_source_pos, attn_source_step, attn_weight, attn_norm [seq, layer, pos, head, rank] (and the gla_*
        approximation's), attn_initial_norm, attn_row_norm, output_norm, reconstruction_error, gla_weight_error,
        gla_output_error [seq, layer, pos, head] and their summaries *_mean, reconstruction_error_max
        [layer, head].
    """
    tok = per_token(ds, window=window, top_k=top_k, rank_by=rank_by, context=context, budget=budget, device=device)
    attrs = dict(tok.attrs)
    tok = sink.write(tok) if sink is not None else tok.compute()
    tok.attrs.update(attrs)
    return from_tokens(tok, ds)


def from_tokens(tok: xr.Dataset, ds: xr.Dataset) -> ProbeResult:
    """The result from per-token arrays already computed (by `run`, or batch by batch during capture);
    `tok.attrs` carries per_token's parameters."""
    attrs = dict(tok.attrs)
    summary = summarize(tok)
    out = xr.merge([tok, summary], combine_attrs="drop")
    out.attrs = attrs
    return ProbeResult(NAME, out, records(out), SUMMARY_KEYS)


def records(out: xr.Dataset) -> list[dict[str, Any]]:
    """One record per layer/head."""
    names = [k for k in SUMMARY_KEYS[2:] if k in out]
    recs = []
    for li, layer in enumerate(out["layer"].values):
        for hi in range(out.sizes["head"]):
            rec: dict[str, Any] = {"layer": int(layer), "head": hi}
            rec.update({n: float(out[n].values[li, hi]) for n in names})
            rec.update({k: out.attrs.get(k) for k in ("window_start", "window_stop", "top_k", "first_source")})
            recs.append(rec)
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", default=None, help="query tokens START:STOP (default: every token)")
    p.add_argument("--top-k", type=int, default=8, help="sources kept per token and head (default 8)")
    p.add_argument("--rank-by", choices=["weight", "contribution"], default="weight",
                   help="rank sources by |alpha| (weight) or by |alpha| ||v|| (contribution)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens before the window kept as separate sources (default all); earlier ones enter "
                        "through the stored chunk-start state")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    window = parse_window(args.window, ds.sizes["pos"])
    return run(ds, window=window, top_k=args.top_k, rank_by=args.rank_by, context=args.context,
               budget=args.memory_budget, device=data.pick_device(args.device), sink=sink)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.attention --store STORE [--window A:B] [--top-k K] [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
