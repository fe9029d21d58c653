"""scripts/kimi_gap.py (why hooked and plain bf16 logits of a random Kimi Linear model differ) at a tiny size: in
float32 the two forwards agree and no router flips; with every expert selected the top-k set can not flip; in bf16
with top-2 routing some sets flip, and forcing the plain run's experts removes most of the gap."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_kimi_gap_script_runs_and_float32_agrees(capsys):
    path = Path(__file__).resolve().parents[2] / "scripts" / "kimi_gap.py"
    spec = importlib.util.spec_from_file_location("kimi_gap", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.main(["--hidden", "128", "--heads", "2", "--head-dim", "32", "--vocab", "256", "--batch", "1",
                        "--length", "96", "--variants", "moe,all-experts"])
    assert "plain~hooked" in capsys.readouterr().out
    by = {(r["variant"], r["dtype"]): r for r in rows}
    assert set(by) == {(v, d) for v in ("moe", "all-experts") for d in ("bfloat16", "float32")}
    for v in ("moe", "all-experts"):
        f32 = by[v, "float32"]
        assert f32["gap"] < 1e-5 and f32["flip_tokens"] == 0 and f32["pairs"] == 3 * 96
        assert by[v, "bfloat16"]["kernel"] < 2e-2  # the first KDA layer: bf16 rounding of q and k only
    assert by["all-experts", "bfloat16"]["flip_tokens"] == 0
    moe = by["moe", "bfloat16"]  # 4 of 288 top-2 sets flip here: 6.8e-2; the plain run's experts forced: 1.1e-2
    assert moe["flip_tokens"] > 0 and moe["forced"] < 0.5 * moe["gap"]
