"""Bad flags and files at the command line: one `error:` line, exit 2, nothing created or lost (--device tpu,
--out naming a file, a data file too large or not a regular file, a full disk during a probe) and
--allow-nonfinite recorded in the store."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.probes.synthetic import write_synthetic_store

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fla" / "gdp_nh2_all"


def one_line(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("flags") / "s.zarr", n_seq=2, length=16, n_layers=1,
                                 n_heads=4, batch_size=2, seed=6)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "", "cpu;rm"])
def test_device_not_known_is_one_line_in_probe_and_capture(pristine, tmp_path, device):
    line = one_line("probe", "erank", "--store", str(pristine), "--device", device)
    assert "is not a device deltalab runs on" in line and "cpu, cuda" in line
    out = tmp_path / "c.zarr"
    line = one_line("capture", str(FIXTURE), "--data", "S4:length=8,samples=2,seed=0", "--out", str(out),
                    "--device", device)
    assert "is not a device deltalab runs on" in line and not out.exists()


def test_out_naming_an_existing_file_is_refused_and_kept(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    line = one_line("capture", str(FIXTURE), "--data", "S4:length=8,samples=2,seed=0", "--out", str(out))
    assert "is a file, not a store folder" in line and out.read_text() == "keep me"


def test_a_data_file_too_large_is_refused_before_reading(tmp_path, monkeypatch):
    import deltalab.store.text_docs as text_docs

    monkeypatch.setattr(text_docs, "FILE_LIMIT", 1000)
    monkeypatch.setattr(text_docs.check_data_file, "__defaults__", (1000,))
    big = tmp_path / "one-line.csv"
    with open(big, "wb") as f:  # sparse: the size of a big file, on no disk
        f.truncate(5000)
    out = tmp_path / "c.zarr"
    line = one_line("capture", str(FIXTURE), "--data", f"csv:{big}", "--out", str(out))
    assert "more than the" in line and "split it" in line and not out.exists()
    text = tmp_path / "huge.txt"
    with open(text, "wb") as f:
        f.truncate(5000)
    line = one_line("capture", str(FIXTURE), "--data", f"text:{text}", "--out", str(out))
    assert "more than the" in line and not out.exists()


def test_a_fifo_as_data_file_is_refused_without_hanging(tmp_path):
    for spec, want in (("pipe.txt", "no text files at"), ("pipe.csv", "is not a regular file")):
        fifo = tmp_path / spec
        os.mkfifo(fifo)
        kind = "text" if spec.endswith(".txt") else "csv"
        line = one_line("capture", str(FIXTURE), "--data", f"{kind}:{fifo}", "--out", str(tmp_path / "c.zarr"))
        assert want in line, line  # refused in one line, never opened (opening a FIFO would block)


def test_disk_full_during_a_probe_names_the_fix_and_keeps_results(pristine, tmp_path, monkeypatch):
    store = Path(shutil.copytree(pristine, tmp_path / "s.zarr"))
    assert CliRunner().invoke(app, ["probe", "erank", "--store", str(store)]).exit_code == 0
    before = _tree(store)
    from deltalab.probes import results

    def full(self, ds):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.ResultSink, "write", full)
    monkeypatch.setattr(results.ResultSink, "finish", lambda self, result: full(self, None))
    line = one_line("probe", "erank", "--store", str(store))
    assert "is full" in line and "free space" in line and "--no-write" in line
    assert _tree(store) == before  # the earlier results are intact


def test_allow_nonfinite_captures_and_records_the_tensors(tmp_path):
    ckpt = Path(shutil.copytree(FIXTURE, tmp_path / "ckpt"))
    state = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    state[name][0, 0] = float("nan")
    save_file(state, str(ckpt / "model.safetensors"))
    out = tmp_path / "c.zarr"
    args = ["capture", str(ckpt), "--data", "S4:length=8,samples=2,seed=0", "--out", str(out), "--no-progress"]
    line = one_line(*args)
    assert "NaN/Inf" in line and "--allow-nonfinite" in line and not out.exists()
    res = CliRunner().invoke(app, [*args, "--allow-nonfinite"])
    assert res.exit_code == 0, res.output
    attrs = json.loads((out / "zarr.json").read_text())["attributes"]
    assert attrs["nonfinite_tensors"] == [name]
    assert torch.isnan(load_file(str(ckpt / "model.safetensors"))[name]).any()  # the checkpoint is untouched


def test_probe_table_shows_stored_strings_inert(capsys, monkeypatch):
    """A record's strings (labels, features: from the store) print as text: no escape sequence, no rich markup."""
    import xarray as xr

    from deltalab.probes.base import print_summary
    from deltalab.probes.core import ProbeResult

    monkeypatch.setenv("COLUMNS", "400")  # one table row per line
    rec = {"layer": 0, "label": "\x1b]0;owned\x07[bold red]loud[/]", "value": 1.5}
    print_summary(ProbeResult("linear", xr.Dataset(), [rec]), written="/tmp/s.zarr/results/\x1b[2Jx")
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07[bold red]loud[/]" in out  # shown as written, markup included
    assert "results/\\x1b[2Jx" in out


def test_app_root_must_be_a_folder(pristine, tmp_path):
    line = one_line("app", str(pristine), "--root", str(tmp_path / "missing"))
    assert "--root" in line and "is not a folder" in line
