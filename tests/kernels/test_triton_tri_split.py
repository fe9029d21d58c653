"""The delta-rule forward's split T kernels (`LaunchConfig.tri_split`: `_kkt_kernel` then `_tri_inverse_kernel`)
against the float64 token loop and against the one-kernel path (`_tri_kernel`).

CPU: TRITON_INTERPRET=1 on small shapes; GPU tests are marked. Errors are max |ours - ref| / max |ref|; the
tolerances are those of tests/kernels/test_triton_shapes.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.delta_rule_cases import TOL, check_choice, cpu_only, inputs, needs_cuda, rel

gpu = pytest.mark.gpu


def _check(case: tuple, dtype: torch.dtype, device: str = "cpu", cfg: dict | None = None) -> tuple[float, ...]:
    """Split on against float64 and against the one-kernel path (`tri_split=False`); returns the errors."""
    cfg = cfg or {}
    return check_choice(case, dtype, dict(tri_split=True, **cfg), dict(tri_split=False, **cfg), device=device)


# ---------------------------------------------------------------- interpreter

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
CPU_CASES = {
    "dk=256 dv=512": (1, 70, 1, 1, 256, 512, 1, True, None),
    "grouped Hk<Hv": (2, 100, 1, 2, 32, 16, 1, True, None),
    "gate off": (1, 130, 2, 2, 32, 16, 1, False, None),
    "varlen grouped": (1, None, 1, 2, 16, 16, 1, True, [70, 20, 0, 130, 5]),
    "varlen n_h=2": (1, None, 1, 2, 16, 16, 2, True, [70, 33, 5]),
    "n_h=3 gate off": (1, 50, 1, 1, 16, 16, 3, False, None),
}


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_split_fp32_matches_float64_and_the_one_kernel_path(name):
    _check(CPU_CASES[name], torch.float32)


@cpu_only
def test_split_bf16_varlen_grouped():
    _check(CPU_CASES["varlen grouped"], torch.bfloat16)


@cpu_only
def test_split_key_blocks_narrower_than_dk():
    """kkt_bk = 16 < dk = 48 (masked last block): A summed over three key blocks."""
    _check((1, 80, 1, 2, 48, 16, 1, True, None), torch.float32, cfg=dict(kkt_bk=16))


@cpu_only
@pytest.mark.parametrize("gate", [False, True])
def test_split_T_is_the_inverse_of_I_plus_A(gate):
    """The two kernels alone: T against (I + A)^-1 in float64 for every (head, block), A from its definition
    A_ij = beta_i e^{G_i - G_j} k_i.k_j / (|k_i| |k_j|) (j < i), dense rows with a partial last chunk; also the kkt
    kernel's intra-chunk attention (q_i.k_j / (|q_i| |k_j|)) e^{G_i - G_j} (j <= i), which `out_aqk` reads, and its
    Gamma and row scales beta_i e^{G_i} / |k_i| (what the keys path with U from v reads instead of `_wu_kernel`'s)."""
    from deltalab.kernels.delta_rule.triton_prep import _kkt_kernel, _tri_inverse_kernel

    B, T, Hk, Hv, K = 2, 100, 1, 2, 32
    q, k, v, beta, g, _ = inputs(B, T, Hk, Hv, K, 16, 1, gate, seed=3)
    NCT = B * 2
    A = torch.full((Hv, NCT * 64, 64), float("nan"))
    Ti = torch.zeros(Hv, NCT * 64, 64)
    rstd = torch.empty(Hv, NCT * 64)
    Aqk = torch.full((Hv, NCT * 64, 64), float("nan"))
    gcum, wsc = torch.full((Hv, NCT * 64), float("nan")), torch.full((Hv, NCT * 64), float("nan"))
    common = dict(HK=Hk, HV=Hv, NH=1, K=K, IS_VARLEN=False, F32=True, PREC="ieee")
    _kkt_kernel[(Hv * NCT,)](
        q, k, beta, g, A, Aqk, None, rstd, gcum, wsc, T, None, None, None, NCT, BK=K, BKC=16, USE_G=gate, NORM=True,
        STORE_AQK=True, STORE_SCALES=True, **common,
    )
    _tri_inverse_kernel[(Hv * NCT,)](A, Ti, PREC="ieee", UPPER_ZEROS=False)
    d = torch.float64
    kn = torch.nn.functional.pad(k[:, :, 0].to(d), (0, 0, 0, 0, 0, 28))  # [B, 128, Hk, K], zero rows past T
    rk = 1 / (kn.pow(2).sum(-1) + 1e-6).sqrt()  # [B, 128, Hk]
    kn = kn * rk[..., None]
    qn = torch.nn.functional.pad(q.to(d), (0, 0, 0, 0, 0, 28))
    qn = qn / (qn.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    bt = torch.nn.functional.pad(beta[:, :, 0].to(d), (0, 0, 0, 28))
    G = torch.nn.functional.pad(g.to(d), (0, 0, 0, 28)) if gate else torch.zeros(B, 128, Hv, dtype=d)
    for h in range(Hv):
        for b in range(B):
            for c in range(2):
                sl = slice(64 * c, 64 * c + 64)
                kc = kn[b, sl, h * Hk // Hv]
                Gc = G[b, sl, h].cumsum(0)
                Aref = torch.tril(bt[b, sl, h, None] * (Gc[:, None] - Gc[None, :]).exp() * (kc @ kc.T), -1)
                rows = slice((b * 2 + c) * 64, (b * 2 + c) * 64 + 64)
                Tref = torch.linalg.inv(torch.eye(64, dtype=d) + Aref)
                assert rel(torch.tril(A[h, rows]), Aref) < 1e-5
                assert rel(torch.tril(Ti[h, rows]), Tref) < 1e-5, (h, b, c)
                Sref = torch.tril((Gc[:, None] - Gc[None, :]).exp() * (qn[b, sl, h * Hk // Hv] @ kc.T))
                assert rel(Aqk[h, rows], Sref) < 1e-5, (h, b, c)
                assert rel(gcum[h, rows], Gc) < 1e-5 if gate else gcum[h, rows].abs().max() == 0
                assert rel(wsc[h, rows], bt[b, sl, h] * Gc.exp() * rk[b, sl, h * Hk // Hv]) < 1e-5, (h, b, c)


# ---------------------------------------------------------------- GPU (run on the device)

GPU_CASES = {
    "fla GDN default: H=6, dk=256, dv=512": (2, 300, 6, 6, 256, 512, 1, True, None),
    "Qwen3-Next: Hk=16, Hv=32, dk=dv=128": (2, 300, 16, 32, 128, 128, 1, True, None),
    "gate off, Qwen heads": (1, 300, 16, 32, 128, 128, 1, False, None),
    "varlen Qwen grouped": (1, None, 16, 32, 128, 128, 1, True, [1000, 37, 64, 1, 511, 300]),
    "varlen GDN default": (1, None, 6, 6, 256, 512, 1, True, [700, 5, 129, 300]),
    "DeltaProduct n_h=2 grouped": (1, 300, 4, 8, 128, 128, 2, True, None),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_split_bf16_vs_float64(name):
    errs = _check(GPU_CASES[name], torch.bfloat16, device="cuda")
    print(f"{name}: o/final/boundary vs f64 {errs[0]:.2e} {errs[1]:.2e} {errs[2]:.2e}, vs split off {errs[3]:.1e}")


@gpu
@needs_cuda
@pytest.mark.parametrize("K, V", [(128, 128), (256, 512)])
def test_gpu_split_long_sequences_vs_chunked_float64(K, V):
    """B = 8, T = 2048 (a full GPU; shapes like these caught miscompiles that T = 300 missed) against the
    PyTorch chunked form in float64, o only through the lean call (what the benchmark's o+fin column times)."""
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product

    q, k, v, beta, g, s0 = inputs(8, 2048, 4, 8, K, V, 1, True, device="cuda")
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o, fin, _ = triton_delta_product(
        qb, kb, vb, beta, g, initial_state=s0, normalize_qk=True, output_boundary_states=False,
        config=LaunchConfig(tri_split=True),
    )  # fmt: skip
    d = torch.float64
    ro, rfin, _ = chunk_delta_product(
        qb.to(d), kb.to(d), vb.to(d), beta.to(d), g.to(d), initial_state=s0.to(d), normalize_qk=True
    )
    errs = rel(o, ro), rel(fin, rfin)
    assert max(errs) < TOL[torch.bfloat16], errs
