"""Trust in stored data: every chunk carries a checksum, `deltalab store verify` names damage, a resume repairs it
to what an uninterrupted capture writes, probes refuse damaged chunks in one line, one capture per store at a time,
and interrupted renames leave nothing that lasts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltalab import store
from deltalab.app.cli import app
from deltalab.models import DeltaProductForCausalLM, save_checkpoint
from deltalab.store import schema
from deltalab.store.verify import has_checksums, verify
from tests.store.test_capture import tiny_config, tree_bytes

SPEC = "S4:length=40,samples=6,seed=3"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(DeltaProductForCausalLM(tiny_config()), tmp_path_factory.mktemp("ckpt") / "gdp")


@pytest.fixture(scope="module")
def clean(ckpt, tmp_path_factory) -> Path:
    """An uninterrupted capture of SPEC, batches of 2 sequences (3 chunks along seq)."""
    out = tmp_path_factory.mktemp("clean") / "clean.zarr"
    store.capture(ckpt, SPEC, out, batch_size=2, progress=False)
    return out


def copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def shard(path: Path, var: str, i: int) -> Path:
    """The file of seq chunk `i` of captured variable `var`."""
    files = sorted(p for p in (path / var / "c" / str(i)).rglob("*") if p.is_file())
    assert len(files) == 1, files
    return files[0]


def flip(file: Path, at: int, n: int = 6) -> None:
    """Flip `n` bytes from offset `at` (inside a chunk's values, not its checksum or the shard index)."""
    data = bytearray(file.read_bytes())
    for j in range(at, at + n):
        data[j] ^= 0x5A
    file.write_bytes(bytes(data))


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_new_stores_checksum_every_chunk(clean):
    assert json.loads((clean / "zarr.json").read_text())["attributes"]["deltalab_format"] == schema.CHECKSUM_FORMAT
    for var in store.read_attrs(clean)["variables"]:
        assert has_checksums(json.loads((clean / var / "zarr.json").read_text())), var
    report = verify(clean)
    assert report.clean and not report.unchecked and report.checked >= 3 * 13


def test_verify_names_flipped_bytes_in_an_activation_chunk(clean, tmp_path):
    ok = cli("store", "verify", str(clean), "--no-progress")
    assert ok.exit_code == 0 and "no damage" in ok.output, ok.output
    bad = copy(clean, tmp_path / "bad.zarr")
    flip(shard(bad, "v", 1), at=100)  # inside layer 0's inner chunk: the values change, the index does not
    opened = store.open(bad, verify=False)  # format 3: the read itself fails, no wrong values come back
    with pytest.raises(ValueError, match="checksum"):
        np.asarray(opened["v"].values)
    res = cli("store", "verify", str(bad), "--no-progress")
    assert res.exit_code == 1, res.output
    assert "v/c/1/0/0/0/0/0 (seq 2-3, checksum mismatch)" in res.output
    assert "damaged sequence(s): 2-3" in res.output
    assert f"repair: deltalab capture CHECKPOINT --data {SPEC} --out {bad}" in res.output  # captured in-process
    as_json = json.loads(cli("store", "verify", str(bad), "--json", "--no-progress").output)
    assert as_json["damaged_sequences"] == [2, 3] and as_json["damage"][0]["array"] == "v"
    missing = cli("store", "verify", str(tmp_path / "nope.zarr"))
    assert missing.exit_code == 2 and len(missing.output.strip().splitlines()) == 1 and "does not exist" in \
        missing.output


def test_a_probe_on_a_flipped_chunk_names_the_sequences_and_the_repair(clean, tmp_path, capsys):
    from deltalab.probes.base import run_module

    bad = copy(clean, tmp_path / "bad.zarr")
    flip(shard(bad, "state", 2), at=64)
    before = tree_bytes(bad)
    assert run_module("erank", ["--store", str(bad)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "damaged sequence(s) 4-5" in lines[0] and "state/c/2/" in lines[0], lines[0]
    assert "rerun `deltalab capture" in lines[0] and "recaptures only the damaged sequences" in lines[0]
    assert "Stored and computed" not in lines[0]
    after = tree_bytes(bad)
    assert {k: v for k, v in after.items() if not k.startswith("results/")} == before
    assert store.list_results(bad) == []


def test_open_names_a_truncated_shard_before_reading_it(clean, tmp_path):
    bad = copy(clean, tmp_path / "bad.zarr")
    file = shard(bad, "k", 0)
    os.truncate(file, file.stat().st_size - 10)
    with pytest.raises(store.TruncatedStoreError) as err:
        store.open(bad)
    assert "\n" not in str(err.value) and "k/c/0/0/0/0/0/0 (seq 0-1" in str(err.value)
    assert "rerun `deltalab capture" in str(err.value)


@pytest.mark.parametrize("damage", ["deleted", "truncated", "flipped", "several"])
def test_resume_repairs_damage_to_an_uninterrupted_capture(ckpt, clean, tmp_path, damage):
    out = copy(clean, tmp_path / "s.zarr")
    if damage in ("deleted", "several"):
        shard(out, "v", 1).unlink()
    if damage in ("truncated", "several"):
        os.truncate(shard(out, "beta", 2), 50)
    if damage in ("flipped", "several"):
        flip(shard(out, "q", 0), at=40)
    if damage == "several":
        flip(shard(out, "tokens", 2), at=2, n=1)  # zstd + crc32c
    assert not verify(out).clean
    assert store.info(out)["complete"] == 6  # the flags alone say complete: that is why resume verifies
    res = cli("capture", str(ckpt), "--data", SPEC, "--out", str(out), "--no-progress")
    assert res.exit_code == 0, res.output
    expect = {"deleted": "2-3", "truncated": "4-5", "flipped": "0-1", "several": "0-5"}[damage]
    assert f"repaired damaged sequence(s) {expect}" in res.output, res.output
    assert f"recapturing damaged sequence(s) {expect}" in res.output
    assert "6/6 complete" in res.output
    assert verify(out).clean
    assert tree_bytes(out) == tree_bytes(clean)
    np.testing.assert_array_equal(store.open(out)["v"].values, store.open(clean)["v"].values)
    again = cli("capture", str(ckpt), "--data", SPEC, "--out", str(out), "--no-progress")
    assert again.exit_code == 0 and "wrote 0 sequence(s), skipped 6" in again.output, again.output


def test_stores_of_older_formats_open_and_verify_says_they_carry_no_checksums(ckpt, tmp_path, monkeypatch):
    """A format-2 store (activations raw, no crc32c: written here as deltalab did before) opens, reads the same
    values, verifies clean with a note that its activations carry no checksums, and still takes appends."""
    old, new = tmp_path / "old.zarr", tmp_path / "new.zarr"
    with monkeypatch.context() as patch:
        patch.setattr(schema, "format_version", lambda attrs: 2)
        patch.setattr(schema, "compressors_for", lambda var: None if schema.VARIABLES[var].dtype == "act" else
                      schema.checked_compressors(level=1))
        store.capture(ckpt, SPEC, old, batch_size=2, progress=False)
    store.capture(ckpt, SPEC, new, batch_size=2, progress=False)
    assert store.read_attrs(old)["deltalab_format"] == 2
    assert not has_checksums(json.loads((old / "v" / "zarr.json").read_text()))
    for var in ("v", "state", "tokens"):
        np.testing.assert_array_equal(store.open(old)[var].values, store.open(new)[var].values)
    res = cli("store", "verify", str(old), "--no-progress")
    assert res.exit_code == 0, res.output
    assert "store format 2 (before 3)" in res.output and "carry no checksums" in res.output
    assert "v" in res.output.split("carry no checksums")[0]
    os.truncate(shard(old, "v", 1), 99)  # sizes are still checked
    assert cli("store", "verify", str(old), "--no-progress").exit_code == 1
    more = cli("capture", str(ckpt), "--data", "S4:length=40,samples=2,seed=9", "--out", str(old), "--no-progress")
    assert more.exit_code == 0 and "repaired" not in more.output and "8/8 complete" in more.output, more.output
    assert store.read_attrs(old)["deltalab_format"] == 2 and store.open(old, verify=False).sizes["seq"] == 8


# --- one capture at a time; leftovers ------------------------------------------------------------------------

def test_a_second_capture_into_a_locked_store_is_one_line_and_creates_nothing(ckpt, tmp_path):
    from deltalab.store.lock import StoreLock

    out = tmp_path / "runs" / "s.zarr"
    with StoreLock(out):
        before = sorted(p.name for p in out.parent.iterdir())
        res = cli("capture", str(ckpt), "--data", SPEC, "--out", str(out), "--no-progress")
        assert res.exit_code == 2
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and f"another capture (pid {os.getpid()}) is writing {out}" in lines[0], lines
        assert sorted(p.name for p in out.parent.iterdir()) == before and not out.exists()
    assert not any(out.parent.iterdir())  # released: the lock file is gone
    (out.parent / ".s.zarr.lock").write_text("999999999\n")  # left by a capture killed with -9: no lock held
    ok = cli("capture", str(ckpt), "--data", SPEC, "--out", str(out), "--no-progress", "--batch-size", "2")
    assert ok.exit_code == 0, ok.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["s.zarr"]


@pytest.mark.slow
def test_two_capture_processes_into_one_store(ckpt, clean, tmp_path):
    """Two real processes at once: exactly one writes (the store comes out as an uninterrupted capture), the other
    gets the one line and exit 2, and no `.creating-*` folder is left."""
    out = tmp_path / "s.zarr"
    cmd = [sys.executable, "-m", "deltalab.app.cli", "capture", str(ckpt), "--data", SPEC, "--out", str(out),
           "--batch-size", "2", "--no-progress"]
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=180), *p.communicate()) for p in procs]
    codes = sorted(r[0] for r in results)
    if codes == [0, 0]:  # one finished before the other started (a slow machine): then the second resumed
        assert all("6/6 complete" in r[1] for r in results)
    else:
        assert codes == [0, 2], results
        refused = next(r for r in results if r[0] == 2)
        assert len(refused[2].strip().splitlines()) == 1 and "another capture" in refused[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    assert tree_bytes(out) == tree_bytes(clean)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_interrupted_creation_is_cleaned_up_by_the_next_capture(ckpt, clean, tmp_path):
    out = copy(clean, tmp_path / "s.zarr")
    stale = tmp_path / f".s.zarr.creating-{dead_pid()}"
    (stale / "v").mkdir(parents=True)
    decoy = tmp_path / ".other.zarr.creating-1"  # another store's: not ours to remove
    decoy.mkdir()
    res = cli("capture", str(ckpt), "--data", SPEC, "--out", str(out), "--no-progress")
    assert res.exit_code == 0, res.output
    assert not stale.exists() and decoy.exists()


def _old_group(path: Path, name: str, pid: int) -> Path:
    """Move results/NAME aside as a probe run does between its two renames."""
    final = path / "results" / name
    old = final.with_name(f".old-{name}-{pid}")
    final.rename(old)
    return old


@pytest.mark.parametrize("case", ["final_there", "partial_finished", "nothing_else"])
def test_results_left_between_two_renames_are_recovered_and_never_listed(clean, tmp_path, case):
    import shutil

    from deltalab.probes.base import run_module
    from deltalab.probes.results import ResultSink

    out = copy(clean, tmp_path / "s.zarr")
    assert run_module("betas", ["--store", str(out)]) == 0
    records = store.open_results(out, "betas").attrs["records"]
    pid = dead_pid()
    if case == "final_there":  # died after both renames, before removing the old group
        shutil.copytree(out / "results" / "betas", out / "results" / f".old-betas-{pid}")
    else:
        old = _old_group(out, "betas", pid)
        if case == "partial_finished":  # the new run's finished group is still staged
            shutil.copytree(old, out / "results" / ".partial-betas")
    assert store.list_results(out) == ([] if case != "final_there" else ["betas"])
    assert all(not n.startswith(".") and "/." not in n for n in store.result_attrs(out))
    ResultSink(out, "spectra", staged=True)  # the next probe run (of any probe) puts it right
    assert sorted(p.name for p in (out / "results").iterdir() if p.is_dir()) == ["betas"]
    assert store.open_results(out, "betas").attrs["records"] == records
    live = out / "results" / f".old-betas-{os.getpid()}"  # a run still between its renames: left alone
    shutil.copytree(out / "results" / "betas", live)
    ResultSink(out, "spectra", staged=True)
    assert live.exists() and store.list_results(out) == ["betas"]
