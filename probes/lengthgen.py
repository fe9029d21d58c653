"""Length generalisation: token accuracy, loss and sequence accuracy against position, within and beyond the
training length (from the store's `correct`, `loss` and `labels`).

`sequence_accuracy[p]` is the fraction of sequences whose labelled tokens are all right up to p,
the prefix form of the papers' sequence accuracy. Records are position buckets.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import xarray as xr

from deltalab.models import IGNORE_INDEX
from deltalab.probes import data
from deltalab.probes.base import ProbeResult, exit_main

NAME = "lengthgen"
SUMMARY_KEYS = ["pos_start", "pos_end", "n", "accuracy", "sequence_accuracy", "loss", "beyond_train"]


def run(ds: xr.Dataset, *, train_length: int | None = None, bucket: int = 16, threshold: float = 0.9,
        budget: int = 1 << 30, checkpoint: str | None = None) -> ProbeResult:
    """Accuracy against position of `ds`; `threshold` sets `first_failure_pos` (first bucket below it).

    Args:
        ds: a store Dataset with `correct` and `labels` [seq, pos] (and `loss` [seq, pos] when stored).
        train_length: the training length (None: the store's attr or the checkpoint's run files).
        bucket: positions per accuracy bucket in the records.
        threshold: accuracy below which a bucket is the first failure.
        budget: bytes of store data read into memory at once (blocks of sequences).
        checkpoint: where to look up the training length.

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per bucket of positions. The dataset holds
        accuracy, loss, count and sequence_accuracy (the share of sequences right up to each position), all [pos].
    """
    data.require(ds, ["correct", "labels"], NAME)
    T = ds.sizes["pos"]
    tl = data.train_length(ds, train_length, checkpoint)
    n_valid, n_right, loss_sum, loss_n, seq_ok = (np.zeros(T) for _ in range(5))
    n_seq = 0
    for _, block in data.iter_blocks(ds, ["correct", "labels", "loss"], budget, desc="lengthgen"):
        valid = np.asarray(block["labels"].values) != IGNORE_INDEX
        right = np.asarray(block["correct"].values, dtype=bool) & valid
        n_valid += valid.sum(0)
        n_right += right.sum(0)
        seq_ok += np.logical_and.accumulate(right | ~valid, axis=1).sum(0)
        n_seq += valid.shape[0]
        if "loss" in block:
            loss = np.asarray(block["loss"].values, dtype=np.float64)
            ok = valid & np.isfinite(loss)
            loss_sum += np.where(ok, loss, 0).sum(0)
            loss_n += ok.sum(0)
    pos = np.arange(T)
    beyond = pos >= tl if tl is not None else np.zeros(T, bool)
    acc = np.where(n_valid > 0, n_right / np.maximum(n_valid, 1), np.nan)
    loss = np.where(loss_n > 0, loss_sum / np.maximum(loss_n, 1), np.nan)

    def region(mask: np.ndarray) -> float:
        c = n_valid[mask].sum()
        return float(n_right[mask].sum() / c) if c else float("nan")

    out = xr.Dataset(
        {"accuracy": ("pos", acc), "loss": ("pos", loss), "count": ("pos", n_valid.astype(np.int64)),
         "sequence_accuracy": ("pos", seq_ok / max(n_seq, 1))},
        coords={"pos": pos, "beyond_train": ("pos", beyond)},
        attrs={"train_length": tl if tl is not None else -1, "bucket": bucket, "threshold": threshold,
               "accuracy_within_train": region(~beyond), "accuracy_beyond_train": region(beyond),
               "n_seq": n_seq},
    )
    recs = records(out, bucket)
    fail = next((r["pos_start"] for r in recs if r["accuracy"] is not None and r["accuracy"] < threshold), None)
    out.attrs["first_failure_pos"] = -1 if fail is None else int(fail)
    if tl is None:
        print("warning: the training length is unknown (no store attr, none in the --checkpoint run files); "
              "pass --train-length to mark it", file=sys.stderr)
    elif not beyond.any():
        print(f"warning: sequences ({T} tokens) are not longer than the training length {tl}: "
              "capture longer ones to see length generalisation", file=sys.stderr)
    return ProbeResult(NAME, out, recs, SUMMARY_KEYS)


def records(out: xr.Dataset, bucket: int) -> list[dict[str, Any]]:
    """One record per bucket of `bucket` positions."""
    T = out.sizes["pos"]
    acc, cnt = out["accuracy"].values, out["count"].values
    recs = []
    for lo in range(0, T, max(1, bucket)):
        hi = min(T, lo + bucket)
        c = cnt[lo:hi]
        a = acc[lo:hi]
        n = int(c.sum())
        loss = out["loss"].values[lo:hi]
        ok = np.isfinite(loss) & (c > 0)
        recs.append({
            "pos_start": lo, "pos_end": hi, "n": n,
            "accuracy": float(np.nansum(a * c) / n) if n else None,
            "loss": float((loss[ok] * c[ok]).sum() / c[ok].sum()) if ok.any() else None,
            "sequence_accuracy": float(out["sequence_accuracy"].values[hi - 1]),
            "beyond_train": bool(out["beyond_train"].values[lo]),
        })
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-length", type=int, default=None,
                   help="training length (default: the store's attr, else --checkpoint's run files)")
    p.add_argument("--bucket", type=int, default=16, help="positions per record (default 16)")
    p.add_argument("--threshold", type=float, default=0.9, help="accuracy below which a bucket counts as failed")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    return run(ds, train_length=args.train_length, bucket=args.bucket, threshold=args.threshold,
               budget=args.memory_budget, checkpoint=args.checkpoint)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.lengthgen --store STORE [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
