"""fla's chunk_dplr_delta_rule behind the DPLR contract (kernels.dplr.fla) and its dispatch.

On the CPU, without fla: a stand-in `fla.ops.generalized_delta_rule` whose kernel is a float64 token loop
written in fla 0.6.0's own convention (head-first inside, S [K, V] updated as S e^{gk} + k v^T + b (a^T S),
fla's signature and checks) checks the argument mapping and the boundary rebuild (segment transitions and
inhomogeneous parts); a swapped a/b mapping fails it. On the GPU (`-m gpu`, fla installed): the real kernel
against the float64 reference in float32 and bfloat16, packed batches and initial states, and its boundaries
against the chunked form's.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import pytest
import torch

import deltalab.kernels.dplr.dispatch as dplr
from deltalab.kernels.delta_rule.naive import boundary_offsets
from deltalab.kernels.dplr.chunk import chunk_dplr
from deltalab.kernels.dplr.fla import fla_dplr
from deltalab.kernels.dplr.naive import naive_dplr
from deltalab.kernels.testing import dplr_inputs as rwkv7_inputs
from deltalab.kernels.testing import rel_err


def fake_chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, **kwargs):
    """fla 0.6.0's chunk_dplr_delta_rule semantics as a float64 loop (its dplr_recurrence, per sequence)."""
    assert gk is not None and gk.shape == q.shape, "fla needs gk [B,T,H,K]"
    assert q.dtype == k.dtype == v.dtype == a.dtype == b.dtype, "fla takes one input dtype"
    assert initial_state is None or initial_state.dtype == torch.float32, "fla's state is float32"
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is not None:
        assert B == 1 and cu_seqlens.dtype == torch.int64, "fla's cu_seqlens: B = 1, int64"
        bounds = cu_seqlens.tolist()
        assert all(e > s for s, e in zip(bounds, bounds[1:])), "no empty sequences sent to fla"
        spans = [(0, s, e) for s, e in zip(bounds, bounds[1:])]
    else:
        spans = [(n, 0, T) for n in range(B)]
    hf = [x.double().transpose(1, 2) for x in (q, k, v, a, b, gk)]  # [B, H, T, D] like fla's naive
    o = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    finals = []
    for n, (row, s, e) in enumerate(spans):
        S = torch.zeros(H, K, v.shape[-1], dtype=torch.float64)
        if initial_state is not None:
            S = S + initial_state[n].double()
        for t in range(s, e):
            qt, kt, vt, at, bt, gt = (x[row, :, t] for x in hf)
            read = (S * at[..., None]).sum(-2, keepdim=True)  # a^T S, before the decay
            S = S * gt.exp()[..., None] + kt[..., None] * vt[:, None, :] + bt[..., None] * read
            o[row, :, t] = torch.einsum("hd,hdm->hm", qt * scale, S)
        finals.append(S)
    final = torch.stack(finals).float() if output_final_state else None
    return o.transpose(1, 2).to(v.dtype), final


@pytest.fixture
def fake_fla(monkeypatch):
    """Install the stand-in fla package; returns the list of its calls' shapes."""
    calls = []

    def kernel(*args, **kw):
        calls.append(tuple(args[0].shape))
        return fake_chunk_dplr_delta_rule(*args, **kw)

    mod = types.ModuleType("fla.ops.generalized_delta_rule")
    mod.chunk_dplr_delta_rule = kernel
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.generalized_delta_rule", mod)
    return calls


def f32(*xs):
    return tuple(None if x is None else x.float() for x in xs)


@pytest.mark.parametrize("decay,init", [(True, True), (False, False)])
def test_mapping_dense_against_float64_reference(fake_fla, decay, init):
    q, k, v, a, b, g, s0 = f32(*rwkv7_inputs(2, 150, 2, 8, 4, seed=3 + decay, decay=decay, init=init))
    ref = naive_dplr(*(None if x is None else x.double() for x in (q, k, v, a, b, g)), scale=0.7,
                     initial_state=None if s0 is None else s0.double())
    out = fla_dplr(q, k, v, a, b, g, scale=0.7, initial_state=s0)
    assert len(fake_fla) == 3  # outputs, segment inhomogeneous parts, segment transitions
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    for got, want in zip(out, ref):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5


def test_mapping_packed_with_empty_and_short_sequences(fake_fla):
    cu = torch.tensor([0, 70, 75, 75, 204])
    q, k, v, a, b, g, _ = f32(*rwkv7_inputs(1, 204, 2, 8, 8, seed=21))
    s0 = torch.randn(4, 2, 8, 8)
    ref = naive_dplr(*(x.double() for x in (q, k, v, a, b, g)), scale=0.5, initial_state=s0.double(),
                     cu_seqlens=cu)
    out = fla_dplr(q, k, v, a, b, g, scale=0.5, initial_state=s0, cu_seqlens=cu, chunk_size=32)
    ref32 = naive_dplr(*(x.double() for x in (q, k, v, a, b, g)), scale=0.5, initial_state=s0.double(),
                       cu_seqlens=cu, chunk_size=32)
    assert out[2].shape[1] == boundary_offsets(cu, 32)[-1]
    assert rel_err(out[0], ref[0]) < 1e-5 and rel_err(out[1], ref[1]) < 1e-5
    assert rel_err(out[2], ref32[2]) < 1e-5
    assert torch.equal(out[1][2], s0[2])  # the empty sequence keeps its initial state


def test_a_wrong_mapping_fails(fake_fla):
    """The check can fail: a and b swapped (or the default fla scale) give visibly wrong outputs."""
    q, k, v, a, b, g, s0 = f32(*rwkv7_inputs(1, 80, 1, 8, 4, seed=4, init=True))
    ref = naive_dplr(*(x.double() for x in (q, k, v, a, b, g)), scale=1.0, initial_state=s0.double())
    swapped = fla_dplr(q, k, v, b, a, g, scale=1.0, initial_state=s0)
    assert rel_err(swapped[0], ref[0]) > 1e-2 and rel_err(swapped[2], ref[2]) > 1e-2


def test_dispatch_uses_fla_where_wanted_and_falls_back_once(fake_fla, monkeypatch):
    monkeypatch.setattr(dplr, "_fla_wanted", lambda q: True)
    monkeypatch.setattr(dplr, "_warned", set())
    q, k, v, a, b, g, s0 = f32(*rwkv7_inputs(1, 70, 2, 8, 4, seed=5, init=True))
    want = chunk_dplr(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    got = dplr.dplr_forward(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    assert len(fake_fla) == 3
    for x, y in zip(got, want):
        assert rel_err(x, y) < 1e-5
    with pytest.raises(ValueError, match="initial_state"):  # malformed inputs raise on the fla path too
        dplr.dplr_forward(q, k, v, a, b, g, scale=1.0, initial_state=s0[:, :1])
    wide = [torch.randn(1, 4, 1, 257) for _ in range(4)]
    with pytest.warns(UserWarning, match="head dims K=257"):
        dplr.dplr_forward(*wide[:2], torch.randn(1, 4, 1, 2), *wide[2:], None, scale=1.0)
    monkeypatch.setitem(sys.modules, "fla.ops.generalized_delta_rule", None)  # import raises: fla absent
    with pytest.warns(UserWarning, match="fla is not importable") as rec:
        out = dplr.dplr_forward(q, k, v, a, b, g, scale=1.0, initial_state=s0)
    assert len(rec) == 1 and len(fake_fla) == 3 and rel_err(out[0], want[0]) < 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second fallback is silent: one warning line per reason
        dplr.dplr_forward(q, k, v, a, b, g, scale=1.0, initial_state=s0)


def test_mapping_with_fla_own_recurrent_kernel(monkeypatch):
    """Where fla is importable (a separate venv on the CPU with TRITON_INTERPRET=1, or the device): fla's own
    fused_recurrent_dplr_delta_rule, which has chunk_dplr_delta_rule's signature and state convention, plugged
    into fla_dplr reproduces the float64 reference (fla's chunked kernel does not run under the interpreter).
    Measured on the CPU: ~1e-7 relative in float32 for o, final and boundaries."""
    fla_gdr = pytest.importorskip("fla.ops.generalized_delta_rule")
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("fla's Triton kernels need CUDA or TRITON_INTERPRET=1")
        import triton.runtime.autotuner as autotuner  # the interpreter cannot benchmark: take the first config
        monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config=None, **kw: [0.0, 0.0, 0.0])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cu = torch.tensor([0, 70, 71, 71, 80])
    x = f32(*rwkv7_inputs(1, 80, 1, 16, 16, seed=1, log_w_min=-0.61))[:6]
    s0 = torch.randn(4, 1, 16, 16, dtype=torch.float64)
    ref = naive_dplr(*(t.double() for t in x), scale=0.5, initial_state=s0, cu_seqlens=cu, chunk_size=32)
    out = fla_dplr(*(t.to(dev) for t in x), scale=0.5, initial_state=s0.float().to(dev), cu_seqlens=cu.to(dev),
                   chunk_size=32, kernel=fla_gdr.fused_recurrent_dplr_delta_rule)
    for got, want in zip(out, ref):
        assert got.shape == want.shape and rel_err(got, want) < 1e-5


# ---------------------------------------------------------------- GPU: the real fla 0.6.0 kernel


def _cuda(*xs):
    return tuple(None if x is None else x.cuda() for x in xs)


def _no_chunk(monkeypatch):
    """Make the PyTorch fallback raise, so a GPU test proves the fla path ran."""
    def boom(*args, **kw):
        raise AssertionError("dplr_forward fell back to the chunked form")
    monkeypatch.setattr(dplr, "chunk_dplr", boom)


def _run(x, dtype, **kw):
    """bfloat16 through the dispatcher (which must take fla); float32 through fla_dplr itself (the dispatcher
    keeps float32 on the chunked form)."""
    with torch.no_grad():
        if dtype == torch.float32:
            return fla_dplr(*_cuda(*x), **kw)
        return dplr.dplr_forward(*_cuda(*x), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_fla_gpu_matches_float64_reference(monkeypatch, dtype, tol):
    """Dense batch with an initial state, RWKV-7 decays (log w >= -0.61). The float32 bound allows TF32 dots
    (unmeasured when written: the printed errors are the measurement)."""
    pytest.importorskip("fla")
    _no_chunk(monkeypatch)
    q, k, v, a, b, g, s0 = rwkv7_inputs(2, 300, 4, 64, 64, seed=31, init=True, log_w_min=-0.61)
    x = [t.to(dtype) for t in (q, k, v, a, b)] + [g.float()]
    ref = naive_dplr(*(t.double() for t in x), scale=1.0, initial_state=s0)
    out = _run(x, dtype, scale=1.0, initial_state=s0.float().cuda())
    errs = [rel_err(got, want) for got, want in zip(out, ref)]
    print(f"fla dplr {dtype}: o, final, boundaries rel err {errs}")
    assert out[0].dtype == dtype and out[2].shape == ref[2].shape
    assert max(errs) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_fla_gpu_packed_and_boundaries_equal_chunk_form(monkeypatch, dtype, tol):
    """Packed lengths 130, 1, 0, 200 with initial states and strong decays (down to -5 per token): fla against
    float64, and its boundary states against the chunked form's on the same inputs."""
    pytest.importorskip("fla")
    cu = torch.tensor([0, 130, 131, 131, 331])
    q, k, v, a, b, g, _ = rwkv7_inputs(1, 331, 2, 64, 32, seed=32)
    s0 = torch.randn(4, 2, 64, 32, dtype=torch.float64)
    x = [t.to(dtype) for t in (q, k, v, a, b)] + [g.float()]
    ref = naive_dplr(*(t.double() for t in x), scale=0.5, initial_state=s0, cu_seqlens=cu)
    with torch.no_grad():
        chunk = chunk_dplr(*_cuda(*x), scale=0.5, initial_state=s0.float().cuda(), cu_seqlens=cu.cuda())
    _no_chunk(monkeypatch)
    out = _run(x, dtype, scale=0.5, initial_state=s0.float().cuda(), cu_seqlens=cu.cuda())
    errs = [rel_err(got, want) for got, want in zip(out, ref)]
    print(f"fla dplr packed {dtype}: o, final, boundaries rel err {errs}; "
          f"boundaries vs chunk form {rel_err(out[2], chunk[2])}")
    assert out[2].shape == chunk[2].shape
    assert max(errs) < tol and rel_err(out[2], chunk[2]) < tol


@pytest.mark.gpu
def test_gradients_and_float32_take_the_chunked_form_on_gpu(monkeypatch):
    """Training needs autograd, float32 analyses need float32 accuracy: both run the chunked form on CUDA."""
    def boom(*args, **kw):
        raise AssertionError("fla path used")
    monkeypatch.setattr(dplr.dplr_fla, "fla_dplr", boom)
    q, k, v, a, b, g, _ = _cuda(*f32(*rwkv7_inputs(1, 70, 1, 16, 8, seed=33)))
    with torch.no_grad():
        dplr.dplr_forward(q, k, v, a, b, g, scale=1.0)
    q.requires_grad_(True)
    dplr.dplr_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), a.bfloat16(), b.bfloat16(), g,
                      scale=1.0)[0].float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
