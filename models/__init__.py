"""nn.Modules, configs and checkpoint I/O for the DeltaProduct family: what defines and loads a model.

The names below load on first use (PEP 562), so `from deltalab.models import IGNORE_INDEX` or
`import deltalab.models.run_files` does not import torch: the store, probes and dashboard stay quick to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltalab.kernels.constants import IGNORE_INDEX
    from deltalab.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from deltalab.models.config import ConfigError, ModelConfig
    from deltalab.models.hooks import HookPoint
    from deltalab.models.lm import DeltaProductForCausalLM
    from deltalab.models.rwkv7 import RWKV7ForCausalLM

_HOMES = {
    "CheckpointError": "deltalab.models.checkpoint",
    "ConfigError": "deltalab.models.config",
    "DeltaProductForCausalLM": "deltalab.models.lm",
    "HookPoint": "deltalab.models.hooks",
    "IGNORE_INDEX": "deltalab.kernels.constants",
    "ModelConfig": "deltalab.models.config",
    "RWKV7ForCausalLM": "deltalab.models.rwkv7",
    "load_checkpoint": "deltalab.models.checkpoint",
    "save_checkpoint": "deltalab.models.checkpoint",
}
"""Public name -> the module defining it."""

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeltaProductForCausalLM",
    "HookPoint",
    "IGNORE_INDEX",
    "ModelConfig",
    "RWKV7ForCausalLM",
    "load_checkpoint",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
