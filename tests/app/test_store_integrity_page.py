"""The dashboard on a damaged store: flipped bytes inside an activation chunk and a truncated shard each give one
error naming the damaged sequences and the capture command that repairs them, never a traceback or wrong values."""

from __future__ import annotations

import os
import shutil

from tests.app.stores import bare_store
from tests.app.test_pages import _page_text, new_app


def _shard(path, var):
    files = sorted(p for p in (path / var / "c").rglob("*") if p.is_file())
    assert files
    return files[0]


def test_flipped_bytes_in_a_beta_chunk_name_the_sequences_on_the_page(monkeypatch, tmp_path, tmp_path_factory):
    bad = tmp_path / "bad.zarr"
    shutil.copytree(bare_store(tmp_path_factory), bad)
    file = _shard(bad, "beta")
    data = bytearray(file.read_bytes())
    for i in range(16, 22):  # inside the first inner chunk's values: the shard index and its crc32c are intact
        data[i] ^= 0x5A
    file.write_bytes(bytes(data))
    at = new_app(monkeypatch, bad)
    at.run()
    at.sidebar.radio(key="page").set_value("Betas").run()
    assert not at.exception, [e.message for e in at.exception]
    text = _page_text(at)  # the preview's box (the page itself reads no stored results here)
    assert f"store {bad} has a corrupt chunk (its checksum does not match its bytes)" in text, text
    assert "damaged sequence(s) 0-3" in text and "beta/c/0/0/0/0/0 (seq 0-3, checksum mismatch)" in text, text
    assert f"rerun `deltalab capture CHECKPOINT --data synthetic:seqs=4,length=64 --out {bad}`" in text, text
    assert "stored and computed" not in text.lower()


def test_a_truncated_shard_is_the_stores_problem_box_naming_the_repair(monkeypatch, tmp_path, tmp_path_factory):
    bad = tmp_path / "bad.zarr"
    shutil.copytree(bare_store(tmp_path_factory), bad)
    file = _shard(bad, "k")
    os.truncate(file, file.stat().st_size // 2)
    at = new_app(monkeypatch, bad)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    text = _page_text(at)
    assert "This store is incomplete or damaged" in text and "k/c/0/" in text, text
    assert "recaptures only the damaged sequences" in text and f"deltalab store verify {bad}" in text, text
