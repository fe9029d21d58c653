"""Registers, spills and shared memory of the Triton KDA kernels, compiled for a GPU architecture without a GPU.

Triton compiles ahead of time for a target (default sm_90, Hopper) with its bundled ptxas; `cuobjdump
--dump-resource-usage` reads the cubin. Spills (STACK bytes per thread) were the first thing to remove in the
prep kernels (kernels/NOTES.md). `python -m benchmarks.kda_ptxas [--dtype bf16] [--dk 128] [--dv 128]
[--state-bv 64]`: the intra, inverse, WY, state and output kernels as `triton_kda` launches them, each with the
pipeline stages it is launched with (Triton's default, 3, except the state kernel's `triton_kda.STATE_STAGES` and
the output kernel's `OUT_STAGES`).
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
    """Resources of the intra, inverse, WY, state and output kernels at one shape, launched as `triton_kda` does."""
    cfg = cfg or tk.KdaConfig()
    t = PTR_DTYPES[dtype]
    BK, BVF = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    F32 = dtype == "fp32"
    common = dict(HV=16, K=dk, V=dv, IS_VARLEN=False, F32=F32, PREC="ieee" if F32 else "tf32")
    f32, i32 = "*fp32", "*i32"
    half = {n: "*" + t for n in ("q", "k", "v", "W", "U", "Kd", "Qd", "Aqk", "D", "o")}
    ptrs = {
        **half,
        **{n: f32 for n in ("beta", "g", "glast", "A", "bnd", "ht", "h0")},
        **{n: i32 for n in ("cu", "cidx", "coff", "order")},
        "scale": "fp32",
    }
    BKH = BK // 2 if BK > 128 else BK
    state_bv = min(cfg.state_bv or (64 if dk <= 128 else 32), BVF)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    half_t = "*fp32" if F32 else "*" + t  # T from the inverse kernel is in the inputs' type
    intra = dict(HK=8, HV=common["HV"], K=dk, BK=BK, BKC=min(tk.PREP_BK, BK), BKW=min(tk.PREP_BKW, BK),
                 IS_VARLEN=False, F32=F32, PREC=common["PREC"], BOUND=tk.OWN_PAIRS_BOUND[torch_dtype])
    wy = dict(common, HK=8, BK=BK, BKC=min(tk.WY_BK, BK), BV=min(tk.WY_BV, BVF), KD_DIFF=not F32)
    state = dict(common, BKH=BKH, SPLIT=BKH < BK, BV=state_bv, HAS_H0=True, STORE_FINAL=True, STORE_BND=True)
    return {
        "intra": resources(tk._intra_chunk_kernel, ptrs, intra, tk.PREP_WARPS, arch=arch),
        "inverse": resources(tp._tri_inverse_kernel, {"A": "*fp32", "Ti": half_t}, {"PREC": common["PREC"]},
                             2 if F32 else tk.INV_WARPS, arch=arch),
        "wy": resources(tk._wy_kernel, {**ptrs, "A": half_t}, wy, tk.WY_WARPS, arch=arch),
        "state": resources(tk._state_kernel, ptrs, state, tk.STATE_WARPS, tk.STATE_STAGES, arch=arch),
        "output": resources(tk._output_kernel, ptrs, dict(common, BK=min(tk.OUT_BK, BK), BV=min(tk.OUT_BV, BVF)),
                            tk.OUT_WARPS, tk.OUT_STAGES, arch=arch),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_ptxas", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=list(PTR_DTYPES), default="bf16")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    p.add_argument("--state-bv", type=int, default=None)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("benchmarks.kda_ptxas compiles for the GPU: run it without TRITON_INTERPRET=1")
    cfg = tk.KdaConfig(state_bv=args.state_bv)
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.dtype}, dk={args.dk}, dv={args.dv}, {cfg}")
    print(f"{'kernel':>8} {'regs':>5} {'spill B':>8} {'smem B':>8}")
    for name, r in report(args.dtype, args.dk, args.dv, cfg, args.arch).items():
        print(f"{name:>8} {r['reg']:>5} {r['stack'] + r['local']:>8} {r['smem']:>8}")


if __name__ == "__main__":
    main()
