"""Findings for the Overview: on each probe that has run, the head that stands out and the number that makes it
stand out, with the page that shows it. Pure functions of the probe results (no Streamlit)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Finding:
    probe: str
    page: str
    layer: int
    head: int
    text: str


def _arg(values: np.ndarray, largest: bool = True) -> tuple[int, int] | None:
    """(layer index, head) of the largest (or smallest) finite value of values [L, H]."""
    v = np.where(np.isfinite(values), values, -np.inf if largest else np.inf)
    if not np.isfinite(v).any():
        return None
    i = int(np.argmax(v) if largest else np.argmin(v))
    return divmod(i, values.shape[1])


def findings(results: dict[str, object]) -> list[Finding]:
    """The standout heads of the betas, spectra and erank results present in `results` (probe -> xr.Dataset)."""
    out: list[Finding] = []
    res = results.get("betas")
    if res is not None and "frac_negative_head" in res:
        frac = np.asarray(res["frac_negative_head"].values, dtype=np.float64)
        at = _arg(frac)
        if at is not None:
            layer = int(res["layer"].values[at[0]])
            mean = np.asarray(res["beta_mean"].values)[at[0], :, at[1]] if "beta_mean" in res else None
            extra = "" if mean is None else f", mean β per step {', '.join(f'{b:.2f}' for b in mean)}"
            out.append(Finding("betas", "Betas", layer, at[1],
                               f"{frac[at]:.0%} of its sub-steps have β > 1 (negative eigenvalue){extra}"))
    res = results.get("spectra")
    if res is not None and "frac_rotation" in res and int(res.sizes.get("step", 2)) > 1:
        rot = np.asarray(res["frac_rotation"].values, dtype=np.float64)
        at = _arg(rot)
        if at is not None and rot[at] > 0:
            out.append(Finding("spectra", "Spectra", int(res["layer"].values[at[0]]), at[1],
                               f"{rot[at]:.0%} of its tokens' transitions are rotations"))
    res = results.get("erank")
    if res is not None and "erank_mean" in res:
        er = np.asarray(res["erank_mean"].values, dtype=np.float64)
        at = _arg(er, largest=False)
        if at is not None:
            out.append(Finding("erank", "Effective rank", int(res["layer"].values[at[0]]), at[1],
                               f"the lowest mean effective rank of its state, {er[at]:.2f} "
                               f"(median over heads {np.nanmedian(er):.2f})"))
    return out
