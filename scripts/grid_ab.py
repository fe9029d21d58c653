"""A/B of delta-rule launch choices at grid points (H = 8, dk = dv = 128, bf16) on the GPU: the default config
against each change given, with fla 0.6.0 in the same run (times as the grid table's: o, final and fp32 boundary
states) and each change's o against the default's.

`python scripts/grid_ab.py --point 1,8192,3,off --point 8,8192,3,on --change out_aqk=False [--profile]`
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

from benchmarks.kernels import fla_call, load_fla, make_inputs, timeit
from kernels.triton_chunk import default_config, triton_delta_product
from scripts.config_ab import _kernels, parse_change

POINTS = ["1,2048,3,off", "1,8192,3,off", "1,8192,3,on", "8,8192,3,on"]


def parse_point(text: str) -> tuple[int, int, int, bool]:
    """'B,T,n_h,on|off' -> (B, T, n_h, gate)."""
    B, T, n_h, gate = text.split(",")
    if gate not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"gate must be on or off, got {gate!r}")
    return int(B), int(T), int(n_h), gate == "on"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--point", action="append", type=parse_point, help="B,T,n_h,on|off (repeatable)")
    p.add_argument("--change", action="append", default=[], type=parse_change, help="k=v[,k=v] of LaunchConfig")
    p.add_argument("--profile", action="store_true", help="also the kernels of each config and fla (GPU ms)")
    args = p.parse_args(argv)
    fla, why = load_fla()
    print(f"fla: {why or 'fla 0.6.0'}; ms (median); o's max rel difference from the default's")
    for B, T, n_h, gate in args.point or [parse_point(x) for x in POINTS]:
        q, k, v, beta, g, _ = make_inputs(B, T, 8, 128, 128, n_h, gate)
        base = default_config(B, 8, 128, n_h, 128)
        run = partial(triton_delta_product, q, k, v, beta, g, normalize_qk=True)
        want = run(config=base)[0].float()
        t_base = timeit(partial(run, config=base))
        t_fla = timeit(partial(fla_call, fla, q, k, v, beta, g)) if fla is not None else float("nan")
        print(f"B={B} T={T} n_h={n_h} gate={'on' if gate else 'off'}: default {t_base:.3f} "
              f"({t_fla / t_base:.2f}x fla), fla {t_fla:.3f}", flush=True)  # fmt: skip
        if args.profile:
            print("      kernels: " + _kernels(partial(run, config=base)))
            if fla is not None:
                print("      fla's kernels: " + _kernels(partial(fla_call, fla, q, k, v, beta, g)))
        for change in args.change:
            cfg = dataclasses.replace(base, **change)
            t = timeit(partial(run, config=cfg))
            diff = float((run(config=cfg)[0].float() - want).abs().max() / want.abs().max())
            print(f"    {change}: {t:.3f} ({t_fla / t:.2f}x fla, default/this {t_base / t:.2f}x), o diff {diff:.0e}",
                  flush=True)  # fmt: skip
            if args.profile:
                print("      kernels: " + _kernels(partial(run, config=cfg)))


if __name__ == "__main__":
    main()
