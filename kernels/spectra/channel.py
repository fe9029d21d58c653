"""Spectra of per-channel-gated transitions (Kimi Delta Attention) over windows of tokens, through dense products.

A token's transition is A_t = P_t diag(e^{g_t}) with P_t = (I - b_{t,n_h} k k^T) ... (I - b_{t,1} k k^T) (the gate
acts before the token's first Householder step, `kernels.delta_rule.naive`). A window of w tokens is the product
A_{t+w-1} ... A_t. It is no longer diagonal plus rank one, and Sylvester's reduction of `kernels.spectra.householder`
does not apply (the decays act on all dk rows), so all dk eigenvalues are non-trivial: the product is multiplied out in
float64 and solved by LAPACK (`torch.linalg.eigvals`, on the CPU: a dense 128 x 128 eig costs milliseconds on a GPU
too). One token with n_h = 1 goes to the exact secular-equation solver (`kernels.spectra.dplr`) instead.
"""

from __future__ import annotations

import torch

from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.kernels.spectra.dplr import dplr_eigvals
from deltalab.kernels.spectra.householder import Spectra, cpu_eigvals, sort_eigenvalues, window_keys

DEFAULT_BLOCK = 2048  # windows x heads multiplied out at once (dk = 128: 256 MiB of float64 products)


def _check(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, window: int, stride: int) -> None:
    if k.dim() != 5 or beta.shape != k.shape[:4]:
        raise ValueError(f"expected k [B,T,n_h,H,K] and beta [B,T,n_h,H], got {tuple(k.shape)} and {tuple(beta.shape)}")
    B, T, _, H, K = k.shape
    if g.shape != (B, T, H, K):
        raise ValueError(f"expected a per-channel gate g [B,T,H,K] = {(B, T, H, K)}, got {tuple(g.shape)}")
    if window < 1 or stride < 1 or window > T:
        raise ValueError(f"window={window}, stride={stride}: need 1 <= window <= T={T} and stride >= 1")


def channel_window_products(
    k: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    window: int = 1,
    stride: int = 1,
    normalize_k: bool = False,
) -> torch.Tensor:
    """The transitions A_{t+w-1} ... A_t of windows starting every `stride` tokens, [B, T', H, K, K] float64.

    k [B,T,n_h,H,K], beta [B,T,n_h,H], g [B,T,H,K] (log decays per key channel); T' = (T - w) // stride + 1.
    """
    _check(k, beta, g, window, stride)
    if normalize_k:
        k = l2_normalize(k)
    d = torch.float64
    n_h = k.shape[2]
    keys, betas = window_keys(k.to(d), beta.to(d), window, stride)  # [B,T',H,w*n_h,K] in application order
    decays = g.to(d).exp().unfold(1, window, stride)  # [B,T',H,K,w]
    K = keys.shape[-1]
    prod = torch.eye(K, dtype=d, device=k.device).expand(*keys.shape[:3], K, K).clone()
    for i in range(window):
        prod = decays[..., i, None] * prod  # diag(e^{g_t}) scales the key rows
        for j in range(i * n_h, (i + 1) * n_h):
            kj, bj = keys[..., j, :], betas[..., j]
            prod = prod - bj[..., None, None] * kj[..., :, None] * (kj[..., None, :] @ prod)
    return prod


def channel_spectra(
    k: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    window: int = 1,
    stride: int = 1,
    normalize_k: bool = False,
    block: int = DEFAULT_BLOCK,
) -> Spectra:
    """All dk eigenvalues of every token's (window's) per-channel-gated transition: Spectra(eigenvalues
    [B,T',H,K] complex128 on k's device, sorted by angle then modulus as `kernels.spectra.householder`, angles |arg|).

    Windows (or n_h > 1): dense float64 products and LAPACK, `block` windows x heads at a time. One token with
    n_h = 1: the exact secular solver (real eigenvalues).
    """
    _check(k, beta, g, window, stride)
    if normalize_k:
        k = l2_normalize(k)
    B, T, n_h, H, K = k.shape
    Tw = (T - window) // stride + 1
    if window == 1 and n_h == 1:
        lam = dplr_eigvals(g.double().exp(), k[:, :, 0].double(), beta[:, :, 0].double())
        eig = torch.complex(lam, torch.zeros_like(lam))
    else:
        eig = torch.empty(B, Tw, H, K, dtype=torch.complex128, device=k.device)
        step = max(1, block // (B * H))  # windows per block
        for w0 in range(0, Tw, step):
            w1 = min(Tw, w0 + step)
            t0, t1 = w0 * stride, (w1 - 1) * stride + window
            prod = channel_window_products(k[:, t0:t1], beta[:, t0:t1], g[:, t0:t1], window=window, stride=stride)
            eig[:, w0:w1] = cpu_eigvals(prod.reshape(-1, K, K).cpu()).reshape(B, w1 - w0, H, K).to(k.device)
    eig = sort_eigenvalues(eig)
    return Spectra(eig, eig.angle().abs())
