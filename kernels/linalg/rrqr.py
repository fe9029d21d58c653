"""Strong rank-revealing QR (Gu & Eisenstat 1996, Algorithm 4): pick k well-conditioned columns.

Starts from QR with column pivoting (scipy/LAPACK geqp3), M P = Q [[A, B], [0, C]] with A k x k, then
swaps a chosen column i with a rejected column j while

    rho_ij = sqrt( (A^-1 B)_ij^2 + (gamma_j(C) * ||row_i(A^-1)||)^2 ) > f,       gamma_j = ||C[:, j]||,

each swap multiplying |det A| by rho_ij > f (so it terminates). On exit |(A^-1 B)_ij| <= f and
gamma_j(C) ||row_i(A^-1)|| <= f for all i, j, which gives (Gu & Eisenstat, Theorem 3.2)

    sigma_i(A) >= sigma_i(M) / sqrt(1 + f^2 k (n - k)),   sigma_j(C) <= sigma_{k+j}(M) sqrt(1 + f^2 k (n - k)).

The triangular factor is re-formed by a QR of the small n x n R after each swap (O(n^3), n = head dim),
not by Givens updates: simpler, and cheap at the sizes pruning needs. Everything runs in float64.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import scipy.linalg


class RRQRResult(NamedTuple):
    """perm: column order (the first k are the selection); R: n x n triangular factor of M[:, perm]."""

    perm: np.ndarray
    R: np.ndarray
    swaps: int
    rho_max: float  # the largest swap gain left (<= f unless stopped early)


def swap_gains(R: np.ndarray, k: int) -> np.ndarray:
    """rho_ij for i < k (chosen), j < n - k (rejected), from the triangular factor R (n x n)."""
    n = R.shape[1]
    A, B, C = R[:k, :k], R[:k, k:], R[k:, k:]
    Ainv = scipy.linalg.solve_triangular(A, np.eye(k), lower=False)
    U = Ainv @ B
    row_norms = np.linalg.norm(Ainv, axis=1)  # 1 / omega_i(A)
    gamma = np.linalg.norm(C, axis=0) if C.shape[0] else np.zeros(n - k)
    return np.sqrt(U**2 + (row_norms[:, None] * gamma[None, :]) ** 2)


def strong_rrqr(M: np.ndarray, k: int, f: float = 1.5, max_swaps: int | None = None, rtol: float = 1e-12) -> RRQRResult:
    """Strong RRQR column selection of k columns of M (m x n); see the module docstring.

    Stops early (rho_max reported as inf) if the leading block is numerically singular (rank(M) < k):
    then no strong bound exists and the QRCP order is kept.
    """
    M = np.asarray(M, dtype=np.float64)
    if M.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {M.shape}")
    m, n = M.shape
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] (the number of columns), got {k}")
    if f < 1:
        raise ValueError(f"f must be >= 1, got {f}")
    if m < n:  # pad with zero rows: same R up to zero rows, keeps the blocks square
        M = np.vstack([M, np.zeros((n - m, n))])
    R, perm = scipy.linalg.qr(M, mode="r", pivoting=True)
    R = R[:n]
    if k == n:
        return RRQRResult(perm, R, 0, 0.0)
    limit = 100 * n if max_swaps is None else max_swaps
    swaps, rho_max = 0, 0.0
    scale = abs(R[0, 0]) if R[0, 0] != 0 else 1.0
    while True:
        if np.abs(np.diag(R[:k, :k])).min() <= rtol * scale:
            return RRQRResult(perm, R, swaps, float("inf"))
        rho = swap_gains(R, k)
        i, j = np.unravel_index(int(np.argmax(rho)), rho.shape)
        rho_max = float(rho[i, j])
        if rho_max <= f or swaps >= limit:
            return RRQRResult(perm, R, swaps, rho_max)
        cols = np.arange(n)
        cols[i], cols[k + j] = k + j, i
        perm = perm[cols]
        R = scipy.linalg.qr(R[:, cols], mode="r")[0][:n]
        swaps += 1


def select_columns(M: np.ndarray, k: int, f: float = 1.5) -> np.ndarray:
    """Sorted indices of the k columns strong RRQR keeps."""
    return np.sort(strong_rrqr(M, k, f).perm[:k])
