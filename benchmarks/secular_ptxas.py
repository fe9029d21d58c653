"""Registers, spills and shared memory of the Triton secular-solver kernels (`kernels.linalg.triton_secular`), compiled
for a GPU architecture without a GPU (Triton's bundled ptxas; see `benchmarks.kda_ptxas`). It also catches
compile errors that TRITON_INTERPRET=1 does not. `python -m benchmarks.secular_ptxas [--dk 128] [--arch 90]`.
"""

from __future__ import annotations

import argparse
import os

import triton

import deltalab.kernels.linalg.triton_secular as ts
from benchmarks.kda_ptxas import resources

POINTERS = {"DP": "*fp64", "Z": "*fp64", "RHO": "*fp64", "DPO": "*fp64", "ZO": "*fp64", "KEPT": "*i8",
            "LAM": "*fp64", "STEPS": "*i32"}
POINTERS32 = {"DP": "*fp32", "Z": "*fp32", "RHO": "*fp32", "PK": "*i64", "LAM": "*fp32", "NK": "*i32", "RW": "*fp32",
              "STEPS": "*i32"}


def report(dk: int = 128, arch: int = 90) -> dict[str, dict[str, int]]:
    """Resources of the deflation and root kernels (float64, float32-then-float64 `mixed`, `counted`: the
    counted-loop form of `for_loop=True`, and the float32 path's, `roots32/lanes` at 32, 64, 128 lanes) at the launch
    configuration `secular_eigvals` uses for dk. Every constexpr is named: a missing one would compile as an i32."""
    block = triton.next_power_of_2(dk)
    br, bp = min(block, ts.BLOCK_R), min(block, ts.BLOCK_P)
    roots = dict(BLOCK_R=br, BLOCK_P=bp, NP=triton.cdiv(dk, bp), EPS_C=ts.EPS, EPS32_C=ts.EPS32, GUESS=True)
    return {
        "deflate": resources(ts._deflate_kernel, POINTERS, dict(BLOCK=block, EPS_C=ts.EPS), 1, arch=arch),
        "roots": resources(ts._roots_kernel, POINTERS, dict(roots, MIXED=False), ts.NUM_WARPS, arch=arch),
        "mixed": resources(ts._roots_kernel, POINTERS, dict(roots, MIXED=True), ts.NUM_WARPS, arch=arch),
        "counted": resources(ts._roots_kernel, POINTERS, dict(roots, MIXED=False, FOR_LOOP=True), ts.NUM_WARPS,
                             arch=arch),
        "deflate32": resources(ts._deflate32_kernel, POINTERS32, dict(BLOCK=block, EPS_C=ts.EPS32), 1, arch=arch),
        **{f"roots32/{lanes}": resources(ts._roots32_kernel, POINTERS32,
                                         dict(LANES=lanes, EPS_C=ts.EPS32, GUESS=True, ERR_STOP=True, FAST_RCP=True),
                                         lanes // 32, arch=arch) for lanes in (32, 64, 128)},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.secular_ptxas", description=__doc__.splitlines()[0])
    p.add_argument("--dk", type=int, nargs="+", default=[64, 128])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("benchmarks.secular_ptxas compiles for the GPU: run it without TRITON_INTERPRET=1")
    print(f"Triton {triton.__version__}, sm_{args.arch}")
    print(f"{'dk':>5} {'kernel':>12} {'regs':>5} {'spill B':>8} {'smem B':>8}")
    for dk in args.dk:
        for name, r in report(dk, args.arch).items():
            print(f"{dk:>5} {name:>12} {r['reg']:>5} {r['stack'] + r['local']:>8} {r['smem']:>8}")


if __name__ == "__main__":
    main()
