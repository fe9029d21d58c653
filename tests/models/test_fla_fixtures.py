"""Checkpoints written by fla 0.6.0 itself load unchanged and reproduce fla's logits on the CPU.

The fixtures come from tests/fixtures/make_fla_fixtures.py, run on a GPU with fla 0.6.0.
Tolerance: `logits_fp32` were computed by fla in float32 (its own naive recurrence patched in,
since fla's chunk kernels refuse float32); ours is float32 with a different summation order, so
agreement is limited by float32 rounding through 2 layers: we require 1e-4 of the largest logit
(measured ~2e-6). Against fla's real bf16 kernels (`logits_bf16`) the bound is bf16's: 8e-2
(fla's own bf16-vs-fp32 gap measured up to 5.1e-2). The rwkv7 fixtures were written on the CPU (fla under the
Triton interpreter, float32 only) and have no `logits_bf16`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import load_checkpoint

FIXTURES = Path(__file__).parents[1] / "fixtures" / "fla"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "logits.safetensors").is_file())


def test_every_variant_has_a_fixture():
    assert {"gdp_nh2_all", "gdp_nh2_none", "gdp_nh3_gate", "gdp_nh3_conv", "delta_net",
            "gated_deltanet", "gdn_hybrid_gva", "kda_gva", "kda_bounded", "rwkv7_fused", "rwkv7_wide_v"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_fla_logits_match(name):
    ref = load_file(str(FIXTURES / name / "logits.safetensors"))
    model = load_checkpoint(FIXTURES / name)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    scale = ref["logits_fp32"].abs().max()
    assert (logits - ref["logits_fp32"]).abs().max() / scale < 1e-4
    if "logits_bf16" in ref:
        assert (logits - ref["logits_bf16"]).abs().max() / scale < 8e-2
