"""Checkpoint folders (config.json + model.safetensors), fla-compatible, with one-line errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from deltalab.models.config import MODEL_TYPES, ConfigError, ModelConfig, check_fits_memory
from deltalab.models.errors import CheckpointError as CheckpointError  # re-exported: callers import it from here
from deltalab.models.files import check_regular, read_capped
from deltalab.models.lm import DeltaProductForCausalLM
from deltalab.models.rwkv7 import RWKV7ForCausalLM

if TYPE_CHECKING:
    from deltalab.models.hf.hooked import HookedHFModel

WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "pytorch_model.bin"
_PER_STEP = re.compile(r"^(?P<pre>.*\.attn\.)(?P<name>[kvb]_projs|[kv]_conv1ds)\.(?P<j>\d+)\.(?P<rest>weight|bias)$")


def _read_raw_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} is missing: a checkpoint folder needs config.json and {WEIGHTS}")
    data = read_capped(path, what="config.json")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err.msg if hasattr(err, 'msg') else err}): "
                              "restore it from the original checkpoint") from None
    except RecursionError:
        raise CheckpointError(f"{path} nests too deeply to be a config: restore it from the original "
                              "checkpoint") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object: restore it from the original checkpoint")
    return raw


_OLD_RWKV = ("rwkv6", "rwkv5", "rwkv4", "rwkv")
"""fla's and transformers' RWKV model types before RWKV-7."""


def _read_config(folder: Path, raw: dict | None = None) -> ModelConfig:
    path = folder / "config.json"
    raw = _read_raw_config(folder) if raw is None else raw
    if str(raw.get("model_type")) in _OLD_RWKV:
        raise CheckpointError(f"model_type {raw['model_type']!r} in {path} is RWKV-6 or older: deltalab loads RWKV-7 "
                              "only (fla's 'rwkv7' checkpoints); supported: " + ", ".join(MODEL_TYPES))
    if raw.get("model_type") not in MODEL_TYPES:
        from deltalab.models.hf.families import supported_types

        raise CheckpointError(f"unknown model_type {raw.get('model_type')!r} in {path}: no delta-rule layer deltalab "
                              f"opens; supported: {', '.join(MODEL_TYPES)} (fla), {supported_types()} (transformers)")
    try:
        return ModelConfig.from_dict(raw)
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: {err}") from None


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Weight dtypes a checkpoint may store; an integer or boolean tensor is refused, never cast."""


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of `folder/model.safetensors` (safetensors only: pickled weights are refused, not read)."""
    st, legacy = folder / WEIGHTS, folder / LEGACY_WEIGHTS
    if os.path.lexists(st):
        check_regular(st, WEIGHTS)
        try:
            return load_file(str(st))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(
                f"{st} is truncated or corrupt ({str(err).splitlines()[0]}): re-download or re-save it"
            ) from None
    if os.path.lexists(legacy) or any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder} holds pickled weights ({LEGACY_WEIGHTS}) only: deltalab reads safetensors only and never "
            f"unpickles; convert them once where you trust the file, e.g. safetensors.torch.save_file("
            f"torch.load('{LEGACY_WEIGHTS}', weights_only=True), '{WEIGHTS}')")
    raise CheckpointError(f"{folder} has no {WEIGHTS}: save the weights beside config.json")


def check_tensors(state: dict[str, torch.Tensor], folder: Path, allow_nonfinite: bool = False) -> list[str]:
    """Refuse a tensor of a non-float dtype, or one holding NaN/Inf, in one line naming it.

    `allow_nonfinite=True` lets non-finite values through; the names of the tensors holding them are returned
    (empty when all are finite) so that a capture can record them."""
    for name, tensor in state.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{folder}: tensor {name} is stored as {str(tensor.dtype).removeprefix('torch.')}, "
                                  "not a float dtype: deltalab does not cast weights; re-save the checkpoint in "
                                  "float32, float16 or bfloat16")
    bad = []
    for name, tensor in state.items():
        if not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    if bad and not allow_nonfinite:
        first = state[bad[0]]
        n_bad = int((~torch.isfinite(first)).sum())
        raise CheckpointError(f"{folder}: tensor {bad[0]} holds {n_bad} NaN/Inf value(s)"
                              f"{f' (and {len(bad) - 1} more tensor(s))' if bad[1:] else ''}: the checkpoint is "
                              "damaged or diverged; use an earlier checkpoint, or pass --allow-nonfinite to capture "
                              "it anyway")
    return bad


def remap_legacy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fold the DeltaProduct authors' per-step module lists (`k_projs.{j}` ...) into fla's fused tensors."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        m = _PER_STEP.match(name)
        if m is None:
            out[name] = tensor
            continue
        fused = m["pre"] + m["name"].replace("_projs", "_proj").replace("_conv1ds", "_conv1d") + "." + m["rest"]
        groups.setdefault(fused, {})[int(m["j"])] = tensor
    for fused, steps in groups.items():  # fla's fused layout is step-major: (n h d) and (n h)
        out[fused] = torch.cat([steps[j] for j in sorted(steps)], 0)
    return out


_RWKV6_MARKERS = (".attn.x_proj.", ".attn.x_bias", ".attn.bonus", ".attn.gk_proj.", ".attn.r_proj.mu")
"""Tensor names only fla's RWKV-6 layout has (its LerpLinear/DDLerpLinear projections and `bonus`)."""


def remap_rwkv7(state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """fla's rwkv7 layouts: split version 1's stacked `attn.x_x` [6, D] into x_r..x_g (as fla's loader does);
    RWKV-6 or BlinkDL's own `.pth` layouts fail in one line naming what deltalab loads."""
    supported = "deltalab loads fla's rwkv7 checkpoints (RWKV-7, RWKV7ForCausalLM, version 1 or 2 layout)"
    names = list(state)
    if any(n.startswith(("blocks.", "emb.")) for n in names):
        raise CheckpointError(f"{folder}: tensor names like {names[0]!r} are BlinkDL's RWKV-LM layout, not fla's: "
                              f"{supported}; convert it with fla's RWKV-7 conversion script")
    old = sorted(n for n in names if any(m in n for m in _RWKV6_MARKERS))
    if old:
        raise CheckpointError(f"{folder}: tensor {old[0]} is an RWKV-6 (or older) layout: {supported}")
    out = dict(state)
    for name in names:
        if name.endswith(".attn.x_x"):
            stacked = out.pop(name)
            for j, part in enumerate("rwkvag"):
                out[name[: -len("x_x")] + f"x_{part}"] = stacked[j].reshape(1, 1, -1)
    return out


def build_model(config: ModelConfig) -> DeltaProductForCausalLM | RWKV7ForCausalLM:
    """The nn.Module of a config's model type (fresh random weights)."""
    return RWKV7ForCausalLM(config) if config.model_type == "rwkv7" else DeltaProductForCausalLM(config)


def _to_module_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fla's `model.layers...` -> our top-level `layers...` (lm_head stays)."""
    return {name.removeprefix("model."): t for name, t in state.items()}


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    device_map: str | None = None, allow_nonfinite: bool = False,
) -> DeltaProductForCausalLM | RWKV7ForCausalLM | HookedHFModel:
    """Load a checkpoint folder in eval mode: fla's format into a DeltaProductForCausalLM (RWKV7ForCausalLM for
    `rwkv7`), a transformers Gated DeltaNet family (OLMo-Hybrid, Qwen3-Next, Qwen3.5, ...) into a
    models.hf.HookedHFModel. Weights are read from safetensors only; no code of the checkpoint runs.

    Args:
        path: the folder holding config.json and model.safetensors (or a safetensors index and its shards).
        device: where the weights go.
        dtype: the floating-point dtype to run in (None: float32); fla-format models keep their gate
            parameters (A_log, dt_bias) in float32 as fla does.
        device_map: "auto" / "balanced" spreads a transformers model over the visible GPUs (accelerate); fla
            checkpoints take None only.

    Returns:
        The model, in eval mode, with a hook point on every intermediate.

    Raises:
        CheckpointError: one line naming what is missing or malformed and how to fix it.

    Before anything is allocated, config.json is checked field by field (models.config.check_fields) and against
    the memory available; weights must be safetensors of a float dtype, finite unless `allow_nonfinite` (then the
    model's `nonfinite_tensors` attribute lists the tensors holding NaN/Inf).
    """
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"checkpoint folder {folder} does not exist: pass a folder with config.json "
                              f"and {WEIGHTS}")
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is a file, not a checkpoint folder: pass the folder that holds config.json")
    raw = _read_raw_config(folder)
    from deltalab.models.hf.families import family_of

    if raw.get("auto_map") or family_of(str(raw.get("model_type"))) is not None:
        from deltalab.models.hf.loader import load_hf_checkpoint

        return load_hf_checkpoint(folder, raw, device=device, dtype=dtype, device_map=device_map,
                                  allow_nonfinite=allow_nonfinite)
    if device_map is not None:
        raise CheckpointError(f"--device-map applies to transformers models; {folder} is fla-format: "
                              "pass --device instead")
    config = _read_config(folder, raw)
    try:
        check_fits_memory(config, 4 if dtype is None else max(torch.finfo(dtype).bits // 8, 4),
                          where=str(folder / "config.json"))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
    state = _read_weights(folder)
    nonfinite = check_tensors(state, folder, allow_nonfinite)
    state = remap_rwkv7(state, folder) if config.model_type == "rwkv7" else remap_legacy(state)
    state = _to_module_names(state)
    model = build_model(config)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("embeddings.weight"))
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{folder}: missing tensor(s) {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}: the weights do not match config.json")
    if unexpected:
        raise CheckpointError(f"{folder}: unexpected tensor(s) {', '.join(unexpected[:4])}"
                              f"{' ...' if len(unexpected) > 4 else ''}: the weights do not match config.json")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{folder}: tensor {name} has shape {tuple(state[name].shape)}, config.json "
                                  f"implies {tuple(tensor.shape)}: the weights do not match config.json")
    model.load_state_dict(state)
    model.nonfinite_tensors = nonfinite
    model.to(device=device)
    if dtype is not None:
        model.to(dtype=dtype)
        for block in model.layers:  # fla keeps the gate parameters and the plain o_norm in float32
            attn = block.attn
            for name in ("A_log", "dt_bias"):
                if hasattr(attn, name):
                    getattr(attn, name).data = getattr(attn, name).data.float()
    return model.eval()


def save_checkpoint(model: DeltaProductForCausalLM | RWKV7ForCausalLM, path: str | Path,
                    dtype: torch.dtype | None = None) -> Path:
    """Write config.json (fla fields) and model.safetensors (fla names) into `path`, atomically per file.

    Args:
        model: a deltalab model (its state dict is written; a tied lm_head is left out, as fla does).
        path: the folder to write (created if missing).
        dtype: store the floating-point tensors in this dtype (e.g. torch.float16, smaller); loading casts
            them back. None: as they are.

    Returns:
        The folder, as a Path.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        key = name if name.startswith("lm_head.") else f"model.{name}"
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[key] = tensor.contiguous()
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS)
    cfg_tmp = folder / "config.json.tmp"
    cfg_tmp.write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n")
    cfg_tmp.replace(folder / "config.json")
    return folder
