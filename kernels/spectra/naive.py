"""Dense reference for Householder-product spectra: build P in float64 and call torch.linalg.eigvals.

The oracle for `kernels.spectra.householder`. It is slow on purpose (a dk x dk eig per token and head) and
exists to be compared against, in tests and in the benchmark. Never use it on whole sequences.
"""

from __future__ import annotations

import torch

from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.kernels.spectra.householder import sort_eigenvalues, window_keys


def dense_products(
    k: torch.Tensor,
    beta: torch.Tensor,
    *,
    window: int = 1,
    stride: int = 1,
    normalize_k: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Return the dense products P = (I - b_n k_n k_n^T)...(I - b_1 k_1 k_1^T) as [B, T', H, K, K].

    For window w the product runs over the w * n_h sub-steps of tokens t..t+w-1, first applied rightmost.
    """
    if normalize_k:
        k = l2_normalize(k)
    keys, betas = window_keys(k.to(dtype), beta.to(dtype), window, stride)  # [B,T',H,n,K], [B,T',H,n]
    dk = keys.shape[-1]
    prod = torch.eye(dk, dtype=dtype, device=k.device).expand(*keys.shape[:-2], dk, dk).clone()
    for j in range(keys.shape[-2]):
        kj, bj = keys[..., j, :], betas[..., j]
        # (I - b k k^T) P = P - b k (k^T P)
        prod = prod - bj[..., None, None] * kj[..., :, None] * (kj[..., None, :] @ prod)
    return prod


def naive_spectra(
    k: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    window: int = 1,
    stride: int = 1,
    normalize_k: bool = False,
) -> torch.Tensor:
    """Non-trivial eigenvalues of every (windowed) product from a dense float64 eig: [B, T', H, w * n_h].

    Of the dk eigenvalues the dk - w*n_h closest to 1 are the trivial ones (the orthogonal complement of
    the keys) and are dropped; the rest are scaled by exp(sum of g over the window) and sorted like
    `kernels.spectra.householder.sort_eigenvalues`.
    """
    prod = dense_products(k, beta, window=window, stride=stride, normalize_k=normalize_k)
    n = k.shape[2] * window
    dk = prod.shape[-1]
    eig = torch.linalg.eigvals(prod)  # [B,T',H,dk] complex128
    if n < dk:
        far = (eig - 1).abs().topk(n, dim=-1).indices  # the n farthest from 1 are the non-trivial ones
        eig = eig.gather(-1, far)
    if g is not None:
        gw = g.to(torch.float64).unfold(1, window, stride).sum(-1)  # [B, T', H]
        eig = eig * gw.exp()[..., None]
    return sort_eigenvalues(eig)


def dplr_eigvals_dense(d: torch.Tensor, k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of (I - beta k k^T) diag(d) built densely in float64 ([..., n, n]) by torch.linalg.eigvals,
    real parts sorted ascending (the matrix is similar to a symmetric one): the oracle for
    `kernels.spectra.dplr.dplr_eigvals`."""
    d, k, beta = d.double(), k.double(), beta.double()
    eye = torch.eye(d.shape[-1], dtype=torch.float64, device=d.device)
    m = (eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]) * d[..., None, :]
    return torch.sort(torch.linalg.eigvals(m).real, dim=-1).values
