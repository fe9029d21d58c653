"""nn.Modules, configs and checkpoint I/O for the DeltaProduct family: what defines and loads a model."""

from models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from models.config import ConfigError, ModelConfig
from models.hooks import HookPoint
from models.lm import IGNORE_INDEX, DeltaProductForCausalLM

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeltaProductForCausalLM",
    "HookPoint",
    "IGNORE_INDEX",
    "ModelConfig",
    "load_checkpoint",
    "save_checkpoint",
]
