"""The shared run loop: every way of stopping early saves, and resuming gives the uninterrupted run, for both
trainers; the folder checks and the time limit are one-line errors."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.train.lm import LMTrainConfig, LMTrainError, train_lm
from deltalab.train.run import LOG_FILE, STATE_FILE, TrainError
from deltalab.train.state_tracking import TrainConfig, train

STEPS = 6


def task_run(out, **kwargs):
    cfg = TrainConfig(task="S3", steps=STEPS, warmup_steps=2, heads=2, head_dim=8, batch_size=8, train_length=16,
                      log_every=2, eval_every=2, eval_samples=4, save_every=0)
    return train(cfg, out, device="cpu", progress=False, **kwargs)


def lm_run(corpus_root):
    cfg = LMTrainConfig(layers=1, hidden_size=16, heads=2, head_dim=8, context_length=16, batch_size=2,
                        steps=STEPS, warmup_steps=1, eval_windows=4, eval_every=2, save_every=0, log_every=2,
                        corpus_root=str(corpus_root), eval_fraction=0.3)
    return lambda out, **kwargs: train_lm(cfg, out, device="cpu", progress=False, **kwargs)


def _entries(folder) -> list[dict]:
    """Log entries without their wall-clock field."""
    lines = (folder / LOG_FILE).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


def _same_entries(a: list[dict], b: list[dict]) -> None:
    assert [(e["step"], e["split"]) for e in a] == [(e["step"], e["split"]) for e in b]
    for ea, eb in zip(a, b, strict=True):
        assert ea.keys() == eb.keys()
        for key, value in ea.items():
            if isinstance(value, float):
                assert eb[key] == pytest.approx(value, rel=0, abs=1e-6), key
            else:
                assert eb[key] == value, key


def _stopper(way: str):
    """`train` keyword arguments that end a call at step 2 (step 3 for stop_after, mid log window)."""
    if way == "stop_after":
        return {"stop_after": 3}

    def on_log(entry: dict) -> None:
        if entry["split"] == "train" and entry["step"] == 2:
            if way == "signal":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                time.sleep(0.6)

    return {"on_log": on_log, **({"time_limit_s": 0.3} if way == "time_limit" else {})}


@pytest.mark.parametrize("way", ["stop_after", "time_limit", "signal"])
@pytest.mark.parametrize("kind", ["task", "lm"])
def test_a_stopped_run_saves_and_resumes_to_the_uninterrupted_run(tmp_path, corpus_root, kind, way):
    run = task_run if kind == "task" else lm_run(corpus_root)
    full, parts = tmp_path / "full", tmp_path / "parts"
    run(full)
    first = run(parts, **_stopper(way))
    stopped_at = 3 if way == "stop_after" else 2
    assert (first.step, first.finished) == (stopped_at, False)
    assert torch.load(parts / STATE_FILE, weights_only=True)["step"] == stopped_at
    assert (parts / "model.safetensors").is_file()
    again = run(parts, resume=True)
    assert (again.step, again.finished) == (STEPS, True)
    _same_entries(_entries(full), _entries(parts))
    wa, wb = load_file(full / "model.safetensors"), load_file(parts / "model.safetensors")
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-6)
    assert sorted(p.name for p in full.iterdir()) == sorted(p.name for p in parts.iterdir())


def test_lm_final_evaluation_is_logged_once_and_saved(tmp_path, corpus_root):
    result = lm_run(corpus_root)(tmp_path)
    evals = [e for e in _entries(tmp_path) if e["split"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4, STEPS]  # quick checks at 2 and 4, the full one at the end
    final = json.loads((tmp_path / "eval.json").read_text())
    assert final == result.eval and evals[-1] == {"step": STEPS, "split": "eval", **final}


@pytest.mark.parametrize("error,run", [(TrainError, task_run), (LMTrainError, None)])
def test_folder_and_time_limit_checks_are_one_line_errors(tmp_path, corpus_root, error, run):
    run = run or lm_run(corpus_root)
    with pytest.raises(error, match="drop --resume"):
        run(tmp_path / "new", resume=True)
    with pytest.raises(error, match="--time-limit must be > 0"):
        run(tmp_path / "new", time_limit_s=0)
    assert not (tmp_path / "new").exists()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / STATE_FILE).write_bytes(b"not a torch file")
    with pytest.raises(error, match="cannot be read safely"):
        run(tmp_path / "bad", resume=True)
    with pytest.raises(error, match="pass --resume"):
        run(tmp_path / "bad")


@pytest.mark.parametrize("command", [["train", "S3"], ["train", "lm"]])
def test_cli_time_limit_must_be_positive(tmp_path, command):
    r = CliRunner().invoke(app, [*command, "--out", str(tmp_path / "run"), "--time-limit", "0", "--no-progress"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--time-limit" in lines[0]
