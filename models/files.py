"""Files read from a checkpoint folder: regular files only (a symlink to one is fine), with a size cap.

A config.json that is a FIFO would hang a plain `read_text()`, one that is a symlink to /dev/zero would
fill memory; both, and a file far larger than any real config, are refused in one CheckpointError line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from deltalab.models.errors import CheckpointError

JSON_LIMIT = 64 * 1024 * 1024
"""Bytes read at most from a checkpoint's JSON file (config.json, a safetensors index, tokenizer files)."""


def check_regular(path: Path, what: str = "file") -> int:
    """The size of `path` when it is a regular file (following symlinks); CheckpointError otherwise."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: put the checkpoint's {what} there") from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror}): check its permissions") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else \
            "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "not a regular file"
        raise CheckpointError(f"{path} is {kind}, not a regular file: the checkpoint's {what} must be a plain file")
    return info.st_size


def read_capped(path: Path, limit: int = JSON_LIMIT, what: str = "file") -> bytes:
    """The bytes of regular file `path`, refused in one line when larger than `limit` (read at most limit + 1)."""
    size = check_regular(path, what)
    if size > limit:
        raise CheckpointError(f"{path} is {size / 1e6:.0f} MB, more than the {limit / 1e6:.0f} MB a {what} may be: "
                              "restore the original file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # never blocks on a FIFO swapped in since stat
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror}): restore the original file") from None
    if len(data) > limit:
        raise CheckpointError(f"{path} is larger than the {limit / 1e6:.0f} MB a {what} may be: restore the "
                              "original file")
    return data
