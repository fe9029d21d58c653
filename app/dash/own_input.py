"""Your own input: a sequence the researcher types, run through the store's checkpoint with the hooks, as an
in-memory xarray.Dataset with the store's schema (one sequence), so every page can show it. No Streamlit here.

Text models read the text through the checkpoint's tokenizer.json (bytes without one); labels are the next
token. Task models read token ids or token names separated by spaces or commas; group tasks get their labels
(the running product) from the task, so loss and accuracy are real.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from deltalab.models import IGNORE_INDEX
from deltalab.store import schema

MAX_TOKENS = 8192


class InputError(ValueError):
    """The typed input cannot be run: one line that says why and what to type."""


@dataclass
class Encoded:
    """A typed sequence ready to run: [T] token ids, labels (IGNORE_INDEX = none), document starts."""

    tokens: np.ndarray
    labels: np.ndarray
    doc_start: np.ndarray
    kind: str  # "text" | "task"
    num_classes: int | None = None
    note: str = ""


@dataclass
class Timing:
    """Seconds spent in each stage of one run."""

    stages: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        self.stages[name] = self.stages.get(name, 0.0) + now - t0
        return now

    @property
    def total(self) -> float:
        return float(sum(self.stages.values()))


def task_name(attrs: dict[str, Any]) -> str | None:
    """The task of a task store (e.g. 'S4'), else None."""
    meta = attrs.get("data_meta") or {}
    name = (meta.get("task") or {}).get("name") if isinstance(meta, dict) else None
    if name:
        return str(name)
    spec = str(attrs.get("data_spec", ""))
    if ":" in spec and not spec.startswith(("csv", "text", "synthetic", "input")):
        return spec.split(":", 1)[0]
    return None


def encode_text(text: str, tokenizer: Path | None) -> np.ndarray:
    """Token ids of `text`: tokenizer.json when given, else UTF-8 bytes."""
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    from tokenizers import Tokenizer

    return np.asarray(Tokenizer.from_file(str(tokenizer)).encode(text, add_special_tokens=False).ids, np.int64)


def parse_task_tokens(text: str, vocab_size: int, names: Sequence[str] | None = None) -> np.ndarray:
    """'3 17 5' or '3,17,5' (ids), or token names separated by spaces ('0 1 1' for parity, '( 1 + 2 )')."""
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts:
        raise InputError("the input is empty: type token ids separated by spaces, e.g. 3 17 5 0")
    lookup = {str(n): i for i, n in enumerate(names or [])}
    out = []
    for p in parts:
        if p in lookup and not p.isdigit():
            out.append(lookup[p])
            continue
        try:
            i = int(p)
        except ValueError:
            raise InputError(f"{p!r} is neither a token id (0..{vocab_size - 1}) nor a token name") from None
        if not 0 <= i < vocab_size:
            raise InputError(f"token id {i} is outside the model's vocabulary 0..{vocab_size - 1}")
        out.append(i)
    return np.asarray(out, np.int64)


def task_labels(task: str | None, tokens: np.ndarray) -> tuple[np.ndarray, int | None]:
    """Labels of a task sequence (group tasks: the running product; parity: the running parity), and the class
    count; IGNORE_INDEX everywhere when the task is unknown or not a simple scan."""
    none = np.full(tokens.shape, IGNORE_INDEX, np.int64)
    if not task:
        return none, None
    try:
        from deltalab.tasks.state_tracking import get_task

        t = get_task(task)
    except Exception:  # noqa: BLE001 - an unknown task: no labels
        return none, None
    group = getattr(t, "group", None)
    if group is not None:
        if tokens.size and tokens.max() >= group.order:
            return none, t.num_classes
        return group.scan(tokens[None])[0].astype(np.int64), t.num_classes
    if t.name == "parity":
        return (np.cumsum(tokens) % 2).astype(np.int64), t.num_classes
    return none, t.num_classes


def encode(text: str, attrs: dict[str, Any], tokenizer: Path | None = None,
           names: Sequence[str] | None = None) -> Encoded:
    """The typed `text` as tokens for the store's model (text or task, from the store's data)."""
    from deltalab.app.dash.textgrid import is_text_store

    vocab = int((attrs.get("model_config") or {}).get("vocab_size") or 0)
    if is_text_store(attrs):
        if not text:
            raise InputError("the input is empty: type some text")
        ids = encode_text(text, tokenizer)
        if ids.size and (ids.max() >= vocab > 0):
            raise InputError(f"the tokenizer produced id {int(ids.max())}, outside the model's vocabulary {vocab}")
        labels = np.full(ids.shape, IGNORE_INDEX, np.int64)
        labels[:-1] = ids[1:]
        enc = Encoded(ids, labels, np.zeros(ids.shape, bool), "text", None,
                      "tokenizer.json" if tokenizer else "UTF-8 bytes")
    else:
        ids = parse_task_tokens(text, vocab, names)
        task = task_name(attrs)
        labels, n_classes = task_labels(task, ids)
        enc = Encoded(ids, labels, np.zeros(ids.shape, bool), "task", n_classes, f"task {task or '?'}")
    if ids.size == 0:
        raise InputError("the input has no tokens")
    if ids.size > MAX_TOKENS:
        raise InputError(f"the input has {ids.size} tokens; the dashboard runs at most {MAX_TOKENS}")
    enc.doc_start[0] = True
    return enc


def load_model(checkpoint: Path, device: str = "cpu") -> Any:
    """The checkpoint as a float32 model in eval mode on `device`."""
    import torch

    from deltalab.models import load_checkpoint

    return load_checkpoint(checkpoint, device=device, dtype=torch.float32)


_MODELS: dict[tuple[str, str], Any] = {}
_MODELS_LOCK = threading.Lock()
MODELS_MAX = 2
_MODEL_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltalab-model")
"""The one thread that loads models and runs every traced forward. nnsight routes a module's calls to whichever
trace on that module is running, whatever thread it runs in, and hands values over by greenlet switches, which
cannot cross threads: two traces at once (the background warm-up and a click on Run, two tabs) fail with
"parent cannot be on a different thread" or a value "not cached". One thread runs them one after another."""


def _on_model_thread(fn: Any, *args: Any) -> Any:
    if threading.current_thread().name.startswith("deltalab-model"):
        return fn(*args)  # already there (a run that loads its model)
    return _MODEL_THREAD.submit(fn, *args).result()


def get_model(checkpoint: Path | str, device: str = "cpu") -> Any:
    """The model, loaded once per process and warmed up with one short traced run (nnsight's first trace sets
    itself up for seconds); safe to call from any thread (the work runs on the model thread), e.g. a background
    thread to have it ready before Run is pressed."""
    return _on_model_thread(_get_model, checkpoint, device)


def _get_model(checkpoint: Path | str, device: str) -> Any:
    key = (str(Path(checkpoint).resolve()), device)
    with _MODELS_LOCK:
        if key in _MODELS:
            return _MODELS[key]
        model = load_model(Path(checkpoint), device)
        from deltalab.store.runner import HookedRunner

        n = min(8, int(model.config.vocab_size))
        ids = np.arange(n, dtype=np.int64)[None] % max(1, int(model.config.vocab_size))
        HookedRunner(model, ["k", "beta"], [0], "float32")(ids, np.full(ids.shape, IGNORE_INDEX),
                                                           np.zeros(ids.shape, bool)).arrays()
        while len(_MODELS) >= MODELS_MAX:
            _MODELS.pop(next(iter(_MODELS)))
        _MODELS[key] = model
        return model


def is_loaded(checkpoint: Path | str, device: str = "cpu") -> bool:
    return (str(Path(checkpoint).resolve()), device) in _MODELS


def run(model: Any, enc: Encoded, attrs: dict[str, Any], timing: Timing | None = None) -> xr.Dataset:
    """Run `model` with the store's hooks over one encoded sequence: a Dataset with the store's variables, dims,
    coordinates and attributes (data_spec 'input:text' or 'input:task'), holding one complete sequence. Safe from
    any thread: the traced forward runs on the model thread, after any warm-up or other run."""
    return _on_model_thread(_run, model, enc, attrs, timing)


def _run(model: Any, enc: Encoded, attrs: dict[str, Any], timing: Timing | None = None) -> xr.Dataset:
    from deltalab.store.plan import head_index
    from deltalab.store.runner import HookedRunner

    timing = timing or Timing()
    t0 = time.perf_counter()
    layers = [int(x) for x in attrs.get("layers") or range(model.config.num_hidden_layers)]
    variables = [v for v in attrs.get("variables") or schema.variables_for(schema.DEFAULT_HOOKS,
                                                                             gated=model.config.use_forget_gate)
                 if v != "complete" and v in schema.VARIABLES]
    kept = (list(attrs["heads"]), attrs.get("key_heads")) if attrs.get("heads") is not None else None
    sizes = dict(attrs.get("sizes") or {})
    picks = {v: p for v in variables if v in schema.MODEL_HOOK_POINTS and sizes
             and (p := head_index(v, sizes, kept)) is not None}  # the store's --heads, so the input matches it
    runner = HookedRunner(model, variables + ["complete"], layers, "float32", enc.num_classes, heads=picks)
    arrays = runner(enc.tokens[None], enc.labels[None], enc.doc_start[None]).arrays()
    t0 = timing.add("run with hooks", t0)
    T = int(enc.tokens.size)
    data_vars = {}
    for var, arr in arrays.items():
        if var not in schema.VARIABLES:
            continue
        # the store's dims: q, k per key head on grouped models, per-key-channel g (Kimi) and beta (rwkv7)
        data_vars[var] = (schema.dims_of(var, sizes), np.ascontiguousarray(arr))
    data_vars["complete"] = (("seq",), np.ones(1, bool))
    chunk = int(attrs.get("chunk_size") or schema.CHUNK_SIZE)
    n_chunks = schema.n_chunks(T, chunk)
    coords: dict[str, Any] = {"seq": np.arange(1, dtype=np.int64), "layer": np.asarray(layers, np.int64),
                              "chunk_pos": ("chunk", np.minimum(np.arange(n_chunks) * chunk, T))}
    spec = f"input:{enc.kind}"
    digest = hashlib.sha256(enc.tokens.astype(np.int64).tobytes()).hexdigest()[:12]
    new_attrs = {**attrs, "data_spec": spec, "segments": [{"data_spec": spec, "start": 0, "count": 1}],
                 "sizes": {**(attrs.get("sizes") or {}), "pos": T, "chunk": n_chunks},
                 "input": {"kind": enc.kind, "tokens": T, "digest": digest, "note": enc.note},
                 "batch_size": 1, "command_line": list(attrs.get("command_line") or [])}
    from deltalab.store.reader import per_value_head

    ds = xr.Dataset(data_vars, coords=coords, attrs=new_attrs)
    if "key_head" in ds.dims:  # grouped heads: which key head each value head reads, as store.open gives it
        ds = ds.assign_coords(key_head_of=("head", np.asarray(attrs["key_head_of"], dtype=np.int64)))
        if "key_heads" in attrs:
            ds = ds.assign_coords(key_head=np.asarray(attrs["key_heads"], dtype=np.int64))
    ds = per_value_head(ds)  # q and k per value head, as the pages read a store
    timing.add("build dataset", t0)
    return ds


def input_key(store: Path | str, enc: Encoded) -> str:
    """The name an input is registered under: beside its store, named by its tokens' digest."""
    digest = hashlib.sha256(enc.tokens.astype(np.int64).tobytes()).hexdigest()[:12]
    return f"{store}#input-{digest}"
