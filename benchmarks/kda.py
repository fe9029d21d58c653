"""Benchmark: the Kimi Delta Attention forward (per-channel gates) against fla 0.6.0's `chunk_kda`, same run.

Rows: B in {1, 8}, T in {2048, 8192}, H in {16, 32}, dk = dv = 128, bf16 inputs, unit keys, beta in (0, 1),
log decays g in (-0.5, 0) per channel. Ours is `kernels.delta_rule.dispatch.delta_product_forward`, which runs the
Triton KDA forward (`kernels.delta_rule.triton_kda`) on CUDA. Each row: our ms, fla's ms, fla/ours, the first call of
each side, and the same two by triton's do_bench (median of back-to-back calls: host time hidden), the max error of each
against the PyTorch chunked form in float32 (`kernels.delta_rule.chunk`, an independent path) relative to the output's
max. `--budget S` starts no new row after S seconds (fla autotunes at each new shape); `--profile` prints our per-kernel
CUDA times at the last row measured. `python -m benchmarks.kda [--quick] [--shape B,T,H ...] [--budget S] [--profile]`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from deltalab.kernels.delta_rule.chunk import chunk_delta_product
from deltalab.kernels.delta_rule.dispatch import delta_product_forward

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


def bench(fn: Callable[[], Any]) -> float:
    """Median GPU milliseconds of back-to-back calls (triton's do_bench, as `benchmarks.kernels`)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


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
        warnings.simplefilter("error")  # a fallback to the PyTorch form would not be the kernel under test
        return delta_product_forward(q, k.unsqueeze(2), v.unsqueeze(2), beta.unsqueeze(2).float(), g,
                                     scale=K**-0.5)[0]


def ours_lean(q, k, v, beta, g) -> torch.Tensor:
    """Ours returning what fla returns (o and the final state): the Triton KDA forward without boundary states,
    which it then keeps in bf16 for its own output kernel (o bit-identical, tests/kernels/test_triton_kda.py)."""
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    with torch.no_grad():
        return triton_kda(q, k.unsqueeze(2), v.unsqueeze(2), beta.unsqueeze(2).float(), g, scale=K**-0.5,
                          output_boundary_states=False)[0]


def reference(q, k, v, beta, g) -> torch.Tensor:
    """The chunked PyTorch form in float32 on the same (bf16-rounded) inputs."""
    with torch.no_grad():
        x = [t.float() for t in (q, k, v, beta, g)]
        return chunk_delta_product(x[0], x[1].unsqueeze(2), x[2].unsqueeze(2), x[3].unsqueeze(2), x[4],
                                   scale=K**-0.5)[0]


def profile(fn: Callable[[], Any], top: int = 8) -> None:
    """Our per-kernel CUDA times for one call (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top))


def load_fla() -> tuple[Any, str]:
    try:
        from fla.ops.kda import chunk_kda
    except Exception as err:  # noqa: BLE001 - any import failure means no peer
        return None, f"fla is not importable ({type(err).__name__}: {str(err)[:80]}); install fla 0.6.0"
    return chunk_kda, ""


def _shape(text: str) -> tuple[int, int, int]:
    try:
        B, T, H = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give B,T,H as three integers, e.g. 1,8192,32") from None
    if min(B, T, H) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: B, T and H must be positive")
    return B, T, H


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="B=1 and T=2048 only")
    p.add_argument("--shape", type=_shape, action="append", metavar="B,T,H",
                   help="measure only this row (repeatable), e.g. --shape 1,8192,32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=float("inf"), help="start no new row after this many seconds")
    p.add_argument("--profile", action="store_true", help="per-kernel CUDA times of ours at the last row")
    args = p.parse_args(argv)
    start = time.perf_counter()
    fla, why = load_fla()
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"Kimi Delta Attention forward on {name}: ours vs fla 0.6.0 chunk_kda (bf16, dk = dv = 128)")
    if fla is None:
        print(f"   fla column empty: {why}")
    print("   ms: best of 3 wall-clock calls, each synchronised (host time included); bench: median GPU ms of "
          "back-to-back calls (triton do_bench, L2 flushed: host time hidden when the GPU is the bottleneck)")
    print("   o+fin: ours returning what fla returns (o, final state; no fp32 boundary states), by do_bench")
    print(f"{'B':>3} {'T':>6} {'H':>3} {'ours ms':>9} {'fla ms':>9} {'fla/ours':>9} {'ours bench':>11} "
          f"{'fla bench':>10} {'fla/ours':>9} {'o+fin bench':>12} {'fla/o+fin':>10} {'first s ours/fla':>17} "
          f"{'err ours':>9} {'err fla':>9}")
    grid = dict(B=(1,), T=(2048,), H=GRID["H"]) if args.quick else GRID
    rows = args.shape or list(itertools.product(grid["B"], grid["T"], grid["H"]))
    x = None
    ratios: list[tuple[float, tuple[int, int, int]]] = []  # fla / o+fin by do_bench, per row measured
    for i, (B, T, H) in enumerate(rows):
        if time.perf_counter() - start > args.budget:
            print(f"   budget of {args.budget:.0f} s spent: rows not run: {rows[i:]}")
            break
        x = inputs(B, T, H, args.device)
        first_o, ms_o, o = timed(lambda x=x: ours(*x))
        ref = reference(*x)
        scale = ref.abs().max()
        err_o = float((o.float() - ref).abs().max() / scale)
        ms_f = first_f = err_f = bench_f = float("nan")
        cuda = args.device.startswith("cuda")
        bench_o = bench(lambda x=x: ours(*x)) if cuda else float("nan")
        bench_l = bench(lambda x=x: ours_lean(*x)) if cuda else float("nan")
        if fla is not None:
            first_f, ms_f, (o_f, _) = timed(lambda x=x: fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5))
            err_f = float((o_f.float() - ref).abs().max() / scale)
            bench_f = bench(lambda x=x: fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5)) if cuda else float("nan")
        print(f"{B:>3} {T:>6} {H:>3} {ms_o:>9.2f} {ms_f:>9.2f} {ms_f / ms_o:>8.2f}x {bench_o:>11.3f} {bench_f:>10.3f} "
              f"{bench_f / bench_o:>8.2f}x {bench_l:>12.3f} {bench_f / bench_l:>9.2f}x {first_o:>8.1f}/{first_f:<8.1f} "
              f"{err_o:>9.1e} {err_f:>9.1e}", flush=True)
        if not (math.isnan(bench_f) or math.isnan(bench_l)):  # both timed
            ratios.append((bench_f / bench_l, (B, T, H)))
        del ref, o
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if ratios:
        worst, where = min(ratios)
        verdict = "met" if worst >= 1.0 else "NOT MET"
        print(f"   target >= 1.0x fla at every row measured (o+fin, do_bench): {verdict} (worst {worst:.2f}x at "
              f"B={where[0]} T={where[1]} H={where[2]}; {len(ratios)} of {len(rows)} rows)")
    if args.profile and x is not None and args.device.startswith("cuda"):
        profile(lambda: ours(*x))


if __name__ == "__main__":
    main()
