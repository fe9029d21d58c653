"""What training leaves beside a checkpoint's weights: task.json, train_config.json and the training length.

One reader for all of them, so the trainers, capture, probes and the dashboard agree on where the
training length comes from; and the two helpers every results file written beside a checkpoint needs
(`clean_json`, `deltalab_version`), here because both train/ and probes/ may import models/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

TASK_FILE = "task.json"
"""Written by the task trainer: the task's spec, `train_length` and the step it was saved at."""
TRAIN_CONFIG_FILE = "train_config.json"
"""Written by both trainers: every setting of the run (the LM trainer's length is `context_length`)."""

_LENGTH_FILES = ("config.json", TRAIN_CONFIG_FILE, "training.json", "train.json", TASK_FILE)
_LENGTH_KEYS = ("train_length", "context_length", "length", "seq_len", "max_length")


class RunFileError(ValueError):
    """A run file beside a checkpoint that exists but cannot be read; the message names the fix."""


def read_json_object(path: str | Path) -> dict[str, Any] | None:
    """A JSON object from `path`; None when the file is absent; RunFileError when it is not a JSON object."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raise RunFileError(f"{path} is not valid JSON: restore it or delete it") from None
    if not isinstance(raw, dict):
        raise RunFileError(f"{path} does not hold a JSON object: restore it or delete it")
    return raw


def read_task_file(checkpoint: str | Path) -> dict[str, Any]:
    """The checkpoint's task.json (empty when absent; RunFileError when unreadable)."""
    return read_json_object(Path(checkpoint) / TASK_FILE) or {}


def training_length(checkpoint: str | Path) -> int | None:
    """Training sequence length recorded beside the checkpoint, else None.

    Looks in config.json, then the run files, in that order, for the first positive integer under
    train_length, context_length, length, seq_len or max_length. Unreadable files are skipped: the
    length is a hint for analyses, never a reason to refuse a checkpoint.
    """
    folder = Path(checkpoint)
    for name in _LENGTH_FILES:
        try:
            raw = read_json_object(folder / name) or {}
        except RunFileError:
            continue
        for key in _LENGTH_KEYS:
            value = raw.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def clean_json(obj: Any) -> Any:
    """numpy scalars/arrays -> Python, NaN/inf -> None, tuples -> lists: plain JSON data."""
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return clean_json(obj.tolist())
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, complex | np.complexfloating):
        return [clean_json(obj.real), clean_json(obj.imag)]
    return obj


def deltalab_version() -> str:
    """Installed distribution version (or 'unknown' when run from a bare checkout), for provenance."""
    try:
        from importlib.metadata import version

        return version("deltalab")
    except Exception:  # noqa: BLE001 - metadata may be absent in a bare checkout
        return "unknown"
