"""Adapters from store blocks (numpy, store dim order) to the kernels: spectra, per-token state ranks, read-out.

The kernels take torch tensors in the model's layout ([B,T,n_h,H,K] ...); the store keeps one
layer per block ([seq,pos,step,head,dk] after selecting the layer). These functions convert,
pick the device (CUDA kernels where present, the PyTorch path on the CPU) and return numpy for numpy
inputs. Given tensors (capture-time reductions) they return tensors where the work ran: nothing waits for
the GPU, and the caller copies a whole batch to the host once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from deltalab.kernels.constants import CHUNK_SIZE

if TYPE_CHECKING:
    from deltalab.kernels.ranks.chunk import RankMetrics

RANK_FIELDS = ("erank", "stable_rank", "rank_utilisation", "frobenius", "spectral", "nuclear")


def _t(x: np.ndarray | torch.Tensor | None, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A store block (numpy) or a capture's tensor (already on its device) as a `dtype` tensor on `device`."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype)
    return torch.as_tensor(np.ascontiguousarray(x)).to(device=device, dtype=dtype)


def as_tensor(x: np.ndarray | torch.Tensor, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`_t` for a block that is never None."""
    out = _t(x, device, dtype)
    assert out is not None
    return out


def _out(like: object, x: torch.Tensor, dtype: torch.dtype) -> np.ndarray | torch.Tensor:
    """A result as the caller gave its inputs: a tensor on its device for tensors, else numpy."""
    if isinstance(like, torch.Tensor):
        return x.to(dtype)
    return x.to("cpu", dtype).numpy()


def host(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """numpy view of a block given as numpy or as a tensor (copied to the host)."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def warm_up(device: str) -> None:
    """Load CUDA's linear-algebra libraries from the calling thread, once. torch loads them lazily on first
    use, and two threads doing that at once (dask's threaded scheduler, capture's writer thread) fail with
    "lazy wrapper should be called at most once"."""
    if not device.startswith("cuda"):
        return
    a = torch.eye(4, device=device, dtype=torch.float64) + 0.1 * torch.ones(4, 4, device=device, dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        m = a.to(dtype)
        torch.linalg.solve_triangular(m.tril(), m, upper=False, unitriangular=True)
        torch.linalg.eigvalsh(m)
        torch.linalg.eigvals(m)
        torch.linalg.svdvals(m)
        torch.linalg.inv(m)
    torch.cuda.synchronize(device)


# --- spectra -------------------------------------------------------------------------------

def token_spectra(k: np.ndarray, beta: np.ndarray, g: np.ndarray | None = None, *, window: int = 1,
                  stride: int = 1, device: str = "cpu") -> np.ndarray:
    """Non-trivial eigenvalues of each token's (window's) product: k [B,T,n_h,H,K], beta [B,T,n_h,H] ->
    complex [B,T',H,w*n_h], sorted by angle then modulus; with g [B,T,H] those of A = exp(sum g) P."""
    from deltalab.kernels.spectra.householder import householder_spectra

    with torch.profiler.record_function(f"deltalab.linalg.spectra_w{window}"):
        kt = _t(k, device, k.dtype) if isinstance(k, torch.Tensor) else _t(k, device)  # converted once, in blocks
        spec = householder_spectra(kt, _t(beta, device), _t(g, device), window=window, stride=stride)
    return _out(k, spec.eigenvalues, torch.complex64)


def channel_gate_spectra(k: np.ndarray, beta: np.ndarray, g: np.ndarray, *, window: int = 1, stride: int = 1,
                         device: str = "cpu", precision: str = "float64") -> np.ndarray:
    """All dk eigenvalues of each token's (window's) per-channel-gated transition, A_t = P_t diag(exp g_t):
    k [B,T,n_h,H,K], beta [B,T,n_h,H], g [B,T,H,K] -> complex [B,T',H,K].

    One token with n_h = 1: real values, ascending, exact by the secular equation (`kernels.spectra.dplr`).
    Otherwise the transitions are multiplied out in float64 and solved densely (`kernels.spectra.channel`),
    sorted by angle, then modulus. `precision` "float32": the secular solve in float32 (one token, n_h = 1)."""
    if window == 1 and k.shape[2] == 1:
        from deltalab.kernels.spectra.dplr import dplr_eigvals

        kk, bb = _t(k[:, :, 0], device, torch.float64), _t(beta[:, :, 0], device, torch.float64)
        d = _t(g, device, torch.float64).exp()
        return _out(k, dplr_eigvals(d, kk, bb, precision=precision), torch.complex64)
    from deltalab.kernels.spectra.channel import channel_spectra

    spec = channel_spectra(_t(k, device, torch.float64), _t(beta, device, torch.float64),
                           _t(g, device, torch.float64), window=window, stride=stride)
    return _out(k, spec.eigenvalues, torch.complex64)


def dplr_spectra(g: np.ndarray, kappa: np.ndarray, beta: np.ndarray, *, device: str = "cpu") -> np.ndarray:
    """Eigenvalues of each RWKV-7 token transition diag(e^g) - (kappa * beta) kappa^T: g, kappa, beta [B,T,H,K]
    (the store's kappa and beta with their step axis dropped) -> complex [B,T,H,K] (real values, ascending), exact
    by the secular equation (`kernels.spectra.dplr.dplr_eigvals_general`, a = -kappa, b = kappa * beta)."""
    from deltalab.kernels.spectra.dplr import dplr_eigvals_general

    kk, bb = as_tensor(kappa, device, torch.float64), as_tensor(beta, device, torch.float64)
    d = as_tensor(g, device, torch.float64).exp()
    return _out(kappa, dplr_eigvals_general(d, -kk, kk * bb), torch.complex64)


def removal_spectra(kappa: np.ndarray, beta: np.ndarray, *, window: int = 1, stride: int = 1,
                    device: str = "cpu") -> np.ndarray:
    """Non-trivial eigenvalues of RWKV-7's removal factors R_t = I - u_t kappa_t^T (u = kappa * beta, the
    transition without its decay) and of their products over windows of `window` tokens (the first rightmost):
    kappa, beta [B,T,H,K] -> complex [B,T',H,window], sorted by angle then modulus.

    Compact WY as `kernels.spectra.householder` for the delta product, with u_i != kappa_i: R_w ... R_1 = I - U M K^T
    with M = (I + L)^{-1}, L = strictly lower part of G = K^T U, so the window's non-trivial eigenvalues are those of
    the w x w C = (I + L)^{-1} (I - triu(G)) (window 1: 1 - sum kappa_i^2 beta_i); float64, dense eig of C."""
    from deltalab.kernels.spectra.householder import sort_eigenvalues

    kk, bb = as_tensor(kappa, device, torch.float64), as_tensor(beta, device, torch.float64)
    u = kk * bb
    B, T, H, K = kk.shape
    starts = torch.arange(0, T - window + 1, stride, device=kk.device)
    idx = starts[:, None] + torch.arange(window, device=kk.device)[None, :]  # [T', w]
    kw, uw = kk[:, idx], u[:, idx]  # [B, T', w, H, K]
    gram = torch.einsum("btihk,btjhk->bthij", kw, uw)  # G_ij = kappa_i^T u_j
    eye = torch.eye(window, dtype=gram.dtype, device=gram.device)
    c = torch.linalg.solve(eye + torch.tril(gram, -1), eye - torch.triu(gram))
    eig = torch.linalg.eigvals(c) if window > 1 else c[..., 0].to(torch.complex128)
    return _out(kappa, sort_eigenvalues(eig), torch.complex64)


# --- per-token states and their ranks --------------------------------------------------------

def token_ranks(k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray | None,
                boundary: np.ndarray | None, *, chunk_size: int = CHUNK_SIZE, device: str = "cpu",
                dtype: torch.dtype = torch.float32, every: int = 1,
                picked: bool = False) -> dict[str, np.ndarray | torch.Tensor]:
    """Rank statistics of every token's state (`kernels.ranks.chunk`): dict of [B,T,H] arrays (RANK_FIELDS).

    k [B,T,n_h,H,K], v [B,T,n_h,H,V], beta [B,T,n_h,H], g [B,T,H]|None, boundary [B,NC,H,K,V]|None
    (the store's chunk-start states; None = recomputed from a zero start). Only a group of chunks of
    per-token states is ever held. `every=N`: only the states after tokens N-1, 2N-1, ... (NaN elsewhere).
    `picked`: boundary holds only the states those ranks read (`kernels.ranks.chunk.ranked_boundaries`).
    """
    from deltalab.kernels.ranks.chunk import state_rank_metrics

    with torch.no_grad(), torch.profiler.record_function("deltalab.linalg.ranks"):
        if picked:
            m = _picked_ranks(boundary, k.shape[1], chunk_size, every, device, dtype)
        else:
            m = state_rank_metrics(_t(k, device, dtype), _t(v, device, dtype), _t(beta, device, dtype),
                                   _t(g, device, dtype), _t(boundary, device, dtype), chunk_size=chunk_size,
                                   every=every)
    return {f: _out(k, getattr(m, f), torch.float32) for f in RANK_FIELDS}


def _picked_ranks(boundary: np.ndarray | torch.Tensor | None, T: int, chunk_size: int, every: int, device: str,
                  dtype: torch.dtype) -> RankMetrics:
    """Ranks from only the boundary states `every` reads (a capture kept no others): their SVDs, no replay."""
    from deltalab.kernels.ranks.chunk import ranks_at_boundaries

    return ranks_at_boundaries(as_tensor(boundary, device, dtype), T, chunk_size, every, "auto", "auto", picked=True)


def dplr_token_ranks(k: np.ndarray, v: np.ndarray, kappa: np.ndarray, beta: np.ndarray, g: np.ndarray | None,
                     boundary: np.ndarray | None, *, chunk_size: int = CHUNK_SIZE, device: str = "cpu",
                     dtype: torch.dtype = torch.float32, every: int = 1,
                     picked: bool = False) -> dict[str, np.ndarray | torch.Tensor]:
    """`token_ranks` for RWKV-7 stores: k, kappa, beta [B,T,H,K], v [B,T,H,V], g [B,T,H,K]|None, boundary
    [B,NC,H,K,V]|None; the states follow H <- (diag(e^g) - (kappa * beta) kappa^T) H + k v^T
    (`kernels.ranks.dplr.dplr_state_rank_metrics`, a = -kappa, b = kappa * beta)."""
    from deltalab.kernels.ranks.dplr import dplr_state_rank_metrics

    with torch.no_grad():
        if picked:
            m = _picked_ranks(boundary, k.shape[1], chunk_size, every, device, dtype)
        else:
            kap, bet = as_tensor(kappa, device, dtype), as_tensor(beta, device, dtype)
            m = dplr_state_rank_metrics(as_tensor(k, device, dtype), as_tensor(v, device, dtype), -kap, kap * bet,
                                        _t(g, device, dtype), _t(boundary, device, dtype), chunk_size=chunk_size,
                                        every=every)
    return {f: _out(k, getattr(m, f), torch.float32) for f in RANK_FIELDS}


def token_states(k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray | None,
                 boundary: np.ndarray | None, lo: int, hi: int, *, chunk_size: int = CHUNK_SIZE,
                 device: str = "cpu") -> np.ndarray:
    """States after tokens lo..hi-1 (one chunk: lo = c * chunk_size) [B, hi-lo, H, K, V], replayed from the
    chunk's stored start state (boundary [B,NC,H,K,V]; None = replay from zero up to lo)."""
    from deltalab.kernels.ranks.chunk import replay_chunks

    B, _, _, H, K = k.shape
    V = v.shape[-1]
    with torch.no_grad():
        if boundary is not None:
            start = _t(boundary[:, lo // chunk_size], device)
        elif lo == 0:
            start = torch.zeros(B, H, K, V, device=device)
        else:
            zero = torch.zeros(B, H, K, V, device=device)
            start = replay_chunks(zero, *(_t(x[:, :lo], device) for x in (k, v, beta)),
                                  _t(None if g is None else g[:, :lo], device))[:, -1]
        states = replay_chunks(start, *(_t(x[:, lo:hi], device) for x in (k, v, beta)),
                               _t(None if g is None else g[:, lo:hi], device))
    return states.to("cpu", torch.float32).numpy()


# --- read-out ---------------------------------------------------------------------------------

def readout(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray | None, *,
            device: str = "cpu") -> np.ndarray:
    """The recurrence output o [B,T,H,V] (scale dk^-1/2) rebuilt from the stored inputs (chunked kernel;
    Triton on CUDA)."""
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward

    with torch.no_grad():
        o, _, _ = delta_product_forward(_t(q, device), _t(k, device), _t(v, device), _t(beta, device),
                                        _t(g, device))
    return o.to("cpu", torch.float32).numpy()
