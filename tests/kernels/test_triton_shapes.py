"""Real-model shapes: dv > dk, dk = 256, dv = 512, grouped heads, packed variable-length batches.

The Triton forward (TRITON_INTERPRET=1 on the CPU, tiny shapes; the GPU tests are marked) and the PyTorch
chunked form against the float64 token loop. Errors are max |ours - ref| / max |ref| per output; the
tolerances are those of tests/kernels/test_triton_chunk.py.
"""

from __future__ import annotations

import os
import warnings
from unittest import mock

import pytest
import torch

from deltalab.kernels.delta_rule.chunk import chunk_delta_product
from deltalab.kernels.delta_rule.naive import boundary_offsets, naive_delta_product, num_boundaries
from tests.kernels.delta_rule_cases import GPU_REAL_CASES, check_choice

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 8e-3}

cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU without TRITON_INTERPRET")
gpu = pytest.mark.gpu


def _inputs(B, T, Hk, Hv, K, V, n_h, gate, n_seq=None, device="cpu", seed=0, beta_max=2.0):
    """Random inputs; n_seq gives initial states for that many packed sequences (else one per batch row)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen)
    k = torch.randn(B, T, n_h, Hk, K, generator=gen)
    v = torch.randn(B, T, n_h, Hv, V, generator=gen)
    beta = torch.rand(B, T, n_h, Hv, generator=gen) * beta_max
    g = -torch.rand(B, T, Hv, generator=gen) * 0.7 if gate else None
    s0 = torch.randn(n_seq or B, Hv, K, V, generator=gen) * 0.3
    return [x.to(device) if x is not None else None for x in (q, k, v, beta, g, s0)]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _reference(q, k, v, beta, g, s0, cu=None):
    d = torch.float64
    return naive_delta_product(
        q.to(d),
        k.to(d),
        v.to(d),
        beta.to(d),
        None if g is None else g.to(d),
        initial_state=s0.to(d),
        normalize_qk=True,
        cu_seqlens=cu,
    )


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ---------------------------------------------------------------- the reference itself


def test_reference_packed_equals_one_call_per_sequence():
    """The packed float64 loop is each sequence run alone from its own state; boundaries per sequence."""
    lengths = [70, 20, 0, 130]
    q, k, v, beta, g, s0 = (
        x.double() for x in _inputs(1, sum(lengths), 1, 2, 8, 8, 2, True, n_seq=len(lengths), seed=1)
    )
    cu = _cu(lengths)
    o, fin, bnd = naive_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, cu_seqlens=cu)
    off = boundary_offsets(cu)
    assert off == [0, *torch.tensor([num_boundaries(n) for n in lengths]).cumsum(0).tolist()]
    assert bnd.shape == (1, off[-1], 2, 8, 8) and fin.shape == (4, 2, 8, 8)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = naive_delta_product(
            q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], g[:, a:b], initial_state=s0[n : n + 1], normalize_qk=True
        )
        assert torch.equal(o[:, a:b], one[0]) and torch.equal(fin[n], one[1][0])
        assert torch.equal(bnd[:, off[n] : off[n + 1]], one[2])
        assert torch.equal(bnd[0, off[n + 1] - 1], fin[n])  # each sequence's last boundary is its final state


def test_reference_grouped_heads_read_key_head_j_over_group():
    """Value head j with key head j // (Hv/Hk) equals the same run with the key heads repeated."""
    q, k, v, beta, g, s0 = (x.double() for x in _inputs(2, 30, 2, 6, 8, 8, 1, True, seed=2))
    got = naive_delta_product(q, k, v, beta, g, initial_state=s0)
    want = naive_delta_product(
        q.repeat_interleave(3, 2), k.repeat_interleave(3, 3), v, beta, g, initial_state=s0
    )  # fmt: skip
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # and not a tiling: head 1 must use key head 0, so swapping key heads 0 and 1 changes it
    other = naive_delta_product(q.flip(2), k.flip(3), v, beta, g, initial_state=s0)
    assert not torch.allclose(other[0][:, :, 1], got[0][:, :, 1])


@pytest.mark.parametrize(
    "shape, lengths",
    [
        ((2, 150, 1, 3, 8, 24, 2, True), None),  # grouped, dv > dk
        ((1, None, 2, 4, 16, 8, 3, True), [1, 63, 64, 65, 0, 130]),  # packed, grouped, dk > dv, empty sequence
    ],
)
def test_chunk_matches_reference_float64(shape, lengths):
    B, T, Hk, Hv, K, V, n_h, gate = shape
    T = sum(lengths) if lengths else T
    q, k, v, beta, g, s0 = (
        x.double() for x in _inputs(B, T, Hk, Hv, K, V, n_h, gate, n_seq=len(lengths) if lengths else None)
    )
    cu = _cu(lengths) if lengths else None
    ref = _reference(q, k, v, beta, g, s0, cu)
    out = chunk_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, cu_seqlens=cu)
    for got, want in zip(out, ref):
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-12


def test_bad_shapes_raise_one_line_value_errors():
    q, k, v, beta, g, s0 = _inputs(1, 10, 2, 3, 8, 8, 1, True)
    with pytest.raises(ValueError, match="multiple of key heads"):
        naive_delta_product(q, k, v, beta, g)
    q, k, v, beta, g, s0 = _inputs(2, 10, 1, 2, 8, 8, 1, True)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_delta_product(q, k, v, beta, g, cu_seqlens=_cu([5, 5]))
    q, k, v, beta, g, s0 = _inputs(1, 10, 1, 2, 8, 8, 1, True)
    with pytest.raises(ValueError, match="rise from 0 to T=10"):
        chunk_delta_product(q, k, v, beta, g, cu_seqlens=_cu([5, 4]))
    with pytest.raises(ValueError, match=r"initial_state must be \[N,Hv,K,V\] = \(2, 2, 8, 8\)"):
        chunk_delta_product(q, k, v, beta, g, initial_state=s0, cu_seqlens=_cu([5, 5]))


# ---------------------------------------------------------------- Triton, interpreter

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None, config)
CPU_CASES = {
    "dv>dk, V tiles": ((2, 70, 1, 1, 16, 48, 1, True, None, dict(out_bv=32, state_bv=32))),
    "dk=256": ((1, 70, 1, 1, 256, 16, 1, True, None, {})),
    "dk=160 (halves, masked)": ((1, 40, 1, 1, 160, 16, 2, False, None, {})),
    "grouped heads": ((1, 100, 2, 4, 16, 16, 2, True, None, {})),
    "varlen": ((1, None, 1, 2, 16, 32, 2, True, [70, 20, 0, 75, 1], dict(state_bv=16))),
    "varlen grouped n_h=3": ((1, None, 1, 2, 16, 16, 3, True, [64, 33, 100], {})),
}


def _check_triton(case, dtype, device="cpu", seed=0, wu_bv=None):
    """The case against float64; wu_bv: the WY kernel's value tile for this run (several U tiles at small dv)."""
    import deltalab.kernels.delta_rule.triton_chunk as tc
    from deltalab.kernels.delta_rule.triton_chunk import LaunchConfig, triton_delta_product

    B, T, Hk, Hv, K, V, n_h, gate, lengths, cfg = case
    T = sum(lengths) if lengths else T
    N = len(lengths) if lengths else B
    q, k, v, beta, g, s0 = _inputs(B, T, Hk, Hv, K, V, n_h, gate, n_seq=N, device=device, seed=seed)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cu = _cu(lengths, device) if lengths else None
    with mock.patch.object(tc, "WU_BV", wu_bv or tc.WU_BV):
        o, fin, bnd = triton_delta_product(
            q, k, v, beta, g, initial_state=s0, normalize_qk=True, cu_seqlens=cu,
            config=LaunchConfig(**cfg) if cfg else None,
        )
    ro, rfin, rbnd = _reference(q, k, v, beta, g, s0, None if cu is None else cu.cpu())
    assert o.shape == (B, T, Hv, V) and o.dtype == dtype
    assert fin.shape == (N, Hv, K, V) and bnd.shape == rbnd.shape
    if cu is not None:
        last = torch.tensor(boundary_offsets(cu.cpu())[1:]) - 1
        assert torch.equal(bnd[0, last.to(bnd.device)], fin)
    errs = _rel(o, ro), _rel(fin, rfin), _rel(bnd, rbnd)
    assert max(errs) < TOL[dtype], f"{case} {dtype}: rel errors o/final/boundary {errs}"
    return errs


@cpu_only
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_triton_fp32_matches_float64_reference(name):
    _check_triton(CPU_CASES[name], torch.float32, wu_bv=32 if name == "dv>dk, V tiles" else None)


@cpu_only
def test_triton_half_inputs_varlen_grouped():
    _check_triton(CPU_CASES["varlen grouped n_h=3"], torch.bfloat16)


@cpu_only
def test_dispatch_warns_once_and_falls_back_for_shapes_triton_does_not_take(monkeypatch):
    """With tensors that claim to be on CUDA (the interpreter runs them), dk = 320 goes to the PyTorch form
    after one warning naming the shape; dk = 16 takes the Triton path, silently."""
    import deltalab.kernels.delta_rule.triton_chunk as tc
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    calls = []
    real = tc.triton_delta_product
    monkeypatch.setattr(tc, "triton_delta_product", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, beta, g, s0 = _inputs(1, 20, 1, 2, 320, 8, 1, True)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"q \(1, 20, 1, 320\).*dk=320") as rec:
        got = delta_product_forward(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    assert len(rec) == 1 and "\n" not in str(rec[0].message) and not calls
    want = chunk_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    q, k, v, beta, g, s0 = _inputs(1, 20, 1, 2, 16, 8, 1, True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = delta_product_forward(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    assert calls == [1]
    assert _rel(got[0], _reference(q, k, v, beta, g, s0)[0]) < TOL[torch.float32]


@cpu_only
def test_dispatch_falls_back_beyond_three_householder_steps(monkeypatch):
    """n_h = 4 (the output kernel keeps one q K^T accumulator per step, three at most) goes to the PyTorch form
    after one warning naming n_h; the Triton forward itself refuses it with the same reason."""
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q, k, v, beta, g, s0 = _inputs(1, 20, 1, 2, 16, 8, 4, True)
    with torch.no_grad(), pytest.warns(UserWarning, match="n_h=4") as rec:
        got = delta_product_forward(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    assert len(rec) == 1
    assert _rel(got[0], _reference(q, k, v, beta, g, s0)[0]) < TOL[torch.float32]
    with pytest.raises(ValueError, match="n_h=4"):
        triton_delta_product(q, k, v, beta, g)


# ---------------------------------------------------------------- GPU (run on the device)

GPU_CASES = {
    "fla GDN default: H=6, dk=256, dv=512": (2, 300, 6, 6, 256, 512, 1, True, None, {}),
    "Qwen3-Next: Hk=16, Hv=32, dk=dv=128": (2, 300, 16, 32, 128, 128, 1, True, None, {}),
    "DeltaProduct n_h=3, dk=256, dv=512": (1, 200, 6, 6, 256, 512, 3, True, None, {}),
    "OLMo-Hybrid-like grouped n_h=2": (1, 300, 4, 8, 128, 128, 2, True, None, {}),
    "varlen Qwen grouped": (1, None, 16, 32, 128, 128, 1, True, [1000, 37, 64, 1, 511, 300], {}),
    "varlen DeltaProduct n_h=2 dv=512": (1, None, 6, 6, 256, 512, 2, True, [700, 5, 129, 300], {}),
}


# every case in bf16; fp16 and fp32 where each feature (dk = 256 with dv = 512, grouped, packed) appears once
DTYPE_CASES = [(name, torch.bfloat16) for name in GPU_CASES] + [
    (name, dt)
    for dt in (torch.float16, torch.float32)
    for name in (
        "fla GDN default: H=6, dk=256, dv=512",
        "Qwen3-Next: Hk=16, Hv=32, dk=dv=128",
        "varlen DeltaProduct n_h=2 dv=512",
    )
]


@gpu
@needs_cuda
@pytest.mark.parametrize("name, dtype", DTYPE_CASES, ids=[f"{n} {str(d)[6:]}" for n, d in DTYPE_CASES])
def test_gpu_real_shapes_vs_float64(name, dtype):
    errs = _check_triton(GPU_CASES[name], dtype, device="cuda")
    print(f"{name} {dtype}: o/final/boundary rel err {errs[0]:.2e} {errs[1]:.2e} {errs[2]:.2e}")


@gpu
@needs_cuda
def test_gpu_long_packed_batch_vs_chunked_float64():
    """A packed batch of 8 documents (4-4000 tokens) of the Qwen grouped shape against the PyTorch form."""
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    lengths = [4000, 17, 2048, 640, 4, 1500, 3333, 64]
    cu = _cu(lengths, "cuda")
    q, k, v, beta, g, s0 = _inputs(1, sum(lengths), 16, 32, 128, 128, 1, True, n_seq=8, device="cuda")
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o, fin, bnd = triton_delta_product(qb, kb, vb, beta, g, initial_state=s0, normalize_qk=True, cu_seqlens=cu)
    d = torch.float64
    ref = chunk_delta_product(
        qb.to(d), kb.to(d), vb.to(d), beta.to(d), g.to(d), initial_state=s0.to(d), normalize_qk=True, cu_seqlens=cu
    )
    errs = _rel(o, ref[0]), _rel(fin, ref[1]), _rel(bnd, ref[2])
    assert max(errs) < TOL[torch.bfloat16], errs


@gpu
@needs_cuda
@pytest.mark.parametrize("n_h", [1, 2])
def test_gpu_matches_fla_packed(n_h):
    """Our packed forward against fla 0.6.0 with the same cu_seqlens (fla's GDN kernel for n_h = 1, grouped)."""
    fla = pytest.importorskip("fla.ops")
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    lengths = [900, 77, 64, 1, 300]
    T, N = sum(lengths), len(lengths)
    Hk, Hv = (2, 4) if n_h == 1 else (4, 4)
    q, k, v, beta, g, s0 = _inputs(1, T, Hk, Hv, 128, 128, n_h, True, n_seq=N, device="cuda", beta_max=1.0)
    q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    cu = _cu(lengths, "cuda").long()
    o, fin, _ = triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, cu_seqlens=cu)
    if n_h == 1:
        fo, ffin = fla.chunk_gated_delta_rule(
            q, k[:, :, 0], v[:, :, 0], g, beta[:, :, 0], initial_state=s0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        )  # fmt: skip
    else:
        from fla.ops.gated_delta_product import chunk_gated_delta_product

        fo, ffin = chunk_gated_delta_product(
            q, k.reshape(1, T * n_h, Hk, 128), v.reshape(1, T * n_h, Hv, 128), g, beta.reshape(1, T * n_h, Hv),
            num_householder=n_h, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )  # fmt: skip
    errs = _rel(o, fo), _rel(fin, ffin)
    assert max(errs) < 3e-2, f"ours vs fla (o, final): {errs}"


@gpu
@needs_cuda
def test_gpu_dispatch_falls_back_with_one_warning():
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward

    q, k, v, beta, g, s0 = _inputs(1, 100, 1, 2, 320, 64, 1, True, device="cuda")
    with torch.no_grad(), pytest.warns(UserWarning, match="dk=320") as rec:
        got = delta_product_forward(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
    assert len(rec) == 1
    assert _rel(got[0], _reference(q, k, v, beta, g, s0)[0]) < 1e-4


# ---------------------------------------------------------------- the launch paths default_config chooses
# Each against the float64 token loop and against the plain path (`LaunchConfig()`: the W path, q K^T formed in the
# output kernel's key-block loop, every state stored), which rounds differently, so to the dtype's tolerance.

# (B, T or None, Hk, Hv, K, V, n_h, gate, lengths or None)
PATH_CASES = {
    "dk 256 dv 512, key halves": (1, 150, 1, 1, 256, 512, 1, True, None),
    "dk 40 n_h 2, no gate": (2, 100, 2, 2, 40, 24, 2, False, None),
    "dk 96 grouped n_h 3, packed": (1, None, 1, 2, 96, 32, 3, True, [70, 5, 130]),
}
OUT_LOOPS = {"prefetch": dict(out_prefetch=True), "aqk": dict(out_aqk=True),
             "aqk + prefetch": dict(out_aqk=True, out_prefetch=True)}  # fmt: skip


@cpu_only
@pytest.mark.parametrize("name", list(PATH_CASES))
def test_keys_path_matches_float64_and_the_w_path(name):
    """The keys path (`state_keys_ws`): D = T (diag(beta) V - diag(c) (K S)) in the sequential kernel, no WY kernel."""
    errs = check_choice(PATH_CASES[name], torch.float32, dict(state_keys_ws=True), dict(state_keys_ws=False))
    assert max(errs[:3]) < 1e-5, f"float32 against float64: {errs[:3]}"


@cpu_only
def test_keys_path_bf16():
    check_choice(PATH_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, dict(state_keys_ws=True), dict())


@cpu_only
@pytest.mark.parametrize("loop", list(OUT_LOOPS))
@pytest.mark.parametrize("name", ["dk 256 dv 512, key halves", "dk 96 grouped n_h 3, packed"])
def test_output_loops_match_float64_and_the_plain_loop(name, loop):
    """`out_prefetch` runs the plain loop's products in the same order (bit-identical in the interpreter);
    `out_aqk` sums q K^T over dk in the kkt kernel, so it differs by rounding. The states are the same."""
    errs = check_choice(PATH_CASES[name], torch.float32, OUT_LOOPS[loop], dict())
    assert max(errs[:3]) < 1e-5, f"{loop}: float32 against float64 {errs[:3]}"
    assert errs[3] == 0.0 if loop == "prefetch" else errs[3] < 1e-5, f"{loop}: o differs by {errs[3]:.2e}"
    assert errs[4] == 0.0 and errs[5] == 0.0, f"{loop}: the states changed ({errs[4:]}), the output kernel writes none"


@cpu_only
def test_output_loops_bf16():
    for loop in OUT_LOOPS.values():
        check_choice(PATH_CASES["dk 96 grouped n_h 3, packed"], torch.bfloat16, loop, dict())


@cpu_only
@pytest.mark.parametrize("keep", [False, True], ids=["every other state", "all states"])
@pytest.mark.parametrize("case", [(1, 300, 1, 1, 256, 64, 1, True, None), (2, 200, 2, 4, 64, 32, 1, False, None),
                                  (1, None, 1, 2, 96, 32, 1, True, [70, 5, 200, 130])],
                         ids=["dk 256, 5 chunks", "grouped, 4 chunks, no gate", "packed 2, 1, 4, 3 chunks"])
def test_output_pairs_match_float64_and_the_unpaired_path(case, keep):
    """`out_pair` (n_h = 1 with `out_aqk`): an odd chunk reads the previous chunk's state and adds that chunk's share;
    without boundary states returned only every other state is stored (half dtype in bf16, fp32 here)."""
    errs = check_choice(case, torch.float32, dict(out_aqk=True, out_pair=True, out_bk=32), dict(out_aqk=True),
                        keep_boundaries=keep)  # fmt: skip
    assert max(errs[:2]) < 1e-5 and errs[3] < 1e-5, errs


@cpu_only
def test_output_pairs_bf16():
    check_choice((1, None, 1, 2, 96, 32, 1, True, [70, 5, 200, 130]), torch.bfloat16,
                 dict(out_aqk=True, out_pair=True, state_keys_ws=True), dict(), keep_boundaries=False)  # fmt: skip


@cpu_only
@pytest.mark.parametrize(
    "n_h, keep, config, expected",
    [(1, False, dict(out_pair=True, out_aqk=True), 2), (1, True, dict(out_pair=True, out_aqk=True), 1),
     (1, False, dict(out_pair=False, out_aqk=True), 1), (1, False, dict(out_pair=True, out_aqk=False), 1),
     (2, False, dict(out_pair=True, out_aqk=True), 1)],
)  # fmt: skip
def test_the_state_kernel_skips_odd_states_only_where_nobody_reads_them(monkeypatch, n_h, keep, config, expected):
    import deltalab.kernels.delta_rule.triton_chunk as tc

    seen = []
    real = tc.launch_resident
    monkeypatch.setattr(tc, "launch_resident", lambda *a, **kw: (seen.append(a[3]["BND_EVERY"]), real(*a, **kw))[1])
    q, k, v, beta, g, s0 = _inputs(1, 130, 1, 1, 32, 16, n_h, True)
    o, _, _ = tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True,
                                      output_boundary_states=keep, config=tc.LaunchConfig(**config))
    assert seen == [expected] and torch.isfinite(o).all()


@cpu_only
@pytest.mark.parametrize("Hk, Hv, heads", [(2, 4, 2), (1, 4, 4), (2, 6, 1), (2, 2, 1)],
                         ids=["group 2", "group 4", "group 3", "no groups"])  # fmt: skip
def test_kkt_programs_serve_a_power_of_two_group(monkeypatch, Hk, Hv, heads):
    """One kkt program forms K K^T and q K^T once for the value heads of a key head where Hv / Hk is a power of two."""
    import deltalab.kernels.delta_rule.triton_chunk as tc

    seen = []
    real = tc.kkt_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid[0], kw["KG"]))
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(tc, "kkt_kernel", Spy())
    q, k, v, beta, g, s0 = _inputs(1, 100, Hk, Hv, 32, 16, 1, True)
    o, fin, bnd = tc.triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True,
                                          config=tc.LaunchConfig(out_aqk=True, out_pair=True))
    assert seen == [(Hv * 2 // heads, heads)]  # (two chunks)
    ro, rfin, rbnd = _reference(q, k, v, beta, g, s0)
    assert max(_rel(o, ro), _rel(fin, rfin), _rel(bnd, rbnd)) < 1e-5


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["GDN default", "Qwen3-Next packed", "DeltaProduct n_h=2"])
def test_gpu_plain_path_matches_float64(name):
    """The real shapes through the plain path (`LaunchConfig()`), against float64 and the default path's choices."""
    check_choice(GPU_REAL_CASES[name], torch.bfloat16, dict(), dict(state_keys_ws=True), device="cuda")
