"""`deltalab probe NAME` and `python -m deltalab.probes.NAME`: JSON records, results written with provenance, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.probes.results import list_results, read_results
from deltalab.probes.synthetic import ROTATION_HEAD, write_synthetic_store
from tests.store.chunks import chunk_files, forge, has_crc32c, zstd_only

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("cli") / "s.zarr", n_seq=4, length=80, batch_size=2, seed=8)


def _probe(*args: str):
    return CliRunner().invoke(app, ["probe", *args])


def test_betas_and_keys_json_records(store):
    res = _probe("betas", "--store", str(store), "--json")
    assert res.exit_code == 0, res.output
    recs = json.loads(res.stdout)
    assert len(recs) == 2 * 4 * 2
    assert {"layer", "head", "step", "beta_mean", "reflection"} <= set(recs[0])
    assert [(r["layer"], r["head"]) for r in recs if r["reflection"]] == [(0, ROTATION_HEAD)] * 2
    res = _probe("keys", "--store", str(store), "--json")
    recs = json.loads(res.stdout)
    rec = next(r for r in recs if r["layer"] == 0 and r["head"] == ROTATION_HEAD and r["step"] == 0)
    assert rec["explained_variance_3"] > 0.95 and len(rec["explained_variance_ratio"]) == 8


def test_results_written_with_provenance_and_nothing_else_touched(store):
    root_meta = (store / "zarr.json").read_bytes()
    assert _probe("erank", "--store", str(store)).exit_code == 0
    assert _probe("spectra", "--store", str(store), "--window", "2", "--json").exit_code == 0
    assert {"erank", "spectra"} <= set(list_results(store))
    out = read_results(store, "spectra")
    assert out.attrs["complete"] is True and out.attrs["probe"] == "spectra"
    assert out.attrs["params"]["window"] == 2
    assert out.attrs["source"]["checkpoint_digest"] == "sha256:synthetic"
    assert out.attrs["command_line"][:3] == ["deltalab", "probe", "spectra"]
    assert out["eig_P"].sizes["seq"] == 4 and "frac_rotation" in out
    assert out.attrs["records"][ROTATION_HEAD]["rotation"] is True
    er = read_results(store, "erank")  # still there after another probe wrote
    assert er.attrs["complete"] and er["erank"].shape == (4, 2, 80, 4)
    assert (store / "zarr.json").read_bytes() == root_meta
    # --no-write leaves the store as it was
    before = sorted(p.name for p in (store / "results").iterdir())
    assert _probe("lengthgen", "--store", str(store), "--no-write").exit_code == 0
    assert sorted(p.name for p in (store / "results").iterdir()) == before


def test_python_m_is_the_same_program(store):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "deltalab.probes.lengthgen", "--store", str(store), "--json",
                           "--no-write"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    via_cli = _probe("lengthgen", "--store", str(store), "--json", "--no-write")
    assert json.loads(proc.stdout) == json.loads(via_cli.stdout)


def test_bad_input_is_one_line_exit_2(store, tmp_path):
    res = _probe("betas", "--store", str(tmp_path / "missing"))
    assert res.exit_code == 2
    assert res.stderr.strip().startswith("error:") and len(res.stderr.strip().splitlines()) == 1
    res = _probe("erank", "--store", str(store), "--layers", "7")
    assert res.exit_code == 2 and "layer(s) [7]" in res.stderr
    res = _probe("spectra", "--store", str(store), "--bogus")
    assert res.exit_code == 2


def test_a_corrupt_chunk_is_one_line_naming_the_fix_and_nothing_is_written(store, tmp_path):
    """A chunk whose bytes no longer match zarr's crc32c checksum: one line (not the two checksums), exit 2, and the
    store byte for byte as it was (no results folder started)."""
    import shutil

    bad = tmp_path / "bad.zarr"
    shutil.copytree(store, bad)
    chunk = sorted(p for p in (bad / "beta").rglob("*") if p.is_file() and "c" in p.relative_to(bad).parts)[0]
    chunk.write_bytes(os.urandom(chunk.stat().st_size))
    before = {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    res = _probe("betas", "--store", str(bad))
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"store {bad} has a corrupt chunk" in lines[0] and "recapture" in lines[0]
    assert {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("array", ["complete", "pad"])
def test_garbage_in_a_small_array_is_one_line_too(store, tmp_path, array):
    """The small per-sequence arrays are zstd then crc32c: garbage there fails its checksum (zarr's ValueError, read
    inside store.open for `complete`), which is the same one line and exit 2, with the store byte for byte as it was."""
    import shutil

    bad = tmp_path / "bad.zarr"
    shutil.copytree(store, bad)
    chunks = chunk_files(bad / array)
    assert chunks
    for chunk in chunks:
        chunk.write_bytes(os.urandom(max(chunk.stat().st_size, 16)))
    before = {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    res = _probe("betas", "--store", str(bad))
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"store {bad} has a corrupt chunk (its checksum does not match" in lines[0], lines
    assert {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("array", ["complete", "pad", "tokens"])
def test_a_corrupt_chunk_that_still_decodes_fails_its_checksum(store, tmp_path, array):
    """A chunk rewritten as a valid zstd frame of other bytes (its crc32c tail kept) decodes fine, so without the
    checksum the probe would read wrong numbers: it is the one corrupt-chunk line and exit 2, the store unchanged."""
    import shutil

    bad = tmp_path / "bad.zarr"
    shutil.copytree(store, bad)
    assert has_crc32c(bad / array)
    forge(chunk_files(bad / array)[0], bad / array)
    before = {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    res = _probe("betas", "--store", str(bad))
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"store {bad} has a corrupt chunk (its checksum does not match its bytes)" in lines[0]
    assert "recapture" in lines[0] and "Stored and computed" not in res.stderr
    assert {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()} == before


def test_a_store_written_without_crc32c_still_reads(store, tmp_path):
    """Stores written before the crc32c (small arrays zstd only) read as before: the same records; garbage in such a
    chunk still fails in zstd, which is the one line (its bytes do not decode) and exit 2."""
    import shutil

    old = tmp_path / "old.zarr"
    shutil.copytree(store, old)
    for array in ("complete", "pad", "tokens", "labels"):
        zstd_only(old / array)
    res = _probe("betas", "--store", str(old), "--json", "--no-write")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == json.loads(_probe("betas", "--store", str(store), "--json", "--no-write").stdout)
    for chunk in chunk_files(old / "pad"):
        chunk.write_bytes(os.urandom(max(chunk.stat().st_size, 16)))
    res = _probe("betas", "--store", str(old))
    assert res.exit_code == 2, res.output
    assert f"store {old} has a corrupt chunk (its bytes do not decode)" in res.stderr.strip().splitlines()[0]


def test_a_failed_rerun_keeps_the_earlier_results_whole(store, tmp_path):
    """A probe run writes into a hidden partial group that replaces results/<name> only when it finishes: a run
    that fails (NaN keys: ranks cannot be computed) leaves the earlier results byte for byte, and no partial group;
    a run that succeeds replaces them and leaves nothing beside them."""
    import shutil

    import zarr

    copy = tmp_path / "s.zarr"
    shutil.copytree(store, copy)
    assert _probe("erank", "--store", str(copy)).exit_code == 0
    results = copy / "results"
    before = {p: p.read_bytes() for p in results.rglob("*") if p.is_file()}
    names = sorted(p.name for p in results.iterdir())  # erank, and whatever the shared store held already
    k = zarr.open_array(str(copy / "k"), mode="r+")
    k[(0,) * k.ndim] = float("nan")
    res = _probe("erank", "--store", str(copy))
    assert res.exit_code == 2 and "a state holds NaN or inf" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in results.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in results.iterdir()) == names and "erank" in names
    k[(0,) * k.ndim] = 0.0
    assert _probe("erank", "--store", str(copy)).exit_code == 0
    assert sorted(p.name for p in results.iterdir()) == names
    assert "erank" in list_results(copy) and read_results(copy, "erank").attrs["complete"]
    assert not any(n.startswith(".") for n in list_results(copy))
