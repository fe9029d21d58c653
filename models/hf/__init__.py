"""Gated DeltaNet layers inside Hugging Face transformers models, with deltalab's hook points.

    from models.hf import load_hf_checkpoint
    model = load_hf_checkpoint("olmo-hybrid-folder")      # HookedHFModel
    NNsight(model).layers[0].attn.hook_beta               # same names as deltalab's own models

families: supported model types; loader: local folders; route + adapter: the kernel call
replaced by deltalab's hooked forward; hooked: the wrapper exposing `layers.{i}`.
"""

from models.hf.adapter import DeltaRuleHooks, key_head_of
from models.hf.config import HFModelConfig
from models.hf.families import FAMILIES, Family, family_of, supported_types
from models.hf.hooked import HookedHFModel
from models.hf.loader import check_transformers, load_hf_checkpoint

__all__ = [
    "FAMILIES",
    "DeltaRuleHooks",
    "Family",
    "HFModelConfig",
    "HookedHFModel",
    "check_transformers",
    "family_of",
    "key_head_of",
    "load_hf_checkpoint",
    "supported_types",
]
