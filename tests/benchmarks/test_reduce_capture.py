"""`python -m benchmarks.reduce_capture --quick`: capture into a store with and without reductions, each row a
share of the plain forward measured in the same run; the stores are removed afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_reduce_capture_bench_prints_one_row_per_mode(tmp_path):
    res = subprocess.run([sys.executable, "-m", "benchmarks.reduce_capture", "--quick", "--batches", "2",
                          "--states-batches", "1",
                          "--modes", "states,reduce", "--rank-every", "64", "--dir", str(tmp_path / "b"),
                          "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "r.json").read_text())
    assert [r["mode"] for r in out["rows"]] == ["states", "reduce ranks,spectra (every 64)"]
    assert all(r["tok_s"] > 0 and 0 < r["share_of_plain"] for r in out["rows"])
    states, reduced = out["rows"]
    assert (states["tokens"], reduced["tokens"]) == (2 * 512, 2 * 2 * 512)  # --states-batches 1, --batches 2
    assert reduced["store_bytes_per_token"] < states["store_bytes_per_token"] / 5  # no q, k, v, states stored
    assert "x plain" in res.stdout and not (tmp_path / "b").exists()


def test_profile_prints_the_top_operators_of_the_first_reduce_run(tmp_path):
    res = subprocess.run([sys.executable, "-m", "benchmarks.reduce_capture", "--quick", "--batches", "1",
                          "--modes", "reduce", "--rank-every", "64,256", "--profile", "--profile-rows", "5",
                          "--dir", str(tmp_path / "b"), "--json", str(tmp_path / "r.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["profiled"] == "reduce ranks,spectra (every 64)"  # the first reduce run only
    tail = res.stdout.split("profile of `reduce ranks,spectra (every 64)`", 1)[1]
    assert "top operators by self CPU time:" in tail and "Self CPU" in tail
    assert tail.count("Self CPU time total") == 1  # one table on the CPU (no CUDA table without a GPU)
