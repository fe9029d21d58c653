"""Open a local Hugging Face folder of a supported Gated DeltaNet family with transformers.

Local files only, safetensors only (sharded with an index too), never remote code; every
failure is one CheckpointError line naming the problem and the fix.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from deltalab.models.errors import CheckpointError
from deltalab.models.files import read_capped
from deltalab.models.hf.config import HFModelConfig
from deltalab.models.hf.families import (
    FAMILIES,
    TRANSFORMERS_RANGE,
    TRANSFORMERS_SPEC,
    Family,
    family_of,
    supported_types,
)
from deltalab.models.hf.hooked import HookedHFModel, summary_line

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _error(message: str) -> Exception:
    return CheckpointError(message)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No weight-loading progress bar on stderr (a CLI's errors stay one line)."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def _no_linear(folder: Path, family: Family | None = None) -> Exception:
    kind = family.layer_kind if family is not None else "Gated DeltaNet"
    return _error(f"{folder / 'config.json'} has no linear_attention layer in layer_types: nothing for deltalab "
                  f"to hook; open a checkpoint with {kind} layers")


def _has_linear(layer_types: Any, family: Family) -> bool:
    """Whether `layer_types` names a layer deltalab hooks for `family`."""
    return any(t in family.linear_types for t in (layer_types or []))


def check_transformers(version: str | None = None) -> str:
    """The installed transformers version, or one-line CheckpointError when absent or out of range."""
    if version is None:
        try:
            import transformers
        except ImportError:
            raise _error(f"transformers is not installed: pip install '{TRANSFORMERS_SPEC}'") from None
        version = transformers.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    low, high = TRANSFORMERS_RANGE
    if m is None or not low <= (int(m[1]), int(m[2])) < high:
        raise _error(f"transformers {version} is not supported (deltalab reads {TRANSFORMERS_SPEC}): "
                     f"pip install '{TRANSFORMERS_SPEC}'")
    return version


def check_family_version(family: Family, version: str) -> None:
    """One-line CheckpointError when the installed transformers `version` predates `family`."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if family.since is not None and m is not None and (int(m[1]), int(m[2])) < family.since:
        need = ".".join(map(str, family.since))
        raise _error(f"{family.label} ({family.model_type}) needs transformers >= {need}, found {version}: "
                     f"pip install 'transformers>={need},<6'")


def hf_family(raw: dict[str, Any], folder: Path) -> Family:
    """The Family of a parsed config.json, refusing remote code and unsupported model types."""
    if raw.get("auto_map"):
        raise _error(f"{folder / 'config.json'} needs remote code (auto_map): deltalab never runs "
                     f"trust_remote_code; supported model types: {supported_types()}")
    family = family_of(str(raw.get("model_type")))
    if family is None:
        raise _error(f"unknown model_type {raw.get('model_type')!r} in {folder / 'config.json'}: no delta-rule layer "
                     f"deltalab opens; supported: {supported_types()}")
    return family


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files the folder's weights need; one-line error for a missing shard or none."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(read_capped(index, what=INDEX))["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise _error(f"{index} is not a safetensors index (no weight_map): re-save the model") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise _error(f"{folder} lacks shard {missing[0]}" + (f" (+{len(missing) - 1} more)" if missing[1:] else "")
                         + f" listed in {INDEX}: download every shard into the folder")
        return [folder / s for s in shards]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise _error(f"{folder} holds pickled weights only: deltalab reads safetensors only; "
                     "convert them with save_pretrained(..., safe_serialization=True)")
    raise _error(f"{folder} has no {SINGLE} or {INDEX}: save the weights beside config.json")


def describe(folder: str | Path) -> tuple[HFModelConfig, int, str] | None:
    """(config, parameter count, summary) of a transformers folder without loading its weights (the
    count comes from the safetensors headers); None when the folder is not a supported transformers type."""
    folder = Path(folder)
    try:
        raw = json.loads(read_capped(folder / "config.json", what="config.json"))
    except (OSError, ValueError, RecursionError):  # CheckpointError too: the fla loader names the problem
        return None
    if not isinstance(raw, dict) or not (raw.get("auto_map") or family_of(str(raw.get("model_type")))):
        return None
    family = hf_family(raw, folder)
    check_family_version(family, check_transformers())
    files = weight_files(folder)
    from safetensors import safe_open
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises becomes one line
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [type(err).__name__]
        raise _error(f"transformers cannot read {folder / 'config.json'} ({lines[-1]}): check config.json") from None
    if not _has_linear(getattr(config.get_text_config(), "layer_types", None), family):
        raise _no_linear(folder, family)
    n_params = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                n_params += math.prod(st.get_slice(name).get_shape())
    cfg = HFModelConfig.from_hf(config, family)
    return cfg, n_params, summary_line(cfg, n_params)


def load_hf_checkpoint(folder: str | Path, raw: dict[str, Any] | None = None, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None, device_map: str | None = None,
                       allow_nonfinite: bool = False) -> HookedHFModel:
    """Build the transformers model of `folder` and hook it; eval mode.

    dtype defaults to float32; `device_map="auto"` spreads it over the visible devices (accelerate)
    and ignores `device`. Weights holding NaN/Inf are refused in one line unless `allow_nonfinite` (then the
    hooked model's `nonfinite_tensors` lists them).
    """
    folder = Path(folder)
    if raw is None:
        try:
            raw = json.loads(read_capped(folder / "config.json", what="config.json"))
        except (ValueError, RecursionError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise _error(f"{folder / 'config.json'} is not valid JSON: restore it from the original "
                         "checkpoint") from None
    family = hf_family(raw, folder)
    check_family_version(family, check_transformers())
    weight_files(folder)
    layer_types = raw.get("text_config", raw).get("layer_types")
    if layer_types is not None and not _has_linear(layer_types, family):
        raise _no_linear(folder, family)
    import transformers
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"dtype": dtype or torch.float32}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        if not _has_linear(getattr(config.get_text_config(), "layer_types", None), family):
            raise _no_linear(folder, family)
        with _quiet_transformers():
            model = getattr(transformers, family.auto_class).from_pretrained(
                folder, config=config, local_files_only=True, use_safetensors=True, trust_remote_code=False, **kwargs
            )
    except Exception as err:  # noqa: BLE001 - whatever transformers raises becomes one line
        if isinstance(err, CheckpointError):
            raise
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [type(err).__name__]
        raise _error(f"transformers cannot build {folder} ({lines[-1]}): check config.json and the weights") from None
    nonfinite = _nonfinite(model)
    if nonfinite and not allow_nonfinite:
        raise _error(f"{folder}: tensor {nonfinite[0]} holds NaN/Inf value(s)"
                     f"{f' (and {len(nonfinite) - 1} more tensor(s))' if nonfinite[1:] else ''}: the checkpoint is "
                     "damaged or diverged; use an earlier checkpoint, or pass --allow-nonfinite to capture it anyway")
    if device_map is None:
        model.to(device)
    hooked = HookedHFModel(model.eval(), family).eval()
    hooked.nonfinite_tensors = nonfinite
    return hooked


def _nonfinite(model: torch.nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers holding NaN or Inf (offloaded `meta` ones skipped)."""
    bad = []
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    return bad


__all__ = ["FAMILIES", "check_transformers", "describe", "hf_family", "load_hf_checkpoint", "weight_files"]
