"""Before any work, capture estimates the store's size (per token and in total) and refuses, in one line and
before writing anything, when the disk of --out lacks the space."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from deltalab import store
from deltalab.app.cli import app

ZOO = Path(__file__).parents[2] / "models" / "zoo"
SPEC = "S4:length=100,samples=6,seed=0"


def test_estimate_equals_the_stores_uncompressed_size_and_bounds_the_disk(tmp_path):
    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(ZOO / "s4-deltaproduct2"), "--data", SPEC, "--out", str(out),
                                   "--json", "--no-progress"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    ds = store.open(out, key_heads="key")
    logical = sum(int(ds[v].nbytes) for v in ds.data_vars)
    assert summary["estimated_bytes_per_token"] == logical / (6 * 100)  # every captured variable, uncompressed
    batch = ds.attrs["batch_size"]
    assert summary["estimated_bytes"] == logical / 6 * batch * -(-6 // batch)  # the last chunk counted whole
    on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert logical < on_disk <= summary["estimated_bytes"] + 64_000  # compression only shrinks it (plus metadata)


def test_capture_that_does_not_fit_is_refused_before_writing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 20_000, 20_000))
    out = tmp_path / "new" / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(ZOO / "s4-deltaproduct2"), "--data", SPEC, "--out", str(out)])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "the store needs about" in lines[0] and "has 20.0 kB free" in lines[0]
    assert "--dtype float16" in lines[0] and "pick another --out" in lines[0]
    assert not out.exists() and not (tmp_path / "new").exists()


def test_the_estimate_line_is_printed_first(tmp_path):
    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(ZOO / "s4-deltaproduct2"), "--data", SPEC, "--out", str(out)])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("capture: about"))
    assert "per token" in line and "for 6 sequence(s) of 100 tokens" in line and "free at" in line
    assert np.isfinite(float(line.split("about ")[1].split(" ")[0]))


def test_estimate_counts_the_reductions_results(tmp_path):
    """With --reduce the per-token results (often larger than the hooks kept) are in the estimate, uncompressed."""
    from deltalab.probes.results import read_results

    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(ZOO / "s4-deltaproduct2"), "--data", SPEC, "--out", str(out),
                                   "--json", "--no-progress", "--hooks", "tokens,beta",
                                   "--reduce", "ranks,spectra,attention"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    ds = store.open(out, key_heads="key")
    logical = sum(int(ds[v].nbytes) for v in ds.data_vars)
    for probe in ("erank", "spectra", "attention"):
        tok = read_results(out, probe)
        logical += sum(int(tok[v].nbytes) for v in tok.data_vars if "seq" in tok[v].dims)
    assert summary["estimated_bytes_per_token"] == logical / (6 * 100)


def _tmpfs(path: str) -> bool:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[1] == path and line.split()[2] == "tmpfs" for line in mounts)


@pytest.mark.skipif(not _tmpfs("/dev/shm") or shutil.disk_usage("/dev/shm").free > 64e9,
                    reason="needs /dev/shm as a tmpfs with at most 64 GB free (data sized to exceed it)")
def test_a_capture_larger_than_a_real_tmpfs_is_refused_before_writing(tmp_path):
    """The real disk check (no patching): data sized to twice /dev/shm's free space at the bundled model's bytes
    per token; one line, exit 2, nothing created under /dev/shm."""
    probe = CliRunner().invoke(app, ["capture", str(ZOO / "s4-deltaproduct2"), "--data", SPEC, "--out",
                                     str(tmp_path / "p.zarr"), "--json", "--no-progress"])
    per_token = json.loads(probe.output[probe.output.index("{"):])["estimated_bytes_per_token"]
    length = 512
    samples = int(2 * shutil.disk_usage("/dev/shm").free / (per_token * length)) + 1
    out = Path("/dev/shm") / f"deltalab-test-{tmp_path.name}" / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(ZOO / "s4-deltaproduct2"), "--data",
                                   f"S4:length={length},samples={samples},seed=0", "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "the store needs about" in lines[0] and "/dev/shm has" in lines[0]
    assert not out.parent.exists()
