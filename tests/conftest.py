"""Shared test settings: deterministic seeds, and GPU tests skipped (not passed) without CUDA (multi_gpu ones below
two GPUs)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on a machine with one")
    skip_multi = pytest.mark.skip(reason=f"needs two or more CUDA GPUs ({gpus} here): run `pytest -m multi_gpu`")
    for item in items:
        if "gpu" in item.keywords and not gpus:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def fill_disk(monkeypatch, fails) -> None:
    """Make store writes raise ENOSPC (disk full) where `fails(key)` is true; `key` is the path in the store.

    Covers both writers: zarr's LocalStore.set and store.shards' writev of whole shards (the real
    temp-file cleanup runs: the fault is injected at the system call).
    """
    import errno
    import os

    import zarr

    original_set, original_writev = zarr.storage.LocalStore.set, os.writev

    async def set_(self, key, value):
        if fails(key):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await original_set(self, key, value)

    def writev(fd, buffers):
        target = os.readlink(f"/proc/self/fd/{fd}")
        key = target.split(".zarr/", 1)[-1].rsplit(".", 2)[0]  # drop the .<uuid>.partial suffix
        if fails(key):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original_writev(fd, buffers)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", set_)
    monkeypatch.setattr(os, "writev", writev)
