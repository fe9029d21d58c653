"""Triton Kimi Delta Attention forward (per-channel gates) vs the float64 token loop.

CPU: TRITON_INTERPRET=1 on tiny shapes; GPU: marked, realistic shapes, and fla 0.6.0's `chunk_kda` when importable.
Errors are max |ours - ref| / max |ref| per output (o, final state, boundary states); the reference gets the
same (half-rounded) inputs in float64, so the tolerance measures the kernel's arithmetic: fp32 1e-5, bf16 3e-2
and fp16 8e-3 (half-precision operands of the matrix products, fp32 accumulation; as tests/kernels/test_triton_chunk).
Strong decays (g down to -20 per token) are held to the same fp32 bound: the kernel sums each log-decay
difference from the gates it spans (a difference of two cumulative sums near -600 would carry fp32's 6e-5 spacing:
1.2e-5 on these inputs; the PyTorch chunked form sums them too, tests/kernels/test_chunk_strong_decays.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("triton")

from deltalab.kernels.delta_rule.naive import boundary_offsets, naive_delta_product, num_boundaries  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 8e-3}

cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU without TRITON_INTERPRET")
gpu = pytest.mark.gpu


def _inputs(B, T, Hk, Hv, K, V, strength=1.0, n_seq=None, device="cpu", seed=0, n_h=1):
    """Unit keys, beta in (0, 2), log decays uniform in (-strength, 0) per channel, an initial state per sequence."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, n_h, Hk, K, generator=gen), dim=-1)
    v = torch.randn(B, T, n_h, Hv, V, generator=gen)
    beta = torch.rand(B, T, n_h, Hv, generator=gen) * 2
    g = -torch.rand(B, T, Hv, K, generator=gen) * strength
    s0 = torch.randn(n_seq or B, Hv, K, V, generator=gen) * 0.3
    return [x.to(device) for x in (q, k, v, beta, g, s0)]


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _reference(q, k, v, beta, g, s0, cu=None):
    d = torch.float64
    return naive_delta_product(
        q.to(d),
        k.to(d),
        v.to(d),
        beta.to(d),
        g.to(d),
        initial_state=None if s0 is None else s0.to(d),
        cu_seqlens=None if cu is None else cu.cpu(),
    )


def _check(
    B, T, Hk, Hv, K, V, dtype=torch.float32, strength=1.0, lengths=None, h0=True, device="cpu", seed=0, config=None
):
    """Run triton_kda on fresh inputs and compare (o, final, boundary) with the float64 loop; return the errors."""
    from deltalab.kernels.delta_rule.triton_kda import KdaConfig, triton_kda

    T = sum(lengths) if lengths else T
    N = len(lengths) if lengths else B
    q, k, v, beta, g, s0 = _inputs(B, T, Hk, Hv, K, V, strength, N, device, seed)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s0 = s0 if h0 else None
    cu = _cu(lengths, device) if lengths else None
    o, fin, bnd = triton_kda(q, k, v, beta, g, initial_state=s0, cu_seqlens=cu, config=config or KdaConfig())
    ro, rfin, rbnd = _reference(q, k, v, beta, g, s0, cu)
    assert o.shape == (B, T, Hv, V) and o.dtype == dtype
    assert fin.shape == (N, Hv, K, V) and fin.dtype == torch.float32
    assert bnd.shape == rbnd.shape and bnd.dtype == torch.float32
    last = torch.tensor(boundary_offsets(cu.cpu())[1:]) - 1 if lengths else None
    assert torch.equal(bnd[0, last.to(bnd.device)], fin) if lengths else torch.equal(bnd[:, -1], fin)
    errs = _rel(o, ro), _rel(fin, rfin), _rel(bnd, rbnd)
    assert max(errs) < TOL[dtype], f"{dtype}: rel errors o/final/boundary {errs}"
    return errs


# ---------------------------------------------------------------- interpreter (CPU)

# name: (B, T, Hk, Hv, K, V, keyword arguments)
CPU_CASES = {
    "two chunks and a part": (2, 150, 1, 1, 16, 32, {}),
    "grouped heads, no initial state": (1, 100, 1, 3, 16, 16, dict(h0=False)),
    "strong decays (g down to -20)": (1, 140, 2, 2, 16, 16, dict(strength=20.0)),
    "dk, dv not powers of two; key-column blocks": (1, 70, 1, 2, 24, 40, {}),
    "packed, grouped, short and empty": (1, None, 2, 4, 16, 16, dict(lengths=[70, 9, 0, 130, 64])),
}


@pytest.fixture
def small_tiles(monkeypatch):
    """Key blocks of 16 in the intra kernel's own pairs and of 8 in the WY kernel, 16-wide value tiles in the WY and
    output kernels: several blocks and tiles at the tests' small dk and dv."""
    import deltalab.kernels.delta_rule.triton_kda as tk

    for name, value in dict(PREP_BKW=16, WY_BK=8, WY_BV=16, OUT_BV=16).items():
        monkeypatch.setattr(tk, name, value)


@cpu_only
@pytest.mark.parametrize("tiles", [False, True], ids=["default tiles", "small tiles"])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_fp32_matches_float64_reference(name, tiles, request):
    if tiles:
        request.getfixturevalue("small_tiles")
    *shape, kw = CPU_CASES[name]
    _check(*shape, **kw)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_match_float64_reference(dtype):
    _check(1, None, 1, 2, 16, 32, dtype=dtype, lengths=[100, 30], strength=3.0)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wy_kernel_in_blocks_at_strong_decays(dtype, small_tiles):
    """The WY kernel's Kd factors e^{Gamma_last - Gamma_j} from the cumulative sums (half dtypes), at strong decays
    (g down to -20 a token, so Gamma reaches -1280 within a chunk), in 8-wide key blocks and 16-wide value tiles."""
    _check(1, None, 1, 2, 16, 32, dtype=dtype, lengths=[100, 30], strength=20.0)


@cpu_only
def test_key_halves_at_dk_256():
    """dk > 128: the state kernel holds the key rows in two halves (as triton_chunk)."""
    _check(1, 70, 1, 1, 256, 16)


@cpu_only
def test_own_pairs_by_products_or_channel_by_channel(monkeypatch):
    """A sub-block's own 16 x 16 pairs go through the products when its decays stay above e^-bound, else channel by
    channel: decays mild except in tokens 20-40 (strong there) put sub-blocks of one chunk on both paths. Both that
    mix and the channel-by-channel path alone (bound 0) agree with float64 to the fp32 bound and with each other to
    1e-6, and they are not bit-equal (the products did run)."""
    from deltalab.kernels.delta_rule.triton_kda import OWN_PAIRS_BOUND, triton_kda

    q, k, v, beta, g, s0 = _inputs(1, 150, 1, 2, 16, 32, seed=7)
    g = g.clone()
    g[:, 20:40] *= 30.0  # sums over 15 tokens near -200 there: past the fp32 bound of 16
    assert (g[:, 1:16].sum(1).min() > -OWN_PAIRS_BOUND[torch.float32]) and (g[:, 21:36].sum(1).min() < -100)
    ref = _reference(q, k, v, beta, g, s0)
    both = triton_kda(q, k, v, beta, g, initial_state=s0)
    monkeypatch.setitem(OWN_PAIRS_BOUND, torch.float32, 0.0)
    slow = triton_kda(q, k, v, beta, g, initial_state=s0)
    for a, b, r in zip(both, slow, ref):
        assert _rel(a, r) < TOL[torch.float32] and _rel(b, r) < TOL[torch.float32]
        assert _rel(a, b) < 1e-6
    assert not torch.equal(both[0], slow[0])


@cpu_only
def test_value_tiles_and_optional_outputs(small_tiles):
    """dv split into 16-wide tiles in every kernel; without the final and boundary states o is unchanged."""
    from deltalab.kernels.delta_rule.triton_kda import KdaConfig, triton_kda

    cfg = KdaConfig(state_bv=16)
    _check(1, 80, 1, 1, 16, 48, config=cfg)
    q, k, v, beta, g, s0 = _inputs(1, 80, 1, 1, 16, 48, seed=2)
    o, fin, bnd = triton_kda(q, k, v, beta, g, initial_state=s0, config=cfg)
    o2, fin2, bnd2 = triton_kda(
        q, k, v, beta, g, initial_state=s0, config=cfg, output_final_state=False, output_boundary_states=False
    )
    assert fin2 is None and bnd2 is None and torch.equal(o, o2)
    assert bnd.shape == (1, num_boundaries(80), 1, 16, 48)


@cpu_only
def test_equal_channels_are_the_scalar_gate_kernel():
    """A per-channel gate equal across channels gives what the scalar-gate Triton forward gives."""
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    q, k, v, beta, g, s0 = _inputs(1, 90, 1, 2, 16, 16, seed=3)
    gs = g[..., 0]
    got = triton_kda(q, k, v, beta, gs[..., None].expand_as(g), initial_state=s0, normalize_qk=True)
    want = triton_delta_product(q, k, v, beta, gs, initial_state=s0, normalize_qk=True)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-5


@cpu_only
def test_normalize_qk_matches_reference():
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    q, k, v, beta, g, s0 = _inputs(1, 70, 1, 1, 16, 16, seed=4)
    k = k * 3.0
    o, fin, _ = triton_kda(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    d = torch.float64
    ro, rfin, _ = naive_delta_product(*(x.to(d) for x in (q, k, v, beta, g)), initial_state=s0.to(d), normalize_qk=True)
    assert max(_rel(o, ro), _rel(fin, rfin)) < TOL[torch.float32]


@cpu_only
def test_bad_inputs_raise_one_line_value_errors():
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    q, k, v, beta, g, s0 = _inputs(1, 20, 1, 1, 16, 16)
    with pytest.raises(ValueError, match=r"per-channel gate g \[B,T,Hv,K\]"):
        triton_kda(q, k, v, beta, g[..., 0])
    with pytest.raises(ValueError, match="n_h=2"):
        q2, k2, v2, b2, g2, _ = _inputs(1, 20, 1, 1, 16, 16, n_h=2)
        triton_kda(q2, k2, v2, b2, g2)
    with pytest.raises(ValueError, match="chunk_size=32"):
        triton_kda(q, k, v, beta, g, chunk_size=32)
    with pytest.raises(ValueError, match="float64"):
        triton_kda(q.double(), k, v, beta, g)
    with pytest.raises(ValueError, match="g must be"):
        triton_kda(q, k, v, beta, g[..., :8])
    with pytest.raises(ValueError) as info:
        triton_kda(q, k, v, beta, g[..., :8])
    assert "\n" not in str(info.value)


@cpu_only
def test_dispatch_routes_per_channel_gates_to_triton_kda():
    """Devices aside, n_h = 1 per-channel gates take triton_kda, which equals the PyTorch form; n_h = 2 says why not."""
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.dispatch import triton_path
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    q, k, v, beta, g, s0 = _inputs(1, 70, 1, 2, 16, 16, seed=5)
    forward, why = triton_path(q, k, v, g)
    assert forward is triton_kda and why is None
    for a, b in zip(
        forward(q, k, v, beta, g, initial_state=s0), chunk_delta_product(q, k, v, beta, g, initial_state=s0)
    ):
        assert _rel(a, b) < TOL[torch.float32]
    assert triton_path(q, k, v, g[..., 0]) == (triton_delta_product, None)
    q2, k2, v2, _, g2, _ = _inputs(1, 20, 1, 1, 16, 16, n_h=2)
    forward, why = triton_path(q2, k2, v2, g2)
    assert forward is None and "n_h=2" in why


# ---------------------------------------------------------------- GPU (run on the device)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_benchmark_shape_vs_float64(dtype):
    """dk = dv = 128, H = 16, T with a partial chunk, g in (-1, 0)."""
    _check(2, 1000, 16, 16, 128, 128, dtype=dtype, device="cuda")


@gpu
@needs_cuda
def test_gpu_strong_decays_grouped_packed_vs_float64():
    """Kimi-like grouped heads (Hk 8, Hv 16), g down to -20 per token, packed sequences not multiples of 64."""
    _check(
        1,
        None,
        8,
        16,
        128,
        128,
        dtype=torch.bfloat16,
        strength=20.0,
        lengths=[700, 37, 64, 1500, 1, 300],
        device="cuda",
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("K,V", [(128, 128), (256, 512)])
def test_gpu_half_internal_states_leave_o_bit_identical(K, V):
    """Without boundary states asked for, the KDA forward keeps them in bf16 (the output kernel rounds them to bf16
    for its product anyway): o and the final state are bit-identical to the call that returns fp32 states."""
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    q, k, v, beta, g, s0 = _inputs(2, 1000, 2, 4, K, V, device="cuda")
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), beta, g)
    o1, fin1, bnd1 = triton_kda(*args, initial_state=s0)
    o2, fin2, bnd2 = triton_kda(*args, initial_state=s0, output_boundary_states=False)
    assert bnd1.dtype == torch.float32 and bnd2 is None
    assert torch.equal(o1, o2) and torch.equal(fin1, fin2)


@gpu
@needs_cuda
def test_gpu_dk256_dv512_vs_float64():
    _check(1, 300, 2, 4, 256, 512, dtype=torch.bfloat16, device="cuda")


@gpu
@needs_cuda
def test_gpu_prep_vs_float64():
    """The prep (intra kernel, inverse kernel, WY kernel in blocks) at dk = dv = 128, bf16 and fp32 (Kd by a second
    scan): full batches (B = 2, T = 1000 with a partial chunk, H = 16), then grouped heads, g down to -20 per token
    and packed sequences not multiples of 64 (one of a single token), and dk = 256, dv = 512."""
    _check(2, 1000, 16, 16, 128, 128, dtype=torch.bfloat16, device="cuda")
    _check(2, 1000, 16, 16, 128, 128, dtype=torch.float32, device="cuda")
    _check(1, None, 8, 16, 128, 128, dtype=torch.bfloat16, strength=20.0, lengths=[700, 37, 64, 1500, 1, 300],
           device="cuda")  # fmt: skip
    _check(1, 300, 2, 4, 256, 512, dtype=torch.bfloat16, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("state_bv", [32, 64])
def test_gpu_long_batch_vs_chunked_float64(state_bv):
    """B = 8, T = 2048 (a full GPU; shapes like these caught miscompiled tiles in triton_chunk) against the
    PyTorch chunked form in float64."""
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.triton_kda import KdaConfig, triton_kda

    q, k, v, beta, g, s0 = _inputs(8, 2048, 8, 8, 128, 128, device="cuda")
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = triton_kda(q, k, v, beta, g, initial_state=s0, config=KdaConfig(state_bv=state_bv))
    d = torch.float64
    want = chunk_delta_product(*(x.to(d) for x in (q, k, v, beta, g)), initial_state=s0.to(d))
    errs = [_rel(a, b) for a, b in zip(got, want)]
    assert max(errs) < TOL[torch.bfloat16], errs


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "B,T,H", [(1, 8192, 32), (2, 4096, 32), (1, 2048, 16)], ids=["1 an SM", "2 an SM", "64 programs"]
)
def test_gpu_pipelined_state_kernel_is_bit_identical_to_one_stage(monkeypatch, B, T, H):
    """The sequential kernel's pipeline stages (`triton_kda.STATE_STAGES`, 3, granted where one or two programs
    share an SM) change when loads are issued, never the arithmetic: o, final and boundary states bit-identical to
    one stage, at the shapes where `launch_resident` grants 3 and 2 stages (a pipelined loop of the delta-rule output
    kernel once miscompiled); and within the bf16 bound of the float64 chunked form."""
    import deltalab.kernels.delta_rule.triton_kda as tk
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    q, k, v, beta, g, s0 = _inputs(B, T, H, H, 128, 128, device="cuda", seed=3)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    outs = {}
    for stages in (1, 2, 3):
        monkeypatch.setattr(tk, "STATE_STAGES", stages)
        outs[stages] = triton_kda(q, k, v, beta, g, initial_state=s0)
    monkeypatch.undo()
    for s in (2, 3):
        for name, a, b in zip(("o", "final", "boundary"), outs[s], outs[1]):
            assert torch.equal(a, b), f"{s} stages: {name} differs from one stage by {_rel(a, b):.1e}"
    default = triton_kda(q, k, v, beta, g, initial_state=s0)
    assert all(torch.equal(a, b) for a, b in zip(default, outs[3])), "the default is not the 3-stage launch"
    d = torch.float64
    want = chunk_delta_product(*(x.to(d) for x in (q, k, v, beta, g)), initial_state=s0.to(d))
    errs = [_rel(a, b) for a, b in zip(outs[3], want)]
    assert max(errs) < TOL[torch.bfloat16], errs


@gpu
@needs_cuda
def test_gpu_dispatch_runs_triton_kda_without_warning():
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    q, k, v, beta, g, s0 = _inputs(1, 300, 4, 4, 128, 128, device="cuda")
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = delta_product_forward(q, k, v, beta, g, initial_state=s0)
    want = triton_kda(q, k, v, beta, g, initial_state=s0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    q2, k2, v2, b2, g2, _ = _inputs(1, 70, 1, 1, 32, 32, device="cuda", n_h=2)
    with torch.no_grad(), pytest.warns(UserWarning, match="n_h=2"):
        delta_product_forward(q2, k2, v2, b2, g2)


@gpu
@needs_cuda
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_matches_fla_chunk_kda(packed):
    """Ours vs fla 0.6.0's chunk_kda on the same bf16 inputs (grouped value heads, initial states)."""
    fla = pytest.importorskip("fla.ops.kda")
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    lengths = [900, 45, 1100] if packed else None
    B, T = (1, sum(lengths)) if packed else (2, 1000)
    N = len(lengths) if packed else B
    q, k, v, beta, g, s0 = _inputs(B, T, 8, 16, 128, 128, strength=2.0, n_seq=N, device="cuda")
    beta = beta / 2  # fla's beta is a sigmoid, in (0, 1)
    q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    cu = _cu(lengths, "cuda") if packed else None
    o, fin, _ = triton_kda(q, k, v, beta, g, initial_state=s0, cu_seqlens=cu)
    fo, ffin = fla.chunk_kda(
        q,
        k[:, :, 0],
        v[:, :, 0],
        g,
        beta[:, :, 0],
        scale=128**-0.5,
        initial_state=s0,
        output_final_state=True,
        cu_seqlens=None if cu is None else cu.long(),
    )
    errs = _rel(o, fo), _rel(fin, ffin)
    assert max(errs) < 3e-2, f"ours vs fla (o, final): {errs}"
    ro, rfin, _ = _reference(q, k, v, beta, g, s0, cu)
    print(
        f"packed={packed}: ours vs float64 {_rel(o, ro):.1e}/{_rel(fin, rfin):.1e}, "
        f"fla vs float64 {_rel(fo, ro):.1e}/{_rel(ffin, rfin):.1e} (o/final)"
    )
