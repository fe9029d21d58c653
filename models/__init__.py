"""nn.Modules, configs, checkpoint I/O, tasks and training for the DeltaProduct family."""

from models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from models.config import ConfigError, ModelConfig
from models.hooks import HookPoint
from models.lm import DeltaProductForCausalLM

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeltaProductForCausalLM",
    "HookPoint",
    "ModelConfig",
    "load_checkpoint",
    "save_checkpoint",
]
