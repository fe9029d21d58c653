"""Which matrices the Triton secular solver gets wrong on the GPU (dk 64): rows, their inputs' traits, errors."""
import torch

from kernels.spectra_dplr import dplr_eigvals
from tests.kernels.test_spectra_dplr import hard_cases, random_inputs, symmetric_reference

for n in (64, 32, 128):
    d, k, beta = random_inputs(2048, n, seed=300 + n)
    hd, hk, hb = hard_cases(n)
    d, k, beta = torch.cat([d, hd]), torch.cat([k, hk]), torch.cat([beta, hb])
    ref = symmetric_reference(d, k, beta)
    got = dplr_eigvals(d.cuda(), k.cuda(), beta.cuda(), method="triton").cpu()
    e = (got - ref).abs()
    bad = (e.amax(-1) > 1e-13).nonzero().flatten()
    print(f"n={n} max err {e.max().item():.3g} bad rows {bad.numel()}: {bad[:12].tolist()}", flush=True)
    for r in bad[:3].tolist():
        cols = (e[r] > 1e-13).nonzero().flatten().tolist()
        print(f"  row {r}: beta {beta[r].item():.4g} bad roots {cols[:10]} got {got[r, cols[:4]].tolist()} "
              f"ref {ref[r, cols[:4]].tolist()}", flush=True)
