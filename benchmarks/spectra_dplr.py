"""Benchmark: exact spectra of diagonal-plus-rank-one transitions (Kimi Delta Attention) by the secular equation
against dense torch.linalg.eigvals of the same dk x dk matrices, measured in the same run on the same device.

Each row: token-heads per second of ours (a batch of `--batch` transitions) and of the dense peer (a subset,
`--dense-batch`, scaled per token-head), the ratio, and the max |error| of ours against float64 eigvalsh of the
similar symmetric matrix (the exact reference) and against the dense peer. `python -m benchmarks.spectra_dplr`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels.spectra_dplr import dplr_eigvals
from kernels.spectra_naive import dplr_eigvals_dense


def _timed(fn: Callable[[], Any], device: torch.device, repeat: int = 3) -> tuple[float, Any]:
    """Best wall time of `repeat` runs after one warm-up, and the last result."""
    out = fn()
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def inputs(n_mats: int, dk: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """KDA-like transitions: decays exp(g) with g in (-2, 0), unit keys, beta in (0, 2)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    d = torch.exp(-2 * torch.rand(n_mats, dk, generator=g, dtype=torch.float64))
    k = torch.nn.functional.normalize(torch.randn(n_mats, dk, generator=g, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(n_mats, generator=g, dtype=torch.float64)
    return d.to(device), k.to(device), beta.to(device)


def row(dk: int, batch: int, dense_batch: int, device: torch.device, block: int | None) -> dict[str, Any]:
    d, k, beta = inputs(batch, dk, device)
    t_ours, ours = _timed(lambda: dplr_eigvals(d, k, beta, block=block), device)
    sub = slice(0, min(dense_batch, batch))
    t_dense, dense = _timed(lambda: dplr_eigvals_dense(d[sub], k[sub], beta[sub]), device, repeat=1)
    w = d[sub].sqrt() * k[sub]
    exact = torch.linalg.eigvalsh(torch.diag_embed(d[sub]) - beta[sub, None, None] * w[:, :, None] * w[:, None, :])
    ours_rate = batch / t_ours
    dense_rate = dense.shape[0] / t_dense
    return {"dk": dk, "batch": batch, "ours_per_s": ours_rate, "dense_per_s": dense_rate,
            "ratio": ours_rate / dense_rate, "err_exact": float((ours[sub] - exact).abs().max()),
            "err_dense": float((ours[sub] - dense).abs().max())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spectra_dplr", description=__doc__.splitlines()[0])
    p.add_argument("--dk", type=int, nargs="+", default=[64, 128], help="key head dims (default 64 128)")
    p.add_argument("--batch", type=int, default=None, help="token-heads for ours (default 65536 GPU, 2048 CPU)")
    p.add_argument("--dense-batch", type=int, default=None, help="token-heads for the dense peer (default 512/64)")
    p.add_argument("--block", type=int, default=None,
                   help="matrices per solver block (memory O(block dk^2); default 4096 GPU, 128 CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch = args.batch or (65536 if cuda else 2048)
    dense_batch = args.dense_batch or (512 if cuda else 64)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"diagonal-plus-rank-one spectra on {name}: ours (secular equation) vs dense torch.linalg.eigvals")
    print(f"{'dk':>5} {'batch':>7} {'ours tok-heads/s':>17} {'dense tok-heads/s':>18} {'ratio':>8} "
          f"{'max|err| exact':>15} {'max|err| dense':>15}")
    for dk in args.dk:
        r = row(dk, batch, dense_batch, device, args.block)
        print(f"{r['dk']:>5} {r['batch']:>7} {r['ours_per_s']:>17.3e} {r['dense_per_s']:>18.3e} {r['ratio']:>7.0f}x "
              f"{r['err_exact']:>15.1e} {r['err_dense']:>15.1e}", flush=True)


if __name__ == "__main__":
    main()
