"""Where the Triton SVD kernel's time goes (#19's rank target): bidiagonalisation alone (0 bisection steps) against
the full kernel, per warp count of both kernels, at dk = dv = 128 on the GPU; prints matrices per second."""

from __future__ import annotations

from functools import partial

import torch
import triton.testing

from kernels.triton_svd import svdvals


def main() -> None:
    n = 32768
    h = torch.randn(n, 128, 128, device="cuda")
    ref = torch.linalg.svdvals(h[:64].double())
    print(f"{'warps':>5} {'bisect':>6} {'n_iter':>6} {'ms':>8} {'matrices/s':>11} {'max err / sigma_max':>20}")
    for warps, bisect_warps, n_iter in [(4, 1, 0), (4, 1, 24), (4, 1, 32), (4, 2, 32), (8, 1, 32)]:
        kw = dict(n_iter=n_iter, num_warps=warps, bisect_warps=bisect_warps)
        ms = triton.testing.do_bench(partial(svdvals, h, **kw), warmup=2, rep=200)
        err = ((svdvals(h[:64], **kw).double().flip(-1) - ref).abs().amax(-1) / ref[:, 0]).amax().item()
        print(f"{warps:>5} {bisect_warps:>6} {n_iter:>6} {ms:8.2f} {n / ms * 1e3:11.3g} {err:20.2e}", flush=True)


if __name__ == "__main__":
    main()
