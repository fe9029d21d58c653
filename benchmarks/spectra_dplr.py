"""Benchmark: exact spectra of diagonal-plus-rank-one transitions (Kimi Delta Attention) by the secular equation,
the Triton solver (`kernels.linalg.triton_secular`) and the torch one, against dense torch.linalg.eigvals of the same
dk x dk matrices, all measured in the same run on the same device.

Each row: token-heads per second of the Triton solver (`--batch` transitions), the torch solver (the first
`--torch-batch`) and the dense peer (the first `--dense-batch`), the ratios, and the max |error| of both solvers
against float64 eigvalsh of the similar symmetric matrix (the exact reference), and of the torch solver against
the dense peer. `python -m benchmarks.spectra_dplr` (the Triton column needs CUDA, or TRITON_INTERPRET=1 on the
CPU at a tiny --batch).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from deltalab.kernels.linalg.triton_secular import secular_eigvals
from deltalab.kernels.spectra.dplr import dplr_eigvals
from deltalab.kernels.spectra.naive import dplr_eigvals_dense


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


def row(dk: int, batch: int, torch_batch: int, dense_batch: int, device: torch.device, block: int | None,
        triton: bool) -> dict[str, Any]:
    """Rates and errors at one dk: the Triton solver on `batch` matrices (when `triton`), the torch solver on the
    first `torch_batch`, dense eigvals on the first `dense_batch`; errors on the dense subset."""
    d, k, beta = inputs(batch, dk, device)
    sub = slice(0, min(dense_batch, batch))
    w = d[sub].sqrt() * k[sub]
    exact = torch.linalg.eigvalsh(torch.diag_embed(d[sub]) - beta[sub, None, None] * w[:, :, None] * w[:, None, :])
    out: dict[str, Any] = {"dk": dk, "batch": batch}
    if triton:
        # the float32 path's inputs: what a bf16/fp16/fp32 model gives (float32); its solver error is measured
        # against the float64 solver of those same rounded inputs, its total error against `exact`
        d32, k32, b32 = d.float(), k.float(), beta.float()
        ref32 = dplr_eigvals(d32.double(), k32.double(), b32.double(), method="triton")
        t_tri, tri = _timed(lambda: dplr_eigvals(d, k, beta, method="triton"), device)
        w_all = d.sqrt() * k
        t_mix, mix = _timed(lambda: secular_eigvals(d, w_all, beta, mixed=True), device)
        t_f32, f32 = _timed(lambda: dplr_eigvals(d32, k32, b32, method="triton", precision="float32"), device)
        out.update(triton_per_s=batch / t_tri, err_triton=float((tri[sub] - exact).abs().max()),
                   mixed_per_s=batch / t_mix, err_mixed=float((mix[sub] - exact).abs().max()),
                   f32_per_s=batch / t_f32, err_f32=float((f32[sub].double() - exact).abs().max()),
                   err_f32_solver=float((f32.double() - ref32).abs().max()))
    ts = slice(0, min(torch_batch, batch))
    t_torch, ours = _timed(lambda: dplr_eigvals(d[ts], k[ts], beta[ts], block=block, method="torch"), device)
    t_dense, dense = _timed(lambda: dplr_eigvals_dense(d[sub], k[sub], beta[sub]), device, repeat=1)
    out.update(torch_per_s=ours.shape[0] / t_torch, dense_per_s=dense.shape[0] / t_dense,
               err_torch=float((ours[sub] - exact).abs().max()), err_dense=float((ours[sub] - dense).abs().max()))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spectra_dplr", description=__doc__.splitlines()[0])
    p.add_argument("--dk", type=int, nargs="+", default=[64, 128], help="key head dims (default 64 128)")
    p.add_argument("--batch", type=int, default=None,
                   help="token-heads for the Triton solver (default 262144 GPU, 64 CPU under TRITON_INTERPRET=1)")
    p.add_argument("--torch-batch", type=int, default=None,
                   help="token-heads for the torch solver (default 65536 GPU, 2048 CPU)")
    p.add_argument("--dense-batch", type=int, default=None, help="token-heads for the dense peer (default 512/64)")
    p.add_argument("--block", type=int, default=None,
                   help="matrices per torch-solver block (memory O(block dk^2); default 4096 GPU, 128 CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sweep", action="store_true",
                   help="also the Triton solver's launch choices (roots per program, warps, one sum per evaluation; "
                   "float32 path: lanes, programs per matrix, stop test, FMA contraction)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    triton = cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"
    batch = args.batch or (262144 if cuda else 64)
    torch_batch = args.torch_batch or (65536 if cuda else 2048)
    dense_batch = args.dense_batch or (512 if cuda else 64)
    batch = max(batch, torch_batch) if not triton else batch
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"diagonal-plus-rank-one spectra on {name}: Triton and torch secular solvers vs dense torch.linalg.eigvals"
          + ("" if triton else " (Triton skipped: CPU without TRITON_INTERPRET=1)"))
    print(f"{'dk':>5} {'triton/s':>10} {'mixed/s':>10} {'f32/s':>10} {'torch/s':>10} {'dense/s':>10} "
          f"{'tri/dense':>10} {'f32/dense':>10} {'f32/tri':>8} {'tri/torch':>10} {'err triton':>11} {'err mixed':>10} "
          f"{'err f32':>9} {'f32-f64':>9} {'err torch':>10} {'torch-dense':>12}"
          "   (token-heads/s; errors max|.| vs eigvalsh; mixed: float32 steps seed float64 ones; f32: the float32 "
          "path on float32-rounded inputs, f32-f64: vs the float64 solver of those inputs, all batch matrices)")
    for dk in args.dk:
        r = row(dk, batch, torch_batch, dense_batch, device, args.block, triton)
        nan = float("nan")
        tri, mix, f32 = r.get("triton_per_s", nan), r.get("mixed_per_s", nan), r.get("f32_per_s", nan)
        print(f"{r['dk']:>5} {tri:>10.3e} {mix:>10.3e} {f32:>10.3e} {r['torch_per_s']:>10.3e} "
              f"{r['dense_per_s']:>10.3e} {tri / r['dense_per_s']:>9.0f}x {f32 / r['dense_per_s']:>9.0f}x "
              f"{f32 / tri:>7.2f}x {tri / r['torch_per_s']:>9.1f}x {r.get('err_triton', nan):>11.1e} "
              f"{r.get('err_mixed', nan):>10.1e} {r.get('err_f32', nan):>9.1e} {r.get('err_f32_solver', nan):>9.1e} "
              f"{r['err_torch']:>10.1e} {r['err_dense']:>12.1e}", flush=True)
    if args.sweep and triton:
        for dk in args.dk:
            sweep(dk, batch, device)


def sweep(dk: int, batch: int, device: torch.device) -> None:
    """The raw Triton solver's rate for each launch choice at one dk (same inputs; max error vs the default's)."""
    d, k, beta = inputs(batch, dk, device)
    w = d.sqrt() * k
    base = secular_eigvals(d, w, beta)
    print(f"launch choices at dk = {dk} (token-heads/s; max |difference| from the default launch)")
    for block_r, warps, one_sum in itertools.product((8, 16, 32), (2, 4), (False, True)):
        t, lam = _timed(lambda b=block_r, nw=warps, o=one_sum: secular_eigvals(d, w, beta, block_r=b, num_warps=nw,
                                                                               one_sum=o), device)
        print(f"   roots/program {block_r:>2}  warps {warps}  one sum {one_sum!s:>5}: {batch / t:.3e}  "
              f"{float((lam - base).abs().max()):.1e}", flush=True)
    d32, w32, b32 = d.float(), d.float().sqrt() * k.float(), beta.float()
    print(f"float32 path at dk = {dk} (token-heads/s of secular_eigvals(precision='float32'); max |difference| from "
          "the float64 default; mean steps per root, mean and max passes per program)")
    for lanes, programs, err_stop, fusion in itertools.product((32, 64, 128), (1, 2), (True, False), (False, True)):
        if (lanes > 32 or programs > 1) and lanes * programs > dk:
            continue
        kw = dict(precision="float32", lanes=lanes, programs=programs, err_stop=err_stop, fp_fusion=fusion)
        t, lam = _timed(lambda kw=kw: secular_eigvals(d32, w32, b32, **kw), device)
        steps: list[torch.Tensor] = []
        secular_eigvals(d32, w32, b32, steps=steps, **kw)
        counts, passes = steps[0][0].float(), steps[0][1][:, :programs].float()
        print(f"   lanes {lanes:>3}  programs/matrix {programs}  f-level stop {err_stop!s:>5}  fma {fusion!s:>5}: "
              f"{batch / t:.3e}  {float((lam.double() - base).abs().max()):.1e}  "
              f"steps {counts.sum() / (counts > 0).sum():.2f}  passes {passes.mean():.1f} / {passes.max():.0f}",
              flush=True)


if __name__ == "__main__":
    main()
