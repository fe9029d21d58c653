"""The delta-rule forward's T = (I + A)^-1 kernel: in registers by 16 x 16 blocks (`LaunchConfig.tri_blocks`, the
default) against the scratch kernel, at real-model and grid shapes on the GPU (o+fin, ms), with fla 0.6.0."""

from __future__ import annotations

import dataclasses
from functools import partial

from benchmarks.kernels import fla_call, fla_real_call, load_fla, make_inputs, make_real_inputs, timeit
from kernels.triton_chunk import default_config, triton_delta_product

# (name, B, T, Hk, Hv, K, V, n_h); "grid": H = 8, dk = dv = 128, gate on
SHAPES = [("Qwen3-Next", 8, 4096, 16, 32, 128, 128, 1), ("Qwen3-Next", 1, 32768, 16, 32, 128, 128, 1),
          ("GDN default", 8, 4096, 6, 6, 256, 512, 1), ("grid n_h=3", 8, 8192, 8, 8, 128, 128, 3),
          ("grid n_h=1", 8, 8192, 8, 8, 128, 128, 1)]  # fmt: skip


def main() -> None:
    fla, why = load_fla()
    print(f"fla: {why or 'fla 0.6.0'}; o+fin ms (median); o's max rel difference between the two kernels")
    for name, B, T, Hk, Hv, K, V, n_h in SHAPES:
        if name.startswith("grid"):
            x = make_inputs(B, T, Hv, K, V, n_h, True)[:5]
            peer = partial(fla_call, fla, *x) if fla is not None else None
        else:
            x = make_real_inputs(B, T, Hk, Hv, K, V, n_h)
            peer = partial(fla_real_call, *x) if fla is not None else None
        base = default_config(B, Hv, V, n_h, K)
        run = partial(triton_delta_product, *x, normalize_qk=True, output_boundary_states=False)
        t_new = timeit(partial(run, config=base))
        t_old = timeit(partial(run, config=dataclasses.replace(base, tri_blocks=False)))
        o_new, o_old = run(config=base)[0].float(), run(config=dataclasses.replace(base, tri_blocks=False))[0].float()
        diff = float((o_new - o_old).abs().max() / o_old.abs().max())
        t_fla = timeit(peer) if peer is not None else float("nan")
        print(f"{name:>12} {B}x{T}: blocks {t_new:.3f} ({t_fla / t_new:.2f}x fla), scratch {t_old:.3f} "
              f"({t_fla / t_old:.2f}x), fla {t_fla:.3f}, o diff {diff:.0e}", flush=True)


if __name__ == "__main__":
    main()
