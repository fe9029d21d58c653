"""notebooks/04_exact_attention.ipynb executes on the bundled S4 model and rebuilds its outputs from the exact map."""

from __future__ import annotations

import pytest

pytest.importorskip("nbclient")

from tests.notebooks.test_notebooks import execute, jupyter_path  # noqa: E402, F401 - the kernel-spec fixture


@pytest.mark.slow
def test_exact_attention_notebook_on_the_bundled_s4_model(jupyter_path, monkeypatch, tmp_path):  # noqa: F811
    summary = execute("04_exact_attention.ipynb", {}, jupyter_path, monkeypatch, tmp_path / "cache")
    assert (summary["checkpoint"], summary["task"]) == ("s4-deltaproduct2", "S4")
    assert (summary["layer"], summary["head"]) == (0, 0)
    assert summary["causal"] is True
    assert summary["reconstruction_error"] < 1e-5  # float64 map vs the model's float32 read-out
    assert summary["reconstruction_error_gla"] > 0.5  # the heuristic does not rebuild this reflection head
    assert summary["weight_error_mean"] > 0.5 and summary["weight_error_max"] >= summary["weight_error_mean"]
