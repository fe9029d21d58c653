"""`deltalab generate`: continues a prompt, steers it from a file, and fails in one line on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.models import load_checkpoint
from deltalab.models.generate import generate

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fla" / "gated_deltanet"


def run(*args: str):
    return CliRunner().invoke(app, ["generate", str(FIXTURE), *args])


def test_generate_prints_the_greedy_continuation():
    res = run("--tokens", "1,5,7,9", "-n", "6", "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    want = generate(load_checkpoint(FIXTURE), [[1, 5, 7, 9]], 6).tokens[0]
    assert got["prompt"] == [1, 5, 7, 9] and got["tokens"] == want
    text = run("--prompt", "hi", "-n", "3")  # bytes 104, 105: outside this 64-token vocabulary
    assert text.exit_code == 2 and "token id 104 outside the vocabulary 0..63" in text.stderr


def test_generate_steers_and_samples_reproducibly(tmp_path):
    vector = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 8
    save_file({"v": vector}, str(tmp_path / "v.safetensors"))
    base = json.loads(run("--tokens", "3,4,5", "-n", "8", "--json").stdout)["tokens"]
    steered = run("--tokens", "3,4,5", "-n", "8", "--json", "--steer", f"1:{tmp_path / 'v.safetensors'}*3")
    assert steered.exit_code == 0, steered.output
    want = generate(load_checkpoint(FIXTURE), [[3, 4, 5]], 8,
                    interventions=[__import__("deltalab.models.interventions").models.interventions.Steering(
                        1, vector, 3.0)]).tokens[0]
    assert json.loads(steered.stdout)["tokens"] == want != base
    erased = run("--tokens", "3,4,5", "-n", "8", "--json", "--scale-state", "0", "--scale-state", "1:0.0")
    assert erased.exit_code == 0 and json.loads(erased.stdout)["tokens"] != base
    a = run("--tokens", "3,4,5", "-n", "8", "--json", "--temperature", "1.5", "--seed", "4")
    b = run("--tokens", "3,4,5", "-n", "8", "--json", "--temperature", "1.5", "--seed", "4")
    assert a.exit_code == 0 and a.stdout == b.stdout


@pytest.mark.parametrize("args, message", [
    (["--tokens", "1,2", "-n", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--tokens", "1,2", "-n", "-4"], "--max-new-tokens must be at least 1, got -4"),
    (["--tokens", "1,99"], "token id 99 outside the vocabulary 0..63"),
    (["--tokens", "1,x"], "is not a list of integer token ids"),
    ([], "pass exactly one of --prompt TEXT and --tokens"),
    (["--tokens", "1", "--steer", "7:v.safetensors"], "--steer layer 7 does not exist: the model has layers 0..1"),
    (["--tokens", "1", "--steer", "1:missing.safetensors"], "steering file missing.safetensors does not exist"),
    (["--tokens", "1", "--steer", "nonsense"], "is not LAYER:FILE[*ALPHA]"),
    (["--tokens", "1", "--steer", "1:v.safetensors*big"], "ALPHA 'big' is not a number"),
    (["--tokens", "1", "--scale-state", "5"], "--scale-state layer 5 has no recurrent state"),
    (["--tokens", "1", "--dtype", "int8"], "--dtype 'int8' is not one of"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(*args)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_a_vector_of_the_wrong_width_and_a_long_prompt_fail_in_one_line(tmp_path):
    save_file({"v": torch.zeros(10)}, str(tmp_path / "w.safetensors"))
    res = run("--tokens", "1", "--steer", f"0:{tmp_path / 'w.safetensors'}")
    assert res.exit_code == 2 and "shape (10,); the model's residual stream needs (64,)" in res.stderr
    ckpt = tmp_path / "short"
    ckpt.mkdir()
    raw = json.loads((FIXTURE / "config.json").read_text()) | {"max_position_embeddings": 8}
    (ckpt / "config.json").write_text(json.dumps(raw))
    (ckpt / "model.safetensors").write_bytes((FIXTURE / "model.safetensors").read_bytes())
    res = CliRunner().invoke(app, ["generate", str(ckpt), "--tokens", "1,2,3,4,5,6", "-n", "4"])
    assert res.exit_code == 2 and "passes the model's max_position_embeddings=8" in res.stderr
    assert "--max-new-tokens" in res.stderr


def test_steering_along_the_difference_of_two_texts():
    from deltalab.models.interventions import Steering, difference_vector

    res = run("--tokens", "3,4,5", "-n", "6", "--json", "--steer-diff", "1:\x01\x02\x03|\x10\x11*5")
    assert res.exit_code == 0, res.output
    model = load_checkpoint(FIXTURE)
    vector = difference_vector(model, torch.tensor([[1, 2, 3]]), torch.tensor([[16, 17]]), 1)
    want = generate(model, [[3, 4, 5]], 6, interventions=[Steering(1, vector, 5.0)]).tokens[0]
    assert json.loads(res.stdout)["tokens"] == want
    bad = run("--tokens", "1", "--steer-diff", "1:hi|\x01")
    assert bad.exit_code == 2 and "--steer-diff text 'hi' has token id 104 outside" in bad.stderr
    bad = run("--tokens", "1", "--steer-diff", "1:nobar")
    assert bad.exit_code == 2 and "is not LAYER:POSITIVE|NEGATIVE[*ALPHA]" in bad.stderr
