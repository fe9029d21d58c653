"""Documents for text capture: .txt files (one document each) and JSON lines (one document per line), and the
document separators of a transformers model (its own begin/end-of-text token ids, from config.json)."""

from __future__ import annotations

import json
from pathlib import Path

from deltalab.store.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl")


FILE_LIMIT = 512 * 1024 * 1024
"""Bytes of one text or CSV data file deltalab reads (a larger one is refused before it is read: split it)."""


def check_data_file(path: Path, limit: int = FILE_LIMIT) -> None:
    """DataError in one line when `path` is not a regular file or is larger than `limit` bytes (checked before
    reading, so a multi-GB file or a FIFO is refused rather than met as a MemoryError or a hang)."""
    import os
    import stat

    try:
        info = os.stat(path)
    except OSError as err:
        raise DataError(f"data file {path} cannot be read ({err.strerror}): check the path") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"data file {path} is not a regular file: pass a plain file (or a folder of them)")
    if info.st_size > limit:
        raise DataError(f"data file {path} is {info.st_size / 1e6:.0f} MB, more than the {limit / 1e6:.0f} MB one "
                        "data file may be: split it into several files (a folder of .txt, or .jsonl lines)")


def read_documents(path: Path) -> list[str]:
    """A .txt file is one document; a .jsonl file holds one per line ({"text": ...} or a JSON string)."""
    check_data_file(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"text file {path} cannot be read as UTF-8 ({err}); pass UTF-8 text (.txt, or .jsonl of "
                        '{"text": ...} lines), or leave the file out of the folder or glob') from None
    if path.suffix != ".jsonl":
        return [raw]
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise DataError(f"{path}:{n} is not JSON: write one {{\"text\": ...}} object per line") from None
        text = obj.get("text") if isinstance(obj, dict) else obj
        if not isinstance(text, str):
            raise DataError(f"{path}:{n} has no \"text\" string: write one {{\"text\": ...}} object per line")
        docs.append(text)
    return docs


def _first_id(value: object) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else None


def hf_separators(checkpoint: str | Path | None) -> tuple[str, int | None, int | None] | None:
    """(model type, begin-of-text id, end-of-text id) of a transformers Gated DeltaNet folder, else None.

    The ids are the model's own (config.json, the text config of vision-language models): documents are
    wrapped in them as the model saw text in training.
    """
    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return None
    from deltalab.models.errors import CheckpointError
    from deltalab.models.files import read_capped

    try:
        raw = json.loads(read_capped(Path(checkpoint) / "config.json", what="config.json"))
    except (OSError, ValueError, RecursionError, CheckpointError):
        return None
    from deltalab.models.hf.families import family_of

    if not isinstance(raw, dict) or family_of(str(raw.get("model_type"))) is None:
        return None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    bos = _first_id(text.get("bos_token_id", raw.get("bos_token_id")))
    eos = _first_id(text.get("eos_token_id", raw.get("eos_token_id")))
    return str(raw["model_type"]), bos, eos
