"""Registers, spills and shared memory of the Triton KDA kernels, compiled for a GPU architecture without a GPU.

Triton compiles ahead of time for a target (default sm_90, Hopper) with its bundled ptxas; `cuobjdump
--dump-resource-usage` reads the cubin. Spills (STACK bytes per thread) were the first thing to remove in the
prep kernel (kernels/NOTES.md). `python -m benchmarks.kda_ptxas [--dtype bf16] [--dk 128] [--dv 128]
[--prep-warps 8] [--prep-bk 32] [--state-bv 64] [--split-prep [--intra-warps 4] [--intra-bk 32]
[--intra-maxnreg 128] [--wy-warps 4]]`; with `--split-prep` the split prep's `_intra_kernel` and `_wy_kernel`
are reported after the persistent prep kernel. Kernels are compiled with the pipeline stages they are launched
with (Triton's default, 3, except the state kernel's `KdaConfig.state_stages`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import deltalab.kernels.delta_rule.triton_kda as tk
import deltalab.kernels.delta_rule.triton_prep as tp

PTR_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def _cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


LAUNCH_STAGES = 3  # Triton's default num_stages (CUDA), which the prep, split prep and output launches get


def resources(
    fn: Any,
    pointers: dict[str, str],
    consts: dict[str, Any],
    warps: int,
    stages: int = LAUNCH_STAGES,
    arch: int = 90,
    maxnreg: int | None = None,
    multiples_of_16: tuple[str, ...] = (),
) -> dict[str, int]:
    """Compile `fn` with `pointers` typed as given (other runtime arguments i32) and return its REG, STACK,
    SHARED (static) and LOCAL bytes from the cubin, and `smem`, the dynamic shared memory Triton asks for.
    Pointers are taken 16-byte aligned, and the integers named in `multiples_of_16` divisible by 16, as a launch
    specialises them: without that hint Triton neither vectorises nor pipelines the tile loads, and the figures
    are not those of the kernel that runs."""
    sig = {n: pointers.get(n, "i32") for n in fn.arg_names}
    sig.update({n: "constexpr" for n in consts})
    hinted = [i for i, n in enumerate(fn.arg_names) if sig[n].startswith("*") or n in multiples_of_16]
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in hinted},
    )
    options = dict(num_warps=warps, num_stages=stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [str(_cuobjdump()), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output: {out[:200]}")
    reg, stack, shared, local = (int(x) for x in found.groups())
    return dict(reg=reg, stack=stack, shared=shared, local=local, smem=int(compiled.metadata.shared))


def report(
    dtype: str = "bf16", dk: int = 128, dv: int = 128, cfg: tk.KdaConfig | None = None, arch: int = 90
) -> dict[str, dict[str, int]]:
    """Resources of the prep, state and output kernels at one shape and launch configuration; with
    cfg.split_prep also the split prep's two kernels ("intra", "wy")."""
    cfg = cfg or tk.KdaConfig()
    t = PTR_DTYPES[dtype]
    BK, BVF = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    F32 = dtype == "fp32"
    common = dict(HV=16, K=dk, V=dv, IS_VARLEN=False, F32=F32, PREC="ieee" if F32 else "tf32")
    f32, i32 = "*fp32", "*i32"
    half = {n: "*" + t for n in ("q", "k", "v", "W", "U", "Kd", "Qd", "Aqk", "D", "o")}
    ptrs = {
        **half,
        **{n: f32 for n in ("beta", "g", "glast", "scratch", "A", "bnd", "ht", "h0")},
        **{n: i32 for n in ("cu", "cidx", "coff", "order")},
        "scale": "fp32",
    }
    BKH = BK // 2 if BK > 128 else BK
    state_bv = min(cfg.state_bv or (64 if dk <= 128 else 32), BVF)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    bound = tk.OWN_PAIRS_BOUND[torch_dtype] if cfg.own_pairs_bound is None else cfg.own_pairs_bound
    in_intra = cfg.intra_per_chunk and cfg.intra_inverts and not cfg.inverse_kernel  # as triton_kda's launch
    inverted = in_intra or cfg.inverse_kernel
    half_t = "*fp32" if F32 else "*" + t  # T from the intra or inverse kernel is in the inputs' type
    intra_ptrs = {**ptrs, "A": half_t} if in_intra else ptrs
    wy_ptrs = {**ptrs, "A": half_t} if inverted else ptrs
    wy_consts = dict(common, HK=8, BK=BK, BKC=min(cfg.wy_bk, BK), BV=min(cfg.wy_bv, BVF), INVERTED=inverted,
                     KD_DIFF=cfg.wy_kd_by_difference and not F32,
                     BLOCKS=cfg.wy_blocks and inverted)
    prep_consts = dict(common, HK=8, BK=BK, BKC=min(cfg.prep_bk, BK), BV=min(cfg.prep_bv, BVF), BOUND=bound)
    split = {}
    if cfg.split_prep:
        intra_consts = {n: prep_consts[n] for n in ("HK", "HV", "K", "BK", "IS_VARLEN", "F32", "PREC", "BOUND")}
        intra_consts.update(BKC=min(cfg.intra_bkc, BK), BKW=min(cfg.intra_bk, BK))
        chunk_consts = dict(intra_consts, BKC=min(cfg.intra_chunk_bk, BK), INVERT=in_intra)
        split = {
            "intra": resources(tk._intra_chunk_kernel, intra_ptrs, chunk_consts, cfg.intra_chunk_warps, arch=arch)
            if cfg.intra_per_chunk
            else resources(tk._intra_kernel, ptrs, intra_consts, cfg.intra_warps, arch=arch, maxnreg=cfg.intra_maxnreg),
            "wy": resources(tk._wy_kernel, wy_ptrs, wy_consts, cfg.wy_warps, arch=arch),
        }
        if cfg.inverse_kernel:
            split["inverse"] = resources(tp._tri_inverse_kernel, {"A": "*fp32", "Ti": half_t},
                                         {"PREC": common["PREC"], "UPPER_ZEROS": True},
                                         2 if F32 else cfg.inverse_warps, arch=arch)
    return {
        "prep": resources(tk._prep_kernel, ptrs, prep_consts, cfg.prep_warps, arch=arch),
        **split,
        "state": resources(
            tk._state_kernel,
            ptrs,
            dict(common, BKH=BKH, SPLIT=BKH < BK, BV=state_bv, HAS_H0=True, STORE_FINAL=True, STORE_BND=True),
            cfg.state_warps,
            cfg.state_stages,
            arch=arch,
        ),
        "output": resources(
            tk._output_kernel, ptrs, dict(common, BK=BK, BV=min(cfg.out_bv, BVF)), cfg.out_warps, arch=arch
        ),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_ptxas", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=list(PTR_DTYPES), default="bf16")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    p.add_argument("--prep-warps", type=int, default=tk.KdaConfig.prep_warps)
    p.add_argument("--prep-bk", type=int, default=tk.KdaConfig.prep_bk)
    p.add_argument("--state-bv", type=int, default=None)
    p.add_argument("--split-prep", action="store_true", help="also the split prep's _intra_kernel and _wy_kernel")
    p.add_argument("--intra-warps", type=int, default=tk.KdaConfig.intra_warps)
    p.add_argument("--intra-bk", type=int, default=tk.KdaConfig.intra_bk)
    p.add_argument("--intra-maxnreg", type=int, default=tk.KdaConfig.intra_maxnreg, help="0: no cap")
    p.add_argument("--intra-bkc", type=int, default=tk.KdaConfig.intra_bkc)
    p.add_argument("--wy-warps", type=int, default=tk.KdaConfig.wy_warps)
    p.add_argument("--wy-bk", type=int, default=tk.KdaConfig.wy_bk)
    p.add_argument("--wy-bv", type=int, default=tk.KdaConfig.wy_bv)
    p.add_argument("--wy-kd-by-difference", action=argparse.BooleanOptionalAction,
                   default=tk.KdaConfig.wy_kd_by_difference, help="Kd's factors from the cumulative sums")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("benchmarks.kda_ptxas compiles for the GPU: run it without TRITON_INTERPRET=1")
    cfg = tk.KdaConfig(
        prep_warps=args.prep_warps,
        prep_bk=args.prep_bk,
        state_bv=args.state_bv,
        split_prep=args.split_prep,
        intra_warps=args.intra_warps,
        intra_bk=args.intra_bk,
        intra_maxnreg=args.intra_maxnreg or None,
        intra_bkc=args.intra_bkc,
        wy_warps=args.wy_warps,
        wy_bk=args.wy_bk,
        wy_bv=args.wy_bv,
        wy_kd_by_difference=args.wy_kd_by_difference,
    )
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.dtype}, dk={args.dk}, dv={args.dv}, {cfg}")
    print(f"{'kernel':>8} {'regs':>5} {'spill B':>8} {'smem B':>8}")
    for name, r in report(args.dtype, args.dk, args.dv, cfg, args.arch).items():
        print(f"{name:>8} {r['reg']:>5} {r['stack'] + r['local']:>8} {r['smem']:>8}")


if __name__ == "__main__":
    main()
