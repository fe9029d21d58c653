"""Linear (logistic-regression) probes from each layer's state read-out to the task's state label.

Features per token (`--features`):
- `o` (default): the recurrence output o_t = scale * H_t^T q_t, i.e. what the layer reads out of its
  state; the stored `o` when captured, else rebuilt from q/k/v/beta/g with the chunked kernel;
- `state`: the per-token state H_t itself, flattened (dk*dv per head; heavy, use --max-train);
- any other stored per-layer variable with dims (seq, layer, pos, ...), e.g. `resid_post`.
One probe per layer on all heads together, and (`--per-head`) one per layer and head. The split is by
sequence (test sequences are never seen in training); accuracy is reported overall and per position.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import xarray as xr

from deltalab.models import IGNORE_INDEX
from deltalab.probes import data, linalg
from deltalab.probes.base import ProbeError, ProbeResult, exit_main

NAME = "linear"
SUMMARY_KEYS = ["layer", "head", "features", "accuracy", "train_accuracy", "chance", "n_train", "n_test"]
ALL_HEADS = -1


def _features(block: xr.Dataset, li: int, kind: str, device: str, chunk: int) -> np.ndarray:
    """[s, T, H, F] features of layer index li (H = 1 for variables without a head dim)."""
    def get(name: str) -> np.ndarray:  # padding (NaN) becomes an identity step; it carries no label
        return np.nan_to_num(np.asarray(block[name].isel(layer=li).values, dtype=np.float32), nan=0.0)

    g = get("g") if "g" in block else None
    if kind == "o":
        if "o" in block:
            return get("o")
        return linalg.readout(get("q"), get("k"), get("v"), get("beta"), g, device=device)
    if kind == "state":
        k, v, beta = get("k"), get("v"), get("beta")
        s, T, H = k.shape[0], k.shape[1], k.shape[3]
        bound = get("state") if "state" in block else None
        out = np.empty((s, T, H, k.shape[-1] * v.shape[-1]), np.float32)
        for lo in range(0, T, chunk):
            hi = min(T, lo + chunk)
            st = linalg.token_states(k, v, beta, g, bound, lo, hi, chunk_size=chunk, device=device)
            out[:, lo:hi] = st.reshape(s, hi - lo, H, -1)
        return out
    x = get(kind)  # [s, T, ...]
    if "head" in block[kind].dims:
        return x.reshape(x.shape[0], x.shape[1], x.shape[2], -1)
    return x.reshape(x.shape[0], x.shape[1], 1, -1)


def _inputs(ds: xr.Dataset, kind: str) -> list[str]:
    if kind == "o":
        return ["o"] if "o" in ds else ["q", "k", "v", "beta", "g"]
    if kind == "state":
        return ["k", "v", "beta", "g", "state"]
    return [kind]


def run(ds: xr.Dataset, *, features: str = "o", per_head: bool = True, test_fraction: float = 0.2,
        max_train: int = 20000, max_test: int = 20000, C: float = 1.0, seed: int = 0, bucket: int = 16,
        budget: int = 1 << 30, device: str = "cpu") -> ProbeResult:
    """Fit and score the probes; see the module docstring.

    Args:
        ds: a store Dataset with `labels` [seq, pos] and the features: `o` (or q, k, v, beta to rebuild it),
            `state` (from k, v, beta), or any variable with dims (seq, layer, pos, ...).
        features: "o", "state" or a variable's name; per_head: one probe per head (else one per layer).
        test_fraction: the share of sequences held out; max_train / max_test: labelled tokens sampled.
        C: inverse regularisation of the logistic regression; seed: the split's and samples' seed.
        bucket: positions per bucket of `accuracy_by_pos`.
        budget: bytes of store data read into memory at once (blocks of sequences).
        device: where the states are rebuilt.

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per (layer, probe head). The dataset holds
        accuracy, train_accuracy, chance, n_train, n_test [layer, probe_head] and accuracy_by_pos [layer, probe_head,
        pos].
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    data.require(ds, ["labels"], NAME)
    if features == "o" and "o" not in ds:
        data.require(ds, ["q", "k", "v", "beta"], NAME)
    elif features == "state":
        data.require(ds, ["k", "v", "beta"], NAME)
    elif features not in ("o", "state"):
        data.require(ds, [features], NAME)
        if "layer" not in ds[features].dims or "pos" not in ds[features].dims:
            raise ProbeError(f"--features {features} must have dims (seq, layer, pos, ...); it has {ds[features].dims}")
    n_seq, T, L = ds.sizes["seq"], ds.sizes["pos"], ds.sizes["layer"]
    if n_seq < 2:
        raise ProbeError("the linear probe needs at least 2 sequences (train/test split by sequence)")
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_seq)
    n_test = min(n_seq - 1, max(1, round(test_fraction * n_seq)))
    is_test = np.zeros(n_seq, bool)
    is_test[order[:n_test]] = True
    n_valid = np.zeros(n_seq, np.int64)  # labelled tokens per sequence, streamed
    for sl, block in data.iter_blocks(ds, ["labels"], budget):
        n_valid[sl] = (np.asarray(block["labels"].values) != IGNORE_INDEX).sum(1)
    p_train = min(1.0, max_train / max(1, n_valid[~is_test].sum()))
    p_test = min(1.0, max_test / max(1, n_valid[is_test].sum()))
    names = _inputs(ds, features)
    chunk = data.chunk_size(ds)
    n_heads_feat = ds.sizes["head"] if (features in ("o", "state") or "head" in ds[features].dims) else 1
    probes_heads = [ALL_HEADS] + (list(range(n_heads_feat)) if per_head and n_heads_feat > 1 else [])

    acc = np.full((L, len(probes_heads)), np.nan)
    train_acc, chance = np.full_like(acc, np.nan), np.full_like(acc, np.nan)
    n_tr, n_te = np.zeros(acc.shape, np.int64), np.zeros(acc.shape, np.int64)
    acc_pos = np.full((L, len(probes_heads), T), np.nan)
    n_classes = 0
    for li in range(L):
        xs_tr, ys_tr, xs_te, ys_te, pos_te = [], [], [], [], []
        layer_ds = ds.isel(layer=slice(li, li + 1))
        for sl, block in data.iter_blocks(layer_ds, [*names, "labels"], budget // 2, factor=3,
                                          desc=f"linear layer {li}"):
            feats = _features(block, 0, features, device, chunk)  # [s, T, H, F]
            lab = np.asarray(block["labels"].values)
            ok = lab != IGNORE_INDEX
            test = is_test[sl][:, None] & ok
            train = ~is_test[sl][:, None] & ok
            train &= rng.random(train.shape) < p_train
            test &= rng.random(test.shape) < p_test
            xs_tr.append(feats[train])
            ys_tr.append(lab[train])
            xs_te.append(feats[test])
            ys_te.append(lab[test])
            pos_te.append(np.nonzero(test)[1])
        x_tr, y_tr = np.concatenate(xs_tr), np.concatenate(ys_tr)
        x_te, y_te, p_te = np.concatenate(xs_te), np.concatenate(ys_te), np.concatenate(pos_te)
        if len(np.unique(y_tr)) < 2:
            raise ProbeError("the training labels have a single class: nothing to probe (check `labels`)")
        n_classes = max(n_classes, len(np.unique(np.concatenate([y_tr, y_te]))))
        values, counts = np.unique(y_tr, return_counts=True)
        majority = values[np.argmax(counts)]
        for pi, head in enumerate(probes_heads):
            xtr = x_tr.reshape(len(x_tr), -1) if head == ALL_HEADS else x_tr[:, head]
            xte = x_te.reshape(len(x_te), -1) if head == ALL_HEADS else x_te[:, head]
            model = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=300))
            model.fit(xtr, y_tr)
            right = model.predict(xte) == y_te
            acc[li, pi] = right.mean() if len(right) else np.nan
            train_acc[li, pi] = model.score(xtr, y_tr)
            chance[li, pi] = (y_te == majority).mean() if len(y_te) else np.nan
            n_tr[li, pi], n_te[li, pi] = len(y_tr), len(y_te)
            cnt = np.bincount(p_te, minlength=T)
            hit = np.bincount(p_te, weights=right.astype(float), minlength=T)
            acc_pos[li, pi] = np.where(cnt > 0, hit / np.maximum(cnt, 1), np.nan)

    dims = ("layer", "probe_head")
    out = xr.Dataset(
        {"accuracy": (dims, acc), "train_accuracy": (dims, train_acc), "chance": (dims, chance),
         "n_train": (dims, n_tr), "n_test": (dims, n_te),
         "accuracy_by_pos": (dims + ("pos",), acc_pos, {"description": "test accuracy at each position"})},
        coords={"layer": data.layer_values(ds), "probe_head": np.asarray(probes_heads), "pos": np.arange(T)},
        attrs={"features": features, "test_fraction": test_fraction, "n_classes": n_classes, "C": C,
               "seed": seed, "bucket": bucket, "probe_head_all": ALL_HEADS,
               "test_seqs": [int(x) for x in np.asarray(ds["seq"].values)[is_test]] if "seq" in ds.coords else []},
    )
    return ProbeResult(NAME, out, records(out), SUMMARY_KEYS)


def records(out: xr.Dataset) -> list[dict[str, Any]]:
    """One record per layer (head=None: all heads) and per layer/head."""
    bucket = int(out.attrs.get("bucket", 16))
    recs = []
    for li, layer in enumerate(out["layer"].values):
        for pi, head in enumerate(out["probe_head"].values):
            by_pos = out["accuracy_by_pos"].values[li, pi]
            buckets = [float(np.nanmean(by_pos[lo:lo + bucket])) if np.isfinite(by_pos[lo:lo + bucket]).any()
                       else None for lo in range(0, len(by_pos), bucket)]
            recs.append({
                "layer": int(layer), "head": None if head == ALL_HEADS else int(head),
                "features": out.attrs["features"], "accuracy": float(out["accuracy"].values[li, pi]),
                "train_accuracy": float(out["train_accuracy"].values[li, pi]),
                "chance": float(out["chance"].values[li, pi]), "n_train": int(out["n_train"].values[li, pi]),
                "n_test": int(out["n_test"].values[li, pi]), "n_classes": int(out.attrs["n_classes"]),
                "accuracy_by_pos_bucket": buckets, "bucket": bucket,
            })
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--features", default="o", help="o (state read-out, default), state, or a stored variable")
    p.add_argument("--no-per-head", dest="per_head", action="store_false", help="only the all-heads probe per layer")
    p.add_argument("--test-fraction", type=float, default=0.2, help="fraction of sequences held out (default 0.2)")
    p.add_argument("--max-train", type=int, default=20000, help="training tokens sampled (default 20000)")
    p.add_argument("--max-test", type=int, default=20000, help="test tokens sampled (default 20000)")
    p.add_argument("--C", type=float, default=1.0, help="inverse L2 regularisation of the logistic regression")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket", type=int, default=16, help="positions per accuracy bucket in the records")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    return run(ds, features=args.features, per_head=args.per_head, test_fraction=args.test_fraction,
               max_train=args.max_train, max_test=args.max_test, C=args.C, seed=args.seed, bucket=args.bucket,
               budget=args.memory_budget, device=data.pick_device(args.device))


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.linear --store STORE [--features o] [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
