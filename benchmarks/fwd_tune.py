"""Where the forward's time goes at the points that miss fla (B=8, T=8192): per-kernel profile, then a
sweep of launch configs. `python -m benchmarks.fwd_tune [--points 8,8192,3,1 ...] [--json out.json]` (GPU)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial

import torch

from benchmarks.kernels import fla_call, load_fla, make_inputs, timeit
from kernels.triton_chunk import default_config, triton_delta_product


def profile(fn, reps: int = 5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    fn()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = {e.key[:48]: e.device_time_total / reps / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
    return dict(sorted(evs.items(), key=lambda x: -x[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="*", default=["8,8192,3,1", "8,8192,3,0", "8,8192,2,0", "8,2048,3,0"])
    ap.add_argument("--json")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    fla, _ = load_fla()
    out = []
    for p in args.points:
        B, T, n_h, gate = (int(x) for x in p.split(","))
        x = make_inputs(B, T, 8, 128, 128, n_h, bool(gate))[:5]
        base = default_config(B, 8, 128, n_h)
        rec = dict(point=p, base=repr(base))
        rec["fla_ms"] = timeit(partial(fla_call, fla, *x)) if fla else float("nan")
        rec["ours_ms"] = timeit(partial(triton_delta_product, *x, normalize_qk=True, config=base))
        rec["profile_ours"] = profile(partial(triton_delta_product, *x, normalize_qk=True, config=base))
        if fla:
            rec["profile_fla"] = profile(partial(fla_call, fla, *x))
        print(f"== {p}: ours {rec['ours_ms']:.3f} ms, fla {rec['fla_ms']:.3f} ms", flush=True)
        for who in ("profile_ours", "profile_fla"):
            print(f"   {who}: " + ", ".join(f"{k} {v:.3f}" for k, v in rec.get(who, {}).items()), flush=True)
        if not args.no_sweep:
            cands = [replace(base, state_bv=bv) for bv in (32, 64, 128) if bv != base.state_bv] + [
                replace(base, state_warps=8),
                replace(base, state_stages=1),
                replace(base, state_stages=3),
                replace(base, wu_warps=8),
            ]
            sweep = {}
            for c in cands:
                try:
                    sweep[repr(c)] = timeit(partial(triton_delta_product, *x, normalize_qk=True, config=c))
                except Exception as exc:  # noqa: BLE001
                    sweep[repr(c)] = float("inf")
                    print(f"   failed {c}: {exc}"[:200], flush=True)
                diff = {k: v for k, v in vars(c).items() if getattr(base, k) != v}
                print(f"   {diff}: {sweep[repr(c)]:.3f} ms", flush=True)
            rec["sweep"] = sweep
        out.append(rec)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
