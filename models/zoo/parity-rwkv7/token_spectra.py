"""Smallest transition eigenvalue of an rwkv7 store per layer, head and input bigram (this card's spectra table).

`python models/zoo/parity-rwkv7/token_spectra.py STORE [--json]`: every token's transition
A_t = diag(w_t) - (kappa_t * a_t) kappa_t^T has a real spectrum (kernels.spectra.dplr.dplr_eigvals_general,
exact by the secular equation); all but the smallest eigenvalue interlace the w's, and the smallest is the one the
removal pulls down (>= min w - 1 > -0.455 for RWKV-7). Reported: its mean per current token and per
(previous token, current token), its minimum, and the share of tokens where it is negative.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from deltalab import store
from deltalab.kernels.spectra.dplr import dplr_eigvals_general


def smallest_eigenvalues(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [S, T], smallest eigenvalue [S, L, T, H]) of every token's transition in the store."""
    ds = store.open(path)
    out = []
    for layer in ds["layer"].values.tolist():
        sub = ds.sel(layer=layer)
        g = torch.from_numpy(np.asarray(sub["g"].values, dtype=np.float64))  # [S, T, H, K]
        kappa = torch.from_numpy(np.asarray(sub["kappa"].values, dtype=np.float64))[:, :, 0]
        a_rwkv = torch.from_numpy(np.asarray(sub["beta"].values, dtype=np.float64))[:, :, 0]
        eig = dplr_eigvals_general(g.exp(), -kappa, kappa * a_rwkv)  # ascending, float64
        out.append(eig[..., 0].numpy())
    return np.asarray(ds["tokens"].values), np.stack(out, axis=1)


def summarise(tokens: np.ndarray, smallest: np.ndarray) -> dict:
    """{layer: {head: {"x=1": {...}, "prev=0,x=1": {...}}}}: mean, min and share < 0 of the smallest eigenvalue."""
    prev = np.concatenate([np.full_like(tokens[:, :1], -1), tokens[:, :-1]], axis=1)
    groups = {f"x={t}": tokens == t for t in np.unique(tokens).tolist()}
    groups |= {f"prev={p},x={t}": (prev == p) & (tokens == t) for p in np.unique(tokens).tolist()
               for t in np.unique(tokens).tolist()}
    res: dict = {}
    for layer in range(smallest.shape[1]):
        for head in range(smallest.shape[3]):
            e = smallest[:, layer, :, head]
            res.setdefault(layer, {})[head] = {
                name: {"mean": round(float(e[m].mean()), 4), "min": round(float(e[m].min()), 4),
                       "share_negative": round(float((e[m] < 0).mean()), 4)}
                for name, m in groups.items() if m.any()}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = summarise(*smallest_eigenvalues(args.store))
    if args.json:
        print(json.dumps(res))
        return
    for layer, heads in res.items():
        for head, groups in heads.items():
            row = "  ".join(f"{g}: {v['mean']:+.2f}" for g, v in groups.items())
            low = min(v["min"] for v in groups.values())
            print(f"layer {layer} head {head}  mean smallest eigenvalue  {row}  (min {low:+.3f})")


if __name__ == "__main__":
    main()
