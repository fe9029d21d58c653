"""The deltalab store schema: dimensions, variables, dtypes, chunking and format version.

This module is the contract between capture (writer), probes and the dashboard (readers).
Names and dims here are stable; a change that breaks readers bumps FORMAT_VERSION.

Layout of one store (zarr v3, one group, no consolidated metadata):

    STORE/zarr.json                 root attrs (provenance, see REQUIRED_ATTRS)
    STORE/<var>/...                 captured arrays, named dims (zarr `dimension_names`)
    STORE/<probe var>/...           variables probes add later (store.add_variables)
    STORE/results/<name>/...        result sub-groups probes add later (store.write_results)

Chunking: along `seq` every array is chunked by the capture batch size (`batch_size` attr), so a
batch (and a torchrun rank) owns whole chunks/shards and never shares one with another writer.
Per-layer arrays are zarr v3 sharded: one shard per (sequence batch) holding all layers, with one
inner chunk per (batch, layer). `complete[seq]` is written last for each batch: a sequence is
visible to readers only once its flag is set.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.models import IGNORE_INDEX

FORMAT_VERSION = 3
"""Newest store format this deltalab reads (root attr `deltalab_format`); readers refuse newer ones. Version 2
marked layouts a version-1 reader would misread (a per-channel gate or beta, a subset of heads); version 3 stores
carry a crc32c on every chunk of every captured array (the sharded activations' inner chunks too), and every new
store is written as 3. Versions 1 and 2 still open; `deltalab store verify` says their activations carry no
checksums."""

CHECKSUM_FORMAT = 3
"""First format whose captured activations carry a crc32c per inner chunk (schema.compressors_for)."""

FLOAT_DTYPES = ("float16", "float32")
"""Activation dtypes (numpy has no bfloat16)."""


@dataclass(frozen=True)
class VarSpec:
    """One variable: its dims, storage dtype ("act" = the capture's --dtype) and fill value."""

    dims: tuple[str, ...]
    dtype: str
    fill: object
    doc: str


VARIABLES: dict[str, VarSpec] = {
    "tokens": VarSpec(("seq", "pos"), "int32", 0, "input token ids"),
    "labels": VarSpec(("seq", "pos"), "int32", IGNORE_INDEX,
                      f"target of the prediction at pos ({IGNORE_INDEX} = none)"),
    "doc_start": VarSpec(("seq", "pos"), "bool", False, "True where a document starts (text data)"),
    "pad": VarSpec(("seq", "pos"), "bool", False,
                   "True at padding after a sequence's end: store.open masks every float variable there"),
    "loss": VarSpec(("seq", "pos"), "float32", float("nan"), "per-token cross-entropy (NaN = no label)"),
    "correct": VarSpec(("seq", "pos"), "bool", False, "argmax prediction equals the label"),
    "q": VarSpec(("seq", "layer", "pos", "head", "dk"), "act", float("nan"), "normalised queries"),
    "k": VarSpec(("seq", "layer", "pos", "step", "head", "dk"), "act", float("nan"), "normalised keys"),
    "v": VarSpec(("seq", "layer", "pos", "step", "head", "dv"), "act", float("nan"), "values"),
    "beta": VarSpec(("seq", "layer", "pos", "step", "head"), "act", float("nan"),
                    "betas (after the sigmoid, and the x2 with negative eigenvalues)"),
    "g": VarSpec(("seq", "layer", "pos", "head"), "act", float("nan"), "log forget gate (gated models)"),
    "state": VarSpec(("seq", "layer", "chunk", "head", "dk", "dv"), "act", float("nan"),
                     "state before each chunk of CHUNK_SIZE tokens, plus the final state"),
    "o": VarSpec(("seq", "layer", "pos", "head", "dv"), "act", float("nan"), "recurrence output"),
    "kappa": VarSpec(("seq", "layer", "pos", "step", "head", "dk"), "act", float("nan"),
                     "unit removal key (rwkv7: transition diag(e^g) - (kappa * beta) kappa^T)"),
    "resid_pre": VarSpec(("seq", "layer", "pos", "hidden"), "act", float("nan"), "residual stream in"),
    "resid_mid": VarSpec(("seq", "layer", "pos", "hidden"), "act", float("nan"), "residual after attn"),
    "resid_post": VarSpec(("seq", "layer", "pos", "hidden"), "act", float("nan"), "residual stream out"),
    "complete": VarSpec(("seq",), "bool", False, "sequence fully written (set last)"),
}
"""Every variable capture can write. Probes may add others (never with these names).

Dims: `step` = Householder sub-step, `chunk` = chunk-boundary index (CHUNK_SIZE tokens apart, then the
final state), `hidden` = model width (only the optional residual-stream hooks)."""

HOOKS: dict[str, tuple[str, ...]] = {
    "tokens": ("tokens", "doc_start", "pad"),
    "labels": ("labels",),
    "loss": ("loss", "correct"),
    "q": ("q",),
    "k": ("k",),
    "v": ("v",),
    "beta": ("beta",),
    "g": ("g",),
    "state": ("state",),
    "o": ("o",),
    "kappa": ("kappa",),
    "resid_pre": ("resid_pre",),
    "resid_mid": ("resid_mid",),
    "resid_post": ("resid_post",),
}
"""`--hooks` names -> variables they write."""

DEFAULT_HOOKS = ("tokens", "labels", "loss", "q", "k", "v", "beta", "g", "state")

MODEL_HOOK_POINTS: dict[str, str] = {
    "q": "attn.hook_q",
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "beta": "attn.hook_beta",
    "g": "attn.hook_g",
    "state": "attn.hook_state",
    "o": "attn.hook_o",
    "kappa": "attn.hook_kappa",
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post",
}
"""Per-layer variable -> hook module path below `layers.{i}` (see docs/architecture.md)."""

REQUIRED_ATTRS = (
    "deltalab_format",  # int, FORMAT_VERSION
    "model_config",  # dict: ModelConfig.to_dict() (fla-format) or HFModelConfig.to_dict() (transformers)
    "checkpoint_digest",  # "sha256:<hex>" of the weights (shard by shard when sharded)
    "data_spec",  # str, the first data spec captured (all of them: `segments`)
    "deltalab_version",
    "command_line",  # list[str]
    "chunk_size",  # CHUNK_SIZE
    "created",  # ISO 8601 UTC
    "hooks",  # list[str], --hooks actually captured
    "variables",  # list[str], captured variable names
    "layers",  # list[int], captured layer indices (the `layer` coordinate: the model's real layer numbers)
    "dtype",  # "float16" | "float32"
    "batch_size",  # chunk length along seq
    "sizes",  # {dim: length} except seq
    "segments",  # [{"data_spec": str, "start": int, "count": int}], one per capture command
)
"""Root attributes (JSON data only, never evaluated). Optional: `train_length`; `key_head_of` (list[int], the
key head each value head reads, model numbers) in stores with a `key_head` dim; `heads` (list[int], the captured
value heads, model numbers: the `head` coordinate; absent = all heads) and, grouped, `key_heads` (the captured key
heads, model numbers: the `key_head` coordinate) in stores captured with `--heads`."""


def head_numbers(attrs: dict) -> list[int]:
    """The model's number of each entry along `head` (the `heads` attr; all heads 0..H-1 when absent)."""
    heads = attrs.get("heads")
    return [int(h) for h in heads] if heads is not None else list(range(int(attrs["sizes"]["head"])))


def key_head_positions(attrs: dict) -> list[int]:
    """Per stored value head, the index along the stored `key_head` dim of the key head it reads: `key_head_of`
    (model numbers) mapped through `key_heads` (the captured key heads; all of them when absent)."""
    key_heads = attrs.get("key_heads")
    if key_heads is None:
        return [int(k) for k in attrs["key_head_of"]]
    where = {int(k): i for i, k in enumerate(key_heads)}
    return [where[int(k)] for k in attrs["key_head_of"]]


def n_chunks(length: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Number of chunk-boundary states for a sequence of `length` tokens (starts + final)."""
    return math.ceil(length / chunk_size) + 1


def storage_dtype(var: str, act_dtype: str) -> np.dtype:
    """numpy dtype of `var` when activations are stored as `act_dtype`."""
    if act_dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {act_dtype!r} is not supported; use one of {', '.join(FLOAT_DTYPES)}")
    spec = VARIABLES[var]
    return np.dtype(act_dtype if spec.dtype == "act" else spec.dtype)


KEY_HEAD_VARS = ("q", "k")
"""Variables indexed by key head: with grouped heads (sizes has `key_head`) their `head` dim is `key_head`."""


GATE_CHANNELS = "gate_channels"
"""`sizes` entry (= dk) of stores whose forget gate is per key channel: `g` then has dims (..., head, dk)."""


BETA_CHANNELS = "beta_channels"
"""`sizes` entry (= dk) of stores whose removal strength is per key channel (RWKV-7): `beta` then has dims
(..., step, head, dk), and `kappa` holds the removal key."""


def format_version(attrs: dict) -> int:
    """The store format a capture with these root attrs writes: always CHECKSUM_FORMAT now (every chunk carries a
    crc32c; a deltalab that reads only 1 or 2 refuses it rather than miss a checksum it cannot know of)."""
    del attrs  # the layout no longer decides: checksums are in every new store
    return CHECKSUM_FORMAT


def dims_of(var: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """Dims of `var` in a store of these sizes: q and k use `key_head` when the model groups its heads
    (Hk key heads < Hv value heads; value head j reads key head `key_head_of[j]`, a root attribute)."""
    dims = VARIABLES[var].dims
    if var in KEY_HEAD_VARS and "key_head" in sizes:
        return tuple("key_head" if d == "head" else d for d in dims)
    if var == "g" and sizes.get(GATE_CHANNELS):
        return (*dims, "dk")  # per-channel gate (Kimi Delta Attention): one log decay per key channel
    if var == "beta" and sizes.get(BETA_CHANNELS):
        return (*dims, "dk")  # RWKV-7: one removal strength per key channel
    return dims


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB'."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def bytes_per_sequence(variables: list[str], sizes: dict[str, int], act_dtype: str) -> int:
    """Uncompressed bytes one sequence adds to a store of these variables and sizes (an upper bound of the disk
    use: zarr compresses the integer and boolean variables)."""
    one = {**sizes, "seq": 1}
    return int(sum(int(np.prod(shape_of(v, one))) * storage_dtype(v, act_dtype).itemsize for v in variables))


def shape_of(var: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """Full shape of `var` given dim sizes (must include `seq`)."""
    return tuple(int(sizes[d]) for d in dims_of(var, sizes))


def chunking(var: str, sizes: dict[str, int],
             batch_size: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(inner chunk shape, shard shape or None) of `var`.

    Along seq: `batch_size`. Per-layer arrays: shard = all layers, inner chunk = one layer.
    Every other dim is whole.
    """
    dims = dims_of(var, sizes) if var in VARIABLES else tuple(sizes)
    full = [int(sizes[d]) for d in dims]
    chunk = [max(1, batch_size) if d == "seq" else max(1, n) for d, n in zip(dims, full, strict=True)]
    if "layer" not in dims:
        return tuple(chunk), None
    shard = list(chunk)
    chunk[dims.index("layer")] = 1
    return tuple(chunk), tuple(shard)


def variables_for(hooks: list[str] | tuple[str, ...], *, gated: bool, removal_key: bool = False) -> list[str]:
    """Variables a capture with `hooks` writes (g dropped for ungated models), plus `complete`; `kappa` only
    for models with a separate removal key (`removal_key`, RWKV-7)."""
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown:
        raise ValueError(f"unknown hook(s) {', '.join(unknown)}; choose from {', '.join(HOOKS)}")
    if "kappa" in hooks and not removal_key:
        raise ValueError("--hooks kappa: only rwkv7 models have a removal key separate from k; drop kappa")
    out: list[str] = []
    for h in hooks:
        if h == "g" and not gated:
            continue
        for var in HOOKS[h]:
            if var not in out:
                out.append(var)
    return [*out, "complete"]


def compressors_for(var: str) -> list | None:
    """Codecs of `var`: activations compress ~1.09x (not worth the CPU), so they are stored raw with a crc32c per
    inner chunk (sharded: the shard index has its own crc32c too); `loss` raw too, with a crc32c; token/label/flag
    arrays compress >10x with zstd level 1, then a crc32c. Every chunk is checked on read (store.verify)."""
    if var in VARIABLES and VARIABLES[var].dtype in ("act", "float32"):
        from zarr.codecs import Crc32cCodec

        return [Crc32cCodec()]
    return checked_compressors(level=1)


def checked_compressors(level: int = 0) -> list:
    """zstd (`level` 0: zstd's default, as zarr's) then a crc32c of its bytes: a corrupt chunk that still decodes
    fails its checksum instead of reading wrong numbers (arrays written before this have zstd only and still read)."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return [ZstdCodec(level=level), Crc32cCodec()]


def checksummed(ds: Any, level: int = 0) -> Any:
    """A copy of xarray Dataset `ds` whose arrays (coordinates too) `to_zarr` writes with `checked_compressors`;
    arrays that already exist (an append) keep their own codecs."""
    ds = ds.copy()
    for v in ds.variables.values():
        v.encoding = {**v.encoding, "compressors": checked_compressors(level)}
    return ds


# --- the schema of the root attributes ----------------------------------------------------------

MAX_COUNT = 1 << 40
"""Largest sequence count, start or dim size a store attribute may hold (past it: damaged or hostile metadata)."""
_VAR_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
"""A variable name: it becomes a folder inside the store, so no '/', '..' or leading dot."""


def _is_int(value: Any, low: int = 0, high: int = MAX_COUNT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_int_list(value: Any, high: int = MAX_COUNT) -> bool:
    return isinstance(value, list) and all(_is_int(v, 0, high) for v in value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


_MODEL_SIZES = {"vocab_size": 1 << 24, "num_hidden_layers": 4096, "num_heads": 4096, "hidden_size": 1 << 17,
                "num_key_heads": 4096, "head_k_dim": 1 << 14, "head_v_dim": 1 << 14}
"""model_config sizes the dashboard and probes allocate by (a vocabulary's token names, per-layer tables)."""

_ATTR_RULES: dict[str, tuple[Any, str]] = {
    "model_config": (lambda v: isinstance(v, dict) and all(
        v.get(k) is None or _is_int(v.get(k), 1, high) for k, high in _MODEL_SIZES.items()),
        f"a JSON object with integer sizes (vocab_size 1..{1 << 24}, num_hidden_layers 1..4096, num_heads "
        "1..4096, ...)"),
    "checkpoint_digest": (lambda v: isinstance(v, str), "a string"),
    "data_spec": (lambda v: isinstance(v, str), "a string"),
    "deltalab_version": (lambda v: isinstance(v, str), "a string"),
    "created": (lambda v: isinstance(v, str), "a string"),
    "command_line": (_is_str_list, "a list of strings"),
    "chunk_size": (lambda v: _is_int(v, 1, 1 << 20), f"an integer 1..{1 << 20}"),
    "batch_size": (lambda v: _is_int(v, 1, 1 << 20), f"an integer 1..{1 << 20}"),
    "hooks": (_is_str_list, "a list of strings"),
    "variables": (lambda v: isinstance(v, list) and all(isinstance(n, str) and _VAR_NAME.fullmatch(n) for n in v),
                  "a list of variable names (letters, digits, _)"),
    "layers": (lambda v: _is_int_list(v, 1 << 16), "a list of layer numbers"),
    "dtype": (lambda v: v in FLOAT_DTYPES, " or ".join(FLOAT_DTYPES)),
    "sizes": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_int(n) for k, n in v.items()),
              f"an object of dim sizes (integers 0..{MAX_COUNT})"),
    "segments": (lambda v: isinstance(v, list) and bool(v) and all(
        isinstance(s, dict) and isinstance(s.get("data_spec"), str) and _is_int(s.get("start"))
        and _is_int(s.get("count")) for s in v),
        'a list of {"data_spec": string, "start": integer, "count": integer}'),
    "heads": (lambda v: _is_int_list(v, 1 << 16), "a list of head numbers"),
    "key_heads": (lambda v: _is_int_list(v, 1 << 16), "a list of head numbers"),
    "key_head_of": (lambda v: _is_int_list(v, 1 << 16), "a list of head numbers"),
    "train_length": (lambda v: v is None or _is_int(v), "an integer or null"),
    "world_size": (lambda v: _is_int(v, 1, 1 << 20), "a positive integer"),
}
"""Root attribute -> (check, what it must be). Optional attributes are checked when present."""


def attr_problem(attrs: dict[str, Any]) -> str | None:
    """One line naming the first root attribute of the wrong type or range (and what it must be), or None.

    Store metadata is data written by whoever made the store: a string where a number belongs, `sizes: null`,
    a count past any real store or a variable named `../x` is refused here rather than met as a traceback, a
    huge allocation or a path outside the store."""
    for key, (ok, want) in _ATTR_RULES.items():
        if key not in attrs:
            continue
        value = attrs[key]
        if not ok(value):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return f"root attribute {key!r} is {shown} ({type(value).__name__}): it must be {want}"
    return None


def array_problem(var: str, meta: dict[str, Any], attrs: dict[str, Any]) -> str | None:
    """One line when a captured array's zarr metadata disagrees with the root attributes: its dtype (for the
    variables deltalab writes) or its number of dims; None when it agrees."""
    if var not in VARIABLES:
        return None
    sizes = attrs.get("sizes") or {}
    want = storage_dtype(var, attrs["dtype"]).name
    have = meta.get("data_type")
    if have != want:
        return f"variable {var!r} is stored as {have!r}, the store's attributes say {want!r}"
    dims = dims_of(var, sizes)
    shape = meta.get("shape")
    if not isinstance(shape, list) or len(shape) != len(dims) or not all(_is_int(n) for n in shape):
        return f"variable {var!r} has shape {shape!r}, the store's attributes say dims {dims}"
    return None
