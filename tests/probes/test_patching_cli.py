"""`deltalab patch`: results written to FILE.nc and into a store with provenance; bad input is one line, exit 2,
nothing written."""

from __future__ import annotations

import json

import pytest
import xarray as xr
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.models import save_checkpoint
from tests.probes.patching_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("patch_cli")
    a, b = base / "a", base / "b"
    save_checkpoint(tiny_model("deltaproduct2"), a)
    save_checkpoint(tiny_model("kda"), b)
    return a, b


@pytest.fixture(scope="module")
def store(checkpoints, tmp_path_factory):
    from deltalab import store as store_lib

    out = tmp_path_factory.mktemp("patch_store") / "s.zarr"
    store_lib.capture(checkpoints[0], "parity:length=12,samples=3,seed=0", out, batch_size=3, progress=False)
    return out


def _patch(*args: str):
    return CliRunner().invoke(app, ["patch", *map(str, args)])


IDS = ("--ids", "--clean", "1 2 3 4 5 6", "--corrupted", "1 2 7 4 5 6")


def test_writes_a_netcdf_that_reads_back(checkpoints, tmp_path):
    out = tmp_path / "r.nc"
    res = _patch(checkpoints[0], *IDS, "--metric", "logit-diff:3,4", "--hooks", "resid_pre,o", "--out", out)
    assert res.exit_code == 0, res.output
    assert "    1.0000  hook resid_pre, layer 0, head -1, position 2" in res.output.splitlines()  # the corrupted token
    ds = xr.open_dataset(out)
    assert ds.patched.dims == ("hook", "layer", "head", "position")
    assert abs(float(ds.patched.sel(hook="resid_pre", layer=0, head=-1, position=2)) - 1.0) < 1e-5  # batch rounding
    assert json.loads(ds.attrs["metric_positions"]) == [5]


def test_state_and_attribution_json(checkpoints):
    res = _patch(checkpoints[1], *IDS, "--metric", "kl", "--experiment", "state", "--heads", "1", "--json",
                 "--parts", "full,rank:1")
    assert res.exit_code == 0, res.output
    cells = json.loads(res.output)["cells"]
    assert {c["head"] for c in cells} == {1} and {c["part"] for c in cells} == {"full", "rank:1"}
    assert len(cells) == 2 * 2 * 6  # parts x layers x tokens
    res = _patch(checkpoints[1], *IDS, "--metric", "logprob:3", "--experiment", "attribution", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["attrs"]["experiment"] == "attribution patching"


def test_store_sequences_in_and_result_with_provenance_out(checkpoints, store):
    from deltalab.probes.results import read_results

    res = _patch(checkpoints[0], "--store", store, "--clean-seq", 0, "--corrupted-seq", 1, "--metric", "loss",
                 "--hooks", "resid_mid", "--all-positions")
    assert res.exit_code == 0, res.output
    ds = read_results(store, "patching-activation")
    assert ds.attrs["command_line"][:2] == ["deltalab", "patch"] and ds.attrs["metric"] == "loss"
    assert ds.patched.sizes["position"] == 1


@pytest.mark.parametrize("args, message", [
    (("--ids", "--clean", "1 2 3", "--corrupted", "1 2", "--metric", "kl"), "differ in length"),
    ((*IDS, "--metric", f"logit-diff:1,{VOCAB + 3}"), "outside the model's vocabulary"),
    ((*IDS, "--metric", "kl", "--positions", "9"), "position 9 is out of range"),
    ((*IDS, "--metric", "logprob:1", "--metric-positions", "6"), "metric position 6 is out of range"),
    ((*IDS, "--metric", "kl", "--experiment", "state", "--heads", "4"), "head 4 is out of range"),
    ((*IDS, "--metric", "kl", "--layers", "5"), "layer 5 is out of range"),
    ((*IDS, "--metric", "kl", "--hooks", "mlp"), "unknown hook"),
    ((*IDS, "--metric", "acc"), "unknown metric"),
    (("--ids", "--clean", "1 2 x", "--corrupted", "1 2 3", "--metric", "kl"), "write integers"),
    (("--ids", "--clean", f"1 2 {VOCAB}", "--corrupted", "1 2 3", "--metric", "kl"), "outside the vocabulary"),
    ((*IDS, "--metric", "kl", "--experiment", "path"), "--experiment 'path'"),
    ((*IDS, "--metric", "kl", "--experiment", "state", "--parts", "rank:0"), "--parts 'rank:0'"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(checkpoints, tmp_path, args, message):
    out = tmp_path / "r.nc"
    res = _patch(checkpoints[0], *args, "--out", out)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output
    assert list(tmp_path.iterdir()) == []


def test_a_store_of_another_checkpoint_is_refused(checkpoints, store):
    from deltalab.probes.results import list_results

    before = list_results(store)
    res = _patch(checkpoints[1], "--store", store, "--clean-seq", 0, "--corrupted-seq", 1, "--metric", "kl")
    assert res.exit_code == 2 and "another checkpoint" in res.output and len(res.output.strip().splitlines()) == 1
    res = _patch(checkpoints[0], "--store", store, "--clean-seq", 0, "--corrupted-seq", 7, "--metric", "kl")
    assert res.exit_code == 2 and "--corrupted-seq 7 is out of range" in res.output
    assert list_results(store) == before


@pytest.mark.slow  # three patching runs into a captured store, then the dashboard under AppTest
def test_the_patching_page_draws_what_the_store_holds(checkpoints, store, monkeypatch):
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from tests.app.test_pages import DASHBOARD, arr, specs

    for extra in (("--experiment", "activation", "--hooks", "resid_pre,o"), ("--experiment", "attribution",
                  "--hooks", "resid_pre,o"), ("--experiment", "state")):
        res = _patch(checkpoints[0], "--store", store, "--clean-seq", 0, "--corrupted-seq", 2, "--metric", "kl",
                     *extra)
        assert res.exit_code == 0, res.output
    monkeypatch.setenv("DELTALAB_STORE", str(store))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    at = AppTest.from_file(DASHBOARD, default_timeout=120).run()
    at.sidebar.radio(key="page").set_value("Patching").run()
    assert not at.exception
    titles = [s["layout"]["title"]["text"] for s in specs(at)]
    assert titles[0].startswith("resid_pre: position x layer") and titles[-1].startswith("layer 0: state")
    at.selectbox(key="patch_hook").set_value("o").run()
    figs = specs(at)
    assert [f["layout"]["title"]["text"] for f in figs][:2] == ["o patched at position 11",
                                                                "o: attribution estimate"]
    assert arr(figs[0]["data"][0]["z"]).size == 2 * 2  # layer x head
