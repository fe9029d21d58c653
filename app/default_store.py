"""The bundled default store: captured from models/zoo/s4-deltaproduct2 and probed on first use, cached per user.

`ensure_default_store(progress=callback)` is shared by `deltalab app`, the dashboard and notebooks: it
returns the cached store at once when it is up to date, else captures the bundled checkpoint over S4
sequences and runs the probes, reporting `callback(fraction, message)` before each stage.

Environment: `$DELTALAB_CACHE` (cache folder; else `$XDG_CACHE_HOME/deltalab`, else `~/.cache/deltalab`),
`$DELTALAB_DEFAULT_CHECKPOINT` (another checkpoint than the bundled one), `$DELTALAB_DEFAULT_SAMPLES`
(sequences captured, default 64). A killed build resumes: capture skips complete batches and probes
whose results are complete are not rerun.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltalab.models.run_files import training_length

STORE_NAME = "default-s4.zarr"
CHECKPOINT_NAME = "s4-deltaproduct2"
DEFAULT_SAMPLES = 64
DEFAULT_SEED = 20250
DEFAULT_TRAIN_LENGTH = 128
PROBES = ("betas", "keys", "spectra", "erank", "linear", "lengthgen")
"""Probes run on the default store (store-only ones; `intervene` also runs when its module exists)."""

TEXT_PROBES = tuple(p for p in PROBES if p != "linear")
"""Probes on a text model's store: the linear read-out probe (next-token classes) takes minutes and is left to
`deltalab probe linear`."""

Progress = Callable[[float, str], None]


class DefaultStoreError(ValueError):
    """The default store cannot be built (no bundled checkpoint, a failed capture or probe): one line with the fix."""


def zoo_dir() -> Path:
    """models/zoo: the bundled checkpoints ship inside the models package (importing it loads no torch)."""
    from deltalab import models

    return Path(models.__file__).resolve().parent / "zoo"


def bundled_checkpoint() -> Path:
    """Path of the bundled S4 checkpoint folder (it may not exist yet); $DELTALAB_DEFAULT_CHECKPOINT overrides it."""
    override = os.environ.get("DELTALAB_DEFAULT_CHECKPOINT")
    return Path(override).expanduser() if override else zoo_dir() / CHECKPOINT_NAME


def has_bundled_checkpoint(path: Path | None = None) -> bool:
    """Whether the checkpoint folder holds config.json and weights."""
    path = path or bundled_checkpoint()
    return (path / "config.json").is_file() and any(
        (path / w).is_file() for w in WEIGHT_FILES)


def default_samples() -> int:
    """Sequences the default store captures: $DELTALAB_DEFAULT_SAMPLES, else DEFAULT_SAMPLES."""
    try:
        return max(2, int(os.environ.get("DELTALAB_DEFAULT_SAMPLES", DEFAULT_SAMPLES)))
    except ValueError:
        return DEFAULT_SAMPLES


def cache_dir() -> Path:
    """User cache folder for deltalab (created on demand)."""
    if os.environ.get("DELTALAB_CACHE"):
        return Path(os.environ["DELTALAB_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "deltalab"


def default_store_path() -> Path:
    """Where the default store lives."""
    return cache_dir() / STORE_NAME


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""What marks a folder's weights (the index of a sharded transformers checkpoint stands for its shards)."""


def _weights(checkpoint: Path) -> Path:
    for name in WEIGHT_FILES:
        if (checkpoint / name).is_file():
            return checkpoint / name
    raise DefaultStoreError(f"{checkpoint} has no model.safetensors")


def probes_for(spec: str) -> tuple[str, ...]:
    """The probes a cached store gets: text stores skip `linear` (no labels worth the 80 s it takes)."""
    return TEXT_PROBES if spec.startswith("text:") else PROBES


def _fingerprint(checkpoint: Path, spec: str) -> dict[str, Any]:
    """What the cached store was built from: weights size + mtime (cheap; no hashing on every page load),
    the data spec and the probes run on it."""
    st = _weights(checkpoint).stat()
    return {"checkpoint": str(checkpoint.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "data": spec,
            "probes": list(probes_for(spec))}


def train_length(checkpoint: Path) -> int:
    """Training length recorded beside the checkpoint (models.run_files), else DEFAULT_TRAIN_LENGTH."""
    return training_length(checkpoint) or DEFAULT_TRAIN_LENGTH


def data_spec(checkpoint: Path, samples: int | None = None) -> str:
    """S4 sequences of at least 128 tokens (the papers' training length) and at least twice the model's
    own training length, so length generalisation and several state chunks show on the dashboard."""
    length = max(128, 2 * train_length(checkpoint))
    return f"S4:length={length},samples={samples or default_samples()},seed={DEFAULT_SEED}"


def _marker(out: Path) -> Path:
    return out.with_name(out.name + ".built.json")


def is_built(out: Path | None = None, checkpoint: Path | None = None, samples: int | None = None,
             spec: str | None = None) -> bool:
    """Whether the default store exists, is complete and matches the bundled checkpoint (and data spec)."""
    out = out or default_store_path()
    checkpoint = checkpoint or bundled_checkpoint()
    try:
        built = json.loads(_marker(out).read_text())
    except (OSError, ValueError):
        return False
    from deltalab.store.reader import read_attrs

    return read_attrs(out) is not None and has_bundled_checkpoint(checkpoint) and \
        built == _fingerprint(checkpoint, spec or data_spec(checkpoint, samples))


def _probe_done(out: Path, name: str) -> bool:
    """Whether probe `name` finished writing its results into the store (the group's `complete` attr)."""
    from deltalab.store.reader import read_attrs

    return bool((read_attrs(out, f"results/{name}") or {}).get("complete"))


def run_probe(out: Path, name: str, extra: list[str] | None = None) -> None:
    """Run `deltalab probe NAME --store OUT [EXTRA]` in-process (its table and progress bars are swallowed);
    DefaultStoreError with the probe's one-line message when it fails."""
    import contextlib
    import io

    from deltalab.probes.base import run_module

    out_buf, err_buf = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
        code = run_module(name, ["--store", str(out), "--device", "cpu", *(extra or [])])
    if code:
        lines = [ln for ln in err_buf.getvalue().splitlines() if ln.strip()]
        why = lines[-1].removeprefix("error: ") if lines else f"exit code {code}"
        raise DefaultStoreError(f"probe {name} on {out} failed: {why}; rerun `deltalab probe {name} --store {out}`")


def ensure_default_store(progress: Progress | None = None, *, checkpoint: str | Path | None = None,
                         out: str | Path | None = None, samples: int | None = None, spec: str | None = None,
                         probes: tuple[str, ...] | None = None) -> Path:
    """Return the default store, capturing and probing it first when it is missing or stale.

    `progress(fraction, message)` is called before each stage and with 1.0 at the end. Concurrent
    callers (two dashboards opened at once) wait on a lock file instead of building twice.
    """
    checkpoint = Path(checkpoint) if checkpoint else bundled_checkpoint()
    out = Path(out) if out else default_store_path()
    report = progress or (lambda _f, _m: None)
    if not has_bundled_checkpoint(checkpoint):
        raise DefaultStoreError(
            f"the bundled checkpoint {checkpoint} is not installed (no config.json + model.safetensors): "
            "train or download it there, or pass a store: `deltalab app STORE`")
    spec = spec or data_spec(checkpoint, samples)
    if is_built(out, checkpoint, samples, spec):
        report(1.0, f"default store ready: {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _Lock(out.with_name(out.name + ".lock")):
        if is_built(out, checkpoint, samples, spec):  # another session finished it while we waited
            report(1.0, f"default store ready: {out}")
            return out
        _marker(out).unlink(missing_ok=True)
        _reset_if_stale(out, checkpoint, spec)
        names = list(probes or probes_for(spec))
        names += ["intervene"] if importlib.util.find_spec("deltalab.probes.intervene") else []
        steps = 1 + len(names)
        report(0.0, f"capturing {spec} from {checkpoint.name} into {out} (step 1/{steps})")
        from deltalab.store import StoreError
        from deltalab.store import capture as run_capture

        try:
            run_capture(checkpoint, spec, out, batch_size=16, progress=False,
                        command_line=["deltalab", "capture", str(checkpoint), "--data", spec, "--out", str(out)])
        except (StoreError, ValueError) as err:
            raise DefaultStoreError(f"capturing {checkpoint.name} into {out} failed: {str(err).splitlines()[0]}") \
                from None
        for i, name in enumerate(names):
            report((1 + i) / steps, f"probe {name} (step {2 + i}/{steps})")
            if _probe_done(out, name):
                continue
            extra = ["--checkpoint", str(checkpoint), "--max-seqs", "16"] if name == "intervene" else None
            run_probe(out, name, extra)
        _marker(out).write_text(json.dumps(_fingerprint(checkpoint, spec)))
    report(1.0, f"default store ready: {out}")
    return out


def _reset_if_stale(out: Path, checkpoint: Path, spec: str) -> None:
    """Remove a cached store captured from other weights or data (it is a cache: nothing is lost)."""
    import shutil

    from deltalab.store.plan import checkpoint_digest
    from deltalab.store.reader import read_attrs

    attrs = read_attrs(out)
    stale = attrs is None or attrs.get("checkpoint_digest") != checkpoint_digest(checkpoint) \
        or attrs.get("data_spec") != spec
    if stale and out.exists():
        shutil.rmtree(out)


class _Lock:
    """An exclusive advisory lock on a file (fcntl; a no-op where fcntl is missing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh: Any = None

    def __enter__(self) -> _Lock:
        self.fh = open(self.path, "a")  # noqa: SIM115 - held for the block
        try:
            import fcntl

            fcntl.flock(self.fh, fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        self.fh.close()


SAMPLE_TEXT_BYTES = 16_000
"""Python source the store of a text model is captured over (the first stdlib modules, by name)."""


def is_checkpoint_folder(path: Path) -> bool:
    """A model folder (config.json beside weights) rather than a store: `deltalab app` accepts both."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "zarr.json").is_file()


def sample_text_folder(root: Path | None = None) -> Path:
    """A small folder of .txt documents (the first stdlib modules by name, about SAMPLE_TEXT_BYTES), written
    once into the cache: the text a text model's dashboard store is captured over."""
    from deltalab.tasks.corpus import source_files, stdlib_root

    folder = cache_dir() / "sample-text"
    if (folder / "done").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    root = root or stdlib_root()
    for i, src in enumerate(source_files(root)):
        text = src.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        (folder / f"{i:04d}-{src.stem}.txt").write_text(text)
        total += len(text)
        if total >= SAMPLE_TEXT_BYTES:
            break
    (folder / "done").write_text(str(total))
    return folder


def checkpoint_data_spec(checkpoint: Path, samples: int | None = None) -> str:
    """Task models (a task.json beside them) capture their task; language models capture sample text."""
    from deltalab.models.run_files import read_task_file

    task = read_task_file(checkpoint).get("name")
    if task:
        length = max(128, 2 * train_length(checkpoint))
        return f"{task}:length={length},samples={samples or default_samples()},seed={DEFAULT_SEED}"
    return f"text:{sample_text_folder().resolve()}:length=256,tokenizer=auto"  # as capture records it


def checkpoint_store_path(checkpoint: Path) -> Path:
    """The cached store of a checkpoint folder: one per folder (named after it and a hash of its path)."""
    import hashlib

    key = hashlib.sha256(str(Path(checkpoint).resolve()).encode()).hexdigest()[:10]
    return cache_dir() / f"{Path(checkpoint).resolve().name}-{key}.zarr"


def ensure_checkpoint_store(checkpoint: str | Path, progress: Progress | None = None) -> Path:
    """`deltalab app CHECKPOINT`: capture the checkpoint over its task (or sample text) and run the probes into
    a cached store, once; later launches open it at once (rebuilt when the weights change)."""
    checkpoint = Path(checkpoint).resolve()
    spec = checkpoint_data_spec(checkpoint)
    return ensure_default_store(progress, checkpoint=checkpoint, out=checkpoint_store_path(checkpoint), spec=spec)
