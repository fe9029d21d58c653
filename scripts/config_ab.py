"""A/B of delta-rule launch choices at real-model shapes on the GPU: o+final ms (the benchmark's o+fin column) of the
default config and of each change given, fla 0.6.0 in the same run, and each change's o against the default's.

`python scripts/config_ab.py --shape "Qwen3-Next grouped" --profile --change state_warps=8 --change state_bv=64`
(shapes: the real rows of benchmarks.kernels; sizes 1x32768, 8x4096 and a packed batch of 32,768 tokens). A change
that fails to compile or faults is reported as a row, not raised (a fault ends the CUDA context, so it comes last).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
from functools import partial

import torch

from benchmarks.kernels import REAL_SHAPES, _profile, fla_real_call, load_fla, make_real_inputs, mixed_lengths, timeit
from kernels.triton_chunk import default_config, triton_delta_product


def parse_change(text: str) -> dict:
    """'a=1,b=True' -> {'a': 1, 'b': True} (values are Python literals, never evaluated as code)."""
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        out[key.strip()] = ast.literal_eval(value.strip())
    return out


def _kernels(fn) -> str:
    return ", ".join(f"{k[:20]} {ms:.3f}" for k, ms in _profile(fn)[:6])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", required=True, help="a real row's name (repeatable)")
    p.add_argument("--change", action="append", default=[], type=parse_change, help="k=v[,k=v] of LaunchConfig")
    p.add_argument("--sizes", default="1x32768,8x4096,varlen", help="comma list of BxT or 'varlen'")
    p.add_argument("--profile", action="store_true", help="also each config's kernels (torch.profiler, GPU ms)")
    args = p.parse_args(argv)
    fla_fn, why = load_fla()
    shapes = {s[0]: s for s in REAL_SHAPES}
    lengths = mixed_lengths(32768)
    print(f"{torch.cuda.get_device_name()}; fla: {why or 'fla 0.6.0'}; bf16, gate on, o+fin ms (do_bench median)")
    for name in args.shape:
        _, Hk, Hv, K, V, n_h = shapes[name]
        for size in args.sizes.split(","):
            varlen = size == "varlen"
            B, T = (1, 32768) if varlen else map(int, size.split("x"))
            x = make_real_inputs(B, T, Hk, Hv, K, V, n_h)
            cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda") if varlen else None
            base = default_config(len(lengths) if varlen else B, Hv, V, n_h, K)
            lean = partial(triton_delta_product, *x, normalize_qk=True, cu_seqlens=cu, output_boundary_states=False)
            want = lean(config=base)[0].float()
            t_base = timeit(partial(lean, config=base))
            t_fla = timeit(partial(fla_real_call, *x, cu_seqlens=cu)) if fla_fn is not None else float("nan")
            print(f"{name} {size}: default {t_base:.3f}  fla {t_fla:.3f}  fla/default {t_fla / t_base:.2f}x")
            if args.profile:
                print("      kernels: " + _kernels(partial(lean, config=base)))
            for change in args.change:
                cfg = dataclasses.replace(base, **change)
                try:
                    t = timeit(partial(lean, config=cfg))
                    got = lean(config=cfg)[0].float()
                    err = float((got - want).abs().max() / want.abs().max())
                    print(f"    {change}: {t:.3f} ms  default/this {t_base / t:.2f}x  fla/this {t_fla / t:.2f}x"
                          f"  o rel diff {err:.1e}")  # fmt: skip
                    if args.profile:
                        print("      kernels: " + _kernels(partial(lean, config=cfg)))
                except Exception as exc:  # noqa: BLE001 - a change that does not run is a result
                    print(f"    {change}: failed ({type(exc).__name__}: {str(exc)[:120]})")


if __name__ == "__main__":
    main()
