"""PCA of the keys per layer/head/Householder step and over all steps jointly; 3-D coordinates; principal angles.

scikit-learn's PCA when one layer's keys fit the memory budget, IncrementalPCA streamed over
sequence blocks otherwise. The DeltaProduct paper's S4 rotation head has keys in a 3-D subspace
(top 3 components > 95% of the variance, Figure 7); `explained_variance_3` reports that number.
Principal angles (scipy.linalg.subspace_angles, degrees) compare the top-`subspace_dim` subspaces
of the steps of a head and of the heads of a layer. Per-token coordinates are lazy (dask) and are
written chunk by chunk.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import xarray as xr

from deltalab.probes import data
from deltalab.probes.base import ProbeError, ProbeResult, exit_main

NAME = "keys"
SUMMARY_KEYS = ["layer", "head", "step", "joint", "n_samples", "explained_variance_3", "n_components_95", "method"]


class _Fitter:
    """PCA of one stream of rows: exact PCA on everything, or IncrementalPCA on buffered blocks."""

    def __init__(self, dk: int, incremental: bool) -> None:
        self.dk, self.incremental, self.rows, self.n = dk, incremental, [], 0
        if incremental:
            from sklearn.decomposition import IncrementalPCA

            self.model = IncrementalPCA(n_components=dk)

    def add(self, x: np.ndarray) -> None:
        x = x[np.isfinite(x).all(1)]
        self.rows.append(x)
        self.n += len(x)
        if self.incremental and sum(len(r) for r in self.rows) >= 4 * self.dk:
            self._flush()

    def _flush(self) -> None:
        x = np.concatenate(self.rows)
        self.rows = []
        if len(x):
            self.model.partial_fit(x)

    def fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(components [dk, dk] rows, mean [dk], explained variance ratio [dk]); NaN-padded if rank-short."""
        from sklearn.decomposition import PCA

        comps, mean, evr = np.full((self.dk, self.dk), np.nan), np.full(self.dk, np.nan), np.full(self.dk, np.nan)
        rest = np.concatenate(self.rows) if self.rows else np.zeros((0, self.dk))
        self.rows = []
        model = None
        if self.incremental and (len(rest) >= self.dk or hasattr(self.model, "components_")):
            if len(rest) >= self.dk:
                self.model.partial_fit(rest)
            else:  # IncrementalPCA needs >= dk rows per batch: the last few rows are left out
                self.n -= len(rest)
            model = self.model
        elif len(rest) >= 2:
            model = PCA(n_components=min(self.dk, len(rest)), svd_solver="full").fit(rest)
        if model is not None:
            m = model.components_.shape[0]
            comps[:m], mean[:], evr[:m] = model.components_, model.mean_, model.explained_variance_ratio_
        return comps, mean, evr


def run(ds: xr.Dataset, *, n_coords: int = 3, subspace_dim: int = 3, budget: int = 1 << 30,
        report_components: int = 8, force_incremental: bool = False, of: str = "k") -> ProbeResult:
    """Key PCA of `ds`; see the module docstring.

    Args:
        ds: a store Dataset with `k` [seq, layer, pos, step, head, dk] (or `kappa`, with `of="kappa"`).
        n_coords: principal coordinates kept per token (`key_pc`).
        subspace_dim: components spanning the subspaces whose principal angles are compared.
        budget: bytes of store data read into memory at once (blocks of sequences).
        report_components: explained-variance ratios listed in the records.
        force_incremental: IncrementalPCA whatever the size (otherwise only when a layer exceeds the budget).
        of: "k" (the written keys) or "kappa" (RWKV-7's unit removal keys).

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per (layer, head, step)
        and one per (layer, head) pooled over steps. The dataset holds
        explained_variance_ratio [layer, step, head, component], components [layer, step, head, component, dk],
        mean [layer, step, head, dk], n_samples [layer, step, head], the same pooled over steps (`*_joint`,
        [layer, head, ...]), step_angles [layer, head, step_a, step_b, angle], head_angles [layer, step, head_a,
        head_b, angle] and key_pc / key_pc_joint [seq, layer, pos, step, head, pc].
    """
    if of not in ("k", "kappa"):
        raise ProbeError(f"--of {of}: choose k (the written keys) or kappa (rwkv7's removal keys)")
    if of == "kappa":
        if "kappa" not in ds:
            raise ProbeError("--of kappa: this store has no kappa (only rwkv7 stores have removal keys); drop --of")
        ds = ds.assign(k=ds["kappa"])
    data.require(ds, ["k"], NAME)
    L, n_h, H, dk = ds.sizes["layer"], ds.sizes["step"], ds.sizes["head"], ds.sizes["dk"]
    if not 1 <= subspace_dim <= dk or not 1 <= n_coords <= dk:
        raise ProbeError(f"--subspace-dim and --coords must be between 1 and dk={dk}")
    comps = np.full((L, n_h, H, dk, dk), np.nan)
    means = np.full((L, n_h, H, dk), np.nan)
    evr = np.full((L, n_h, H, dk), np.nan)
    comps_j, means_j, evr_j = np.full((L, H, dk, dk), np.nan), np.full((L, H, dk), np.nan), np.full((L, H, dk), np.nan)
    n_samples = np.zeros((L, n_h, H), np.int64)
    layer_bytes = ds["k"].nbytes // max(L, 1)
    incremental = force_incremental or layer_bytes * 3 > budget  # float64 copy + centring
    for li in range(L):
        fit = {(s, h): _Fitter(dk, incremental) for s in range(n_h) for h in range(H)}
        joint = {h: _Fitter(dk, incremental) for h in range(H)}
        k_layer = ds[["k"]].isel(layer=li)
        for _, block in data.iter_blocks(k_layer, ["k"], budget // 3 if incremental else budget,
                                         desc=f"keys layer {li}"):
            k = np.asarray(block["k"].values, dtype=np.float64)  # [s, pos, step, head, dk]
            for h in range(H):
                for s in range(n_h):
                    rows = k[:, :, s, h].reshape(-1, dk)
                    fit[(s, h)].add(rows)
                    joint[h].add(rows)
        for (s, h), f in fit.items():
            comps[li, s, h], means[li, s, h], evr[li, s, h] = f.fit()
            n_samples[li, s, h] = f.n
        for h, f in joint.items():
            comps_j[li, h], means_j[li, h], evr_j[li, h] = f.fit()

    step_angles = np.full((L, H, n_h, n_h, subspace_dim), np.nan)
    head_angles = np.full((L, n_h, H, H, subspace_dim), np.nan)
    head_angles_j = np.full((L, H, H, subspace_dim), np.nan)
    for li in range(L):
        for h in range(H):
            for a in range(n_h):
                for b in range(n_h):
                    step_angles[li, h, a, b] = _angles(comps[li, a, h], comps[li, b, h], subspace_dim)
        for h1 in range(H):
            for h2 in range(H):
                head_angles_j[li, h1, h2] = _angles(comps_j[li, h1], comps_j[li, h2], subspace_dim)
                for s in range(n_h):
                    head_angles[li, s, h1, h2] = _angles(comps[li, s, h1], comps[li, s, h2], subspace_dim)

    coords = {"layer": data.layer_values(ds), "step": np.arange(n_h), "head": np.arange(H),
              "component": np.arange(dk), "pc": np.arange(n_coords), "angle": np.arange(subspace_dim),
              "step_a": np.arange(n_h), "step_b": np.arange(n_h), "head_a": np.arange(H), "head_b": np.arange(H)}
    deg = {"units": "degrees"}
    out = xr.Dataset(
        {
            "explained_variance_ratio": (("layer", "step", "head", "component"), evr),
            "explained_variance_ratio_joint": (("layer", "head", "component"), evr_j),
            "components": (("layer", "step", "head", "component", "dk"), comps),
            "mean": (("layer", "step", "head", "dk"), means),
            "components_joint": (("layer", "head", "component", "dk"), comps_j),
            "mean_joint": (("layer", "head", "dk"), means_j),
            "n_samples": (("layer", "step", "head"), n_samples),
            "step_angles": (("layer", "head", "step_a", "step_b", "angle"), step_angles, deg),
            "head_angles": (("layer", "step", "head_a", "head_b", "angle"), head_angles, deg),
            "head_angles_joint": (("layer", "head_a", "head_b", "angle"), head_angles_j, deg),
        },
        coords=coords,
        attrs={"method": "incremental_pca" if incremental else "pca", "subspace_dim": subspace_dim,
               "n_coords": n_coords, "of": of},
    )
    out = out.merge(coordinates(ds, out, n_coords))
    return ProbeResult(NAME, out, records(out, report_components), SUMMARY_KEYS)


def _angles(a: np.ndarray, b: np.ndarray, d: int) -> np.ndarray:
    """Principal angles (degrees, ascending) between the spans of the first d rows of a and b."""
    from scipy.linalg import subspace_angles

    x, y = a[:d].T, b[:d].T
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return np.full(d, np.nan)
    return np.sort(np.degrees(subspace_angles(x, y)))


def coordinates(ds: xr.Dataset, pca: xr.Dataset, n_coords: int) -> xr.Dataset:
    """Lazy per-token coordinates on the top components: per step (`key_pc`) and joint basis (`key_pc_joint`)."""
    k = ds["k"].astype(np.float32)
    top = pca["components"].isel(component=slice(0, n_coords)).rename(component="pc").astype(np.float32)
    top_j = pca["components_joint"].isel(component=slice(0, n_coords)).rename(component="pc").astype(np.float32)
    pc = xr.dot(k - pca["mean"].astype(np.float32), top, dim="dk")
    pc_j = xr.dot(k - pca["mean_joint"].astype(np.float32), top_j, dim="dk")
    order = ("seq", "layer", "pos", "step", "head", "pc")
    pc = pc.transpose(*order).drop_vars([c for c in pc.coords if c not in order])
    pc_j = pc_j.transpose(*order).drop_vars([c for c in pc_j.coords if c not in order])
    return xr.Dataset({"key_pc": pc, "key_pc_joint": pc_j})


def records(out: xr.Dataset, report_components: int = 8) -> list[dict[str, Any]]:
    """One record per layer/head/step, then one per layer/head for all steps jointly (step=None, joint=True)."""
    recs = []
    evr, evr_j = out["explained_variance_ratio"].values, out["explained_variance_ratio_joint"].values
    n, angles = out["n_samples"].values, out["step_angles"].values
    method = out.attrs.get("method")
    for li, layer in enumerate(out["layer"].values):
        for h in out["head"].values:
            for s in out["step"].values:
                e = evr[li, s, h]
                rec = _evr_record(int(layer), int(h), int(s), e, report_components)
                rec.update({"n_samples": int(n[li, s, h]), "method": method})
                rec["principal_angles_deg"] = {f"step_{int(b)}": [float(x) for x in angles[li, h, s, b]]
                                               for b in out["step"].values if b != s}
                recs.append(rec)
            rec = _evr_record(int(layer), int(h), None, evr_j[li, h], report_components)
            rec.update({"n_samples": int(n[li, :, h].sum()), "method": method})
            recs.append(rec)
    return recs


def _evr_record(layer: int, head: int, step: int | None, e: np.ndarray, m: int) -> dict[str, Any]:
    cum = np.nancumsum(e)
    return {
        "layer": layer, "head": head, "step": step, "joint": step is None,
        "explained_variance_ratio": [float(x) for x in e[:m]],
        "explained_variance_3": float(cum[min(2, len(cum) - 1)]),
        "n_components_95": int(np.searchsorted(cum, 0.95 - 1e-9) + 1) if np.isfinite(e).any() else None,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--of", default="k", help="k (default) or kappa: rwkv7's removal keys (write them with "
                                              "--name keys-kappa to keep both)")
    p.add_argument("--coords", type=int, default=3, help="per-token coordinates on this many components (default 3)")
    p.add_argument("--subspace-dim", type=int, default=3,
                   help="dimension of the subspaces compared by principal angles")
    p.add_argument("--report-components", type=int, default=8, help="explained-variance ratios listed per record")
    p.add_argument("--incremental", action="store_true", help="use IncrementalPCA even when the keys fit in memory")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    return run(ds, n_coords=args.coords, subspace_dim=args.subspace_dim, budget=args.memory_budget,
               report_components=args.report_components, force_incremental=args.incremental, of=args.of)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.keys --store STORE [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
