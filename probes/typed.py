"""Typed input for the probes that run a checkpoint themselves (lens, attribution): `--text` or `--tokens`
instead of a store, tokenised as the model reads it, and the tokens spelled back for tables."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from deltalab.probes.core import ProbeError


def add_typed_arguments(p: argparse.ArgumentParser) -> None:
    """--text / --tokens: the input when there is no --store."""
    p.add_argument("--text", default=None, help="text to read (the checkpoint's tokenizer.json, else bytes)")
    p.add_argument("--tokens", default=None, help="token ids to read, comma-separated (e.g. 1,17,42)")


def wants_typed(argv: list[str]) -> bool:
    """True when argv names no --store and asks for no help: the probe reads --text / --tokens with a checkpoint."""
    return not any(a in ("--help", "-h") or a == "--store" or a.startswith("--store=") for a in argv)


def _tokenizer(checkpoint: str | Path):
    path = Path(checkpoint) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode(checkpoint: str | Path, text: str | None, tokens: str | None, vocab_size: int) -> list[int]:
    """Token ids of --text (tokenizer.json beside the checkpoint, else UTF-8 bytes) or --tokens."""
    if (text is None) == (tokens is None):
        raise ProbeError("pass exactly one of --text TEXT or --tokens IDS (or --store STORE for a capture)")
    if tokens is not None:
        try:
            ids = [int(x) for x in tokens.replace(" ", "").split(",") if x]
        except ValueError:
            raise ProbeError(f"--tokens {tokens!r}: write integer ids separated by commas, e.g. 1,17,42") from None
    else:
        tok = _tokenizer(checkpoint)
        if tok is not None:
            ids = tok.encode(text, add_special_tokens=False).ids
        elif vocab_size >= 256:
            ids = list(text.encode("utf-8"))
        else:
            raise ProbeError(f"{checkpoint} has no tokenizer.json and its {vocab_size}-token vocabulary cannot hold "
                             "bytes: pass --tokens IDS")
    if not ids:
        raise ProbeError("the input is empty: pass at least one token")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ProbeError(f"token {bad[0]} is outside the vocabulary: pass ids in 0..{vocab_size - 1}")
    return ids


def decoder(checkpoint: str | Path | None, vocab_size: int) -> Callable[[int], str]:
    """id -> a short printable spelling (tokenizer.json's token, a byte's character, else the id)."""
    tok = _tokenizer(checkpoint) if checkpoint is not None else None
    if tok is not None:
        return lambda i: tok.id_to_token(int(i)) or str(int(i))
    if vocab_size >= 256:
        return lambda i: repr(chr(int(i)))[1:-1] if int(i) < 256 else f"<{int(i)}>"
    return lambda i: str(int(i))
