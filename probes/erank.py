"""Entropy effective rank, stable rank and rank utilisation of the state per token, head and layer.

erank(H) = exp(-sum p_k log p_k), p_k = sigma_k / sum sigma (DeltaProduct paper, Figure 9);
stable rank ||H||_F^2 / ||H||_2^2 and rank utilisation = stable rank / min(dk, dv) (state-reduction
paper, Defs. 2.1/2.3). Every token's state is rebuilt from its chunk's stored start state and the
chunk's k/v/beta/g (never a whole sequence of states at once). Document starts (`doc_start`) and the
training length are carried into the output; the summary per head compares within/beyond training
length and the change of erank at document starts.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import xarray as xr

from deltalab.probes import data, linalg
from deltalab.probes.base import ProbeError, ProbeResult, exit_main
from deltalab.probes.lazy import LayerPlan

NAME = "erank"
FIELDS = ("erank", "stable_rank", "rank_utilisation", "state_norm")
SUMMARY_KEYS = ["layer", "head", "erank_mean", "erank_max", "stable_rank_mean", "rank_utilisation_mean",
                "erank_within_train", "erank_beyond_train"]


def per_token(ds: xr.Dataset, *, budget: int = 1 << 30, device: str = "cpu", every: int = 1) -> xr.Dataset:
    """Lazy [seq, layer, pos, head] arrays: erank, stable_rank, rank_utilisation, state_norm (Frobenius);
    `every=N` ranks the state after every N-th token only (NaN at the others, which summaries skip like padding)."""
    return plan(ds, device=device, every=every).lazy(ds, budget)


def plan(ds: xr.Dataset, *, device: str = "cpu", every: int = 1, picked: bool = False) -> LayerPlan:
    """What per_token computes for one (sequences, layer) piece of `ds` (probes.lazy.LayerPlan). `picked`: the
    states given are only the chunk boundaries `every` reads (a capture's reductions keep no others)."""
    data.require(ds, ["k", "v", "beta"], NAME)
    T, H = ds.sizes["pos"], ds.sizes["head"]
    chunk = data.chunk_size(ds)
    use_state = "state" in ds
    dplr = data.dplr_store(ds)  # RWKV-7: H <- (diag(e^g) - (kappa * beta) kappa^T) H + k v^T
    if dplr:
        data.require(ds, ["kappa"], NAME)

    def fn(a: dict[str, Any]) -> dict[str, np.ndarray]:
        boundary = a["state"] if use_state else None
        if dplr:  # the step axis of k, v, kappa, beta has length 1
            r = linalg.dplr_token_ranks(a["k"][:, :, 0], a["v"][:, :, 0], a["kappa"][:, :, 0], a["beta"][:, :, 0],
                                        a.get("g"), boundary, chunk_size=chunk, device=device, every=every,
                                        picked=picked)
        else:
            r = linalg.token_ranks(a["k"], a["v"], a["beta"], a.get("g"), boundary, chunk_size=chunk,
                                   device=device, every=every, picked=picked)
        return {"erank": r["erank"], "stable_rank": r["stable_rank"], "rank_utilisation": r["rank_utilisation"],
                "state_norm": r["frobenius"]}

    outputs = {f: (("seq", "layer", "pos", "head"), np.float32) for f in FIELDS}
    # working memory: one chunk of per-token states [s, C, H, dk, dv] beside the inputs
    dkdv = ds.sizes["dk"] * ds.sizes["dv"] * H * chunk * 4 * 3
    names = ["k", "v", "beta", "g", "state", *(["kappa"] if dplr else [])]
    factor = 1 + dkdv / max(1, data.bytes_per_seq(ds, names) / max(1, ds.sizes["layer"]))
    return LayerPlan(names, fn, outputs, {"pos": T, "head": H}, factor=factor,
                     attrs={"every": every},
                     descriptions={"erank": "exp(entropy of sigma / sum sigma)",
                                   "stable_rank": "||H||_F^2 / ||H||_2^2",
                                   "rank_utilisation": "stable rank / min(dk, dv)"})


def summarize(tok: xr.Dataset, ds: xr.Dataset, train_length: int | None, budget: int = 1 << 30) -> xr.Dataset:
    """Per layer/head means (overall, within/beyond training length), per-position means, doc-start drops."""
    L, T, H = tok.sizes["layer"], tok.sizes["pos"], tok.sizes["head"]
    pos = np.arange(T)
    beyond = pos >= train_length if train_length is not None else np.zeros(T, bool)
    sums = {f: np.zeros((L, T, H)) for f in ("erank", "stable_rank", "rank_utilisation", "state_norm")}
    sq = np.zeros((L, T, H))
    mx = np.zeros((L, H))
    count = np.zeros(T)
    final, n_final = np.zeros((L, H)), 0
    drop, n_drop = np.zeros((L, H)), 0
    merged = tok[list(sums)]
    if "doc_start" in ds:
        merged = merged.assign(doc_start=ds["doc_start"])
    def part(block: xr.Dataset) -> dict[str, Any]:
        """One block's contributions: sums (and the max) over its sequences (run on threads by data.map_blocks)."""
        p: dict[str, Any] = {}
        er = np.asarray(block["erank"].values, dtype=np.float64)  # [s, L, T, H]; NaN at padding
        real = np.isfinite(er).all((1, 3))  # [s, T]
        er = np.where(real[:, None, :, None], er, 0.0)
        for f in sums:
            p[f] = np.nan_to_num(np.asarray(block[f].values, dtype=np.float64), nan=0.0).sum(0)
        p["sq"] = (er * er).sum(0)
        p["mx"] = er.max((0, 2))
        p["count"] = real.sum(0)
        last = T - 1 - np.argmax(real[:, ::-1], axis=1)  # each sequence's last real token
        has = real.any(1)
        p["final"] = er[np.flatnonzero(has), :, last[has]].sum(0)
        p["n_final"] = int(has.sum())
        p["drop"], p["n_drop"] = 0.0, 0
        if "doc_start" in block:
            starts = np.asarray(block["doc_start"].values, dtype=bool).copy()
            starts[:, 0] = False  # the first token has no "before"
            starts &= real
            starts[:, 1:] &= real[:, :-1]  # nor a token whose predecessor has no rank (--every N, padding)
            s_idx, t_idx = np.nonzero(starts)
            if len(s_idx):
                p["drop"] = (er[s_idx, :, t_idx - 1] - er[s_idx, :, t_idx]).sum(0)
                p["n_drop"] = len(s_idx)
        return p

    for p in data.map_blocks(merged, [*sums, "doc_start"], budget, part, factor=2, desc="erank summary"):
        for f in sums:
            sums[f] += p[f]
        sq += p["sq"]
        mx = np.maximum(mx, p["mx"])
        count += p["count"]
        final += p["final"]
        n_final += p["n_final"]
        drop += p["drop"]
        n_drop += p["n_drop"]
    n = np.where(count > 0, count, np.nan)[None, :, None]
    by_pos = {f: sums[f] / n for f in sums}
    total = count.sum()

    def region(f: str, mask: np.ndarray) -> np.ndarray:
        c = count[mask].sum()
        return sums[f][:, mask].sum(1) / c if c else np.full((L, H), np.nan)

    every = np.ones(T, bool)
    mean = region("erank", every)
    std = np.sqrt(np.maximum(sq.sum(1) / max(total, 1) - mean**2, 0))
    dims = ("layer", "head")
    out = xr.Dataset(
        {
            "erank_by_pos": (("layer", "pos", "head"), by_pos["erank"], {"description": "mean over sequences"}),
            "stable_rank_by_pos": (("layer", "pos", "head"), by_pos["stable_rank"]),
            "rank_utilisation_by_pos": (("layer", "pos", "head"), by_pos["rank_utilisation"]),
            "erank_mean": (dims, mean), "erank_std": (dims, std), "erank_max": (dims, mx),
            "erank_final": (dims, final / n_final if n_final else np.full((L, H), np.nan),
                            {"description": "mean erank at each sequence's last real token"}),
            "stable_rank_mean": (dims, region("stable_rank", every)),
            "rank_utilisation_mean": (dims, region("rank_utilisation", every)),
            "state_norm_mean": (dims, region("state_norm", every)),
            "erank_within_train": (dims, region("erank", ~beyond)),
            "erank_beyond_train": (dims, region("erank", beyond)),
            "stable_rank_within_train": (dims, region("stable_rank", ~beyond)),
            "stable_rank_beyond_train": (dims, region("stable_rank", beyond)),
            "erank_drop_at_doc_start": (dims, drop / n_drop if n_drop else np.full((L, H), np.nan),
                                        {"description": "mean erank(t-1) - erank(t) where a document starts at t"}),
        },
        coords={"layer": tok["layer"].values, "head": np.arange(H), "pos": pos, "beyond_train": ("pos", beyond)},
        attrs={"train_length": train_length if train_length is not None else -1,
               "dk": _size(ds, "dk"), "dv": _size(ds, "dv"), "n_doc_starts": int(n_drop)},
    )
    return out


def _size(ds: xr.Dataset, dim: str) -> int:
    """A dim's length, from the store's sizes when no stored variable has it (reductions without k or v stored)."""
    return int(ds.sizes[dim]) if dim in ds.sizes else int(ds.attrs["sizes"][dim])


def run(ds: xr.Dataset, *, train_length: int | None = None, budget: int = 1 << 30, device: str = "cpu",
        sink: Any = None, checkpoint: str | None = None, every: int = 1) -> ProbeResult:
    """State ranks of `ds`. With a `sink` the per-token arrays are written first and the summaries read them
    back; without one they are computed in memory (small stores).

    Args:
        ds: a store Dataset with `k`, `v` [seq, layer, pos, step, head, dk|dv], `beta` (and `g`, `state` when
            stored: the chunk-boundary states replayed from, else from zero).
        train_length: the checkpoint's training length (splits `*_within_train` / `*_beyond_train`; None: the
            store's attr or the checkpoint's run files).
        budget: bytes of store data read into memory at once (blocks of sequences).
        device: where the SVDs run; sink: a results.ResultSink for the per-token arrays.
        checkpoint: where to look up the training length; every: rank only every N-th token's state.

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per (layer, head). The dataset holds
        erank, stable_rank, rank_utilisation, state_norm [seq, layer, pos, head], their means by position
        (`*_by_pos` [layer, pos, head]) and summaries erank_mean, erank_std, erank_max, erank_final,
        stable_rank_mean, rank_utilisation_mean, state_norm_mean, erank_within_train / beyond_train,
        erank_drop_at_doc_start [layer, head].
    """
    tok = per_token(ds, budget=budget, device=device, every=every)
    if "doc_start" in ds:
        tok["doc_start"] = ds["doc_start"]
    tok = sink.write(tok) if sink is not None else tok.compute()
    return from_tokens(tok, ds, train_length=train_length, budget=budget, checkpoint=checkpoint)


def from_tokens(tok: xr.Dataset, ds: xr.Dataset, *, train_length: int | None = None, budget: int = 1 << 30,
                checkpoint: str | None = None) -> ProbeResult:
    """The result from per-token arrays already computed (by `run`, or batch by batch during capture)."""
    tl = data.train_length(ds, train_length, checkpoint)
    summary = summarize(tok, ds, tl, budget)
    out = xr.merge([tok, summary], combine_attrs="drop")
    out.attrs = {**tok.attrs, **summary.attrs}
    return ProbeResult(NAME, out, records(out), SUMMARY_KEYS)


def records(out: xr.Dataset) -> list[dict[str, Any]]:
    """One record per layer/head."""
    names = ["erank_mean", "erank_std", "erank_max", "erank_final", "stable_rank_mean", "rank_utilisation_mean",
             "state_norm_mean", "erank_within_train", "erank_beyond_train", "stable_rank_within_train",
             "stable_rank_beyond_train", "erank_drop_at_doc_start"]
    tl = out.attrs.get("train_length", -1)
    recs = []
    for li, layer in enumerate(out["layer"].values):
        for h in out["head"].values:
            rec: dict[str, Any] = {"layer": int(layer), "head": int(h)}
            rec.update({n: float(out[n].values[li, h]) for n in names})
            rec.update({"train_length": None if tl is None or tl < 0 else int(tl),
                        "dk": out.attrs.get("dk"), "dv": out.attrs.get("dv")})
            recs.append(rec)
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-length", type=int, default=None,
                   help="training context length to mark (default: the store's train_length attr, "
                        "else what --checkpoint's run files record)")
    p.add_argument("--every", type=int, default=1,
                   help="rank the state after every N-th token only (N-fold fewer SVDs; default 1: every token)")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    if args.every < 1:
        raise ProbeError(f"--every {args.every}: pass a positive number of tokens")
    return run(ds, train_length=args.train_length, budget=args.memory_budget,
               device=data.pick_device(args.device), sink=sink, checkpoint=args.checkpoint, every=args.every)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.erank --store STORE [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
