"""A real text corpus available offline: the Python standard library's own source, byte-level.

Documents are the `*.py` files under `sysconfig.get_paths()['stdlib']` (site-/dist-packages and
__pycache__ excluded), read as raw bytes. Each file goes to the held-out split when the first 8 bytes
of sha256(relative posix path) read as an integer fall below `eval_fraction` of 2**64, so the split is
fixed by path alone (stable across machines, orderings and additions of other files).

Tokenizer: one token per byte (ids 0..255) plus a boundary token `<|endoftext|>` = 256 between
documents; vocab 257. `tokenizer_json()` writes it in Hugging Face `tokenizers` format (a byte-level
BPE without merges, bytes mapped to ids by value), so `Tokenizer.from_file` encodes UTF-8 text to
exactly its bytes; `store.data`'s `tokenizer=auto` picks it up beside a checkpoint.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EOS_ID = 256
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 257
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
DATA_FILE = "data.json"
TOKENIZER_FILE = "tokenizer.json"


class CorpusError(ValueError):
    """A corpus that cannot be built as asked; the message names the fix."""


def stdlib_root() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """Sorted `*.py` files under root, without installed packages and byte-code caches."""
    if not root.is_dir():
        raise CorpusError(f"corpus root {root} is not a folder: pass the standard library folder "
                          "(sysconfig.get_paths()['stdlib'])")
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not any(part in EXCLUDED_DIRS for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(relative_path: str, eval_fraction: float) -> bool:
    """Deterministic split by hash of the relative posix path."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < eval_fraction * 2**64


@dataclass
class Corpus:
    """Token streams of the two splits: documents joined as doc EOS doc EOS ... (uint16)."""

    train: np.ndarray
    eval: np.ndarray
    spec: dict[str, Any] = field(default_factory=dict)


def _join(docs: list[bytes]) -> np.ndarray:
    """doc_1 EOS doc_2 EOS ... as uint16 ids (one boundary token after every document)."""
    total = sum(len(d) + 1 for d in docs)
    out = np.empty(total, dtype=np.uint16)
    pos = 0
    for d in docs:
        out[pos: pos + len(d)] = np.frombuffer(d, dtype=np.uint8)
        out[pos + len(d)] = EOS_ID
        pos += len(d) + 1
    return out


def load_corpus(root: str | Path | None = None, eval_fraction: float = 0.05) -> Corpus:
    """Read the corpus and split it by path hash; `spec` records what a rebuild must match."""
    if not 0 < eval_fraction < 1:
        raise CorpusError(f"eval fraction must be in (0, 1), got {eval_fraction}")
    root = Path(root) if root is not None else stdlib_root()
    files = source_files(root)
    if not files:
        raise CorpusError(f"no *.py files under {root}: pass the standard library folder")
    splits: dict[str, list[bytes]] = {"train": [], "eval": []}
    names: dict[str, list[str]] = {"train": [], "eval": []}
    h = hashlib.sha256()
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError as err:
            raise CorpusError(f"cannot read {path} ({err.strerror}): fix its permissions or pass another root") \
                from None
        split = "eval" if is_held_out(rel, eval_fraction) else "train"
        splits[split].append(data)
        names[split].append(rel)
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    if not splits["eval"] or not splits["train"]:
        raise CorpusError(f"the split of {len(files)} files left one side empty: raise/lower --eval-fraction")
    train, held = _join(splits["train"]), _join(splits["eval"])
    spec = {
        "name": "python-stdlib",
        "root": str(root),
        "python": platform.python_version(),
        "eval_fraction": eval_fraction,
        "split_rule": "held out iff int(sha256(relative posix path)[:8 bytes]) < eval_fraction * 2**64",
        "files": {"train": len(names["train"]), "eval": len(names["eval"])},
        "tokens": {"train": int(train.size), "eval": int(held.size)},
        "eval_files": names["eval"],
        "digest": "sha256:" + h.hexdigest(),
        "tokenizer": {"kind": "bytes", "vocab_size": VOCAB_SIZE, "eos_id": EOS_ID, "eos_token": EOS_TOKEN},
        "documents": "one per file, raw bytes, EOS after each",
    }
    return Corpus(train, held, spec)


def encode(text: str | bytes) -> list[int]:
    """Byte ids of text (UTF-8 for str); no boundary token."""
    return list(text.encode("utf-8") if isinstance(text, str) else text)


def decode(ids: list[int] | np.ndarray) -> str:
    """Bytes back to text (boundary tokens become newlines; invalid UTF-8 replaced)."""
    ids = [int(i) for i in ids]
    return bytes(10 if i == EOS_ID else i for i in ids).decode("utf-8", errors="replace")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what tokenizers' ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def tokenizer_json() -> dict[str, Any]:
    """The byte tokenizer in Hugging Face `tokenizers` format: id = byte value, EOS = 256."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[EOS_TOKEN] = EOS_ID
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": EOS_ID, "content": EOS_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def write_tokenizer(folder: str | Path) -> Path:
    """Write tokenizer.json into folder (atomically)."""
    import json

    path = Path(folder) / TOKENIZER_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(tokenizer_json(), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def random_windows(tokens: np.ndarray, batch_size: int, length: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """batch_size random windows: inputs [B, L] and next-token labels [B, L] (int64)."""
    if tokens.size < length + 1:
        raise CorpusError(f"the split has {tokens.size} tokens, fewer than one window of {length + 1}")
    starts = rng.integers(0, tokens.size - length, size=batch_size)
    idx = starts[:, None] + np.arange(length + 1)[None, :]
    w = tokens[idx].astype(np.int64)
    return w[:, :-1], w[:, 1:]


def eval_windows(tokens: np.ndarray, length: int, max_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows from the start of the split (evenly spaced when capped), with labels."""
    n = (tokens.size - 1) // length
    if n < 1:
        raise CorpusError(f"the split has {tokens.size} tokens, fewer than one window of {length + 1}")
    starts = np.arange(n) * length
    if max_windows is not None and max_windows < n:
        starts = starts[np.linspace(0, n - 1, max_windows).round().astype(np.int64)]
    idx = starts[:, None] + np.arange(length + 1)[None, :]
    w = tokens[idx].astype(np.int64)
    return w[:, :-1], w[:, 1:]
