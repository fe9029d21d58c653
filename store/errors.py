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


def corrupt_chunk_line(err: BaseException, store: object) -> str | None:
    """The line for a read that failed on a corrupt chunk, naming the store, the damaged sequences (and arrays) and
    the command that repairs them; None for any other error. Two kinds: a checksum that does not match the bytes
    (zarr's crc32c codec, on every chunk of a format-3 store, says so with both checksums) and bytes zstd cannot
    decode (its RuntimeError; stores written before the crc32c). The damage is found by `store.verify` (it reads the
    store once: this is the error path)."""
    text = str(err).lower()
    if "checksum" in text:
        reason = "its checksum does not match its bytes"
    elif "decompress" in text:
        reason = "its bytes do not decode"
    else:
        return None
    head = f"store {store} has a corrupt chunk ({reason})"
    if store not in ("", None):
        from deltalab.store.verify import damage_line

        found = damage_line(str(store))
        if found is not None:
            return f"{head}: {found}"
    return (f"{head}; re-run the probe if it is a probe's results, else rerun the capture command (it recaptures "
            "damaged sequences), or restore the store from a copy")


def is_corrupt_chunk(err: BaseException) -> bool:
    """Whether a read failed on a corrupt store chunk (a RuntimeError from a codec is one; other ones are bugs)."""
    return corrupt_chunk_line(err, "") is not None


def reraise_unless_input_error(err: BaseException) -> None:
    """Raise `err` again if it is a RuntimeError other than a codec's on a corrupt chunk: that is a bug to see in
    full, not bad input to put in one line."""
    if isinstance(err, RuntimeError) and not is_corrupt_chunk(err):
        raise err
