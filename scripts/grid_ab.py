"""A/B of the delta-rule forward's default launch choices at grid points (H = 8, dk = dv = 128, bf16) on the GPU:
the sixth session's default (one resident program a SM, 2-3 stages, one output key block at dk <= 128) against the
fifth's (stages sized for all programs, a 64-wide output key loop), with fla 0.6.0 in the same run."""

from __future__ import annotations

import dataclasses
from functools import partial

from benchmarks.kernels import fla_call, load_fla, make_inputs, timeit
from kernels.triton_chunk import LaunchConfig, default_config, triton_delta_product

POINTS = [(1, 2048, 3, False), (1, 2048, 3, True), (1, 2048, 1, False), (1, 2048, 1, True), (8, 8192, 3, True)]


def main() -> None:
    fla, why = load_fla()
    print(f"fla: {why or 'fla 0.6.0'}; ms (median); o's max rel difference between the two choices")
    for B, T, n_h, gate in POINTS:
        q, k, v, beta, g, _ = make_inputs(B, T, 8, 128, 128, n_h, gate)
        new = default_config(B, 8, 128, n_h, 128)
        old = dataclasses.replace(new, resident_per_sm=None, state_stages=2, out_bk=LaunchConfig.out_bk)
        run = partial(triton_delta_product, q, k, v, beta, g, normalize_qk=True)
        t_new, t_old = timeit(partial(run, config=new)), timeit(partial(run, config=old))
        o_new, o_old = run(config=new)[0].float(), run(config=old)[0].float()
        diff = float((o_new - o_old).abs().max() / o_old.abs().max())
        t_fla = timeit(partial(fla_call, fla, q, k, v, beta, g)) if fla is not None else float("nan")
        print(f"B={B} T={T} n_h={n_h} gate={'on' if gate else 'off':>3}: new {t_new:.3f} ({t_fla / t_new:.2f}x fla), "
              f"old {t_old:.3f} ({t_fla / t_old:.2f}x), fla {t_fla:.3f}, o diff {diff:.0e}", flush=True)


if __name__ == "__main__":
    main()
