"""Exact attention map benchmark: `python -m benchmarks.attention [--T 4096] [--n-h 1 2] [--gate scalar channel]`.

Full rows of alpha for a T-token window of one head (B = 1, dk = dv = 128), one row per (n_h, gate), gate
'scalar' ([B, T, H]) or 'channel' (per-channel, Kimi Delta Attention [B, T, H, dk]); every column of a row is
measured in the same run on the same device:
- `triton`: kernels.attention.triton_attention.triton_attention (float32 inputs; 'tf32x3' dot: float32 accuracy on
tensor
  cores), full rows;
- `triton_top8`: the same with top_k=8 (ranked by contribution): the running top-k inside the kernel;
- `chunked_fp32` / `chunked_fp64`: kernels.attention.chunk.delta_attention in float32 / float64 (the float64 one is
  what the GPU tests compare against);
- `reference_fp64` (extrapolated): the float64 oracle kernels.attention.naive.naive_attention (dense transitions
  multiplied out), timed on a short window and scaled by the number of (query, source) pairs;
- `dense_phi` (extrapolated): materialising every Phi(t, u) as a dk x dk matrix (P <- P A_u walking back from
  each query), timed on a few query rows and scaled likewise.
Accuracy: the triton rows against the float64 chunked form (max relative error over the window).
`--quick`: T = 128, n_h = 2, both gates, one timed call (a smoke run; on the CPU with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from deltalab.kernels.attention.chunk import delta_attention
from deltalab.kernels.attention.naive import naive_attention, transitions


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int = 3) -> float:
    """Best of `repeat` wall times in ms, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def dense_phi_rows(q, k, beta, g, rows: list[int]) -> torch.Tensor:
    """alpha rows by materialising Phi(t, u) densely: [len(rows), T, n_h] for one head (float64)."""
    B, T, n_h, H, K = k.shape
    A = transitions(k.double(), beta.double(), None if g is None else g.double(), H)[0, :, :, 0]  # [T, n_h, K, K]
    out = torch.zeros(len(rows), T, n_h, dtype=torch.float64, device=k.device)
    scale = K**-0.5
    for i, t in enumerate(rows):
        phi = torch.eye(K, dtype=torch.float64, device=k.device)
        for s in range(t, -1, -1):
            for j in range(n_h - 1, -1, -1):
                out[i, s, j] = scale * beta[0, s, j, 0] * (q[0, t, 0].double() @ phi @ k[0, s, j, 0].double())
                phi = phi @ A[s, j]
    return out


def make_inputs(T: int, n_h: int, gate: str, device: str) -> list[torch.Tensor]:
    """Float32 inputs of one head: q, k (unit), v, beta in [0, 2), log-decays in [-0.05, 0] (scalar or per channel)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, 1, 128, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, n_h, 1, 128, generator=gen), dim=-1)
    v = torch.randn(1, T, n_h, 1, 128, generator=gen)
    beta = torch.rand(1, T, n_h, 1, generator=gen) * 2
    g = -torch.rand(1, T, 1, *((128,) if gate == "channel" else ()), generator=gen) * 0.05
    return [t.to(device) for t in (q, k, v, beta, g)]


def bench_one(T: int, n_h: int, gate: str, device: str, sample_rows: int, repeat: int = 3) -> dict:
    """One table row: times in ms (measured, or extrapolated where named so) and the triton rows' error."""
    from deltalab.kernels.attention.triton_attention import triton_attention

    x = make_inputs(T, n_h, gate, device)
    x64 = [t.double() for t in x]
    row = dict(T=T, n_h=n_h, gate=gate, device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
    row["triton_ms"] = timed(partial(triton_attention, *x), device, repeat)
    row["triton_top8_ms"] = timed(partial(triton_attention, *x, top_k=8, rank_by="contribution"), device, repeat)
    row["chunked_fp32_ms"] = timed(partial(delta_attention, *x), device, repeat)
    row["chunked_fp64_ms"] = timed(partial(delta_attention, *x64), device, repeat=1)
    pairs = T * (T + 1) / 2  # (query, source-token) pairs of the whole window
    # the oracle's cost is per (query, sub-step) pair: time it on a short window and scale
    t_short = max(sample_rows, 32)
    ms_short = timed(partial(naive_attention, *(t[:, :t_short] for t in x)), device, repeat=1)
    row["reference_fp64_ms_extrapolated"] = ms_short * pairs / (t_short * (t_short + 1) / 2)
    sample = list(range(T - sample_rows, T))
    ms_dense = timed(partial(dense_phi_rows, x[0], x[1], x[3], x[4], sample), device, repeat=1)
    row["dense_phi_ms_extrapolated"] = ms_dense * pairs / sum(t + 1 for t in sample)
    got = triton_attention(*x).weights
    want = delta_attention(*x64).weights
    row["max_rel_err_vs_fp64"] = ((got.double() - want).abs().max() / want.abs().max()).item()
    return row


COLUMNS = [
    ("triton_ms", "triton"),
    ("triton_top8_ms", "triton top-8"),
    ("chunked_fp32_ms", "chunked fp32"),
    ("chunked_fp64_ms", "chunked fp64"),
    ("reference_fp64_ms_extrapolated", "fp64 oracle*"),
    ("dense_phi_ms_extrapolated", "dense Phi*"),
]


def table(rows: list[dict]) -> str:
    """Markdown table of the rows (ms); columns marked * are extrapolated from a timed part (see the docstring)."""
    lines = ["| T | n_h | gate | " + " | ".join(name for _, name in COLUMNS) + " | max rel err vs fp64 |",
             "|---" * (len(COLUMNS) + 4) + "|"]
    for r in rows:
        cells = " | ".join(f"{r[key]:.4g}" for key, _ in COLUMNS)
        lines.append(f"| {r['T']} | {r['n_h']} | {r['gate']} | {cells} | {r['max_rel_err_vs_fp64']:.2g} |")
    lines.append(f"times in ms on {rows[0]['device']}; * extrapolated by (query, source) pairs from a timed part")
    return "\n".join(lines)


def run(T: int, n_hs: list[int], gates: list[str], device: str, sample_rows: int, repeat: int = 3,
        json_path: str | None = None) -> list[dict]:
    """Every (n_h, gate) row; each is printed and (json_path) written as soon as it is done, so a run cut short
    keeps its finished rows."""
    rows = []
    for n_h in n_hs:
        for gate in gates:
            rows.append(bench_one(T, n_h, gate, device, sample_rows, repeat))
            print(json.dumps(rows[-1]), flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(rows, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--n-h", type=int, nargs="+", default=[1, 2])
    p.add_argument("--gate", nargs="+", choices=["scalar", "channel"], default=["scalar", "channel"])
    p.add_argument("--sample-rows", type=int, default=4, help="query rows timed for the extrapolated baselines")
    p.add_argument("--quick", action="store_true", help="T = 128, n_h = 2, both gates, one timed call (a smoke run)")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per measured column (best of)")
    p.add_argument("--json", help="write the rows to this file")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, n_hs, repeat = (128, [2], 1) if a.quick else (a.T, a.n_h, a.repeat)
    rows = run(T, n_hs, a.gate, device, a.sample_rows, repeat, a.json)
    print(table(rows))


if __name__ == "__main__":
    main()
