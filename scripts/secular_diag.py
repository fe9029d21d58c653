"""Which matrices the Triton secular solver gets wrong on the GPU: rows, roots, step counts, start variants.

    python scripts/secular_diag.py            (run once more with TRITON_DEFAULT_FP_FUSION=0 to see FMA's part)
First GPU run (H200, Triton 3.6): dk = 64, only matrix 1078 of random_inputs(2048, 64, seed=364), its smallest
eigenvalue (the last root of D' = -D): the kernel returned exactly the dlaed4-style start x_small, as if no step
had been taken for that root (kernels/NOTES.md). A step count of 0 for that root means the loop never ran for it,
1 that its first step declared it converged; `for_loop=True` replaces the `while` by a counted loop (a miscompile
check: the interpreter gives both the same steps).
"""

import torch

from kernels.triton_secular import secular_eigvals
from tests.kernels.test_spectra_dplr import hard_cases, random_inputs, symmetric_reference

for n in (64, 32, 128):
    d, k, beta = random_inputs(2048, n, seed=300 + n)
    hd, hk, hb = hard_cases(n)
    d, k, beta = torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb])
    ref = symmetric_reference(d, k, beta)
    # the kernel's own roots (dplr_eigvals would re-solve a matrix that misses its trace)
    got = secular_eigvals(d.cuda(), (d.sqrt() * k).cuda(), beta.clamp(min=0).cuda()).cpu()
    e = (got - ref).abs()
    bad = (e.amax(-1) > 1e-13).nonzero().flatten()
    print(f"n={n} max err {e.max().item():.3g} bad rows {bad.numel()}: {bad[:12].tolist()}", flush=True)
    for r in bad[:3].tolist():
        cols = (e[r] > 1e-13).nonzero().flatten().tolist()
        print(f"  row {r}: beta {beta[r].item():.4g} bad roots {cols[:10]} got {got[r, cols[:4]].tolist()} "
              f"ref {ref[r, cols[:4]].tolist()}", flush=True)
        dr, wr, rr = d[r:r + 1].cuda(), (d[r:r + 1].sqrt() * k[r:r + 1]).cuda(), beta[r:r + 1].clamp(min=0).cuda()
        for guess, mixed, for_loop in ((True, False, False), (False, False, False), (True, True, False),
                                       (True, False, True)):
            steps: list[torch.Tensor] = []
            lam = secular_eigvals(dr, wr, rr, guess=guess, mixed=mixed, steps=steps, for_loop=for_loop).cpu()
            its = steps[0][:, 0].cpu()  # [2, n]: float64 and float32 evaluations per root (D' order)
            print(f"    guess={guess} mixed={mixed} for_loop={for_loop}: "
                  f"err {(lam - ref[r:r + 1]).abs().max().item():.3g}, "
                  f"float64 evaluations of the last 4 roots {its[0, -4:].tolist()}, float32 {its[1, -4:].tolist()}",
                  flush=True)
