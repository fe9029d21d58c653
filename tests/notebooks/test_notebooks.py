"""The notebooks in notebooks/: committed without outputs, and each one executes (nbclient) on data built here.

Stores and checkpoints come from tests/notebooks/stores.py and reach the notebooks via environment variables
(DELTALAB_STORE, DELTALAB_CHECKPOINT, DELTALAB_DEFAULT_CHECKPOINT, DELTALAB_CACHE). The kernel is a temporary
kernel spec that runs this interpreter, so the notebooks see the same environment as the tests. Each notebook
ends with a cell tagged `summary` that prints its conclusions as JSON; the tests check those against the data.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.notebooks import stores as ns

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
EXPECTED = ("01_s4_rotation_head.ipynb", "02_effective_rank_over_time.ipynb", "03_state_reduction.ipynb")
KERNEL = "deltalab-nbtest"
ENV_VARS = ("DELTALAB_STORE", "DELTALAB_CHECKPOINT", "DELTALAB_PRUNE_JSON", "DELTALAB_CACHE",
            "DELTALAB_DEFAULT_CHECKPOINT", "DELTALAB_DEFAULT_SAMPLES")



def test_notebooks_are_committed_without_outputs():
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert set(EXPECTED) <= set(found), f"missing notebooks: {set(EXPECTED) - set(found)}"
    for name in found:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.get("kernelspec", {}).get("name") == "python3", name
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [], f"{name}: cell {cell.get('id')} has outputs; clear them before committing"
                assert cell.execution_count is None, f"{name}: cell {cell.get('id')} has an execution count"
        tagged = [c for c in nb.cells if "summary" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{name}: needs exactly one cell tagged 'summary'"


@pytest.fixture(scope="session")
def jupyter_path(tmp_path_factory) -> str:
    """A kernel spec named KERNEL that runs this interpreter (the .venv's), in a temporary Jupyter data dir."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, display_name="deltalab tests", prefix=str(prefix))
    spec = json.loads((prefix / "share" / "jupyter" / "kernels" / KERNEL / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    return str(prefix / "share" / "jupyter")


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints (planted S4, random S4, tiny LM) and a bare capture of the random one (no probe results)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    from deltalab import store

    base = tmp_path_factory.mktemp("notebook_data")
    random_ckpt = ns.random_s4_checkpoint(base / "s4-random")
    random_store = base / "s4-random.zarr"
    store.capture(random_ckpt, f"S4:length={2 * ns.TRAIN_LENGTH},samples=8,seed=0", random_store, batch_size=8,
                  progress=False)
    return {"planted": ns.planted_s4_checkpoint(base / "s4-planted"), "random_store": random_store,
            "lm": ns.tiny_lm_checkpoint(base / "lm-tiny", context_length=64), "base": base}


def execute(name: str, env: dict[str, str], jupyter_path: str, monkeypatch, cache: Path) -> dict:
    """Run notebook `name` with only `env` among the DELTALAB_* variables; return its summary JSON."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JUPYTER_PATH", jupyter_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("DELTALAB_CACHE", str(cache))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # CellExecutionError (with the traceback) if any cell fails
    cell = next(c for c in nb.cells if "summary" in c.get("metadata", {}).get("tags", []))
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    return json.loads(text)


@pytest.mark.slow
def test_s4_rotation_head_recovers_the_cube_on_the_default_store(data, jupyter_path, monkeypatch):
    cache = data["base"] / "cache-planted"
    summary = execute("01_s4_rotation_head.ipynb",
                      {"DELTALAB_DEFAULT_CHECKPOINT": str(data["planted"]), "DELTALAB_DEFAULT_SAMPLES": "16"},
                      jupyter_path, monkeypatch, cache)
    assert Path(summary["store"]).parent == cache  # built through ensure_default_store, probes cached
    assert summary["task"] == "S4"
    assert summary["reflection_head"] == [0, 0]  # the planted head, not the beta ~ 1 one
    assert min(summary["beta_mean"]) > 1.99
    assert summary["keys_explained_variance_3"] > 0.999
    assert summary["frac_rotation"] == 1.0
    assert summary["n_elements"] == 24
    assert summary["mean_abs_angle_error_deg"] < 0.1
    assert summary["frac_within_5deg"] == 1.0
    assert summary["verdict"].startswith("match")


@pytest.mark.slow
def test_s4_rotation_head_says_so_without_a_reflection_head(data, jupyter_path, monkeypatch):
    summary = execute("01_s4_rotation_head.ipynb", {"DELTALAB_STORE": str(data["random_store"])},
                      jupyter_path, monkeypatch, data["base"] / "cache-random")
    assert summary["reflection_head"] is None
    assert summary["head_shown"] is not None
    assert summary["verdict"].startswith("no reflection head")
    assert summary["frac_within_5deg"] < 0.5  # a random head does not turn like the cube


@pytest.mark.slow
def test_effective_rank_marks_document_boundaries_of_a_text_capture(data, jupyter_path, monkeypatch):
    from deltalab import store

    summary = execute("02_effective_rank_over_time.ipynb", {"DELTALAB_CHECKPOINT": str(data["lm"])},
                      jupyter_path, monkeypatch, data["base"] / "cache-lm")
    assert summary["source"] == "lm"
    assert summary["train_length"] == 64 and summary["sequence_length"] == 128
    ds = store.open(summary["store"])
    assert ds.attrs["data_meta"]["kind"] == "text"
    starts = np.asarray(ds["doc_start"].values)
    assert summary["n_doc_starts"] == int(starts[:, 1:].sum()) > 0
    assert summary["boundary"]["n_aligned"] >= 1
    for key in ("erank_within_train", "erank_beyond_train", "stable_rank_within_train", "stable_rank_beyond_train"):
        assert 1.0 <= summary[key] <= 16.0  # between rank 1 and min(dk, dv)
    assert any("document start" in n for n in summary["notes"])
    assert any("Beyond the training length (64)" in n for n in summary["notes"])


@pytest.mark.slow
def test_effective_rank_falls_back_to_a_state_tracking_store(data, jupyter_path, monkeypatch):
    summary = execute("02_effective_rank_over_time.ipynb", {"DELTALAB_STORE": str(data["random_store"])},
                      jupyter_path, monkeypatch, data["base"] / "cache-random")
    assert summary["source"] == "state-tracking" and summary["checkpoint"] is None
    assert summary["n_doc_starts"] == 0 and summary["boundary"] == {}
    assert summary["train_length"] == ns.TRAIN_LENGTH and summary["sequence_length"] == 2 * ns.TRAIN_LENGTH
    assert "No document boundaries inside sequences in this capture." in summary["notes"]


@pytest.mark.slow
def test_state_reduction_runs_a_quick_study_and_reports_it(data, jupyter_path, monkeypatch):
    cache = data["base"] / "cache-lm"
    summary = execute("03_state_reduction.ipynb", {"DELTALAB_CHECKPOINT": str(data["lm"])},
                      jupyter_path, monkeypatch, cache)
    results = Path(summary["results"])
    assert results.parent == cache / "notebooks"
    records = json.loads(results.read_text())["records"]
    base = next(r for r in records if r["method"] == "baseline")
    assert summary["baseline_perplexity"] == pytest.approx(base["perplexity"])
    assert summary["rank_utilisation_before"] == pytest.approx(base["rank_utilisation"])
    assert sorted(summary["methods"]) == sorted(["l1", "random", "wanda", "grad", "drrqr", "pca"])
    assert summary["compressions"] == [0.25, 0.5, 0.75]
    for c, best in summary["best_by_compression"].items():
        at = [r for r in records if r["method"] != "baseline" and r["compression"] == float(c)]
        assert best["perplexity"] == pytest.approx(min(r["perplexity"] for r in at))
        assert summary["rank_utilisation_after"][c] == {r["method"]: pytest.approx(r["rank_utilisation"]) for r in at}


@pytest.mark.slow
def test_state_reduction_reads_a_results_file(data, jupyter_path, monkeypatch, tmp_path):
    """A prune.json given directly is shown as it is (no study is run)."""
    records = [{"model": "m", "model_type": "gated_deltaproduct", "num_householder": 2, "head_dim": 8,
                "head_v_dim": 8, "method": method, "compression": c, "head_dim_kept": int(8 * (1 - c)),
                "perplexity": ppl, "eval_tokens": 100, "accuracy": None, "rank_utilisation": u, "stable_rank": 8 * u,
                "rank_utilisation_per_layer": [u]}
               for method, c, ppl, u in (("baseline", 0.0, 10.0, 0.25), ("l1", 0.5, 12.0, 0.4),
                                         ("drrqr", 0.5, 11.0, 0.45))]
    path = tmp_path / "prune.json"
    path.write_text(json.dumps({"command": "deltalab prune m", "data": {"kind": "lm", "eval_windows": 128},
                                "records": records}))
    summary = execute("03_state_reduction.ipynb", {"DELTALAB_PRUNE_JSON": str(path)}, jupyter_path, monkeypatch,
                      tmp_path / "cache")
    assert summary["results"] == str(path)
    assert summary["best_by_compression"] == {"0.5": {"method": "drrqr", "perplexity": 11.0}}
    assert any("Rank utilisation rises" in n for n in summary["notes"])
    assert not (tmp_path / "cache" / "notebooks").exists()
