"""Triton chunked forward vs the float64 token loop (CPU: TRITON_INTERPRET=1 on tiny shapes; GPU: marked).

Errors are max |ours - ref| / max |ref| per output (o, final state, boundary states). The reference gets
the same (half-rounded) inputs in float64, so the tolerance only measures the kernel's arithmetic:
fp32 1e-4; bf16 3e-2 and fp16 8e-3 (half-precision operands of the matrix products, fp32 accumulation).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from deltalab.kernels.delta_rule.naive import naive_delta_product, num_boundaries  # noqa: E402

ON_CPU = not torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 8e-3}

cpu_only = pytest.mark.skipif(
    not INTERPRET, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1 (set by `make test`)"
)


def _inputs(B, T, H, K, V, n_h, gate, h0, device="cpu", beta_max=2.0, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, n_h, H, K, generator=gen)
    v = torch.randn(B, T, n_h, H, V, generator=gen)
    beta = torch.rand(B, T, n_h, H, generator=gen) * beta_max
    g = -torch.rand(B, T, H, generator=gen) * 0.7 if gate else None
    s0 = torch.randn(B, H, K, V, generator=gen) * 0.3 if h0 else None
    return [x.to(device) if x is not None else None for x in (q, k, v, beta, g, s0)]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


TILINGS = {"default": dict(), "bv16": dict(state_bv=16), "bv64": dict(state_bv=64)}  # sequential-kernel value tiles


def _check_against_naive(shape, dtype, device="cpu", tiling="default", normalize=True, beta_max=2.0, seed=0):
    from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product

    B, T, H, K, V, n_h, gate, h0 = shape
    q, k, v, beta, g, s0 = _inputs(B, T, H, K, V, n_h, gate, h0, device, beta_max, seed)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    config = LaunchConfig(**TILINGS[tiling]) if TILINGS[tiling] else None  # "default": default_config's choices
    o, fin, bnd = triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=normalize, config=config)
    d = torch.float64
    ro, rfin, rbnd = naive_delta_product(
        q.to(d),
        k.to(d),
        v.to(d),
        beta.to(d),
        None if g is None else g.to(d),
        initial_state=None if s0 is None else s0.to(d),
        normalize_qk=normalize,
    )
    assert o.shape == (B, T, H, V) and o.dtype == dtype
    assert fin.shape == (B, H, K, V) and fin.dtype == torch.float32
    assert bnd.shape == (B, num_boundaries(T), H, K, V) and bnd.dtype == torch.float32
    assert torch.equal(bnd[:, -1], fin)
    errs = _rel(o, ro), _rel(fin, rfin), _rel(bnd, rbnd)
    assert max(errs) < TOL[dtype], f"{shape} {dtype}: rel errors o/final/boundary {errs}"
    return errs


# (B, T, H, K, V, n_h, gate, initial state): every variant on tiny shapes, T not a multiple of 64
CPU_CASES = [
    (1, 70, 2, 16, 16, 1, False, False),  # DeltaNet
    (2, 100, 1, 16, 32, 1, True, False),  # Gated DeltaNet, K != V
    (1, 100, 2, 32, 16, 2, False, True),  # DeltaProduct n_h = 2, initial state
    (1, 90, 1, 32, 32, 3, True, True),  # Gated DeltaProduct n_h = 3
]


@cpu_only
@pytest.mark.parametrize("shape", CPU_CASES)
@pytest.mark.parametrize("tiling", ["default", "bv16"])
def test_fp32_matches_float64_reference(shape, tiling):
    _check_against_naive(shape, torch.float32, tiling=tiling)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [CPU_CASES[1], CPU_CASES[3]])
def test_half_inputs_match_float64_reference(shape, dtype):
    _check_against_naive(shape, dtype)


@cpu_only
def test_without_normalisation_and_reflections():
    """normalize_qk=False with unit keys and beta = 2 everywhere (pure reflections): states stay bounded."""
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    B, T, H, K, V, n_h = 1, 80, 1, 16, 16, 2
    q, k, v, _, g, _ = _inputs(B, T, H, K, V, n_h, True, False, seed=3)
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.full((B, T, n_h, H), 2.0)
    o, fin, bnd = triton_delta_product(q, k, v, beta, g, normalize_qk=False)
    ro, rfin, rbnd = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double())
    assert max(_rel(o, ro), _rel(fin, rfin), _rel(bnd, rbnd)) < TOL[torch.float32]


@cpu_only
def test_optional_outputs_and_chunk_boundary():
    from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product

    q, k, v, beta, g, _ = _inputs(1, 64, 1, 16, 16, 1, True, False, seed=5)
    for tiling in ("default", "bv16"):
        o, fin, bnd = triton_delta_product(
            q,
            k,
            v,
            beta,
            g,
            normalize_qk=True,
            output_final_state=False,
            output_boundary_states=False,
            config=LaunchConfig(**TILINGS[tiling]) if TILINGS[tiling] else None,
        )
        assert fin is None and bnd is None
        ro = naive_delta_product(q.double(), k.double(), v.double(), beta.double(), g.double(), normalize_qk=True)[0]
        assert _rel(o, ro) < TOL[torch.float32]


@cpu_only
def test_bad_input_raises_one_line_value_error():
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    q, k, v, beta, g, _ = _inputs(1, 16, 1, 16, 16, 1, True, False)
    with pytest.raises(ValueError, match="chunk_size"):
        triton_delta_product(q, k, v, beta, g, chunk_size=32)
    with pytest.raises(ValueError, match="shapes disagree"):
        triton_delta_product(q, k[:, :, :, :, :8], v, beta, g)
    with pytest.raises(ValueError, match="fp64"):
        triton_delta_product(q.double(), k, v, beta, g)
    with pytest.raises(ValueError, match="g must be"):
        triton_delta_product(q, k, v, beta, g[:, :8])


# ---------------------------------------------------------------- GPU (run on the device)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(ON_CPU or INTERPRET, reason="needs a CUDA GPU without TRITON_INTERPRET")


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "n_h, gate, tiling",
    [(n, gt, "default") for n in (1, 2, 3) for gt in (False, True)] + [(1, True, "bv64"), (3, True, "bv64")],
)
def test_gpu_bf16_vs_float64(n_h, gate, tiling):
    """dk = dv = 128, H = 8 (as the benchmark, so compiled kernels are shared), T with a partial chunk."""
    _check_against_naive((1, 300, 8, 128, 128, n_h, gate, True), torch.bfloat16, device="cuda", tiling=tiling)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_fp16_fp32_vs_float64(dtype):
    _check_against_naive((1, 300, 8, 128, 128, 2, True, True), dtype, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("n_h", [1, 3])
@pytest.mark.parametrize("tiling", ["default", "bv64"])
def test_gpu_long_sequence_vs_chunked_float64(n_h, tiling):
    """B = 8, T = 2048 (a full GPU, T divisible by 16: Triton specialises on it) against the PyTorch chunked
    form in float64. Shapes like these caught 16-wide value tiles miscompiling while T = 300 passed."""
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product

    q, k, v, beta, g, s0 = _inputs(8, 2048, 8, 128, 128, n_h, True, True, "cuda")
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o, fin, bnd = triton_delta_product(qb, kb, vb, beta, g, initial_state=s0, normalize_qk=True,
                                      config=LaunchConfig(**TILINGS[tiling]) if TILINGS[tiling] else None)
    d = torch.float64
    ro, rfin, rbnd = chunk_delta_product(
        qb.to(d), kb.to(d), vb.to(d), beta.to(d), g.to(d), initial_state=s0.to(d), normalize_qk=True
    )
    errs = _rel(o, ro), _rel(fin, rfin), _rel(bnd, rbnd)
    assert max(errs) < TOL[torch.bfloat16], errs


@gpu
@needs_cuda
@pytest.mark.parametrize("K, V, n_h", [(128, 128, 1), (256, 512, 1), (128, 128, 3)])
def test_gpu_half_internal_states_leave_o_bit_identical(K, V, n_h):
    """Without boundary states asked for, the kernel keeps them in bf16 (the output kernel rounds them to bf16 for
    its product anyway): the final state and o are bit-identical to the call that returns fp32 states. This test
    caught the pipelined key-block loop's miscompile (o off by 50-90% at n_h = 1; triton_chunk.OUT_STAGES)."""
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    q, k, v, beta, g, s0 = _inputs(2, 1000, 4, K, V, n_h, True, True, "cuda")
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), beta, g)
    o1, fin1, bnd1 = triton_delta_product(*args, initial_state=s0, normalize_qk=True)
    o2, fin2, bnd2 = triton_delta_product(*args, initial_state=s0, normalize_qk=True, output_boundary_states=False)
    assert bnd1.dtype == torch.float32 and bnd2 is None
    assert torch.equal(fin1, fin2) and torch.equal(o1, o2)


@gpu
@needs_cuda
def test_gpu_refuses_16_wide_value_tiles():
    from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product

    q, k, v, beta, g, _ = _inputs(1, 64, 8, 128, 128, 1, False, False, "cuda")
    with pytest.raises(ValueError, match="state_bv=16"):
        triton_delta_product(q, k, v, beta, config=LaunchConfig(state_bv=16))


@gpu
@needs_cuda
@pytest.mark.parametrize("n_h", [1, 3])
@pytest.mark.parametrize("gate", [False, True])
def test_gpu_matches_fla(n_h, gate):
    fla = pytest.importorskip("fla.ops.gated_delta_product")
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    B, T, H, K = 1, 1000, 8, 128
    q, k, v, beta, g, s0 = _inputs(B, T, H, K, K, n_h, gate, True, "cuda", beta_max=1.0)
    q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    o, fin, _ = triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    fo, ffin = fla.chunk_gated_delta_product(
        q,
        k.reshape(B, T * n_h, H, K),
        v.reshape(B, T * n_h, H, K),
        g,
        beta.reshape(B, T * n_h, H),
        num_householder=n_h,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    errs = _rel(o, fo), _rel(fin, ffin)
    assert max(errs) < 3e-2, f"ours vs fla (o, final): {errs}"


def test_dispatch_falls_back_to_pytorch_on_cpu():
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward

    q, k, v, beta, g, s0 = _inputs(1, 20, 2, 16, 16, 2, True, True)
    got = delta_product_forward(q, k, v, beta, g, initial_state=s0)
    want = chunk_delta_product(q, k, v, beta, g, initial_state=s0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_every_forward_has_the_same_normalize_default():
    """naive, chunk, dispatch and Triton agree on `normalize_qk` (Triton used to default to True alone)."""
    import inspect

    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    defaults = {fn.__name__: inspect.signature(fn).parameters["normalize_qk"].default
                for fn in (naive_delta_product, chunk_delta_product, delta_product_forward, triton_delta_product)}
    assert set(defaults.values()) == {False}, defaults


@cpu_only
def test_default_call_matches_the_reference_on_unnormalised_keys():
    """Called with defaults on keys that are not unit vectors, Triton computes what the reference computes."""
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    q, k, v, beta, g, s0 = _inputs(1, 70, 2, 16, 16, 2, True, True, beta_max=0.2, seed=5)
    k = k * 0.25  # small keys keep the unnormalised recurrence contractive
    o, fin, _ = triton_delta_product(q, k, v, beta, g, initial_state=s0)
    ro, rfin, _ = naive_delta_product(*(x.double() for x in (q, k, v, beta, g)), initial_state=s0.double())
    assert max(_rel(o, ro), _rel(fin, rfin)) < TOL[torch.float32]


def test_packed_tables_are_reused_until_the_offsets_change():
    """The chunk tables of a packed batch (one GPU sync to build) come back for the same cu_seqlens tensor, and are
    rebuilt after an in-place change; the validation likewise reads a tensor once, and again after a change."""
    from deltalab.kernels.delta_rule.naive import check_cu_seqlens
    from deltalab.kernels.triton_utils import varlen_tables

    cu = torch.tensor([0, 70, 79, 200], dtype=torch.int32)
    first = varlen_tables(cu, torch.device("cpu"))
    assert varlen_tables(cu, torch.device("cpu")) is first
    assert first[-1] == 2 + 1 + 2 and first[1].tolist() == [0, 0, 1, 2, 2]
    assert check_cu_seqlens(cu, 1, 200) == 3 and check_cu_seqlens(cu, 1, 200) == 3
    cu[2] = 150  # in place: a new version
    again = varlen_tables(cu, torch.device("cpu"))
    assert again is not first and again[-1] == 2 + 2 + 1 and again[1].tolist() == [0, 0, 1, 1, 2]
    assert varlen_tables(cu.clone(), torch.device("cpu")) is not again  # another tensor, same values
    cu[2] = 250  # past T: the check reads it again and refuses
    with pytest.raises(ValueError, match="rise from 0 to T=200"):
        check_cu_seqlens(cu, 1, 200)



# ---------------------------------------------------------------- default_config's rules


def test_default_config_takes_the_keys_path_past_one_program_a_sm():
    """Past one program a SM (8 x 4096, packed) the keys path at two stages; at B = 1 the W path (132 SMs)."""
    from deltalab.kernels.delta_rule.triton_chunk import default_config

    for B, H, V, n_h, K in [(8, 6, 512, 1, 256), (32, 6, 512, 3, 256), (8, 32, 128, 1, 128)]:
        cfg = default_config(B, H, V, n_h, K)
        assert cfg.state_keys_ws and cfg.state_stages == 2, (B, H, V, n_h, K)
    for B, H, V, n_h, K in [(1, 6, 512, 1, 256), (1, 6, 512, 3, 256)]:
        assert not default_config(B, H, V, n_h, K).state_keys_ws, (B, H, V, n_h, K)


def test_default_config_output_kernel_choices():
    """q K^T from the kkt kernel and output pairs at dk > 128 (pairs at n_h = 1 only); evict-first state loads at one
    key block (dk <= 128); the next key block loaded ahead at n_h = 1 with several key blocks."""
    from deltalab.kernels.delta_rule.triton_chunk import default_config

    for B in (1, 8):
        d = default_config(B, 6, 512, 1, 256)
        assert d.out_pair and d.out_aqk and d.out_prefetch and not d.out_evict_first and d.out_bk == 64
    d = default_config(8, 32, 128, 1, 128)
    assert not d.out_pair and not d.out_aqk and not d.out_prefetch and d.out_evict_first and d.out_bk == 128
    d = default_config(8, 6, 512, 2, 256)
    assert d.out_aqk and not d.out_pair and not d.out_prefetch


@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("n_h", [1, 2, 3])
def test_default_config_wide_output_tiles_only_with_half_states_at_dv_512(B, n_h):
    from deltalab.kernels.delta_rule.triton_chunk import default_config

    assert default_config(B, 6, 512, n_h, 256).out_bv == 256
    assert default_config(B, 6, 512, n_h, 256, half_states=False).out_bv == 128
    assert default_config(B, 32, 128, n_h, 128).out_bv == 128


@cpu_only
@pytest.mark.parametrize(
    "dtype, keep, half", [(torch.bfloat16, False, True), (torch.bfloat16, True, False), (torch.float32, False, False)]
)
def test_the_forward_asks_for_the_states_it_stores(monkeypatch, dtype, keep, half):
    import deltalab.kernels.delta_rule.triton_chunk as tc

    seen = []
    real = tc.default_config
    monkeypatch.setattr(tc, "default_config", lambda *a, **kw: (seen.append(kw.get("half_states")), real(*a, **kw))[1])
    q, k, v, beta, g, _ = _inputs(1, 70, 1, 16, 16, 1, True, False)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    tc.triton_delta_product(q, k, v, beta, g, normalize_qk=True, output_boundary_states=keep)
    assert seen == [half]


@cpu_only
def test_wide_output_tiles_equal_narrow_ones():
    from tests.kernels.delta_rule_cases import check_choice

    """The same products per output column; the interpreter's fp32 dots (numpy) may block a wider tile's sums
    differently, so o agrees to float32 rounding here (bit for bit on the GPU: benchmarks/compare_outputs.py)."""
    errs = check_choice((1, 150, 1, 1, 32, 512, 1, True, None), torch.float32, dict(out_bv=256), dict(out_bv=128))
    assert errs[3] < 1e-6, f"o differs between 256- and 128-wide output tiles: {errs[3]:.2e}"
