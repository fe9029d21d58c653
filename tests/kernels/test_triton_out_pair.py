"""The output kernel's chunk pairs (`LaunchConfig.out_pair`, n_h = 1 with `out_aqk`): an odd chunk's program reads
the previous chunk's state and adds that chunk's share through q K'^T from the kkt kernel, so that the sequential
kernel stores only even chunks' states when no boundary states are returned. Checked against the float64 token loop
and the unpaired path, with boundary states returned (all stored) and not (every other one stored): odd and even
chunk counts, a partial last chunk, dk 256 in key blocks, grouped heads, packed sequences of 1-4 chunks and one
shorter than a chunk, no gate. A first form (the share's own key loop in the output kernel) measured a loss on an
H200 (kernels/NOTES.md); this one gained 1.03-1.06x at GDN default and is default_config's there. GPU tests are
marked.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import deltalab.kernels.delta_rule.triton_chunk as tc
from tests.kernels.delta_rule_cases import TOL, cpu_only, cu_seqlens, inputs, needs_cuda, rel

# (B, T or None, Hk, Hv, K, V, gate, lengths or None)
CPU_CASES = {
    "dk 256 dv 64, 5 chunks, four key blocks": (1, 300, 1, 1, 256, 64, True, None),
    "grouped, 4 chunks, no gate": (2, 200, 2, 4, 64, 32, False, None),
    "packed 2, 1, 4, 3 chunks": (1, None, 1, 2, 96, 32, True, [70, 5, 200, 130]),
}
PAIRED = dict(out_aqk=True)  # the pairs need q K^T from the kkt kernel


def _run(case: tuple, dtype: torch.dtype, device: str, keep_boundaries: bool, **config) -> tuple[float, float, float]:
    """Rel. errors of (o, final state) against float64, and o's difference from the unpaired path."""
    from deltalab.kernels.delta_rule.naive import naive_delta_product

    B, T, Hk, Hv, K, V, gate, lengths = case
    T = sum(lengths) if lengths else T
    q, k, v, beta, g, s0 = inputs(B, T, Hk, Hv, K, V, 1, gate, n_seq=len(lengths) if lengths else B, device=device)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cu = cu_seqlens(lengths, device) if lengths else None
    run = dict(initial_state=s0, normalize_qk=True, cu_seqlens=cu, output_boundary_states=keep_boundaries)
    base = tc.default_config(len(lengths) if lengths else B, Hv, V, 1, K) if device == "cuda" else tc.LaunchConfig()
    on = replace(base, **PAIRED, **config, out_pair=True)
    off = replace(base, **PAIRED, **config, out_pair=False)
    o, fin, _ = tc.triton_delta_product(q, k, v, beta, g, config=on, **run)
    o0, _, _ = tc.triton_delta_product(q, k, v, beta, g, config=off, **run)
    d = torch.float64
    ro, rfin, _ = naive_delta_product(
        q.to(d), k.to(d), v.to(d), beta.to(d), None if g is None else g.to(d), initial_state=s0.to(d),
        normalize_qk=True, cu_seqlens=None if cu is None else cu.cpu(),
    )  # fmt: skip
    return rel(o, ro), rel(fin, rfin), rel(o, o0)


@cpu_only
@pytest.mark.parametrize("keep_boundaries", [False, True], ids=["every other state", "all states"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["loop", "prefetch"])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_pairs_match_float64_and_the_unpaired_path(name, prefetch, keep_boundaries):
    err_o, err_fin, diff = _run(CPU_CASES[name], torch.float32, "cpu", keep_boundaries, out_bk=32,
                                out_prefetch=prefetch)
    assert err_o < 1e-5 and err_fin < 1e-5, f"float32 against float64: o {err_o:.2e}, final {err_fin:.2e}"
    assert diff < 1e-5, f"o differs from the unpaired path's by {diff:.2e} (only sums reordered)"


@cpu_only
def test_pairs_bf16_match_float64():
    err_o, err_fin, _ = _run(CPU_CASES["packed 2, 1, 4, 3 chunks"], torch.bfloat16, "cpu", False)
    assert max(err_o, err_fin) < TOL[torch.bfloat16], f"bf16 against float64: o {err_o:.2e}, final {err_fin:.2e}"


@cpu_only
@pytest.mark.parametrize(
    "n_h, keep, config, expected",
    [(1, False, dict(out_pair=True, out_aqk=True), 2), (1, True, dict(out_pair=True, out_aqk=True), 1),
     (1, False, dict(out_pair=False, out_aqk=True), 1), (1, False, dict(out_pair=True, out_aqk=False), 1),
     (1, False, dict(out_pair=True, out_aqk=True, tri_split=False), 1),
     (2, False, dict(out_pair=True, out_aqk=True), 1)],
)  # fmt: skip
def test_the_state_kernel_skips_odd_states_only_where_nobody_reads_them(monkeypatch, n_h, keep, config, expected):
    """Every other state is stored only for the pairs (n_h = 1, q K^T and the pairs' share from the kkt kernel) with
    no boundary states returned."""
    seen = []
    real = tc._launch
    monkeypatch.setattr(tc, "_launch", lambda *a: (seen.append(a[4]["BND_EVERY"]), real(*a))[1])
    q, k, v, beta, g, s0 = inputs(1, 130, 1, 1, 32, 16, n_h, True)
    o, _, _ = tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True,
                                      output_boundary_states=keep, config=tc.LaunchConfig(**config))
    assert seen == [expected] and torch.isfinite(o).all()


def test_default_config_pairs_where_q_k_comes_from_the_kkt_kernel():
    """On at n_h = 1 with out_aqk (dk > 128: GDN default); off at dk = 128 (no out_aqk) and at n_h > 1."""
    for B in (1, 8):
        d = tc.default_config(B, 6, 512, 1, 256)
        assert d.out_pair and d.out_aqk
    assert not tc.default_config(8, 32, 128, 1, 128).out_pair
    assert not tc.default_config(8, 6, 512, 2, 256).out_pair


GPU_CASES = {
    "GDN default": (1, 2048, 6, 6, 256, 512, True, None),
    "GDN default 8 sequences": (8, 1000, 6, 6, 256, 512, True, None),
    "Qwen3-Next packed": (1, None, 16, 32, 128, 128, True, [3000, 64, 1, 700, 129]),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("keep_boundaries", [False, True], ids=["every other state", "all states"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_pairs_match_float64(name, keep_boundaries):
    """The default config with the pairs (and q K^T from the kkt kernel) in bf16 at real shapes."""
    err_o, err_fin, diff = _run(GPU_CASES[name], torch.bfloat16, "cuda", keep_boundaries)
    assert max(err_o, err_fin) < TOL[torch.bfloat16], f"bf16 against float64: o {err_o:.2e}, final {err_fin:.2e}"
    assert diff < TOL[torch.bfloat16] / 2, f"o differs from the unpaired path's by {diff:.2e}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_pairs_fp16_and_fp32():
    for dtype in (torch.float16, torch.float32):
        err_o, err_fin, _ = _run(GPU_CASES["Qwen3-Next packed"], dtype, "cuda", False)
        assert max(err_o, err_fin) < TOL[dtype], f"{dtype} against float64: o {err_o:.2e}, final {err_fin:.2e}"
