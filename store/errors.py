"""One-line store errors: each names the problem and the fix; the CLI prints them and exits 2."""

from __future__ import annotations


class StoreError(ValueError):
    """Base class of every store error a user can fix."""


class NotAStoreError(StoreError):
    """Path missing, or not a deltalab store."""


class FormatVersionError(StoreError):
    """Store written by a newer deltalab."""


class TruncatedStoreError(StoreError):
    """Store metadata or arrays are missing or unreadable."""


class StoreMismatchError(StoreError):
    """Appending a capture of another model, config, layout or dtype."""


class StoreWriteError(StoreError):
    """Writing failed (e.g. disk full); complete sequences are kept."""


class DataError(StoreError):
    """A data spec that cannot be read, or tokens outside the model's vocabulary."""
