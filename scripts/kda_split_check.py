"""One short GPU run of the KDA forward's prep choices, with fla 0.6.0's chunk_kda in the same run, at two grid
points; errors against the float32 chunked form; then our per-kernel times at the large point.

    python scripts/kda_split_check.py [--persistent]

At B=8 T=8192 H=32 every `SWEEP` config is timed (the split prep's key blocks, warps and register cap);
--persistent adds the persistent prep kernel.
"""

import argparse

import torch

from benchmarks.kda import K, inputs, load_fla, reference, timed
from kernels.triton_kda import KdaConfig, triton_kda

SWEEP = {
    "default": {},
    "inverse kernel": dict(inverse_kernel=True),
    "inverse kernel 2w": dict(inverse_kernel=True, inverse_warps=2),
    "sub-block 2w + inverse": dict(inverse_kernel=True, intra_per_chunk=False, intra_warps=2, intra_maxnreg=None),
    "sub-block 4w + inverse": dict(inverse_kernel=True, intra_per_chunk=False, intra_warps=4),
    "sub-block 4w nocap + inverse": dict(inverse_kernel=True, intra_per_chunk=False, intra_warps=4,
                                         intra_maxnreg=None),
    "sub-block 2w bk16 + inverse": dict(inverse_kernel=True, intra_per_chunk=False, intra_warps=2, intra_bk=16,
                                        intra_maxnreg=None),
    "per chunk 2w + inverse": dict(inverse_kernel=True, intra_chunk_warps=2),
    "wy blocks 4w 32/64": dict(wy_bv=64),
}


def run(x, cfg):
    q, k, v, beta, g = x
    return triton_kda(q, k.unsqueeze(2), v.unsqueeze(2), beta.unsqueeze(2).float(), g, scale=K**-0.5, config=cfg,
                      output_boundary_states=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--persistent", action="store_true", help="also time the persistent prep kernel")
    args = ap.parse_args()
    fla, _ = load_fla()
    print(f"{torch.cuda.get_device_name(0)}: ms (best of 3), error vs float32 chunked form (max rel)")
    for B, T, H in ((8, 8192, 32), (1, 2048, 16)):
        x = inputs(B, T, H, "cuda")
        ref = reference(*x)
        scale = ref.abs().max()
        configs = dict(SWEEP) if B == 8 else {"default": {}}
        if args.persistent:
            configs["persistent"] = dict(split_prep=False)
        for name, kw in configs.items():
            cfg = KdaConfig(**kw)
            try:
                first, ms, out = timed(lambda x=x, cfg=cfg: run(x, cfg))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                print(f"B={B} T={T} H={H} {name:>22}: failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            err = float((out[0].float() - ref).abs().max() / scale)
            split = ""
            if B == 8:  # where the time goes, each config
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    run(x, cfg)
                    torch.cuda.synchronize()
                split = "  " + ", ".join(
                    f"{e.key.strip('_').replace('_kernel', '')} {e.self_device_time_total / 1e3:.2f}"
                    for e in prof.key_averages() if e.key.startswith("_")
                )
            print(f"B={B} T={T} H={H} {name:>22}: {ms:7.2f} ms  first {first:5.1f} s  err {err:.1e}{split}",
                  flush=True)
        if fla is not None:
            first, ms, (o_f, _) = timed(lambda x=x: fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5))
            print(f"B={B} T={T} H={H} {'fla':>22}: {ms:7.2f} ms  first {first:5.1f} s  "
                  f"err {float((o_f.float() - ref).abs().max() / scale):.1e}", flush=True)
        if B == 8:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                run(x, KdaConfig())
                torch.cuda.synchronize()
            ours = [(e.key, e.self_device_time_total / 1e3) for e in prof.key_averages()]
            print("  default per kernel (ms): " + ", ".join(f"{n} {t:.3f}" for n, t in
                                                          sorted(ours, key=lambda r: -r[1])[:5]), flush=True)
            if fla is not None:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5)
                    torch.cuda.synchronize()
                theirs = [(e.key, e.self_device_time_total / 1e3) for e in prof.key_averages()]
                print("  fla per kernel (ms): " + ", ".join(f"{n[:40]} {t:.3f}" for n, t in
                                                            sorted(theirs, key=lambda r: -r[1])[:8]), flush=True)
        del x, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
