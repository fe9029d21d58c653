"""Where the Triton SVD kernel's time goes (#19's rank target): bidiagonalisation alone (0 bisection steps) against
the full kernel, per warp count and with the bidiagonalisation's reductions paired or not, at dk = dv = 128 on the
GPU; prints matrices per second."""

from __future__ import annotations

from functools import partial

import torch
import triton.testing

from kernels.triton_svd import svdvals


def main() -> None:
    n = 32768
    h = torch.randn(n, 128, 128, device="cuda")
    ref = torch.linalg.svdvals(h[:64].double())
    print(f"{'warps':>5} {'paired':>6} {'n_iter':>6} {'ms':>8} {'matrices/s':>11} {'max err / sigma_max':>20}")
    for warps, paired, n_iter in [(4, False, 0), (4, False, 32), (4, True, 0), (4, True, 32), (8, True, 0)]:
        kw = dict(n_iter=n_iter, num_warps=warps, paired=paired)
        ms = triton.testing.do_bench(partial(svdvals, h, **kw), warmup=2, rep=200)
        err = ((svdvals(h[:64], **kw).double().flip(-1) - ref).abs().amax(-1) / ref[:, 0]).amax().item()
        print(f"{warps:>5} {paired!s:>6} {n_iter:>6} {ms:8.2f} {n / ms * 1e3:11.3g} {err:20.2e}", flush=True)


if __name__ == "__main__":
    main()
