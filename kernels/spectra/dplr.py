"""Exact eigenvalues of diagonal-plus-rank-one transitions (Kimi Delta Attention, RWKV-7), by the secular equation.

A per-channel-gated token transition is M = (I - b k k^T) D with D = diag(d), d = exp(g) > 0. It is similar to
the symmetric D^{1/2} M D^{-1/2} = D - b w w^T with w = D^{1/2} k, so its eigenvalues are real, interlace the d_i
(each lies between consecutive d's, the smallest may drop below min d, and below 0 when b > 1), and are the
roots of the secular equation 1 - b sum_i d_i k_i^2 / (d_i - lambda) = 0, plus every d_i whose w_i vanishes.
The generalised delta rule's M = D + b a^T (RWKV-7: a = -kappa, b = kappa * a_rwkv) has the spectrum of the
symmetric D - z z^T, z_i^2 = -a_i b_i, whenever every a_i b_i <= 0 (`dplr_eigvals_general`).

The solver works on -(D - b w w^T) = D' + b w w^T (D' = -D, a positive rank-one update as in LAPACK's dlaed4):
1. sort D' ascending; deflate tiny w_i (d_i is an eigenvalue) and near-equal pairs (a Givens rotation moves all
   weight onto one of them, the other becomes an eigenvalue), with LAPACK's tolerance 8 eps max(|d|, b ||w||^2);
2. every remaining pole d'_i owns one root in (d'_i, d'_next) (the last in (d'_n, d'_n + b ||w||^2)); its origin is
   the nearer pole (f at the midpoint decides), and all arithmetic is relative to it, so roots near a pole keep
   their digits;
3. each root takes up to ITERATIONS steps of the middle-way rational step (Li's fixed-weight model of f by its two
   nearest poles), safeguarded by a bisection bracket: a step that leaves the bracket bisects instead.
Everything is batched over token-heads in float64: in torch here (the CPU path), and on CUDA by the Triton kernels
of `kernels.linalg.triton_secular` (same steps, each matrix's poles and roots in registers). O(n) work per root, O(n^2)
per matrix.
The dense reference is `kernels.spectra.naive.dplr_eigvals_dense`.
"""

from __future__ import annotations

import os
import warnings

import torch

from deltalab.kernels.constants import SECULAR_ITERATIONS, SECULAR_PRECISIONS

TRITON_ENV = "DELTALAB_SECULAR"
""""auto" runs the Triton solver on CUDA tensors (checked on a Hopper GPU: 262,144 random matrices per dk, errors
<= 4.1e-15; 3.8e6 token-heads/s at dk = 64, 1.1e6 at dk = 128, 37-87x the torch solver); `DELTALAB_SECULAR=torch`
makes "auto" use the torch solver there too."""

ITERATIONS = SECULAR_ITERATIONS
"""Safeguarded steps per root at most; a block stops once every root's step is below rounding. The rational
steps converge quadratically (5 to 10 steps on random inputs); a root whose steps keep leaving its bracket
falls back to bisection, and 64 halvings pin any root to the last bit, so the bound is a guarantee."""


def dplr_eigvals(d: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, block: int | None = None,
                 method: str = "auto", precision: str = "float64") -> torch.Tensor:
    """Eigenvalues (ascending, float64) of (I - beta k k^T) diag(d) for d, k [..., n] and beta [...].

    `d` are the per-channel decays exp(g) (positive); `k` need not be normalised. `method`: "auto" runs the
    Triton solver (`kernels.linalg.triton_secular`) on CUDA tensors (unless DELTALAB_SECULAR=torch), else the torch one;
    "torch" and "triton" force one (Triton on CPU tensors needs TRITON_INTERPRET=1). The torch solver works in
    blocks of `block` matrices (memory O(block n^2)); the Triton one needs O(n) memory per matrix, no `block`.
    `precision="float32"` (for transitions of bf16/fp16/fp32 models): inputs rounded to float32 and, with the Triton
    solver, everything in float32 (float32 eigenvalues within a few eps32 of the spectral scale; the torch solver
    stays float64 and its result is rounded).
    """
    if d.shape != k.shape or beta.shape != d.shape[:-1]:
        raise ValueError(f"dplr_eigvals: d {tuple(d.shape)} and k {tuple(k.shape)} must match and beta "
                         f"{tuple(beta.shape)} must be their leading dims")
    if bool((d <= 0).any()):
        raise ValueError("dplr_eigvals: decays d must be positive (d = exp(g))")
    if precision not in SECULAR_PRECISIONS:
        raise ValueError(f"dplr_eigvals: precision {precision!r} must be one of {', '.join(SECULAR_PRECISIONS)}")
    lead, n = d.shape[:-1], d.shape[-1]
    dt = torch.float64 if precision == "float64" else torch.float32
    d2, k2, b2 = d.reshape(-1, n).to(dt), k.reshape(-1, n).to(dt), beta.reshape(-1).to(dt)
    return _blocked(d2, d2.sqrt() * k2, b2.clamp(min=0.0), block, method).reshape(*lead, n)


def dplr_eigvals_general(d: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int | None = None,
                         method: str = "auto") -> torch.Tensor:
    """Eigenvalues of the generalised-delta-rule transition diag(d) + b a^T for d, a, b [..., n] (RWKV-7:
    d = e^g, a = -kappa, b = kappa * a_rwkv).

    Its characteristic polynomial prod_i (lambda - d_i) (1 - sum_i a_i b_i / (lambda - d_i)) depends on the
    products a_i b_i only, so where every a_i b_i <= 0 (always for RWKV-7: a_i b_i = -kappa_i^2 a_rwkv_i) the
    spectrum is that of the symmetric diag(d) - z z^T with z_i^2 = -a_i b_i: real, interlacing d, and solved
    exactly by the secular equation (float64, ascending). Otherwise (some a_i b_i > 0, complex pairs possible)
    every matrix takes a dense float64 `torch.linalg.eigvals` after one warning, and the result is complex128
    sorted by real then imaginary part (the symmetric-reducible matrices of that batch have zero imaginary parts).
    `block` and `method` as in `dplr_eigvals`.
    """
    if a.shape != d.shape or b.shape != d.shape:
        raise ValueError(f"dplr_eigvals_general: d {tuple(d.shape)}, a {tuple(a.shape)} and b {tuple(b.shape)} "
                         "must have one shape [..., n]")
    lead, n = d.shape[:-1], d.shape[-1]
    d2, p2 = d.reshape(-1, n).double(), (a.double() * b.double()).reshape(-1, n)
    if not bool(torch.isfinite(d2).all()):
        raise ValueError("dplr_eigvals_general: decays d must be finite (d = exp(g))")
    if bool((p2 <= 0).all()):
        return _blocked(d2, (-p2).sqrt(), torch.ones_like(d2[:, 0]), block, method).reshape(*lead, n)
    warnings.warn("dplr_eigvals_general: some a_i b_i > 0 (not RWKV-7's sign pattern), so the spectrum may be "
                  "complex; using dense float64 eigvals", stacklevel=2)
    m = torch.diag_embed(d.double()) + b.double()[..., :, None] * a.double()[..., None, :]
    eig = torch.linalg.eigvals(m)
    eig = torch.complex(eig.real, torch.where(eig.imag == 0, torch.zeros_like(eig.imag), eig.imag))
    eig = eig.gather(-1, eig.imag.argsort(dim=-1, stable=True))
    return eig.gather(-1, eig.real.argsort(dim=-1, stable=True))


def _blocked(d: torch.Tensor, w: torch.Tensor, rho: torch.Tensor, block: int | None,
             method: str = "torch") -> torch.Tensor:
    """Ascending eigenvalues of D - rho w w^T for [N, n] float64 (or float32: the float32 path) d, w and [N]
    rho >= 0: the Triton solver for `method` "triton" (or "auto" on CUDA unless DELTALAB_SECULAR=torch),
    else the torch one `block` matrices at a time (memory O(block n^2))."""
    if method not in ("auto", "torch", "triton"):
        raise ValueError(f"dplr_eigvals: method {method!r} must be 'auto', 'torch' or 'triton'")
    if method == "triton" or (method == "auto" and d.is_cuda and os.environ.get(TRITON_ENV) != "torch"):
        from deltalab.kernels.linalg.triton_secular import (
            secular_eigvals,  # imports triton; the CPU path does not need it
        )

        precision = "float32" if d.dtype == torch.float32 else "float64"
        lam = secular_eigvals(d.contiguous(), w.contiguous(), rho.contiguous(), precision=precision)
        return _trace_checked(lam, d, w, rho)
    if d.dtype != torch.float64:
        return _blocked(d.double(), w.double(), rho.double(), block, method).to(d.dtype)
    block = block or (4096 if d.is_cuda else 128)
    out = torch.empty_like(d)
    for lo in range(0, d.shape[0], block):
        hi = min(lo + block, d.shape[0])
        out[lo:hi] = _solve(d[lo:hi], w[lo:hi], rho[lo:hi])
    return out


TRACE_TOL = 16
"""A matrix's eigenvalues must sum to its trace within TRACE_TOL * n * eps * (max |d| + rho ||w||^2), eps of the
solver's precision (float32: 2.4e-4 of the scale at n = 128, while a float32 root is off by a few eps32 at most):
a check that costs O(n) per matrix and catches any grossly wrong root (such as the one a Hopper GPU returned once)."""


def _trace_checked(lam: torch.Tensor, d: torch.Tensor, w: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """`lam` (the Triton solver's), with the matrices whose eigenvalues miss the trace re-solved by the torch
    solver, after one warning that counts them (a compiler or hardware fault, worth reporting)."""
    w2 = rho * (w * w).sum(-1)
    scale = d.abs().amax(-1) + w2
    bad = (lam.sum(-1) - (d.sum(-1) - w2)).abs() > TRACE_TOL * d.shape[-1] * torch.finfo(d.dtype).eps * scale
    bad |= ~torch.isfinite(lam).all(-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten()
        warnings.warn(f"dplr_eigvals: the Triton secular solver's eigenvalues of {rows.numel()} of {d.shape[0]} "
                      "matrices missed their trace; re-solved them with the torch solver", stacklevel=3)
        lam = lam.clone()
        lam[rows] = _solve(d[rows].double(), w[rows].double(), rho[rows].double()).to(lam.dtype)
    return lam


def _solve(d: torch.Tensor, w: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """[N, n] ascending eigenvalues of D - rho w w^T."""
    dp, order = torch.sort(-d, dim=-1)  # D' ascending
    z = torch.gather(w, 1, order)
    dp, z, kept = _deflate(dp, z, rho)
    lam = dp.clone()  # deflated entries are their own eigenvalues (of D' + rho z z^T)
    if bool(kept.any()):
        roots = _secular_roots(dp, z, rho, kept)
        lam = torch.where(kept, roots, lam)
    return torch.sort(-lam, dim=-1).values


def _deflate(dp: torch.Tensor, z: torch.Tensor, rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LAPACK-style deflation (dlaed2) of D' + rho z z^T with D' sorted ascending: (d', z', kept mask)."""
    eps = torch.finfo(torch.float64).eps
    znorm2 = (z * z).sum(-1)
    scale = torch.maximum(dp.abs().amax(-1), rho * znorm2)
    tol = (8 * eps * scale)[:, None]
    zhat = z / znorm2.clamp(min=1e-300).sqrt()[:, None]
    rhohat = (rho * znorm2)[:, None]
    kept = (rhohat * zhat.abs() > tol) & (rhohat > 0)
    dp, z = dp.clone(), torch.where(kept, z, torch.zeros_like(z))
    rows = torch.arange(dp.shape[0], device=dp.device)
    prev = torch.full((dp.shape[0],), -1, dtype=torch.long, device=dp.device)
    for j in range(dp.shape[1]):  # merge near-equal neighbours among the kept poles, left to right
        has_prev = prev >= 0
        p = prev.clamp(min=0)
        zp, zj = z[rows, p], z[:, j]
        tau = torch.hypot(zp, zj)
        c = torch.where(tau > 0, zj / tau.clamp(min=1e-300), torch.ones_like(tau))
        s = torch.where(tau > 0, -zp / tau.clamp(min=1e-300), torch.zeros_like(tau))
        gap = dp[:, j] - dp[rows, p]
        merge = kept[:, j] & has_prev & ((gap * c * s).abs() <= tol[:, 0])
        if bool(merge.any()):
            dprev, dj = dp[rows, p], dp[:, j]
            new_prev = dprev * c * c + dj * s * s
            new_j = dprev * s * s + dj * c * c
            m = merge.nonzero().flatten()
            dp[m, p[m]], dp[m, j] = new_prev[m], new_j[m]
            z[m, p[m]], z[m, j] = 0.0, tau[m]
            kept[m, p[m]] = False
        prev = torch.where(kept[:, j], torch.full_like(prev, j), prev)
    return dp, z, kept


def _secular_roots(dp: torch.Tensor, z: torch.Tensor, rho: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Root of 1/rho + sum_j z_j^2 / (d'_j - x) = 0 owned by every kept pole i (in (d'_i, next kept pole)).

    Works on the flat list of kept roots, and each step only on the roots not yet converged, so the cost is
    O(n) per active root and step.
    """
    N, n = dp.shape
    eps = torch.finfo(torch.float64).eps
    idx = torch.arange(n, device=dp.device).expand(N, n)
    pos = torch.where(kept, idx, torch.full_like(idx, n))  # next kept pole after i: reverse cumulative min
    nxt = torch.flip(torch.cummin(torch.flip(pos, [1]), 1).values, [1])
    nxt = torch.cat([nxt[:, 1:], torch.full((N, 1), n, device=dp.device, dtype=nxt.dtype)], 1)
    z2 = z * z
    mi, ri = kept.nonzero(as_tuple=True)  # one entry per root: its matrix and its own pole
    last = nxt[mi, ri] >= n
    pole = dp[mi, ri]
    width = torch.where(last, rho[mi] * z2[mi].sum(-1), dp[mi, nxt[mi, ri].clamp(max=n - 1)] - pole)
    inv_rho = 1.0 / rho[mi].clamp(min=1e-300)
    lower = torch.arange(n, device=dp.device)[None, :] <= ri[:, None]  # [R, n]: poles at or below the own pole

    def f_at(sel: torch.Tensor, x: torch.Tensor, origin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        den = (dp[mi[sel]] - origin[:, None]) - x[:, None]  # pole positions relative to the origin, minus x
        den = torch.where(den == 0, torch.full_like(den, 1e-300), den)
        terms = z2[mi[sel]] / den
        low = lower[sel]
        psi, phi = torch.where(low, terms, 0.0).sum(-1), torch.where(low, 0.0, terms).sum(-1)
        dterms = terms / den
        dpsi, dphi = torch.where(low, dterms, 0.0).sum(-1), torch.where(low, 0.0, dterms).sum(-1)
        return inv_rho[sel] + psi + phi, dpsi, dphi

    everything = torch.arange(mi.numel(), device=dp.device)
    mid = width / 2
    from_lower = last | (f_at(everything, mid, pole)[0] >= 0)  # f rises from -inf at the pole to +inf at the next
    origin = torch.where(from_lower, pole, pole + width)
    # bracket of x = root - origin: (0, mid] from the lower pole ((0, width] for the last root), [mid - width, 0)
    # from the upper one; the two nearest poles sit at d_lo and d_hi relative to the origin
    lo = torch.where(from_lower, torch.zeros_like(pole), mid - width)
    hi = torch.where(from_lower, torch.where(last, width, mid), torch.zeros_like(pole))
    d_lo = torch.where(from_lower, torch.zeros_like(pole), -width)
    d_hi = torch.where(from_lower, width, torch.zeros_like(pole))
    x = (lo + hi) / 2
    active = everything
    for _ in range(ITERATIONS):
        if active.numel() == 0:
            break
        xa, la, ha, last_a = x[active], lo[active], hi[active], last[active]
        f, dpsi, dphi = f_at(active, xa, origin[active])
        la, ha = torch.where(f < 0, xa, la), torch.where(f > 0, xa, ha)
        a_lo = d_lo[active] - xa  # distance to the own pole (< 0) and to the next one (> 0, none for the last)
        a_hi = torch.where(last_a, torch.zeros_like(xa), d_hi[active] - xa)
        s_lo, s_hi = a_lo * a_lo * dpsi, a_hi * a_hi * dphi
        c = f - a_lo * dpsi - a_hi * dphi
        # middle way: c + s_lo / (a_lo - eta) + s_hi / (a_hi - eta) = 0, the root of c e^2 - qa e + qb nearer 0;
        # the last root has no upper pole: c + s_lo / (a_lo - eta) = 0
        qa = (a_lo + a_hi) * c + s_lo + s_hi
        qb = a_lo * a_hi * c + s_lo * a_hi + s_hi * a_lo
        disc = (qa * qa - 4 * c * qb).clamp(min=0).sqrt()
        eta_two = 2 * qb / torch.where(qa >= 0, qa + disc, qa - disc)
        eta_one = a_lo + s_lo / c
        eta = torch.where(last_a, eta_one, eta_two)
        step = xa + eta
        ok = torch.isfinite(step) & (step > la) & (step < ha)
        x_new = torch.where(ok, step, (la + ha) / 2)
        done = (f == 0) | (eta.abs() <= 4 * eps * xa.abs()) | (ha - la <= 2 * eps * torch.maximum(la.abs(), ha.abs()))
        x[active] = torch.where(done, xa, x_new)
        lo[active], hi[active] = la, ha
        active = active[~done]
    roots = torch.zeros_like(dp)
    roots[mi, ri] = origin + x
    return roots
