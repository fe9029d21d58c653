"""Why o differs when the delta-rule forward keeps its unreturned boundary states in bf16 (GPU test
`test_gpu_half_internal_states_leave_o_to_bf16_rounding` failed at n_h = 1): o of the lean call against the call
that returns fp32 states, per output-kernel choice (key block, pipeline stages), and each against float64."""

from __future__ import annotations

import dataclasses

import torch

from kernels.naive import naive_delta_product
from kernels.triton_chunk import default_config, triton_delta_product


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def main() -> None:
    for K, V, n_h in [(128, 128, 1), (256, 512, 1), (128, 128, 3), (128, 128, 2)]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        B, T, H = 2, 1000, 4
        q = torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16()
        k = torch.randn(B, T, n_h, H, K, device="cuda", generator=gen).bfloat16()
        v = torch.randn(B, T, n_h, H, V, device="cuda", generator=gen).bfloat16()
        beta = torch.rand(B, T, n_h, H, device="cuda", generator=gen)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 3)
        s0 = torch.randn(B, H, K, V, device="cuda", generator=gen) * 0.1
        ref = naive_delta_product(*(x.double() for x in (q, k, v, beta, g)), initial_state=s0.double(),
                                  normalize_qk=True)[0]  # fmt: skip
        base = default_config(B, H, V, n_h, K)
        for name, kw in [("default", {}), ("out_bk 128", dict(out_bk=128)), ("out_bk 256", dict(out_bk=256)),
                         ("out stages 1", dict(out_stages=1)), ("out stages 2", dict(out_stages=2)),
                         ("state stages 1", dict(state_stages=1))]:  # fmt: skip
            cfg = dataclasses.replace(base, **kw)
            try:
                o1 = triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, config=cfg)[0]
                o2 = triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True, config=cfg,
                                          output_boundary_states=False)[0]  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a choice that does not compile is a result
                print(f"K={K} V={V} n_h={n_h} {name:>14}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
                continue
            bad = ((o1.float() - o2.float()).abs() > 2**-7 * o1.float().abs() + 1e-6).nonzero()
            first = bad[0].tolist() if len(bad) else None
            print(f"K={K} V={V} n_h={n_h} {name:>14}: fp32 states vs f64 {rel(o1, ref):.2e}, bf16 states vs f64 "
                  f"{rel(o2, ref):.2e}, o1 vs o2 {rel(o2, o1):.2e}, elements off {len(bad)} (first {first})",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
