"""Text capture through a transformers model's own tokenizer: .txt and JSON-lines documents wrapped in the
model's begin/end-of-text ids from config.json, and a one-line error when the folder has no tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from typer.testing import CliRunner  # noqa: E402

from deltalab import store  # noqa: E402
from deltalab.app.cli import app  # noqa: E402
from deltalab.store.data import load_data  # noqa: E402
from tests.models.hf_tiny import SPECIALS, save_char_tokenizer, save_tiny  # noqa: E402

BOS, EOS = SPECIALS["<|begin_of_text|>"], SPECIALS["<|endoftext|>"]
DOCS = ["the quick brown fox jumps over the lazy dog. " * 3, "hello world, hello delta rule! " * 4,
        "state tracking with reflections, 1 2 3. " * 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = save_tiny("qwen3_5", tmp_path_factory.mktemp("q35") / "model")
    save_char_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpus")
    (base / "a.txt").write_text(DOCS[0])
    (base / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS[1:]) + "\n")
    return base


def test_documents_wrapped_in_the_models_own_ids(folder, corpus):
    data = load_data(f"text:{corpus}:length=32", folder)
    flat, starts, labels = data.tokens.ravel(), data.doc_start.ravel(), data.labels.ravel()
    lengths = [len(d) + 2 for d in DOCS]  # characters + begin + end
    bounds = np.cumsum([0, *lengths])[:-1]
    bounds = bounds[bounds < flat.size]
    assert np.flatnonzero(starts).tolist() == bounds.tolist()  # one document per .txt file and per JSON line
    assert (flat[bounds] == BOS).all() and (flat[bounds[1:] - 1] == EOS).all()
    assert (labels[bounds[1:] - 1] == -100).all()  # no target across a document boundary
    assert data.meta["separators"] == {"bos": BOS, "eos": EOS} and data.meta["tokenizer"].startswith("tokenizer.json")


def test_capture_text_through_the_cli(folder, corpus, tmp_path):
    out = tmp_path / "t.zarr"
    res = CliRunner().invoke(app, ["capture", str(folder), "--data", f"text:{corpus}:length=32", "--out", str(out),
                                   "--hooks", "tokens,labels,loss,beta,state", "--no-progress"])
    assert res.exit_code == 0, res.output
    ds = store.open(out)
    assert ds.attrs["data_meta"]["kind"] == "text" and ds.sizes["pos"] == 32
    assert ds["layer"].values.tolist() == [0, 1, 3] and np.isfinite(ds["beta"].values).all()


def test_no_tokenizer_for_a_text_spec_is_one_line(folder, corpus, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in folder.iterdir():
        if f.name != "tokenizer.json":
            (bare / f.name).write_bytes(f.read_bytes())
    res = CliRunner().invoke(app, ["capture", str(bare), "--data", f"text:{corpus}", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no tokenizer.json" in lines[0] and "tokenizer=PATH" in lines[0]
