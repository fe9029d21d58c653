"""Errors of U from v on the W path (`state_from_v`, `state_keys_ws=False`) at the GPU tests' realistic shapes, per
pipeline stage count and value tile: o / final / boundary against float64 and against the path that reads U.

`python scripts/fromv_check.py` (GPU; the W-path GPU tests of tests/kernels/test_triton_from_v.py failed in bf16 and
fp16 on an H100: this tells a miscompile, which depends on stages, from rounding, which does not)."""

from __future__ import annotations

import torch

from tests.kernels.delta_rule_cases import GPU_REAL_CASES, check_choice


def report(stage_counts: tuple[int, ...] = (1, 2, 3), tiles: tuple[int, ...] = (32, 64)) -> None:
    """One line a case, stage count and value tile: the six errors of `check_choice`, or FAIL and why."""
    for name, dtype in [("GDN default", torch.bfloat16), ("grouped n_h=3", torch.bfloat16),
                        ("grouped n_h=3", torch.float16), ("Qwen3-Next packed", torch.bfloat16)]:  # fmt: skip
        for stages in stage_counts:
            for bv in tiles:
                off = dict(state_keys_ws=False, state_stages=stages, state_bv=bv)
                try:
                    errs = check_choice(GPU_REAL_CASES[name], dtype, dict(off, state_from_v=True), off, device="cuda")
                    text = " ".join(f"{e:.1e}" for e in errs)
                except AssertionError as err:
                    text = "FAIL " + str(err).splitlines()[0][-160:]
                print(f"{name} {str(dtype)[6:]} stages {stages} bv {bv}: {text}", flush=True)


def main() -> None:
    report()


if __name__ == "__main__":
    main()
