"""The plan of one capture, built and checked before anything is written.

`plan_capture` reads the arguments of `store.capture` (checkpoint, data spec, out, hooks, layers, heads, batch
size, device, dtypes, state_every, reductions), loads the data and the model, and works out the store's variables,
sizes and root attrs and what it will take on disk. Every bad argument is a CaptureError (one line, with the fix)
raised here, before the store is touched; `store.capture` then executes the plan.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.models.run_files import deltalab_version, training_length
from deltalab.store import schema
from deltalab.store.data import Data, load_data
from deltalab.store.errors import StoreError, StoreMismatchError
from deltalab.store.schema import human_bytes

DEFAULT_BATCH_SIZE = 8


class CaptureError(StoreError):
    """Bad capture arguments (layers, hooks, batch size, device)."""


# --- provenance --------------------------------------------------------------------------

def checkpoint_digest(folder: str | Path) -> str:
    """`sha256:<hex>` of the checkpoint's weights file (model.safetensors, else pytorch_model.bin), or of
    its shards in order (model.safetensors.index.json)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file() and not (folder / "model.safetensors").is_file():
        import json

        h = hashlib.sha256()
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            with open(folder / shard, "rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 22), b""):
                    h.update(block)
        return "sha256:" + h.hexdigest()
    for name in ("model.safetensors", "pytorch_model.bin"):
        f = folder / name
        if f.is_file():
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            return "sha256:" + h.hexdigest()
    return "sha256:unknown"


# --- arguments ---------------------------------------------------------------------------

def parse_list(text: str | Sequence | None) -> list[str] | None:
    """"a,b" -> ["a", "b"]; lists pass through; None stays None."""
    if text is None:
        return None
    if isinstance(text, str):
        return [t.strip() for t in text.split(",") if t.strip()]
    return [str(t) for t in text]


def resolve_layers(layers: str | Sequence[int] | None, num_layers: int,
                   delta_layers: Sequence[int] | None = None) -> list[int]:
    """Captured layer indices (sorted, unique); CaptureError if one is outside 0..num_layers-1.

    `delta_layers` (hybrids: the real indices of the delta-rule layers) is the default and the only
    layers allowed; softmax-attention layers have no hooks to capture.
    """
    if layers is None:
        return list(range(num_layers)) if delta_layers is None else sorted(delta_layers)
    out = []
    for item in parse_list(layers) or []:
        try:
            i = int(item)
        except ValueError:
            raise CaptureError(f"--layers {item!r} is not an integer; pass e.g. --layers 0,1") from None
        if not 0 <= i < num_layers:
            raise CaptureError(f"layer {i} is out of range: the model has {num_layers} layer(s) "
                               f"(0..{num_layers - 1})")
        if delta_layers is not None and i not in delta_layers:
            raise CaptureError(f"layer {i} is a softmax-attention layer: the delta-rule layers are "
                               f"{','.join(map(str, delta_layers))}; pass --layers among them or omit it")
        out.append(i)
    if not out:
        raise CaptureError("--layers is empty; pass e.g. --layers 0 or omit it for all layers")
    return sorted(set(out))


def _int_ranges(text: str, flag: str, example: str) -> list[int]:
    """"0,3-5" -> [0, 3, 4, 5]; CaptureError (one line) for anything else."""
    out: list[int] = []
    for part in parse_list(text) or []:
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise CaptureError(f"{flag} {part!r} is not an integer or a range; pass e.g. {flag} {example}") from None
        if b < a:
            raise CaptureError(f"{flag} {part!r} is an empty range; write it low-high, e.g. {flag} {example}")
        out.extend(range(a, b + 1))
    return out


def resolve_heads(heads: str | Sequence[int] | None, num_heads: int,
                  key_head_of: Sequence[int] | None = None) -> tuple[list[int], list[int] | None] | None:
    """(value heads, key heads or None) that `--heads` captures (sorted, unique, model numbers); None = all.

    `--heads 0,3-5` names value heads (the `head` dim of every per-head variable). On grouped models
    (`key_head_of`: value head -> key head) q and k are kept for the key heads those value heads read, and
    `--heads key:0,1` names key heads instead (every value head reading them is captured).
    CaptureError (one line, with the fix) for a bad, empty or out-of-range selection."""
    if heads is None:
        return None
    text = heads if isinstance(heads, str) else ",".join(map(str, heads))
    by_key = text.strip().startswith("key:")
    grouped = key_head_of is not None
    n_key = len(set(key_head_of)) if grouped else num_heads
    if by_key and not grouped:
        raise CaptureError(f"--heads {text}: this model does not group its heads (each of its {num_heads} heads has "
                           f"its own keys); drop key: and pass e.g. --heads 0,1")
    picked = _int_ranges(text.strip()[4:] if by_key else text, "--heads", "key:0,1" if by_key else "0,3-5")
    if not picked:
        raise CaptureError("--heads is empty; pass e.g. --heads 0 or omit it for all heads")
    limit, what = (n_key, "key head") if by_key else (num_heads, "value head" if grouped else "head")
    for h in picked:
        if not 0 <= h < limit:
            msg = f"{what} {h} is out of range: the model has {limit} {what}s (0..{limit - 1})"
            if grouped and by_key:
                msg += f" and {num_heads} value heads; drop key: to name value heads (--heads 0,{num_heads - 1})"
            elif grouped:
                msg += (f" and {n_key} key heads; --heads names value heads (q, k are kept for the key heads they "
                        f"read), --heads key:0,{n_key - 1} names key heads")
            raise CaptureError(msg)
    if not grouped:
        return sorted(set(picked)), None
    if by_key:
        values = [j for j, kh in enumerate(key_head_of) if kh in set(picked)]
    else:
        values = sorted(set(picked))
    return values, sorted({int(key_head_of[j]) for j in values})


def head_index(var: str, sizes: dict[str, int], heads: tuple[list[int], list[int] | None] | None
               ) -> tuple[int, list[int]] | None:
    """(axis, model head numbers) to keep of per-layer variable `var` laid out [layer, seq, ...] (the store's dims
    with seq and layer swapped); None when `var` has no head axis or every head is captured."""
    if heads is None:
        return None
    dims = schema.dims_of(var, sizes)
    if "key_head" in dims:
        return dims.index("key_head"), list(heads[1] or [])
    if "head" in dims:
        return dims.index("head"), list(heads[0])
    return None


def _dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def _store_batch_size(out: Path) -> int | None:
    """batch_size of an existing store at `out` (None if there is none)."""
    if not (out / "zarr.json").exists():
        return None
    from deltalab.store.reader import check_store

    return int(check_store(out)["batch_size"])


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def size_estimate(out: Path, variables: list[str], sizes: dict[str, int], dtype: str, n_seq: int,
                  batch: int = 1, extra_per_seq: int = 0) -> dict[str, Any]:
    """What the capture will write (uncompressed, an upper bound: chunks hold `batch` sequences, so the last one
    is counted whole; `extra_per_seq`: the reductions' results) and what the disk of `out` has free. Bytes already
    in a store at `out` count as written."""
    import shutil

    per_seq = schema.bytes_per_sequence(variables, sizes, dtype) + extra_per_seq
    existing = 0
    if out.exists():
        existing = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    disk = _existing_parent(out)
    chunks = -(-n_seq // max(1, batch))
    return {"bytes": per_seq * chunks * max(1, batch), "bytes_per_token": per_seq / max(1, sizes["pos"]),
            "already": existing, "free": shutil.disk_usage(disk).free, "disk": str(disk)}


def check_disk(out: Path, estimate: dict[str, Any]) -> None:
    """CaptureError (one line, nothing written) when the store would not fit on the disk of `out`."""
    need = estimate["bytes"] - estimate["already"]
    if need > estimate["free"]:
        raise CaptureError(
            f"--out {out}: the store needs about {human_bytes(need)} but {estimate['disk']} has "
            f"{human_bytes(estimate['free'])} free; capture less (--layers, --heads, --hooks, --dtype float16, "
            "a shorter --data) or pick another --out")


@dataclass(frozen=True)
class CapturePlan:
    """One capture, checked: what runs (model, data, layers, heads, device), what is stored (variables, dtype,
    sizes, attrs) and what it costs (estimate). `captured` adds to `variables` what only the reductions read (never
    stored); `head_sel` is resolve_heads' (value heads, key heads) or None for every head; `rank`/`world` come from
    torchrun's environment (0, 1 otherwise)."""

    checkpoint: Path
    out: Path
    data: Data
    model: Any
    device: str
    dtype: str
    batch_size: int
    layers: list[int]
    head_sel: tuple[list[int], list[int] | None] | None
    hooks: list[str]
    variables: list[str]
    captured: list[str]
    state_every: int
    sizes: dict[str, int]
    attrs: dict[str, Any]
    estimate: dict[str, Any]
    reductions: Any
    progress: bool
    rank: int
    world: int


def plan_capture(checkpoint: str | Path, data: str | Data, out: str | Path, *,
                 hooks: str | Sequence[str] | None = None, layers: str | Sequence[int] | None = None,
                 batch_size: int | None = None, device: str = "cpu",
                 dtype: str = "float32", progress: bool = True, command_line: list[str] | None = None,
                 model: Any = None, model_dtype: str = "float32", device_map: str | None = None,
                 state_every: int = 1, reductions: Any = None,
                 heads: str | Sequence[int] | None = None, allow_nonfinite: bool = False) -> CapturePlan:
    """Check the arguments of `store.capture` (see there), load the data and the model, and return the plan; nothing
    is written. CaptureError (or StoreMismatchError, for a store chunked otherwise) names the first bad argument."""
    import torch

    checkpoint, out = Path(checkpoint), Path(out)
    rank, world, local_rank = _dist_env()
    if dtype not in schema.FLOAT_DTYPES:
        raise CaptureError(f"--dtype {dtype!r} is not supported; use one of {', '.join(schema.FLOAT_DTYPES)}")
    if state_every < 1:
        raise CaptureError(f"--state-every must be >= 1, got {state_every}")
    if reductions is not None and world > 1:
        raise CaptureError("--reduce under torchrun is not supported: capture, then run `deltalab probe` on the store")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CaptureError("--device cuda but no CUDA GPU is visible; use --device cpu")
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
    data = data if isinstance(data, Data) else load_data(data, checkpoint)  # bad data fails before the model loads
    if model is None:
        from deltalab.models import load_checkpoint

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if model_dtype not in dtypes:
            raise CaptureError(f"--model-dtype {model_dtype!r} is not supported; use one of {', '.join(dtypes)}")
        model = load_checkpoint(checkpoint, device=device, dtype=dtypes[model_dtype], device_map=device_map,
                                allow_nonfinite=allow_nonfinite)
    cfg = model.config
    rwkv7 = getattr(cfg, "model_type", None) == "rwkv7"  # beta per key channel, and a removal key kappa
    hook_list = list(parse_list(hooks) or schema.DEFAULT_HOOKS)
    if getattr(cfg, "removal", True) is False:  # Mamba-2 (SSD): no removal, so no beta to capture
        defaults = set(schema.DEFAULT_HOOKS) <= set(hook_list)  # the default list (the CLI spells it out): drop beta
        if "beta" in hook_list and not defaults:
            raise CaptureError(f"--hooks beta: {cfg.family}'s Mamba-2 layers have no removal and no beta "
                               "(every write is whole); drop beta")
        hook_list = [h for h in hook_list if h != "beta"]
    if rwkv7 and "beta" in hook_list and "kappa" not in hook_list:  # beta alone does not give the transition
        hook_list.append("kappa")
    layer_list = resolve_layers(layers, cfg.num_hidden_layers, getattr(cfg, "delta_layers", None))
    head_sel = resolve_heads(heads, cfg.num_value_heads, list(cfg.key_head_of) if cfg.grouped else None)
    try:
        variables = schema.variables_for(hook_list, gated=bool(cfg.use_forget_gate), removal_key=rwkv7)
        read = [h for h in reductions.hooks() if h not in hook_list] if reductions is not None else []
        if "beta" in read and getattr(cfg, "removal", True) is False:
            raise ValueError(f"--reduce reads beta, which {cfg.family}'s Mamba-2 layers do not have (no removal): "
                             "drop the reductions that read it (their transitions reduce to the decay exp(g))")
        if rwkv7 and "beta" in read and "kappa" not in hook_list:  # the reductions' transitions need kappa too
            read.append("kappa")
        captured = schema.variables_for(hook_list + read, gated=bool(cfg.use_forget_gate), removal_key=rwkv7)
    except ValueError as err:
        raise CaptureError(str(err)) from None
    if state_every > 1 and "state" not in variables:
        raise CaptureError(f"--state-every {state_every} but no states are captured; drop --state-every "
                           "or add state to --hooks")
    resid = [h for h in hook_list if h.startswith("resid_")]
    if resid and not getattr(cfg, "single_residual", True):
        raise CaptureError(f"--hooks {','.join(resid)}: {cfg.model_type} keeps several residual streams "
                           "(hyper-connections), so it has no resid hooks; drop them")
    data.check_vocab(cfg.vocab_size)

    stored_batch = _store_batch_size(out)
    if batch_size is not None and batch_size < 1:
        raise CaptureError(f"--batch-size must be >= 1, got {batch_size}")
    if stored_batch is not None and batch_size is not None and batch_size != stored_batch:
        raise StoreMismatchError(f"{out} is chunked by {stored_batch} sequences: "
                                 f"pass --batch-size {stored_batch} or omit it")
    batch = stored_batch or batch_size or DEFAULT_BATCH_SIZE

    model_config = cfg.to_dict()
    sizes = {"pos": data.length, "layer": len(layer_list), "head": cfg.num_value_heads, "step": cfg.num_householder,
             "dk": cfg.head_k_dim, "dv": cfg.head_v_dim,
             "chunk": schema.n_chunks(data.length, CHUNK_SIZE * state_every),
             "hidden": cfg.hidden_size}
    if cfg.grouped:  # grouped heads: q, k per key head (schema.dims_of)
        sizes["key_head"] = cfg.num_key_heads
    if head_sel is not None:  # --heads: the head dims hold the chosen heads only
        sizes["head"] = len(head_sel[0])
        if cfg.grouped:
            sizes["key_head"] = len(head_sel[1] or [])
    if getattr(cfg, "gate", "scalar") == "channel":  # Kimi Delta Attention: g [.., head, dk]
        sizes[schema.GATE_CHANNELS] = cfg.head_k_dim
    if rwkv7:
        sizes[schema.BETA_CHANNELS] = cfg.head_k_dim
    attrs = {
        "model_config": model_config,
        "checkpoint_digest": checkpoint_digest(checkpoint), "deltalab_version": deltalab_version(),
        "command_line": list(command_line if command_line is not None else sys.argv),
        "chunk_size": CHUNK_SIZE * state_every,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hooks": hook_list, "variables": variables, "layers": layer_list, "dtype": dtype,
        "batch_size": batch, "sizes": sizes, "data_meta": data.meta, "world_size": world,
    }
    if getattr(model, "nonfinite_tensors", None):  # captured anyway (--allow-nonfinite): the store says so
        attrs["nonfinite_tensors"] = list(model.nonfinite_tensors)
    if "key_head" in sizes:
        attrs["key_head_of"] = list(cfg.key_head_of) if head_sel is None else \
            [int(cfg.key_head_of[j]) for j in head_sel[0]]
    if head_sel is not None:
        attrs["heads"] = head_sel[0]
        if cfg.grouped:
            attrs["key_heads"] = head_sel[1]
    train_length = training_length(checkpoint)
    if train_length is not None:
        attrs["train_length"] = train_length
    attrs["deltalab_format"] = schema.format_version(attrs)  # from the layout above: 1 unless a v1 reader misreads

    if reductions is not None:  # a reduction this model cannot have fails before the store is touched
        try:
            reductions.check(attrs, captured)
        except ValueError as err:
            raise CaptureError(str(err)) from None
    extra = reductions.bytes_per_sequence(attrs, captured) if reductions is not None else 0
    estimate = size_estimate(out, variables, sizes, dtype, len(data), batch, extra)
    check_disk(out, estimate)
    return CapturePlan(checkpoint=checkpoint, out=out, data=data, model=model, device=device, dtype=dtype,
                       batch_size=batch, layers=layer_list, head_sel=head_sel, hooks=hook_list, variables=variables,
                       captured=captured, state_every=state_every, sizes=sizes, attrs=attrs, estimate=estimate,
                       reductions=reductions, progress=progress, rank=rank, world=world)
