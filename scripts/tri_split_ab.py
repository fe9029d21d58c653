"""A/B of the delta rule's split T kernels (`LaunchConfig.tri_split`: `_kkt_kernel` + `_tri_inverse_kernel`) against
the one-kernel `_tri_kernel` at real-model shapes on the GPU: whole-forward o+final ms (the lean call the benchmark's
o+fin column times) for split off / on and fla 0.6.0 in the same run, o's max abs difference between off and on, a
per-kernel CUDA profile of the split forward, and the split kernels' own times under a few launch choices.

`python scripts/tri_split_ab.py [--no-fla] [--no-sweep]` (86 s on an H100 with fla's autotune cache; the sweep
compiles 16 launch variants, and fla autotunes each shape it has no cache for for about a minute)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from functools import partial

import torch

import benchmarks.kernels as bk
from benchmarks.kernels import fla_real_call, load_fla, make_real_inputs, mixed_lengths, timeit
from kernels.triton_chunk import default_config, triton_delta_product

# (name, Hk, Hv, dk, dv); sizes (B, T) or ("varlen", total tokens)
SHAPES = [
    ("GDN default", 6, 6, 256, 512, [(1, 32768), (8, 4096)]),
    ("Qwen3-Next", 16, 32, 128, 128, [(1, 32768), (8, 4096), ("varlen", 32768)]),
]
PROFILE_AT = ("Qwen3-Next", 1, 32768)
# launch choices of the split kernels, timed kernel by kernel (profiler) at the first size of each shape
SWEEP = [dict(), dict(kkt_warps=8), dict(kkt_bk=32), dict(kkt_bk=128), dict(kkt_stages=3), dict(inv_warps=1),
         dict(inv_warps=4), dict(inv_warps=8)]  # fmt: skip


def _kernel_ms(fn, names: tuple[str, ...]) -> dict[str, float]:
    """GPU ms per call of the kernels whose names start with one of `names` (torch.profiler)."""
    evs = bk._profile(fn, reps=5)
    return {n: sum(ms for k, ms in evs if k.startswith(n)) for n in names}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-fla", action="store_true", help="skip fla (its first call at a shape autotunes)")
    p.add_argument("--no-sweep", action="store_true", help="skip the split kernels' launch choices")
    args = p.parse_args(argv)
    bk.NO_FLA = args.no_fla
    fla, why = load_fla()
    t_start = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}; fla: {why or 'fla 0.6.0'}; bf16, gate on, beta in (0, 2), normalize_qk")
    print("o+fin ms (median, triton do_bench); 'o diff': max |o_on - o_off| (and relative to max |o_off|)")
    print(f"{'shape':>12} {'B x T':>10} {'off':>7} {'on':>7} {'fla':>7} {'on/off':>7} {'fla/on':>7} {'fla/off':>7}"
          f" {'o diff':>9} {'rel':>8}")  # fmt: skip
    lengths = mixed_lengths(32768)
    for name, Hk, Hv, K, V, sizes in SHAPES:
        for i, (B, T) in enumerate(sizes):
            varlen = B == "varlen"
            x = make_real_inputs(1 if varlen else B, T, Hk, Hv, K, V, 1)
            cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda") if varlen else None
            split = default_config(len(lengths) if varlen else B, Hv, V, 1, K)  # the split is the default
            base = dataclasses.replace(split, tri_split=False)
            lean = partial(triton_delta_product, *x, normalize_qk=True, cu_seqlens=cu, output_boundary_states=False)
            o_off, o_on = lean(config=base)[0].float(), lean(config=split)[0].float()  # compiles both
            t_off, t_on = timeit(partial(lean, config=base)), timeit(partial(lean, config=split))
            t_fla = float("nan")
            if fla is not None:
                try:
                    t_fla = timeit(partial(fla_real_call, *x, cu_seqlens=cu))
                except Exception as exc:  # noqa: BLE001 - a shape fla refuses is a result
                    print(f"   fla failed: {type(exc).__name__}: {str(exc)[:120]}")
            diff = float((o_on - o_off).abs().max())
            size = f"varlen {len(lengths)}" if varlen else f"{B}x{T}"
            print(f"{name:>12} {size:>10} {t_off:7.3f} {t_on:7.3f} {t_fla:7.3f} {t_off / t_on:6.2f}x "
                  f"{t_fla / t_on:6.2f}x {t_fla / t_off:6.2f}x {diff:9.2e} {diff / float(o_off.abs().max()):8.1e}",
                  flush=True)  # fmt: skip
            if (name, B, T) == PROFILE_AT:
                for label, cfg in (("split on", split), ("split off", base)):
                    evs = bk._profile(partial(lean, config=cfg))
                    print(f"   profile {label} {name} {size} (ms/call): "
                          + ", ".join(f"{k[:26]} {ms:.3f}" for k, ms in evs[:8]), flush=True)  # fmt: skip
            if i == 0 and not args.no_sweep:  # the split kernels' launch choices, kernel by kernel
                row = []
                for kw in SWEEP:
                    try:
                        ms = _kernel_ms(partial(lean, config=dataclasses.replace(split, **kw)),
                                        ("_kkt_kernel", "_tri_inverse_kernel"))  # fmt: skip
                        kkt, inv = ms["_kkt_kernel"], ms["_tri_inverse_kernel"]
                        row.append(f"{kw or 'default'}: kkt {kkt:.3f} inv {inv:.3f}")
                    except Exception as exc:  # noqa: BLE001 - a choice that does not compile is a result
                        row.append(f"{kw}: {type(exc).__name__}")
                old = _kernel_ms(partial(lean, config=base), ("_tri_kernel",))["_tri_kernel"]
                print(f"   split kernels {name} {size} (ms; _tri_kernel {old:.3f}): " + "; ".join(row), flush=True)
            del x, o_off, o_on
            torch.cuda.empty_cache()
    print(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
