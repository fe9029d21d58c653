"""Bad command lines get one line on stderr that names the problem and where help is, and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltalab.app.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["capture"], "deltalab capture: Missing argument 'checkpoint'"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["store", "info"], "deltalab store info: Missing argument 'STORE'"),
        (["capture", "x", "--batch-size", "many"], "Invalid value for '--batch-size'"),
        (["probe", "betas"], "deltalab probe betas: the following arguments are required: --store"),
        (["probe", "keys", "--store", "s.zarr", "--layers", "one"], "argument --layers: cannot read 'one'"),
    ],
)
def test_usage_errors_are_one_line(args, expected):
    res = run_cli(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and expected in lines[0] and "--help" in lines[0]
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_help_still_exits_zero():
    res = run_cli("capture", "--help")
    assert res.returncode == 0 and "--data" in res.stdout


def test_prune_is_top_level_and_probe_prune_is_gone():
    """`deltalab prune` is the study's command; `probe prune` is no command of `probe`."""
    new = run_cli("prune", "--bogus")
    assert new.returncode == 2
    assert new.stderr.strip().splitlines()[-1].startswith("error:")
    old = run_cli("probe", "prune", "--bogus")
    assert old.returncode == 2 and "deprecated" not in old.stderr
    lines = old.stderr.strip().splitlines()
    assert len(lines) == 1 and "No such command 'prune'" in lines[0], old.stderr
