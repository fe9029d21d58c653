"""`python -m benchmarks.probes`: probe throughput on a store, printed as records, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from deltalab.probes.results import list_results
from deltalab.probes.synthetic import write_synthetic_store

ROOT = Path(__file__).resolve().parents[2]


def test_probe_bench_reports_throughput_and_writes_nothing(tmp_path):
    store = write_synthetic_store(tmp_path / "s.zarr", n_seq=4, length=80, batch_size=2, seed=8)
    before = set(list_results(store))
    res = subprocess.run([sys.executable, "-m", "benchmarks.probes", "--store", str(store), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    recs = json.loads(res.stdout)
    assert [r["probe"] for r in recs] == ["erank", "spectra"]
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == 4 * 80 * 2 for r in recs)
    assert set(list_results(store)) == before


def test_probe_bench_bad_probe_is_one_line_usage_error(tmp_path):
    store = write_synthetic_store(tmp_path / "s.zarr", n_seq=2, length=16, batch_size=2, seed=1)
    res = subprocess.run([sys.executable, "-m", "benchmarks.probes", "--store", str(store), "--probes", "keys"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "erank and spectra" in res.stderr
