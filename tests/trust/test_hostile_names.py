"""Hostile `--name`s for a probe run: refused in one line before any file is created, renamed or deleted; decoy
folders around the store (its parent, the parent's parent, an absolute path) survive untouched."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.probes.results import ResultSink
from deltalab.probes.synthetic import write_synthetic_store
from deltalab.store.reader import check_results_name


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("names") / "s.zarr", n_seq=2, length=16, batch_size=2, seed=3)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


def _decoys(store: Path, absolute: Path) -> list[Path]:
    """Folders a staged run's `.partial-x` (and the final `x`) reach through '..' or an absolute path."""
    decoys = []
    for folder in (store.parent / "x", store.parent / ".partial-x", store.parent.parent / ".partial-x",
                   store / ".partial-x", absolute / "x", absolute / ".partial-x"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "keep.txt").write_text(f"decoy {folder}")
        decoys.append(folder)
    return decoys


@pytest.mark.parametrize("hostile", ["../../x", "../x", "{abs}/x", "erank/../../x", "..", ".partial-x", "a b",
                                     "x\n", "/", "erank//x", "-x"])
def test_hostile_name_is_one_line_and_touches_nothing(pristine, tmp_path, hostile):
    base = tmp_path / "work"
    base.mkdir()
    store = base / "w" / "s.zarr"
    shutil.copytree(pristine, store)
    decoys = _decoys(store, tmp_path / "abs")
    before_all = _tree(tmp_path)
    name = hostile.format(abs=tmp_path / "abs")
    res = CliRunner().invoke(app, ["probe", "erank", "--store", str(store), f"--name={name}"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --name") and "e.g. --name" in lines[0], res.stderr
    assert all(d.is_dir() and (d / "keep.txt").is_file() for d in decoys)
    assert _tree(tmp_path) == before_all  # nothing created, renamed or deleted anywhere


@pytest.mark.parametrize("hostile", ["../../x", "/tmp/x", "results/../x", ""])
def test_the_sink_refuses_before_any_filesystem_step(tmp_path, hostile):
    with pytest.raises(ValueError, match="not a results name"):
        ResultSink(tmp_path / "s.zarr", hostile, staged=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("good", ["erank", "erank-run2", "keys/kappa", "a.b_c-1"])
def test_ordinary_names_pass(good):
    assert check_results_name(good) == good
