"""Where the time goes in kernels.attention_triton on a GPU: each step timed and printed as it finishes.

    python scripts/attention_diag.py [--T 256 1024 4096] [--n-h 1] [--gate scalar]
A traceback of every thread is printed every 45 s while a step runs (faulthandler), so a hang shows where it is.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from functools import partial

import torch


def step(name: str, fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(f"  {name}: {time.perf_counter() - t:.2f} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--n-h", type=int, default=1)
    p.add_argument("--gate", default="scalar")
    a = p.parse_args()
    faulthandler.dump_traceback_later(45, repeat=True, file=sys.stderr)
    from kernels.attention import chunk_recurrence, delta_attention
    from kernels.attention_triton import triton_attention
    from tests.kernels.test_attention_triton import make_inputs

    for T in a.T:
        print(f"T={T} n_h={a.n_h} gate={a.gate}", flush=True)
        x = make_inputs(1, T, 1, 2, 128, 128, a.n_h, a.gate, device="cuda", decay=0.05)
        args, s0 = x[:5], x[5]
        w = (max(0, T - 1024), T)
        top = dict(initial_state=s0, top_k=8, rank_by="contribution")
        for i in range(2):
            step(f"triton window {w} (call {i})", partial(triton_attention, *args, initial_state=s0, window=w))
        step("float64 chunked window", partial(delta_attention, *args, initial_state=s0, window=w))
        step("float64 chunk_recurrence", partial(chunk_recurrence, *args, initial_state=s0))
        for i in range(2):
            step(f"triton top8 (call {i})", partial(triton_attention, *args, **top))
        step("float64 chunked top8", partial(delta_attention, *args, **top))

if __name__ == "__main__":
    main()
