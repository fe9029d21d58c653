"""deltalab installs under one name: a wheel of the repository holds the package `deltalab` and nothing else at the
top level, and a researcher's own `models/`, `train/` or `kernels/` folder does not hide deltalab's.

pyproject's package-dir maps the repository's top-level folders (app, kernels, models, ...) onto subpackages of
`deltalab`; these tests build the wheel a `pip install .` would install and read what it ships.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FOLDERS = ("app", "kernels", "models", "probes", "store", "tasks", "train")
"""The repository's package folders: each installs as `deltalab.<folder>`, none as a top-level name."""


def _source_copy(dest: Path) -> Path:
    """The tracked files of the checkout, copied to `dest` (the build writes build/ and *.egg-info beside them)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _build_wheel(src: Path, out: Path) -> Path:
    """`pip wheel src --no-deps`: in this environment when its setuptools can build the project (>= 77, pyproject's
    build requirement), else in pip's isolated build environment."""
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)]
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        major = 0
    if major >= 77:
        cmd.append("--no-build-isolation")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("deltalab-*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_ships_one_top_level_package(tmp_path):
    wheel = _build_wheel(_source_copy(tmp_path / "src"), tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        top_level = z.read(f"{info}/top_level.txt").decode().split()
        record = [row.split(",")[0] for row in z.read(f"{info}/RECORD").decode().splitlines() if row]
    assert top_level == ["deltalab"]
    assert {n.split("/")[0] for n in record} == {"deltalab", info}
    for folder in FOLDERS:  # each folder is inside the one name
        assert f"deltalab/{folder}/__init__.py" in record, folder
    assert "deltalab/models/zoo/s4-deltaproduct2/model.safetensors" in record  # the bundled checkpoints ship

    # installed into an empty target, it adds one package (and its metadata), and imports from there
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name for p in target.iterdir() if p.name != "bin"} == {"deltalab", info}
    code = "import json, deltalab.models, deltalab.store.schema; print(json.dumps(deltalab.models.__file__))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(target), "PATH": str(BIN)})
    assert done.returncode == 0, done.stderr
    assert Path(json.loads(done.stdout)).is_relative_to(target / "deltalab" / "models")


def test_deltalab_imports_beside_a_project_with_its_own_models(tmp_path):
    """A research repository with its own models/, train/ and kernels/ packages (run from its root, so they come
    first on sys.path) imports both its packages and deltalab's."""
    for folder in ("models", "train", "kernels"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text(f"WHOSE = 'the project {folder}'\n")
    code = ("import json, models, train, kernels, deltalab.models, deltalab.train, deltalab.kernels.constants as c\n"
            "print(json.dumps([models.WHOSE, train.WHOSE, kernels.WHOSE, deltalab.models.__file__,\n"
            "                  deltalab.train.__file__, c.CHUNK_SIZE, hasattr(deltalab.models, 'WHOSE')]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    mine_m, mine_t, mine_k, theirs_m, theirs_t, chunk, leaked = json.loads(done.stdout)
    assert (mine_m, mine_t, mine_k) == ("the project models", "the project train", "the project kernels")
    assert not Path(theirs_m).is_relative_to(tmp_path) and Path(theirs_m).parent.name == "models"
    assert not Path(theirs_t).is_relative_to(tmp_path)
    assert chunk == 64 and leaked is False


@pytest.mark.parametrize("argv", [
    pytest.param([str(BIN / "deltalab"), "--help"], id="deltalab"),
    pytest.param([sys.executable, "-m", "deltalab.probes.erank", "--help"], id="python -m deltalab.probes.erank",
                 marks=pytest.mark.slow),  # imports torch and dask: 5-15 s on a loaded machine
])
def test_commands_under_the_one_name_run(tmp_path, argv):
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower() and ("--store" in done.stdout or "capture" in done.stdout)
