"""Data-parallel capture on several GPUs against one process on one GPU: the same store.

The same data spec is captured twice, once in one process on cuda:0 and once under `torchrun --nproc-per-node N`
(NCCL, each rank on its own GPU writing only its own chunks); the two stores must hold the same values. The times
(wall, with process start, imports and NCCL setup; and the slowest rank's in-process capture) are printed, not
asserted. A small capture first warms the Triton kernel cache, so neither timed run compiles. The CPU form of the
same check (gloo) is tests/store/test_capture.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = str(ROOT / "models" / "zoo" / "s4-deltaproduct2")
DATA = "S4:length=512,samples=256,seed=3"


def _run(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds of the command, slowest rank's in-process capture seconds from its summary line)."""
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=540)
    assert res.returncode == 0, f"failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-3000:]}"
    wall = time.perf_counter() - t0
    summaries = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return wall, max((float(s["seconds"]) for s in summaries), default=float("nan"))


@pytest.mark.multi_gpu
def test_data_parallel_capture_matches_one_gpu(tmp_path):
    import torch

    from deltalab import store

    gpus = torch.cuda.device_count()
    capture = [sys.executable, "-m", "deltalab.store.capture_dist"]
    common = [CHECKPOINT, "--data", DATA, "--batch-size", "64", "--device", "cuda", "--no-progress"]
    _run([*capture, CHECKPOINT, "--data", "S4:length=512,samples=2,seed=0", "--device", "cuda",
          "--out", str(tmp_path / "warm.zarr"), "--no-progress"])
    t_dist, c_dist = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(gpus), "-m", "deltalab.store.capture_dist", *common, "--out", str(tmp_path / "d.zarr")])
    t_single, c_single = _run([*capture, *common, "--out", str(tmp_path / "s.zarr")])

    dist, single = store.open(tmp_path / "d.zarr"), store.open(tmp_path / "s.zarr")
    assert dist.sizes["seq"] == single.sizes["seq"] == 256
    if "complete" in dist:
        assert bool(np.asarray(dist["complete"].values).all())
    assert set(dist.data_vars) == set(single.data_vars)
    for name in single.data_vars:  # the tolerance of the CPU (gloo) check in test_capture.py
        np.testing.assert_allclose(dist[name].values, single[name].values, rtol=1e-6, atol=1e-7, err_msg=name)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "d.zarr") for f in fs)
    print(f"{gpus} ranks: wall {t_single:.1f} -> {t_dist:.1f} s ({t_single / t_dist:.2f}x), capture {c_single:.1f} "
          f"-> {c_dist:.1f} s ({c_single / c_dist:.2f}x), {size} bytes on disk")
