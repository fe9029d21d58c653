"""Data-parallel capture on N GPUs against one: `python scripts/dist_capture_check.py [--gpus 2] [--json OUT]`.

Captures the same data spec twice, once in one process on cuda:0 and once under
`torchrun --nproc-per-node N` (NCCL, each rank on its own GPU writing only its own chunks), checks that
the two stores hold the same values, and prints the times and their ratio: wall (with process start,
imports and NCCL setup) and in-process capture (the slowest rank's). A small capture first warms
the Triton kernel cache, so neither timed run compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def run(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds of the command, slowest rank's in-process capture seconds from its summary line)."""
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    summaries = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return wall, max((float(s["seconds"]) for s in summaries), default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="models/zoo/s4-deltaproduct2")
    ap.add_argument("--data", default="S4:length=512,samples=1024,seed=3")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/dist-check")
    ap.add_argument("--device", default="cuda", help="cuda (NCCL, one GPU per rank) or cpu (gloo)")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    single, dist = f"{args.workdir}/single.zarr", f"{args.workdir}/dist.zarr"
    common = [args.checkpoint, "--data", args.data, "--batch-size", str(args.batch_size), "--device", args.device]
    # warm-up: compile the Triton kernels into the on-disk cache, so neither timed run pays for it
    run([sys.executable, "-m", "deltalab.store.capture_dist", args.checkpoint,
         "--data", "S4:length=512,samples=2,seed=0",
         "--device", args.device, "--out", f"{args.workdir}/warm.zarr", "--no-progress"])
    t_dist, c_dist = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.gpus),
            "-m",
            "deltalab.store.capture_dist",
            *common,
            "--out",
            dist,
            "--no-progress",
        ]
    )
    t_single, c_single = run([sys.executable, "-m", "deltalab.store.capture_dist", *common, "--out", single,
                              "--no-progress"])

    from deltalab import store

    a, b = store.open(dist), store.open(single)
    diffs = {}
    for name in b.data_vars:
        x, y = np.asarray(a[name].values, dtype=np.float64), np.asarray(b[name].values, dtype=np.float64)
        diffs[name] = float(np.nanmax(np.abs(x - y))) if x.size else 0.0
    result = dict(
        gpus=args.gpus,
        data=args.data,
        sequences=int(a.sizes["seq"]),
        complete=int(np.asarray(a["complete"].values).sum()) if "complete" in a else None,
        seconds_single=t_single,
        seconds_dist=t_dist,
        speedup=t_single / t_dist,
        capture_seconds_single=c_single,
        capture_seconds_dist=c_dist,
        capture_speedup=c_single / c_dist,
        max_abs_diff=diffs,
        bytes_on_disk=sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dist) for f in fs),
    )
    print(f"{'':>22}{'1 rank':>10}{f'{args.gpus} ranks':>10}   ({args.device})")
    print(f"{'wall seconds':>22}{t_single:>10.1f}{t_dist:>10.1f}")
    print(f"{'speed-up (1 / N ranks)':>22}{'':>10}{result['speedup']:>10.2f}")
    print(f"{'capture seconds':>22}{c_single:>10.1f}{c_dist:>10.1f}   (in-process, slowest rank)")
    print(f"{'speed-up (1 / N ranks)':>22}{'':>10}{result['capture_speedup']:>10.2f}")
    print(f"sequences {result['sequences']}, largest |dist - single| over variables: {max(diffs.values()):.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
