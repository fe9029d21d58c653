"""Does the Triton secular solver give the same, right roots on the GPU run after run? Bad matrices per run.

    python scripts/secular_diag.py
History (kernels/NOTES.md): on an H200 (Triton 3.6) the solver returned a wrong smallest eigenvalue for about 1
matrix in 3,000, different matrices from run to run (a race): first a root left at its start after one step,
later one stuck at its start for all 64 steps. The loop then got an int32 `active` mask and a barrier per step.
This script runs the kernel several times per configuration (4 or 1 warps, float32 phase or not) on
2048 random matrices plus the hard cases and prints the bad rows of each run.
"""

import torch

from kernels.triton_secular import secular_eigvals
from tests.kernels.test_spectra_dplr import hard_cases, random_inputs, symmetric_reference

RUNS = 5
for n in (64, 128):
    d, k, beta = random_inputs(2048, n, seed=300 + n)
    hd, hk, hb = hard_cases(n)
    d, k, beta = torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb])
    ref = symmetric_reference(d, k, beta)
    dc, wc, rc = d.cuda(), (d.sqrt() * k).cuda(), beta.clamp(min=0).cuda()
    for warps in (4, 1):
        for mixed, for_loop in ((False, False), (True, False)):
            bad_runs, worst = [], 0.0
            for _ in range(RUNS):
                e = (secular_eigvals(dc, wc, rc, num_warps=warps, mixed=mixed, for_loop=for_loop).cpu() - ref).abs()
                worst = max(worst, e.max().item())
                bad_runs.append((e.amax(-1) > 1e-13).nonzero().flatten().tolist()[:6])
            print(f"n={n} warps={warps} mixed={mixed} for_loop={for_loop}: max err {worst:.3g}, bad rows per run "
                  f"{bad_runs}", flush=True)
