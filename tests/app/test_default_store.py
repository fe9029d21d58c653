"""The default store's data spec follows the training length the checkpoint's run files record."""

from __future__ import annotations

import json

from deltalab.app.default_store import DEFAULT_TRAIN_LENGTH, data_spec, train_length


def test_train_length_reads_the_run_files_else_the_default(tmp_path):
    assert train_length(tmp_path) == DEFAULT_TRAIN_LENGTH
    (tmp_path / "train_config.json").write_text(json.dumps({"context_length": 256}))  # a `train lm` run
    assert train_length(tmp_path) == 256
    assert data_spec(tmp_path, samples=4) == "S4:length=512,samples=4,seed=20250"
    (tmp_path / "train_config.json").unlink()
    (tmp_path / "task.json").write_text(json.dumps({"name": "S4", "train_length": 32}))  # a task run
    assert train_length(tmp_path) == 32 and data_spec(tmp_path, samples=4).startswith("S4:length=128,")
