"""Eigenvalues of many small real general matrices (n <= 32) in one Triton kernel, one matrix per program.

Window spectra (`kernels.spectra.householder`, n = w * n_h factors, e.g. 12) have no closed form, and
torch.linalg.eigvals on CUDA hands its work to the CPU. `householder_eigvals` builds, per window, the
n x n matrix Z = I - R M R^T from the keys (LQ by Householder, K^T = Q R; M the compact-WY factor), which
is orthogonal whenever the product is, and then applies the textbook method, in float64 registers:
Householder reduction to upper Hessenberg form and the Francis double-shift QR iteration with deflation
by small subdiagonals (Golub & Van Loan, Algorithms 7.4.2 and 7.5.2; LAPACK dlahqr's exceptional shifts
every 10 iterations). A subdiagonal deflates when it is below eps times its two diagonal neighbours, or
below n eps ||Z||_F: clusters of equal eigenvalues (dependent keys give many 1s) otherwise stall at the
rounding-noise level. Backward stable: each eigenvalue is off by about eps ||Z|| times its condition
number. A matrix that has not converged after 30 n sweeps is flagged and re-solved on the CPU.
`triton_eigvals` exposes the same solver for any square matrices; the reference is torch.linalg.eigvals.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

MAX_N = 32
EPS = tl.constexpr(2.220446049250313e-16)  # float64 machine epsilon (a constexpr: kernels read no other globals)


@triton.jit
def _reflect(H, v, rows, cols):
    """Similarity H <- P H P with P = I - 2 v v^T / (v^T v) (identity when v = 0)."""
    vv = tl.sum(v * v, axis=0)
    tau = tl.where(vv > 0, 2.0 / tl.where(vv > 0, vv, 1.0), 0.0)
    w = tl.sum(v[:, None] * H, axis=0)  # v^T H, indexed by column
    H = H - (tau * v)[:, None] * w[None, :]
    z = tl.sum(H * v[None, :], axis=1)  # H v, indexed by row
    H = H - (tau * z)[:, None] * v[None, :]
    return H


@triton.jit
def _house(x, r, k):
    """Householder vector that maps x (zero outside rows k..) onto a multiple of e_k."""
    xk = tl.sum(tl.where(r == k, x, 0.0), axis=0)
    nx = tl.sqrt(tl.sum(x * x, axis=0))
    alpha = tl.where(xk >= 0, -nx, nx)
    return x - tl.where(r == k, alpha, 0.0)


@triton.jit
def _col(H, j, cols):
    return tl.sum(tl.where(cols == j, H, 0.0), axis=1)


@triton.jit
def _at(x, r, i):
    return tl.sum(tl.where(r == i, x, 0.0), axis=0)


@triton.jit
def _hessenberg_eigvals(H, n, r, rows, cols, NP: tl.constexpr, MAX_SWEEPS: tl.constexpr):
    """Eigenvalues (re [NP], im [NP], converged) of the leading n x n block of the register tile H."""
    hnorm = tl.sqrt(tl.sum(tl.sum(H * H, axis=1), axis=0))
    hnorm = tl.where(hnorm > 0, hnorm, 1.0)
    # Hessenberg form: zero column k below the subdiagonal
    for k in range(0, n - 2):
        x = tl.where(r > k, _col(H, k, cols), 0.0)
        H = _reflect(H, _house(x, r, k + 1), rows, cols)
        H = tl.where((cols == k) & (rows > k + 1), 0.0, H)
    ev_re = tl.zeros([NP], dtype=tl.float64)
    ev_im = tl.zeros([NP], dtype=tl.float64)
    hi = n - 1
    its = tl.full([], 0, tl.int32)
    sweeps = tl.full([], 0, tl.int32)
    while (hi >= 0) & (sweeps < MAX_SWEEPS):
        # deflation: the last l <= hi with a negligible H[l, l-1]
        d_row = tl.sum(tl.where(rows == cols, H, 0.0), axis=1)  # H[i, i] by row
        d_col = tl.sum(tl.where(rows == cols, H, 0.0), axis=0)  # H[j, j] by column
        d_prev = tl.sum(tl.where(cols == rows - 1, d_col[None, :], 0.0), axis=1)  # H[i-1, i-1] by row
        sub = tl.sum(tl.where(cols == rows - 1, H, 0.0), axis=1)  # H[i, i-1] by row
        tst = tl.abs(d_row) + tl.abs(d_prev)
        tst = tl.where(tst > 0, tst, hnorm)
        # relative to the diagonal (LAPACK) or, for clusters where rounding noise sits above that, to ||H||
        small = ((tl.abs(sub) <= EPS * tst) | (tl.abs(sub) <= n * EPS * hnorm)) & (r >= 1) & (r <= hi)
        lo = tl.max(tl.where(small, r, 0), axis=0)
        H = tl.where((rows == lo) & (cols == lo - 1), 0.0, H)
        if lo == hi:
            ev_re = tl.where(r == hi, _at(d_row, r, hi), ev_re)
            ev_im = tl.where(r == hi, 0.0, ev_im)
            hi -= 1
            its = its * 0
        elif lo == hi - 1:
            ch = _col(H, hi, cols)
            a = _at(d_row, r, hi - 1)
            b = _at(ch, r, hi - 1)
            c = _at(sub, r, hi)
            d = _at(d_row, r, hi)
            p = 0.5 * (a - d)
            disc = p * p + b * c
            sq = tl.sqrt(tl.abs(disc))
            z = p + tl.where(p >= 0, sq, -sq)
            z_safe = tl.where(z != 0, z, 1.0)
            l1 = tl.where(disc >= 0, d + z, d + p)
            l2 = tl.where(disc >= 0, tl.where(z != 0, d - b * c / z_safe, d), d + p)
            i1 = tl.where(disc >= 0, 0.0, sq)
            ev_re = tl.where(r == hi - 1, l1, tl.where(r == hi, l2, ev_re))
            ev_im = tl.where(r == hi - 1, i1, tl.where(r == hi, -i1, ev_im))
            hi -= 2
            its = its * 0
        else:
            its += 1
            sweeps += 1
            c1 = _col(H, hi - 1, cols)
            c2 = _col(H, hi, cols)
            h11 = _at(c1, r, hi - 1)
            h21 = _at(c1, r, hi)
            h12 = _at(c2, r, hi - 1)
            h22 = _at(c2, r, hi)
            if its % 10 == 0:  # exceptional shift (dlahqr)
                s = tl.abs(_at(sub, r, hi)) + tl.abs(_at(sub, r, hi - 1))
                h11 = 0.75 * s + h22
                h12 = -0.4375 * s
                h21 = s
                h22 = h11
            tr = h11 + h22
            det = h11 * h22 - h12 * h21
            # first column of (H - s1)(H - s2) restricted to rows lo..lo+2
            c0 = _col(H, lo, cols)
            c0n = _col(H, lo + 1, cols)
            a00 = _at(c0, r, lo)
            a10 = _at(c0, r, lo + 1)
            a01 = _at(c0n, r, lo)
            a11 = _at(c0n, r, lo + 1)
            a21 = _at(c0n, r, lo + 2)
            x0 = a00 * a00 + a01 * a10 - tr * a00 + det
            x1 = a10 * (a00 + a11 - tr)
            x2 = a10 * a21
            x = tl.where(r == lo, x0, tl.where(r == lo + 1, x1, tl.where(r == lo + 2, x2, 0.0)))
            H = _reflect(H, _house(x, r, lo), rows, cols)
            # chase the bulge down to hi
            for k in range(lo + 1, hi - 1):
                x = tl.where((r >= k) & (r <= k + 2), _col(H, k - 1, cols), 0.0)
                H = _reflect(H, _house(x, r, k), rows, cols)
                H = tl.where((cols == k - 1) & (rows > k) & (rows <= k + 2), 0.0, H)
            x = tl.where((r >= hi - 1) & (r <= hi), _col(H, hi - 2, cols), 0.0)
            H = _reflect(H, _house(x, r, hi - 1), rows, cols)
            H = tl.where((cols == hi - 2) & (rows == hi), 0.0, H)
    return ev_re, ev_im, hi < 0


@triton.jit
def _eig_kernel(a_ptr, re_ptr, im_ptr, ok_ptr, n, NP: tl.constexpr, MAX_SWEEPS: tl.constexpr):
    """One program per general matrix a [n, n]."""
    pid = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NP)
    rows = r[:, None]
    cols = r[None, :]
    H = tl.load(a_ptr + pid * n * n + rows * n + cols, mask=(rows < n) & (cols < n), other=0.0).to(tl.float64)
    ev_re, ev_im, ok = _hessenberg_eigvals(H, n, r, rows, cols, NP, MAX_SWEEPS)
    tl.store(re_ptr + pid * n + r, ev_re, mask=r < n)
    tl.store(im_ptr + pid * n + r, ev_im, mask=r < n)
    tl.store(ok_ptr + pid, ok.to(tl.int8))


@triton.jit
def _householder_z_eigvals(K, b, S, n, r, rows, cols, o_d, NP: tl.constexpr, MAX_SWEEPS: tl.constexpr):
    """Eigenvalues (re, im, converged) of Z = I - L^T M L for one product of n factors: keys K [NP, DK] and
    betas b [NP] (float64, zero outside n), K = L Q (LQ by Householder), M = (I + B tril(L L^T, -1))^-1 B.
    S: this program's [NP, NP] float64 scratch. Shared by both kernels so that their arithmetic is identical."""
    eye = tl.where(rows == cols, 1.0, 0.0).to(tl.float64)
    for j in range(0, n):  # LQ: zero row j right of the diagonal
        x = tl.sum(tl.where(rows == j, K, 0.0), axis=0)
        v = _house(tl.where(o_d >= j, x, 0.0), o_d, j)
        vv = tl.sum(v * v, axis=0)
        tau = tl.where(vv > 0, 2.0 / tl.where(vv > 0, vv, 1.0), 0.0)
        kv = tl.sum(K * v[None, :], axis=1)
        K = K - (tau * kv)[:, None] * v[None, :]
    tl.debug_barrier()  # the previous job may still read the scratch
    tl.store(S + rows * NP + o_d[None, :], K, mask=o_d[None, :] < NP)
    tl.debug_barrier()
    L = tl.load(S + rows * NP + cols, mask=cols <= rows, other=0.0)
    G = tl.zeros([NP, NP], dtype=tl.float64)  # L L^T, the Gram matrix of the keys
    for j in range(0, n):
        lj = _col(L, j, cols)
        G += lj[:, None] * lj[None, :]
    M = tl.zeros([NP, NP], dtype=tl.float64)
    for i in range(0, n):  # forward substitution: M_i = b_i (e_i - sum_{j<i} G_ij M_j)
        gi = tl.where(r < i, tl.sum(tl.where(rows == i, G, 0.0), axis=0), 0.0)
        bi = _at(b, r, i)
        mi = bi * (tl.where(r == i, 1.0, 0.0) - tl.sum(gi[:, None] * M, axis=0))
        M = tl.where(rows == i, mi[None, :], M)
    X = tl.zeros([NP, NP], dtype=tl.float64)  # M L
    Z = eye  # I - L^T (M L)
    for j in range(0, n):
        X += _col(M, j, cols)[:, None] * tl.sum(tl.where(rows == j, L, 0.0), axis=0)[None, :]
    for i in range(0, n):
        Z -= (
            tl.sum(tl.where(rows == i, L, 0.0), axis=0)[:, None]
            * tl.sum(tl.where(rows == i, X, 0.0), axis=0)[None, :]
        )
    Z = tl.where((rows < n) & (cols < n), Z, 0.0)
    return _hessenberg_eigvals(Z, n, r, rows, cols, NP, MAX_SWEEPS)


@triton.jit
def _householder_eig_kernel(
    k_ptr,
    b_ptr,
    scratch,
    re_ptr,
    im_ptr,
    ok_ptr,
    N,
    n,
    dk,
    NP: tl.constexpr,
    DK: tl.constexpr,
    MAX_SWEEPS: tl.constexpr,
):
    """Persistent over products of n Householder factors (contiguous keys k [N, n, dk], betas b [N, n])."""
    r = tl.arange(0, NP)
    rows = r[:, None]
    cols = r[None, :]
    o_d = tl.arange(0, DK)
    S = scratch + tl.program_id(0).to(tl.int64) * NP * NP
    for job in range(tl.program_id(0), N, tl.num_programs(0)):
        base = job + tl.zeros([], dtype=tl.int64)
        K = tl.load(
            k_ptr + base * n * dk + rows * dk + o_d[None, :], mask=(rows < n) & (o_d[None, :] < dk), other=0.0
        ).to(tl.float64)
        b = tl.load(b_ptr + base * n + r, mask=r < n, other=0.0).to(tl.float64)
        ev_re, ev_im, ok = _householder_z_eigvals(K, b, S, n, r, rows, cols, o_d, NP, MAX_SWEEPS)
        tl.store(re_ptr + base * n + r, ev_re, mask=r < n)
        tl.store(im_ptr + base * n + r, ev_im, mask=r < n)
        tl.store(ok_ptr + base, ok.to(tl.int8))


def triton_eigvals(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [N, n, n] real -> (eigenvalues [N, n] complex128, converged [N] bool); float64 throughout."""
    if a.dim() != 3 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"expected square matrices [N, n, n], got {tuple(a.shape)}")
    N, n = a.shape[0], a.shape[-1]
    if n > MAX_N:
        raise ValueError(f"triton_eigvals handles n <= {MAX_N}, got n = {n}; use torch.linalg.eigvals")
    a = a.to(torch.float64).contiguous()
    re = torch.empty(N, n, dtype=torch.float64, device=a.device)
    im = torch.empty_like(re)
    ok = torch.empty(N, dtype=torch.int8, device=a.device)
    if N == 0:
        return torch.complex(re, im), ok.bool()
    NP = max(4, triton.next_power_of_2(n))
    _eig_kernel[(N,)](a, re, im, ok, n, NP=NP, MAX_SWEEPS=30 * n, num_warps=1 if NP <= 16 else 4)
    return torch.complex(re, im), ok.bool()


def _persistent_launch(
    n: int, dk: int, N: int, device: torch.device, programs: int | None
) -> tuple[int, int, int, torch.Tensor]:
    """(NP, DK, programs, per-program [NP, NP] float64 scratch) of the persistent Householder eigen kernels: 16
    programs an SM on CUDA unless `programs` is given (4 in the interpreter), never more than the N jobs."""
    NP = max(4, triton.next_power_of_2(n))
    DK = max(NP, triton.next_power_of_2(dk))
    if programs is None:
        programs = 4 if device.type == "cpu" else torch.cuda.get_device_properties(device).multi_processor_count * 16
    programs = min(N, programs)
    return NP, DK, programs, torch.empty(programs, NP, NP, dtype=torch.float64, device=device)


def householder_eigvals(keys: torch.Tensor, betas: torch.Tensor, programs: int | None = None,
                        fallback: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """keys [N, n, dk] (unit rows), betas [N, n] -> the n non-trivial eigenvalues [N, n] (complex128) of
    (I - b_n k_n k_n^T) ... (I - b_1 k_1 k_1^T), through Z = I - L^T M L (orthogonal when P is, so its
    eigenvalues are as well conditioned as P's). Matrices whose QR iteration does not converge go to
    `fallback(keys, betas)` on the CPU (`kernels.spectra.householder.wide_eigenvalues` passes its LAPACK path); without
    one they raise."""
    if keys.dim() != 3 or betas.shape != keys.shape[:2]:
        raise ValueError(f"expected keys [N, n, dk] and betas [N, n], got {tuple(keys.shape)}, {tuple(betas.shape)}")
    N, n, dk = keys.shape
    if n > MAX_N:
        raise ValueError(f"householder_eigvals handles n <= {MAX_N} factors, got {n}")
    keys, betas = keys.contiguous(), betas.contiguous()
    re = torch.empty(N, n, dtype=torch.float64, device=keys.device)
    im = torch.empty_like(re)
    ok = torch.empty(N, dtype=torch.int8, device=keys.device)
    if N == 0:
        return torch.complex(re, im)
    NP, DK, programs, scratch = _persistent_launch(n, dk, N, keys.device, programs)
    _householder_eig_kernel[(programs,)](
        keys, betas, scratch, re, im, ok, N, n, dk, NP=NP, DK=DK, MAX_SWEEPS=30 * n, num_warps=2 if DK <= 128 else 4
    )
    eig = torch.complex(re, im)
    if not bool(ok.bool().all()):
        bad = (~ok.bool()).nonzero().squeeze(1)
        if fallback is None:
            raise RuntimeError(f"householder_eigvals: {bad.numel()} of {N} matrices did not converge; pass "
                               "fallback=kernels.spectra.householder.wide_eigenvalues (LAPACK on the CPU)")
        eig[bad] = fallback(keys[bad].cpu(), betas[bad].cpu()).to(eig.device)
    return eig
