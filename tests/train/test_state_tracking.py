"""Training: exact resume, run-folder contents, evaluation metrics and the `train` / `eval` commands."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.models import load_checkpoint
from deltalab.tasks.state_tracking import IGNORE_INDEX, get_task
from deltalab.train.evaluate import accuracy, evaluate, perplexity, position_curves
from deltalab.train.run import LOG_FILE, STATE_FILE, TrainError, lr_lambda
from deltalab.train.state_tracking import TrainConfig, model_config, train

TINY = dict(heads=2, head_dim=8, batch_size=8, train_length=16, log_every=1, eval_every=0, save_every=0)


def _losses(folder) -> list[float]:
    lines = (folder / LOG_FILE).read_text().splitlines()
    return [e["loss"] for e in map(json.loads, lines) if e["split"] == "train"]


def _entries(folder) -> list[dict]:
    """Log entries without their wall-clock field."""
    lines = (folder / LOG_FILE).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


@pytest.mark.parametrize("train_samples", [None, 24])
def test_interrupted_then_resumed_run_continues_the_same_curve(tmp_path, train_samples):
    """Stop after 3 of 6 steps (mid log window, between validations), resume: same log, same weights."""
    cfg = TrainConfig(task="S3", steps=6, train_samples=train_samples, warmup_steps=2,
                      **{**TINY, "log_every": 2, "eval_every": 2, "eval_samples": 4})
    full, parts = tmp_path / "full", tmp_path / "parts"
    train(cfg, full, device="cpu", progress=False)
    first = train(cfg, parts, device="cpu", progress=False, stop_after=3)
    assert (first.step, first.finished) == (3, False)
    assert [e["step"] for e in _entries(parts)] == [2, 2]  # train and val lines of step 2 only
    again = train(TrainConfig(task="ignored-on-resume"), parts, resume=True, device="cpu", progress=False)
    assert (again.step, again.finished) == (6, True)
    a, b = _entries(full), _entries(parts)
    assert [e["step"] for e in a] == [e["step"] for e in b] == [2, 2, 4, 4, 6, 6]
    for ea, eb in zip(a, b, strict=True):
        if ea["split"] == "train":
            np.testing.assert_allclose([eb["loss"], eb["token_acc"], eb["lr"]],
                                       [ea["loss"], ea["token_acc"], ea["lr"]], rtol=0, atol=1e-6)
        else:
            assert ea == eb
    wa, wb = load_file(full / "model.safetensors"), load_file(parts / "model.safetensors")
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-6)


def test_resume_drops_log_lines_written_after_the_last_checkpoint(tmp_path):
    cfg = TrainConfig(task="Z3", steps=4, **TINY)
    train(cfg, tmp_path, device="cpu", progress=False, stop_after=2)
    with open(tmp_path / LOG_FILE, "a") as f:  # a crash after logging step 3 but before saving it
        f.write(json.dumps({"step": 3, "split": "train", "loss": 99.0}) + "\n")
    train(cfg, tmp_path, resume=True, device="cpu", progress=False)
    steps = [json.loads(line)["step"] for line in (tmp_path / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and 99.0 not in _losses(tmp_path)


def test_run_folder_is_a_loadable_checkpoint(tmp_path):
    cfg = TrainConfig(task="S3", steps=3, **{**TINY, "eval_every": 3, "eval_samples": 8})
    result = train(cfg, tmp_path, device="cpu", progress=False)
    model = load_checkpoint(tmp_path)
    assert model.config.num_householder == 2 and model.config.allow_neg_eigval
    assert not model.config.use_short_conv and not model.config.use_forget_gate
    task = json.loads((tmp_path / "task.json").read_text())
    assert task["name"] == "S3" and task["train_length"] == 16 and task["step"] == 3
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    assert state["step"] == 3 and set(state) >= {"model", "optimizer", "scheduler", "rng", "config"}
    val = [e for e in map(json.loads, (tmp_path / LOG_FILE).read_text().splitlines()) if e["split"] == "val"]
    assert val and set(val[-1]["accuracy"]) == {"16", "64"}
    x, _ = get_task("S3").generate(16, 4, 0)
    trained = result.last["loss"]
    assert math.isfinite(trained) and model(x).logits.shape == (4, 16, 6)


def test_paper_defaults():
    cfg = TrainConfig(task="S4")
    mc = model_config(cfg, get_task("S4"))
    assert (mc.num_hidden_layers, mc.num_heads, mc.head_dim, mc.hidden_size, mc.num_householder) == (1, 12, 32, 384, 2)
    assert mc.allow_neg_eigval and not (mc.use_short_conv or mc.use_forget_gate or mc.use_output_gate)
    assert (cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, cfg.batch_size, cfg.train_length) == (
        1e-3, (0.9, 0.999), 1e-8, 1e-6, 1024, 128)
    mc = model_config(TrainConfig(task="modarith", model_type="delta_net"), get_task("modarith"))
    assert mc.model_type == "delta_net" and mc.num_householder == 1 and mc.vocab_size == 10


def test_cosine_schedule_with_warmup():
    f = lr_lambda(TrainConfig(task="S4", steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-4))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)


def test_training_reduces_the_loss(tmp_path):
    """Length-2 S3 words: the first label is the input itself, which a few steps learn."""
    cfg = TrainConfig(task="S3", steps=15, lr=1e-2, **{**TINY, "batch_size": 32, "train_length": 2,
                                                       "log_every": 5})
    train(cfg, tmp_path, device="cpu", progress=False)
    losses = _losses(tmp_path)
    assert losses[-1] < losses[0] - 0.2


@pytest.mark.parametrize("kwargs,needle", [
    (dict(steps=0), "--steps"),
    (dict(precision="fp8"), "--precision"),
    (dict(model_type="delta_net", num_householder=2), "num-householder"),
    (dict(train_samples=4), "--train-samples"),
    (dict(task="S9"), "unknown task"),
    (dict(task="S4", min_length=4), "min-length"),
])
def test_bad_settings_are_one_line_errors(tmp_path, kwargs, needle):
    with pytest.raises(TrainError, match=needle) as err:
        train(TrainConfig(**{"task": "S3", **TINY, **kwargs}), tmp_path, device="cpu", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / STATE_FILE).exists()


def test_perplexity_averages_labelled_positions_over_batches_and_classes():
    task = get_task("S3")
    torch.manual_seed(0)
    model = load_or_build(task)
    x, y = task.generate(8, 5, 0)
    y[1, :3] = IGNORE_INDEX
    logits = model(x).logits.float()[..., : task.num_classes]
    mask = y != IGNORE_INDEX
    nll = torch.nn.functional.cross_entropy(logits[mask], y[mask]).item()
    acc = (logits.argmax(-1)[mask] == y[mask]).float().mean().item()
    res = perplexity(model, x, y, batch_size=2, num_classes=task.num_classes, with_accuracy=True)
    assert res["tokens"] == int(mask.sum()) and res["nll"] == pytest.approx(nll, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5) and res["accuracy"] == pytest.approx(acc)
    assert "accuracy" not in perplexity(model, x, y)


def test_accuracy_and_position_curves():
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, IGNORE_INDEX]])
    pred = torch.tensor([[1, 2, 0, 4], [1, 2, 3, 0]])
    acc = accuracy(pred, labels)
    assert acc["token"] == pytest.approx(6 / 7) and acc["sequence"] == pytest.approx(0.5)
    curves = position_curves(pred, labels)
    assert curves["token"] == [1.0, 1.0, 0.5, 1.0]
    assert curves["sequence"] == [1.0, 1.0, 0.5, 0.5]  # once wrong, a sequence stays wrong
    only_last = torch.tensor([[IGNORE_INDEX, 3]])
    assert position_curves(torch.tensor([[0, 3]]), only_last)["token"] == [None, 1.0]


def test_evaluate_reports_every_length_and_a_curve_at_the_longest():
    task = get_task("S3")
    torch.manual_seed(0)
    model = load_or_build(task)
    res = evaluate(model, task, [8, 4, 16], samples=8, seed=1)
    assert list(res["accuracy"]) == ["4", "8", "16"]
    assert len(res["position_accuracy"]["token"]) == 16
    assert all(0 <= v["token"] <= 1 and 0 <= v["sequence"] <= 1 for v in res["accuracy"].values())


def load_or_build(task):
    from deltalab.models import DeltaProductForCausalLM

    return DeltaProductForCausalLM(model_config(TrainConfig(task=task.name, heads=2, head_dim=8), task))


# ----------------------------------------------------------------------------- CLI

def test_cli_train_then_eval_json_and_length_curve(tmp_path):
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "S3", "--out", str(run), "--steps", "2", "--batch-size", "8",
                                 "--train-length", "16", "--heads", "2", "--head-dim", "8", "--eval-every", "0",
                                 "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["step"] == 2
    curves = tmp_path / "curves"
    r = CliRunner().invoke(app, ["eval", str(run), "--lengths", "8,32", "--samples", "8", "--json",
                                 "--out", str(curves)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out["accuracy"]) == {"8", "32"} and set(out["accuracy"]["8"]) == {"token", "sequence"}
    assert out["length_curve"] == str(curves / "length_curve.json")
    curve = json.loads((curves / "length_curve.json").read_text())
    assert curve["train_length"] == 16 and len(curve["position_accuracy"]["sequence"]) == 32
    assert (curves / "length_curve.svg").read_text().startswith("<svg")
    r = CliRunner().invoke(app, ["eval", str(run), "--lengths", "8", "--samples", "4"])
    assert r.exit_code == 0 and "token" in r.output and "S3" in r.output


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_cli_eval_leaves_the_checkpoint_untouched_and_writes_only_to_out(tmp_path):
    """`deltalab eval` of an installed model must not write into its folder; --out says where curves go."""
    ckpt = tmp_path / "ckpt"
    train(TrainConfig(task="S3", steps=1, **TINY), ckpt, device="cpu", progress=False)
    before = _snapshot(ckpt)
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--lengths", "8", "--samples", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["length_curve"] is None
    assert _snapshot(ckpt) == before
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--lengths", "8", "--samples", "4", "--out",
                                 str(tmp_path / "new" / "curves")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "new" / "curves").iterdir()) == ["length_curve.json",
                                                                                "length_curve.svg"]
    assert _snapshot(ckpt) == before
    (tmp_path / "file").write_text("")
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--lengths", "8", "--samples", "4", "--out",
                                 str(tmp_path / "file")])
    assert r.exit_code == 2 and r.output.startswith("error:") and "--out" in r.output


@pytest.mark.parametrize("args,needle", [
    (["train", "S4", "--steps", "0"], "--steps"),
    (["train", "nope"], "unknown task"),
    (["train", "S4", "--resume"], "--resume"),
    (["train", "S4", "--device", "tpu"], "--device"),
    (["eval", "{out}/missing"], "does not exist"),
])
def test_cli_bad_arguments_give_one_line(tmp_path, args, needle):
    args = [a.replace("{out}", str(tmp_path)) for a in args]
    if args[0] == "train":
        args += ["--out", str(tmp_path / "run"), "--no-progress"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_cli_train_refuses_to_overwrite_a_run(tmp_path):
    train(TrainConfig(task="S3", steps=1, **TINY), tmp_path, device="cpu", progress=False)
    before = (tmp_path / STATE_FILE).read_bytes()
    r = CliRunner().invoke(app, ["train", "S3", "--out", str(tmp_path), "--no-progress"])
    assert r.exit_code == 2 and "--resume" in r.output
    assert (tmp_path / STATE_FILE).read_bytes() == before


def test_init_from_starts_at_another_runs_weights(tmp_path):
    first = TrainConfig(task="S3", steps=2, **TINY)
    train(first, tmp_path / "short", device="cpu", progress=False)
    source = load_checkpoint(tmp_path / "short")
    follow = TrainConfig(task="S3", steps=5, init_from=str(tmp_path / "short"), **{**TINY, "train_length": 32})
    train(follow, tmp_path / "long", device="cpu", progress=False, stop_after=0)
    again = load_checkpoint(tmp_path / "long")
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), again.state_dict().values()))
    other = TrainConfig(task="S3", steps=1, init_from=str(tmp_path / "short"), **{**TINY, "heads": 4})
    with pytest.raises(TrainError, match="another architecture"):
        train(other, tmp_path / "bad", device="cpu", progress=False)
