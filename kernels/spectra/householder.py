r"""Exact spectra of Householder products through the n x n compact-WY reduction.

One token applies n = n_h Householder-like factors (a window of w tokens applies n = w * n_h, in time
order, the first one rightmost):

    P = (I - b_n k_n k_n^T) ... (I - b_1 k_1 k_1^T),      K = [k_1 ... k_n] in R^{dk x n},  B = diag(b).

**Compact WY form.** P = I - K M K^T with M = (I + B L)^{-1} B, where G = K^T K is the Gram matrix of
the keys and L = tril(G, -1) its strictly lower part. Induction: with P_j = I - K_j M_j K_j^T,
P_{j+1} = (I - b k k^T) P_j = I - K_j M_j K_j^T - b k k^T + b k (k^T K_j) M_j K_j^T, so M_{j+1} =
[[M_j, 0], [-b (k^T K_j) M_j, b]], which is the block forward substitution of (I + B L) M = B.

**Reduction.** Sylvester's determinant identity det(I_dk + X Y) = det(I_n + Y X) gives

    det(lambda I - P) = det((lambda - 1) I_dk + K M K^T) = (lambda - 1)^(dk - n) det(lambda I_n - C),
    C = I_n - M G = (I + B L)^{-1} (I - B U),   U = triu(G)  (G - L = U).

So P has dk - n eigenvalues equal to 1 (the orthogonal complement of the keys) and the other n, with
multiplicity, are the eigenvalues of the n x n matrix C. This is an identity of characteristic
polynomials: it holds for any keys, including linearly dependent, repeated or zero keys (I + B L is
unit lower triangular, always invertible); a dependent key just contributes an eigenvalue 1 to C too.
det C = prod_i (1 - b_i G_ii) (= det P). For a gated token A = exp(g) P: every eigenvalue, the trivial
ones included, is multiplied by exp(g); over a window by exp(sum of g).

**Small eigenproblem.** n = 1: 1 - b |k|^2. n = 2: lambda^2 - tr(C) lambda + det(C) with
tr C = 2 - b1 G11 - b2 G22 + b1 b2 G12^2 (two reflections b = 2 whose planes meet at angle phi give
lambda^2 - 2 cos(2 phi) lambda + 1: a rotation by 2 phi). n = 3: the characteristic cubic, one real root
by Cardano/trigonometric formulas polished by Newton steps, then a deflated quadratic. The quadratic
uses the cancellation-free formula. n > 3 (wide windows, n_h > 3): C is replaced by the similar
Z = I - R M R^T, K = Q R (Q^T P Q on the span of the keys, orthogonal when P is; C can be far from
normal when keys are dependent, which costs digits), solved by a Francis QR Triton kernel on CUDA
(`kernels.linalg.triton_eig`) and by LAPACK on the CPU.

Eigenvalues are returned sorted by angle in (-pi, pi], then by modulus (real ones have an imaginary part
of exactly +0, so negative reals have angle +pi).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from deltalab.kernels.delta_rule.naive import l2_normalize

DEFAULT_BLOCK = 1 << 18  # token-heads per block of work (bounds the memory of the Gram matrices)


class Spectra(NamedTuple):
    """Non-trivial eigenvalues [B, T', H, n] (complex) and rotation angles |arg| [B, T', H, n] (radians)."""

    eigenvalues: torch.Tensor
    angles: torch.Tensor


def window_keys(
    k: torch.Tensor, beta: torch.Tensor, window: int = 1, stride: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B,T,n_h,H,K], [B,T,n_h,H] -> keys [B,T',H,w*n_h,K], betas [B,T',H,w*n_h] in application order.

    Window i covers tokens i*stride .. i*stride + w - 1; T' = (T - w) // stride + 1.
    """
    B, T, n_h, H, K = k.shape
    if window < 1 or stride < 1:
        raise ValueError(f"window={window} and stride={stride} must be >= 1")
    if window > T:
        raise ValueError(f"window={window} is longer than the sequence (T={T}); pass a window <= T")
    if window == 1 and stride == 1:
        return k.permute(0, 1, 3, 2, 4), beta.permute(0, 1, 3, 2)
    kw = k.unfold(1, window, stride)  # [B,T',n_h,H,K,w]
    bw = beta.unfold(1, window, stride)  # [B,T',n_h,H,w]
    Tw = kw.shape[1]
    keys = kw.permute(0, 1, 3, 5, 2, 4).reshape(B, Tw, H, window * n_h, K)
    betas = bw.permute(0, 1, 3, 4, 2).reshape(B, Tw, H, window * n_h)
    return keys, betas


def reduced_matrix(gram: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """C = (I + B tril(G,-1))^{-1} (I - B triu(G)) = I - M G [..., n, n]: eigenvalues = P's non-trivial ones."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return eye - compact_wy(gram, beta) @ gram


def compact_wy(gram: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """M = (I + B tril(G, -1))^{-1} B [..., n, n], so that P = I - K M K^T."""
    n = gram.shape[-1]
    rows = []
    for i in range(n):  # M_i = b_i (e_i - sum_{j<i} G_ij M_j)
        row = torch.zeros_like(gram[..., i, :])
        row[..., i] = 1
        for j in range(i):
            row = row - gram[..., i, j, None] * rows[j]
        rows.append(beta[..., i, None] * row)
    return torch.stack(rows, -2)


def _sign(x: torch.Tensor) -> torch.Tensor:
    """sign with sign(0) = +1 (for cancellation-free root formulas)."""
    return torch.where(x < 0, -torch.ones_like(x), torch.ones_like(x))


def quadratic_roots(b1: torch.Tensor, b0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Roots of lambda^2 + b1 lambda + b0 as (real [..., 2], imag [..., 2]), conjugate pairs exact."""
    disc = b1 * b1 - 4 * b0
    real_case = disc >= 0
    sq = disc.abs().sqrt()
    r1 = -(b1 + _sign(b1) * sq) / 2  # the larger-modulus real root, no cancellation
    r2 = torch.where(r1 != 0, b0 / torch.where(r1 != 0, r1, torch.ones_like(r1)), torch.zeros_like(r1))
    re = torch.stack([torch.where(real_case, r1, -b1 / 2), torch.where(real_case, r2, -b1 / 2)], -1)
    half = torch.where(real_case, torch.zeros_like(sq), sq / 2)
    im = torch.stack([half, -half], -1)
    return re, im


def cubic_real_root(a2: torch.Tensor, a1: torch.Tensor, a0: torch.Tensor, newton: int = 3) -> torch.Tensor:
    """A real root of lambda^3 + a2 lambda^2 + a1 lambda + a0 (Cardano / trigonometric, Newton-polished)."""
    shift = a2 / 3
    p = a1 - a2 * shift
    q = (2 * a2 * a2 * a2) / 27 - a2 * a1 / 3 + a0
    disc = (q / 2) ** 2 + (p / 3) ** 3
    # One real root (disc > 0): u^3 = -q/2 - sign(q) sqrt(disc) has the larger modulus, x = u - p / (3u).
    u3 = -q / 2 - _sign(q) * disc.clamp(min=0).sqrt()
    u = torch.sign(u3) * u3.abs().pow(1.0 / 3.0)
    u_safe = torch.where(u != 0, u, torch.ones_like(u))
    x_one = torch.where(u != 0, u - p / (3 * u_safe), torch.zeros_like(u))
    # Three real roots (disc <= 0, p <= 0): 2 sqrt(-p/3) cos((theta - 2 pi j)/3). Take the most isolated one
    # (j = 0, the largest, when theta < pi/2; else j = 2, the smallest) so that a double root is never
    # the one polished and deflated.
    m = (-p / 3).clamp(min=0).sqrt()
    m_safe = torch.where(m > 0, m, torch.ones_like(m))
    theta = torch.acos((-q / (2 * m_safe**3)).clamp(-1, 1))
    theta = torch.where(theta < torch.pi / 2, theta, theta + 2 * torch.pi)
    x_three = torch.where(m > 0, 2 * m * torch.cos(theta / 3), torch.zeros_like(m))
    lam = torch.where(disc > 0, x_one, x_three) - shift

    def poly(x: torch.Tensor) -> torch.Tensor:
        return ((x + a2) * x + a1) * x + a0

    f = poly(lam)
    for _ in range(newton):  # polish; a step is kept only where it lowers |f|
        df = (3 * lam + 2 * a2) * lam + a1
        cand = lam - f / torch.where(df != 0, df, torch.ones_like(df))
        f_cand = poly(cand)
        better = (df != 0) & (f_cand.abs() < f.abs())
        lam = torch.where(better, cand, lam)
        f = torch.where(better, f_cand, f)
    return lam


def small_eigenvalues(c: torch.Tensor, det: torch.Tensor | None = None) -> torch.Tensor:
    """Eigenvalues [..., n] (complex) of real [..., n, n], n <= 3, by closed forms (wider: `wide_eigenvalues`).

    det: optional exact determinant (prod(1 - b_i G_ii) for Householder products), more accurate than
    expanding C.
    """
    n = c.shape[-1]
    if n == 1:
        return torch.complex(c[..., 0, 0], torch.zeros_like(c[..., 0, 0]))[..., None]
    if n == 2:
        tr = c[..., 0, 0] + c[..., 1, 1]
        d = c[..., 0, 0] * c[..., 1, 1] - c[..., 0, 1] * c[..., 1, 0] if det is None else det
        re, im = quadratic_roots(-tr, d)
        return torch.complex(re, im)
    if n == 3:
        tr = c[..., 0, 0] + c[..., 1, 1] + c[..., 2, 2]
        m2 = (
            c[..., 0, 0] * c[..., 1, 1]
            - c[..., 0, 1] * c[..., 1, 0]
            + c[..., 0, 0] * c[..., 2, 2]
            - c[..., 0, 2] * c[..., 2, 0]
            + c[..., 1, 1] * c[..., 2, 2]
            - c[..., 1, 2] * c[..., 2, 1]
        )
        d = torch.linalg.det(c) if det is None else det
        # det(lambda I - C) = lambda^3 - tr lambda^2 + m2 lambda - det
        a2, a1, a0 = -tr, m2, -d
        r = cubic_real_root(a2, a1, a0)
        b1 = a2 + r
        b0 = a1 + r * b1
        re, im = quadratic_roots(b1, b0)
        re = torch.cat([r[..., None], re], -1)
        im = torch.cat([torch.zeros_like(r)[..., None], im], -1)
        return torch.complex(re, im)
    raise ValueError(f"small_eigenvalues has closed forms for n <= 3, got n = {n}: use wide_eigenvalues")


def cpu_eigvals(flat: torch.Tensor, per_task: int = 8192) -> torch.Tensor:
    """LAPACK eigvals of [N, n, n] on the CPU, blocks spread over threads (torch loops a batch serially).
    Non-finite matrices raise ValueError: MKL answered them with an error line and a segfault."""
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("spectra: a transition holds NaN or inf (non-finite keys, betas or gates); check the "
                         "model's activations (or the store's padding mask) before computing spectra")
    workers = min(os.cpu_count() or 1, -(-flat.shape[0] // per_task))
    if workers <= 1:
        return _robust_eigvals(flat)
    with ThreadPoolExecutor(workers) as pool:
        return torch.cat(list(pool.map(_robust_eigvals, flat.split(per_task))))


def _robust_eigvals(block: torch.Tensor, tries: int = 3) -> torch.Tensor:
    """torch.linalg.eigvals, except that a matrix on which LAPACK's QR fails to converge (seen on Z of
    windows whose keys span 3 dimensions: clusters of exact 1s) is solved again after a random orthogonal
    similarity Q^T A Q, which keeps the eigenvalues (to rounding) and breaks the stalling structure."""
    try:
        return torch.linalg.eigvals(block)
    except torch.linalg.LinAlgError:
        pass
    out = []
    gen = torch.Generator().manual_seed(0)
    for a in block:
        for attempt in range(tries + 1):
            try:
                out.append(torch.linalg.eigvals(a))
                break
            except torch.linalg.LinAlgError:
                if attempt == tries:
                    raise
                q, _ = torch.linalg.qr(torch.randn(a.shape, dtype=a.dtype, generator=gen))
                a = q.T @ a @ q
    return torch.stack(out)


NETWORK_MAX = 16
"""Up to this many eigenvalues per set, `sort_eigenvalues` runs a sorting network of elementwise ops: argsort over a
last axis of 4 took 64 ms of a 7B capture's 0.29 s of spectra per batch on a Hopper GPU (segmented sorts)."""


def sort_eigenvalues(eig: torch.Tensor) -> torch.Tensor:
    """Sort complex [..., n] by angle in (-pi, pi], then by modulus, ties kept in order (NaN last); -0.0 imaginary
    parts become +0.0."""
    im = eig.imag
    eig = torch.complex(eig.real, torch.where(im == 0, torch.zeros_like(im), im))
    n = eig.shape[-1]
    if n == 1:  # one eigenvalue per token (n_h = 1): nothing to sort (two sorts of every token saved)
        return eig
    if n <= NETWORK_MAX:
        return _transposition_sort(eig)
    order = eig.abs().argsort(dim=-1, stable=True)
    eig = eig.gather(-1, order)
    order = eig.angle().argsort(dim=-1, stable=True)
    return eig.gather(-1, order)


def _transposition_sort(eig: torch.Tensor) -> torch.Tensor:
    """Odd-even transposition sort of [..., n] on the key (angle, modulus): n rounds of compare-exchanges of
    neighbours, each swapping only a pair strictly out of order, so it is stable like the two argsorts it replaces."""
    n = eig.shape[-1]
    angle, modulus = eig.angle(), eig.abs()
    nan = angle.isnan() | modulus.isnan()
    angle = angle.masked_fill(nan, math.inf)  # NaN sorts last, as argsort puts it
    modulus = modulus.masked_fill(nan, math.inf)
    eig, angle, modulus = eig.clone(), angle.clone(), modulus.clone()
    for r in range(n):
        left, right = slice(r % 2, n - 1, 2), slice(r % 2 + 1, n, 2)
        a_ang, b_ang = angle[..., left], angle[..., right]
        a_mod, b_mod = modulus[..., left], modulus[..., right]
        swap = (a_ang > b_ang) | ((a_ang == b_ang) & (a_mod > b_mod))
        for x in (eig, angle, modulus):
            a, b = x[..., left].clone(), x[..., right]
            x[..., left] = torch.where(swap, b, a)
            x[..., right] = torch.where(swap, a, b)
    return eig


def wide_eigenvalues(keys: torch.Tensor, betas: torch.Tensor) -> torch.Tensor:
    """keys [N, n, K], betas [N, n] -> eigenvalues [N, n] (complex128) for n > 3, through the similar
    m x m matrix Z = I - R M R^T with K^T = Q R (m = min(n, K)), orthogonal whenever P is, so that its
    eigenvalues are as well conditioned as P's (C itself is far from normal when keys are dependent).
    CUDA: one Triton kernel (`kernels.linalg.triton_eig`, the CPU path for what it cannot converge); CPU: batched QR and
    LAPACK."""
    if keys.is_cuda:
        from deltalab.kernels.linalg.triton_eig import (
            householder_eigvals,  # imports triton; the CPU path does not need it
        )

        return householder_eigvals(keys, betas, fallback=_wide_eigenvalues_cpu)
    return _wide_eigenvalues_cpu(keys, betas)


def _wide_eigenvalues_cpu(keys: torch.Tensor, betas: torch.Tensor) -> torch.Tensor:
    """`wide_eigenvalues` by batched QR and LAPACK (float64)."""
    keys, betas = keys.to(torch.float64), betas.to(torch.float64)
    N, n, _ = keys.shape
    gram = keys @ keys.transpose(-1, -2)
    m_wy = compact_wy(gram, betas)
    r = torch.linalg.qr(keys.transpose(-1, -2), mode="r").R  # [N, m, n]
    m = r.shape[-2]
    z = torch.eye(m, dtype=keys.dtype) - r @ m_wy @ r.transpose(-1, -2)
    eig = cpu_eigvals(z)
    if m < n:
        eig = torch.cat([eig, torch.ones(N, n - m, dtype=eig.dtype)], -1)
    return eig


def _block_spectra(keys: torch.Tensor, betas: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """keys [N, n, K], betas [N, n] -> unsorted eigenvalues [N, n]."""
    betas = betas.to(dtype)
    n = keys.shape[-2]
    if n == 1:
        k = keys[:, 0]
        if k.dtype in (torch.bfloat16, torch.float16):  # half squares are exact in float32: half the traffic
            sq = k.float().square_().sum(-1, dtype=dtype)
        else:
            k = k.to(dtype)
            sq = (k * k).sum(-1)
        lam = 1 - betas[:, 0] * sq
        return torch.complex(lam, torch.zeros_like(lam))[:, None]
    keys = keys.to(dtype)  # float64 keys: the Triton kernel read bf16 keys 1.4x slower (Hopper, 7B capture)
    if n > 3:
        eig = wide_eigenvalues(keys, betas)
        return eig.to(torch.complex64) if dtype == torch.float32 else eig
    gram = keys @ keys.transpose(-1, -2)
    c = reduced_matrix(gram, betas)
    det = (1 - betas * gram.diagonal(dim1=-2, dim2=-1)).prod(-1)
    return small_eigenvalues(c, det)


def householder_spectra(
    k: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    window: int = 1,
    stride: int = 1,
    normalize_k: bool = False,
    dtype: torch.dtype = torch.float64,
    block: int = DEFAULT_BLOCK,
) -> Spectra:
    """Non-trivial eigenvalues of every token's (or window's) transition, exactly, via the WY reduction.

    k [B,T,n_h,H,K] (L2-normalised unless normalize_k), beta [B,T,n_h,H] in [0, 2], g [B,T,H] or None.
    Window w: the product P_{t+w-1} ... P_t (w * n_h keys), for windows starting every `stride` tokens.
    Returns Spectra(eigenvalues [B,T',H,w*n_h] complex, angles [B,T',H,w*n_h]); with a gate the
    eigenvalues are those of A = exp(sum g) P (the dk - w*n_h trivial ones of A equal exp(sum g)).
    dtype: the precision of the small problem (float64 default: cheap, and exact to ~1e-15 away from
    multiple eigenvalues; float32 for speed).
    """
    if k.dim() != 5 or beta.shape != k.shape[:4]:
        raise ValueError(f"expected k [B,T,n_h,H,K] and beta [B,T,n_h,H], got {tuple(k.shape)} and {tuple(beta.shape)}")
    if g is not None and g.shape != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"expected g [B,T,H] = {(k.shape[0], k.shape[1], k.shape[3])}, got {tuple(g.shape)}")
    B, T, n_h, H, _ = k.shape
    if window < 1 or stride < 1 or window > T:
        raise ValueError(f"window={window}, stride={stride}: need 1 <= window <= T={T} and stride >= 1")
    if normalize_k:
        k = l2_normalize(k)
    n = window * n_h
    Tw = (T - window) // stride + 1
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    out = torch.empty(B, Tw, H, n, dtype=complex_dtype, device=k.device)
    per_window = B * H
    step = max(1, block // per_window)  # windows per block
    for w0 in range(0, Tw, step):
        w1 = min(Tw, w0 + step)
        t0, t1 = w0 * stride, (w1 - 1) * stride + window
        keys, betas = window_keys(k[:, t0:t1], beta[:, t0:t1], window, stride)
        if n > 1:  # one contiguous copy in the small problem's dtype, not a window copy and then a dtype one
            keys = keys.to(dtype, memory_format=torch.contiguous_format)
        eig = _block_spectra(keys.reshape(-1, n, keys.shape[-1]), betas.reshape(-1, n), dtype)
        out[:, w0:w1] = eig.reshape(B, w1 - w0, H, n).to(complex_dtype)
    if g is not None:
        gw = g.to(dtype).unfold(1, window, stride).sum(-1)[:, :Tw]  # [B,T',H]
        out = out * gw.exp()[..., None]
    out = sort_eigenvalues(out)
    return Spectra(out, out.angle().abs())
