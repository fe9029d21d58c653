"""Where capture's `--reduce spectra` time goes at a real model's shape, without the model (#19).

Synthetic captured inputs shaped like one batch of OLMo-Hybrid 7B at B x T = 8 x 4096 (24 delta-rule layers,
32 heads, dk = 128, keys bf16 as capture hands them to the reductions) go through the spectra plan's per-layer
function (`probes.spectra.plan`, what capture's reducer runs), timed per layer and per part with CUDA syncs, then
once under torch.profiler (CUDA kernels by total time).
`python scripts/spectra_reduce_profile.py [--layers 24] [--batch 8] [--length 4096] [--heads 32] [--dk 128]`.
"""

from __future__ import annotations

import argparse
import time

import dask.array as da
import numpy as np
import torch
import xarray as xr

from probes import linalg
from probes.spectra import plan


def _inputs(B: int, T: int, H: int, K: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(B, T, 1, H, K, device="cuda", generator=gen), dim=-1)
    beta = 2 * torch.rand(B, T, 1, H, device="cuda", generator=gen)
    g = -torch.rand(B, T, H, device="cuda", generator=gen)
    return {"k": k.bfloat16(), "beta": beta.bfloat16(), "g": g.bfloat16()}


def _dataset(B: int, T: int, H: int, K: int) -> xr.Dataset:
    """Only the sizes and variable names matter to the plan: lazy zeros."""
    return xr.Dataset({
        "k": (("seq", "layer", "pos", "step", "head", "dk"), da.zeros((B, 1, T, 1, H, K), dtype=np.float16)),
        "beta": (("seq", "layer", "pos", "step", "head"), da.zeros((B, 1, T, 1, H), dtype=np.float16)),
        "g": (("seq", "layer", "pos", "head"), da.zeros((B, 1, T, H), dtype=np.float16)),
    })


def _timed(fn, repeat: int = 1) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dk", type=int, default=128)
    args = p.parse_args(argv)
    B, T, H, K, L = args.batch, args.length, args.heads, args.dk, args.layers
    layers = [_inputs(B, T, H, K, seed) for seed in range(L)]
    fn = plan(_dataset(B, T, H, K), window=4, device="cuda").fn
    fn(layers[0])  # compile
    print(f"{torch.cuda.get_device_name(0)}: spectra reduction of {L} layers of B={B} T={T} H={H} dk={K} (bf16)")
    whole = _timed(lambda: [fn(x) for x in layers])
    print(f"  plan fn, all layers: {whole:.1f} ms ({whole / L:.2f} a layer)")
    from kernels.triton_token_spectra import token_eigenvalues

    parts = {
        "eig_P (window 1), householder_spectra": lambda x: linalg.token_spectra(x["k"], x["beta"], device="cuda"),
        "eig_P and eig_A (window 1), fused kernel": lambda x: token_eigenvalues(x["k"], x["beta"], x["g"]),
        "window_eig_P (window 4)": lambda x: linalg.token_spectra(x["k"], x["beta"], window=4, stride=4,
                                                                  device="cuda"),
    }
    for name, part in parts.items():
        part(layers[0])  # compile
        ms = _timed(lambda part=part: [part(x) for x in layers])
        print(f"  {name}: {ms:.1f} ms")
    from kernels.spectra import window_keys
    from kernels.triton_eig import householder_eigvals

    x = layers[0]
    keys, betas = window_keys(x["k"], x["beta"], 4, 4)
    keys64, betas64 = keys.reshape(-1, 4, K).double(), betas.reshape(-1, 4).double()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"  window-4 kernel on one layer ({keys64.shape[0]} windows), ms by programs a SM:")
    householder_eigvals(keys64, betas64)  # compile
    for per_sm in (4, 8, 10, 12, 16, 24, 32):
        ms = _timed(lambda per_sm=per_sm: householder_eigvals(keys64, betas64, programs=sms * per_sm), repeat=3)
        print(f"    {per_sm:>3}: {ms:.2f}", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for x in layers:
            fn(x)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
