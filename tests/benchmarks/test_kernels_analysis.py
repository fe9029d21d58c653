"""Smoke run of the analysis benchmark on tiny shapes: every row measured, every error small."""

from __future__ import annotations

import json

from benchmarks import kernels_analysis as bench_analysis


def test_quick_run_rows_and_json(tmp_path):
    rows = bench_analysis.run(device="cpu", quick=True, targets=("spectra", "ranks"), methods=["gram64"])
    assert {r["target"] for r in rows} == {"spectra", "ranks"}
    for r in rows:
        assert "error" not in r, r
        assert r["token_heads_per_s"] > 0 and r["peer_token_heads_per_s"] > 0
        assert r.get("max_abs_err_vs_float64", r.get("max_rel_err_vs_float64")) < 1e-3
    table = bench_analysis.format_table(rows)
    assert "spectra" in table and "ranks" in table
    out = tmp_path / "rows.json"
    bench_analysis.main(["--device", "cpu", "--quick", "--targets", "spectra", "--out", str(out)])
    assert len(json.loads(out.read_text())) == 9
