"""One reader for the files training leaves beside a checkpoint (task.json, train_config.json)."""

from __future__ import annotations

import json

import pytest

from deltalab.models.run_files import RunFileError, read_task_file, training_length


def test_training_length_from_task_file_and_lm_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gated_deltaproduct"}))
    assert training_length(tmp_path) is None
    (tmp_path / "task.json").write_text(json.dumps({"name": "S4", "train_length": 48}))
    assert training_length(tmp_path) == 48
    (tmp_path / "train_config.json").write_text(json.dumps({"context_length": 256}))
    assert training_length(tmp_path) == 256  # the run's own config comes before task.json


def test_training_length_skips_unreadable_and_nonpositive(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "train_config.json").write_text(json.dumps({"train_length": 0, "seq_len": True}))
    (tmp_path / "task.json").write_text(json.dumps({"train_length": 32}))
    assert training_length(tmp_path) == 32


def test_task_file_absent_empty_and_corrupt_is_one_line(tmp_path):
    assert read_task_file(tmp_path) == {}
    (tmp_path / "task.json").write_text("[1, 2]")
    with pytest.raises(RunFileError, match="task.json does not hold a JSON object"):
        read_task_file(tmp_path)
    (tmp_path / "task.json").write_text("{oops")
    with pytest.raises(RunFileError, match="not valid JSON: restore it or delete it"):
        read_task_file(tmp_path)


def test_clean_json_gives_plain_json_data():
    import math

    import numpy as np

    from deltalab.models.run_files import clean_json

    raw = {1: (np.float32(0.5), np.int64(3), np.bool_(True)), "x": [math.nan, -math.inf, np.arange(2)], "z": 1 + 2j}
    assert clean_json(raw) == {"1": [0.5, 3, True], "x": [None, None, [0, 1]], "z": [1.0, 2.0]}
    assert json.loads(json.dumps(clean_json(raw), allow_nan=False)) == clean_json(raw)
