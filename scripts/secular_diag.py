"""Does the Triton secular solver give the same, right roots on the GPU run after run? Bad matrices per run.

    python scripts/secular_diag.py
History (kernels/NOTES.md): on an H200 (Triton 3.6) the solver returned a wrong smallest eigenvalue for about 1
matrix in 2,000: first a root left at its start after one step, later one stuck at its start for all 64 steps. A
race was suspected (the loop got an int32 `active` mask and a barrier per step), but on an H100 the same rows failed
every run: 1609 of dk = 64, and with the float32 phase 2042 (dk = 64) and 227 (dk = 128), and none with FMA
contraction off (`fp_fusion=False`, now the default). This script runs the kernel twice per configuration
(float32 phase, start, FMA) on 2048 random matrices plus the hard cases and prints the bad rows of each run.
"""

import torch

from kernels.triton_secular import secular_eigvals
from tests.kernels.test_spectra_dplr import hard_cases, random_inputs, symmetric_reference

RUNS = 2
for n in (64, 128):
    d, k, beta = random_inputs(2048, n, seed=300 + n)
    hd, hk, hb = hard_cases(n)
    d, k, beta = torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb])
    ref = symmetric_reference(d, k, beta)
    dc, wc, rc = d.cuda(), (d.sqrt() * k).cuda(), beta.clamp(min=0).cuda()
    for mixed, guess, fusion in ((False, True, True), (True, True, True), (False, False, True), (False, True, False),
                                 (True, True, False)):
        bad_runs, worst = [], 0.0
        for _ in range(RUNS):
            e = (secular_eigvals(dc, wc, rc, mixed=mixed, guess=guess, fp_fusion=fusion).cpu() - ref).abs()
            worst = max(worst, e.max().item())
            bad_runs.append((e.amax(-1) > 1e-13).nonzero().flatten().tolist()[:6])
        print(f"n={n} mixed={mixed} guess={guess} fp_fusion={fusion}: max err {worst:.3g}, bad rows per run "
              f"{bad_runs}", flush=True)
