"""Per-token transition spectra of an rwkv7 store, split by input token (the numbers in models/zoo/parity-rwkv7).

`python scripts/rwkv7_token_spectra.py STORE [--json]`: for every layer, head and input token, the eigenvalues of
RWKV-7's transition A_t = diag(w_t) - kappa_t (kappa_t * a_t)^T. With a_t > 0, diag(a)^(1/2) A diag(a)^(-1/2) =
diag(w) - u u^T (u = sqrt(a) * kappa) is symmetric, so the spectrum is real and eigvalsh gives it exactly: all
but one eigenvalue interlace the w's; the smallest is the one the removal pulls down (>= min w - 1 > -0.455).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import store


def token_spectra(path: str) -> dict:
    """{layer: {head: {token: {min, max, mean_min, share_negative}}}} over all (seq, pos) of the store."""
    ds = store.open(path)
    tokens = np.asarray(ds["tokens"].values)
    out: dict = {}
    for layer in ds["layer"].values.tolist():
        sub = ds.sel(layer=layer)
        w = np.exp(np.asarray(sub["g"].values, dtype=np.float64))  # [S, T, H, K]
        kappa = np.asarray(sub["kappa"].values, dtype=np.float64)[:, :, 0]
        a = np.asarray(sub["beta"].values, dtype=np.float64)[:, :, 0]
        u = np.sqrt(a) * kappa
        sym = np.einsum("sthk,kl->sthkl", w, np.eye(w.shape[-1])) - u[..., :, None] * u[..., None, :]
        eig = np.linalg.eigvalsh(sym)  # [S, T, H, K], ascending
        out[layer] = {}
        for head in range(eig.shape[2]):
            out[layer][head] = {}
            for tok in np.unique(tokens).tolist():
                e = eig[:, :, head][tokens == tok]  # [N, K]
                out[layer][head][tok] = {"min": round(float(e.min()), 4), "max": round(float(e.max()), 4),
                                         "mean_min": round(float(e[:, 0].mean()), 4),
                                         "share_negative": round(float((e[:, 0] < 0).mean()), 4)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = token_spectra(args.store)
    if args.json:
        print(json.dumps(res))
        return
    for layer, heads in res.items():
        for head, toks in heads.items():
            row = "  ".join(f"tok {t}: min {v['min']:+.3f} mean-min {v['mean_min']:+.3f} max {v['max']:.3f} "
                            f"neg {v['share_negative']:.0%}" for t, v in toks.items())
            print(f"layer {layer} head {head}  {row}")


if __name__ == "__main__":
    main()
