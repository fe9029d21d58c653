"""One short GPU run of the KDA forward's prep choices, with fla 0.6.0's chunk_kda in the same run, at two grid
points; errors against the float32 chunked form; then our per-kernel times at the large point.

    python scripts/kda_split_check.py [--persistent] [--shape B,T,H ...]

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


SMALL_SWEEP = {  # few sequences: the sequential state kernel has few programs
    "default": {},
    "state bv 64": dict(state_bv=64),
    "state 2 warps": dict(state_warps=2),
    "state 8 warps": dict(state_warps=8),
    "state 3 stages": dict(state_stages=3),
    "intra 2 warps": dict(intra_chunk_warps=2),
    "output bv 64": dict(out_bv=64),
    "wy bv 64": dict(wy_bv=64),
}


def _shape(text: str) -> tuple[int, int, int]:
    try:
        B, T, H = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: give B,T,H, e.g. 1,8192,32") from None
    return B, T, H


def _profile_line(fn) -> str:
    """Per-kernel ms of one call (torch.profiler), ours (names starting with _) or fla's."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted(((e.key, e.self_device_time_total / 1e3) for e in prof.key_averages()), key=lambda r: -r[1])
    return ", ".join(f"{n.strip('_').replace('_kernel', '')[:40]} {t:.2f}" for n, t in evs if t > 0.005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--persistent", action="store_true", help="also time the persistent prep kernel")
    ap.add_argument("--shape", type=_shape, action="append",
                    help="B,T,H to run SMALL_SWEEP at, with per-kernel times (repeatable; default: the two grid "
                         "points with SWEEP at B=8 T=8192 H=32)")
    args = ap.parse_args()
    fla, _ = load_fla()
    print(f"{torch.cuda.get_device_name(0)}: ms (best of 3), error vs float32 chunked form (max rel)")
    shapes = args.shape or [(8, 8192, 32), (1, 2048, 16)]
    for B, T, H in shapes:
        x = inputs(B, T, H, "cuda")
        ref = reference(*x)
        scale = ref.abs().max()
        profiled = bool(args.shape) or B == 8
        configs = dict(SMALL_SWEEP) if args.shape else dict(SWEEP) if B == 8 else {"default": {}}
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
            split = "  " + _profile_line(lambda x=x, cfg=cfg: run(x, cfg)) if profiled else ""
            print(f"B={B} T={T} H={H} {name:>22}: {ms:7.2f} ms  first {first:5.1f} s  err {err:.1e}{split}",
                  flush=True)
        if fla is not None:
            first, ms, (o_f, _) = timed(lambda x=x: fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5))
            print(f"B={B} T={T} H={H} {'fla':>22}: {ms:7.2f} ms  first {first:5.1f} s  "
                  f"err {float((o_f.float() - ref).abs().max() / scale):.1e}", flush=True)
            if profiled:
                print("  fla per kernel (ms): " + _profile_line(
                    lambda x=x: fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5)), flush=True)
        del x, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
