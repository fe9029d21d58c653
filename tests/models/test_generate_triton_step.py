"""The Triton decode step (one token, all heads) against the float64 token-by-token recurrence.

CPU: TRITON_INTERPRET=1 on tiny shapes; GPU: marked gpu. Errors are max |ours - ref| / max |ref| of the output
and of the state after the step; the reference gets the same (rounded) inputs in float64."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from deltalab.kernels.delta_rule.naive import naive_delta_product  # noqa: E402
from deltalab.kernels.delta_rule.triton_step import triton_delta_rule_step  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}  # float32 arithmetic on rounded inputs


def inputs(B, HK, HV, K, V, n_h, gate, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, 1, HK, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, 1, n_h, HK, K, generator=gen), dim=-1)
    v = torch.randn(B, 1, n_h, HV, V, generator=gen)
    beta = torch.rand(B, 1, n_h, HV, generator=gen) * 2
    g = None
    if gate == "scalar":
        g = -torch.rand(B, 1, HV, generator=gen) * 3
    elif gate == "channel":
        g = -torch.rand(B, 1, HV, K, generator=gen) * 3
    state = torch.randn(B, HV, K, V, generator=gen)
    cast = [x.to(device=device, dtype=dtype) for x in (q, k, v, beta)]
    return (*cast, None if g is None else g.to(device), state.to(device))


def check(args, scale, block_v=None):
    q, k, v, beta, g, state = args
    o, final, bounds = triton_delta_rule_step(q, k, v, beta, g, scale, state, block_v=block_v)
    ref_o, ref_final, _ = naive_delta_product(*(x.double().cpu() for x in (q, k, v, beta)),
                                              None if g is None else g.double().cpu(), scale=scale,
                                              initial_state=state.double().cpu())
    tol = TOL[q.dtype] if q.dtype == torch.float32 else 1e-2  # o is rounded to the half dtype on the way out
    err_o = (o.double().cpu() - ref_o).abs().max() / ref_o.abs().max()
    err_s = (final.double().cpu() - ref_final).abs().max() / ref_final.abs().max()
    assert err_o < tol and err_s < TOL[torch.float32], (float(err_o), float(err_s))
    assert torch.equal(bounds[:, 0].cpu(), state.float().cpu()) and torch.equal(bounds[:, 1], final)


@interpreter
@pytest.mark.parametrize("HK, HV, K, V, n_h, gate", [
    (2, 2, 16, 16, 1, None), (1, 2, 16, 32, 2, "scalar"), (2, 4, 12, 20, 3, "channel"), (2, 2, 16, 16, 1, "scalar"),
])
def test_step_kernel_matches_the_float64_recurrence(HK, HV, K, V, n_h, gate):
    check(inputs(2, HK, HV, K, V, n_h, gate), K**-0.5, block_v=16)


@interpreter
def test_step_kernel_from_a_zero_state():
    q, k, v, beta, g, _ = inputs(1, 1, 1, 16, 16, 2, "scalar")
    o, final, _ = triton_delta_rule_step(q, k, v, beta, g, 0.25, None)
    ref_o, ref_final, _ = naive_delta_product(*(x.double() for x in (q, k, v, beta)), g.double(), scale=0.25)
    assert (o.double() - ref_o).abs().max() < 1e-5 and (final.double() - ref_final).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("HK, HV, K, V, n_h, gate", [
    (4, 8, 128, 128, 1, "scalar"), (8, 8, 128, 128, 3, "scalar"), (4, 4, 128, 256, 1, "channel"),
    (4, 4, 64, 64, 2, None),
])
def test_step_kernel_on_the_gpu(HK, HV, K, V, n_h, gate, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check(inputs(3, HK, HV, K, V, n_h, gate, device="cuda", dtype=dtype), K**-0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("name, op, kernel", [("gdn_hybrid_gva", "delta_rule", "triton_delta_rule_step"),
                                              ("rwkv7_fused", "dplr", "triton_dplr_step")])
def test_cuda_generation_takes_the_step_kernel_and_matches_the_cpu(name, op, kernel):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import importlib
    from unittest import mock

    from deltalab.models.generate import generate
    from tests.models.test_generate import load, prompts

    module = importlib.import_module(f"deltalab.kernels.{op}.triton_step")
    cpu = load(name, torch.float32)
    gpu = load(name, torch.float32).cuda()
    rows = prompts((9, 5))
    with mock.patch.object(module, kernel, wraps=getattr(module, kernel)) as spy:
        on_gpu = generate(gpu, rows, 8, output_logits=True)
    assert spy.call_count > 0
    on_cpu = generate(cpu, rows, 8, output_logits=True)
    # the Triton prefill against the CPU chunked form
    torch.testing.assert_close(on_gpu.logits.cpu(), on_cpu.logits, rtol=1e-3, atol=1e-3)

def dplr_inputs(B, H, K, V, gate, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kappa = torch.nn.functional.normalize(torch.randn(B, 1, H, K, generator=gen), dim=-1)
    a_rwkv = torch.rand(B, 1, H, K, generator=gen)
    q, k = torch.randn(B, 1, H, K, generator=gen), torch.randn(B, 1, H, K, generator=gen) * 0.3
    v = torch.randn(B, 1, H, V, generator=gen)
    g = -torch.rand(B, 1, H, K, generator=gen) * 0.6 if gate else None
    state = torch.randn(B, H, K, V, generator=gen)
    cast = [x.to(device=device, dtype=dtype) for x in (q, k, v, -kappa, kappa * a_rwkv)]
    return (*cast, None if g is None else g.to(device), state.to(device))


def check_dplr(args, block_v=None):
    from deltalab.kernels.dplr.naive import naive_dplr
    from deltalab.kernels.dplr.triton_step import triton_dplr_step

    q, k, v, a, b, g, state = args
    o, final, bounds = triton_dplr_step(q, k, v, a, b, g, 1.0, state, block_v=block_v)
    ref_o, ref_final, _ = naive_dplr(*(x.double().cpu() for x in (q, k, v, a, b)),
                                     None if g is None else g.double().cpu(), scale=1.0,
                                     initial_state=state.double().cpu())
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    err_o = (o.double().cpu() - ref_o).abs().max() / ref_o.abs().max()
    err_s = (final.double().cpu() - ref_final).abs().max() / ref_final.abs().max()
    assert err_o < tol and err_s < 1e-5, (float(err_o), float(err_s))
    assert torch.equal(bounds[:, 1], final)


@interpreter
@pytest.mark.parametrize("H, K, V, gate", [(2, 16, 16, True), (3, 12, 40, True), (1, 16, 16, False)])
def test_dplr_step_kernel_matches_the_float64_recurrence(H, K, V, gate):
    check_dplr(dplr_inputs(2, H, K, V, gate), block_v=16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, K, V", [(8, 64, 64), (4, 64, 128)])
def test_dplr_step_kernel_on_the_gpu(H, K, V, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_dplr(dplr_inputs(3, H, K, V, True, device="cuda", dtype=dtype))
