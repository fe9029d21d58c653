"""The byte-level stdlib corpus, its tokenizer.json, LM training with exact resume, and `deltalab train lm`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltalab.models import load_checkpoint
from deltalab.tasks.corpus import (
    EOS_ID,
    VOCAB_SIZE,
    CorpusError,
    decode,
    eval_windows,
    is_held_out,
    load_corpus,
    random_windows,
    source_files,
    write_tokenizer,
)
from deltalab.train.lm import LMTrainConfig, LMTrainError, train_lm

SAMPLE = "def f(x):\n    return 'héllo ∑ 日本' + \"\\t\" \x00\x7f\r\n"


def test_tokenizer_json_encodes_exactly_the_bytes(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(write_tokenizer(tmp_path)))
    ids = tok.encode(SAMPLE, add_special_tokens=False).ids
    assert ids == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids) == SAMPLE
    assert tok.get_vocab_size() == VOCAB_SIZE and tok.token_to_id("<|endoftext|>") == EOS_ID
    assert tok.encode("a<|endoftext|>b").ids == [97, EOS_ID, 98]


def test_store_text_data_reads_the_checkpoint_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from deltalab.store.data import load_data

    write_tokenizer(tmp_path)
    text = SAMPLE.replace("\r", "") * 3  # store.data reads text with universal newlines
    (tmp_path / "doc.txt").write_text(text)
    data = load_data(f"text:{tmp_path / 'doc.txt'}:length=16", checkpoint=tmp_path)
    assert "tokenizer.json" in data.meta["tokenizer"]
    assert data.tokens.ravel().tolist() == list(text.encode("utf-8"))[: data.tokens.size]


def test_corpus_split_is_by_path_hash_and_joins_documents_with_eos(corpus_root):
    files = source_files(corpus_root)
    rel = [p.relative_to(corpus_root).as_posix() for p in files]
    assert len(files) == 12 and not any("site-packages" in r or "__pycache__" in r for r in rel)
    assert rel == sorted(rel)
    c = load_corpus(corpus_root, 0.4)
    held = [r for r in rel if is_held_out(r, 0.4)]
    assert c.spec["eval_files"] == held and c.spec["files"] == {"train": 12 - len(held), "eval": len(held)}
    expected = b"".join((corpus_root / r).read_bytes() + b"\xff" for r in held)  # 0xff stands for EOS here
    got = c.eval.astype(np.int64)
    assert got.size == len(expected) and (got == EOS_ID).sum() == len(held)
    assert bytes(np.where(got == EOS_ID, 0xFF, got).astype(np.uint8)) == expected
    assert load_corpus(corpus_root, 0.4).spec["digest"] == c.spec["digest"]
    assert all(is_held_out(r, 0.4) == is_held_out(r, 0.4) for r in rel)
    with pytest.raises(CorpusError, match="not a folder"):
        load_corpus(corpus_root / "missing")


def test_windows_are_next_token_pairs():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = random_windows(tokens, 5, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (5, 16) and np.array_equal(x[:, 1:], y[:, :-1])
    ex, ey = eval_windows(tokens, 100)
    assert ex.shape == (9, 100) and np.array_equal(ex[:, 0], np.arange(9) * 100) and ey[0, -1] == 100
    assert eval_windows(tokens, 100, max_windows=3)[0][:, 0].tolist() == [0, 400, 800]
    assert decode([104, 105, EOS_ID]) == "hi\n"


def small(corpus_root, **over) -> LMTrainConfig:
    base = dict(model_type="gated_deltaproduct", layers=1, hidden_size=16, heads=2, head_dim=8, context_length=16,
                batch_size=2, steps=4, warmup_steps=1, eval_windows=4, eval_every=2, save_every=2, log_every=1,
                corpus_root=str(corpus_root), eval_fraction=0.3)
    return LMTrainConfig(**{**base, **over})


def test_training_writes_a_loadable_checkpoint_and_resumes_exactly(corpus_root, tmp_path):
    done = train_lm(small(corpus_root), tmp_path / "a", progress=False, command="deltalab train lm ...")
    assert done.finished and done.eval["perplexity"] > 1
    for name in ("config.json", "model.safetensors", "tokenizer.json", "data.json", "eval.json", "README.md"):
        assert (tmp_path / "a" / name).is_file(), name
    model = load_checkpoint(tmp_path / "a")
    assert model.config.vocab_size == VOCAB_SIZE and model.config.num_householder == 2
    assert "deltalab train lm" in (tmp_path / "a" / "README.md").read_text()
    part = train_lm(small(corpus_root), tmp_path / "b", progress=False, stop_after=2)
    assert not part.finished and part.step == 2
    with pytest.raises(LMTrainError, match="--resume"):
        train_lm(small(corpus_root), tmp_path / "b", progress=False)
    resumed = train_lm(small(corpus_root, steps=999), tmp_path / "b", resume=True, progress=False)  # saved cfg wins
    assert resumed.step == 4 and resumed.eval["nll"] == pytest.approx(done.eval["nll"], rel=1e-6)
    a, b = load_checkpoint(tmp_path / "a").state_dict(), load_checkpoint(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind,dk", [("delta_net", 8), ("gated_deltanet", 8), ("kda", 8)])
def test_model_types_build_with_fla_dims(corpus_root, kind, dk):
    from deltalab.train.lm import model_config

    cfg = model_config(small(corpus_root, model_type=kind))
    assert (cfg.model_type, cfg.head_k_dim, cfg.head_v_dim, cfg.num_householder) == (kind, dk, 8, 1)
    assert cfg.use_output_gate == (kind != "delta_net")
    with pytest.raises(LMTrainError, match="num-householder"):
        small(corpus_root, model_type=kind, num_householder=2).validate()


def test_cli_train_lm_and_train_task_share_the_command(corpus_root, tmp_path):
    from deltalab.app.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["train", "lm", "--out", str(tmp_path / "run"), "--corpus-root", str(corpus_root),
                              "--layers", "1", "--hidden-size", "16", "--heads", "2", "--head-dim", "8",
                              "--context-length", "16", "--batch-size", "2", "--steps", "2", "--warmup-steps", "1",
                              "--eval-windows", "2", "--eval-fraction", "0.3", "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["finished"] and out["eval"]["perplexity"] > 1
    bad = runner.invoke(app, ["train", "lm", "--out", str(tmp_path / "x"), "--model-type", "mamba"])
    assert bad.exit_code == 2 and "unknown --model-type" in bad.output
    assert "train lm --help" in runner.invoke(app, ["train", "--help"]).output
    task_help = runner.invoke(app, ["train", "S4", "--help"])
    assert task_help.exit_code == 0 and "--train-length" in task_help.output
