"""kill -9 at random points of capture, verify and repair (a resume over injected damage): after the last resume
the store verifies clean and equals an uninterrupted capture file for file, with nothing left beside it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltalab import store
from deltalab.models import DeltaProductForCausalLM, save_checkpoint
from deltalab.store.verify import verify
from tests.store.test_capture import tiny_config, tree_bytes

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
N_SEQ = 16
SPEC = f"S4:length=40,samples={N_SEQ},seed=5"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltalab.app.cli", *args]


def _wait_for_batches(out: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until `n` more batches' `complete` flag chunks exist than now (or the process ends)."""
    folder = out / "complete" / "c"

    def count() -> int:
        return len(list(folder.iterdir())) if folder.is_dir() else 0

    goal, deadline = count() + n, time.time() + timeout
    while count() < goal and proc.poll() is None:
        assert time.time() < deadline, "the capture wrote nothing"
        time.sleep(0.002)


def _damage(out: Path, rng: random.Random) -> str:
    """Delete, truncate or flip bytes in one random chunk file of a captured array; returns what was done."""
    files = sorted(p for var in store.read_attrs(out)["variables"] for p in (out / var / "c").rglob("*")
                   if p.is_file()) if (out / "zarr.json").exists() else []
    if not files:
        return "none (no chunk yet)"
    file = rng.choice(files)
    how = rng.choice(["delete", "truncate", "flip"])
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        os.truncate(file, rng.randrange(file.stat().st_size))
    else:
        data = bytearray(file.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(data))
    return f"{how} {file.relative_to(out)}"


def _holds(lock: Path, pid: int) -> bool:
    try:
        return lock.read_text().strip() == str(pid)
    except OSError:
        return False


def _wait_for_lock(lock: Path, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Wait until `proc` holds the store's lock (its pid in the lock file: a killed holder's file stays behind)
    (True) or ends (False)."""
    deadline = time.time() + timeout
    while not _holds(lock, proc.pid):
        if proc.poll() is not None:
            return False
        assert time.time() < deadline, "the process never took the lock"
        time.sleep(0.002)
    return True


@pytest.mark.slow
@pytest.mark.timeout(1800)  # twelve fresh processes (torch, nnsight): minutes on a busy machine
def test_kill_9_at_random_points_then_resume_verifies_clean(tmp_path):
    seed = int(os.environ.get("DELTALAB_KILL_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    torch.manual_seed(0)
    ckpt = save_checkpoint(DeltaProductForCausalLM(tiny_config()), tmp_path / "ckpt")
    clean = tmp_path / "clean" / "s.zarr"
    store.capture(ckpt, SPEC, clean, batch_size=1, progress=False)
    (tmp_path / "killed").mkdir()
    out = tmp_path / "killed" / "s.zarr"
    capture = _cli("capture", str(ckpt), "--data", SPEC, "--out", str(out), "--batch-size", "1", "--no-progress")
    lock = out.parent / f".{out.name}.lock"

    kinds = ["capture"] * 5 + ["repair"] * 3 + ["verify"] * 2
    rng.shuffle(kinds)
    kinds = ["capture", *kinds]  # the first kill lands in a capture that creates the store
    points = []
    for kind in kinds:
        what = _damage(out, rng) if kind == "repair" else ""
        before = tree_bytes(out) if kind == "verify" and out.exists() else None
        cmd = _cli("store", "verify", str(out), "--no-progress") if kind == "verify" else capture
        proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if kind == "verify":
            at = f"{rng.uniform(0.3, 1.5):.2f} s after start"  # in its start-up or in the check itself
            time.sleep(float(at.split()[0]))
        elif kind == "repair":  # while it verifies, repairs or recaptures
            _wait_for_lock(lock, proc)
            at = f"{rng.uniform(0, 1.0):.2f} s after the lock"
            time.sleep(float(at.split()[0]))
        else:  # inside the batch loop: after a random number of batches, a random moment into the next one
            _wait_for_lock(lock, proc)
            batches = rng.randrange(3)
            _wait_for_batches(out, batches, proc)
            jitter = rng.uniform(0, 0.05)
            time.sleep(jitter)
            at = f"{batches} batch(es) + {jitter * 1000:.0f} ms after the lock"
        finished = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        n = store.info(out)["complete"] if (out / "zarr.json").exists() else 0
        points.append((kind, what, at, finished, n))
        if before is not None:
            assert tree_bytes(out) == before, "verify changed the store"
    table = "\n".join(f"  {k:<8} kill {d}{' (had finished)' if f else ''}: {n}/{N_SEQ} complete after; {w}"
                      for k, w, d, f, n in points)
    print(f"\nkill points (seed {seed}):\n{table}")
    assert sum(not f for _, _, _, f, _ in points) >= 10, f"fewer than 10 kills landed mid-run (seed {seed}):\n{table}"

    done = subprocess.run(capture, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert f"{N_SEQ}/{N_SEQ} complete" in done.stdout, done.stdout
    report = verify(out)
    assert report.clean, (seed, report.damage)
    assert tree_bytes(out) == tree_bytes(clean), f"seed {seed}\n{table}"
    assert sorted(p.name for p in out.parent.iterdir()) == ["s.zarr"], f"leftovers beside the store (seed {seed})"
    assert not list(out.rglob("*.partial"))
