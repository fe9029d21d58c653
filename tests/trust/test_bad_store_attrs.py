"""Store attributes and array metadata of the wrong type or range: one line naming the attribute, exit 2, in
`store info` and the probes, and one message (no traceback box) in the dashboard; the store's files untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.probes.synthetic import write_synthetic_store

pytest.importorskip("streamlit")
from tests.app.test_pages import new_app  # noqa: E402


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("attrs") / "s.zarr", n_seq=2, length=16, n_layers=1,
                                 n_heads=4, batch_size=2, seed=4)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _plant(store: Path, edit) -> None:
    meta = json.loads((store / "zarr.json").read_text())
    edit(meta["attributes"])
    (store / "zarr.json").write_text(json.dumps(meta))


BAD_ATTRS = [
    ("batch_size", 10**30, "'batch_size' is 1000000000000000000000000000000 (int): it must be an integer 1..1048576"),
    ("batch_size", "2", "'batch_size' is '2' (str)"),
    ("chunk_size", 0, "'chunk_size' is 0"),
    ("sizes", None, "'sizes' is None (NoneType): it must be an object of dim sizes"),
    ("sizes", {"pos": "16"}, "'sizes' is {'pos': '16'}"),
    ("segments", [{"data_spec": "x", "start": 0, "count": 10**20}], "'segments' is"),
    ("segments", "all", "'segments' is 'all' (str)"),
    ("variables", ["q", "../../outside"], "'variables' is ['q', '../../outside']"),
    ("dtype", "int8", "'dtype' is 'int8' (str): it must be float16 or float32"),
    ("layers", ["0"], "'layers' is ['0']"),
    ("heads", [0, -1], "'heads' is [0, -1]"),
    ("model_config", {"model_type": "delta_net", "vocab_size": 10**12}, "'model_config' is {'model_type'"),
    ("model_config", "gdp", "'model_config' is 'gdp' (str)"),
]


@pytest.mark.parametrize("key, value, fragment", BAD_ATTRS)
def test_bad_attribute_is_one_line_in_store_info_and_probes(pristine, tmp_path, key, value, fragment):
    store = Path(shutil.copytree(pristine, tmp_path / "s.zarr"))
    _plant(store, lambda a: a.__setitem__(key, value))
    before = _tree(store)
    for args in (["store", "info", str(store)], ["probe", "erank", "--store", str(store)]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (args, res.stderr)
        assert "recapture it" in lines[0]
    assert _tree(store) == before  # nothing written, nothing lost


def test_a_wrong_array_dtype_is_one_line(pristine, tmp_path):
    store = Path(shutil.copytree(pristine, tmp_path / "s.zarr"))
    meta = json.loads((store / "beta" / "zarr.json").read_text())
    meta["data_type"] = "int64"
    (store / "beta" / "zarr.json").write_text(json.dumps(meta))
    res = CliRunner().invoke(app, ["store", "info", str(store)])
    assert res.exit_code == 2
    assert "variable 'beta' is stored as 'int64', the store's attributes say 'float32'" in res.stderr


@pytest.mark.parametrize("key, value", [("sizes", None), ("batch_size", "2"), ("segments", "all")])
def test_the_dashboard_shows_one_message_not_a_traceback(monkeypatch, pristine, tmp_path, key, value):
    store = Path(shutil.copytree(pristine, tmp_path / "s.zarr"))
    _plant(store, lambda a: a.__setitem__(key, value))
    at = new_app(monkeypatch, store)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert len(at.error) == 1 and f"attribute {key!r}" in at.error[0].value.replace("\\", "")
