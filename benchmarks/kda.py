"""Benchmark: the Kimi Delta Attention forward (per-channel gates) against fla 0.6.0's `chunk_kda`, same run.

Rows: B in {1, 8}, T in {2048, 8192}, H in {16, 32}, dk = dv = 128, bf16 inputs, unit keys, beta in (0, 1),
log decays g in (-0.5, 0) per channel. Ours is `kernels.dispatch.delta_product_forward` (per-channel gates run
the chunked PyTorch form, `kernels.chunk._channel_gate_factors`; there is no Triton KDA kernel yet). Each row:
our ms, fla's ms, fla/ours, the first call of each side, and the max error of each against a float32 reference
(ours in float32) relative to the output's max. `python -m benchmarks.kda [--quick]`.
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kernels.dispatch import delta_product_forward

GRID = dict(B=(1, 8), T=(2048, 8192), H=(16, 32))
K = V = 128


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, float, Any]:
    """(first call s, best of `repeat` ms, last result)."""
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return first, best * 1e3, out


def inputs(B: int, T: int, H: int, device: str, dtype=torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g_ = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_)
    beta = torch.rand(B, T, H, generator=g_)
    g = -0.5 * torch.rand(B, T, H, K, generator=g_)
    return tuple(x.to(device=device, dtype=dtype if x is not g else torch.float32) for x in (q, k, v, beta, g))


def ours(q, k, v, beta, g) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dispatcher's one-line note that per-channel gates skip Triton
        return delta_product_forward(q, k.unsqueeze(2), v.unsqueeze(2), beta.unsqueeze(2).float(), g,
                                     scale=K**-0.5)[0]


def load_fla() -> tuple[Any, str]:
    try:
        from fla.ops.kda import chunk_kda
    except Exception as err:  # noqa: BLE001 - any import failure means no peer
        return None, f"fla is not importable ({type(err).__name__}: {str(err)[:80]}); install fla 0.6.0"
    return chunk_kda, ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="B=1 and T=2048 only")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    fla, why = load_fla()
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"Kimi Delta Attention forward on {name}: ours vs fla 0.6.0 chunk_kda (bf16, dk = dv = 128)")
    if fla is None:
        print(f"   fla column empty: {why}")
    print(f"{'B':>3} {'T':>6} {'H':>3} {'ours ms':>9} {'fla ms':>9} {'fla/ours':>9} {'first s ours/fla':>17} "
          f"{'err ours':>9} {'err fla':>9}")
    grid = dict(B=(1,), T=(2048,), H=GRID["H"]) if args.quick else GRID
    for B, T, H in itertools.product(grid["B"], grid["T"], grid["H"]):
        x = inputs(B, T, H, args.device)
        first_o, ms_o, o = timed(lambda x=x: ours(*x))
        ref = ours(*(t.float() for t in x))
        scale = ref.abs().max()
        err_o = float((o.float() - ref).abs().max() / scale)
        ms_f = first_f = err_f = float("nan")
        if fla is not None:
            first_f, ms_f, (o_f, _) = timed(lambda x=x: fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5))
            err_f = float((o_f.float() - ref).abs().max() / scale)
        print(f"{B:>3} {T:>6} {H:>3} {ms_o:>9.2f} {ms_f:>9.2f} {ms_f / ms_o:>8.2f}x {first_o:>8.1f}/{first_f:<8.1f} "
              f"{err_o:>9.1e} {err_f:>9.1e}", flush=True)
        del x
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
