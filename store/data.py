"""Data specs for capture: task generators, word-problem CSVs and text files -> fixed-length token arrays.

Spec grammar (one string, as `deltalab capture --data` takes it):

    S4:length=128,samples=512,seed=0        a tasks.state_tracking task (any name get_task knows; min_length= too)
    csv:PATH  or  PATH.csv                   word-problem CSV: seed,input,target (space-separated ints)
    text:PATH[:length=256,tokenizer=auto,pack=yes]
                                             a .txt or .jsonl file, a folder of them (sorted) or a glob;
                                             one document per .txt file or per JSON line ({"text": ...}),
                                             cut into non-overlapping windows of `length` tokens (the
                                             last partial window is dropped); tokenizer = auto (the
                                             checkpoint's tokenizer.json, else bytes; transformers models
                                             need theirs) | bytes | PATH/to/tokenizer.json. Documents of
                                             a transformers model are wrapped in its own begin/end ids.
                                             pack=no: one document per row (its state starts from zero),
                                             long documents cut into several rows, the last right-padded;
                                             `pad` marks the padding, which no analysis reads.

Token ids are int32; labels are aligned with positions (-100 = none). For text the label at t is the
next token of the same document. `doc_start` marks the first token of each document.
"""

from __future__ import annotations

import glob as globmod
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deltalab.models import IGNORE_INDEX
from deltalab.store.errors import DataError
from deltalab.store.text_docs import TEXT_SUFFIXES, hf_separators, read_documents

TEXT_DEFAULT_LENGTH = 256


@dataclass
class Data:
    """Token sequences ready for capture (all [N, T])."""

    spec: str  # canonical spec: the key a store's segment is recorded under
    tokens: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE_INDEX = none
    doc_start: np.ndarray  # bool
    num_classes: int | None = None  # `correct` compares the argmax over logits[:num_classes] (tasks)
    meta: dict[str, Any] = field(default_factory=dict)
    pad: np.ndarray | None = None  # bool, True at padding after a sequence's end (None: no padding)

    def __post_init__(self) -> None:
        if self.pad is None:
            self.pad = np.zeros(self.tokens.shape, dtype=bool)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def digest(self) -> str:
        """sha256 of tokens and labels: a resumed segment must hold the same data."""
        h = hashlib.sha256()
        for a in (self.tokens, self.labels):
            h.update(np.ascontiguousarray(a).tobytes())
        return "sha256:" + h.hexdigest()

    def check_vocab(self, vocab_size: int) -> None:
        """DataError naming the first token (or label) id outside [0, vocab_size)."""
        for what, arr, allowed in (("token", self.tokens, None), ("label", self.labels, IGNORE_INDEX)):
            bad = (arr < 0) | (arr >= vocab_size)
            if allowed is not None:
                bad &= arr != allowed
            if bad.any():
                s, t = (int(i) for i in np.argwhere(bad)[0])
                raise DataError(f"data {self.spec!r}: {what} id {int(arr[s, t])} at sequence {s}, "
                                f"position {t} is outside the model's vocabulary (0..{vocab_size - 1}); "
                                "use data made for this model (or its tokenizer)")


def _parse_options(text: str, spec: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise DataError(f"data spec {spec!r}: option {part!r} must be key=value (e.g. length=128)")
        key, value = (s.strip() for s in part.split("=", 1))
        out[key] = value
    return out


def _int_option(opts: dict[str, str], key: str, spec: str, default: int | None = None) -> int | None:
    if key not in opts:
        return default
    try:
        return int(opts[key])
    except ValueError:
        raise DataError(f"data spec {spec!r}: {key}={opts[key]!r} must be an integer") from None


def load_data(spec: str, checkpoint: str | Path | None = None) -> Data:
    """Parse `spec` and build its token arrays (see the module docstring); DataError on bad input."""
    spec = spec.strip()
    if not spec:
        raise DataError("empty --data spec: pass e.g. S4:length=128,samples=512,seed=0, a .csv or text:PATH")
    if spec.startswith("csv:") or (spec.endswith(".csv") and ":" not in spec.split("/")[0]):
        return _csv(spec.removeprefix("csv:"))
    if spec.startswith("text:"):
        body = spec.removeprefix("text:")
        path, _, options = body.partition(":")
        return _text(path, _parse_options(options, spec), checkpoint, spec)
    if Path(spec).is_dir() or spec.endswith((".txt", ".jsonl")):
        return _text(spec, {}, checkpoint, spec)
    return _task(spec)


_SPLIT_HINT = " (several smaller specs, e.g. other seeds, can go into one store: capture appends)"


def _task(spec: str) -> Data:
    from deltalab.tasks.state_tracking import TaskError, get_task

    name, _, options = spec.partition(":")
    opts = _parse_options(options, spec)
    unknown = sorted(set(opts) - {"length", "samples", "seed", "min_length"})
    if unknown:
        raise DataError(f"data spec {spec!r}: unknown option(s) {', '.join(unknown)} "
                        "(tasks take length, samples, seed, min_length)")
    if "length" not in opts or "samples" not in opts:
        raise DataError(f"data spec {spec!r} needs length= and samples= "
                        f"(e.g. {name}:length=128,samples=512,seed=0)")
    length, samples = _int_option(opts, "length", spec), _int_option(opts, "samples", spec)
    seed, min_length = _int_option(opts, "seed", spec, 0), _int_option(opts, "min_length", spec)
    try:
        task = get_task(name)
        x, y = task.generate(length, samples, seed, min_length)
    except TaskError as err:
        raise DataError(f"data spec {spec!r}: {err}" + (_SPLIT_HINT if "of memory" in str(err) else "")) from None
    except MemoryError:
        raise DataError(f"data spec {spec!r}: {length * samples:,} tokens do not fit in this machine's free memory; "
                        f"use fewer samples{_SPLIT_HINT}") from None
    canonical = f"{name}:" + ",".join(f"{k}={v}" for k, v in
                                      (("length", length), ("samples", samples), ("seed", seed),
                                       ("min_length", min_length)) if v is not None)
    tokens = np.asarray(x, dtype=np.int32)
    doc_start = np.zeros(tokens.shape, dtype=bool)
    doc_start[:, 0] = True
    return Data(canonical, tokens, np.asarray(y, dtype=np.int32), doc_start, task.num_classes,
                {"kind": "task", "task": task.spec()}, pad=task_padding(task, tokens, min_length))


def task_padding(task: Any, tokens: np.ndarray, min_length: int | None) -> np.ndarray:
    """Variable-length task samples (`min_length=`) end in the task's [PAD] symbol: True there."""
    symbols = list(getattr(task, "symbols", ()) or ())
    if min_length is None or "[PAD]" not in symbols:
        return np.zeros(tokens.shape, dtype=bool)
    return tokens == symbols.index("[PAD]")


def _csv(path_text: str) -> Data:
    from deltalab.tasks.state_tracking import TaskError, read_csv

    path = Path(path_text).expanduser()
    if path.exists():
        from deltalab.store.text_docs import check_data_file

        check_data_file(path)
    try:
        rows = read_csv(path)
    except TaskError as err:
        raise DataError(f"data file {path}: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"data file {path} cannot be read ({err}); pass a seed,input,target CSV") from None
    tokens = np.asarray(rows.inputs, dtype=np.int32)
    doc_start = np.zeros(tokens.shape, dtype=bool)
    doc_start[:, 0] = True
    return Data(f"csv:{path.resolve()}", tokens, np.asarray(rows.labels, dtype=np.int32), doc_start, None,
                {"kind": "csv", "path": str(path.resolve())})


def _unpacked(docs: list[np.ndarray], length: int, eos: int | None, files: list[Path], path_text: str,
              opts: dict[str, str], tok_desc: str, bos: int | None) -> Data:
    """pack=no: every document starts its own row (state from zero), cut into windows of `length`; the last
    window of each document is right-padded (with the end-of-text id, else 0) and marked in `pad`."""
    rows, labels, pads, starts = [], [], [], []
    for doc in docs:
        nxt = np.append(doc[1:], IGNORE_INDEX)
        for lo in range(0, doc.size, length):
            n = min(length, doc.size - lo)
            row = np.full(length, eos if eos is not None else 0, dtype=np.int64)
            lab = np.full(length, IGNORE_INDEX, dtype=np.int64)
            row[:n], lab[:n] = doc[lo:lo + n], nxt[lo:lo + n]
            pad = np.arange(length) >= n
            start = np.zeros(length, dtype=bool)
            start[0] = lo == 0
            rows.append(row)
            labels.append(lab)
            pads.append(pad)
            starts.append(start)
    if not rows:
        raise DataError(f"data spec text:{path_text}: the files hold no text")
    tokens = np.stack(rows)
    if np.any(tokens > np.iinfo(np.int32).max):
        raise DataError(f"data spec text:{path_text}: token ids exceed int32")
    where = Path(path_text).expanduser().resolve()
    canonical = f"text:{where}:length={length},tokenizer={opts.get('tokenizer', 'auto')},pack=no"
    pad = np.stack(pads)
    return Data(canonical, tokens.astype(np.int32), np.stack(labels).astype(np.int32), np.stack(starts), None,
                {"kind": "text", "files": [str(f.resolve()) for f in files], "tokenizer": tok_desc,
                 "separators": {"bos": bos, "eos": eos}, "packed": False, "padded_tokens": int(pad.sum())},
                pad=pad)


def _text_files(path_text: str, spec: str) -> list[Path]:
    path = Path(path_text).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in globmod.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"data spec {spec!r}: no text files at {path} "
                        "(pass a .txt or .jsonl file, a folder of them or a glob)")
    return files


EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>")


def _end_of_document(tok: Any) -> int | None:
    """The id of the tokenizer's end-of-document special token, if it declares one."""
    for added in tok.get_added_tokens_decoder().values():
        if added.special and added.content in EOS_NAMES:
            return tok.token_to_id(added.content)
    return None


def _tokenizer(choice: str, checkpoint: str | Path | None, spec: str) -> tuple[Any, str, int | None]:
    """(encode function str -> list[int], description, end-of-document id or None).

    A tokenizer.json with an end-of-document special token (e.g. `deltalab train lm`'s byte tokenizer,
    whose `<|endoftext|>` is 256) gets that token after every document, as the model saw in training.
    """
    if choice == "auto":
        found = Path(checkpoint) / "tokenizer.json" if checkpoint is not None else None
        hf = hf_separators(checkpoint)
        if hf is not None and (found is None or not found.is_file()):
            raise DataError(f"data spec {spec!r}: {checkpoint} has no tokenizer.json, and bytes would be ids "
                            f"meaningless to this {hf[0]} model: put the model's tokenizer.json beside config.json "
                            "or pass tokenizer=PATH/to/tokenizer.json")
        choice = str(found) if found is not None and found.is_file() else "bytes"
    if choice == "bytes":
        return (lambda s: list(s.encode("utf-8"))), "bytes", None
    path = Path(choice).expanduser()
    if not path.is_file():
        raise DataError(f"data spec {spec!r}: tokenizer {path} not found "
                        "(use tokenizer=bytes or a tokenizer.json)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("reading tokenizer.json needs the `tokenizers` package: pip install tokenizers "
                        "(or use tokenizer=bytes)") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad file
        raise DataError(f"tokenizer {path} cannot be read ({str(err).splitlines()[0]})") from None
    desc = f"tokenizer.json sha256:{_sha256(path)[:16]}"
    return (lambda s: tok.encode(s, add_special_tokens=False).ids), desc, _end_of_document(tok)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _text(path_text: str, opts: dict[str, str], checkpoint: str | Path | None, spec: str) -> Data:
    unknown = sorted(set(opts) - {"length", "tokenizer", "pack"})
    if unknown:
        raise DataError(f"data spec {spec!r}: unknown option(s) {', '.join(unknown)} "
                        "(text takes length, tokenizer, pack)")
    if opts.get("pack", "yes") not in ("yes", "no"):
        raise DataError(f"data spec {spec!r}: pack={opts['pack']!r} must be yes (documents packed into windows) "
                        "or no (one document per row, padded)")
    length = _int_option(opts, "length", spec, TEXT_DEFAULT_LENGTH)
    if length < 1:
        raise DataError(f"data spec {spec!r}: length must be >= 1")
    files = _text_files(path_text, spec)
    encode, tok_desc, eos = _tokenizer(opts.get("tokenizer", "auto"), checkpoint, spec)
    bos, hf = None, hf_separators(checkpoint)
    if hf is not None:  # a transformers model: its own begin/end-of-text ids separate documents
        _, bos, eos = hf
    ids: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    for text in (doc for f in files for doc in read_documents(f)):
        doc = np.asarray(encode(text), dtype=np.int64)
        if doc.size == 0:
            continue
        if bos is not None:
            doc = np.insert(doc, 0, bos)
        if eos is not None:
            doc = np.append(doc, eos)
        start = np.zeros(doc.size, dtype=bool)
        start[0] = True
        ids.append(doc)
        starts.append(start)
    if opts.get("pack", "yes") == "no":
        return _unpacked(ids, length, eos, files, path_text, opts, tok_desc, bos)
    stream = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    is_start = np.concatenate(starts) if starts else np.zeros(0, dtype=bool)
    n = stream.size // length
    if n == 0:
        raise DataError(f"data spec {spec!r}: the text has {stream.size} tokens, fewer than one window of "
                        f"{length}; pass a smaller length= or more text")
    nxt = np.full(stream.size, IGNORE_INDEX, dtype=np.int64)
    nxt[:-1] = np.where(is_start[1:], IGNORE_INDEX, stream[1:])  # next token of the same document
    if np.any(stream > np.iinfo(np.int32).max):
        raise DataError(f"data spec {spec!r}: token ids exceed int32")
    cut = n * length
    where = Path(path_text).expanduser().resolve()
    canonical = f"text:{where}:length={length},tokenizer={opts.get('tokenizer', 'auto')}"
    return Data(canonical, stream[:cut].reshape(n, length).astype(np.int32),
                nxt[:cut].reshape(n, length).astype(np.int32), is_start[:cut].reshape(n, length), None,
                {"kind": "text", "files": [str(f.resolve()) for f in files], "tokenizer": tok_desc,
                 "separators": {"bos": bos, "eos": eos},
                 "dropped_tokens": int(stream.size - cut)})
