"""Triton secular-equation solver: all eigenvalues of many D - rho w w^T at once (diagonal-plus-rank-one
transitions, `kernels.spectra.dplr`), float64 throughout, no per-channel Python loop.

The method is `kernels.spectra.dplr`'s (read its docstring): on D' = -D sorted ascending (torch.sort, batched),
1. `_deflate_kernel`, one program per matrix: tiny weights are dropped and near-equal kept neighbours merged by a
   Givens rotation, left to right, with LAPACK's tolerance 8 eps max(|d'|, rho ||z||^2). The sequential merge
   chain runs inside the program (a loop over the n channels on register vectors; the previous kept pole is
   carried as scalars), so it costs no launches and no [n, n] tensors.
2. `_roots_kernel`, one program per (matrix, block of BLOCK_R roots): every root's secular function, psi and phi
   and their derivatives are a [BLOCK_R, BLOCK_P] tile in registers (the poles streamed in chunks of BLOCK_P);
   each root starts at the middle of its bracket relative to its nearer pole and takes middle-way rational steps
   safeguarded by bisection, at most ITERATIONS steps, with a per-root convergence mask (a program stops when
   all its roots have converged).
The eigenvalues are then sorted (torch.sort). Only CUDA tensors run compiled; under TRITON_INTERPRET=1 the same
kernels run on CPU tensors (that is how the tests check them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltalab.kernels.constants import SECULAR_ITERATIONS as ITERATIONS
from deltalab.kernels.constants import SECULAR_PRECISIONS

EPS = float(torch.finfo(torch.float64).eps)
EPS32 = float(torch.finfo(torch.float32).eps)
BLOCK_R, BLOCK_P, NUM_WARPS, ONE_SUM = 8, 32, 2, True
"""Roots per program, poles per streamed chunk, warps and one cross-lane sum per evaluation of the float64 root
kernel: Hopper (`python -m benchmarks.spectra_dplr --dk 64 128 --sweep`, 262,144 matrices) 1.91e6 token-heads/s at
dk = 128 and 5.52e6 at dk = 64, against 1.05e6 / 3.78e6 for 16 roots, 4 warps and a sum per pole chunk (the
earlier default). A program iterates until its slowest root converges: on KDA-like inputs (dk = 64) a root takes
4.25 steps on average but a block of 16 roots 6.7, of 8 roots 6.1."""


@triton.jit
def _merge_chain(DP, Z, row, n, idx, dp, z, kept, rhohat, inv_norm, tol):
    """dlaed2's merge chain over one matrix's n channels (D' ascending), in dp's float type: tiny weights dropped,
    near-equal kept neighbours merged by a Givens rotation; returns the rotated poles, weights and kept mask. The
    previous kept pole (index, position, weight) is carried as scalars; pole j is read from the input, which no
    earlier step has changed (step j only writes positions <= j)."""
    prev = tl.full((), -1, tl.int32)
    dprev = tl.full((), 0.0, dp.dtype)
    zprev = tl.full((), 0.0, dp.dtype)
    for j in range(0, n):
        dj = tl.load(DP + row * n + j)
        zj0 = tl.load(Z + row * n + j)
        kj = rhohat * tl.abs(zj0) * inv_norm > tol
        zj = tl.where(kj, zj0, 0.0)
        tau = tl.sqrt(zprev * zprev + zj * zj)
        pos = tau > 0
        c = tl.where(pos, zj / tl.where(pos, tau, 1.0), 1.0)
        s = tl.where(pos, -zprev / tl.where(pos, tau, 1.0), 0.0)
        gap = dj - dprev
        merge = kj & (prev >= 0) & (tl.abs(gap * c * s) <= tol)
        new_prev = dprev * c * c + dj * s * s
        new_j = dprev * s * s + dj * c * c
        mi = merge.to(tl.int32)  # scalar & vector masks via integers (the interpreter cannot broadcast bools)
        at_p = ((idx == prev).to(tl.int32) * mi) != 0
        at_j = ((idx == j).to(tl.int32) * mi) != 0
        dp = tl.where(at_p, new_prev, tl.where(at_j, new_j, dp))
        z = tl.where(at_p, 0.0, tl.where(at_j, tau, z))
        kept = kept & (~at_p)
        prev = tl.where(kj, j, prev)
        dprev = tl.where(kj, tl.where(merge, new_j, dj), dprev)
        zprev = tl.where(kj, tl.where(merge, tau, zj), zprev)
    return dp, z, kept


@triton.jit
def _deflate_row(DP, Z, RHO, row, n, idx, m, EPS_C: tl.constexpr, FLOOR: tl.constexpr):
    """Matrix `row`'s deflation in its inputs' float type: weights below 8 eps scale dropped, then `_merge_chain`;
    returns the rotated poles, weights, kept mask and rho. FLOOR keeps 1 / ||z|| finite (tiny in the float type)."""
    dp = tl.load(DP + row * n + idx, mask=m, other=0.0)
    z = tl.load(Z + row * n + idx, mask=m, other=0.0)
    rho = tl.load(RHO + row)
    znorm2 = tl.sum(z * z, 0)
    rhohat = rho * znorm2
    scale = tl.maximum(tl.max(tl.abs(dp), 0), rhohat)
    tol = 8 * EPS_C * scale
    inv_norm = 1.0 / tl.sqrt(tl.maximum(znorm2, FLOOR))
    kept = m & (rhohat * tl.abs(z) * inv_norm > tol)  # rho ||z||^2 = 0 keeps nothing (tol >= 0)
    z = tl.where(kept, z, 0.0)
    dp, z, kept = _merge_chain(DP, Z, row, n, idx, dp, z, kept, rhohat, inv_norm, tol)
    return dp, z, kept, rho


@triton.jit
def _deflate_kernel(DP, Z, RHO, DPO, ZO, KEPT, n, BLOCK: tl.constexpr, EPS_C: tl.constexpr):
    """dlaed2-style deflation of D' + rho z z^T (D' ascending) for one matrix: rotated poles DPO, weights ZO and
    the kept mask KEPT (int8)."""
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    m = idx < n
    dp, z, kept, rho = _deflate_row(DP, Z, RHO, row, n, idx, m, EPS_C, 1e-300)
    tl.store(DPO + row * n + idx, dp, mask=m)
    tl.store(ZO + row * n + idx, z, mask=m)
    tl.store(KEPT + row * n + idx, kept.to(tl.int8), mask=m)


@triton.jit
def _secular(DP, Z, row, n, ir, origin, x, inv_rho, BLOCK_P: tl.constexpr, NP: tl.constexpr, F32: tl.constexpr,
             ONE_SUM: tl.constexpr):
    """1/rho + psi + phi at origin + x for each root, and psi', phi' (psi: poles at or below the root's own).
    F32: x and the sums in float32 (the pole offsets d'_j - origin still formed in float64, then rounded).
    ONE_SUM: the pole chunks add into [roots, BLOCK_P] tiles, reduced once at the end (4 cross-lane sums an
    evaluation instead of 4 per chunk); else each chunk is reduced as it comes."""
    psi = tl.zeros_like(x)
    phi = tl.zeros_like(x)
    dpsi = tl.zeros_like(x)
    dphi = tl.zeros_like(x)
    psi_t = tl.zeros([x.shape[0], BLOCK_P], dtype=x.dtype)  # ONE_SUM's tiles (dead code otherwise)
    phi_t = tl.zeros([x.shape[0], BLOCK_P], dtype=x.dtype)
    dpsi_t = tl.zeros([x.shape[0], BLOCK_P], dtype=x.dtype)
    dphi_t = tl.zeros([x.shape[0], BLOCK_P], dtype=x.dtype)
    for c in range(NP):  # not unrolled: the poles stream from L1 each step
        pj = c * BLOCK_P + tl.arange(0, BLOCK_P)
        mp = pj < n
        dpj = tl.load(DP + row * n + pj, mask=mp, other=0.0)
        zj = tl.load(Z + row * n + pj, mask=mp, other=0.0)
        if F32:
            den = (dpj[None, :] - origin[:, None]).to(tl.float32) - x[:, None]
            den = tl.where(den == 0, 1e-30, den)
            z2 = (zj * zj).to(tl.float32)
        else:
            den = (dpj[None, :] - origin[:, None]) - x[:, None]
            den = tl.where(den == 0, 1e-300, den)
            z2 = zj * zj
        r = 1.0 / den  # one division per (root, pole), the kernel's main cost
        t = z2[None, :] * r
        dt = t * r
        low = pj[None, :] <= ir[:, None]
        if ONE_SUM:
            psi_t += tl.where(low, t, 0.0)
            phi_t += tl.where(low, 0.0, t)
            dpsi_t += tl.where(low, dt, 0.0)
            dphi_t += tl.where(low, 0.0, dt)
        else:
            psi += tl.sum(tl.where(low, t, 0.0), 1)
            phi += tl.sum(tl.where(low, 0.0, t), 1)
            dpsi += tl.sum(tl.where(low, dt, 0.0), 1)
            dphi += tl.sum(tl.where(low, 0.0, dt), 1)
    if ONE_SUM:
        psi, phi = tl.sum(psi_t, 1), tl.sum(phi_t, 1)
        dpsi, dphi = tl.sum(dpsi_t, 1), tl.sum(dphi_t, 1)
    return inv_rho + psi + phi, dpsi, dphi


@triton.jit
def _step(DP, Z, row, n, ir, origin, x, lo, hi, d_lo, d_hi, active, inv_rho, count, eps,
          BLOCK_P: tl.constexpr, NP: tl.constexpr, F32: tl.constexpr, ONE_SUM: tl.constexpr):
    """One middle-way step of every active root, safeguarded by its bracket: (x, lo, hi, count, active).
    The last root (no pole above) needs no case of its own: its phi terms vanish and its d_hi is a virtual pole
    beyond its bracket, so the quadratic's roots are the one-pole step and a_hi > hi - x, and the smaller is taken as
    for the others (the old model put a_hi = 0 for the last root, whose quadratic has a spurious root 0, and an
    Hopper returned a root left at its start; kernels/NOTES.md)."""
    f, dpsi, dphi = _secular(DP, Z, row, n, ir, origin, x, inv_rho, BLOCK_P, NP, F32, ONE_SUM)
    on = active != 0
    lo = tl.where(on & (f < 0), x, lo)
    hi = tl.where(on & (f > 0), x, hi)
    a_lo = d_lo - x
    a_hi = d_hi - x
    s_lo = a_lo * a_lo * dpsi
    s_hi = a_hi * a_hi * dphi
    cc = f - a_lo * dpsi - a_hi * dphi
    qa = (a_lo + a_hi) * cc + s_lo + s_hi
    qb = a_lo * a_hi * cc + s_lo * a_hi + s_hi * a_lo
    disc = tl.sqrt(tl.maximum(qa * qa - 4 * cc * qb, 0.0))
    eta = 2 * qb / tl.where(qa >= 0, qa + disc, qa - disc)
    step = x + eta
    ok = (step == step) & (tl.abs(step) < float("inf")) & (step > lo) & (step < hi)
    x_new = tl.where(ok, step, (lo + hi) / 2)
    done = (f == 0) | (tl.abs(eta) <= 4 * eps * tl.abs(x)) | \
        (hi - lo <= 2 * eps * tl.maximum(tl.abs(lo), tl.abs(hi)))
    x = tl.where(on & (~done), x_new, x)
    count += active
    active = tl.where(done, 0, active)
    return x, lo, hi, count, active


@triton.jit
def _iterate(DP, Z, row, n, ir, origin, x, lo, hi, d_lo, d_hi, active, inv_rho, ITERS, eps,
             BLOCK_P: tl.constexpr, NP: tl.constexpr, F32: tl.constexpr, FOR_LOOP: tl.constexpr,
             ONE_SUM: tl.constexpr):
    """Middle-way steps safeguarded by the bracket (lo, hi) until each active root's step is below rounding
    (`eps`, in the working precision): the final x (relative to origin) and each root's number of evaluations.
    FOR_LOOP: a counted loop whose body is skipped once every root has converged, instead of a `while` on that
    test (the same steps; kept to check a GPU miscompile, kernels/NOTES.md).
    `active` is an int32 0/1 vector and every step ends at a barrier: added while a race was suspected for the
    wrong roots a Hopper GPU returned; the cause was FMA contraction (same rows every run; none with it off). Kept
    because the kernel was verified on the GPU in this form (kernels/NOTES.md)."""
    count = tl.zeros(x.shape, tl.int32)
    if FOR_LOOP:
        for _ in range(ITERS):
            if tl.max(active, 0) > 0:
                x, lo, hi, count, active = _step(DP, Z, row, n, ir, origin, x, lo, hi, d_lo, d_hi, active,
                                                 inv_rho, count, eps, BLOCK_P, NP, F32, ONE_SUM)
            tl.debug_barrier()
    else:
        it = 0
        while (it < ITERS) & (tl.max(active, 0) > 0):
            x, lo, hi, count, active = _step(DP, Z, row, n, ir, origin, x, lo, hi, d_lo, d_hi, active,
                                             inv_rho, count, eps, BLOCK_P, NP, F32, ONE_SUM)
            tl.debug_barrier()
            it += 1
    return x, count


@triton.jit
def _roots_kernel(DP, Z, KEPT, RHO, LAM, STEPS, n, ITERS, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                  NP: tl.constexpr, EPS_C: tl.constexpr, EPS32_C: tl.constexpr, GUESS: tl.constexpr,
                  MIXED: tl.constexpr, FOR_LOOP: tl.constexpr = False, ONE_SUM: tl.constexpr = False):
    """Eigenvalues of D' + rho z z^T (deflated, D' ascending) owned by poles BLOCK_R * pid(1) ...: the root in
    (d'_i, next kept pole) for a kept pole i, d'_i itself for a deflated one. STEPS [2, N, n] gets each root's
    number of float64 and float32 secular-function evaluations. GUESS: start from the root of the two-pole model
    at the midpoint (dlaed4's start), else the middle of the bracket. MIXED: float32 steps first, then float64."""
    row = tl.program_id(0).to(tl.int64)
    ir = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = ir < n
    pole = tl.load(DP + row * n + ir, mask=mr, other=0.0)
    kr = tl.load(KEPT + row * n + ir, mask=mr, other=0) != 0
    rho = tl.load(RHO + row)
    inv_rho = 1.0 / tl.maximum(rho, 1e-300)
    # next kept pole after each root's own, and rho ||z||^2 (the last root's bracket width)
    nxt = tl.full((BLOCK_R,), n, tl.int32)
    znorm2 = tl.full((), 0.0, tl.float64)
    for c in tl.static_range(NP):
        pj = c * BLOCK_P + tl.arange(0, BLOCK_P)
        mp = pj < n
        kj = tl.load(KEPT + row * n + pj, mask=mp, other=0) != 0
        zj = tl.load(Z + row * n + pj, mask=mp, other=0.0)
        znorm2 += tl.sum(zj * zj, 0)
        cand = tl.where(kj[None, :] & (pj[None, :] > ir[:, None]), pj[None, :], n)
        nxt = tl.minimum(nxt, tl.min(cand, 1))
    last = nxt >= n
    d_next = tl.load(DP + row * n + tl.minimum(nxt, n - 1), mask=mr, other=0.0)
    width = tl.where(last, rho * znorm2, d_next - pole)
    mid = width / 2
    f_mid, _, _ = _secular(DP, Z, row, n, ir, pole, mid, inv_rho, BLOCK_P, NP, False, ONE_SUM)
    from_lower = last | (f_mid >= 0)
    origin = tl.where(from_lower, pole, pole + width)
    zero = tl.zeros_like(pole)
    lo = tl.where(from_lower, zero, mid - width)
    hi = tl.where(from_lower, tl.where(last, width, mid), zero)
    d_lo = tl.where(from_lower, zero, -width)
    # the upper pole of each root's two-pole model; the last root has none, so a virtual one at twice its bracket
    # width: the model's root there lies outside the bracket, and no step, start or stop test needs a `last` case
    d_hi = tl.where(from_lower, tl.where(last, 2 * width, width), zero)
    x = (lo + hi) / 2
    if GUESS:
        # c + z_i^2 / (a - x) + z_next^2 / (b - x) = 0 with c the rest of f at the midpoint, a and b the two poles
        # relative to the origin (one of them 0): c x^2 - B x + C = 0; take the root inside the bracket
        z_own = tl.load(Z + row * n + ir, mask=mr, other=0.0)
        z_nxt = tl.load(Z + row * n + tl.minimum(nxt, n - 1), mask=mr & (~last), other=0.0)
        zi2, zn2 = z_own * z_own, z_nxt * z_nxt
        x_mid = tl.where(from_lower, mid, mid - width)
        cm = f_mid - zi2 / (d_lo - x_mid) - tl.where(last, 0.0, zn2 / (d_hi - x_mid))
        bq = cm * (d_lo + d_hi) + zi2 + zn2
        cq = zi2 * d_hi + zn2 * d_lo
        sq = bq + tl.where(bq >= 0, 1.0, -1.0) * tl.sqrt(tl.maximum(bq * bq - 4 * cm * cq, 0.0))
        x_small = 2 * cq / sq
        x_big = sq / (2 * cm)
        in_small = (x_small > lo) & (x_small < hi)
        in_big = (x_big > lo) & (x_big < hi)
        x = tl.where(in_small, x_small, tl.where(in_big, x_big, x))
    active = (kr & mr).to(tl.int32)
    count32 = tl.zeros((BLOCK_R,), tl.int32)
    if MIXED:
        # float32 steps first (cheaper divisions); their x only seeds the float64 steps, which keep the float64
        # bracket and stop test, so the result's accuracy is the float64 solver's
        x32, count32 = _iterate(DP, Z, row, n, ir, origin, x.to(tl.float32), lo.to(tl.float32), hi.to(tl.float32),
                              d_lo.to(tl.float32), d_hi.to(tl.float32), active, inv_rho.to(tl.float32),
                              ITERS, EPS32_C, BLOCK_P, NP, True, FOR_LOOP, ONE_SUM)
        x64 = x32.to(tl.float64)
        x = tl.where((x64 > lo) & (x64 < hi), x64, x)
    x, count64 = _iterate(DP, Z, row, n, ir, origin, x, lo, hi, d_lo, d_hi, active, inv_rho, ITERS, EPS_C,
                          BLOCK_P, NP, False, FOR_LOOP, ONE_SUM)
    tl.store(LAM + row * n + ir, tl.where(kr, origin + x, pole), mask=mr)
    tl.store(STEPS + row * n + ir, count64, mask=mr)
    tl.store(STEPS + (tl.num_programs(0) + row) * n + ir, count32, mask=mr)

# ---------------------------------------------------------------------------------------------------------------
# float32 path (`secular_eigvals(..., precision="float32")`): for transitions from bf16/fp16/fp32 models, whose
# inputs carry float32 precision at most. Every (root, pole) operation is float32; see `_roots32_kernel`.

LANES32 = 32
"""Roots in flight per float32 program (one lane each, LANES32 / 32 warps); a lane that finishes its root takes the
program's next one, so a program's cost is the largest per-lane sum of evaluations, not roots x slowest root."""


@triton.jit
def _deflate32_kernel(DP, Z, RHO, PK, LAM, NK, RW, n, BLOCK: tl.constexpr, EPS_C: tl.constexpr):
    """`_deflate_kernel` in float32 (tolerance 8 eps32 scale) that also compacts: kept (pole, squared weight) pairs
    to PK[:nk] ([N, n, 2], one 64-bit load a pole for the root kernel), deflated poles (their own eigenvalues) to
    LAM[nk:], nk to NK and rho ||z||^2 to RW, so the root kernel loops over kept poles only."""
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    m = idx < n
    dp, z, kept, rho = _deflate_row(DP, Z, RHO, row, n, idx, m, EPS_C, 1e-30)
    k32 = kept.to(tl.int32)
    pos = tl.cumsum(k32, 0) - 1  # rank among the kept poles (ascending, as D' is)
    nk = tl.sum(k32, 0)
    tl.store(PK + (row * n + pos) * 2, dp, mask=kept)
    tl.store(PK + (row * n + pos) * 2 + 1, z * z, mask=kept)
    tl.store(LAM + row * n + nk + idx - pos - 1, dp, mask=m & (k32 == 0))  # idx - pos - 1 deflated poles before idx
    tl.store(NK + row, nk)
    tl.store(RW + row, rho * tl.sum(z * z, 0))


@triton.jit
def _unpack32(v):
    """The (pole, squared weight) float32 pair packed in int64 `v` (little-endian: pole in the low half)."""
    return v.to(tl.int32).to(tl.float32, bitcast=True), (v >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _eval32(PK, base, nk, origin, x, ERR_STOP: tl.constexpr, FAST_RCP: tl.constexpr):
    """f - 1/rho, psi', phi' and sum |terms| (ERR_STOP, else 0) at origin + x for each lane's root, in float32:
    d'_q - origin first (exact for the near poles), then - x; one approximate reciprocal per (root, pole)
    (FAST_RCP: rcp.approx.ftz, one MUFU op; else an approximate division, what the interpreter runs). A pole
    belongs to psi (at or below the root's own) exactly when its denominator is negative, so no index test.
    No guard for a zero denominator: an inf or NaN f fails the step's bracket test, so that step bisects."""
    f = tl.zeros_like(x)
    dpsi = tl.zeros_like(x)
    dphi = tl.zeros_like(x)
    fabs = tl.zeros_like(x)
    for q in range(0, nk):  # one uniform 64-bit load a pole (every lane reads pole q), served by L1
        dq, wq = _unpack32(tl.load(PK + base + q))
        den = (dq - origin) - x
        if FAST_RCP:
            r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [den], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            r = tl.math.fdiv(1.0, den, approx=True)
        t = wq * r
        dt = t * r
        f += t
        if ERR_STOP:
            fabs += tl.abs(t)
        low = r < 0
        dpsi = tl.where(low, dpsi + dt, dpsi)
        dphi = tl.where(low, dphi, dphi + dt)
    return f, dpsi, dphi, fabs


@triton.jit
def _root32_data(PK, base, nk, rw, p, take):
    """Own pole, next kept pole, bracket width, squared weights of both and `last` for root p (lanes `take`)."""
    pole, zi2 = _unpack32(tl.load(PK + base + p, mask=take, other=0))
    has_next = take & (p + 1 < nk)
    d_next, zn2 = _unpack32(tl.load(PK + base + p + 1, mask=has_next, other=0))
    last = ~has_next
    width = tl.where(last, rw, d_next - pole)
    return pole, d_next, width, zi2, zn2, last


@triton.jit
def _roots32_kernel(PK, NK, RW, RHO, LAM, STEPS, n, ITERS, LANES: tl.constexpr, EPS_C: tl.constexpr,
                    GUESS: tl.constexpr, ERR_STOP: tl.constexpr = True, FAST_RCP: tl.constexpr = False):
    """Kept roots of D' + rho z z^T (compacted by `_deflate32_kernel`) in float32, one lane per root: root p of
    program (row, j) is p = j * LANES + lane, then + LANES * programs when it converges, so lanes stay busy until
    the program's roots run out. Each pass evaluates every lane's secular function once: a fresh root's at its
    bracket's middle (which picks its origin pole and dlaed4's two-pole start), then middle-way steps safeguarded
    by bisection (the float64 kernel's `_step`), stopped at |eta| <= 4 eps32 |x| or (ERR_STOP) at |f| <= 2 eps32
    (sum |terms| + 1/rho), f's rounding level (dlaed4's test; cuts the tail of 6-12-step roots). STEPS[0] gets
    each root's steps, STEPS[1][row, j] the program's passes."""
    row = tl.program_id(0).to(tl.int64)
    base = row * n
    nk = tl.load(NK + row)
    rw = tl.load(RW + row)
    inv_rho = 1.0 / tl.maximum(tl.load(RHO + row), 1e-30)
    stride = tl.num_programs(1) * LANES
    p = tl.program_id(1) * LANES + tl.arange(0, LANES)
    live = (p < nk).to(tl.int32)
    pole, d_next, width, zi2, zn2, last = _root32_data(PK, base, nk, rw, p, live != 0)
    origin = pole
    x = width / 2
    fresh = live  # 1: this pass evaluates f at the middle of the root's bracket (origin = own pole)
    zero = tl.zeros_like(x)
    lo, hi, d_lo, d_hi = zero, zero, zero, zero
    count = tl.zeros((LANES,), tl.int32)
    passes = 0
    while tl.max(live, 0) > 0:
        f, dpsi, dphi, fabs = _eval32(PK, base, nk, origin, x, ERR_STOP, FAST_RCP)
        f += inv_rho
        # fresh roots: the nearer pole becomes the origin (f at the middle decides), the bracket and the start
        mid = width / 2
        lower = last | (f >= 0)
        o_i = tl.where(lower, pole, d_next)  # the next pole itself, not pole + width (no rounding of the origin)
        lo_i = tl.where(lower, zero, mid - width)
        hi_i = tl.where(lower, tl.where(last, width, mid), zero)
        dlo_i = tl.where(lower, zero, -width)
        dhi_i = tl.where(lower, tl.where(last, 2 * width, width), zero)  # last root: a virtual pole (see `_step`)
        x_i = (lo_i + hi_i) / 2
        if GUESS:  # the two-pole model through f at the middle, as `_roots_kernel`
            x_mid = tl.where(lower, mid, mid - width)
            cm = f - zi2 / (dlo_i - x_mid) - tl.where(last, 0.0, zn2 / (dhi_i - x_mid))
            bq = cm * (dlo_i + dhi_i) + zi2 + zn2
            cq = zi2 * dhi_i + zn2 * dlo_i
            sq = bq + tl.where(bq >= 0, 1.0, -1.0) * tl.sqrt(tl.maximum(bq * bq - 4 * cm * cq, 0.0))
            x_small = 2 * cq / sq
            x_big = sq / (2 * cm)
            in_small = (x_small > lo_i) & (x_small < hi_i)
            in_big = (x_big > lo_i) & (x_big < hi_i)
            x_i = tl.where(in_small, x_small, tl.where(in_big, x_big, x_i))
        # stepping roots: one middle-way step safeguarded by the bracket
        lo_s = tl.where(f < 0, x, lo)
        hi_s = tl.where(f > 0, x, hi)
        a_lo = d_lo - x
        a_hi = d_hi - x
        s_lo = a_lo * a_lo * dpsi
        s_hi = a_hi * a_hi * dphi
        cc = f - a_lo * dpsi - a_hi * dphi
        qa = (a_lo + a_hi) * cc + s_lo + s_hi
        qb = a_lo * a_hi * cc + s_lo * a_hi + s_hi * a_lo
        disc = tl.sqrt(tl.maximum(qa * qa - 4 * cc * qb, 0.0))
        eta = 2 * qb / tl.where(qa >= 0, qa + disc, qa - disc)
        step = x + eta
        ok = (step == step) & (tl.abs(step) < float("inf")) & (step > lo_s) & (step < hi_s)
        conv = (f == 0) | (tl.abs(eta) <= 4 * EPS_C * tl.abs(x)) | \
            (hi_s - lo_s <= 2 * EPS_C * tl.maximum(tl.abs(lo_s), tl.abs(hi_s)))
        if ERR_STOP:
            conv = conv | (tl.abs(f) <= 2 * EPS_C * (fabs + inv_rho))
        x_s = tl.where(conv, x, tl.where(ok, step, (lo_s + hi_s) / 2))
        count = count + 1 - fresh
        st = live * (1 - fresh)
        done = (st * ((conv | (count >= ITERS)).to(tl.int32))) != 0
        tl.store(LAM + base + p, origin + x_s, mask=done)
        tl.store(STEPS + base + p, count, mask=done)
        nf = fresh != 0
        origin = tl.where(nf, o_i, origin)
        x = tl.where(nf, x_i, x_s)
        lo = tl.where(nf, lo_i, lo_s)
        hi = tl.where(nf, hi_i, hi_s)
        d_lo = tl.where(nf, dlo_i, d_lo)
        d_hi = tl.where(nf, dhi_i, d_hi)
        # converged lanes take their next root
        p = tl.where(done, p + stride, p)
        take = done & (p < nk)
        live = tl.where(done, take.to(tl.int32), live)
        fresh = take.to(tl.int32)
        count = tl.where(done, 0, count)
        pole_n, dnext_n, width_n, zi2_n, zn2_n, last_n = _root32_data(PK, base, nk, rw, p, take)
        pole = tl.where(take, pole_n, pole)
        d_next = tl.where(take, dnext_n, d_next)
        width = tl.where(take, width_n, width)
        zi2 = tl.where(take, zi2_n, zi2)
        zn2 = tl.where(take, zn2_n, zn2)
        last = tl.where(take, last_n, last)
        origin = tl.where(take, pole, origin)
        x = tl.where(take, width / 2, x)
        passes += 1
    tl.store(STEPS + (tl.num_programs(0) + row) * n + tl.program_id(1), passes)


def _secular_eigvals32(d: torch.Tensor, w: torch.Tensor, rho: torch.Tensor, lanes: int, programs: int,
                       guess: bool, steps: list[torch.Tensor] | None, fp_fusion: bool, err_stop: bool,
                       fast_rcp: bool | None) -> torch.Tensor:
    """`secular_eigvals(precision="float32")`: float32 sort, deflation and roots (see `_roots32_kernel`)."""
    d, w, rho = d.float(), w.float(), rho.float().contiguous()
    N, n = d.shape
    dp, order = torch.sort(-d, dim=-1)
    z = torch.gather(w, 1, order).contiguous()
    dp = dp.contiguous()
    packed = torch.empty(N, n, 2, dtype=torch.float32, device=d.device)  # kept (pole, weight^2) pairs
    lam = torch.empty_like(dp)
    nk = torch.empty(N, dtype=torch.int32, device=d.device)
    rw = torch.empty(N, dtype=torch.float32, device=d.device)
    fusion = {"enable_fp_fusion": fp_fusion}
    _deflate32_kernel[(N,)](dp, z, rho, packed, lam, nk, rw, n, BLOCK=triton.next_power_of_2(n), EPS_C=EPS32,
                            num_warps=1, **fusion)
    programs = max(1, min(programs, triton.cdiv(n, lanes)))
    its = torch.zeros(2, N, n, dtype=torch.int32, device=d.device)
    fast = d.is_cuda and torch.version.hip is None if fast_rcp is None else fast_rcp
    _roots32_kernel[(N, programs)](packed.view(torch.int64), nk, rw, rho, lam, its, n, ITERATIONS, LANES=lanes,
                                   EPS_C=EPS32, GUESS=guess, ERR_STOP=err_stop, FAST_RCP=fast,
                                   num_warps=max(1, lanes // 32), **fusion)
    if steps is not None:
        steps.append(its)
    return torch.sort(-lam, dim=-1).values

def secular_eigvals(d: torch.Tensor, w: torch.Tensor, rho: torch.Tensor, *, block_r: int = BLOCK_R,
                    block_p: int = BLOCK_P, num_warps: int = NUM_WARPS, guess: bool = True, mixed: bool = False,
                    steps: list[torch.Tensor] | None = None, for_loop: bool = False,
                    fp_fusion: bool = False, one_sum: bool = ONE_SUM, precision: str = "float64",
                    lanes: int = LANES32, programs: int = 1, err_stop: bool = True,
                    fast_rcp: bool | None = None) -> torch.Tensor:
    """Ascending eigenvalues of D - rho w w^T for [N, n] float64 d, w and [N] float64 rho >= 0, on the device of
    the inputs (CUDA, or CPU under TRITON_INTERPRET=1). `guess`: start each root from the two-pole model (else
    the bracket's middle); `mixed`: float32 steps seed the float64 ones (same accuracy, fewer
    float64 divisions); `steps`, if given, receives the [2, N, n] float64 and float32
    step counts (for benchmarks); `for_loop`: iterate in a counted loop instead of a `while` (same steps);
    `fp_fusion`: let the compiler contract multiply-adds into FMAs. Off by default: with FMAs two Hopper GPUs
    returned wrong roots for about 1 matrix in 2,000 (the same ones every run), without them none (kernels/NOTES.md).
    `one_sum`: each evaluation's pole chunks add into [roots, poles] tiles reduced once instead of one cross-lane
    sum per chunk (the same roots up to the order of the additions; the default, see ONE_SUM).
    `precision="float32"`: everything in float32 (inputs float32 or float64, rounded; float32 result, accurate to
    a few eps32 of the spectral scale, for transitions of bf16/fp16/fp32 models): `lanes` roots in flight per
    program, `programs` programs per matrix, `err_stop` also stops a root once |f| is at its rounding level,
    `fast_rcp` (default: on CUDA) one rcp.approx.ftz per (root, pole); `block_r`, `block_p`, `num_warps`, `mixed`,
    `for_loop` and `one_sum` are float64 choices and are ignored there."""
    if precision not in SECULAR_PRECISIONS:
        raise ValueError(f"secular_eigvals: precision {precision!r} must be 'float64' or 'float32'")
    if precision == "float32":
        if any(t.dtype not in (torch.float32, torch.float64) for t in (d, w, rho)):
            raise ValueError("secular_eigvals: d, w and rho must be float32 or float64")
        if d.ndim != 2 or w.shape != d.shape or rho.shape != d.shape[:1]:
            raise ValueError(f"secular_eigvals: d {tuple(d.shape)} and w {tuple(w.shape)} must be [N, n] and rho "
                             f"{tuple(rho.shape)} [N]")
        if d.shape[0] == 0 or d.shape[1] == 0:
            return d.float().clone()
        return _secular_eigvals32(d, w, rho, lanes, programs, guess, steps, fp_fusion, err_stop, fast_rcp)
    if d.dtype != torch.float64 or w.dtype != torch.float64 or rho.dtype != torch.float64:
        raise ValueError("secular_eigvals: d, w and rho must be float64 (convert with .double())")
    if d.ndim != 2 or w.shape != d.shape or rho.shape != d.shape[:1]:
        raise ValueError(f"secular_eigvals: d {tuple(d.shape)} and w {tuple(w.shape)} must be [N, n] and rho "
                         f"{tuple(rho.shape)} [N]")
    N, n = d.shape
    if N == 0 or n == 0:
        return d.clone()
    dp, order = torch.sort(-d, dim=-1)  # D' = -D ascending
    z = torch.gather(w, 1, order).contiguous()
    dp, rho = dp.contiguous(), rho.contiguous()
    dpo, zo = torch.empty_like(dp), torch.empty_like(z)
    kept = torch.empty(N, n, dtype=torch.int8, device=d.device)
    block = triton.next_power_of_2(n)
    fusion = {"enable_fp_fusion": fp_fusion}
    _deflate_kernel[(N,)](dp, z, rho, dpo, zo, kept, n, BLOCK=block, EPS_C=EPS, num_warps=1, **fusion)
    br, bp = min(block, block_r), min(block, block_p)
    lam = torch.empty_like(dp)
    its = torch.empty(2, N, n, dtype=torch.int32, device=d.device)
    _roots_kernel[(N, triton.cdiv(n, br))](dpo, zo, kept, rho, lam, its, n, ITERATIONS, BLOCK_R=br, BLOCK_P=bp,
                           NP=triton.cdiv(n, bp), EPS_C=EPS, EPS32_C=EPS32, GUESS=guess, MIXED=mixed,
                           FOR_LOOP=for_loop, ONE_SUM=one_sum, num_warps=num_warps, **fusion)
    if steps is not None:
        steps.append(its)
    return torch.sort(-lam, dim=-1).values
