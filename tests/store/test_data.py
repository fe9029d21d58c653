"""Capture data specs: task generators, word-problem CSVs, text (bytes, tokenizer.json), vocabulary checks."""

from __future__ import annotations

import numpy as np
import pytest

from deltalab.models import IGNORE_INDEX
from deltalab.store.data import load_data
from deltalab.store.errors import DataError
from deltalab.tasks.state_tracking import get_task, write_csv


def test_task_spec_matches_generator_and_is_canonical():
    d = load_data("S4:seed=3,samples=6,length=20")
    x, y = get_task("S4").generate(20, 6, 3)
    assert d.spec == "S4:length=20,samples=6,seed=3"
    np.testing.assert_array_equal(d.tokens, x.numpy())
    np.testing.assert_array_equal(d.labels, y.numpy())
    assert d.tokens.dtype == np.int32 and d.doc_start[:, 0].all() and not d.doc_start[:, 1:].any()
    assert d.num_classes == 24 and d.digest() == load_data("S4:length=20,samples=6,seed=3").digest()
    assert d.digest() != load_data("S4:length=20,samples=6,seed=4").digest()


def test_csv_spec(tmp_path):
    x, y = get_task("A5").generate(12, 5, 0)
    path = write_csv(tmp_path / "a5.csv", x.numpy(), y.numpy(), 0)
    for spec in (f"csv:{path}", str(path)):
        d = load_data(spec)
        np.testing.assert_array_equal(d.tokens, x.numpy())
        np.testing.assert_array_equal(d.labels, y.numpy())
        assert d.spec == f"csv:{path.resolve()}"


def test_text_bytes_windows_doc_starts_and_labels(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("abcdefg")
    (tmp_path / "docs" / "b.txt").write_text("XYZ12")
    d = load_data(f"text:{tmp_path / 'docs'}:length=4,tokenizer=bytes")
    stream = list(b"abcdefgXYZ12")
    assert d.tokens.shape == (3, 4)
    assert d.tokens.ravel().tolist() == stream
    starts = np.zeros(12, bool)
    starts[[0, 7]] = True
    np.testing.assert_array_equal(d.doc_start.ravel(), starts)
    labels = stream[1:] + [IGNORE_INDEX]
    labels[6] = IGNORE_INDEX  # 'g' ends document a: no target across documents
    assert d.labels.ravel().tolist() == labels
    with pytest.raises(DataError, match="outside the model's vocabulary") as err:
        d.check_vocab(24)
    assert "\n" not in str(err.value)


def test_text_with_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tok.save(str(ckpt / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("the cat sat the dog")
    d = load_data(f"text:{tmp_path / 't.txt'}:length=5", checkpoint=ckpt)  # tokenizer=auto finds it
    assert d.tokens.tolist() == [[1, 2, 3, 1, 0]]
    assert d.meta["tokenizer"].startswith("tokenizer.json")
    d.check_vocab(4)


@pytest.mark.parametrize("spec, msg", [
    ("", "empty"),
    ("S4:length=10", "needs length= and samples="),
    ("S4:length=ten,samples=2", "must be an integer"),
    ("S4:length=10,samples=2,bogus=1", "unknown option"),
    ("NoSuchGroup:length=10,samples=2", "unknown task"),
    ("csv:/nonexistent/x.csv", "no such data file"),
    ("text:/nonexistent/dir:length=4", "no text files"),
])
def test_bad_specs_one_line(spec, msg):
    with pytest.raises(DataError, match=msg) as err:
        load_data(spec)
    assert "\n" not in str(err.value)


def test_text_shorter_than_a_window(tmp_path):
    (tmp_path / "t.txt").write_text("ab")
    with pytest.raises(DataError, match="fewer than one window"):
        load_data(f"text:{tmp_path / 't.txt'}:length=8,tokenizer=bytes")


def test_text_with_an_end_of_document_token_gets_it_after_every_document(tmp_path):
    """`deltalab train lm`'s tokenizer.json ends each document with <|endoftext|> (256), as in training."""
    pytest.importorskip("tokenizers")
    from deltalab.tasks.corpus import EOS_ID, write_tokenizer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_tokenizer(ckpt)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("abc")
    (tmp_path / "docs" / "b.txt").write_text("de")
    d = load_data(f"text:{tmp_path / 'docs'}:length=7", checkpoint=ckpt)
    assert d.tokens.tolist() == [[97, 98, 99, EOS_ID, 100, 101, EOS_ID]]
    assert d.doc_start.tolist() == [[True, False, False, False, True, False, False]]
    assert d.labels[0, 2] == EOS_ID and d.labels[0, 3] < 0  # the boundary is predicted, nothing after it


def test_a_task_spec_larger_than_memory_is_refused_before_generating():
    """length x samples past the machine's physical memory: one line naming the fix, nothing allocated."""
    with pytest.raises(DataError) as err:
        load_data("S4:length=1000000,samples=1000000000")
    msg = str(err.value)
    assert "\n" not in msg and "need about" in msg and "GB of memory" in msg and "use fewer samples" in msg


def test_running_out_of_memory_while_generating_is_one_line(monkeypatch):
    task = get_task("S4")

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(type(task), "sample", no_memory)
    with pytest.raises(DataError) as err:
        load_data("S4:length=64,samples=8")
    msg = str(err.value)
    assert "\n" not in msg and "512 tokens do not fit" in msg and "use fewer samples" in msg


def test_a_text_file_that_is_not_utf8_is_one_line_naming_the_fix(tmp_path):
    path = tmp_path / "bin.txt"
    path.write_bytes(b"\x00\x01\xff\xfe")
    with pytest.raises(DataError) as err:
        load_data(f"text:{path}:length=16")
    msg = str(err.value)
    assert "\n" not in msg and "cannot be read as UTF-8" in msg and "pass UTF-8 text" in msg
